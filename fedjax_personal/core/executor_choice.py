"""Which executor a run uses: ``create_executor`` by name, and ``auto``'s
choice by platform, processes and model (convolutions, parameter bytes),
with the reason the header prints.
"""

import os
from typing import Any, Optional

import jax
import jax.numpy as jnp

from fedjax_personal.core import host
from fedjax_personal.core.executors import (
  EXECUTOR_NAMES,
  BlockedExecutor,
  Executor,
  SequentialExecutor,
  ShardedExecutor,
  VmapExecutor,
)
from fedjax_personal.core.tree_util import tree_bytes
from fedjax_personal.models import Model

__all__ = [
  'CPU_BLOCK_BYTES',
  'cpu_block_size',
  'create_executor',
  'model_has_conv',
]


def _has_conv(jaxpr: Any) -> bool:
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'conv_general_dilated':
      return True
    for v in eqn.params.values():
      for sub in v if isinstance(v, (list, tuple)) else [v]:
        inner = getattr(sub, 'jaxpr', None)
        if inner is not None and _has_conv(getattr(inner, 'jaxpr', inner)):
          return True
  return False


def model_has_conv(model: Model, sample_x: Any) -> bool:
  """Whether the model is convolutional: its forward pass contains an XLA
  convolution, or it is one of the project's convolutional modules (they
  carry ``conv_impl``; with ``matmul`` they contain no convolution op).

  Args:
    model: the model.
    sample_x: one input batch.

  Returns:
    True when it convolves.
  """
  if getattr(getattr(model, 'module', None), 'conv_impl', None) is not None:
    return True
  params = jax.eval_shape(model.init, jax.random.key(0))
  closed = jax.make_jaxpr(model.apply)(params, jnp.asarray(sample_x)[:1])
  return _has_conv(closed.jaxpr)


def create_executor(
  name: str = 'auto',
  model: Optional[Model] = None,
  sample_x: Any = None,
  block_size: Optional[int] = None,
  num_threads: int = 0,
) -> Executor:
  """Builds an executor by name; ``auto`` picks the fastest for the platform.

  ``auto``: ``sharded`` over all processes' devices when several processes
  run the experiment (``run.distributed``); on GPU/TPU, ``sharded`` over all
  devices when there are several,
  else ``vmap`` (``blocked`` when ``block_size`` is given);
  on CPU, ``blocked`` by work on as many host threads as cores
  (``num_threads`` overrides): one client a block for models with
  convolutions, ``cpu_block_size`` clients for the others (unless
  ``block_size`` is given), as measured by benchmarks/peers/run.py and
  scripts/benchmark.py (benchmarks/speed/README.md). ``blocked`` named
  explicitly runs on ``num_threads`` threads (0 or 1: one fused program).

  Args:
    name: ``auto``, ``vmap``, ``blocked``, ``sequential`` or ``sharded``.
    model: the model (``auto`` looks for convolutions and parameter bytes).
    sample_x: one input batch of the model.
    block_size: clients per block (``blocked``).
    num_threads: host threads of the ``blocked`` executor (0: one per core).

  Returns:
    The ``Executor``; its ``reason`` says why ``auto`` chose it.
  """
  if name not in EXECUTOR_NAMES:
    raise ValueError(
      f'unknown executor {name!r}; choose one of {list(EXECUTOR_NAMES)}'
    )
  if jax.default_backend() == 'cpu':
    host.tune_allocator()
  if jax.process_count() > 1 and name not in ('auto', 'sharded'):
    raise ValueError(
      f'executor {name!r} runs on one process; with {jax.process_count()} '
      'processes the client axis is sharded over all of them: use sharded or '
      'auto'
    )
  if name == 'auto':
    return _auto(model, sample_x, block_size, num_threads)
  if name == 'vmap':
    return VmapExecutor()
  if name == 'sharded':
    return ShardedExecutor(block_size)
  if name == 'blocked':
    return BlockedExecutor(
      block_size or cpu_block_size(model), num_threads=max(1, num_threads)
    )
  return SequentialExecutor(num_threads=num_threads)


def _auto(
  model: Optional[Model],
  sample_x: Any,
  block_size: Optional[int],
  num_threads: int,
) -> Executor:
  """``auto``'s choice (``create_executor``), with its reason (a rule from
  the platform and the model's cost, measured in benchmarks/speed/README.md,
  "Against FedJAX on the field's populations")."""
  ex: Executor
  if jax.process_count() > 1:
    ex = ShardedExecutor(block_size)
    ex.reason = f'auto: {jax.process_count()} processes share the client axis'
    return ex
  if jax.default_backend() != 'cpu':
    if jax.device_count() > 1:
      ex = ShardedExecutor(block_size)
    elif block_size:
      ex = BlockedExecutor(block_size)
    else:
      ex = VmapExecutor()
    ex.plan_memory = block_size is None and not isinstance(ex, BlockedExecutor)
    ex.reason = 'auto: an accelerator vectorizes the cohort (blocks fitted to its free memory)'
    return ex
  threads = num_threads or os.cpu_count() or 1
  if (
    model is not None
    and sample_x is not None
    and model_has_conv(model, sample_x)
  ):
    ex = BlockedExecutor(block_size or 1, num_threads=threads)
    ex.reason = (
      f'auto: convolutions on a CPU, clients in blocks of {ex.block_size} by '
      f'their '
      f'real steps (XLA:CPU runs vectorized convolutions slowly), {threads} '
      f'host '
      'thread(s) sharing the blocks by work'
    )
    return ex
  bs = block_size or cpu_block_size(model)
  ex = BlockedExecutor(bs, num_threads=threads)
  ex.reason = (
    f'auto: no convolutions on a CPU, clients in blocks of {bs} by their real '
    f'steps, {threads} host thread(s) sharing the blocks by work'
    + ('' if block_size else ' (block size from the parameter bytes)')
  )
  return ex


#: The parameter bytes a CPU block of clients may hold (``cpu_block_size``).
CPU_BLOCK_BYTES = 1 << 20


def cpu_block_size(model: Optional[Model] = None) -> int:
  """Clients per block on CPU: as many as keep the block's parameters within
  ``CPU_BLOCK_BYTES``, between 1 and 10. Local SGD on small batches reads and
  writes every parameter each step, so a block that spills the caches runs
  at memory speed (MLP, 1,000 clients, blocks of 10: 1.55x slower than 1-4),
  and blocks by work cost a block's imbalance: one client a block for the
  MLP (0.84 MB; FedAvg on 3,400 EMNIST-shaped writers, cohorts 10 / 50:
  1.31x / 1.11x faster than blocks of 3). Small models (logistic
  regression: 5) still share a block.

  Args:
    model: the model (None: the default block).

  Returns:
    Clients per block.
  """
  if model is None:
    return 10
  nbytes = tree_bytes(model.param_shapes())
  return int(max(1, min(10, CPU_BLOCK_BYTES // max(nbytes, 1))))
