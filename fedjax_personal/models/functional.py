"""Parameter trees and functions of the small layers some algorithms add
beside the model (FedCP's policy network, GPFL's conditional valve): a dense
layer followed by a layer normalization, initialized as PyTorch initializes
``Linear`` and ``LayerNorm``, applied as plain functions of their
parameters."""

import jax
import jax.numpy as jnp

from fedjax_personal.models import initializers

__all__ = ['dense_norm_params', 'layer_norm']

#: PyTorch's ``LayerNorm`` epsilon (Flax's default is 1e-6).
TORCH_LAYER_NORM_EPS = 1e-5


def dense_norm_params(key, fan_in: int, fan_out: int):
  """``{'kernel' [in, out], 'bias', 'scale', 'shift'}`` of a ``Linear``
  (PyTorch's initialization: U(+-1/sqrt(fan_in)) for both) and the
  ``LayerNorm`` after it (scale 1, shift 0).

  Args:
    key: draws the dense layer.
    fan_in: its inputs.
    fan_out: its outputs.

  Returns:
    The parameters.
  """
  k_kernel, k_bias = jax.random.split(key)
  return {
    'kernel': initializers.kernel_init('pytorch')(k_kernel, (fan_in, fan_out)),
    'bias': initializers.bias_init('pytorch', fan_in)(k_bias, (fan_out,)),
    'scale': jnp.ones(fan_out, jnp.float32),
    'shift': jnp.zeros(fan_out, jnp.float32),
  }


def layer_norm(h, scale, shift, eps: float = TORCH_LAYER_NORM_EPS):
  """PyTorch's ``LayerNorm`` over the last axis: the biased variance, ``eps``
  inside the square root.

  Args:
    h: [..., D].
    scale: [D].
    shift: [D].
    eps: the epsilon.

  Returns:
    [..., D].
  """
  mean = jnp.mean(h, axis=-1, keepdims=True)
  var = jnp.mean((h - mean) ** 2, axis=-1, keepdims=True)
  return (h - mean) / jnp.sqrt(var + eps) * scale + shift
