"""How ``auto``'s executor is fitted to a run on an accelerator: blocks of
clients grouped by work for a heavy-tailed cohort, blocks that fit the
device's free memory (``RoundRunner`` asks once, when the executor says
``plan_memory``).
"""

from typing import Optional

import numpy as np

from fedjax_personal.core import memory
from fedjax_personal.core.executors import (
  BlockedExecutor,
  Executor,
  ShardedExecutor,
  VmapExecutor,
)

__all__ = [
  'ACCELERATOR_WORK_BLOCK',
  'WORK_BLOCKS_BELOW',
  'fit_accelerator',
  'fit_memory',
  'fit_work',
]


def fit_memory(executor: Executor, need, free_bytes: Optional[int]) -> Executor:
  """``executor`` (``vmap`` or ``sharded``, chosen by ``auto`` on an
  accelerator) in blocks when its whole cohort would not fit in
  ``free_bytes`` per device (``memory.block_size``; unchanged without memory
  statistics, e.g. on CPU).

  Args:
    executor: the chosen executor.
    need: the round's memory estimate.
    free_bytes: the device's free bytes.

  Returns:
    The executor that fits, and why.

  Raises:
    SettingError: not even one client a block fits.
  """
  if free_bytes is None or not isinstance(
    executor, (VmapExecutor, ShardedExecutor)
  ):
    return executor
  devices = (
    executor.mesh.devices.size if isinstance(executor, ShardedExecutor) else 1
  )
  block = memory.block_size(need, free_bytes, devices)
  if block is None:
    return executor
  ex = ShardedExecutor(block) if devices > 1 else BlockedExecutor(block)
  ex.reason = (
    f'auto: the whole cohort does not fit the {free_bytes / (1 << 30):.1f} GB '
    f'free, '
    f'blocks of {block} clients'
  )
  return ex


#: Clients per block when ``auto`` on an accelerator runs a heavy-tailed
#: cohort in blocks by work (``fit_work``). Measured on an H200, FedAvg on
#: 3,400 EMNIST-shaped writers (mean 175 examples, capped at 256, batch 20),
#: the McMahan CNN, a cohort of 500: the whole cohort vmapped 0.449-0.460
#: s/round, blocks of 250 0.394, of 100 0.365, of 50 0.366
#: (benchmarks/speed/README.md, "On a GPU").
ACCELERATOR_WORK_BLOCK = 100
#: ``fit_work`` blocks a cohort when the population's mean real local steps
#: are below this share of its largest (over a fifth of a vmapped cohort's
#: steps would be padding; the EMNIST shape above: 0.71).
WORK_BLOCKS_BELOW = 0.8


def fit_work(executor: Executor, steps, cohort_size: int) -> Executor:
  """``executor`` (``vmap``, chosen by ``auto`` on an accelerator) in blocks
  of ``ACCELERATOR_WORK_BLOCK`` clients grouped by their real steps when the
  cohort is large enough for several such blocks and the population's work
  is heavy-tailed (mean real steps below ``WORK_BLOCKS_BELOW`` of the
  largest): a vmapped cohort steps as long as its longest client, blocks by
  work each as long as theirs. Equal clients keep one vectorized cohort.

  Args:
    executor: the executor ``auto`` chose.
    steps: every client's real local steps (host ints).
    cohort_size: clients per round.

  Returns:
    ``executor``, or a ``BlockedExecutor`` saying why.
  """
  steps = np.asarray(steps)
  if (
    type(executor) is not VmapExecutor
    or cohort_size < 2 * ACCELERATOR_WORK_BLOCK
    or steps.size == 0
    or steps.max() == 0
  ):
    return executor
  share = float(steps.mean() / steps.max())
  if share >= WORK_BLOCKS_BELOW:
    return executor
  ex = BlockedExecutor(ACCELERATOR_WORK_BLOCK)
  ex.reason = (
    f'auto: a heavy-tailed cohort of {cohort_size} on an accelerator (mean '
    f'real steps '
    f'{share:.0%} of the largest), clients in blocks of '
    f'{ACCELERATOR_WORK_BLOCK} by '
    'their real steps'
  )
  return ex


def fit_accelerator(
  executor: Executor, steps, cohort_size: int, need, free_bytes: Optional[int]
) -> Executor:
  """``auto``'s executor on an accelerator fitted to the run: in blocks by
  work for a heavy-tailed cohort (``fit_work``), in blocks that fit the free
  memory (``fit_memory``), the smaller blocks of the two.

  Args:
    executor: the executor ``auto`` chose (``plan_memory``).
    steps: every client's real local steps.
    cohort_size: clients per round.
    need: ``memory.estimate`` of the round.
    free_bytes: the device's free memory (None: unknown, no memory blocks).

  Returns:
    The executor the run uses.

  Raises:
    SettingError: not even one client fits (``memory.block_size``).
  """
  by_memory = fit_memory(executor, need, free_bytes)
  by_work = fit_work(executor, steps, cohort_size)
  if by_work is executor:
    return by_memory
  if (
    isinstance(by_memory, BlockedExecutor)
    and isinstance(by_work, BlockedExecutor)
    and by_memory.block_size <= by_work.block_size
  ):
    return by_memory
  return by_work
