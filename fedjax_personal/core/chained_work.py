"""A round's clients one after another (``algorithm.CohortChain``).

APPLE's clients read what the clients before them in the round wrote, so
they cannot run side by side: the engine runs the cohort as a scan over its
slots, in their order, the chain's carry threaded through; each client runs
its own real steps (a ``while_loop`` to its step count, as a blocked
executor's client does), so a client costs its own work. The fused
executors trace this into the compiled round; a dispatching executor
compiles it as one function of its own between the server's steps.
"""

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_personal.core import aggregation, training, tree_util
from fedjax_personal.core.algorithm import CohortChain
from fedjax_personal.core.tree_util import PyTree

__all__ = ['ChainRan', 'run_chain']


class ChainRan(NamedTuple):
  """A chained cohort's work.

  Attributes:
    outputs: the clients' outputs, stacked [C] (``Sum`` nodes summed over
      the active slots), as an executor's ``run_work`` returns them.
    carry: the chain after the last client.
  """

  outputs: PyTree
  carry: PyTree


def run_chain(
  work: training.ClientWork,
  make_ctx: Callable[[Any, Any], training.ClientCall],
  shared: PyTree,
  per_client: PyTree,
  ids: jax.Array,
  active: jax.Array,
  chain: CohortChain,
  carry: PyTree,
) -> ChainRan:
  """The cohort's clients in slot order, each reading the chain the ones
  before it wrote (``ClientContext.chain``) and writing its own.

  Args:
    work: the algorithm's ``ClientWork``.
    make_ctx: ``(shared, inputs) -> ClientCall`` (the round's).
    shared: what every client reads (``SharedInputs``).
    per_client: the cohort's per-client inputs [C].
    ids: int32 [C], each slot's client id (what ``chain.write`` gets).
    active: bool [C], the slots that run and write (real, uploading).
    chain: the algorithm's ``CohortChain``.
    carry: the chain before the first client (``chain.start``'s).

  Returns:
    The ``ChainRan``.
  """
  c = ids.shape[0]

  def client(carry, pos):
    ctx, key = make_ctx(shared, tree_util.client_slice(per_client, pos))
    ctx = dataclasses.replace(ctx, chain=carry)
    steps = jnp.where(
      active[pos], training.work_num_steps(work, ctx, key), 0
    ).astype(jnp.int32)
    out = training.run_work(work, ctx, key, steps)
    # a branch, not a select: the chain's buffers are written in place
    carry = jax.lax.cond(
      active[pos], lambda c: chain.write(c, ids[pos], out), lambda c: c, carry
    )
    return carry, out

  carry, outputs = jax.lax.scan(client, carry, jnp.arange(c))
  return ChainRan(aggregation.sum_clients(outputs, active), carry)
