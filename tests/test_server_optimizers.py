"""FedAdagrad, FedYogi and FedAdam against Reddi et al.'s Algorithm 2
("Adaptive Federated Optimization", arXiv 2003.00295) written as a NumPy
loop, alone and inside a FedAvg round; their settings are refused where they
do nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import digits_data, run_rounds

from fedjax_personal import algorithms
from fedjax_personal.config import TrainingConfig
from fedjax_personal.core import server_optimizers
from fedjax_personal.errors import ConfigError


def paper_steps(kind, deltas, eta, b1, b2, tau):
  """x_T - x_0 after Algorithm 2's server updates for mean changes
  ``deltas``."""
  m, v, x = (
    np.zeros_like(deltas[0]),
    np.full_like(deltas[0], tau**2),
    np.zeros_like(deltas[0]),
  )
  for d in deltas:
    m = b1 * m + (1 - b1) * d
    if kind == 'adagrad':
      v = v + d**2
    elif kind == 'yogi':
      v = v - (1 - b2) * d**2 * np.sign(v - d**2)
    else:
      v = b2 * v + (1 - b2) * d**2
    x = x + eta * m / (np.sqrt(v) + tau)
  return x


# Algorithm 2; 'keras_adam' is the publisher's code's
PAPER = (
  'adagrad',
  'yogi',
  'adam',
)


@pytest.mark.parametrize('kind', PAPER)
def test_updates_follow_algorithm_2(kind):
  rng = np.random.default_rng(0)
  deltas = [
    rng.normal(0, s, 7).astype(np.float64) for s in (0.1, 0.01, 0.5, 0.03)
  ]
  eta, b1, b2, tau = 0.3, 0.8, 0.95, 1e-2
  opt = server_optimizers.adaptive_server(kind, eta, b1, b2, tau)
  params = {
    'w': jnp.zeros(7, jnp.float64)
    if jax.config.jax_enable_x64
    else jnp.zeros(7)
  }
  state = opt.init(params)
  for d in deltas:  # the server sees the pseudo-gradient -Delta
    updates, state = opt.update(
      {'w': -jnp.asarray(d, params['w'].dtype)}, state, params
    )
    params = optax.apply_updates(params, updates)
  np.testing.assert_allclose(
    params['w'],
    paper_steps(kind, deltas, eta, b1, b2, tau),
    rtol=2e-5,
    atol=1e-7,
  )


def keras_steps(deltas, eta, b1, b2, eps):
  """x_T - x_0 after TensorFlow's ApplyAdam (tf.keras.optimizers.Adam, what
  google-research/federated ran for FedAdam) on the pseudo-gradients -Delta: m_0
  = v_0 = 0, eta_t = eta sqrt(1 - b2^t) / (1 - b1^t), epsilon outside the
  root."""
  m, v, x = (np.zeros_like(deltas[0]) for _ in range(3))
  for t, d in enumerate(deltas, 1):
    g = -d
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g**2
    x = x - eta * np.sqrt(1 - b2**t) / (1 - b1**t) * m / (np.sqrt(v) + eps)
  return x


def test_keras_adam_follows_tensorflows_apply_adam_and_differs_from_algorithm_2():
  rng = np.random.default_rng(1)
  deltas = [rng.normal(0, s, 5) for s in (0.1, 0.01, 0.5)]
  eta, b1, b2, eps = 0.01, 0.9, 0.999, 1e-3
  opt = server_optimizers.adaptive_server('keras_adam', eta, b1, b2, eps)
  params = {'w': jnp.zeros(5)}
  state = opt.init(params)
  for d in deltas:
    updates, state = opt.update(
      {'w': -jnp.asarray(d, jnp.float32)}, state, params
    )
    params = optax.apply_updates(params, updates)
  want = keras_steps(deltas, eta, b1, b2, eps)
  np.testing.assert_allclose(params['w'], want, rtol=2e-5, atol=1e-8)
  assert (
    np.abs(want - paper_steps('adam', deltas, eta, b1, b2, eps)).max() > 1e-4
  )
  assert TrainingConfig(
    server_optimizer='keras_adam', server_beta2=0.999
  ).make_server_optimizer()


def test_the_three_differ_and_yogi_grows_v_slower_than_adagrad():
  d = [np.full(3, 0.5)] * 3
  got = {k: paper_steps(k, d, 1.0, 0.9, 0.99, 1e-3)[0] for k in PAPER}
  assert len(set(np.round(list(got.values()), 6))) == 3
  assert got['yogi'] > got['adagrad']  # adagrad's v sums every Delta^2


@pytest.mark.parametrize(
  'kind', [pytest.param('yogi', marks=pytest.mark.slow), 'adagrad']
)
def test_fedavg_round_with_an_adaptive_server(kind):
  """One round: the mean change of plain FedAvg (server SGD, lr 1), then
  Algorithm 2's step on it."""
  data = digits_data(num_clients=4, max_examples=200)
  from fedjax_personal.models import MLP, from_flax

  model = from_flax(
    'mlp', MLP(data.num_classes, hidden=(8,)), data.train.x[0, :1]
  )
  common = dict(client_lr=0.1, batch_size=16, local_steps=2)
  _, plain = run_rounds(
    algorithms.build('fedavg', model, data, **common), data, rounds=1
  )
  _, adaptive = run_rounds(
    algorithms.build(
      'fedavg', model, data, server_optimizer=kind, server_lr=0.05, **common
    ),
    data,
    rounds=1,
  )
  start = model.init(jax.random.key(0))
  for leaf0, leaf_plain, leaf_ad in zip(
    jax.tree.leaves(start),
    jax.tree.leaves(plain.params),
    jax.tree.leaves(adaptive.params),
  ):
    delta = np.asarray(leaf_plain - leaf0, np.float64)
    want = np.asarray(leaf0) + paper_steps(kind, [delta], 0.05, 0.9, 0.99, 1e-3)
    np.testing.assert_allclose(np.asarray(leaf_ad), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
  'settings,flag',
  [
    (dict(server_beta1=0.5), 'server_beta1'),  # sgd
    (dict(server_optimizer='adagrad', server_beta2=0.9), 'server_beta2'),
    (dict(server_optimizer='yogi', server_momentum=0.9), 'server_momentum'),
    (dict(server_tau=0.1), 'server_tau'),
  ],
)
def test_settings_that_do_nothing_are_refused(settings, flag):
  with pytest.raises(ConfigError, match=f'--{flag}: does nothing'):
    TrainingConfig(**settings).check()
