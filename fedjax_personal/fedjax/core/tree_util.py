"""FedJAX's ``fedjax.tree_util``: sums, weighted means and norms of pytrees
(the server's mean of client deltas in FedJAX's examples)."""

from typing import Iterable, Tuple

import jax
import jax.numpy as jnp

from fedjax_personal.fedjax.core.typing import PyTree

__all__ = [
  'tree_add',
  'tree_clip_by_global_norm',
  'tree_inverse_weight',
  'tree_l2_norm',
  'tree_l2_squared',
  'tree_mean',
  'tree_size',
  'tree_sum',
  'tree_weight',
  'tree_zeros_like',
]


@jax.jit
def tree_weight(pytree: PyTree, weight: float) -> PyTree:
  """Each leaf times ``weight``."""
  return jax.tree.map(lambda leaf: leaf * weight, pytree)


def tree_inverse_weight(pytree: PyTree, weight: float) -> PyTree:
  """Each leaf times ``1 / weight`` (zero when ``weight`` is not positive).

  Args:
    pytree: the tree.
    weight: the divisor.

  Returns:
    The tree.
  """
  return tree_weight(pytree, 1.0 / weight if weight > 0.0 else 0.0)


@jax.jit
def tree_zeros_like(pytree: PyTree) -> PyTree:
  """Zeros shaped as ``pytree``."""
  return jax.tree.map(jnp.zeros_like, pytree)


@jax.jit
def tree_add(left: PyTree, right: PyTree) -> PyTree:
  """The leafwise sum of two trees."""
  return jax.tree.map(jnp.add, left, right)


def tree_sum(pytrees: Iterable[PyTree]) -> PyTree:
  """The leafwise sum of trees.

  Args:
    pytrees: the trees.

  Returns:
    Their sum (None for none).
  """
  total = None
  for pytree in pytrees:
    total = (
      jax.tree.map(jnp.array, pytree)
      if total is None
      else tree_add(total, pytree)
    )
  return total


def tree_mean(pytrees_and_weights: Iterable[Tuple[PyTree, float]]) -> PyTree:
  """The weighted mean of trees, accumulated one tree at a time as FedJAX.

  Args:
    pytrees_and_weights: ``(tree, weight)`` pairs.

  Returns:
    sum_i w_i t_i / sum_i w_i (zero when the weights sum to 0).
  """
  total, weights = None, 0.0
  for pytree, weight in pytrees_and_weights:
    weighted = tree_weight(pytree, weight)
    total = weighted if total is None else tree_add(total, weighted)
    weights += weight
  return tree_inverse_weight(total, weights)


@jax.jit
def tree_size(pytree: PyTree) -> int:
  """The number of scalars in the tree's leaves."""
  return sum(leaf.size for leaf in jax.tree.leaves(pytree))


@jax.jit
def tree_l2_squared(pytree: PyTree) -> jax.Array:
  """The squared l2 norm of all leaves together."""
  return jnp.asarray(sum(jnp.vdot(x, x) for x in jax.tree.leaves(pytree)))


@jax.jit
def tree_l2_norm(pytree: PyTree) -> jax.Array:
  """The l2 norm of all leaves together."""
  return jnp.sqrt(tree_l2_squared(pytree))


@jax.jit
def tree_clip_by_global_norm(pytree: PyTree, max_norm: float) -> PyTree:
  """The tree scaled by min(1, max_norm / its global l2 norm)."""
  scale = jnp.minimum(1, max_norm / tree_l2_norm(pytree))
  return jax.tree.map(lambda t: scale * t, pytree)
