"""SCAFFOLD, FedDyn and personalized FedDyn."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import least_squares_data, linear_model, run_rounds

import fedjax_personal as fp
from fedjax_personal.algorithms.fedavg import fedavg
from fedjax_personal.algorithms.feddyn import feddyn
from fedjax_personal.algorithms.pfeddyn import (
  class_prototypes,
  maml_objective,
  pfeddyn,
  prototype_logits,
  prototype_objective,
)
from fedjax_personal.algorithms.scaffold import scaffold
from fedjax_personal.core.data import to_device
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.core.training import Batch
from fedjax_personal.datasets import DataConfig, load_federated


def true_minimizer(xs, ys):
  """argmin (1/N) sum_k mean_{i in k} 0.5 (x theta + b - y)^2 (normal
  equations)."""
  a, c = 0, 0
  for x, y in zip(xs, ys):
    xt = np.concatenate([x, np.ones((len(x), 1))], 1).astype(np.float64)
    a = a + xt.T @ xt / len(x)
    c = c + xt.T @ y.astype(np.float64) / len(x)
  return np.linalg.solve(a, c)


def distance(params, theta):
  return np.linalg.norm(
    np.concatenate([np.asarray(params['w'])[:, 0], np.asarray(params['b'])])
    - theta
  )


@pytest.fixture(scope='module')
def heterogeneous():
  data, xs, ys = least_squares_data(
    num_clients=4, sizes=(6, 10, 14, 8), shift=0.5
  )
  return data, true_minimizer(xs, ys)


# full-batch local GD
LOCAL = fp.Batching(batch_size=None, num_epochs=None, num_steps=20)


@pytest.mark.parametrize(
  'participation', ['full', pytest.param('partial', marks=pytest.mark.slow)]
)
@pytest.mark.slow_variants('full')
def test_feddyn_and_scaffold_reach_the_minimizer_fedavg_does_not(
  heterogeneous, participation
):
  data, theta = heterogeneous
  model = linear_model(3)
  if participation == 'full':
    sampler_dyn = sampler_sca = fp.CohortSampler(4, cohort_size=4)
    rounds = 200
  else:
    sampler_dyn = fp.CohortSampler(4, participation=0.5)  # FedDyn's scheme
    sampler_sca = fp.CohortSampler(4, cohort_size=2)
    rounds = 400
  lr = 0.05
  data = to_device(data)
  _, avg = run_rounds(
    fedavg(model, 4, optax.sgd(lr), LOCAL, weighting='uniform'),
    data,
    rounds,
    sampler_sca,
  )
  _, dyn = run_rounds(
    feddyn(model, 4, data.train.num_examples, optax.sgd(lr), LOCAL, alpha=1.0),
    data,
    rounds,
    sampler_dyn,
  )
  _, sca = run_rounds(
    scaffold(model, 4, optax.sgd(lr), LOCAL), data, rounds, sampler_sca
  )
  # FedAvg's client drift: a biased fixed point
  assert distance(avg.params, theta) > 1e-2
  assert distance(dyn.params, theta) < 1e-4
  assert distance(sca.params, theta) < 1e-4


@pytest.mark.slow
def test_feddyn_state_update_follows_the_equations():
  """One client loop + server step written from the spec, compared for 3
  rounds."""
  data, xs, ys = least_squares_data(num_clients=3, sizes=(5, 7, 9))
  model = linear_model(3)
  alpha, lr, k = 0.3, 0.05, 4
  batching = fp.Batching(batch_size=3, num_epochs=None, num_steps=k)
  sampler = fp.CohortSampler(3, cohort_size=2)
  alg = feddyn(
    model, 3, data.train.num_examples, optax.sgd(lr), batching, alpha=alpha
  )
  runner = RoundRunner(
    alg, to_device(data), sampler, fp.executors.SequentialExecutor()
  )
  state = runner.init(jax.random.key(0))
  theta_s = state.params
  h = jax.tree.map(jnp.zeros_like, theta_s)
  g = [jax.tree.map(jnp.zeros_like, theta_s) for _ in range(3)]

  def local_objective(p, xb, yb, gi, server):
    data_term = jnp.mean(0.5 * jnp.square(model.apply(p, xb) - yb))
    lin = sum(
      jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(gi), jax.tree.leaves(p))
    )
    quad = sum(
      jnp.sum(jnp.square(a - b))
      for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(server))
    )
    return data_term - lin + alpha / 2 * quad

  grad = jax.jit(jax.grad(local_objective))
  for t in range(3):
    key = jax.random.key(10 + t)
    k_cohort, k_clients = jax.random.split(key)
    cohort = np.asarray(sampler(k_cohort).idx)
    thetas = []
    for i in cohort:
      _, k_batch, _ = jax.random.split(jax.random.fold_in(k_clients, int(i)), 3)
      idx, mask = fp.batching.batch_indices(
        k_batch, data.train.num_examples[i], 9, batching
      )
      p = theta_s
      for s in range(k):
        sel = np.asarray(idx[s])[np.asarray(mask[s])]
        gr = grad(p, data.train.x[i][sel], data.train.y[i][sel], g[i], theta_s)
        p = jax.tree.map(lambda a, b: a - lr * b, p, gr)
      g[i] = jax.tree.map(
        lambda gi, a, b: gi - alpha * (a - b), g[i], p, theta_s
      )
      thetas.append(p)
    # h <- h - (alpha / N) sum_{i in P_t} (theta_i - theta_server)
    h = jax.tree.map(
      lambda hh, s, *ps: hh - alpha / 3 * sum(pp - s for pp in ps),
      h,
      theta_s,
      *thetas,
    )
    mean = jax.tree.map(lambda *ps: sum(ps) / len(ps), *thetas)
    theta_s = jax.tree.map(lambda m, hh: m - hh / alpha, mean, h)
    state, _ = runner.round(state, key)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    jax.tree.map(close, state.params, theta_s)
    jax.tree.map(close, state.h, h)
    for i in range(3):
      jax.tree.map(close, jax.tree.map(lambda a: a[i], state.grad_state), g[i])


def test_scaffold_control_variates_follow_option_ii():
  """The reference writes option II as (theta - y_i) / (K lr); the library
  computes the mean raw gradient, which must be the same number for SGD."""
  data, xs, ys = least_squares_data(num_clients=3, sizes=(5, 7, 9))
  model = linear_model(3)
  lr, k = 0.05, 3
  batching = fp.Batching(batch_size=None, num_epochs=None, num_steps=k)
  sampler = fp.CohortSampler(3, cohort_size=2)
  runner = RoundRunner(
    scaffold(model, 3, optax.sgd(lr), batching),
    to_device(data),
    sampler,
    fp.executors.BlockedExecutor(1),
  )
  state = runner.init(jax.random.key(0))
  theta, c = state.params, jax.tree.map(jnp.zeros_like, state.params)
  ci = [c] * 3
  grad = jax.jit(
    jax.grad(lambda p, x, y: jnp.mean(0.5 * jnp.square(model.apply(p, x) - y)))
  )
  for t in range(3):
    key = jax.random.key(t)
    cohort = np.asarray(sampler(jax.random.split(key)[0]).idx)
    ys_, deltas = [], []
    for i in cohort:
      n = int(data.train.num_examples[i])
      p = theta
      for _ in range(k):
        gr = grad(p, data.train.x[i][:n], data.train.y[i][:n])
        p = jax.tree.map(
          lambda a, g_, cc, cci: a - lr * (g_ + cc - cci), p, gr, c, ci[i]
        )
      new_ci = jax.tree.map(
        lambda cci, cc, s, a: cci - cc + (s - a) / (k * lr), ci[i], c, theta, p
      )
      deltas.append(jax.tree.map(lambda a, b: a - b, new_ci, ci[i]))
      ci[i] = new_ci
      ys_.append(p)
    theta = jax.tree.map(lambda *ps: sum(ps) / len(ps), *ys_)
    c = jax.tree.map(lambda cc, *ds: cc + sum(ds) / 3, c, *deltas)
    state, _ = runner.round(state, key, t)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    jax.tree.map(close, state.params, theta)
    jax.tree.map(close, state.control, c)
    for i in range(3):
      jax.tree.map(
        close, jax.tree.map(lambda a: a[i], state.client_controls), ci[i]
      )


def test_prototype_logits_and_loss_by_hand():
  feats = jnp.array([[0.0, 0.0], [2.0, 0.0], [0.0, 4.0]])
  protos, present = class_prototypes(
    feats, jnp.array([0, 0, 1]), jnp.array([True, True, True]), 3
  )
  np.testing.assert_allclose(protos[:2], [[1.0, 0.0], [0.0, 4.0]])
  assert present.tolist() == [True, True, False]
  logits = prototype_logits(jnp.array([[1.0, 1.0]]), protos, present)
  np.testing.assert_allclose(logits[0, :2], [-1.0, -10.0], rtol=1e-6)
  assert logits[0, 2] < -1e8
  # The objective with a logistic-regression model: features are the inputs.
  model = fp.create_model('logreg', 3, np.zeros((1, 2), np.float32))
  params = model.init(jax.random.key(0))
  batch = Batch(
    x=jnp.stack(
      [
        jnp.concatenate([feats, jnp.zeros((1, 2))]),
        jnp.array([[1.0, 1.0], [0.0, 3.0], [0, 0], [0, 0]]),
      ]
    ),
    y=jnp.array([[0, 0, 1, 0], [0, 1, 0, 0]]),
    mask=jnp.array([[True, True, True, False], [True, True, False, False]]),
  )
  loss, stats = prototype_objective(model, 3)(params, batch)
  # query 1: d = [1, 10]; query 2 (label 1): d = [1 + 9, 1] -> both correct.
  expect = (np.log1p(np.exp(-9.0)) + np.log1p(np.exp(-9.0))) / 2
  # float32 log-softmax
  np.testing.assert_allclose(loss, expect, rtol=1e-3, atol=1e-7)
  assert float(stats.correct) == 2.0


@pytest.mark.slow
def test_maml_differentiates_through_the_inner_steps():
  model = fp.create_model('mlp', 3, np.zeros((1, 4), np.float32))
  params = model.init(jax.random.key(0))
  rng = np.random.default_rng(0)
  batch = Batch(
    x=jnp.asarray(rng.normal(size=(2, 8, 4)), jnp.float32),
    y=jnp.asarray(rng.integers(0, 3, (2, 8))),
    mask=jnp.ones((2, 8), bool),
  )
  g_full = jax.grad(lambda p: maml_objective(model, 3, 0.5)(p, batch)[0])(
    params
  )
  g_fo = jax.grad(
    lambda p: maml_objective(model, 3, 0.5, first_order=True)(p, batch)[0]
  )(params)
  diff = max(
    float(jnp.max(jnp.abs(a - b)))
    for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_fo))
  )
  assert diff > 1e-4
  # With no inner step both are the plain query-loss gradient.
  query = Batch(batch.x[1], batch.y[1], batch.mask[1])
  g0 = jax.grad(lambda p: maml_objective(model, 0, 0.5)(p, batch)[0])(params)
  g_plain = jax.grad(lambda p: fp.training.batch_loss(model, p, query)[0])(
    params
  )
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
    g0,
    g_plain,
  )


@pytest.mark.parametrize(
  'head',
  ['finetune', pytest.param('maml', marks=pytest.mark.slow), 'prototype'],
)
@pytest.mark.slow_variants('finetune')
def test_pfeddyn_heads_run_on_permuted_sparse_classes(head):
  data = to_device(
    load_federated(
      DataConfig(
        dataset='digits',
        partition='sparse_classes_permuted',
        num_clients=5,
        classes_per_client=3,
      )
    )
  )
  assert data.num_classes == 3
  model = fp.models.from_flax(
    'mlp', fp.models.MLP(3, hidden=(16,)), data.train.x[0, :1]
  )
  alg = pfeddyn(
    model,
    5,
    data.train.num_examples,
    3,
    optax.sgd(0.1),
    fp.Batching(batch_size=16, num_epochs=None, num_steps=4),
    head=head,
  )
  runner = RoundRunner(
    alg, data, fp.CohortSampler(5, cohort_size=3), fp.executors.VmapExecutor()
  )
  state = runner.init(jax.random.key(0))
  for t in range(3):
    state, metrics = runner.round(state, jax.random.key(t))
  assert np.isfinite(float(metrics['train_loss']))
  acc = fp.summarize(runner.evaluate(state, jax.random.key(0)))
  assert 0.0 <= acc['accuracy_worst'] <= acc['accuracy_mean'] <= 1.0
  if head == 'prototype':
    # nearest prototype beats chance (1/3) quickly
    assert acc['accuracy_mean'] > 0.5
