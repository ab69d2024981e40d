"""FedJAX's compressed means (``fedjax.aggregators.compression``): each
client's params quantized before the weighted mean, the bits sent counted
in the state. Uniform and binary stochastic quantization and their rotated
form (Suresh et al., "Distributed Mean Estimation with Limited
Communication", arXiv:1611.00429), TernGrad (Wen et al., arXiv:1705.07878)
and structured DRIVE (Vargaftik et al., arXiv:2105.08339), with FedJAX's
keys: each client's key is the next of a sequence that splits one key of
the round (Haiku's ``PRNGSequence``, without Haiku)."""

import math
from typing import Callable, Iterator, Optional, Union

import jax
import jax.numpy as jnp

from fedjax_personal.fedjax.aggregators import walsh_hadamard
from fedjax_personal.fedjax.aggregators.aggregator import Aggregator
from fedjax_personal.fedjax.core import tree_util
from fedjax_personal.fedjax.core.dataclasses import dataclass
from fedjax_personal.fedjax.core.typing import Params, PRNGKey

__all__ = [
  'arithmetic_encoding_num_bits',
  'binary_stochastic_quantize',
  'CompressionState',
  'drive_pytree',
  'num_leaves',
  'rotated_uniform_stochastic_quantizer',
  'structured_drive_quantizer',
  'terngrad_quantize',
  'terngrad_quantize_pytree',
  'terngrad_quantizer',
  'uniform_stochastic_quantize',
  'uniform_stochastic_quantize_pytree',
  'uniform_stochastic_quantizer',
]


@dataclass
class CompressionState:
  """A compression aggregator's state.

  Attributes:
    num_bits: bits sent per client so far (summed over rounds).
    rng: the next round's key.
  """

  num_bits: float
  rng: PRNGKey


def _scaled(v, v_min, v_max):
  """``v`` in [0, 1] between the thresholds (their defaults: its min and
  max), and the thresholds."""
  v_min = jnp.amin(v) if v_min is None else v_min
  v_max = jnp.amax(v) if v_max is None else v_max
  v = jnp.nan_to_num((v - v_min) / (v_max - v_min))
  return jnp.maximum(0.0, jnp.minimum(v, 1.0)), v_min, v_max


def binary_stochastic_quantize(
  v: jax.Array,
  rng: PRNGKey,
  v_min: Optional[Union[float, jax.Array]] = None,
  v_max: Optional[Union[float, jax.Array]] = None,
) -> jax.Array:
  """Each value to ``v_min`` or ``v_max``, unbiased (arXiv:1611.00429).

  Args:
    v: the array.
    rng: the draws' key.
    v_min: the low level (default: ``v``'s min).
    v_max: the high level (default: ``v``'s max).

  Returns:
    The quantized array.
  """
  v, v_min, v_max = _scaled(v, v_min, v_max)
  rand = jax.random.uniform(key=rng, shape=v.shape)
  return jnp.where(rand > v, v_min, v_max)


def uniform_stochastic_quantize(
  v: jax.Array,
  num_levels: int,
  rng: PRNGKey,
  v_min: Optional[Union[float, jax.Array]] = None,
  v_max: Optional[Union[float, jax.Array]] = None,
) -> jax.Array:
  """Each value to one of ``num_levels`` evenly spaced levels, unbiased
  (arXiv:1611.00429).

  Args:
    v: the array.
    num_levels: the levels.
    rng: the draws' key.
    v_min: the lowest level (default: ``v``'s min).
    v_max: the highest (default: ``v``'s max).

  Returns:
    The quantized array.
  """
  v, v_min, v_max = _scaled(v, v_min, v_max)
  v_ceil = jnp.ceil(v * (num_levels - 1)) / (num_levels - 1)
  v_floor = jnp.floor(v * (num_levels - 1)) / (num_levels - 1)
  rand = jax.random.uniform(key=rng, shape=v.shape)
  threshold = jnp.nan_to_num((v - v_floor) / (v_ceil - v_floor))
  quantized = jnp.where(rand > threshold, v_floor, v_ceil)
  return v_min + quantized * (v_max - v_min)


def _each_leaf(quantize, params: Params, rng: PRNGKey) -> Params:
  """``quantize(leaf, key)`` of every leaf, one split of ``rng`` each."""
  leaves, tree_def = jax.tree.flatten(params)
  keys = jax.random.split(rng, len(leaves))
  return jax.tree.unflatten(
    tree_def, [quantize(leaf, k) for leaf, k in zip(leaves, keys)]
  )


