"""Initialisation conventions: each framework's default initialisers.

A model built with ``convention='flax' | 'pytorch' | 'keras' | 'haiku'`` draws
its first parameters the way that framework's layers do by default, so that a
protocol taken from a paper's PyTorch, Keras or Haiku (FedJAX) code starts from
the same distribution (``--model_init``). Parameter names and shapes do not
change.

Dense kernels are [fan_in, fan_out]; convolution kernels HWIO, whose fan-in is
kh * kw * Cin and fan-out kh * kw * Cout; embeddings [vocabulary, features].

| layer | ``flax`` (Linen defaults) | ``pytorch`` (``torch.nn`` defaults) | ``keras`` (Keras 3 defaults) | ``haiku`` (Haiku defaults, FedJAX's models) |
|---|---|---|---|---|
| Dense / Conv kernel | LeCun normal: truncated normal, variance 1 / fan_in | ``kaiming_uniform_(a=sqrt(5))``: U(-b, b), b = 1 / sqrt(fan_in) | Glorot uniform: U(-b, b), b = sqrt(6 / (fan_in + fan_out)) | s * N(0, 1) truncated at +-2, s = 1 / sqrt(fan_in) (not rescaled: variance 0.774 / fan_in) |
| Dense / Conv bias | 0 | U(-b, b), b = 1 / sqrt(fan_in) | 0 | 0 |
| Embedding | normal, variance 1 / features | N(0, 1) | U(-0.05, 0.05) | N(0, 1) truncated at +-2 |
| LSTM input kernel | LeCun normal per gate | U(-k, k), k = 1 / sqrt(hidden) | Glorot uniform over the [in, 4 hidden] kernel | one ``Linear`` over [x, h]: s * N(0, 1) truncated at +-2, s = 1 / sqrt(in + hidden) |
| LSTM recurrent kernel | orthogonal per gate | U(-k, k) | orthogonal [hidden, 4 hidden] (rows orthonormal) | the same draw as the input kernel |
| LSTM bias | 0 | b_ih + b_hh, each U(-k, k) | 0, forget gate 1 (``unit_forget_bias``) | 0, forget gate 1 (``hk.LSTM`` adds 1 to the forget gate's pre-activation) |

References: ``torch.nn.Linear.reset_parameters``, ``torch.nn.Conv2d`` (same),
``torch.nn.Embedding`` and ``torch.nn.LSTM`` (PyTorch docs, "Variables");
``keras.layers.Dense`` / ``Conv2D`` (``glorot_uniform``, ``zeros``),
``keras.layers.Embedding`` (``uniform``, +-0.05), ``keras.layers.LSTM``
(``glorot_uniform``, ``orthogonal``, ``unit_forget_bias=True``);
``hk.Linear`` / ``hk.Conv2D`` (``TruncatedNormal(1 / sqrt(fan_in))``, which
scales the +-2-truncated standard normal without correcting its variance),
``hk.Embed`` (``TruncatedNormal(1)``), ``hk.LSTM`` (one ``hk.Linear(4 H)`` of
[x, h]; ``sigmoid(f + 1)``: the +1 is here the forget bias's initial value,
the same function and, under any optimizer that does not decay the bias, the
same training). Flax's
single LSTM bias plays PyTorch's two (b_ih + b_hh enter the gates only as a
sum), so its PyTorch draw is the sum of two uniforms. Gate order is
i, f, g, o here (Haiku's own kernel is ordered i, g, f, o).
"""

import functools
from typing import Dict

import jax
import jax.numpy as jnp

from fedjax_personal.errors import ConfigError

__all__ = [
  'bias_init',
  'check',
  'describe',
  'embedding_init',
  'GATES',
  'INITS',
  'kernel_init',
  'lstm_params',
]


INITS = ('flax', 'pytorch', 'keras', 'haiku')
KERAS_EMBEDDING_LIMIT = 0.05
GATES = ('i', 'f', 'g', 'o')


def check(init: str) -> str:
  """``init`` if it is a known convention, else a ConfigError naming
  ``--model_init``.

  Args:
    init: a convention's name.

  Returns:
    ``init``.
  """
  if init not in INITS:
    raise ConfigError(
      'model_init',
      f'unknown initialisation {init!r}; choose one of {list(INITS)}',
    )
  return init


def _uniform(bound):
  def draw(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return draw


def fans(shape) -> tuple:
  """(fan_in, fan_out) of a [in, out] or HWIO kernel."""
  receptive = 1
  for d in shape[:-2]:
    receptive *= d
  return shape[-2] * receptive, shape[-1] * receptive


def _haiku_truncated_normal(key, shape, stddev, dtype=jnp.float32):
  """``hk.initializers.TruncatedNormal(stddev)``: ``stddev`` times a
  standard normal truncated at +-2 (the truncation's variance left as it
  is)."""
  return stddev * jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype)


