"""The pieces of one round: the server's broadcast to the cohort (``pre``:
a ``Broadcast`` of the ``RoundShared`` every client reads and each client's
``ClientInputs``), a client's ``ClientContext`` (``make_ctx``), the server's
update with the round's counts (``post``), and the whole round as one traced
function (``fused_round``), the algorithm's pre-round phase included
(``pre_round_functions``). ``engine.RoundRunner`` compiles them once per run.
"""

import collections
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from fedjax_personal.core import chained_work, tree_util
from fedjax_personal.core import system as system_lib
from fedjax_personal.core.algorithm import (
  ChainedOutputs,
  FederatedAlgorithm,
  PhasedOutputs,
  RoundContext,
  upload_communication,
)
from fedjax_personal.core.data import LocalData, client_row
from fedjax_personal.core.executors import Executor
from fedjax_personal.core.round_metrics import (
  PARTICIPATED,
  cohort_counts,
)
from fedjax_personal.core.sampling import Cohort, CohortSampler, client_keys
from fedjax_personal.core.training import ClientCall, ClientContext, WorkLimit
from fedjax_personal.core.tree_util import PyTree

__all__ = [
  'Broadcast',
  'ClientInputs',
  'PreRoundFunctions',
  'RoundFunctions',
  'RoundShared',
  'pre_round_functions',
  'round_functions',
  'rows_in_place',
  'PRE_ROUND',
  'PRE_ROUND_RAN',
]


#: Keys of a round's metrics that carry the pre-round phase's diagnostics
#: (``experiment`` merges them into the record when the phase ran).
PRE_ROUND_RAN, PRE_ROUND = 'pre_round_ran', 'pre_round'
#: ``fold_in`` tag of a client's key for its cohort phase's draws.
COHORT_PHASE_DRAWS = 0xC0


class PreRoundFunctions(NamedTuple):
  """The functions of an algorithm's pre-round phase.

  Its ``PreRound``, as ``pre_round_functions`` makes them.

  Attributes:
    due: ``round -> bool``, whether the phase runs this round.
    rc_of: ``(key, round) -> RoundContext`` of the phase.
    run: ``(state, rc, train, val) -> (state, diagnostics)``.
    phase_client: ``(SharedInputs, PhaseInputs) -> output`` of one
      client.
  """

  due: Callable
  rc_of: Callable
  run: Callable
  phase_client: Callable


class RoundFunctions(NamedTuple):
  """The pieces of one round (``round_functions``).

  Attributes:
    pre: ``(state, key, round, cohort=None, train=None) -> Broadcast``.
    make_ctx: ``(SharedInputs, ClientInputs) -> ClientCall``.
    post: ``(state, cohort, outputs, rc, RoundShared) -> (state, metrics)``.
    fused_round: ``(state, key, round, train, val) -> (state, metrics)``:
      the whole round as one traced function.
    cohort_phase: ``(RoundShared, cohort, ClientInputs, rc, train, val) ->
      RoundShared``: the algorithm's ``CohortPhase`` run on the cohort.
    chained: ``(state, cohort, rc, RoundShared, ClientInputs, train, val)
      -> ChainedOutputs``: the cohort's work of an algorithm with a
      ``CohortChain``, its clients in order.
  """

  pre: Callable
  make_ctx: Callable
  post: Callable
  fused_round: Callable
  cohort_phase: Callable
  chained: Callable


class Broadcast(NamedTuple):
  """What the server side of a round hands the clients (``pre``).

  Attributes:
    cohort: the round's ``Cohort``.
    rc: its ``RoundContext``.
    shared: what every client reads (``RoundShared``).
    per_client: each client's inputs (``ClientInputs``).
  """

  cohort: Cohort
  rc: RoundContext
  shared: 'RoundShared'
  per_client: 'ClientInputs'


