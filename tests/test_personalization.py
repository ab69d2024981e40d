"""Per-FedAvg, partial personalization (FedAlt / FedSim) and the regularized
personal baselines (pFedMe, Ditto, APFL)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import digits_data, max_diff
from helpers import run_rounds as run

import fedjax_personal as fp
from fedjax_personal.algorithms.apfl import apfl
from fedjax_personal.algorithms.ditto import ditto
from fedjax_personal.algorithms.fedavg import fedavg
from fedjax_personal.algorithms.local import local
from fedjax_personal.algorithms.partial import partial_personalization
from fedjax_personal.algorithms.perfedavg import (
  hvp_exact,
  hvp_finite_difference,
  perfedavg,
  perfedavg_update,
)
from fedjax_personal.algorithms.pfedme import pfedme
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.core.personalization import make_split
from fedjax_personal.core.training import Batch, batch_loss
from fedjax_personal.core.tree_util import tree_bytes
from fedjax_personal.run.experiment import communication_metrics

EXEC = fp.executors.VmapExecutor


@pytest.fixture(scope='module')
def digits():
  return digits_data(num_clients=6)


def mlp(data, hidden=(8,), adapter_dim=0):
  return fp.models.from_flax(
    'mlp',
    fp.models.MLP(data.num_classes, hidden=hidden, adapter_dim=adapter_dim),
    data.train.x[0, :1],
  )


def random_batch(shape=(3, 8, 8, 8, 1), seed=0):
  rng = np.random.default_rng(seed)
  return Batch(
    jnp.asarray(rng.random(shape), jnp.float32),
    jnp.asarray(rng.integers(0, 10, shape[:2])),
    jnp.ones(shape[:2], bool),
  )


def test_exact_hvp_equals_explicit_hessian_times_vector(digits):
  model = mlp(digits, hidden=(4,))
  params = model.init(jax.random.key(0))
  b = random_batch()
  d = Batch(b.x[0], b.y[0], b.mask[0])
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  loss = lambda p: batch_loss(model, p, d)[0]
  hessian = jax.jit(jax.hessian(lambda f: loss(unravel(f))))(flat)
  v = jax.random.normal(jax.random.key(1), flat.shape)
  expected = hessian @ v
  got = jax.flatten_util.ravel_pytree(
    jax.jit(lambda p, u: hvp_exact(loss, p, u))(params, unravel(v))
  )[0]
  np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-4)
  errors = []
  for delta in (1e-1, 1e-2, 1e-3):
    fd = jax.flatten_util.ravel_pytree(
      jax.jit(lambda p, u: hvp_finite_difference(loss, p, u, delta))(
        params, unravel(v)
      )
    )[0]
    errors.append(float(jnp.linalg.norm(fd - expected)))
  assert errors[1] < errors[0]  # approaches the exact product as delta shrinks
  assert errors[1] < 1e-2 * float(jnp.linalg.norm(expected)) + 1e-3


@pytest.mark.slow
def test_perfedavg_fo_and_hf_differ_and_coincide_at_alpha_zero(digits):
  model = mlp(digits)
  params = model.init(jax.random.key(0))
  b = random_batch()
  fo, _ = perfedavg_update(model, params, b, 0.3, 0.1, 'fo')
  hf, _ = perfedavg_update(model, params, b, 0.3, 0.1, 'hf')
  fd, _ = perfedavg_update(model, params, b, 0.3, 0.1, 'hf_fd')
  diff = max_diff
  assert diff(fo, hf) > 1e-5
  # finite differences track the exact HVP
  assert diff(hf, fd) < 0.1 * diff(fo, hf)
  fo0, _ = perfedavg_update(model, params, b, 0.0, 0.1, 'fo')
  hf0, _ = perfedavg_update(model, params, b, 0.0, 0.1, 'hf')
  # alpha = 0: both are a plain SGD step with lr beta on the batch D'.
  d1 = Batch(b.x[1], b.y[1], b.mask[1])
  g = jax.grad(lambda p: batch_loss(model, p, d1)[0])(params)
  sgd = jax.tree.map(lambda p, gg: p - 0.1 * gg, params, g)
  assert diff(fo0, hf0) < 1e-7 and diff(fo0, sgd) < 1e-7


def test_perfedavg_rounds_and_evaluates_after_alpha_steps(digits):
  model = mlp(digits)
  alg = perfedavg(
    model,
    6,
    optax.sgd(0.1),
    fp.Batching(8, num_epochs=None, num_steps=3),
    alpha=0.05,
    variant='hf',
  )
  runner = RoundRunner(alg, digits, fp.CohortSampler(6, cohort_size=4), EXEC())
  state = runner.init(jax.random.key(0))
  for t in range(3):
    state, m = runner.round(state, jax.random.key(t))
  tuned = runner.evaluate(state, jax.random.key(0))
  plain = runner.evaluate(state, jax.random.key(0), finetune=False)
  assert float(tuned.correct.sum()) != float(plain.correct.sum())


@pytest.mark.slow
def test_perfedavg_default_is_the_plain_mean_of_returned_models(digits):
  """Algorithm 1: w <- mean over the sampled clients of their w_i (no size
  weighting), each w_i from tau plain-SGD Per-FedAvg steps."""
  model = mlp(digits)
  batching = fp.Batching(8, num_epochs=None, num_steps=2)
  alg = perfedavg(model, 6, optax.sgd(0.1), batching, alpha=0.05, variant='fo')
  sampler = fp.CohortSampler(6, cohort_size=3)
  runner = RoundRunner(alg, digits, sampler, EXEC())
  state = runner.init(jax.random.key(0))
  new, _ = runner.round(state, jax.random.key(4))
  k_cohort, k_clients = jax.random.split(jax.random.key(4))
  cohort = np.asarray(sampler(k_cohort).idx)
  sizes = {int(digits.train.num_examples[i]) for i in cohort}
  assert len(sizes) > 1  # so that a size-weighted mean would differ
  returned = []
  for i in cohort:
    _, k_batch, _ = jax.random.split(jax.random.fold_in(k_clients, int(i)), 3)
    idx, mask = fp.training.work_batch_indices(
      alg.client_work,
      k_batch,
      digits.train.num_examples[i],
      digits.train.max_examples,
    )
    w = state.params
    for s in range(idx.shape[0]):
      b = Batch(digits.train.x[i][idx[s]], digits.train.y[i][idx[s]], mask[s])
      w, _ = perfedavg_update(model, w, b, 0.05, 0.1, 'fo')
    returned.append(w)
  expected = jax.tree.map(lambda *ws: sum(ws) / len(ws), *returned)
  assert max_diff(new.params, expected) < 1e-5


def one_round_partial(
  digits, mode, part='output', adapter_dim=0, executor=EXEC
):
  model = mlp(digits, adapter_dim=adapter_dim)
  split = make_split(part, jax.eval_shape(model.init, jax.random.key(0)))
  batching = fp.Batching(16, num_epochs=1)
  alg = partial_personalization(model, 6, split, mode, optax.sgd(0.1), batching)
  sampler = fp.CohortSampler(6, cohort_size=3)
  runner = RoundRunner(alg, digits, sampler, executor())
  state = runner.init(jax.random.key(0))
  before = state
  state, _ = runner.round(state, jax.random.key(7))
  cohort = np.asarray(sampler(jax.random.split(jax.random.key(7))[0]).idx)
  return model, split, alg, runner, before, state, cohort


@pytest.mark.parametrize('mode', ['alt', 'sim'])
@pytest.mark.ci_variants('sim')
def test_partial_personal_leaves_change_only_in_own_state(digits, mode):
  model, split, alg, runner, before, after, cohort = one_round_partial(
    digits, mode
  )
  for path in after.personal:
    for i in range(6):
      changed = not np.allclose(
        after.personal[path][i], before.personal[path][i]
      )
      assert changed == (i in cohort), (path, i)


@pytest.mark.parametrize('mode', ['alt', 'sim'])
@pytest.mark.ci_variants('alt')
def test_partial_shared_is_weighted_average_and_nothing_personal_is_uploaded(
  digits, mode
):
  model, split, alg, runner, before, after, cohort = one_round_partial(
    digits, mode
  )
  # Re-run each cohort client's work alone with the same key: the server's new
  # shared part must be the n_i-weighted mean of their shared parts.
  from fedjax_personal.core.data import LocalData
  from fedjax_personal.core.training import ClientContext, run_work

  k_clients = jax.random.split(jax.random.key(7))[1]
  shared_parts, weights = [], []
  for i in cohort:
    ctx = ClientContext(
      before.shared,
      jax.tree.map(lambda a: a[i], before.personal),
      LocalData(digits.train.client(i), digits.val.client(i)),
    )
    out = run_work(alg.client_work, ctx, jax.random.fold_in(k_clients, int(i)))
    # The upload is the client's share of the n_i-weighted mean: (n_i * delta,
    # n_i).
    weighted, n_i = out.shared_delta.value
    assert float(n_i) == float(digits.train.num_examples[i])
    delta = jax.tree.map(lambda a: a / n_i, weighted)
    # uploaded part has no personal leaf
    assert set(delta) & set(out.personal) == set()
    assert not any(split.is_personal(p) for p in delta)
    shared_parts.append(jax.tree.map(lambda s, d: s - d, before.shared, delta))
    weights.append(float(digits.train.num_examples[i]))
  w = np.array(weights) / sum(weights)
  expected = jax.tree.map(
    lambda *xs: sum(wi * x for wi, x in zip(w, xs)), *shared_parts
  )
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5),
    after.shared,
    expected,
  )
  comm = communication_metrics(runner, after, 3.0)
  assert comm['bytes_up'] == 3 * tree_bytes(after.shared)
  assert tree_bytes(after.shared) < tree_bytes(model.init(jax.random.key(0)))


@pytest.mark.slow
def test_fedalt_and_fedsim_differ_and_match_across_executors(digits):
  _, _, _, _, _, alt, _ = one_round_partial(digits, 'alt')
  _, _, _, _, _, sim, _ = one_round_partial(digits, 'sim')
  assert not np.allclose(
    alt.shared['hidden_0/kernel'], sim.shared['hidden_0/kernel']
  )
  _, _, _, _, _, alt_seq, _ = one_round_partial(
    digits, 'alt', executor=fp.executors.SequentialExecutor
  )
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5),
    alt.shared,
    alt_seq.shared,
  )
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5),
    alt.personal,
    alt_seq.personal,
  )


@pytest.mark.parametrize(
  'part', ['input', 'adapter', 'split:hidden_0/bias,output/bias']
)
@pytest.mark.ci_variants('adapter')
def test_partial_presets(digits, part):
  _, split, _, runner, _, after, _ = one_round_partial(
    digits, 'sim', part, adapter_dim=4
  )
  if part == 'input':
    assert set(after.personal) == {'hidden_0/bias', 'hidden_0/kernel'}
  elif part == 'adapter':
    assert (
      all(p.startswith('adapter_') for p in after.personal)
      and len(after.personal) == 4
    )
  else:
    assert set(after.personal) == {'hidden_0/bias', 'output/bias'}
  acc = fp.summarize(runner.evaluate(after, jax.random.key(0)))
  assert 0 <= acc['accuracy_mean'] <= 1


def test_bad_personal_part(digits):
  params = mlp(digits).init(jax.random.key(0))
  with pytest.raises(ValueError, match='personal part'):
    make_split('split:nothing_matches', params)
  with pytest.raises(ValueError, match='unknown personal part'):
    make_split('middle', params)


@pytest.mark.slow
def test_ditto_large_lambda_gives_the_global_model(digits):
  model = mlp(digits)
  batching = fp.Batching(16, num_epochs=1)
  # lambda * personal_lr = 1: every personal step lands on the received global
  # model up to personal_lr * gradient, so with a tiny lr the personal model is
  # the global model; lambda = 0 is Local training.
  _, strong = run(
    ditto(
      model,
      6,
      optax.sgd(0.1),
      batching,
      lam=1e4,
      personal_optimizer=optax.sgd(1e-4),
    ),
    digits,
    rounds=1,
  )
  runner0, state0 = run(
    fedavg(model, 6, optax.sgd(0.1), batching), digits, rounds=1
  )
  start = model.init(jax.random.key(0))
  for i in range(6):
    assert max_diff(jax.tree.map(lambda a: a[i], strong.personal), start) < 1e-4
  _, weak = run(
    ditto(model, 6, optax.sgd(0.1), batching, lam=0.0), digits, rounds=1
  )
  _, loc = run(local(model, 6, optax.sgd(0.1), batching), digits, rounds=1)
  assert max_diff(weak.personal, loc.personal_params) < 1e-5


@pytest.mark.slow
def test_apfl_alpha_zero_is_global_and_one_is_local(digits):
  model = mlp(digits)
  batching = fp.Batching(16, num_epochs=1)
  a0 = apfl(model, 6, optax.sgd(0.1), batching, alpha=0.0)
  _, s0 = run(a0, digits)
  models = a0.client_models(s0)
  for i in range(6):
    assert (
      max_diff(jax.tree.map(lambda a: a[i], models.params), s0.params) < 1e-7
    )
  a1 = apfl(model, 6, optax.sgd(0.1), batching, alpha=1.0)
  _, s1 = run(a1, digits)
  _, loc = run(local(model, 6, optax.sgd(0.1), batching), digits)
  assert max_diff(a1.client_models(s1).params, loc.personal_params) < 1e-5


@pytest.mark.slow
# wd: PFLlib's pFedMeOptimizer's weight decay on theta (--pfedme_weight_decay)
@pytest.mark.parametrize('wd', [0.0, 0.3])
def test_pfedme_step_by_hand(digits, wd):
  model = mlp(digits)
  lam, plr, lr, k = 2.0, 0.05, 0.1, 3
  batching = fp.Batching(16, num_epochs=None, num_steps=1)
  alg = pfedme(
    model,
    6,
    optax.sgd(lr),
    batching,
    lam=lam,
    personal_lr=plr,
    inner_steps=k,
    weight_decay=wd,
  )
  runner = RoundRunner(alg, digits, fp.CohortSampler(6, cohort_size=6), EXEC())
  state = runner.init(jax.random.key(0))
  w0 = state.params
  new, _ = runner.round(state, jax.random.key(3))
  k_clients = jax.random.split(jax.random.key(3))[1]
  ws, weights = [], []
  for i in range(6):
    _, k_batch, _ = jax.random.split(jax.random.fold_in(k_clients, i), 3)
    idx, mask = fp.batching.batch_indices(
      k_batch, digits.train.num_examples[i], digits.train.max_examples, batching
    )
    b = Batch(digits.train.x[i][idx[0]], digits.train.y[i][idx[0]], mask[0])
    theta = w0
    for _ in range(k):
      g = jax.grad(lambda t: batch_loss(model, t, b)[0])(theta)
      theta = jax.tree.map(
        lambda t, gg, ww: t - plr * (gg + lam * (t - ww) + wd * t), theta, g, w0
      )
    ws.append(jax.tree.map(lambda ww, t: ww - lr * lam * (ww - t), w0, theta))
    weights.append(float(digits.train.num_examples[i]))
    assert max_diff(jax.tree.map(lambda a: a[i], new.personal), theta) < 1e-5
  w = np.array(weights) / sum(weights)
  expected = jax.tree.map(lambda *xs: sum(wi * x for wi, x in zip(w, xs)), *ws)
  assert max_diff(new.params, expected) < 1e-5
