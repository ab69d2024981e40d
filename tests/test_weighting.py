"""Client weighting: ``--weighting=tokens`` weighs each client's upload by
its training tokens (google-research/federated's ``num_tokens``), checked
against a weighted mean written out by hand."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import fedjax_personal as fp
from fedjax_personal.algorithms.fedavg import fedavg, train_tokens
from fedjax_personal.core.data import FederatedData, pad_clients, to_device
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.core.executors import VmapExecutor
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import from_flax

VOCAB, T = 7, 5


class TinyLM(nn.Module):
  """Next token from the token alone: an embedding and a dense layer."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(VOCAB)(nn.Embed(VOCAB, 4)(x))


def _clients():
  """Three clients of token rows: padded positions -1, some PAD (0)
  targets, different row counts and lengths."""
  rng = np.random.default_rng(0)
  xs, ys = [], []
  for n, lengths in ((2, (5, 3)), (4, (1, 2, 5, 4)), (1, (2,))):
    x = rng.integers(1, VOCAB, (n, T)).astype(np.int32)
    # 0: PAD targets, not tokens
    y = rng.integers(0, VOCAB, (n, T)).astype(np.int32)
    for i, l in enumerate(lengths):
      y[i, l:] = -1
    xs.append(x)
    ys.append(y)
  return xs, ys


def _data(xs, ys):
  split = pad_clients(xs, ys, (T,), np.int32, (T,), np.int32)
  empty = pad_clients(
    [x[:0] for x in xs], [y[:0] for y in ys], (T,), np.int32, (T,), np.int32
  )
  return to_device(
    FederatedData(
      train=split,
      val=empty,
      test=split,
      groups=-np.ones(len(xs), np.int32),
      num_classes=VOCAB,
      name='tokens',
    )
  )


def _one_round(data, weighting):
  model = from_flax('tiny_lm', TinyLM(), data.train.x[0, :1])
  alg = fedavg(
    model,
    data.num_clients,
    optax.sgd(0.5),
    fp.Batching(None, num_epochs=1),
    weighting=weighting,
  )
  runner = RoundRunner(
    alg,
    data,
    fp.CohortSampler(data.num_clients, cohort_size=data.num_clients),
    VmapExecutor(),
  )
  state = runner.init(jax.random.key(0))
  start = state.params
  state, _ = runner.round(state, jax.random.key(1))
  return start, state.params


@pytest.mark.slow
def test_tokens_weigh_each_upload_by_its_non_padding_targets():
  xs, ys = _clients()
  tokens = [int(np.sum((y >= 0) & (y != 0))) for y in ys]  # by hand
  data = _data(xs, ys)
  got = [
    float(train_tokens(jax.tree.map(lambda a: a[i], data.train)))
    for i in range(3)
  ]
  assert got == tokens
  start, mean = _one_round(data, 'tokens')
  # Each client's own delta: one full-batch step (no shuffle), alone.
  deltas = []
  for x, y in zip(xs, ys):
    s, p = _one_round(_data([x], [y]), 'num_examples')
    # the same initial model
    jax.tree.map(np.testing.assert_array_equal, s, start)
    deltas.append(
      jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), s, p)
    )
  w = np.asarray(tokens, np.float64) / sum(tokens)
  want = jax.tree.map(
    lambda s, *d: np.asarray(s) - sum(wi * di for wi, di in zip(w, d)),
    start,
    *deltas,
  )
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
    mean,
    want,
  )
  # The same clients weighted by examples give another model.
  _, by_examples = _one_round(data, 'num_examples')
  assert not np.allclose(
    jax.tree.leaves(by_examples)[0], jax.tree.leaves(mean)[0]
  )


def test_tokens_of_one_label_per_example_are_its_examples():
  train = fp.data.ClientData(
    x=np.zeros((4, 3), np.float32),
    y=np.array([0, 3, 0, 9]),
    num_examples=np.int32(3),
  )
  assert float(train_tokens(train)) == 3.0


def test_cfl_refuses_tokens_it_weighs_on_the_server():
  from helpers import digits_data

  from fedjax_personal import algorithms

  data = digits_data(num_clients=4)
  model = fp.create_model('mlp', data.num_classes, data.train.x[0, :1])
  with pytest.raises(ConfigError, match='--weighting: cfl weighs'):
    algorithms.build('cfl', model, data, weighting='tokens')
