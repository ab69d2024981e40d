"""Client executors: how a cohort's client work runs.

The same pure client work (``training.ClientWork``: init / step / final) and
the same per-client functions (evaluation) run
  * ``vmap``: vectorized over the whole cohort, steps scanned, inside one
    compiled round (the point of this project on GPU/TPU);
  * ``blocked``: vectorized over blocks of clients, blocks looped by
    ``lax.scan`` inside the compiled round (bounded memory at any population);
  * ``sequential``: one client at a time from Python, each real local step one
    jitted dispatch (padded steps are skipped, not computed), clients spread
    over a few host threads, the longest first (FedJAX's ``for_each_client``
    way).
``blocked`` groups clients by their real local steps (``client_blocks``): a
block steps as long as its longest client, idle cohort slots never run, so a
heavy-tailed cohort costs its real work. All give the same numbers up to
float reassociation (tested). The choice belongs to the engine
(``executor_choice.create_executor``: ``auto`` picks per platform and
model, and says why), never to an algorithm.
"""

import concurrent.futures
import dataclasses
import os
from typing import Any, Callable, List, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal.core import aggregation, training, tree_util
from fedjax_personal.core.client_blocks import (
  active_mask,
  block_loop,
  client_blocks,
  client_fn,
  join_owned,
  join_parts,
  limited_client,
  map_stacked,
  scan_blocks,
  traced_work_layout,
  work_steps,
)
from fedjax_personal.core.executor_base import (
  EXECUTOR_NAMES,
  Active,
  ClientFn,
  Executor,
  MakeContext,
  no_rows_in_place,
)
from fedjax_personal.core.tree_util import PyTree

__all__ = [
  'BlockedExecutor',
  'Executor',
  'EXECUTOR_NAMES',
  'SequentialExecutor',
  'ShardedExecutor',
  'THREADED_STATE_BYTES',
  'VmapExecutor',
]


class Slots(NamedTuple):
  """Where a cohort's clients run in blocks: positions and validity.

  Attributes:
    pos: host ints, each slot's cohort position.
    valid: bools, the slots of active clients (not padding).
  """

  pos: np.ndarray
  valid: Any


class Ran(NamedTuple):
  """Clients run one at a time and their outputs.

  Attributes:
    todo: their cohort positions, in the order run.
    outs: their outputs, in that order.
  """

  todo: List[int]
  outs: List[Any]


@dataclasses.dataclass
class VmapExecutor(Executor):
  """The whole cohort vectorized with ``jax.vmap``."""

  name: str = 'vmap'
  fused: bool = True

  def map(
    self,
    fn: ClientFn,
    shared: PyTree,
    per_client: PyTree,
    active: Active = None,
  ) -> PyTree:
    c = tree_util.cohort_size(per_client)
    with training.unroll_steps(False):
      out = jax.vmap(client_fn(fn, shared, per_client))(jnp.arange(c))
    return aggregation.sum_clients(out, active_mask(active, c))

  def run_work(
    self,
    work: training.ClientWork,
    make_ctx: MakeContext,
    shared: PyTree,
    per_client: PyTree,
    active: Active = None,
    num_steps: Optional[Sequence[int]] = None,
    rows_in_place: Optional[tuple] = None,
  ) -> PyTree:
    """The cohort's steps loop as long as its longest active client's work
    (not the padded maximum)."""
    no_rows_in_place(self, rows_in_place)
    c = tree_util.cohort_size(per_client)
    steps = work_steps(work, make_ctx, shared, per_client, active)
    client = limited_client(work, make_ctx, shared, per_client)
    with training.unroll_steps(False):
      out = jax.vmap(client, in_axes=(0, None))(jnp.arange(c), jnp.max(steps))
    return aggregation.sum_clients(out, active_mask(active, c))