@jax.jit
def uniform_stochastic_quantize_pytree(
  params: Params, num_levels: int, rng: PRNGKey
) -> Params:
  """``uniform_stochastic_quantize`` of every leaf.

  Args:
    params: the tree.
    num_levels: the levels.
    rng: the draws' key.

  Returns:
    The quantized tree.
  """
  return _each_leaf(
    lambda leaf, k: uniform_stochastic_quantize(leaf, num_levels, k),
    params,
    rng,
  )


def num_leaves(pytree) -> int:
  """The tree's leaves.

  Args:
    pytree: the tree.

  Returns:
    Their number.
  """
  return len(jax.tree.leaves(pytree))


@jax.jit
def _entropy(v, uniq):
  uniq = jnp.concatenate([uniq, jnp.array([jnp.inf])], axis=0)
  hist, _ = jnp.histogram(v, bins=uniq)
  hist = hist / jnp.sum(hist)
  return -jnp.sum(hist * jnp.log2(hist))


@jax.jit
def _hist_bits(v, uniq):
  d, k = v.size, uniq.size
  return k * jnp.log2(jnp.exp(1) * (d + k) / k)


def arithmetic_encoding_num_bits(v: jax.Array):
  """Bits arithmetic coding of ``v`` takes: its histogram's, its
  entropy's, and two floats.

  Args:
    v: the array.

  Returns:
    The bits (a scalar).
  """
  v = jnp.nan_to_num(v).flatten()
  uniq = jnp.unique(v)
  return _hist_bits(v, uniq) + v.size * _entropy(v, uniq) + 2 * 32 + 2


def _key_sequence(rng: PRNGKey) -> Iterator[PRNGKey]:
  """Haiku's ``PRNGSequence(rng)``: each next key the second half of a
  split, the first carried on."""
  while True:
    rng, key = jax.random.split(rng)
    yield key


def _compressed_mean(quantize: Callable, clients, rng: PRNGKey, on_each=None):
  """The weighted mean of ``quantize(params, key)`` of each client, its key
  the next of ``_key_sequence(rng)``; ``on_each(quantized)`` sees each."""
  pairs = []
  for (_, params, weight), key in zip(clients, _key_sequence(rng)):
    quantized = quantize(params, key)
    if on_each is not None:
      on_each(quantized)
    pairs.append((quantized, weight))
  return tree_util.tree_mean(pairs)


def _fixed_bits(params: Params, bits_per_param: float) -> float:
  """``bits_per_param`` per parameter and two 32-bit floats per leaf."""
  return bits_per_param * tree_util.tree_size(params) + 32 * 2 * num_leaves(
    params
  )


def uniform_stochastic_quantizer(
  num_levels: int, rng: PRNGKey, encode_algorithm: Optional[str] = None
) -> Aggregator:
  """The weighted mean of uniformly quantized params (arXiv:1611.00429).

  Args:
    num_levels: the levels.
    rng: the aggregator's key.
    encode_algorithm: None (log2(num_levels) bits a parameter) or
      'arithmetic' (the bits arithmetic coding takes, averaged over the
      clients).

  Returns:
    The ``Aggregator``.
  """

  def apply(clients_params_and_weights, state: CompressionState):
    if encode_algorithm is not None:
      assert encode_algorithm == 'arithmetic'
    rng, use_rng = jax.random.split(state.rng)
    bits = []

    def count(quantized):
      bits.append(
        sum(
          arithmetic_encoding_num_bits(leaf)
          for leaf in jax.tree.leaves(quantized)
        )
      )

    aggregate = _compressed_mean(
      lambda p, k: uniform_stochastic_quantize_pytree(p, num_levels, k),
      clients_params_and_weights,
      use_rng,
      count if encode_algorithm == 'arithmetic' else None,
    )
    if encode_algorithm == 'arithmetic':
      new_bits = sum(bits) / len(bits) if bits else 0.0
    else:
      new_bits = _fixed_bits(aggregate, math.log2(num_levels))
    return aggregate, CompressionState(state.num_bits + new_bits, rng)

  return Aggregator(lambda: CompressionState(0.0, rng), apply)


