"""Where each client of a cohort runs: work layouts and the block loops.

A cohort's clients are grouped into blocks by their real local steps
(``client_blocks``): a block steps as long as its longest client, idle cohort
slots never run, so a heavy-tailed cohort costs its real work. The
executors (``core/executors.py``) run client work through these pieces.
"""

import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from fedjax_personal.core import aggregation, training, tree_util
from fedjax_personal.core.tree_util import PyTree

__all__ = [
  'active_mask',
  'BlockLayout',
  'WorkBlocks',
  'block_loop',
  'client_fn',
  'join_owned',
  'join_parts',
  'limited_client',
  'map_stacked',
  'scan_blocks',
  'traced_work_layout',
  'client_blocks',
  'work_steps',
]


def active_mask(active: Any, c: int, xp: Any = jnp) -> Any:
  """``active`` as a bool mask of ``c`` clients (None: all active).

  Args:
    active: bools [c], or None.
    c: the cohort size.
    xp: ``jnp`` (a device or traced mask) or ``np`` (host bools: no device
      dispatch).

  Returns:
    bool [c].
  """
  return xp.ones(c, bool) if active is None else xp.asarray(active, bool)


def client_fn(
  fn: Callable[[Any, Any], Any], shared: PyTree, per_client: PyTree
) -> Callable[[Any], Any]:
  """``pos -> fn(shared, client inputs at cohort position pos)``.

  Args:
    fn: ``(shared, inputs) -> output``.
    shared: what every client reads.
    per_client: per-client inputs.

  Returns:
    ``pos -> output``.
  """
  return lambda pos: fn(shared, tree_util.client_slice(per_client, pos))


def map_stacked(f: Callable[[Any], Any], out: PyTree) -> PyTree:
  """Applies ``f`` to the stacked (non-``Sum``) leaves of executor outputs.

  Args:
    f: applied to each stacked leaf.
    out: executor outputs.

  Returns:
    The outputs with ``f`` applied.
  """
  return jax.tree.map(
    lambda n: n if aggregation.is_sum(n) else jax.tree.map(f, n),
    out,
    is_leaf=aggregation.is_sum,
  )


