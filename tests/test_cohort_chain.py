"""A cohort whose clients run in order (``algorithm.CohortChain``), on APPLE:
every executor against a plain loop over the cohort's clients, one after
another, written from APPLE's update rules; the round compiled once."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import digits_data

import fedjax_personal as fp
from fedjax_personal.algorithms import apple
from fedjax_personal.core.engine import RoundRunner

EXECUTORS = {
  'vmap': lambda: fp.executors.VmapExecutor(),
  'blocked': lambda: fp.executors.BlockedExecutor(block_size=2),
  'blocked_threads': lambda: fp.executors.BlockedExecutor(
    block_size=1, num_threads=2
  ),
  'sequential': lambda: fp.executors.SequentialExecutor(num_threads=2),
  'sharded': lambda: fp.executors.ShardedExecutor(),
}
N, COHORT, EPOCHS, LR, MU, DECAY = 5, 3, 2, 0.05, 0.5, 2


@pytest.fixture(scope='module')
def digits():
  return digits_data(num_clients=N, max_examples=40)


def _model(data):
  return fp.models.from_flax(
    'mlp', fp.models.MLP(data.num_classes, hidden=(8,)), data.train.x[0, :1]
  )


def _loss(model, params, x, y):
  logits = model.apply(params, x)
  return -jnp.mean(
    jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1)
  )


def reference_rounds(model, data, cores, ps, p0, cohorts, dr_lr):
  """APPLE by a plain loop: the cohort's clients one after another, each
  from the cores the clients before it trained this round, full-batch
  steps."""
  cores = [jax.tree.map(np.asarray, c) for c in cores]
  ps = np.array(ps, np.float64)
  grad = jax.jit(jax.grad(lambda p, x, y: _loss(model, p, x, y)))
  for r, cohort in enumerate(cohorts):
    lamda = (
      1.0
      if r == 0
      else (
        (math.cos((r - 1) * math.pi / DECAY) + 1) / 2 if r - 1 < DECAY else 0.0
      )
    )
    chain = list(cores)
    new_cores = list(cores)
    for i in cohort:
      n = int(data.train.num_examples[i])
      x, y = data.train.x[i, :n], data.train.y[i, :n]
      own, p, last = chain[i], ps[i].copy(), chain[i]
      for _ in range(EPOCHS):
        models = [own if j == i else chain[j] for j in range(N)]
        w = jax.tree.map(lambda *m: sum(p[j] * m[j] for j in range(N)), *models)
        g = grad(w, x, y)
        own = jax.tree.map(lambda o, gg: o - LR * N * p[i] * gg, own, g)
        models[i] = own
        dp = np.zeros(N)
        for j in range(N):
          pairs = zip(jax.tree.leaves(g), jax.tree.leaves(models[j]))
          means = [float(np.mean(gg * m)) for gg, m in pairs]
          dp[j] = sum(means) / len(means)
        p = p - dr_lr * (dp + lamda * MU * (p - p0))
        last = w
      chain[i] = own
      new_cores[i] = last
      ps[i] = p
    cores = new_cores
  return cores, ps


@pytest.mark.parametrize('executor', sorted(EXECUTORS))
# 0: PFLlib's default, the vectors fixed (the others' mixture read once)
@pytest.mark.parametrize('dr_lr', [2.0, 0.0])
@pytest.mark.ci_variants('2.0-vmap', '2.0-sequential', '0.0-blocked_threads')
def test_chained_cohort_matches_a_plain_loop_over_its_clients(
  digits, executor, dr_lr
):
  model = _model(digits)
  counts = np.asarray(digits.train.num_examples, np.float64)
  alg = apple.apple(
    model,
    N,
    LR,
    fp.Batching(batch_size=64, num_epochs=EPOCHS),
    counts / counts.sum(),
    dr_lr=dr_lr,
    mu=MU,
    decay_rounds=DECAY,
  )
  sampler = fp.CohortSampler(N, cohort_size=COHORT)
  runner = RoundRunner(alg, digits, sampler, EXECUTORS[executor]())
  state = runner.init(jax.random.key(0))
  start = (
    [jax.tree.map(lambda a: a[i], state.cores) for i in range(N)],
    np.asarray(state.ps),
    np.asarray(state.p0, np.float64),
  )
  cohorts = []
  for t in range(3):
    key = jax.random.key(10 + t)
    cohorts.append(list(np.asarray(sampler(jax.random.split(key)[0]).idx)))
    state, metrics = runner.round(state, key, t)
  assert sorted(cohorts[0]) != cohorts[0] or sorted(cohorts[1]) != cohorts[1]
  want_cores, want_ps = reference_rounds(model, digits, *start, cohorts, dr_lr)
  for i in range(N):
    chex.assert_trees_all_close(
      jax.tree.map(lambda a: a[i], state.cores), want_cores[i], atol=2e-5
    )
  np.testing.assert_allclose(np.asarray(state.ps), want_ps, atol=1e-5)
  assert float(metrics['num_active']) == COHORT


def test_clients_in_order_read_what_the_ones_before_wrote(digits):
  """The same round without the chain's writes (every client reads the
  cores as the last round left them) gives other cores: the order matters."""
  model = _model(digits)
  shares = np.full(N, 1.0 / N)
  alg = apple.apple(model, N, LR, fp.Batching(64, EPOCHS), shares)
  unchained = alg.replace(
    cohort_chain=alg.cohort_chain.__class__(
      start=alg.cohort_chain.start, write=lambda cores, i, out: cores
    )
  )
  out = []
  for a in (alg, unchained):
    runner = RoundRunner(
      a, digits, fp.CohortSampler(N, cohort_size=N), fp.executors.VmapExecutor()
    )
    state = runner.init(jax.random.key(0))
    for t in range(2):
      state, _ = runner.round(state, jax.random.key(t), t)
    out.append(state.cores)
  diff = max(
    float(np.max(np.abs(a - b)))
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1]))
  )
  assert diff > 1e-4


@pytest.mark.parametrize('executor', ['vmap', 'sequential'])
def test_chained_round_compiles_once(digits, executor):
  chex.clear_trace_counter()
  model = _model(digits)
  alg = apple.apple(model, N, LR, fp.Batching(16, 1), np.full(N, 1.0 / N))
  alg = alg.replace(
    server_update=chex.assert_max_traces(alg.server_update, n=1),
  )
  runner = RoundRunner(
    alg, digits, fp.CohortSampler(N, cohort_size=COHORT), EXECUTORS[executor]()
  )
  state = runner.init(jax.random.key(0))
  for t in range(3):
    state, _ = runner.round(state, jax.random.key(t), t)
  counts = dict(runner.trace_counts)
  if EXECUTORS[executor]().fused:
    assert counts['round'] == 1, counts
  else:  # the server's steps and the chained clients, each compiled once
    assert counts['pre'] == 1 and counts['post'] == 1, counts
    assert counts['client'] == 1, counts


def test_lamda_follows_pfllibs_schedule():
  """PFLlib's client sets lamda after training round R to (cos(R pi / L) +
  1) / 2 while R < L, else 0, starting at 1."""
  for decay in (0, 1, 3):
    lamda, want = 1.0, []
    for r in range(6):
      want.append(lamda)
      lamda = (math.cos(r * math.pi / decay) + 1) / 2 if r < decay else 0.0
    got = [float(apple.lamda_of_round(r, decay)) for r in range(6)]
    np.testing.assert_allclose(got, want, atol=1e-6)