def rotated_uniform_stochastic_quantizer(
  num_levels: int, rng: PRNGKey
) -> Aggregator:
  """The weighted mean of params rotated (HD), uniformly quantized and
  rotated back (arXiv:1611.00429); one rotation a round for every client.

  Args:
    num_levels: the levels.
    rng: the aggregator's key.

  Returns:
    The ``Aggregator``.
  """

  def apply(clients_params_and_weights, state: CompressionState):
    rng, rotation_rng = jax.random.split(state.rng)

    def quantize(params, key):
      rotated, shapes = walsh_hadamard.structured_rotation_pytree(
        params, rotation_rng
      )
      return walsh_hadamard.inverse_structured_rotation_pytree(
        uniform_stochastic_quantize_pytree(rotated, num_levels, key),
        rotation_rng,
        shapes,
      )

    rng, use_rng = jax.random.split(rng)
    aggregate = _compressed_mean(quantize, clients_params_and_weights, use_rng)
    new_bits = _fixed_bits(aggregate, math.log2(num_levels))
    return aggregate, CompressionState(state.num_bits + new_bits, rng)

  return Aggregator(lambda: CompressionState(0.0, rng), apply)


@jax.jit
def drive_pytree(params: Params) -> Params:
  """DRIVE's one-bit quantization of every leaf with its unbiased scale
  ||x||^2 / ||x||_1 (arXiv:2105.08339, section 4.2).

  Args:
    params: the (rotated) tree.

  Returns:
    The quantized tree.
  """
  return jax.tree.map(
    lambda leaf: (
      jnp.sum(jnp.power(leaf, 2)) * jnp.sign(leaf) / jnp.sum(jnp.abs(leaf))
    ),
    params,
  )


def structured_drive_quantizer(rng: PRNGKey) -> Aggregator:
  """The weighted mean of structured DRIVE's quantized params
  (arXiv:2105.08339): each client rotated with its own key.

  Args:
    rng: the aggregator's key.

  Returns:
    The ``Aggregator``.
  """

  def apply(clients_params_and_weights, state: CompressionState):
    rng, rotation_rng = jax.random.split(state.rng)

    def quantize(params, key):
      rotated, shapes = walsh_hadamard.structured_rotation_pytree(params, key)
      return walsh_hadamard.inverse_structured_rotation_pytree(
        drive_pytree(rotated), key, shapes
      )

    aggregate = _compressed_mean(
      quantize, clients_params_and_weights, rotation_rng
    )
    new_bits = _fixed_bits(aggregate, 1.0)
    return aggregate, CompressionState(state.num_bits + new_bits, rng)

  return Aggregator(lambda: CompressionState(0.0, rng), apply)


def terngrad_quantize(v: jax.Array, rng: PRNGKey) -> jax.Array:
  """TernGrad (arXiv:1705.07878): values clipped to 2.5 standard
  deviations, then each to 0 or +-max, unbiased.

  Args:
    v: the array.
    rng: the draws' key.

  Returns:
    The quantized array.
  """
  sigma = jnp.std(v)
  v = jnp.where(jnp.abs(v) > 2.5 * sigma, 2.5 * sigma * jnp.sign(v), v)
  return binary_stochastic_quantize(
    jnp.abs(v), rng, 0.0, jnp.amax(jnp.abs(v))
  ) * jnp.sign(v)


@jax.jit
def terngrad_quantize_pytree(params: Params, rng: PRNGKey) -> Params:
  """``terngrad_quantize`` of every leaf.

  Args:
    params: the tree.
    rng: the draws' key.

  Returns:
    The quantized tree.
  """
  return _each_leaf(terngrad_quantize, params, rng)


def terngrad_quantizer(rng: PRNGKey) -> Aggregator:
  """The weighted mean of TernGrad's quantized params (arXiv:1705.07878).

  Args:
    rng: the aggregator's key.

  Returns:
    The ``Aggregator``.
  """

  def apply(clients_params_and_weights, state: CompressionState):
    rng, use_rng = jax.random.split(state.rng)
    aggregate = _compressed_mean(
      terngrad_quantize_pytree, clients_params_and_weights, use_rng
    )
    new_bits = _fixed_bits(aggregate, math.log2(3))
    return aggregate, CompressionState(state.num_bits + new_bits, rng)

  return Aggregator(lambda: CompressionState(0.0, rng), apply)
