"""Client executors: how a cohort's client work runs.

The same pure client work (``training.ClientWork``: init / step / final) and
the same per-client functions (evaluation) run
  * ``vmap``: vectorized over the whole cohort, steps scanned, inside one
    compiled round (the point of this project on GPU/TPU);
  * ``blocked``: vectorized over blocks of clients, blocks looped by
    ``lax.map`` inside the compiled round (bounded memory at any population);
  * ``sequential``: one client at a time from Python, each real local step one
    jitted dispatch (padded steps are skipped, not computed), clients spread
    over a few host threads. XLA:CPU runs vmapped convolutions and
    convolutions inside loops slowly, so this is the fastest path for
    convolutional models on CPU (see BUILD.md for the measurements).
All give the same numbers up to float reassociation (tested). The choice
belongs to the engine (``auto`` picks per platform and model), never to an
algorithm.
"""

import abc
import concurrent.futures
import dataclasses
import os
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal import training

EXECUTOR_NAMES = ('auto', 'vmap', 'blocked', 'sequential', 'sharded')

# make_ctx(shared_all, client) -> (ClientContext, key): builds one client's
# context from what is shared by the round and the client's stacked inputs.
MakeContext = Callable[[Any, Any], tuple]


def _leading_dim(tree) -> int:
  return jax.tree.leaves(tree)[0].shape[0]


class Executor(abc.ABC):
  """Maps per-client computations over stacked per-client inputs."""

  name: str = ''
  #: True when calls may be traced inside an outer ``jax.jit`` (then a round is
  #: one compiled function); False when the executor dispatches from Python.
  fused: bool = True

  @abc.abstractmethod
  def map(self, fn: Callable[[Any, Any], Any], shared, per_client,
          active: Optional[Sequence[bool]] = None):
    """``fn(shared, client_i)`` stacked over the leading axis of ``per_client``.

    ``active`` (bool [C]) lets an executor skip padded cohort slots, whose
    outputs are then zeros; callers mask them.
    """

  def run_work(self, work: training.ClientWork, make_ctx: MakeContext, shared, per_client,
               active=None, num_steps: Optional[Sequence[int]] = None):
    """Runs ``work`` for every client; returns the stacked ``final`` outputs.

    ``num_steps`` (host ints [C]) are the clients' real step counts, used by
    executors that skip padded steps.
    """
    def fn(sh, c):
      ctx, key = make_ctx(sh, c)
      return training.run_work(work, ctx, key)
    return self.map(fn, shared, per_client, active)

  def describe(self) -> str:
    return self.name


@dataclasses.dataclass
class VmapExecutor(Executor):
  """The whole cohort vectorized with ``jax.vmap``."""
  name: str = 'vmap'
  fused: bool = True

  def map(self, fn, shared, per_client, active=None):
    with training.unroll_steps(False):
      return jax.vmap(fn, in_axes=(None, 0))(shared, per_client)


@dataclasses.dataclass
class BlockedExecutor(Executor):
  """Blocks of ``block_size`` clients vectorized, blocks looped by ``lax.map``.

  Peak memory is that of one block whatever the cohort. The cohort is padded
  to a multiple of the block size by repeating clients; padded outputs are
  dropped.
  """
  block_size: int = 10
  name: str = 'blocked'
  fused: bool = True

  def __post_init__(self):
    if self.block_size < 1:
      raise ValueError(f'block_size must be >= 1, got {self.block_size}')

  def describe(self):
    return f'blocked(block_size={self.block_size})'

  def map(self, fn, shared, per_client, active=None):
    c = _leading_dim(per_client)
    bs = min(self.block_size, c)
    nb = -(-c // bs)
    fill = np.arange(nb * bs) % c  # pad by repeating clients

    def to_blocks(a):
      return (a if nb * bs == c else a[fill]).reshape((nb, bs) + a.shape[1:])

    blocks = jax.tree.map(to_blocks, per_client)
    with training.unroll_steps(False):
      out = jax.lax.map(lambda b: jax.vmap(fn, in_axes=(None, 0))(shared, b), blocks)
    return jax.tree.map(lambda o: o.reshape((nb * bs,) + o.shape[2:])[:c], out)


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

  def describe(self):
    return f'sequential(threads={self.num_threads or os.cpu_count()})'

  def _run(self, fn, c, active):
    act = np.ones(c, bool) if active is None else np.asarray(active)
    todo = [i for i in range(c) if act[i]]
    outs = list(self._pool.map(fn, todo)) if self._pool else [fn(i) for i in todo]
    return todo, outs

  def _stack(self, c, todo, outs):
    """Stacks the active clients' outputs, zeros in skipped slots."""
    if len(todo) < c:
      zero = jax.tree.map(jnp.zeros_like, outs[0])
      full = [zero] * c
      for i, o in zip(todo, outs):
        full[i] = o
      outs = full
    return self._stacker(outs)

  @staticmethod
  @jax.jit
  def _stacker(outs):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)

  def map(self, fn, shared, per_client, active=None):
    if ('map', fn) not in self._compiled:
      self._compiled[('map', fn)] = jax.jit(
          lambda sh, pc, i: fn(sh, jax.tree.map(lambda a: a[i], pc)))
    one = self._compiled[('map', fn)]
    c = _leading_dim(per_client)

    def call(i):
      with training.unroll_steps(True):  # a step loop inside fn (fine-tuning) runs unrolled
        return one(shared, per_client, np.int32(i))
    todo, outs = self._run(call, c, active)
    return self._stack(c, todo, outs)

  def _work_fns(self, work, make_ctx):
    key = ('work', work, make_ctx)
    if key not in self._compiled:
      def ctx_of(sh, pc, i):
        return make_ctx(sh, jax.tree.map(lambda a: a[i], pc))

      def init(sh, pc, i):
        ctx, k = ctx_of(sh, pc, i)
        return training.work_init(work, ctx, k)

      def step(sh, pc, i, carry, idx, mask, k_steps, s):
        return training.work_step(work, ctx_of(sh, pc, i)[0], carry, idx, mask, k_steps, s)

      def final(sh, pc, i, carry):
        return work.final(ctx_of(sh, pc, i)[0], carry)
      self._compiled[key] = (jax.jit(init), jax.jit(step), jax.jit(final))
    return self._compiled[key]

  def run_work(self, work, make_ctx, shared, per_client, active=None, num_steps=None):
    init, step, final = self._work_fns(work, make_ctx)
    c = _leading_dim(per_client)

    def client(i):
      i32 = np.int32(i)
      carry, idx, mask, k_steps = init(shared, per_client, i32)
      n = idx.shape[0] if num_steps is None else int(num_steps[i])
      for s in range(n):
        carry = step(shared, per_client, i32, carry, idx, mask, k_steps, np.int32(s))
      return final(shared, per_client, i32, carry)

    todo, outs = self._run(client, c, active)
    return self._stack(c, todo, outs)


