"""Persistent client optimizer state (``--client_opt_state=persistent``).

By default a client's optimizer state (momentum buffer, Adam moments) starts
fresh every round, the usual FL convention. ``persistent_client_optimizer``
keeps each client's state across rounds instead, as the user-centric paper's
per-user Keras optimizers do: one stacked [N, ...] pytree next to the
algorithm's state, whose cohort rows are gathered into ``ctx.opt_state`` and
scattered back after the round. It wraps any algorithm whose client work
declares its optimizer state (``ClientWork.init_opt_state`` / ``opt_state``);
the algorithm itself is unchanged.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from fedjax_personal.core.algorithm import ClientRows, FederatedAlgorithm
from fedjax_personal.core.tree_util import rows, tree_broadcast, tree_scatter
from fedjax_personal.errors import SettingError

__all__ = ['persistent_client_optimizer', 'WithClientOptState']


@struct.dataclass
class WithClientOptState:
  """An algorithm's state with each client's optimizer state kept as rows.

  Attributes:
    inner: the algorithm's state.
    opt_state: stacked [N, ...] client optimizer states.
  """

  inner: Any
  opt_state: Any


def persistent_client_optimizer(
  alg: FederatedAlgorithm, num_clients: int
) -> FederatedAlgorithm:
  """``alg`` with each client's optimizer state kept across rounds.

  Args:
    alg: the algorithm (its client optimizer state restarts each round).
    num_clients: N: the state gains one optimizer state row per client.

  Returns:
    The algorithm whose client optimizer state persists
    (``--client_opt_state=persistent``).
  """
  work = alg.client_work
  init_opt_state, opt_state_of = work.init_opt_state, work.opt_state
  if init_opt_state is None or opt_state_of is None:
    raise SettingError(
      'client_opt_state', f'{alg.name} keeps no client optimizer state'
    )

  def init(key):
    inner = alg.init(key)
    shapes = jax.eval_shape(alg.model.init, key)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return WithClientOptState(
      inner, tree_broadcast(init_opt_state(params), num_clients)
    )

  def server_broadcast(state, cohort, rc):
    shared, per_client = alg.server_broadcast(state.inner, cohort, rc)
    return shared, (per_client, rows(state.opt_state, cohort.rows))

  def unwrap(ctx):
    per_client, opt_state = ctx.state
    return ctx.replace(state=per_client, opt_state=opt_state)

  wrapped = dataclasses.replace(
    work,
    init=lambda ctx, key: work.init(unwrap(ctx), key),
    step=lambda ctx, carry, batch, key: work.step(
      unwrap(ctx), carry, batch, key
    ),
    final=lambda ctx, carry: (
      work.final(unwrap(ctx), carry),
      opt_state_of(carry),
    ),
  )

  inner_rows = alg.client_rows

  def server_update(state, cohort, outputs, rc):
    out, opt_state = outputs
    inner = state.inner
    # the rows the engine writes for the algorithm alone
    if inner_rows is not None:
      inner, out = inner_rows.write(inner, cohort.rows, out)
    inner, metrics = alg.server_update(inner, cohort, out, rc)
    return WithClientOptState(
      inner, tree_scatter(state.opt_state, cohort.rows, opt_state)
    ), metrics

  pre_round = inner_pre_round = alg.pre_round
  if inner_pre_round is not None:

    def update(state, outputs, rc):
      inner, info = inner_pre_round.update(state.inner, outputs, rc)
      return state.replace(inner=inner), info

    pre_round = dataclasses.replace(
      inner_pre_round,
      broadcast=lambda state, rc: inner_pre_round.broadcast(state.inner, rc),
      update=update,
    )

  # The optimizer states are client rows, with the algorithm's own if it has
  # them: (inner rows or None, optimizer states).
  client_rows = ClientRows(
    get=lambda s: (
      None if inner_rows is None else inner_rows.get(s.inner),
      s.opt_state,
    ),
    put=lambda s, r: WithClientOptState(
      s.inner if inner_rows is None else inner_rows.put(s.inner, r[0]), r[1]
    ),
    models_from_rows=inner_rows is not None and inner_rows.models_from_rows,
  )

  return alg.replace(
    init=init,
    server_broadcast=server_broadcast,
    client_work=wrapped,
    server_update=server_update,
    client_rows=client_rows,
    client_models=lambda s: alg.client_models(s.inner),
    communication=(
      None
      if alg.communication is None
      else lambda s: alg.communication(s.inner)
    ),
    pre_round=pre_round,
    privacy=None
    if alg.privacy is None
    else dataclasses.replace(
      alg.privacy, steps=lambda s: alg.privacy.steps(s.inner)
    ),
  )