def scan_blocks(
  block_fn: Callable,
  positions: PyTree,
  valid: jax.Array,
  rows: Optional[tuple] = None,
  count: Optional[jax.Array] = None,
  sink: Optional[tuple] = None,
) -> Any:
  """Runs ``block_fn`` over blocks of cohort positions ([nb, bs], or a
  pytree of [nb, ...] arrays: what each block receives) in a loop: ``Sum``
  outputs are reduced over each block's valid slots and accumulated in the
  loop carry (nothing of them is stacked); other outputs are stacked [nb,
  bs, ...], or, with ``rows = (c, [nb, bs] cohort rows)``, written in place
  into [c, ...] buffers in the carry at each block's rows (a row of c or
  more is dropped), so that they come out in cohort order without a second
  stacked copy (rows left unwritten are zeros). With ``count`` (a traced
  int, ``rows`` required) only the first ``count`` blocks run (a
  ``fori_loop``): empty blocks cost nothing.

  With ``sink = (held, at)``, ``held`` (a pytree of [R, ...] rows) is
  carried by the loop too: ``block_fn(positions, held) -> (outputs, new
  rows [bs, ...])`` reads the rows it needs from the carried ``held`` and
  its new rows are written into it at ``at`` ([nb, bs] rows; R or more:
  dropped) when the block ends.

  Args:
    block_fn: ``positions -> outputs`` of one block (with ``sink``:
      ``(positions, held) -> (outputs, new rows)``).
    positions: [nb, bs] positions (or a pytree of [nb, ...]).
    valid: real slots [nb, bs].
    rows: ``(c, [nb, bs] cohort rows)``: write stacked outputs in place (None:
      stack them).
    count: blocks to run (traced; ``rows`` required).
    sink: ``(held, at)``: rows read and written by the blocks in place.

  Returns:
    The outputs: ``Sum`` nodes summed, the others stacked; with ``sink``,
    ``(outputs, held with the new rows written)``.
  """
  held, at = sink if sink is not None else ((), None)

  def body(pos, ok, held):
    out, new = block_fn(pos, held) if sink is not None else (block_fn(pos), ())
    return aggregation.sum_clients(out, ok), new

  # Traced once (the jaxpr gives the carry's shapes and is the loop body).
  closed, (shape, _) = jax.make_jaxpr(body, return_shape=True)(
    jax.tree.map(lambda a: a[0], positions), valid[0], held
  )
  body_fn = jax.extend.core.jaxpr_as_fun(closed)
  out_tree = jax.tree.structure((shape, held))
  nodes, treedef = jax.tree.flatten(shape, is_leaf=aggregation.is_sum)
  flags = [aggregation.is_sum(n) for n in nodes]
  init = [
    jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), n.value)
    for n, f in zip(nodes, flags)
    if f
  ]
  bufs = None
  if rows is not None:
    c, rows = rows
    bufs = [
      jax.tree.map(lambda a: jnp.zeros((c,) + a.shape[1:], a.dtype), n)
      for n, f in zip(nodes, flags)
      if not f
    ]

  def step(carry, xs):
    acc, bufs, held = carry
    leaves, ok, at_rows, at_held = xs
    out, new = jax.tree.unflatten(
      out_tree, body_fn(*leaves, ok, *jax.tree.leaves(held))
    )
    out = jax.tree.flatten(out, is_leaf=aggregation.is_sum)[0]
    sums = [n.value for n, f in zip(out, flags) if f]
    stacked = [n for n, f in zip(out, flags) if not f]
    acc = jax.tree.map(jnp.add, acc, sums)
    held = jax.tree.map(
      lambda h, v: h.at[at_held].set(v, mode='drop'), held, new
    )
    if bufs is None:
      return (acc, None, held), stacked
    bufs = jax.tree.map(
      lambda b, o: b.at[at_rows].set(o, mode='drop'), bufs, stacked
    )
    return (acc, bufs, held), None

  xs = (jax.tree.leaves(positions), valid, rows, at)
  if count is None:
    (acc, bufs, held), stacked = jax.lax.scan(step, (init, bufs, held), xs)
  else:
    (acc, bufs, held) = jax.lax.fori_loop(
      0,
      count,
      lambda i, carry: step(carry, jax.tree.map(lambda a: a[i], xs))[0],
      (init, bufs, held),
    )
  sums, kept = iter(acc), iter(stacked if bufs is None else bufs)
  out = jax.tree.unflatten(
    treedef, [aggregation.Sum(next(sums)) if f else next(kept) for f in flags]
  )
  return (out, held) if sink is not None else out


def work_steps(
  work: training.ClientWork,
  make_ctx: Callable,
  shared: PyTree,
  per_client: PyTree,
  active: Any,
) -> jax.Array:
  """Each cohort client's real local step count (traced int32 [C]; 0 for an
  inactive slot), read off its own batches (``training.work_num_steps``).

  Args:
    work: the ``ClientWork``.
    make_ctx: ``(shared, inputs) -> (ctx, key)``.
    shared: what every client reads.
    per_client: per-client inputs.
    active: active slots (None: all).

  Returns:
    int32 [C].
  """
  c = tree_util.cohort_size(per_client)

  def one(pos):
    ctx, key = make_ctx(shared, tree_util.client_slice(per_client, pos))
    return training.work_num_steps(work, ctx, key)

  return jnp.where(active_mask(active, c), jax.vmap(one)(jnp.arange(c)), 0)


def limited_client(
  work: training.ClientWork,
  make_ctx: Callable,
  shared: PyTree,
  per_client: PyTree,
) -> Callable[[Any, Any], PyTree]:
  """``(pos, limit) -> output``: the client at cohort position ``pos`` runs
  its first ``limit`` steps (``training.run_work``).

  Args:
    work: the ``ClientWork``.
    make_ctx: ``(shared, inputs) -> (ctx, key)``.
    shared: what every client reads.
    per_client: per-client inputs.

  Returns:
    ``client(pos, limit) -> output``.
  """

  def client(pos, limit):
    ctx, key = make_ctx(shared, tree_util.client_slice(per_client, pos))
    return training.run_work(work, ctx, key, limit)

  return client


class WorkBlocks(NamedTuple):
  """A cohort cut into blocks of clients of similar work.

  Attributes:
    pos: int [nb, bs], the blocks' cohort positions.
    ok: bool [nb, bs], real slots (active clients, not padding).
    limit: int32 [nb], each block's longest client's steps.
  """

  pos: Any
  ok: Any
  limit: Any


