"""FedNova and q-FFL against one round computed by hand: each client's local
SGD redone by a plain loop on the engine's batches, then the paper's
aggregation rule written out."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
  least_squares_data,
  linear_model,
  max_diff,
  reference_sgd,
  run_rounds,
)

from fedjax_personal import algorithms
from fedjax_personal.algorithms.fednova import effective_steps
from fedjax_personal.core import batching as batching_lib

LR = 0.05


def one_round(name, sizes, momentum=0.0, batch_size=2, **own):
  """(initial params, params after one round, per-client (n, tau, theta_i, xs,
  ys))."""
  data, xs, ys = least_squares_data(num_clients=len(sizes), sizes=sizes)
  model = linear_model(3)
  extra = dict(client_momentum=momentum) if momentum else {}
  alg = algorithms.build(
    name, model, data, client_lr=LR, batch_size=batch_size, **extra, **own
  )
  start = alg.init(jax.random.key(0))
  _, state = run_rounds(alg, data, rounds=1)
  batching = batching_lib.Batching(batch_size, num_epochs=1)
  _, k_clients = jax.random.split(jax.random.key(0))
  theta = start.params
  clients = []
  for i, n in enumerate(sizes):
    p = reference_sgd(
      model,
      theta,
      data.train.x[i],
      data.train.y[i],
      n,
      jax.random.fold_in(k_clients, i),
      batching,
      LR,
      momentum=momentum or None,
    )
    clients.append((n, -(-n // batch_size), p, xs[i], ys[i]))
  return model, theta, state, clients


def test_fednova_normalizes_unequal_step_counts_by_hand():
  # 3 and 7 examples in batches of 2: 2 and 4 local steps.
  _, theta, state, clients = one_round('fednova', (3, 7))
  assert [c[1] for c in clients] == [2, 4]
  n = np.array([c[0] for c in clients], np.float64)
  p = n / n.sum()
  tau_eff = sum(pi * c[1] for pi, c in zip(p, clients))
  d = [jax.tree.map(lambda a, b: (a - b) / c[1], theta, c[2]) for c in clients]
  want = jax.tree.map(
    lambda t, *ds: t - tau_eff * sum(pi * di for pi, di in zip(p, ds)),
    theta,
    *d,
  )
  assert max_diff(state.params, want) < 1e-6
  # FedAvg's n_i-weighted mean of the models differs here (unequal steps).
  fedavg = jax.tree.map(
    lambda *ps: sum(pi * pj for pi, pj in zip(p, ps)), *[c[2] for c in clients]
  )
  assert max_diff(state.params, fedavg) > 1e-4


def test_fednova_with_momentum_uses_the_momentum_step_count():
  rho = 0.5
  _, theta, state, clients = one_round('fednova', (3, 7), momentum=rho)
  a = [
    sum((1 - rho ** (k + 1)) / (1 - rho) for k in range(c[1])) for c in clients
  ]
  np.testing.assert_allclose(
    [effective_steps(c[1], rho) for c in clients], a, rtol=1e-6
  )
  p = np.array([c[0] for c in clients], np.float64)
  p /= p.sum()
  tau_eff = sum(pi * ai for pi, ai in zip(p, a))
  want = jax.tree.map(
    lambda t, *ps: (
      t - tau_eff * sum(pi * (t - pj) / ai for pi, pj, ai in zip(p, ps, a))
    ),
    theta,
    *[c[2] for c in clients],
  )
  assert max_diff(state.params, want) < 1e-6


@pytest.mark.slow
def test_fednova_with_equal_steps_is_fedavg():
  _, _, nova, clients = one_round('fednova', (6, 6))
  _, _, avg, _ = one_round('fedavg', (6, 6))
  assert max_diff(nova.params, avg.params) < 1e-6


def test_fednova_refuses_adam_and_persistent_optimizer_state():
  data, _, _ = least_squares_data()
  with pytest.raises(ValueError, match='--client_optimizer'):
    algorithms.build('fednova', linear_model(3), data, client_optimizer='adam')
  with pytest.raises(
    ValueError, match='--client_opt_state: does nothing for fednova'
  ):
    algorithms.build(
      'fednova',
      linear_model(3),
      data,
      client_momentum=0.9,
      client_opt_state='persistent',
    )


@pytest.mark.parametrize('q', [0.5, 2.0])
@pytest.mark.ci_variants('2.0')
def test_qffl_round_by_hand(q):
  model, theta, state, clients = one_round('qffl', (3, 7, 5), q=q)
  lip = 1 / LR
  deltas, hs = [], []
  for _, _, p, x, y in clients:
    pred = np.asarray(model.apply(theta, jnp.asarray(x)))
    # F_k(theta) on the client's training data
    f = float(np.mean(0.5 * (pred - y) ** 2))
    dw = jax.tree.map(lambda a, b: lip * (a - b), theta, p)
    norm2 = sum(float(jnp.sum(v**2)) for v in jax.tree.leaves(dw))
    deltas.append(jax.tree.map(lambda v: f**q * v, dw))
    hs.append(q * f ** (q - 1) * norm2 + lip * f**q)
  want = jax.tree.map(lambda t, *ds: t - sum(ds) / sum(hs), theta, *deltas)
  assert max_diff(state.params, want) < 1e-5


@pytest.mark.slow
def test_qffl_with_q_zero_is_uniform_fedavg():
  _, _, q0, _ = one_round('qffl', (3, 7, 5), q=0.0)
  _, _, avg, _ = one_round('fedavg', (3, 7, 5), weighting='uniform')
  assert max_diff(q0.params, avg.params) < 1e-6
