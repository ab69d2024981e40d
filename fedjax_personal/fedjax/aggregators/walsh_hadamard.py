"""FedJAX's Walsh-Hadamard transform and structured rotations
(``fedjax.aggregators.walsh_hadamard``): O(n log n) by einsums over small
Hadamard matrices (H_{2^M 2^N} flat(X) = flat(H_{2^M} X H_{2^N})), and
HD x / sqrt(d) with a Rademacher diagonal D (Suresh et al., "Distributed
Mean Estimation with Limited Communication", arXiv:1611.00429)."""

import functools
import math
from typing import Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal.fedjax.core.typing import Params, PRNGKey

__all__ = [
  'hadamard_matrix',
  'inverse_structured_rotation',
  'inverse_structured_rotation_pytree',
  'structured_rotation',
  'structured_rotation_pytree',
  'walsh_hadamard_transform',
]


@functools.partial(jax.jit, static_argnames=('small_n', 'precision'))
def walsh_hadamard_transform(
  x: jax.Array,
  small_n: int = 2**7,
  precision: Union[jax.lax.Precision, str] = 'highest',
) -> jax.Array:
  """The Walsh-Hadamard transform of ``x`` (its length a power of 2).

  Args:
    x: a vector.
    small_n: the largest Hadamard block (a power of 2, > 1; static here:
      FedJAX 0.0.17 traces it and fails when it is given).
    precision: the einsums' precision.

  Returns:
    H x.

  Raises:
    ValueError: ``small_n`` <= 1, or too small for ``x``.
  """
  if small_n <= 1:
    raise ValueError(f'small_n must be > 1, got {small_n}')
  n = len(x)
  shape = []
  while n > 1:
    shape.append(min(n, small_n))
    n //= small_n
  shape.reverse()
  num_dims = len(shape)
  if num_dims + 1 >= 10:
    raise ValueError(f'small_n={small_n} is too small for input size {n}')
  y = x.reshape(shape)
  hadamards = {d: hadamard_matrix(d, x.dtype) for d in set(shape)}
  for i, d in enumerate(shape):
    y_dims = ''.join(str(j) for j in range(num_dims))
    h_dims = f'{i}{num_dims + 1}'
    out_dims = y_dims.replace(str(i), str(num_dims + 1), 1)
    y = jnp.einsum(
      f'{y_dims},{h_dims}->{out_dims}', y, hadamards[d], precision=precision
    )
  return y.flatten()


def hadamard_matrix(n: int, dtype) -> jax.Array:
  """The n x n Hadamard matrix (n a power of 2) in ``dtype``.

  Args:
    n: its size.
    dtype: its dtype.

  Returns:
    The matrix.
  """
  h = np.ones((1, 1))
  while h.shape[0] < n:  # Sylvester's construction, scipy.linalg.hadamard's
    h = np.block([[h, h], [h, -h]])
  return jnp.array(h, dtype)


@jax.jit
def structured_rotation(
  x: jax.Array, rng: PRNGKey
) -> Tuple[jax.Array, jax.Array]:
  """HD x / sqrt(d), x flattened and zero-padded to d = the next power of 2.

  Args:
    x: the array.
    rng: draws D.

  Returns:
    ``(rotated vector, x's shape)``.
  """
  x_flat = jnp.reshape(x, [-1])
  d = 2 ** math.ceil(math.log2(x_flat.size))
  w = jnp.pad(x_flat, (0, d - x.size))
  rademacher = jax.random.rademacher(rng, w.shape)
  return (
    walsh_hadamard_transform(w * rademacher) / jnp.sqrt(d),
    jnp.array(x.shape),
  )


def inverse_structured_rotation(
  x: jax.Array, rng: PRNGKey, original_shape: jax.Array
) -> jax.Array:
  """(HD)^-1 x: the rotation undone and cut back to ``original_shape``.

  Args:
    x: a rotated vector.
    rng: the rotation's key.
    original_shape: the array's shape.

  Returns:
    The array.
  """
  rademacher = jax.random.rademacher(rng, x.shape)
  w = walsh_hadamard_transform(x) * rademacher / jnp.sqrt(x.size)
  y_flat = w.take(jnp.arange(jnp.prod(original_shape)))
  return jnp.reshape(y_flat, original_shape)


def structured_rotation_pytree(
  params: Params, rng: PRNGKey
) -> Tuple[Params, Params]:
  """``structured_rotation`` of every leaf, one split of ``rng`` each.

  Args:
    params: the tree.
    rng: the rotations' key.

  Returns:
    ``(rotated tree, tree of shapes)``.
  """
  leaves, tree_def = jax.tree.flatten(params)
  out = [
    structured_rotation(leaf, r)
    for leaf, r in zip(leaves, jax.random.split(rng, len(leaves)))
  ]
  return (
    jax.tree.unflatten(tree_def, [o[0] for o in out]),
    jax.tree.unflatten(tree_def, [o[1] for o in out]),
  )


def inverse_structured_rotation_pytree(
  params: Params, rng: PRNGKey, shapes: Params
) -> Params:
  """``inverse_structured_rotation`` of every leaf.

  Args:
    params: the rotated tree.
    rng: the rotations' key.
    shapes: the tree of shapes ``structured_rotation_pytree`` returned.

  Returns:
    The tree.
  """
  leaves, tree_def = jax.tree.flatten(params)
  leaf_shapes, _ = jax.tree.flatten(shapes)
  return jax.tree.unflatten(
    tree_def,
    [
      inverse_structured_rotation(leaf, r, shape)
      for leaf, r, shape in zip(
        leaves, jax.random.split(rng, len(leaves)), leaf_shapes
      )
    ],
  )