def pre_round_functions(
  alg: FederatedAlgorithm, ex: Executor, counts=None
) -> PreRoundFunctions:
  """The algorithm's ``PreRound`` phase (``PreRoundFunctions``).

  ``run(state, rc, train, val) -> (state, diagnostics)`` computes the
  phase's client function on every client through the executor (client i's
  key is ``fold_in(rc.key, i)``) and the server update; the phase's key is
  ``fold_in(round_key, 2)``.

  Args:
    alg: the algorithm.
    ex: the executor.
    counts: a Counter of traces (None: a new one).

  Returns:
    ``(due, rc_of, run, phase_client)``.
  """
  counts = collections.Counter() if counts is None else counts
  pr = alg.pre_round
  if pr is None:
    raise ValueError(f'{alg.name} has no pre-round phase')

  def rc_of(key, round_num):
    return RoundContext(
      round=jnp.asarray(round_num, jnp.int32), key=jax.random.fold_in(key, 2)
    )

  def phase_client(shared_all: SharedInputs, c: PhaseInputs):
    """Client ``c``: its examples are row ``c.row`` of the split arrays."""
    counts['pre_round_client'] += 1
    shared, train, val = shared_all.common, shared_all.train, shared_all.val
    pos, key = c.row, c.key
    if pr.client is None:
      raise ValueError(f"{alg.name}'s pre-round phase has no client part")
    return pr.client(
      shared,
      LocalData(train=client_row(train, pos), val=client_row(val, pos)),
      key,
    )

  def run(state, rc, train, val):
    counts['pre_round'] += 1
    shared = pr.broadcast(state, rc)
    outputs = None
    if pr.client is not None:
      n = train.num_examples.shape[0]
      outputs = ex.map(
        phase_client,
        SharedInputs(shared, train, val),
        PhaseInputs(
          jnp.arange(n, dtype=jnp.int32), client_keys(rc.key, jnp.arange(n))
        ),
      )
    return pr.update(state, outputs, rc)

  return PreRoundFunctions(pr.due, rc_of, run, phase_client)


class SharedInputs(NamedTuple):
  """What every client of a phase reads.

  The server's part and the split arrays its rows index.

  Attributes:
    common: the round's ``RoundShared`` (a round's clients) or the pre-round
      phase's broadcast (its clients).
    train: the training split's arrays (``ClientData``), or None.
    val: the validation split's arrays, or None.
  """

  common: PyTree
  train: PyTree
  val: PyTree


class PhaseInputs(NamedTuple):
  """A pre-round phase's per-client inputs, stacked over its clients.

  Attributes:
    row: each client's row of the split arrays (its index on the device
      layout, its block position on the host layout).
    key: each client's key.
  """

  row: jax.Array
  key: jax.Array


class RoundShared(NamedTuple):
  """What every client of a round reads beside its own inputs.

  Attributes:
    broadcast: the server's broadcast (``server_broadcast``'s shared part).
    round: int32 scalar, rounds done before this one.
    devices: the round's draws of the clients' devices
      (``system.RoundSystem``: lost uploads, ...), or None when every
      client is a full, reliable device.
    phase: what ``server_update`` reads of the round's cohort phase
      (``PhaseResult.server``), or None.
  """

  broadcast: PyTree
  round: jax.Array
  devices: Optional[system_lib.RoundSystem] = None
  phase: PyTree = None


class ClientInputs(NamedTuple):
  """A round's per-client inputs, stacked over the cohort.

  Attributes:
    row: each client's row of the round's split arrays (its index on the
      device layout, its cohort position on the host layout).
    state: each client's part of the broadcast (``server_broadcast``'s
      per-client part: its rows of the state).
    key: each client's key.
    limit: the ``WorkLimit`` each client's device does
      (``ClientContext.work_limit``), or None: all of its work.
  """

  row: jax.Array
  state: PyTree
  key: jax.Array
  limit: Optional[WorkLimit] = None


def rows_in_place(client_rows, state, per_client) -> bool:
  """Whether a round's client blocks may read and write the state's client
  rows in one buffer: the algorithm declares the clients' new rows
  (``ClientRows.output``) and the per-client part of its broadcast is the
  state's rows themselves at the cohort's rows (``tree_util.Rows`` of the
  very arrays ``client_rows.get(state)`` holds), so each client's row is
  read from the buffer its new row is written to.

  Args:
    client_rows: the algorithm's ``ClientRows`` or None.
    state: the round's state (traced).
    per_client: the engine's ``ClientInputs``.

  Returns:
    bool.
  """
  if client_rows is None or client_rows.output is None:
    return False
  part = per_client.state
  if not tree_util.is_rows(part):
    return False
  held = jax.tree.leaves(client_rows.get(state))
  read = jax.tree.leaves(part.source)
  return len(held) == len(read) and all(a is b for a, b in zip(held, read))


