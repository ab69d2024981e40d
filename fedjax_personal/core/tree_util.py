"""Pytree helpers of the engine and the algorithms that optax.tree_utils
does not have (stacked per-client state: gather, scatter, lazy rows).
Arithmetic on pytrees uses ``optax.tree_utils`` (tree_sub, tree_zeros_like,
tree_norm, ...)."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

__all__ = [
  'client_slice',
  'cohort_size',
  'is_concrete',
  'leading_size',
  'PyTree',
  'Rows',
  'rows',
  'SCATTER_CHUNK',
  'shapes',
  'tree_broadcast',
  'tree_bytes',
  'tree_gather',
  'tree_scatter',
  'tree_scatter_where',
  'tree_where',
]


PyTree = Any


def is_concrete(x: Any) -> bool:
  """False for a traced value (a hyperparameter swept inside ``jax.vmap``):
  argument checks skip those; the CLI validates sweep values beforehand.

  Args:
    x: a value.

  Returns:
    True unless traced.
  """
  return not isinstance(x, jax.core.Tracer)


def tree_where(cond: Any, x: PyTree, y: PyTree) -> PyTree:
  """Selects `x` where the scalar `cond` holds, else `y`, leaf by leaf.

  Args:
    cond: a scalar bool.
    x: a pytree.
    y: a pytree of the same structure.

  Returns:
    ``x`` or ``y``, leaf by leaf.
  """
  return jax.tree.map(lambda a, b: jnp.where(cond, a, b), x, y)


def tree_gather(x: PyTree, idx: Any) -> PyTree:
  """x[idx] on the leading (client) axis of every leaf; out-of-range idx
  clipped.

  Args:
    x: a stacked pytree [N, ...].
    idx: row indices.

  Returns:
    The rows [len(idx), ...].
  """
  return jax.tree.map(lambda a: a.at[idx].get(mode='clip'), x)


@struct.dataclass
class Rows:
  """Rows of a stacked per-client pytree, gathered where the client runs.

  The rows ``idx`` of the stacked per-client pytree ``source``, gathered
  where the client runs.

  An algorithm's ``server_broadcast`` returns ``rows(state.personal,
  cohort.rows)`` for the cohort's per-client state; the executor gathers
  each block's (or each client's) rows inside its loop, so the round never
  holds a gathered copy of the whole cohort's state. ``idx`` may have
  trailing axes (e.g. [C, K] candidates per client).
  """

  source: PyTree
  idx: jax.Array


def is_rows(x: Any) -> bool:
  """Whether ``x`` is a ``Rows`` leaf (one row per client)."""
  return isinstance(x, Rows)


def rows(x: PyTree, idx: Any) -> Rows:
  """Lazy ``tree_gather(x, idx)`` for a broadcast (see ``Rows``).

  Args:
    x: a stacked pytree [N, ...].
    idx: row indices.

  Returns:
    The lazy ``Rows``.
  """
  return Rows(x, jnp.asarray(idx))


def client_slice(tree: PyTree, pos: Any) -> PyTree:
  """Position(s) ``pos`` of the cohort's per-client inputs: ``a[pos]`` for
  plain stacked leaves, ``source[idx[pos]]`` for ``Rows``.

  Args:
    tree: per-client inputs [C, ...] (``Rows`` allowed).
    pos: cohort position(s).

  Returns:
    The inputs at ``pos``.
  """
  return jax.tree.map(
    lambda n: tree_gather(n.source, n.idx[pos]) if is_rows(n) else n[pos],
    tree,
    is_leaf=is_rows,
  )


def cohort_size(tree: PyTree) -> int:
  """The leading (client) dimension of per-client inputs that may hold ``Rows``.

  Args:
    tree: per-client inputs.

  Returns:
    C.
  """
  node = jax.tree.leaves(tree, is_leaf=is_rows)[0]
  return (node.idx if is_rows(node) else node).shape[0]


#: Rows written per step of ``tree_scatter``'s loop over a large cohort.
SCATTER_CHUNK = 64


def tree_scatter(x: PyTree, idx: Any, values: PyTree) -> PyTree:
  """x.at[idx].set(values) on the leading axis; out-of-range idx are dropped.

  The engine pads cohorts with the index N (one past the last client), so
  padded slots never overwrite a real client's state. A large cohort is
  written ``SCATTER_CHUNK`` rows at a time in a loop, so that XLA updates
  ``x`` in place without first copying all of ``values`` into the scatter's
  layout (the round then holds no second copy of the cohort's outputs).

  Args:
    x: a stacked pytree [N, ...].
    idx: row indices (N or more: dropped).
    values: the rows to write [len(idx), ...].

  Returns:
    ``x`` with the rows written.
  """

  def scatter(x, i, v):
    return jax.tree.map(lambda a, u: a.at[i].set(u, mode='drop'), x, v)

  c = idx.shape[0]
  full = c // SCATTER_CHUNK
  if full < 2:
    return scatter(x, idx, values)

  def chunk(k, x):
    take = lambda a: jax.lax.dynamic_slice_in_dim(
      a, k * SCATTER_CHUNK, SCATTER_CHUNK
    )
    return scatter(x, take(idx), jax.tree.map(take, values))

  x = jax.lax.fori_loop(0, full, chunk, x)
  rest = slice(full * SCATTER_CHUNK, c)
  return (
    scatter(x, idx[rest], jax.tree.map(lambda a: a[rest], values))
    if rest.start < c
    else x
  )


def tree_scatter_where(
  x: PyTree, idx: Any, values: PyTree, keep: Any
) -> PyTree:
  """``tree_scatter`` of the rows whose ``keep`` is true; the others are
  left as they are (a cohort's slot that did not take part keeps its row).

  Args:
    x: a stacked pytree [N, ...].
    idx: row indices (N or more: dropped).
    values: the rows to write [len(idx), ...].
    keep: bool [len(idx)].

  Returns:
    ``x`` with the kept rows written.
  """
  return tree_scatter(x, jnp.where(keep, idx, leading_size(x)), values)


def leading_size(x: PyTree) -> int:
  """The leading (client) dimension of a stacked pytree (its first leaf's).

  Args:
    x: a stacked pytree.

  Returns:
    Its leading dimension.
  """
  return jax.tree.leaves(x)[0].shape[0]


def tree_broadcast(x: PyTree, n: int) -> PyTree:
  """Stacks n copies of x on a new leading axis.

  Args:
    x: a pytree.
    n: copies.

  Returns:
    The pytree with leaves [n, ...].
  """
  return jax.tree.map(lambda a: jnp.broadcast_to(a, (n,) + a.shape), x)


def tree_bytes(x: PyTree) -> int:
  """Bytes of all array leaves of x (works on arrays and ShapeDtypeStructs).

  Args:
    x: a pytree.

  Returns:
    Its bytes.
  """
  return int(
    sum(
      np.prod(a.shape, dtype=np.int64) * np.dtype(a.dtype).itemsize
      for a in jax.tree.leaves(x)
    )
  )


def shapes(tree: PyTree) -> tuple:
  """The shapes and dtypes of a pytree's leaves, hashable (a compiled
  function's signature).

  Args:
    tree: a pytree of arrays (or abstract values).

  Returns:
    ``((shape, dtype name), ...)``.
  """
  return tuple(
    (np.shape(a), str(getattr(a, 'dtype', type(a).__name__)))
    for a in jax.tree.leaves(tree)
  )
