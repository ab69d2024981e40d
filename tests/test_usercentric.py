"""User-centric aggregation, streams and the time model."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import digits_data, max_diff
from helpers import run_rounds as rounds

import fedjax_personal as fp
from fedjax_personal.algorithms import usercentric as uc
from fedjax_personal.algorithms.fedavg import fedavg
from fedjax_personal.algorithms.local import local
from fedjax_personal.core.algorithm import RoundContext
from fedjax_personal.core.engine import RoundRunner, pre_round_functions
from fedjax_personal.core.tree_util import tree_bytes
from fedjax_personal.run.experiment import communication_metrics, run
from fedjax_personal.run.timing import TimeModel, harmonic, simulated_times


@pytest.fixture(scope='module')
def digits():
  return digits_data(num_clients=5)


def mlp(data):
  return fp.models.from_flax(
    'mlp', fp.models.MLP(10, hidden=(8,)), data.train.x[0, :1]
  )


def with_matrix(alg, w):
  """The algorithm with a fixed stream matrix W (one stream per client)."""
  n = w.shape[0]
  base_init = alg.init

  def init(key):
    s = base_init(key)
    return s.replace(
      stream_matrix=jnp.asarray(w, jnp.float32),
      assignment=jnp.arange(n, dtype=jnp.int32),
      num_streams=jnp.asarray(n, jnp.int32),
    )

  return alg.replace(init=init, pre_round=None)


@pytest.mark.slow
def test_identity_mixing_is_local_and_fedavg_rows_are_fedavg(digits):
  model = mlp(digits)
  batching = fp.Batching(16, 1)
  n = np.asarray(digits.train.num_examples)
  alg = uc.usercentric(model, 5, n, optax.sgd(0.1), batching, num_streams=5)
  _, s_id = rounds(with_matrix(alg, np.eye(5)), digits)
  _, s_loc = rounds(local(model, 5, optax.sgd(0.1), batching), digits)
  assert max_diff(s_id.personal, s_loc.personal_params) < 1e-5
  _, s_avg = rounds(with_matrix(alg, uc.fedavg_matrix(n)), digits)
  _, s_fedavg = rounds(fedavg(model, 5, optax.sgd(0.1), batching), digits)
  for i in range(5):
    assert (
      max_diff(jax.tree.map(lambda a: a[i], s_avg.personal), s_fedavg.params)
      < 1e-5
    )


def test_mixing_weights_match_eq6_by_hand():
  grads = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
  sigma2 = np.array([1.0, 4.0, 0.25])
  n = np.array([10.0, 20.0, 5.0])
  w = np.asarray(uc.mixing_matrix(grads, sigma2, n))
  s = np.sqrt(sigma2)
  expect = np.zeros((3, 3))
  for i in range(3):
    for j in range(3):
      d = np.sum((grads[i] - grads[j]) ** 2)
      expect[i, j] = n[j] / n[i] * np.exp(-d / (2 * s[i] * s[j]))
    expect[i] /= expect[i].sum()
  np.testing.assert_allclose(w, expect, rtol=1e-5)
  # Far apart clients: W is the identity (log space: no NaN).
  w = np.asarray(
    uc.mixing_matrix(
      np.array([[0.0], [1e3]]), np.array([1e-6, 1e-6]), np.array([1, 1])
    )
  )
  np.testing.assert_allclose(w, np.eye(2), atol=1e-6)
  assert uc.effective_neighbours(np.eye(3)).tolist() == [1, 1, 1]
  np.testing.assert_allclose(uc.effective_neighbours(np.full((4, 4), 0.25)), 4)


@pytest.mark.slow
def test_streams_m_equal_n_gives_w_and_one_gives_one_model():
  rng = np.random.default_rng(0)
  w = rng.random((6, 6))
  w /= w.sum(1, keepdims=True)
  key = jax.random.key(0)
  c, a, k = uc.streams(key, w, 6, 5)
  np.testing.assert_allclose(np.asarray(c)[np.asarray(a)], w, rtol=1e-6)
  c, a, k = uc.streams(key, w, 1, 5)
  assert int(k) == 1 and set(np.asarray(a).tolist()) == {0}
  np.testing.assert_allclose(c[0], w.mean(0), rtol=1e-6)
  assert c.shape == (1, 6)
  c, a, k = uc.streams(key, w, 2, 5)
  assert c.shape == (2, 6) and int(k) == 2
  # Two clear groups of rows: the silhouette picks 2 streams.
  w2 = (
    np.array([[0.5, 0.5, 0, 0]] * 2 + [[0, 0, 0.5, 0.5]] * 2)
    + rng.random((4, 4)) * 1e-3
  )
  c, a, k = uc.streams(key, w2, None, 3)
  a = np.asarray(a)
  assert int(k) == 2 and a[0] == a[1] != a[2] == a[3]
  # padded to the search bound
  assert c.shape == (3, 4) and np.all(np.asarray(c)[2] == 0)
  # Identical rows: one stream.
  _, a, k = uc.streams(key, np.tile(w[:1], (6, 1)), None, 5)
  assert int(k) == 1 and not np.asarray(a).any()


def test_in_group_share_by_hand():
  groups = np.array([0, 0, 1, 1])
  # 0.25 / 0.75
  w = np.array(
    [
      [0.5, 0.3, 0.2, 0.0],  # off-diagonal 0.5, in group 0.3 -> 0.6
      [0.0, 1.0, 0.0, 0.0],  # no off-diagonal weight -> 0
      [0.1, 0.1, 0.4, 0.4],  # 0.4 / 0.6
      [0.25, 0.25, 0.25, 0.25],
    ],
    np.float32,
  )
  want = np.mean([0.6, 0.0, 0.4 / 0.6, 0.25 / 0.75])
  assert float(jax.jit(uc.in_group_share)(w, groups)) == pytest.approx(
    want, rel=1e-6
  )
  assert uc.in_group_chance(groups) == pytest.approx(1 / 3)


@pytest.mark.slow
def test_collaboration_round_and_streams_in_a_run(digits):
  model = mlp(digits)
  n = np.asarray(digits.train.num_examples)
  alg = uc.usercentric(
    model,
    5,
    n,
    optax.sgd(0.1),
    fp.Batching(16, 1),
    num_streams=2,
    sigma_batch_size=16,
    groups=np.array([0, 0, 1, 1, 1]),
  )
  runner = RoundRunner(
    alg, digits, fp.CohortSampler(5, cohort_size=5), fp.executors.VmapExecutor()
  )
  state, history = run(runner, 3, eval_every=3)
  first = history[0]
  assert first['num_streams'] == 2 and 'streams_ari' in first
  assert 1 <= first['w_effective_neighbours_mean'] <= 5
  assert 0 <= first['w_in_group_share'] <= 1
  assert first['w_in_group_chance'] == pytest.approx(
    (2 * 1 / 4 + 3 * 2 / 4) / 5
  )
  models = {
    tuple(np.asarray(state.personal['output']['bias'][i]).round(6))
    for i in range(5)
  }
  assert len(models) == 2  # only m_t distinct models
  comm = communication_metrics(runner, state, 5.0)
  b = tree_bytes(jax.tree.map(lambda a: a[0], state.personal))
  assert (
    comm['bytes_down_broadcast'] == 2 * b
    and comm['bytes_down_unicast'] == 5 * b
  )
  fed = fedavg(model, 5, optax.sgd(0.1), fp.Batching(16, 1))
  r2 = RoundRunner(
    fed, digits, fp.CohortSampler(5, cohort_size=5), fp.executors.VmapExecutor()
  )
  assert (
    communication_metrics(r2, r2.init(jax.random.key(0)), 5.0)[
      'bytes_down_broadcast'
    ]
    == b
  )


def test_time_model():
  assert harmonic(1) == 1 and abs(harmonic(3) - 11 / 6) < 1e-12
  tm = TimeModel(rho=4, t_min=1, inv_mu=1)
  assert tm.computing_time(3) == pytest.approx(1 + 11 / 6)
  assert tm.round_time(3, 1) == pytest.approx(1 + 1 + 11 / 6 + 4)
  hist = [{'num_active': 3, 'bytes_up': 1.0}] * 2
  np.testing.assert_allclose(
    simulated_times(hist, TimeModel(2, 1, 0), 3), [6, 12]
  )


def test_mixing_matrix_is_float32_stable_for_large_nearly_equal_gradients():
  """|g| = 100 with a spread of 0.01: W in float32 matches float64 to 1e-5
  (|g_i|^2 + |g_j|^2 - 2 g_i.g_j on raw gradients cancels catastrophically)."""
  rng = np.random.default_rng(0)
  n_clients, dim = 8, 50
  base = rng.normal(size=dim)
  base *= 100 / np.linalg.norm(base)
  grads = (base + 0.01 * rng.normal(size=(n_clients, dim))).astype(np.float32)
  g64 = grads.astype(np.float64)
  d = np.sum((g64[:, None] - g64[None]) ** 2, -1)
  sigma2 = np.full(n_clients, np.median(d[d > 0]), np.float32)
  n = rng.integers(20, 60, n_clients).astype(np.float32)
  s = np.sqrt(sigma2.astype(np.float64))
  logits = np.log(n.astype(np.float64))[None] - d / (2 * s[:, None] * s[None])
  expect = np.exp(logits - logits.max(1, keepdims=True))
  expect /= expect.sum(1, keepdims=True)
  w = np.asarray(uc.mixing_matrix(grads, sigma2, n))
  np.testing.assert_allclose(w, expect, atol=1e-5)
  # a real mixing, not I
  assert 1.5 < uc.effective_neighbours(expect).mean() < n_clients


def collaboration(alg, data, state, key):
  """The collaboration round alone (the algorithm's PreRound, as the
  engine runs it inside the compiled round)."""
  _, _, run, _ = pre_round_functions(alg, fp.executors.VmapExecutor())
  rc = RoundContext(round=jnp.asarray(0, jnp.int32), key=key)
  return jax.jit(run)(state, rc, data.train, data.val)


def test_sigma_batches_and_kmeans_follow_the_round_key(digits):
  """The collaboration round draws from the key it is given (derived from
  the experiment's seed): the same key gives the same W, another key another."""
  model = mlp(digits)
  n = np.asarray(digits.train.num_examples)
  alg = uc.usercentric(
    model,
    5,
    n,
    optax.sgd(0.1),
    fp.Batching(16, 1),
    num_streams=5,
    sigma_batch_size=8,
  )
  state = jax.jit(alg.init)(jax.random.key(0))
  a, _ = collaboration(alg, digits, state, jax.random.key(1))
  b, _ = collaboration(alg, digits, state, jax.random.key(1))
  c, _ = collaboration(alg, digits, state, jax.random.key(2))
  np.testing.assert_array_equal(a.stream_matrix, b.stream_matrix)
  assert not np.allclose(a.stream_matrix, c.stream_matrix)


@pytest.mark.slow
def test_collaboration_round_is_inside_the_one_compiled_round(digits):
  """W, k-means and the silhouette run inside the round when due (rounds 1
  and 3 here), the round compiling once on the fused executors; the
  sequential executor (phase dispatched from Python) gives the same W."""
  model = mlp(digits)
  n = np.asarray(digits.train.num_examples)
  alg = uc.usercentric(
    model,
    5,
    n,
    optax.sgd(0.1),
    fp.Batching(16, 1),
    num_streams=2,
    sigma_batch_size=8,
    recompute_every=2,
  )
  out = {}
  for name, ex in (
    ('vmap', fp.executors.VmapExecutor()),
    ('blocked', fp.executors.BlockedExecutor(block_size=2)),
    (
      'blocked_threads',
      fp.executors.BlockedExecutor(block_size=2, num_threads=2),
    ),
    ('sequential', fp.executors.SequentialExecutor(num_threads=1)),
  ):
    runner = RoundRunner(alg, digits, fp.CohortSampler(5, cohort_size=5), ex)
    state, history = run(runner, 3, eval_every=3)
    assert [r['round'] for r in history if r.get('pre_round_ran')] == [1, 3], (
      name
    )
    assert all(
      'w_effective_neighbours_mean' in r
      for r in history
      if r.get('pre_round_ran')
    )
    if ex.fused:
      assert runner.trace_counts['round'] == 1, (name, runner.trace_counts)
    out[name] = state
  for name in ('blocked', 'blocked_threads', 'sequential'):
    np.testing.assert_allclose(
      out[name].stream_matrix, out['vmap'].stream_matrix, atol=1e-5
    )
    assert max_diff(out[name].personal, out['vmap'].personal) < 1e-4, name