def round_functions(
  alg: FederatedAlgorithm,
  sampler: CohortSampler,
  ex: Executor,
  counts=None,
  system: Optional[system_lib.Devices] = None,
  row_groups: Optional[int] = None,
) -> RoundFunctions:
  """The pieces of one round of ``alg`` (``RoundFunctions``).

  ``fused_round(state, key, round_num, train, val[, cohort]) -> (state,
  metrics)`` is the whole round as one traceable function (for fused executors),
  the algorithm's pre-round phase included (under ``lax.cond`` on its schedule;
  its diagnostics in ``metrics['pre_round']``, ``metrics['pre_round_ran']``
  saying whether it ran); ``pre`` / ``post`` are the server steps around client
  work for the sequential executor. The round key splits into the cohort's key
  and the clients' keys (client i's is ``fold_in(k_clients, i)``); the server's
  key is ``fold_in(k_cohort, 1)``.

  Args:
    alg: the algorithm.
    sampler: the cohort sampler.
    ex: the executor.
    counts: a Counter of traces (None: a new one).
    system: the clients' devices (``system.SystemConfig``; None or inactive:
      every sampled client does its full work and uploads). Its draws come
      from ``fold_in(k_cohort, SYSTEM_DRAWS)``; a client's work limit is the
      4th of its per-client inputs, the lost uploads the 3rd of ``shared``.
    row_groups: the input id that starts a group of a client's rows shuffled
      as one (``batching.row_groups``; the data set's
      ``DataOptions.row_group_start``), or None.

  Returns:
    The ``RoundFunctions``.
  """
  counts = collections.Counter() if counts is None else counts
  n_clients = sampler.num_clients
  prepared = None if system is None else system_lib.prepare(system, n_clients)
  devices = (
    prepared if prepared is not None and prepared.config.active else None
  )

  def pre(state, key, round_num, cohort=None, train=None):
    """The server's broadcast. A given ``cohort`` (the host layout's, drawn by
    ``system.draw_cohort`` from the same key) means the round's split arrays
    hold the cohort's rows in cohort order; without it they hold every client.
    ``train`` (the round's training split) gives the system its clients'
    work."""
    counts['pre'] += 1
    k_cohort, k_clients = jax.random.split(key)
    online = system_lib.available(devices, k_cohort, round_num, n_clients)
    if cohort is None:
      cohort = sampler(k_cohort, available=online, round_num=round_num)
      data_rows = cohort.idx
    else:
      data_rows = jnp.arange(cohort.idx.shape[0], dtype=jnp.int32)
    rc = RoundContext(
      round=jnp.asarray(round_num, jnp.int32),
      key=jax.random.fold_in(k_cohort, 1),
    )
    shared, per_client = alg.server_broadcast(state, cohort, rc)
    keys = client_keys(k_clients, cohort.idx)
    if devices is None:
      return Broadcast(
        cohort,
        rc,
        RoundShared(shared, rc.round),
        ClientInputs(data_rows, per_client, keys),
      )
    sizes = (
      None
      if train is None
      else jnp.where(
        cohort.mask,
        train.num_examples[
          jnp.clip(data_rows, 0, train.num_examples.shape[0] - 1)
        ],
        0,
      )
    )
    drawn = system_lib.draw(
      devices,
      jax.random.fold_in(k_cohort, system_lib.SYSTEM_DRAWS),
      cohort.mask,
      alg.client_work.batching,
      alg.partial_work,
      sizes,
      1 if train is None else train.max_examples,
      cohort.idx,
    )
    drawn = drawn._replace(
      available=None if online is None else jnp.sum(online)
    )
    return Broadcast(
      cohort,
      rc,
      RoundShared(
        shared, rc.round, drawn._replace(work_limit=None, step_cap=None)
      ),
      ClientInputs(
        data_rows, per_client, keys, WorkLimit(drawn.work_limit, drawn.step_cap)
      ),
    )

  def make_ctx(shared_all: SharedInputs, c: ClientInputs) -> ClientCall:
    counts['client'] += 1
    round_shared, train, val = (
      shared_all.common,
      shared_all.train,
      shared_all.val,
    )
    local = LocalData(
      train=client_row(train, c.row), val=client_row(val, c.row)
    )
    ctx = ClientContext(
      shared=round_shared.broadcast,
      state=c.state,
      data=local,
      round=round_shared.round,
      work_limit=c.limit,
      row_group_start=row_groups,
    )
    return ClientCall(ctx, c.key)

  def cohort_phase(shared: RoundShared, cohort, per_client, rc, train, val):
    """The algorithm's ``CohortPhase``: its client part on the cohort,
    folded by the server into the broadcast the cohort trains with."""
    cp = alg.cohort_phase
    assert cp is not None

    def phase_client(shared_all: SharedInputs, c: PhaseInputs):
      counts['cohort_phase_client'] += 1
      local = LocalData(
        train=client_row(shared_all.train, c.row),
        val=client_row(shared_all.val, c.row),
      )
      return cp.client(shared_all.common, local, c.key)

    keys = jax.vmap(lambda k: jax.random.fold_in(k, COHORT_PHASE_DRAWS))(
      per_client.key
    )
    outputs = ex.map(
      phase_client,
      SharedInputs(shared.broadcast, train, val),
      PhaseInputs(per_client.row, keys),
      active=system_lib.uploading(cohort, shared.devices),
    )
    result = cp.fold(shared.broadcast, cohort, outputs, rc)
    return shared._replace(broadcast=result.broadcast, phase=result.server)

  def chained(state, cohort, rc, shared: RoundShared, per_client, train, val):
    """The algorithm's ``CohortChain``: the cohort's clients in order
    (``chained_work.run_chain``), as ``ChainedOutputs``."""
    chain = alg.cohort_chain
    assert chain is not None
    ran = chained_work.run_chain(
      alg.client_work,
      make_ctx,
      SharedInputs(shared, train, val),
      per_client,
      cohort.idx,
      system_lib.uploading(cohort, shared.devices),
      chain,
      chain.start(state, cohort, rc),
    )
    return ChainedOutputs(ran.carry, ran.outputs)

  def post(state, cohort, outputs, rc, shared: RoundShared):
    counts['post'] += 1
    chain_end = None
    if alg.cohort_chain is not None:  # ``chained``'s outputs
      chain_end, outputs = outputs
    sampled = cohort
    drawn_devices = shared.devices
    # a lost upload is a padded slot for the server
    if drawn_devices is not None:
      cohort = system_lib.without(cohort, drawn_devices.lost, n_clients)
    # the new rows the engine writes (ClientRows.output)
    if alg.client_rows is not None:
      state, outputs = alg.client_rows.write(state, cohort.rows, outputs)
    comm = (
      None
      if alg.communication is not None
      else upload_communication(outputs, shared.broadcast, cohort.mask.shape[0])
    )
    if alg.cohort_phase is not None:
      outputs = PhasedOutputs(shared.phase, outputs)
    if alg.cohort_chain is not None:
      outputs = ChainedOutputs(chain_end, outputs)
    state, metrics = alg.server_update(state, cohort, outputs, rc)
    metrics, drawn = dict(metrics), {}
    if drawn_devices is not None:
      metrics[PARTICIPATED] = (
        metrics.get(PARTICIPATED, True) & ~drawn_devices.lost
      )
      drawn = system_lib.system_metrics(drawn_devices, sampled.mask)
    # takes PARTICIPATED out
    counted = cohort_counts(alg, state, sampled, metrics, comm)
    return state, {**metrics, **counted, **drawn}

  def fused_pre_round(state, key, round_num, train, val):
    if alg.pre_round is None:
      return state, {}
    due, rc_of, run, _ = pre_round_functions(alg, ex, counts)
    rc = rc_of(key, round_num)
    diag_shape = jax.eval_shape(lambda s: run(s, rc, train, val)[1], state)

    def skip(s):
      return s, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), diag_shape)

    ran = jnp.asarray(due(rc.round))
    state, diag = jax.lax.cond(
      ran, lambda s: run(s, rc, train, val), skip, state
    )
    return state, {PRE_ROUND_RAN: ran, PRE_ROUND: diag}

  def fused_round(state, key, round_num, train, val, cohort=None):
    counts['round'] += 1
    phase = {}
    # the host layout runs the phase apart (it streams every client)
    if cohort is None:
      state, phase = fused_pre_round(state, key, round_num, train, val)
    cohort, rc, shared, per_client = pre(state, key, round_num, cohort, train)
    if alg.cohort_phase is not None:
      shared = cohort_phase(shared, cohort, per_client, rc, train, val)
    cr = alg.client_rows
    if alg.cohort_chain is not None:
      outputs = chained(state, cohort, rc, shared, per_client, train, val)
    elif (
      devices is None
      and ex.writes_rows
      and cr is not None
      and rows_in_place(cr, state, per_client)
    ):
      # The client blocks read and write the state's rows (ClientRows.output).
      outputs, new_rows = ex.run_work(
        alg.client_work,
        make_ctx,
        SharedInputs(shared, train, val),
        per_client,
        active=cohort.mask,
        rows_in_place=(cr.output, 'state'),
      )
      # the outputs' field is None: post writes nothing
      state = cr.put(state, new_rows)
    else:
      outputs = ex.run_work(
        alg.client_work,
        make_ctx,
        SharedInputs(shared, train, val),
        per_client,
        active=system_lib.uploading(cohort, shared.devices),
      )
    state, metrics = post(state, cohort, outputs, rc, shared)
    return state, {**metrics, **phase}

  return RoundFunctions(pre, make_ctx, post, fused_round, cohort_phase, chained)
