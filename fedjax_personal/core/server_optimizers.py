"""Adaptive server optimizers: FedAdagrad, FedYogi, FedAdam.

Reddi et al., "Adaptive Federated Optimization" (arXiv 2003.00295),
Algorithm 2. With Delta_t the cohort's mean model change (x_i - x_t):

    m_t = beta1 m_{t-1} + (1 - beta1) Delta_t
    v_t = v_{t-1} + Delta_t^2                                   (FedAdagrad)
    v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)   (FedYogi)
    v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2                 (FedAdam)
    x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)

with m_{-1} = 0 and v_{-1} = tau^2 (the paper asks v_{-1} >= tau^2), no bias
correction, and the paper's defaults beta1 = 0.9, beta2 = 0.99, tau = 1e-3
(the adaptivity it tunes over 1e-5 .. 1). The server receives the pseudo-
gradient g_t = -Delta_t (``algorithms/fedavg.server_step``): m flips sign
with it, v does not, and the update is -eta m_g / (sqrt(v) + tau).

``keras_adam`` is what google-research/federated's code ran for FedAdam
(``tf.keras.optimizers.Adam``, its ``shared/optimizer_utils.py``): m_0 =
v_0 = 0, bias correction in the step size, epsilon outside the root,

    eta_t = eta sqrt(1 - beta2^t) / (1 - beta1^t)
    x_{t+1} = x_t - eta_t m_t / (sqrt(v_t) + epsilon)

(TensorFlow's ``ApplyAdam``; Keras's defaults beta1 0.9, beta2 0.999, the
code's epsilon the paper's tau). ``keras_yogi`` is its ``keras_optimizers/
yogi.py`` (the same bias-corrected step, v_t = v_{t-1} + (1 - beta2)
sign(g^2 - v_{t-1}) g^2 from v_0 = 0, its flag
``--server_yogi_initial_accumulator_value=0.0``) and ``keras_adagrad``
Keras's Adagrad (``ApplyAdagradV2``: v_t = v_{t-1} + g^2 from v_0 = 0, no
momentum, x_{t+1} = x_t - eta g / (sqrt(v_t) + epsilon)).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = [
  'adaptive_server',
  'AdaptiveState',
  'KERAS_KINDS',
  'KerasAdamState',
  'KINDS',
  'PAPER_KINDS',
  'scale_by_keras',
]


#: Reddi et al.'s Algorithm 2.
PAPER_KINDS = ('adagrad', 'yogi', 'adam')
#: google-research/federated's Keras optimizers (``shared/optimizer_utils.py``).
KERAS_KINDS = ('keras_adagrad', 'keras_yogi', 'keras_adam')
KINDS = PAPER_KINDS + KERAS_KINDS


class AdaptiveState(NamedTuple):
  """First and second moments of the pseudo-gradient (m_t, v_t)."""

  m: optax.Updates
  v: optax.Updates


def scale_by_adaptive_server(
  kind: str, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3
) -> optax.GradientTransformation:
  """``m_t / (sqrt(v_t) + tau)`` of Algorithm 2 for ``kind`` in KINDS."""
  if kind not in PAPER_KINDS:
    raise ValueError(f'kind must be one of {KINDS}, got {kind!r}')

  def init(params):
    return AdaptiveState(
      m=jax.tree.map(jnp.zeros_like, params),
      v=jax.tree.map(lambda p: jnp.full_like(p, tau**2), params),
    )

  def second_moment(v, g):
    g2 = jnp.square(g)
    if kind == 'adagrad':
      return v + g2
    if kind == 'yogi':
      return v - (1 - beta2) * g2 * jnp.sign(v - g2)
    return beta2 * v + (1 - beta2) * g2

  def update(updates, state, params=None):
    del params
    m = jax.tree.map(lambda m, g: beta1 * m + (1 - beta1) * g, state.m, updates)
    v = jax.tree.map(second_moment, state.v, updates)
    out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + tau), m, v)
    return out, AdaptiveState(m=m, v=v)

  return optax.GradientTransformation(init, update)


class KerasAdamState(NamedTuple):
  """A Keras optimizer's step count and moments (m unused by Adagrad)."""

  count: jax.Array  # type: ignore[assignment]  # optax's name (shadows tuple.count)
  m: optax.Updates
  v: optax.Updates


def scale_by_keras(
  kind: str, beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-7
) -> optax.GradientTransformation:
  """The step of a Keras optimizer before the learning rate (module doc),
  from m_0 = v_0 = 0: ``keras_adam`` TensorFlow's ``ApplyAdam``,
  ``keras_yogi`` google-research/federated's ``Yogi``, ``keras_adagrad``
  ``ApplyAdagradV2``.

  Args:
    kind: one of ``KERAS_KINDS``.
    beta1: the first moment's decay (Adam, Yogi).
    beta2: the second moment's decay (Adam, Yogi).
    epsilon: added to the root of the second moment.

  Returns:
    The optax transformation.
  """
  if kind not in KERAS_KINDS:
    raise ValueError(f'kind must be one of {KERAS_KINDS}, got {kind!r}')

  def init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return KerasAdamState(jnp.zeros((), jnp.int32), zeros, zeros)

  def second_moment(v, g):
    g2 = jnp.square(g)
    if kind == 'keras_adagrad':
      return v + g2
    if kind == 'keras_yogi':
      return v + (1 - beta2) * jnp.sign(g2 - v) * g2
    return beta2 * v + (1 - beta2) * g2

  def update(updates, state, params=None):
    del params
    v = jax.tree.map(second_moment, state.v, updates)
    if kind == 'keras_adagrad':
      out = jax.tree.map(lambda g, v: g / (jnp.sqrt(v) + epsilon), updates, v)
      return out, KerasAdamState(state.count + 1, state.m, v)
    t = (state.count + 1).astype(jnp.float32)
    m = jax.tree.map(lambda m, g: beta1 * m + (1 - beta1) * g, state.m, updates)
    correction = jnp.sqrt(1 - beta2**t) / (1 - beta1**t)
    out = jax.tree.map(
      lambda m, v: correction * m / (jnp.sqrt(v) + epsilon), m, v
    )
    return out, KerasAdamState(state.count + 1, m, v)

  return optax.GradientTransformation(init, update)


def adaptive_server(
  kind: str,
  learning_rate: float,
  beta1: float = 0.9,
  beta2: float = 0.99,
  tau: float = 1e-3,
) -> optax.GradientTransformation:
  """FedAdagrad / FedYogi / FedAdam with server learning rate eta.

  Args:
    kind: ``'adagrad'``, ``'yogi'``, ``'adam'`` (Algorithm 2) or
      ``'keras_adagrad'``, ``'keras_yogi'``, ``'keras_adam'`` (the
      publisher's code).
    learning_rate: eta.
    beta1: the first moment's decay.
    beta2: the second moment's decay.
    tau: the adaptivity (epsilon).

  Returns:
    An optax transformation applied to the mean delta.
  """
  scale = (
    scale_by_keras(kind, beta1, beta2, tau)
    if kind in KERAS_KINDS
    else scale_by_adaptive_server(kind, beta1, beta2, tau)
  )
  return optax.chain(scale, optax.scale(-learning_rate))
