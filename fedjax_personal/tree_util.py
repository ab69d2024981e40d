"""Small pytree helpers shared by the engine and the algorithms."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def is_concrete(x) -> bool:
  """False for a traced value (a hyperparameter swept inside ``jax.vmap``):
  argument checks skip those; the CLI validates sweep values beforehand."""
  return not isinstance(x, jax.core.Tracer)


def tree_where(cond, x: PyTree, y: PyTree) -> PyTree:
  """Selects `x` where the scalar `cond` holds, else `y`, leaf by leaf."""
  return jax.tree.map(lambda a, b: jnp.where(cond, a, b), x, y)


def tree_add(x: PyTree, y: PyTree) -> PyTree:
  return jax.tree.map(jnp.add, x, y)


def tree_sub(x: PyTree, y: PyTree) -> PyTree:
  return jax.tree.map(jnp.subtract, x, y)


def tree_scale(x: PyTree, s) -> PyTree:
  return jax.tree.map(lambda a: a * s, x)


def tree_vdot(x: PyTree, y: PyTree):
  """Sum over leaves of <x, y>."""
  return sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)))


def tree_sq_norm(x: PyTree):
  return sum(jnp.sum(jnp.square(a)) for a in jax.tree.leaves(x))


def tree_zeros_like(x: PyTree) -> PyTree:
  return jax.tree.map(jnp.zeros_like, x)


def tree_gather(x: PyTree, idx) -> PyTree:
  """x[idx] on the leading (client) axis of every leaf; out-of-range idx clipped."""
  return jax.tree.map(lambda a: a.at[idx].get(mode='clip'), x)


def tree_scatter(x: PyTree, idx, values: PyTree) -> PyTree:
  """x.at[idx].set(values) on the leading axis; out-of-range idx are dropped.

  The engine pads cohorts with the index N (one past the last client), so
  padded slots never overwrite a real client's state.
  """
  return jax.tree.map(lambda a, v: a.at[idx].set(v, mode='drop'), x, values)


def tree_stack(trees) -> PyTree:
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def tree_broadcast(x: PyTree, n: int) -> PyTree:
  """Stacks n copies of x on a new leading axis."""
  return jax.tree.map(lambda a: jnp.broadcast_to(a, (n,) + a.shape), x)


def tree_bytes(x: PyTree) -> int:
  """Bytes of all array leaves of x (works on arrays and ShapeDtypeStructs)."""
  return int(sum(np.prod(a.shape, dtype=np.int64) * np.dtype(a.dtype).itemsize
                 for a in jax.tree.leaves(x)))


def tree_size(x: PyTree) -> int:
  return int(sum(np.prod(a.shape, dtype=np.int64) for a in jax.tree.leaves(x)))