def kernel_init(init: str):
  """The initialiser of a Dense or Conv kernel ([in, out] or HWIO).

  Args:
    init: the convention.

  Returns:
    A Flax initialiser.
  """
  check(init)
  if init == 'haiku':

    def draw(key, shape, dtype=jnp.float32):
      return _haiku_truncated_normal(
        key, shape, 1 / fans(shape)[0] ** 0.5, dtype
      )

    return draw
  if init == 'flax':
    return jax.nn.initializers.lecun_normal()
  if init == 'pytorch':
    # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / (1 + 5)), bound gain * sqrt(3 /
    # fan_in).
    return jax.nn.initializers.variance_scaling(1 / 3, 'fan_in', 'uniform')
  return jax.nn.initializers.glorot_uniform()


def bias_init(init: str, fan_in: int):
  """The initialiser of the bias of a layer whose kernel has ``fan_in``.

  Args:
    init: the convention.
    fan_in: the kernel's fan-in.

  Returns:
    A Flax initialiser.
  """
  check(init)
  if init == 'pytorch':
    return _uniform(1 / fan_in**0.5 if fan_in > 0 else 0.0)
  return jax.nn.initializers.zeros


def embedding_init(init: str):
  """The initialiser of an embedding table [vocabulary, features].

  Args:
    init: the convention.

  Returns:
    A Flax initialiser.
  """
  check(init)
  if init == 'pytorch':
    return jax.nn.initializers.normal(1.0)
  if init == 'keras':
    return _uniform(KERAS_EMBEDDING_LIMIT)
  if init == 'haiku':
    return lambda key, shape, dtype=jnp.float32: _haiku_truncated_normal(
      key, shape, 1.0, dtype
    )
  return jax.nn.initializers.variance_scaling(
    1.0, 'fan_in', 'normal', out_axis=0
  )


def lstm_params(
  init: str, key: jax.Array, in_features: int, hidden: int
) -> Dict[str, dict]:
  """One LSTM layer's parameters drawn jointly, in the layout of Flax's
  ``OptimizedLSTMCell``: ``{'ii': {'kernel': [in, H]}, ..., 'hi': {'kernel':
  [H, H], 'bias': [H]}, ...}`` for the gates i, f, g, o.

  Drawn as one [in, 4H] input kernel, one [H, 4H] recurrent kernel and one
  [4H] bias, then split by gate, so that Keras' Glorot bound and orthogonal
  recurrent matrix are those of the whole kernels, as Keras draws them
  (Haiku's: one [in + H, 4H] kernel, split into the two).

  Args:
    init: the convention.
    key: the PRNG key.
    in_features: the input width.
    hidden: the hidden width.

  Returns:
    The layer's parameters.
  """
  check(init)
  k_in, k_rec, k_b1, k_b2 = jax.random.split(key, 4)
  h4 = 4 * hidden
  if init == 'pytorch':
    u = _uniform(1 / hidden**0.5)
    w_in, w_rec = u(k_in, (in_features, h4)), u(k_rec, (hidden, h4))
    bias = u(k_b1, (h4,)) + u(k_b2, (h4,))
  elif init == 'keras':
    w_in = jax.nn.initializers.glorot_uniform()(k_in, (in_features, h4))
    w_rec = jax.nn.initializers.orthogonal()(k_rec, (hidden, h4))
    bias = jnp.zeros(h4).at[hidden : 2 * hidden].set(1.0)
  elif init == 'haiku':
    w = _haiku_truncated_normal(
      k_in, (in_features + hidden, h4), 1 / (in_features + hidden) ** 0.5
    )
    w_in, w_rec = w[:in_features], w[in_features:]
    bias = jnp.zeros(h4).at[hidden : 2 * hidden].set(1.0)
  else:
    w_in = jnp.concatenate(
      [
        jax.nn.initializers.lecun_normal()(k, (in_features, hidden))
        for k in jax.random.split(k_in, 4)
      ],
      -1,
    )
    w_rec = jnp.concatenate(
      [
        jax.nn.initializers.orthogonal()(k, (hidden, hidden))
        for k in jax.random.split(k_rec, 4)
      ],
      -1,
    )
    bias = jnp.zeros(h4)
  out = {}
  for g, name in enumerate(GATES):
    cols = slice(g * hidden, (g + 1) * hidden)
    out[f'i{name}'] = {'kernel': w_in[:, cols]}
    out[f'h{name}'] = {'kernel': w_rec[:, cols], 'bias': bias[cols]}
  return out


@functools.lru_cache(maxsize=None)
def describe(init: str) -> str:
  """One line naming the convention's kernel and bias rule."""
  return {
    'flax': 'Flax defaults (LeCun normal kernels, zero biases)',
    'pytorch': 'PyTorch defaults (U(+-1/sqrt(fan_in)) kernels and biases)',
    'keras': 'Keras defaults (Glorot uniform kernels, zero biases)',
    'haiku': 'Haiku defaults (truncated normal kernels of scale 1/sqrt(fan_in), zero '
    'biases)',
  }[check(init)]
