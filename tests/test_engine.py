"""The round engine against plain per-client loops and hand-derived results."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
  digits_data,
  least_squares_data,
  linear_model,
  reference_fedavg,
  reference_sgd,
)

import fedjax_personal as fp
from fedjax_personal.algorithms.fedavg import fedavg
from fedjax_personal.algorithms.fedprox import fedprox
from fedjax_personal.algorithms.fedsgd import fedsgd
from fedjax_personal.algorithms.local import local
from fedjax_personal.algorithms.oracle import oracle
from fedjax_personal.core import aggregation
from fedjax_personal.core.data import to_device
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.core.tree_util import tree_bytes
from fedjax_personal.run.experiment import communication_metrics, run

EXECUTORS = {
  'vmap': lambda: fp.executors.VmapExecutor(),
  'blocked': lambda: fp.executors.BlockedExecutor(block_size=3),
  # CPU `auto` for dense models: the blocked loop on 2 host threads (not fused).
  'blocked_threads': lambda: fp.executors.BlockedExecutor(
    block_size=1, num_threads=2
  ),
  'sequential': lambda: fp.executors.SequentialExecutor(num_threads=2),
}


@pytest.fixture(scope='module')
def digits():
  return digits_data(num_clients=6)


def small_mlp(data):
  return fp.models.from_flax(
    'mlp', fp.models.MLP(data.num_classes, hidden=(16,)), data.train.x[0, :1]
  )


def cohort_of(sampler, round_key):
  k_cohort, k_clients = jax.random.split(round_key)
  cohort = sampler(k_cohort)
  return np.asarray(cohort.idx), np.asarray(cohort.mask), k_clients


def reference_fedavg_round(
  model, params, data, idx, mask, k_clients, batching, lr, prox_mu=0.0
):
  """FedAvg by a plain loop: each cohort client alone, then the n_i-weighted
  mean."""
  return reference_fedavg(
    model,
    params,
    data,
    [i for i, m in zip(idx, mask) if m],
    k_clients,
    batching,
    lr,
    prox_mu=prox_mu,
  )


@pytest.mark.parametrize('executor', sorted(EXECUTORS))
@pytest.mark.parametrize('algorithm', ['fedavg', 'fedprox'])
@pytest.mark.ci_variants('fedavg-vmap', 'fedprox-vmap')
def test_round_matches_plain_per_client_loop(digits, executor, algorithm):
  model = small_mlp(digits)
  batching = fp.Batching(batch_size=16, num_epochs=1)
  lr, mu = 0.1, 0.5
  if algorithm == 'fedavg':
    alg = fedavg(model, 6, optax.sgd(lr), batching)
  else:
    alg = fedprox(model, 6, optax.sgd(lr), batching, mu=mu)
  sampler = fp.CohortSampler(6, cohort_size=4)
  runner = RoundRunner(alg, digits, sampler, EXECUTORS[executor]())
  state = runner.init(jax.random.key(0))
  params = state.params
  for t in range(2):
    key = jax.random.key(100 + t)
    idx, mask, k_clients = cohort_of(sampler, key)
    expected = reference_fedavg_round(
      model,
      params,
      digits,
      idx,
      mask,
      k_clients,
      batching,
      lr,
      prox_mu=mu if algorithm == 'fedprox' else 0.0,
    )
    state, metrics = runner.round(state, key)
    chex.assert_trees_all_close(state.params, expected, atol=1e-5)
    params = state.params
    assert float(metrics['num_active']) == 4


# Heavy-tailed client sizes, as federated EMNIST's writers (24 to 1,067
# examples) or Stack Overflow's users: most clients small, a few large.
HEAVY_SIZES = (2, 5, 3, 160, 9, 1, 40, 7, 4, 75, 12, 6)


@pytest.mark.parametrize(
  'executor',
  [
    pytest.param(
      e,
      marks=()
      if e in ('vmap', 'blocked_threads', 'sequential')
      else (pytest.mark.slow,),
    )
    for e in sorted(EXECUTORS)
  ],
)
@pytest.mark.parametrize(
  'participation', [pytest.param(None, marks=pytest.mark.slow), 0.5]
)
@pytest.mark.slow_variants('0.5-blocked_threads', '0.5-sequential', '0.5-vmap')
def test_heavy_tailed_cohort_matches_plain_per_client_loop(
  executor, participation
):
  """Clients sorted into blocks by work, each block stepping only as long
  as its longest client (and idle cohort slots never run) still give each
  client exactly its own SGD: FedAvg equals the plain loop, and Local's
  personal models (stacked outputs written back at their cohort rows) equal
  each client trained alone."""
  from fedjax_personal.algorithms.local import local

  data, _, _ = least_squares_data(
    num_clients=len(HEAVY_SIZES), dim=3, sizes=HEAVY_SIZES, shift=0.1
  )
  data = to_device(data)
  model = linear_model(3)
  batching = fp.Batching(batch_size=4, num_epochs=1)
  n = len(HEAVY_SIZES)
  sampler = (
    fp.CohortSampler(n, participation=participation)
    if participation
    else fp.CohortSampler(n, cohort_size=9)
  )
  runner = RoundRunner(
    fedavg(model, n, optax.sgd(0.05), batching),
    data,
    sampler,
    EXECUTORS[executor](),
  )
  state = runner.init(jax.random.key(0))
  for t in range(2):
    key = jax.random.key(200 + t)
    idx, mask, k_clients = cohort_of(sampler, key)
    expected = reference_fedavg_round(
      model, state.params, data, idx, mask, k_clients, batching, 0.05
    )
    state, _ = runner.round(state, key)
    chex.assert_trees_all_close(state.params, expected, atol=1e-5)

  alg = local(model, n, optax.sgd(0.05), batching)
  runner = RoundRunner(alg, data, sampler, EXECUTORS[executor]())
  state = runner.init(jax.random.key(0))
  start = jax.tree.map(np.asarray, state.personal_params)
  key = jax.random.key(300)
  idx, mask, k_clients = cohort_of(sampler, key)
  state, _ = runner.round(state, key)
  for i, m in zip(idx, mask):
    if not m:
      continue
    p0 = jax.tree.map(lambda a: a[i], start)
    want = reference_sgd(
      model,
      p0,
      data.train.x[i],
      data.train.y[i],
      int(data.train.num_examples[i]),
      jax.random.fold_in(k_clients, int(i)),
      batching,
      0.05,
    )
    got = jax.tree.map(lambda a: a[i], state.personal_params)
    chex.assert_trees_all_close(got, want, atol=1e-5)


def test_work_layout_blocks_clients_by_work():
  """Blocks hold clients of neighbouring step counts; a block runs its
  longest client's steps; inactive slots are never in a block; with two
  parts, the blocks are shared out longest first to the part with the least
  work (both finish near half the total)."""
  steps = np.array([3, 40, 1, 7, 0, 12, 2, 9])
  active = np.array([1, 1, 1, 1, 1, 1, 0, 1], bool)
  pos, ok, limit, count = fp.executors.client_blocks(steps, active, 2)
  assert count.tolist() == [4]
  # longest first, inactive 6 left out
  assert pos[0][ok[0]].tolist() == [
    1,
    5,
    7,
    3,
    0,
    2,
    4,
  ]
  assert limit[0][:4].tolist() == [40, 9, 3, 0]
  pos, ok, limit, count = fp.executors.client_blocks(steps, active, 1, parts=2)
  loads = [limit[t][: count[t]].sum() + count[t] for t in range(2)]
  assert sorted(pos[0][ok[0]].tolist() + pos[1][ok[1]].tolist()) == [
    0,
    1,
    2,
    3,
    4,
    5,
    7,
  ]
  # 40 alone, against the 6 others: 32 steps + 6 block costs
  assert sorted(loads) == [
    38,
    41,
  ]


@pytest.mark.parametrize('executor', sorted(EXECUTORS))
@pytest.mark.ci_variants('blocked_threads', 'vmap')
def test_round_compiles_once_per_run(digits, executor):
  chex.clear_trace_counter()
  # A per-round learning-rate decay: the round number is traced, not static.
  opt = fp.config.TrainingConfig(
    client_momentum=0.5, client_lr_decay=0.9
  ).make_client_optimizer()
  alg = fedavg(small_mlp(digits), 6, opt, fp.Batching(16, 1))
  alg = alg.replace(
    server_update=chex.assert_max_traces(alg.server_update, n=1),
    server_broadcast=chex.assert_max_traces(alg.server_broadcast, n=1),
  )
  runner = RoundRunner(
    alg, digits, fp.CohortSampler(6, cohort_size=3), EXECUTORS[executor]()
  )
  state, history = run(runner, num_rounds=5, eval_every=2)
  counts = dict(runner.trace_counts)
  if EXECUTORS[executor]().fused:
    assert counts['round'] == 1, counts
  elif executor == 'blocked_threads':
    # pre, post once; the client's context traced once, into the threads'
    # block loop (the blocks are laid out from the engine's host step counts).
    assert (
      counts['pre'] == 1 and counts['post'] == 1 and counts['client'] == 1
    ), counts
  else:
    # pre, post once; the client context once for each of init / step / final.
    assert (
      counts['pre'] == 1 and counts['post'] == 1 and counts['client'] == 3
    ), counts
  # FedAvg's one model is evaluated on the clients' test rows pooled.
  assert counts['eval_pooled'] == 1 and 'eval_client' not in counts, counts
  assert len([r for r in history if 'accuracy_mean' in r]) == 3


@pytest.mark.slow  # ~30 s; CI covers a CNN on vmap vs sharded (test_sharding)
def test_executors_agree_on_a_conv_model(digits):
  model = fp.models.from_flax(
    'cnn',
    fp.models.CNN(10, conv_features=(4, 8), dense=(16,)),
    digits.train.x[0, :1],
  )
  results = {}
  for name, make in EXECUTORS.items():
    alg = fedavg(
      model,
      6,
      optax.sgd(0.1, momentum=0.9),
      fp.Batching(16, num_epochs=None, num_steps=3),
    )
    runner = RoundRunner(
      alg, digits, fp.CohortSampler(6, cohort_size=5), make()
    )
    state = runner.init(jax.random.key(1))
    for t in range(2):
      state, _ = runner.round(state, jax.random.key(t))
    results[name] = (state.params, runner.evaluate(state, jax.random.key(9)))
  for name in ('blocked', 'blocked_threads', 'sequential'):
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5),
      results[name][0],
      results['vmap'][0],
    )
    np.testing.assert_allclose(
      results[name][1].correct, results['vmap'][1].correct
    )


@pytest.mark.parametrize('executor', sorted(EXECUTORS))
@pytest.mark.ci_variants('sequential', 'vmap')
def test_padded_client_gets_what_it_gets_alone(executor):
  data, xs, ys = least_squares_data(num_clients=4, sizes=(5, 9, 13, 7))
  model = linear_model(3)
  batching = fp.Batching(batch_size=4, num_epochs=2)
  key = jax.random.key(3)

  def personal_after_round(d):
    alg = local(model, d.num_clients, optax.sgd(0.05, momentum=0.9), batching)
    runner = RoundRunner(
      alg,
      to_device(d),
      fp.CohortSampler(d.num_clients, cohort_size=d.num_clients),
      EXECUTORS[executor](),
    )
    state = runner.init(jax.random.key(0))
    state, _ = runner.round(state, key)
    return jax.tree.map(lambda a: np.asarray(a[0]), state.personal_params)

  alone, _, _ = least_squares_data(num_clients=1, sizes=(5,))
  padded = personal_after_round(data)  # client 0 (5 examples) padded to 13
  single = personal_after_round(alone)
  assert data.train.max_examples == 13 and alone.train.max_examples == 5
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
    padded,
    single,
  )


def test_fedsgd_is_full_batch_gradient_descent():
  data, xs, ys = least_squares_data(num_clients=4)
  model = linear_model(3)
  lr = 0.02
  alg = fedsgd(model, 4, optax.sgd(lr))
  runner = RoundRunner(
    alg,
    to_device(data),
    fp.CohortSampler(4, cohort_size=4),
    fp.executors.VmapExecutor(),
  )
  state = runner.init(jax.random.key(0))
  w = np.asarray(state.params['w'], np.float64)
  b = np.asarray(state.params['b'], np.float64)
  x = np.concatenate(xs).astype(np.float64)
  y = np.concatenate(ys).astype(np.float64)
  for t in range(5):
    state, _ = runner.round(state, jax.random.key(t))
    r = x @ w[:, 0] + b[0] - y  # gradient of mean 0.5 r^2 over all examples
    w = w - lr * (x.T @ r / len(y))[:, None]
    b = b - lr * np.array([r.mean()])
    np.testing.assert_allclose(state.params['w'], w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state.params['b'], b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_local_trains_each_client_alone(digits):
  model = small_mlp(digits)
  batching = fp.Batching(16, 1)
  alg = local(model, 6, optax.sgd(0.1), batching)
  sampler = fp.CohortSampler(6, cohort_size=6)
  runner = RoundRunner(alg, digits, sampler, fp.executors.BlockedExecutor(4))
  state = runner.init(jax.random.key(0))
  start = jax.tree.map(lambda a: a[0], state.personal_params)
  key = jax.random.key(5)
  idx, _, k_clients = cohort_of(sampler, key)
  state, _ = runner.round(state, key)
  for i in range(6):
    expected = reference_sgd(
      model,
      start,
      digits.train.x[i],
      digits.train.y[i],
      int(digits.train.num_examples[i]),
      jax.random.fold_in(k_clients, i),
      batching,
      0.1,
    )
    got = jax.tree.map(lambda a: a[i], state.personal_params)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), got, expected
    )
  # Personal models differ between clients, and Local communicates nothing.
  assert not np.allclose(
    state.personal_params['output']['kernel'][0],
    state.personal_params['output']['kernel'][1],
  )
  assert communication_metrics(runner, state, 6.0)['bytes_up'] == 0


@pytest.mark.slow
def test_oracle_is_fedavg_within_each_group():
  data = digits_data(num_clients=8)
  data = data.replace(groups=jnp.array([0, 1, 0, 1, 1, 0, 1, 0], jnp.int32))
  model = small_mlp(data)
  batching = fp.Batching(16, 1)
  alg = oracle(model, data.groups, optax.sgd(0.1), batching)
  sampler = fp.CohortSampler(8, cohort_size=8)
  runner = RoundRunner(alg, data, sampler, fp.executors.VmapExecutor())
  state = runner.init(jax.random.key(0))
  start = jax.tree.map(lambda a: a[0], state.group_params)
  key = jax.random.key(2)
  idx, mask, k_clients = cohort_of(sampler, key)
  state, _ = runner.round(state, key)
  groups = np.asarray(data.groups)
  for g in (0, 1):
    sel = groups[idx] == g
    expected = reference_fedavg_round(
      model, start, data, idx[sel], mask[sel], k_clients, batching, 0.1
    )
    got = jax.tree.map(lambda a: a[g], state.group_params)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), got, expected
    )
  models = alg.client_models(state)
  np.testing.assert_array_equal(models.index, groups)


def test_oracle_needs_groups(digits):
  with pytest.raises(ValueError, match='known group'):
    oracle(small_mlp(digits), digits.groups, optax.sgd(0.1), fp.Batching(16, 1))


def test_server_momentum_and_uniform_weighting(digits):
  """FedAvgM: the server applies SGD with momentum to the mean delta."""
  model = small_mlp(digits)
  server = optax.sgd(0.7, momentum=0.5)
  alg = fedavg(
    model,
    6,
    optax.sgd(0.1),
    fp.Batching(16, 1),
    server_optimizer=server,
    weighting='uniform',
  )
  sampler = fp.CohortSampler(6, cohort_size=6)
  runner = RoundRunner(alg, digits, sampler, fp.executors.VmapExecutor())
  state = runner.init(jax.random.key(0))
  params, opt_state = state.params, server.init(state.params)
  for t in range(2):
    key = jax.random.key(t)
    _, _, k_clients = cohort_of(sampler, key)
    deltas = []
    for i in range(6):
      p = reference_sgd(
        model,
        params,
        digits.train.x[i],
        digits.train.y[i],
        int(digits.train.num_examples[i]),
        jax.random.fold_in(k_clients, i),
        fp.Batching(16, 1),
        0.1,
      )
      deltas.append(jax.tree.map(lambda a, b: a - b, params, p))
    mean = jax.tree.map(lambda *d: sum(d) / 6, *deltas)
    upd, opt_state = server.update(mean, opt_state, params)
    params = optax.apply_updates(params, upd)
    state, _ = runner.round(state, key)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5),
      state.params,
      params,
    )


def test_participation_sampling_and_round(digits):
  sampler = fp.CohortSampler(6, participation=0.3)
  draw = jax.jit(sampler)
  counts = []
  for t in range(200):
    c = draw(jax.random.key(t))
    idx, mask = np.asarray(c.idx), np.asarray(c.mask)
    assert mask.sum() >= 1  # redrawn when empty
    assert np.all(idx[~mask] == 6) and np.all(idx[mask] < 6)
    assert len(set(idx[mask])) == mask.sum()
    counts.append(mask.sum())
  # E[count | count > 0] for Binomial(6, 0.3)
  expected = 6 * 0.3 / (1 - 0.7**6)
  assert abs(np.mean(counts) - expected) < 0.25
  alg = fedavg(small_mlp(digits), 6, optax.sgd(0.1), fp.Batching(16, 1))
  # num_active comes from the server update, whatever runs the clients (the
  # executors' equality tests cover the rest)
  for make in (EXECUTORS['vmap'],):
    runner = RoundRunner(alg, digits, sampler, make())
    state = runner.init(jax.random.key(0))
    state, metrics = runner.round(state, jax.random.key(4))
    c = sampler(jax.random.split(jax.random.key(4))[0])
    assert float(metrics['num_active']) == int(np.asarray(c.mask).sum())


def test_communication_bytes(digits):
  model = small_mlp(digits)
  alg = fedavg(model, 6, optax.sgd(0.1), fp.Batching(16, 1))
  runner = RoundRunner(
    alg, digits, fp.CohortSampler(6, cohort_size=4), fp.executors.VmapExecutor()
  )
  state = runner.init(jax.random.key(0))
  b = tree_bytes(state.params)
  assert b == 4 * (64 * 16 + 16 + 16 * 10 + 10)
  m = communication_metrics(runner, state, 4.0)
  assert m == {
    'bytes_up': 4.0 * b,
    'bytes_down_broadcast': 1.0 * b,
    'bytes_down_unicast': 4.0 * b,
  }


def test_summarize_hand_made():
  stats = fp.training.LossStats(
    loss_sum=jnp.array([2.0, 1.0, 0.0, 3.0]),
    correct=jnp.array([1.0, 3.0, 0.0, 2.0]),
    count=jnp.array([2.0, 4.0, 0.0, 4.0]),
  )
  s = fp.summarize(stats)
  assert s['num_eval_clients'] == 3  # the client without test data is left out
  np.testing.assert_allclose(s['accuracy_mean'], (0.5 + 0.75 + 0.5) / 3)
  np.testing.assert_allclose(s['accuracy_weighted'], 6 / 10)
  assert s['accuracy_worst'] == 0.5 and s['accuracy_best'] == 0.75
  np.testing.assert_allclose(s['loss_weighted'], 0.6)


def test_aggregation_contractions():
  stacked = {'w': jnp.arange(12.0).reshape(3, 4)}
  np.testing.assert_allclose(
    aggregation.weighted_mean(stacked, jnp.array([1.0, 0.0, 3.0]))['w'],
    (stacked['w'][0] + 3 * stacked['w'][2]) / 4,
  )
  w = jnp.array([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
  np.testing.assert_allclose(
    aggregation.mix(w, stacked)['w'], np.asarray(w) @ np.asarray(stacked['w'])
  )
  g = aggregation.group_means(
    stacked, jnp.array([1, 0, 1]), jnp.array([1.0, 1.0, 1.0]), 2
  )
  np.testing.assert_allclose(
    g['w'], np.stack([stacked['w'][1], (stacked['w'][0] + stacked['w'][2]) / 2])
  )


@pytest.mark.slow
def test_finetune_evaluation_uses_training_data(digits):
  model = small_mlp(digits)
  ft = fp.training.sgd_finetune(
    model, 0.1, fp.Batching(16, num_epochs=None, num_steps=3)
  )
  alg = fedavg(model, 6, optax.sgd(0.1), fp.Batching(16, 1), finetune=ft)
  runner = RoundRunner(
    alg, digits, fp.CohortSampler(6, cohort_size=6), fp.executors.VmapExecutor()
  )
  state = runner.init(jax.random.key(0))
  plain = runner.evaluate(state, jax.random.key(1), finetune=False)
  tuned = runner.evaluate(state, jax.random.key(1))
  assert float(tuned.correct.sum()) != float(plain.correct.sum())
  # Hand check for client 2: fine-tune on its train split, evaluate on test.
  from fedjax_personal.core.training import evaluate_params

  local_data = fp.data.LocalData(
    train=digits.train.client(2), val=digits.val.client(2)
  )
  p = ft(state.params, local_data, jax.random.fold_in(jax.random.key(1), 2))
  expect = evaluate_params(model, p, digits.test.client(2))
  np.testing.assert_allclose(tuned.correct[2], expect.correct)


@pytest.mark.parametrize(
  'executor',
  [
    pytest.param(e, marks=() if e == 'vmap' else (pytest.mark.slow,))
    for e in sorted(EXECUTORS)
  ],
)
@pytest.mark.slow_variants('vmap')
def test_evaluation_in_test_length_groups_matches_plain_loop(executor):
  # Unequal test splits (Dirichlet 0.1): clients are evaluated in groups of
  # static test length (evaluation.eval_buckets); the result must be each
  # client's statistics on its whole split, for global and personal models.
  from fedjax_personal.core.evaluation import eval_buckets
  from fedjax_personal.core.training import evaluate_params

  data = digits_data(num_clients=8, alpha=0.1, seed=3)
  n_test = np.asarray(data.test.num_examples)
  groups = eval_buckets(n_test, data.test.max_examples, smallest=8)
  assert len(groups) > 1
  assert sorted(np.concatenate([g for _, g in groups]).tolist()) == list(
    range(8)
  )
  for length, idx in groups:
    assert np.all(n_test[idx] <= length)
  model = small_mlp(data)
  for alg in (
    fedavg(model, 8, optax.sgd(0.1), fp.Batching(16, 1)),
    local(model, 8, optax.sgd(0.1), fp.Batching(16, 1)),
  ):
    runner = RoundRunner(
      alg, data, fp.CohortSampler(8, cohort_size=8), EXECUTORS[executor]()
    )
    state, _ = runner.round(runner.init(jax.random.key(0)), jax.random.key(1))
    got = runner.evaluate(state, jax.random.key(2))
    models = alg.client_models(state)
    for i in range(8):
      want = evaluate_params(model, models.for_client(i), data.test.client(i))
      np.testing.assert_allclose(got.correct[i], want.correct)
      np.testing.assert_allclose(got.count[i], want.count)
      np.testing.assert_allclose(got.loss_sum[i], want.loss_sum, rtol=1e-5)


@pytest.mark.slow
def test_pooled_evaluation_of_the_device_layout_skips_clients_without_test_rows(
  monkeypatch,
):
  """One model on every client's real test rows back to back, in chunks of
  a few rows: a chunk spanning clients with no test row between its rows
  (more clients than rows) still gives each client its own statistics."""
  from fedjax_personal.core import evaluation
  from fedjax_personal.core.training import evaluate_params

  data = digits_data(num_clients=8, alpha=0.1, seed=3)
  n_test = np.asarray(data.test.num_examples).copy()
  n_test[[1, 2, 3, 5]] = 0
  n_test[[0, 4]] = 1
  data = data.replace(
    test=data.test.replace(num_examples=jnp.asarray(n_test, jnp.int32))
  )
  # chunks of 1-2 rows
  monkeypatch.setattr(evaluation, 'POOLED_CHUNK_BYTES', 1024)
  model = small_mlp(data)
  alg = fedavg(model, 8, optax.sgd(0.1), fp.Batching(16, 1))
  runner = RoundRunner(
    alg, data, fp.CohortSampler(8, cohort_size=8), fp.executors.VmapExecutor()
  )
  state, _ = runner.round(runner.init(jax.random.key(0)), jax.random.key(1))
  got = runner.evaluate(state, jax.random.key(2))
  assert runner.trace_counts['eval_pooled'] == 1
  for i in range(8):
    want = evaluate_params(model, state.params, data.test.client(i))
    np.testing.assert_allclose(got.count[i], want.count)
    np.testing.assert_allclose(got.correct[i], want.correct)
    np.testing.assert_allclose(got.loss_sum[i], want.loss_sum, rtol=1e-5)


@pytest.mark.skipif(
  jax.default_backend() != 'cpu', reason='the CPU choice of auto'
)
def test_auto_executor_on_cpu_blocks_clients_by_work_on_threads(digits):
  import os

  x = digits.train.x[0, :1]
  dense = fp.create_executor('auto', small_mlp(digits), x)
  threads = os.cpu_count() or 1
  assert (
    isinstance(dense, fp.executors.BlockedExecutor)
    and dense.num_threads == threads
  )
  assert dense.fused == (threads == 1)
  assert fp.create_executor('auto', small_mlp(digits), x, num_threads=1).fused
  assert fp.create_executor(
    'blocked', small_mlp(digits), x
  ).fused  # named: one program
  conv = fp.models.from_flax(
    'cnn', fp.models.CNN(10, conv_features=(4, 8), dense=(16,)), x
  )
  # one client a block: no vectorized convolutions
  conv_ex = fp.create_executor('auto', conv, x)
  assert (
    isinstance(conv_ex, fp.executors.BlockedExecutor)
    and conv_ex.block_size == 1
  )
  assert conv_ex.num_threads == threads and 'convolutions' in conv_ex.reason
  with pytest.raises(ValueError, match='num_threads'):
    fp.executors.BlockedExecutor(2, num_threads=0)


def test_threaded_blocked_runs_fused_when_the_per_client_state_is_large():
  threaded = fp.executors.BlockedExecutor(3, num_threads=2)
  small = {'w': jax.ShapeDtypeStruct((100, 1000), jnp.float32)}
  # 1.2 GB
  large = {
    'w': jax.ShapeDtypeStruct((1000, 300_000), jnp.float32),
    'g': small['w'],
  }
  assert threaded.for_run(small, 100) is threaded
  fused = threaded.for_run(large, 1000)
  assert fused.fused and fused.block_size == 3 and not threaded.fused
  # Shared (non per-client) leaves do not count.
  assert (
    threaded.for_run(
      {'w': jax.ShapeDtypeStruct((300_000, 1000), jnp.float32)}, 10
    )
    is threaded
  )
  # Client work from host threads cannot run inside a trace: a clear error, not
  # a tracer leak.
  with pytest.raises(ValueError, match='num_threads=1'):
    jax.jit(lambda x: threaded.map(lambda sh, c: c * sh, 2.0, x))(
      jnp.arange(4.0)
    )


def test_evaluation_groups_join_where_a_program_costs_more_than_their_work():
  """EMNIST-like test splits: 2,961 clients of length 32 stay apart (joining
  them would cost far more than a block's rows), 408 of length 64 join the
  31 of length 128 (at most one block of 256 clients' rows more)."""
  from fedjax_personal.core.evaluation import eval_buckets

  counts = np.array([20] * 2961 + [50] * 408 + [100] * 31)
  plain = eval_buckets(counts, 128)
  assert [(l, len(i)) for l, i in plain] == [(32, 2961), (64, 408), (128, 31)]
  joined = eval_buckets(counts, 128, block=256)
  assert [(l, len(i)) for l, i in joined] == [(32, 2961), (128, 439)]
  assert np.array_equal(joined[1][1], np.arange(2961, 3400))
  # small groups chain into the longest; every client keeps a length >= its
  # count
  few = eval_buckets(np.array([3, 20, 50, 100]), 128, smallest=4, block=256)
  assert [(l, i.tolist()) for l, i in few] == [(128, [0, 1, 2, 3])]