class BlockLayout(NamedTuple):
  """Blocks of clients by work, as the executors run them.

  Attributes:
    pos: int [..., nb, bs], the blocks' cohort positions.
    ok: bool [..., nb, bs], real slots.
    limit: int32 [..., nb], the blocks' step counts.
    count: the number of blocks that hold active clients (they come first),
      per part where there are parts.
  """

  pos: Any
  ok: Any
  limit: Any
  count: Any


def blocks_by_work(steps: Any, active: Any, bs: int, xp: Any) -> WorkBlocks:
  """The cohort sorted by real step count (longest first; inactive slots
  last) and cut into blocks of ``bs`` neighbours. ``xp`` is ``np`` (host
  ints) or ``jnp`` (traced)."""
  c = steps.shape[0]
  bs = min(bs, c)
  nb = -(-c // bs)
  key = -xp.where(active, steps, -1)
  order = (
    np.argsort(key, kind='stable')
    if xp is np
    else jnp.argsort(key, stable=True)
  )
  slots = xp.arange(nb * bs)
  at = order[slots % c]
  pos = at.reshape(nb, bs)
  ok = ((slots < c) & active[at]).reshape(nb, bs)
  limit = xp.max(xp.where(ok, steps[pos], 0), axis=-1).astype(xp.int32)
  return WorkBlocks(pos, ok, limit)


def client_blocks(
  steps: Any, active: Any, bs: int, parts: int = 1
) -> BlockLayout:
  """Blocks of clients by work (host ints, ``blocks_by_work``); with
  ``parts`` > 1, the blocks assigned to the parts longest first, each to the
  part with the least work so far (LPT scheduling), so that host threads
  finish together. Inactive slots are never in a block.

  A block then runs as many steps as its longest client (``training.run_work``
  with ``limit``), and since its clients are neighbours in the sorted order
  that is close to each one's own work: a round costs about the cohort's
  real steps / ``bs`` block steps instead of ``blocks * S`` (S the padded
  maximum).

  Args:
    steps: real steps per cohort client.
    active: active slots.
    bs: clients per block.
    parts: host threads.

  Returns:
    The ``BlockLayout`` with a leading parts axis (``count`` [parts]: a
    part's first ``count`` blocks hold its clients); ``nb`` is the cohort's
    number of blocks (a part may get them all).
  """
  steps, active = np.asarray(steps), np.asarray(active, bool)
  b_pos, b_ok, b_limit = blocks_by_work(steps, active, bs, np)
  nb, bs = b_pos.shape
  pos = np.zeros((parts, nb, bs), np.int32)
  ok = np.zeros((parts, nb, bs), bool)
  limit = np.zeros((parts, nb), np.int32)
  count = np.zeros(parts, np.int32)
  load = np.zeros(parts)
  for b in np.flatnonzero(b_ok.any(-1)):  # longest first
    t = int(np.argmin(load))
    pos[t, count[t]], ok[t, count[t]], limit[t, count[t]] = (
      b_pos[b],
      b_ok[b],
      b_limit[b],
    )
    count[t] += 1
    load[t] += b_limit[b] + 1  # + 1: a block's fixed cost (init, final)
  return BlockLayout(pos, ok, limit, count)


def traced_work_layout(
  steps: jax.Array, active: jax.Array, bs: int
) -> BlockLayout:
  """``client_blocks`` with one part, on traced arrays (inside a compiled
  round).

  Args:
    steps: real steps [c] (traced).
    active: active slots [c].
    bs: clients per block.

  Returns:
    The ``BlockLayout`` (``count``: blocks holding active clients).
  """
  pos, ok, limit = blocks_by_work(steps, active, bs, jnp)
  bs = pos.shape[1]
  count = (jnp.sum(active.astype(jnp.int32)) + bs - 1) // bs
  return BlockLayout(pos, ok, limit, count)


def block_loop(
  work: training.ClientWork,
  make_ctx: Callable,
  shared: PyTree,
  per_client: PyTree,
  pos: jax.Array,
  limit: jax.Array,
  ok: jax.Array,
  count: jax.Array,
  c: int,
  rows_in_place: Optional[tuple] = None,
) -> Any:
  """The first ``count`` blocks (``pos`` [nb, bs], ``limit`` [nb]) of client
  work vectorized within a block, each block ``limit`` steps; stacked
  outputs written at their cohort rows of [c, ...] buffers.

  With ``rows_in_place = (field, slot)``, ``per_client``'s field ``slot`` is a
  ``tree_util.Rows`` of the state's client rows and the client output's
  ``field`` is the client's new row (``ClientRows.output``): the loop
  carries those rows, each block reads its clients' rows from them and
  writes its new rows into them where it ends, so that no [c, ...] buffer
  of new rows is made (a client's row is read before it is written: a
  cohort holds each client once, and slots that are not real write
  nothing).

  Args:
    work: the ``ClientWork``.
    make_ctx: ``(shared, inputs) -> (ctx, key)``.
    shared: what every client reads.
    per_client: per-client inputs [c, ...].
    pos: cohort positions [nb, bs].
    limit: each block's steps [nb].
    ok: real slots [nb, bs].
    count: blocks to run (traced).
    c: the cohort size.
    rows_in_place: ``(field, slot)`` or None.

  Returns:
    The outputs: ``Sum`` nodes summed, the others [c, ...]; with
    ``rows_in_place``, ``(outputs with field None, the rows written)``.
  """
  sink = None
  client: Callable
  if rows_in_place is None:
    client = limited_client(work, make_ctx, shared, per_client)
  else:
    field, slot = rows_in_place
    source = getattr(per_client, slot)

    def client(p, lim, held):
      inputs = per_client._replace(**{slot: tree_util.Rows(held, source.idx)})
      ctx, key = make_ctx(shared, tree_util.client_slice(inputs, p))
      out = training.run_work(work, ctx, key, lim)
      return out.replace(**{field: None}), getattr(out, field)

    n = jax.tree.leaves(source.source)[0].shape[0]
    sink = (source.source, jnp.where(ok, source.idx[pos], n))
  args = () if sink is None else (None,)
  # one client a block: its own shapes, no batched matmuls of one
  if pos.shape[-1] == 1:
    block = lambda x, *h: jax.tree.map(
      lambda a: a[None], client(x[0][0], x[1], *h)
    )
  else:
    block = lambda x, *h: jax.vmap(client, in_axes=(0, None) + args)(*x, *h)
  with training.unroll_steps(False):
    return scan_blocks(
      block,
      (pos, limit),
      ok,
      rows=(c, jnp.where(ok, pos, c)),
      count=count,
      sink=sink,
    )


@jax.jit
def join_owned(outs: Sequence[PyTree], owner: jax.Array) -> PyTree:
  """Threaded outputs in cohort order: ``Sum`` values added over the parts,
  row i of stacked outputs from part ``owner[i]`` (the part that ran it)."""
  nodes = [jax.tree.flatten(o, is_leaf=aggregation.is_sum)[0] for o in outs]
  treedef = jax.tree.structure(outs[0], is_leaf=aggregation.is_sum)

  def pick(*xs):
    out = xs[0]
    for t, x in enumerate(xs[1:], 1):
      out = jnp.where((owner == t).reshape((-1,) + (1,) * (x.ndim - 1)), x, out)
    return out

  def join(*ns):
    if aggregation.is_sum(ns[0]):
      return aggregation.Sum(
        jax.tree.map(lambda *v: sum(v[1:], v[0]), *[n.value for n in ns])
      )
    return jax.tree.map(pick, *ns)

  return jax.tree.unflatten(treedef, [join(*ns) for ns in zip(*nodes)])


@functools.partial(jax.jit, static_argnums=1)
def join_parts(outs: Sequence[PyTree], c: int) -> PyTree:
  """Threaded blocked outputs: ``Sum`` values added over the parts, stacked
  outputs ([nb, bs, ...] per part) concatenated in slot order, first ``c``."""
  nodes = [jax.tree.flatten(o, is_leaf=aggregation.is_sum)[0] for o in outs]
  treedef = jax.tree.structure(outs[0], is_leaf=aggregation.is_sum)

  def join(*ns):
    if aggregation.is_sum(ns[0]):
      return aggregation.Sum(
        jax.tree.map(lambda *v: sum(v[1:], v[0]), *[n.value for n in ns])
      )
    return jax.tree.map(
      lambda *xs: jnp.concatenate([x.reshape((-1,) + x.shape[2:]) for x in xs])[
        :c
      ],
      *ns,
    )

  return jax.tree.unflatten(treedef, [join(*ns) for ns in zip(*nodes)])
