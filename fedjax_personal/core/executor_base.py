"""The executor contract: what every executor implements (``Executor``: how
a cohort's per-client computations run) and the types passed to it.

The executors themselves (``vmap``, ``blocked``, ``sequential``,
``sharded``) are in ``executors``, which re-exports these names.
"""

import abc
import copy
from typing import Any, Callable, Optional, Sequence

import jax

from fedjax_personal import numerics
from fedjax_personal.core import training
from fedjax_personal.core.tree_util import PyTree

__all__ = [
  'Active',
  'ClientFn',
  'Executor',
  'EXECUTOR_NAMES',
  'MakeContext',
  'no_rows_in_place',
]

EXECUTOR_NAMES = ('auto', 'vmap', 'blocked', 'sequential', 'sharded')

# make_ctx(shared_all, client) -> ClientCall (a ClientContext and a key): builds
# one client's context from what is shared by the round and the client's
# stacked inputs.
MakeContext = Callable[[Any, Any], training.ClientCall]
#: ``(shared, client inputs) -> output``: what ``map`` runs on each client.
ClientFn = Callable[[Any, Any], Any]
#: bool [C], the cohort's real (active) slots, or None: every slot.
Active = Optional[Any]


def no_rows_in_place(ex: 'Executor', rows_in_place: Optional[tuple]) -> None:
  """Refuses ``rows_in_place`` for an executor that does not write client
  rows.

  Args:
    ex: the executor.
    rows_in_place: what the round asked of it (None: nothing).

  Returns:
    None.

  Raises:
    ValueError: ``rows_in_place`` was given.
  """
  if rows_in_place is not None:
    raise ValueError(f'{ex.name} does not write client rows in place')


class Executor(abc.ABC):
  """Maps per-client computations over stacked per-client inputs."""

  name: str = ''
  #: True when calls may be traced inside an outer ``jax.jit`` (then a round is
  #: one compiled function); False when the executor dispatches from Python.
  fused: bool = True
  #: ``run_work`` takes ``rows_in_place`` (``client_blocks.block_loop``).
  writes_rows: bool = False
  #: Chosen by ``auto`` on an accelerator: the round runner fits its blocks to
  #: the device's free memory and the cohort's work (``fitting``).
  plan_memory: bool = False
  #: Why ``auto`` chose this executor ('' when it was named); the CLI's
  #: header prints it.
  reason: str = ''
  #: The matmul precision its compiled functions are traced at
  #: (``at_matmul_precision``; the round runner sets its own), or None:
  #: JAX's setting where they are traced.
  matmul_precision: Optional[str] = None

  def at_matmul_precision(self, name: str) -> 'Executor':
    """This executor with every function it compiles traced at matmul
    precision ``name`` (``numerics.scoped``: in whichever thread compiles it).

    Args:
      name: one of ``numerics.MATMUL_PRECISIONS``.

    Returns:
      The executor (a copy; ``self`` when it has that precision already).
    """
    if self.matmul_precision == name:
      return self
    out = copy.copy(self)
    out.matmul_precision = name
    # its own programs, compiled at its precision
    for cache in (
      '_compiled',
      '_seen',
    ):
      if hasattr(out, cache):
        setattr(out, cache, type(getattr(out, cache))())
    return out

  def jit(self, fn: Callable, **kwargs) -> Callable:
    """``jax.jit(fn, **kwargs)``, ``fn`` traced at the executor's matmul
    precision (the engine compiles through this).

    Args:
      fn: the function.
      **kwargs: ``jax.jit``'s.

    Returns:
      The jitted function.
    """
    if self.matmul_precision is not None:
      fn = numerics.scoped(fn, self.matmul_precision)
    return jax.jit(fn, **kwargs)

  @abc.abstractmethod
  def map(
    self,
    fn: ClientFn,
    shared: PyTree,
    per_client: PyTree,
    active: Active = None,
  ) -> PyTree:
    """``fn(shared, client_i)`` stacked over the leading axis of ``per_client``.

    ``per_client`` leaves are stacked [C, ...] arrays or ``tree_util.Rows``
    (gathered where the client runs). ``active`` (bool [C]) marks the real
    cohort slots: ``aggregation.Sum`` outputs are summed over them (without a
    client axis); other outputs are stacked [C, ...], zeros or junk in
    inactive slots, which callers mask.
    """

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
    """Runs ``work`` for every client; returns the stacked ``final`` outputs.

    ``num_steps`` (host ints [C]) are the clients' real step counts, used by
    executors that skip padded steps. ``rows_in_place`` is for executors that
    write client rows in place (``writes_rows``) alone.
    """
    no_rows_in_place(self, rows_in_place)

    def fn(sh, c):
      ctx, key = make_ctx(sh, c)
      return training.run_work(work, ctx, key)

    return self.map(fn, shared, per_client, active)

  def describe(self) -> str:
    return self.name

  def for_run(self, state_shapes: PyTree, num_clients: int) -> 'Executor':
    """The executor a run of this state uses (``RoundRunner`` asks once):
    ``self``, unless the state makes another form the better choice."""
    del state_shapes, num_clients
    return self

  def state_shardings(self, state_shapes: PyTree, num_clients: int) -> Any:
    """Where the algorithm's state lives between rounds (a pytree of
    shardings), or None to leave it to XLA (one device)."""
    del state_shapes, num_clients
    return None

  def host_readable(self, tree: PyTree) -> PyTree:
    """``tree`` (traced, inside a compiled function) placed where every
    process can read it: what a round or an evaluation returns to the host
    (metrics, per-client statistics). The identity on one process."""
    return tree
