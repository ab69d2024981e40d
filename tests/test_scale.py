"""Scale: block-size invariance and a 10,000-client round on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import digits_data, max_diff

import fedjax_personal as fp
from fedjax_personal.algorithms.fedavg import fedavg
from fedjax_personal.core.data import FederatedData, pad_clients, to_device
from fedjax_personal.core.engine import RoundRunner


@pytest.mark.parametrize('block_size', [1, 4, 7])
@pytest.mark.slow_variants('4', '7')
def test_results_do_not_depend_on_block_size(block_size):
  data = digits_data(num_clients=9)
  model = fp.models.from_flax(
    'mlp', fp.models.MLP(10, hidden=(8,)), data.train.x[0, :1]
  )
  alg = fedavg(model, 9, optax.sgd(0.1, momentum=0.9), fp.Batching(16, 1))
  out = {}
  for name, ex in (
    ('vmap', fp.executors.VmapExecutor()),
    ('blocked', fp.executors.BlockedExecutor(block_size)),
  ):
    runner = RoundRunner(alg, data, fp.CohortSampler(9, cohort_size=9), ex)
    state = runner.init(jax.random.key(0))
    for t in range(2):
      state, _ = runner.round(state, jax.random.key(t))
    out[name] = (state.params, runner.evaluate(state, jax.random.key(0)))
  assert max_diff(out['vmap'][0], out['blocked'][0]) < 1e-5
  np.testing.assert_array_equal(
    out['vmap'][1].correct, out['blocked'][1].correct
  )


def synthetic_population(num_clients, n=5, dim=16, seed=0):
  rng = np.random.default_rng(seed)
  xs = [
    rng.normal(size=(n, dim)).astype(np.float32) for _ in range(num_clients)
  ]
  ys = [rng.integers(0, 4, n).astype(np.int32) for _ in range(num_clients)]
  train = pad_clients(xs, ys, (dim,), np.float32)
  return to_device(
    FederatedData(
      train=train,
      val=pad_clients(
        [x[:0] for x in xs], [y[:0] for y in ys], (dim,), np.float32
      ),
      test=train,
      groups=-np.ones(num_clients, np.int32),
      num_classes=4,
    )
  )


def test_ten_thousand_clients_in_one_round():
  data = synthetic_population(10_000)
  model = fp.create_model('logreg', 4, data.train.x[0, :1])
  alg = fedavg(
    model, 10_000, optax.sgd(0.1), fp.Batching(5, num_epochs=None, num_steps=2)
  )
  runner = RoundRunner(
    alg,
    data,
    fp.CohortSampler(10_000, cohort_size=10_000),
    fp.executors.BlockedExecutor(block_size=1000),
  )
  state = runner.init(jax.random.key(0))
  state, metrics = runner.round(state, jax.random.key(0))
  jax.block_until_ready(state)
  assert float(metrics['num_active']) == 10_000
  assert np.isfinite(float(metrics['train_loss']))
  stats = runner.evaluate(state, jax.random.key(0))
  # its time: scripts/benchmark.py --section=scale
  assert stats.correct.shape == (10_000,)


EXECUTORS = {
  'vmap': fp.executors.VmapExecutor,
  'blocked': lambda: fp.executors.BlockedExecutor(3),
  # 7 slots: 3 parts
  'blocked_threads': lambda: fp.executors.BlockedExecutor(2, num_threads=3),
  'sequential': lambda: fp.executors.SequentialExecutor(num_threads=1),
  'sharded': lambda: fp.executors.ShardedExecutor(block_size=2),
}


@pytest.mark.parametrize('executor', sorted(EXECUTORS))
def test_sum_outputs_and_rows_inputs(executor):
  """Every executor sums ``Sum`` outputs over the active slots only (padding
  of blocks and inactive slots excluded) and gathers ``Rows`` inputs."""
  source = {
    'a': jnp.arange(8.0)[:, None] * jnp.ones((8, 2)),
    'b': jnp.arange(8) * 10,
  }
  # 8 = N: a padded slot, gathered clipped
  idx = jnp.array([5, 0, 7, 8, 2, 2, 3])
  active = np.array([True, True, True, False, True, False, True])
  per_client = (fp.tree_util.rows(source, idx), jnp.arange(7.0))

  def fn(shared, c):
    rows, x = c
    return {
      'total': fp.aggregation.Sum((rows['a'] * shared, x)),
      'own': rows['b'],
      'x': x,
    }

  mapped = EXECUTORS[executor]().map
  out = (
    jax.jit(mapped, static_argnums=0)(fn, 2.0, per_client, active)
    if EXECUTORS[executor]().fused
    else mapped(fn, 2.0, per_client, active)
  )
  expect_idx = np.minimum(np.asarray(idx), 7)
  total_a, total_x = out['total'].value
  np.testing.assert_allclose(
    total_a, 2.0 * expect_idx[active].sum() * np.ones(2)
  )
  np.testing.assert_allclose(total_x, np.arange(7.0)[active].sum())
  got = np.asarray(out['own'])
  np.testing.assert_array_equal(got[active], 10 * expect_idx[active])
  np.testing.assert_array_equal(
    np.asarray(out['x'])[active], np.arange(7.0)[active]
  )


def test_tree_scatter_in_chunks_equals_one_scatter():
  x = {'w': jnp.zeros((300, 3))}
  # 300 = N is dropped
  idx = jnp.asarray(np.random.default_rng(0).permutation(301)[:290])
  values = {'w': jnp.arange(290.0)[:, None] * jnp.ones((290, 3))}
  expect = x['w'].at[idx].set(values['w'], mode='drop')
  assert 290 // fp.tree_util.SCATTER_CHUNK >= 2  # the chunked path
  np.testing.assert_array_equal(
    jax.jit(fp.tree_util.tree_scatter)(x, idx, values)['w'], expect
  )


def _ditto_runner(num_clients, block_size, hidden=(64, 64)):
  from fedjax_personal.algorithms.ditto import ditto

  data = synthetic_population(num_clients, n=8, dim=32)
  model = fp.models.from_flax(
    'mlp', fp.models.MLP(4, hidden=hidden), data.train.x[0, :1]
  )
  alg = ditto(
    model,
    num_clients,
    optax.sgd(0.05),
    fp.Batching(4, num_epochs=None, num_steps=2),
    lam=0.1,
  )
  return RoundRunner(
    alg,
    data,
    fp.CohortSampler(num_clients, cohort_size=num_clients),
    fp.executors.BlockedExecutor(block_size),
  ), model


@pytest.mark.slow
def test_donated_round_equals_plain_round():
  runner, _ = _ditto_runner(20, 6)
  a = runner.round(runner.init(jax.random.key(0)), jax.random.key(1))[0]
  b = runner.round(
    runner.init(jax.random.key(0)), jax.random.key(1), donate=True
  )[0]
  assert max_diff(a, b) == 0.0


@pytest.mark.slow
def test_round_memory_is_bounded_by_state_and_one_output():
  """The compiled blocked round of a personalized algorithm (Ditto) needs
  about one cohort's worth of stacked personal outputs besides the state it
  updates in place: no gathered copy of the cohort's state, no stacked
  uploads (they are summed in the block loop), no copy for the scatter.
  FedAvg's round needs only block-sized memory."""
  from fedjax_personal.core.engine import round_functions

  n = 400
  runner, model = _ditto_runner(n, 10)
  state = runner.init(jax.random.key(0))
  fused = round_functions(runner.algorithm, runner.sampler, runner.executor)[3]
  args = (
    state,
    jax.random.key(0),
    jnp.int32(0),
    runner.data.train,
    runner.data.val,
  )
  mem = (
    jax.jit(fused, donate_argnums=0).lower(*args).compile().memory_analysis()
  )
  if mem is None:
    pytest.skip('this backend reports no memory analysis')
  personal = fp.tree_util.tree_bytes(state.personal)
  assert mem.alias_size_in_bytes >= personal  # the state is updated in place
  assert mem.temp_size_in_bytes < 1.35 * personal, (
    mem.temp_size_in_bytes,
    personal,
  )

  alg = fedavg(
    model, n, optax.sgd(0.1), fp.Batching(4, num_epochs=None, num_steps=2)
  )
  fused = round_functions(alg, runner.sampler, runner.executor)[3]
  mem = (
    jax.jit(fused)
    .lower(alg.init(jax.random.key(0)), *args[1:])
    .compile()
    .memory_analysis()
  )
  assert mem.temp_size_in_bytes < 0.1 * personal, (
    mem.temp_size_in_bytes,
    personal,
  )