@dataclasses.dataclass
class BlockedExecutor(Executor):
  """Blocks of ``block_size`` clients vectorized, blocks looped by ``lax.scan``.

  Each block gathers its clients' inputs (``Rows`` of per-client state
  included) inside the loop, and ``Sum`` outputs are accumulated across
  blocks, so the round's extra memory is one block's work plus the stacked
  outputs that are not sums. The cohort is padded to a multiple of the block
  size by repeating clients; padded outputs are dropped (and not summed).

  With ``num_threads`` > 1 the blocks are split into that many equal runs of
  consecutive blocks, each run one call of the same compiled block loop on
  its own host thread (then the executor is not fused: the round's server
  steps are compiled apart from client work). XLA:CPU runs one small dense
  client step on about one core (its matmuls of a batch of 10 are not split
  across threads), so two such loops side by side use the second core
  (benchmarks/speed/README.md, "Against the PyTorch loop").
  """

  block_size: int = 10
  num_threads: int = 1
  name: str = 'blocked'
  fused: bool = True

  def __post_init__(self):
    if self.block_size < 1:
      raise ValueError(f'block_size must be >= 1, got {self.block_size}')
    if self.num_threads < 1:
      raise ValueError(f'num_threads must be >= 1, got {self.num_threads}')
    self.fused = self.num_threads == 1
    self.writes_rows = self.fused
    if not self.fused:
      self._pool = concurrent.futures.ThreadPoolExecutor(self.num_threads)
      self._compiled, self._seen = {}, set()

  def describe(self) -> str:
    threads = f', threads={self.num_threads}' if self.num_threads > 1 else ''
    return f'blocked(block_size={self.block_size}{threads})'

  def for_run(self, state_shapes: PyTree, num_clients: int) -> 'Executor':
    """The fused form (one thread) when the per-client state exceeds
    ``THREADED_STATE_BYTES``: the threaded form joins the parts' stacked
    outputs in a new array and updates the state without donation, so it can
    hold about three copies of the per-client state where the fused round
    holds one (a Ditto round of 10,000 MLP clients: 8 GB of personal models)."""
    if self.fused:
      return self
    nbytes = sum(
      int(np.prod(s.shape)) * s.dtype.itemsize
      for s in jax.tree.leaves(state_shapes)
      if len(s.shape) >= 1 and s.shape[0] == num_clients
    )
    return (
      dataclasses.replace(self, num_threads=1)
      if nbytes > THREADED_STATE_BYTES
      else self
    )

  def _layout(self, c: int, active: Active, parts: int) -> 'Slots':
    """The cohort's ``Slots``, [parts, nb, bs]: the cohort padded by
    repeating clients to ``parts`` runs of ``nb`` blocks."""
    bs = min(self.block_size, c)
    blocks = -(-c // bs)
    nb = -(-blocks // parts)  # blocks per part
    slots = np.arange(parts * nb * bs)
    # Inside a compiled round a traced mask; else host bools (no device dispatch
    # per call).
    act = active_mask(
      active, c, jnp if isinstance(active, jax.core.Tracer) else np
    )
    valid = (act[slots % c] & (slots < c)).reshape(parts, nb, bs)
    return Slots((slots % c).reshape(parts, nb, bs), valid)

  def map(
    self,
    fn: ClientFn,
    shared: PyTree,
    per_client: PyTree,
    active: Active = None,
  ) -> PyTree:
    c = tree_util.cohort_size(per_client)
    if not self.fused:
      return self._threaded_map(fn, shared, per_client, active, c)
    pos, valid = self._layout(c, active, 1)
    client = client_fn(fn, shared, per_client)
    with training.unroll_steps(False):
      out = scan_blocks(jax.vmap(client), jnp.asarray(pos[0]), valid[0])
    return map_stacked(lambda o: o.reshape((-1,) + o.shape[2:])[:c], out)

  def run_work(
    self,
    work: training.ClientWork,
    make_ctx: MakeContext,
    shared: PyTree,
    per_client: PyTree,
    active: Active = None,
    num_steps: Optional[Sequence[int]] = None,
    rows_in_place: Optional[tuple] = None,
  ) -> PyTree:
    """Client work in blocks of clients of similar work (``client_blocks``):
    each block runs its longest client's steps and only blocks holding
    active clients run, so a heavy-tailed cohort costs about its real
    steps, not blocks x the padded maximum. With ``rows_in_place`` (fused:
    ``block_loop``'s) returns ``(outputs, new rows)``."""
    c = tree_util.cohort_size(per_client)
    if not self.fused:
      return self._threaded_work(
        work, make_ctx, shared, per_client, active, c, num_steps
      )
    steps = work_steps(work, make_ctx, shared, per_client, active)
    pos, ok, limit, count = traced_work_layout(
      steps, active_mask(active, c), self.block_size
    )
    return block_loop(
      work,
      make_ctx,
      shared,
      per_client,
      pos,
      limit,
      ok,
      count,
      c,
      rows_in_place=rows_in_place,
    )

  def _threaded_work(
    self,
    work: training.ClientWork,
    make_ctx: MakeContext,
    shared: PyTree,
    per_client: PyTree,
    active: Active,
    c: int,
    num_steps: Optional[Sequence[int]] = None,
  ) -> PyTree:
    """The threaded form of ``run_work``: the step counts (the engine's host
    counts, else one small compiled function) laid out in blocks on the host,
    shared out by work (``client_blocks``), each thread's blocks one compiled
    call."""
    key = ('work', work, make_ctx)
    # one set of functions per (work, make_ctx): compiled once
    if key not in self._compiled:
      self._compiled[key] = (
        self.jit(lambda sh, pc, act: work_steps(work, make_ctx, sh, pc, act)),
        self.jit(
          lambda sh, pc, p, lim, ok, n: block_loop(
            work, make_ctx, sh, pc, p, lim, ok, n, tree_util.cohort_size(pc)
          )
        ),
      )
    steps_fn, loop = self._compiled[key]
    # host bools: no round trip through the device
    act = active_mask(active, c, np)
    steps = (
      np.asarray(steps_fn(shared, per_client, act))
      if num_steps is None
      else np.where(act, np.asarray(num_steps, np.int32), 0)
    )
    parts = max(
      1, min(self.num_threads, -(-int(act.sum()) // min(self.block_size, c)))
    )
    pos, ok, limit, count = client_blocks(steps, act, self.block_size, parts)
    outs = self._on_threads(
      lambda t: jax.block_until_ready(
        loop(shared, per_client, pos[t], limit[t], ok[t], count[t])
      ),
      parts,
      (key, tree_util.shapes((shared, per_client, pos[0]))),
    )
    owner = np.zeros(c, np.int32)
    for t in range(parts):
      owner[pos[t][ok[t]]] = t
    return join_owned(outs, owner)

  def _threaded_map(
    self,
    fn: ClientFn,
    shared: PyTree,
    per_client: PyTree,
    active: Active,
    c: int,
  ) -> PyTree:
    if any(
      isinstance(a, jax.core.Tracer)
      for a in jax.tree.leaves((shared, per_client))
    ):
      raise ValueError(
        f'{self.describe()} runs client work from host threads and cannot be '
        'traced inside jax.jit; use num_threads=1 (one fused program)'
      )
    parts = max(1, min(self.num_threads, -(-c // min(self.block_size, c))))
    pos, valid = self._layout(c, active, parts)
    if ('map', fn) not in self._compiled:

      def loop(sh, pc, p, v):
        with training.unroll_steps(False):
          return scan_blocks(jax.vmap(client_fn(fn, sh, pc)), p, v)

      self._compiled[('map', fn)] = self.jit(loop)
    loop = self._compiled[('map', fn)]
    outs = self._on_threads(
      lambda t: loop(shared, per_client, pos[t], valid[t]),
      parts,
      ('map', fn, tree_util.shapes((shared, per_client, pos[0]))),
    )
    return join_parts(outs, c)

  def _on_threads(self, call: Callable, parts: int, signature: Any) -> list:
    """``[call(t) for t in range(parts)]`` on the host threads; the first
    call of a new ``signature`` (a compiled function and its argument
    shapes) runs alone first, so that one thread traces and compiles it while
    the others wait (side by side, every thread would trace it)."""
    first = []
    if signature not in self._seen:
      self._seen.add(signature)
      first = [call(0)]
    return first + list(self._pool.map(call, range(len(first), parts)))


@dataclasses.dataclass
class SequentialExecutor(Executor):
  """One client at a time from Python, each real step one jitted dispatch.

  Each dispatch indexes the client's inputs inside the jitted function (no
  host copies). Padded cohort slots and padded steps are skipped. Clients are
  spread over ``num_threads`` host threads (XLA:CPU does not fill two cores
  with one small model; two clients at once run ~1.3x faster on 2 cores).
  """

  num_threads: int = 0  # 0: os.cpu_count()
  name: str = 'sequential'
  fused: bool = False

  def __post_init__(self):
    self._compiled = {}
    n = self.num_threads or os.cpu_count() or 1
    self._pool = concurrent.futures.ThreadPoolExecutor(n) if n > 1 else None

  def describe(self) -> str:
    return f'sequential(threads={self.num_threads or os.cpu_count()})'

  def _run(
    self,
    fn: Callable[[int], Any],
    c: int,
    active: Active,
    work: Optional[Sequence[int]] = None,
  ) -> 'Ran':
    """Runs ``fn`` on the active clients; with ``work`` (their step counts),
    the longest first, so that the threads, each taking the next client
    when free, finish together (LPT scheduling)."""
    act = np.ones(c, bool) if active is None else np.asarray(active)
    todo = [i for i in range(c) if act[i]]
    if work is not None:
      todo.sort(key=lambda i: -int(work[i]))
    outs = (
      list(self._pool.map(fn, todo)) if self._pool else [fn(i) for i in todo]
    )
    return Ran(todo, outs)

  def _stack(self, c: int, todo: List[int], outs: List[PyTree]) -> PyTree:
    """Stacks the active clients' outputs (zeros in skipped slots) and adds
    up their ``Sum`` outputs one client at a time (never stacked)."""
    nodes = [jax.tree.flatten(o, is_leaf=aggregation.is_sum)[0] for o in outs]
    treedef = jax.tree.structure(outs[0], is_leaf=aggregation.is_sum)
    flags = [aggregation.is_sum(n) for n in nodes[0]]
    stacked = [[n for n, f in zip(ns, flags) if not f] for ns in nodes]
    full = [jax.tree.map(jnp.zeros_like, stacked[0])] * c
    for i, s in zip(todo, stacked):
      full[i] = s
    stacked = iter(self._stacker(full))
    sums = [n.value for n, f in zip(nodes[0], flags) if f]
    for ns in nodes[1:]:
      sums = self._adder(sums, [n.value for n, f in zip(ns, flags) if f])
    sum_iter = iter(sums)
    return jax.tree_util.tree_unflatten(
      treedef,
      [aggregation.Sum(next(sum_iter)) if f else next(stacked) for f in flags],
    )

  @staticmethod
  @jax.jit
  def _stacker(outs: List[PyTree]) -> PyTree:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)

  @staticmethod
  @jax.jit
  def _adder(a: List[jax.Array], b: List[jax.Array]) -> List[jax.Array]:
    return jax.tree.map(jnp.add, a, b)

  def map(
    self,
    fn: ClientFn,
    shared: PyTree,
    per_client: PyTree,
    active: Active = None,
  ) -> PyTree:
    if ('map', fn) not in self._compiled:
      self._compiled[('map', fn)] = self.jit(
        lambda sh, pc, i: fn(sh, tree_util.client_slice(pc, i))
      )
    one = self._compiled[('map', fn)]
    c = tree_util.cohort_size(per_client)

    def call(i):
      # a step loop inside fn (fine-tuning) runs unrolled
      with training.unroll_steps(True):
        return one(shared, per_client, np.int32(i))

    todo, outs = self._run(call, c, active)
    return self._stack(c, todo, outs)

  def _work_fns(
    self, work: training.ClientWork, make_ctx: MakeContext
  ) -> tuple:
    key = ('work', work, make_ctx)
    if key not in self._compiled:

      def ctx_of(sh, pc, i):
        return make_ctx(sh, tree_util.client_slice(pc, i))

      def init(sh, pc, i):
        ctx, k = ctx_of(sh, pc, i)
        return training.work_init(work, ctx, k)

      def step(sh, pc, i, carry, idx, mask, k_steps, s):
        return training.work_step(
          work, ctx_of(sh, pc, i).ctx, carry, idx, mask, k_steps, s
        )

      def final(sh, pc, i, carry):
        return work.final(ctx_of(sh, pc, i).ctx, carry)

      self._compiled[key] = (self.jit(init), self.jit(step), self.jit(final))
    return self._compiled[key]

  def run_work(
    self,
    work: training.ClientWork,
    make_ctx: MakeContext,
    shared: PyTree,
    per_client: PyTree,
    active: Active = None,
    num_steps: Optional[Sequence[int]] = None,
    rows_in_place: Optional[tuple] = None,
  ) -> PyTree:
    no_rows_in_place(self, rows_in_place)
    init, step, final = self._work_fns(work, make_ctx)
    c = tree_util.cohort_size(per_client)

    def client(i):
      i32 = np.int32(i)
      carry, idx, mask, k_steps = init(shared, per_client, i32)
      n = idx.shape[0] if num_steps is None else int(num_steps[i])
      for s in range(n):
        carry = step(
          shared, per_client, i32, carry, idx, mask, k_steps, np.int32(s)
        )
      return final(shared, per_client, i32, carry)

    todo, outs = self._run(client, c, active, num_steps)
    return self._stack(c, todo, outs)


@dataclasses.dataclass
class ShardedExecutor(Executor):
  """An executor that shards the cohort over the local devices.

  The cohort's client axis sharded over all local devices (GPUs, TPU
  cores, or CPU devices forced with
  ``XLA_FLAGS=--xla_force_host_platform_device_count=8``), vectorized on
  each device, inside the one compiled round.

  The cohort is padded to a multiple of the device count by repeating
  clients (padded outputs dropped, not summed); per-client inputs (``Rows``
  gathered) and stacked outputs are constrained to ``NamedSharding(mesh,
  P('clients'))`` and XLA's SPMD partitioner splits the work. With
  ``block_size``, each device processes its
  shard in blocks (bounded memory). Multi-host: call
  ``jax.distributed.initialize()`` first; ``jax.devices()`` then spans all
  hosts and the same mesh shards clients across them.
  """

  block_size: Optional[int] = None
  name: str = 'sharded'
  fused: bool = True

  def __post_init__(self):
    devices = np.array(jax.devices())
    self.mesh = jax.sharding.Mesh(
      devices, ('clients',), axis_types=(jax.sharding.AxisType.Auto,)
    )
    self.spec = jax.sharding.NamedSharding(
      self.mesh, jax.sharding.PartitionSpec('clients')
    )

  def state_shardings(self, state_shapes: PyTree, num_clients: int) -> Any:
    """Per-client state (leading axis N, N a multiple of the device count)
    sharded over the devices on its client axis, the rest replicated. The
    round constrains its output state to these shardings and the initial
    state is placed with them, so every round sees the same input layout
    (and the round compiles once)."""
    d = self.mesh.devices.size
    replicated = jax.sharding.NamedSharding(
      self.mesh, jax.sharding.PartitionSpec()
    )
    return jax.tree.map(
      lambda s: (
        self.spec
        if (
          len(s.shape) >= 1
          and s.shape[0] == num_clients
          and num_clients % d == 0
        )
        else replicated
      ),
      state_shapes,
    )

  def describe(self) -> str:
    procs = (
      f', {jax.process_count()} processes' if jax.process_count() > 1 else ''
    )
    return f'sharded({self.mesh.devices.size} devices{procs}' + (
      f', block_size={self.block_size})' if self.block_size else ')'
    )

  def host_readable(self, tree: PyTree) -> PyTree:
    """Replicated on every device when several processes share the mesh (a
    client-sharded [N] statistic is then gathered once, inside the compiled
    function); as it is on one process."""
    if jax.process_count() == 1:
      return tree
    replicated = jax.sharding.NamedSharding(
      self.mesh, jax.sharding.PartitionSpec()
    )
    return jax.tree.map(
      lambda a: jax.lax.with_sharding_constraint(a, replicated), tree
    )

  def map(
    self,
    fn: ClientFn,
    shared: PyTree,
    per_client: PyTree,
    active: Active = None,
  ) -> PyTree:
    c = tree_util.cohort_size(per_client)
    d = self.mesh.devices.size
    padded = -(-c // d) * d
    slots = np.arange(padded)
    valid = active_mask(active, c)[slots % c] & (slots < c)
    constrain = lambda a: jax.lax.with_sharding_constraint(a, self.spec)
    # The cohort's inputs, gathered and spread over the devices.
    pc = jax.tree.map(constrain, tree_util.client_slice(per_client, slots % c))
    client = client_fn(fn, shared, pc)
    with training.unroll_steps(False):
      if self.block_size:
        per_device = padded // d
        bs = min(self.block_size, per_device)
        nb = -(-per_device // bs)
        # Each device loops over blocks of its own slots: [d, nb, bs].
        local = np.arange(nb * bs) % per_device
        pos = (np.arange(d)[:, None] * per_device + local[None]).reshape(
          d, nb, bs
        )
        ok = valid[pos] & (np.arange(nb * bs) < per_device).reshape(1, nb, bs)
        out = jax.vmap(lambda p, v: scan_blocks(jax.vmap(client), p, v))(
          jnp.asarray(pos), ok
        )
        out = jax.tree.map(
          lambda n: (
            aggregation.Sum(jax.tree.map(lambda a: a.sum(0), n.value))
            if aggregation.is_sum(n)
            else n
          ),
          out,
          is_leaf=aggregation.is_sum,
        )
        out = map_stacked(
          lambda o: o.reshape((d, nb * bs) + o.shape[3:])[
            :, :per_device
          ].reshape((padded,) + o.shape[3:]),
          out,
        )
      else:
        out = aggregation.sum_clients(
          jax.vmap(client)(jnp.arange(padded)), valid
        )
    return map_stacked(lambda o: constrain(o)[:c], out)


#: Above this much per-client state a threaded ``BlockedExecutor`` runs fused
#: (``BlockedExecutor.for_run``).
THREADED_STATE_BYTES = 1 << 30
