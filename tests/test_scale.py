"""Scale: block-size invariance and a 10,000-client round on CPU."""

import time

import jax
import numpy as np
import optax
import pytest

import fedjax_personal as fp
from fedjax_personal.algorithms.fedavg import fedavg
from fedjax_personal.data import FederatedData, pad_clients, to_device
from fedjax_personal.engine import RoundRunner
from helpers import digits_data, max_diff


@pytest.mark.parametrize('block_size', [1, 4, 7])
def test_results_do_not_depend_on_block_size(block_size):
  data = digits_data(num_clients=9)
  model = fp.models.from_flax('mlp', fp.models.MLP(10, hidden=(8,)), data.train.x[0, :1])
  alg = fedavg(model, 9, optax.sgd(0.1, momentum=0.9), fp.Batching(16, 1))
  out = {}
  for name, ex in (('vmap', fp.executors.VmapExecutor()),
                   ('blocked', fp.executors.BlockedExecutor(block_size))):
    runner = RoundRunner(alg, data, fp.CohortSampler(9, cohort_size=9), ex)
    state = runner.init(jax.random.key(0))
    for t in range(2):
      state, _ = runner.round(state, jax.random.key(t))
    out[name] = (state.params, runner.evaluate(state, jax.random.key(0)))
  assert max_diff(out['vmap'][0], out['blocked'][0]) < 1e-5
  np.testing.assert_array_equal(out['vmap'][1].correct, out['blocked'][1].correct)


def synthetic_population(num_clients, n=5, dim=16, seed=0):
  rng = np.random.default_rng(seed)
  xs = [rng.normal(size=(n, dim)).astype(np.float32) for _ in range(num_clients)]
  ys = [rng.integers(0, 4, n).astype(np.int32) for _ in range(num_clients)]
  train = pad_clients(xs, ys, (dim,), np.float32)
  return to_device(FederatedData(train=train, val=pad_clients([x[:0] for x in xs], [y[:0] for y in ys], (dim,), np.float32),
                                 test=train, groups=-np.ones(num_clients, np.int32), num_classes=4))


def test_ten_thousand_clients_in_one_round():
  data = synthetic_population(10_000)
  model = fp.create_model('logreg', 4, data.train.x[0, :1])
  alg = fedavg(model, 10_000, optax.sgd(0.1), fp.Batching(5, num_epochs=None, num_steps=2))
  runner = RoundRunner(alg, data, fp.CohortSampler(10_000, cohort_size=10_000),
                       fp.executors.BlockedExecutor(block_size=1000))
  state = runner.init(jax.random.key(0))
  start = time.perf_counter()
  state, metrics = runner.round(state, jax.random.key(0))
  jax.block_until_ready(state)
  assert float(metrics['num_active']) == 10_000
  assert np.isfinite(float(metrics['train_loss']))
  stats = runner.evaluate(state, jax.random.key(0))
  assert stats.correct.shape == (10_000,)
  assert time.perf_counter() - start < 120