@dataclasses.dataclass
class ShardedExecutor(Executor):
  """The cohort's client axis sharded over all local devices (GPUs, TPU
  cores, or CPU devices forced with
  ``XLA_FLAGS=--xla_force_host_platform_device_count=8``), vectorized on
  each device, inside the one compiled round.

  The cohort is padded to a multiple of the device count by repeating
  clients (padded outputs dropped); per-client inputs and outputs are
  constrained to ``NamedSharding(mesh, P('clients'))`` and XLA's SPMD
  partitioner splits the work. With ``block_size``, each device processes its
  shard in blocks (bounded memory). Multi-host: call
  ``jax.distributed.initialize()`` first; ``jax.devices()`` then spans all
  hosts and the same mesh shards clients across them.
  """
  block_size: Optional[int] = None
  name: str = 'sharded'
  fused: bool = True

  def __post_init__(self):
    devices = np.array(jax.devices())
    self.mesh = jax.sharding.Mesh(devices, ('clients',),
                                  axis_types=(jax.sharding.AxisType.Auto,))
    self.spec = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec('clients'))

  def describe(self):
    return f'sharded({self.mesh.devices.size} devices' + (
        f', block_size={self.block_size})' if self.block_size else ')')

  def map(self, fn, shared, per_client, active=None):
    c = _leading_dim(per_client)
    d = self.mesh.devices.size
    padded = -(-c // d) * d
    fill = np.arange(padded) % c
    constrain = lambda a: jax.lax.with_sharding_constraint(a, self.spec)
    pc = jax.tree.map(lambda a: constrain(a if padded == c else a[fill]), per_client)
    if self.block_size:
      per_device = padded // d
      bs = min(self.block_size, per_device)
      nb = -(-per_device // bs)
      # [d * per_device] -> [d, nb, bs] blocks, each device looping over its own.
      def blocked(a):
        a = a.reshape((d, per_device) + a.shape[1:])
        if nb * bs != per_device:
          a = a[:, np.arange(nb * bs) % per_device]
        return a.reshape((d, nb, bs) + a.shape[2:])
      blocks = jax.tree.map(blocked, pc)
      with training.unroll_steps(False):
        out = jax.vmap(lambda dev: jax.lax.map(
            lambda b: jax.vmap(fn, in_axes=(None, 0))(shared, b), dev))(blocks)
      out = jax.tree.map(lambda o: o.reshape((d, nb * bs) + o.shape[3:])[:, :per_device]
                         .reshape((padded,) + o.shape[3:]), out)
    else:
      with training.unroll_steps(False):
        out = jax.vmap(fn, in_axes=(None, 0))(shared, pc)
    return jax.tree.map(lambda o: constrain(o)[:c], out)


def _has_conv(jaxpr) -> bool:
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'conv_general_dilated':
      return True
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (list, tuple)) else [v]):
        inner = getattr(sub, 'jaxpr', None)
        if inner is not None and _has_conv(getattr(inner, 'jaxpr', inner)):
          return True
  return False


def model_has_conv(model, sample_x) -> bool:
  """Whether the model's forward pass contains a convolution."""
  params = jax.eval_shape(model.init, jax.random.key(0))
  closed = jax.make_jaxpr(model.apply)(params, jnp.asarray(sample_x)[:1])
  return _has_conv(closed.jaxpr)


def create_executor(name: str = 'auto', model=None, sample_x=None,
                    block_size: Optional[int] = None, num_threads: int = 0) -> Executor:
  """Builds an executor by name; ``auto`` picks the fastest for the platform.

  ``auto``: on GPU/TPU, ``sharded`` over all devices when there are several,
  else ``vmap`` (``blocked`` when ``block_size`` is given);
  on CPU, ``sequential`` for models with convolutions and ``blocked`` (10
  clients a block) otherwise, as measured by scripts/benchmark.py (BUILD.md).
  """
  if name not in EXECUTOR_NAMES:
    raise ValueError(f'unknown executor {name!r}; choose one of {list(EXECUTOR_NAMES)}')
  if name == 'auto':
    if jax.default_backend() != 'cpu':
      name = 'sharded' if jax.device_count() > 1 else ('blocked' if block_size else 'vmap')
    elif model is not None and sample_x is not None and model_has_conv(model, sample_x):
      name = 'sequential'
    else:
      name = 'blocked'
  if name == 'vmap':
    return VmapExecutor()
  if name == 'sharded':
    return ShardedExecutor(block_size)
  if name == 'blocked':
    return BlockedExecutor(block_size or 10)
  return SequentialExecutor(num_threads=num_threads)
