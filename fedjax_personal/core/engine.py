"""Composes an algorithm, data, a cohort sampler and an executor into rounds.

``RoundRunner`` builds the round once per experiment. With a fused executor
(``vmap``, ``blocked``) one round is one ``jax.jit``-compiled function of
(state, key, data); with ``sequential`` it is a compiled server step, compiled
client init / step / final dispatched per client, and a compiled aggregation.
Every compiled piece compiles once per run (``trace_counts`` records traces).
"""

import collections
import dataclasses
import os
import tempfile
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal import numerics
from fedjax_personal.core import evaluation, fitting, memory, tree_util
from fedjax_personal.core import host as host_lib
from fedjax_personal.core import system as system_lib
from fedjax_personal.core.algorithm import (
  FederatedAlgorithm,
  RoundContext,
  upload_communication,
)
from fedjax_personal.core.data import LocalData, client_row
from fedjax_personal.core.evaluation import eval_function
from fedjax_personal.core.evaluation_stats import (  # noqa: F401  (the engine's API)
  evaluation_record,
  per_client_accuracy,
  summarize,
)
from fedjax_personal.core.executors import EXECUTOR_NAMES, Executor
from fedjax_personal.core.population import (
  placement,
  rows_in_files,
  rows_in_memory,
)
from fedjax_personal.core.round_metrics import (
  PARTICIPATED,
  cohort_counts,
  communication_metrics,
)
from fedjax_personal.core.sampling import CohortSampler, client_keys
from fedjax_personal.core.training import ClientContext, LossStats
from fedjax_personal.core.tree_util import PyTree
from fedjax_personal.hparams import Declared, hparam

__all__ = [
  'communication_metrics',
  'EngineConfig',
  'PARTICIPATED',
  'pre_round_functions',
  'PyTree',
  'round_functions',
  'RoundRunner',
]


@dataclasses.dataclass(frozen=True)
class EngineConfig(Declared):
  """How the engine runs client work, where clients live and at what matmul
  precision it computes, declared once (``hparam``; the command's flags are
  generated from these fields). The executor and layout change speed and
  memory, never the numbers (up to float reassociation); the precision is
  recorded with the run."""

  executor: str = hparam(
    'auto', 'How client work runs.', choices=EXECUTOR_NAMES
  )
  block_size: Optional[int] = hparam(
    None, 'Clients per block for the blocked executor.', minimum=1
  )
  layout: str = hparam(
    'auto',
    "Where the clients' examples live: device (every client padded to "
    'the largest, on the device), host (the population store; each round '
    'gathers its cohort) or auto (device when the padded population takes at '
    'most a quarter of the free memory and, on an accelerator, fits beside '
    'the largest algorithm state).',
    choices=placement.LAYOUTS,
  )
  client_state: str = hparam(
    'auto',
    'Host layout: where client rows (personal models, control '
    'variates, FedDyn gradients, persistent client optimizers) live. '
    'memory: host memory, all made at the start; disk: files under '
    'client_rows/ in the output folder, a row written when its client first '
    'trains (a client never met costs nothing); auto: memory unless the '
    'rows take more than half the available memory.',
    choices=('auto', 'memory', 'disk'),
  )
  matmul_precision: str = hparam(
    numerics.DEFAULT_MATMUL_PRECISION,
    'Precision of every float32 matmul and convolution of '
    "the run, traced into what the engine compiles (JAX's own setting is left alone): "
    'float32 (the default: the same numbers on every card), tf32 (TensorFloat-32 products, a '
    "GPU's fast default), bf16x3 (three bfloat16 passes, near float32), bf16 (one bfloat16 "
    "pass, a TPU's default), or JAX's default / high / highest (the command's default when "
    'not given: $JAX_DEFAULT_MATMUL_PRECISION if set). On a CPU only float32 is accepted: '
    'XLA:CPU computes float32 whatever the setting, so a reduced one would be recorded but not '
    'used. Recorded in the run identity.',
    choices=tuple(numerics.MATMUL_PRECISIONS),
  )


#: Keys of a round's metrics that carry the pre-round phase's diagnostics
#: (``experiment`` merges them into the record when the phase ran).
PRE_ROUND_RAN, PRE_ROUND = 'pre_round_ran', 'pre_round'


def pre_round_functions(alg: FederatedAlgorithm, ex: Executor, counts=None):
  """The algorithm's ``PreRound`` phase: (due, rc_of, run, phase_client).

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

  def phase_client(shared_all, c):
    """Client ``c = (row, key)``: its examples are row ``row`` of the
    split arrays (its index on the device layout, its block position on the
    host layout)."""
    counts['pre_round_client'] += 1
    shared, train, val = shared_all
    pos, key = c
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
        (shared, train, val),
        (jnp.arange(n, dtype=jnp.int32), client_keys(rc.key, jnp.arange(n))),
      )
    return pr.update(state, outputs, rc)

  return pr.due, rc_of, run, phase_client


#: Where the algorithm's broadcast part sits in the engine's per-client
#: inputs ``(data_rows, broadcast part, keys)`` (``round_functions``' ``pre``).
BROADCAST_SLOT = 1


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
    per_client: the engine's per-client inputs ``(data_rows, broadcast part, keys)``.

  Returns:
    bool.
  """
  if client_rows is None or client_rows.output is None:
    return False
  part = per_client[BROADCAST_SLOT]
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
):
  """The pieces of one round of ``alg``: (pre, make_ctx, post, fused_round).

  ``fused_round(state, key, round_num, train, val[, cohort]) -> (state,
  metrics)`` is the whole round as one traceable function (for fused executors), the
  algorithm's pre-round phase included (under ``lax.cond`` on its schedule;
  its diagnostics in ``metrics['pre_round']``, ``metrics['pre_round_ran']``
  saying whether it ran); ``pre`` / ``post`` are the server steps around
  client work for the sequential executor. The round key splits into the
  cohort's key and the clients' keys (client i's is ``fold_in(k_clients,
  i)``); the server's key is ``fold_in(k_cohort, 1)``.

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
    ``(pre, make_ctx, post, fused_round)``.
  """
  counts = collections.Counter() if counts is None else counts
  n_clients = sampler.num_clients
  prepared = None if system is None else system_lib.prepare(system, n_clients)
  devices = (
    prepared if prepared is not None and prepared.config.active else None
  )

  def pre(state, key, round_num, cohort=None, train=None):
    """The server's broadcast. A given ``cohort`` (the host layout's, drawn
    by ``system.draw_cohort`` from the same key) means the round's split arrays hold
    the cohort's rows in cohort order; without it they hold every client.
    ``train`` (the round's training split) gives the system its clients' work."""
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
      return cohort, rc, (shared, rc.round), (data_rows, per_client, keys)
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
    return (
      cohort,
      rc,
      (shared, rc.round, drawn._replace(work_limit=None, step_cap=None)),
      (data_rows, per_client, keys, (drawn.work_limit, drawn.step_cap)),
    )

  def make_ctx(shared_all, c):
    counts['client'] += 1
    (shared, round_num, *_), train, val = shared_all
    row, client_state, key, *limit = c
    local = LocalData(train=client_row(train, row), val=client_row(val, row))
    return ClientContext(
      shared=shared,
      state=client_state,
      data=local,
      round=round_num,
      work_limit=limit[0] if limit else None,
      row_group_start=row_groups,
    ), key

  def post(state, cohort, outputs, rc, shared):
    counts['post'] += 1
    sampled = cohort
    if devices is not None:  # a lost upload is a padded slot for the server
      cohort = system_lib.without(cohort, shared[2].lost, n_clients)
    if (
      alg.client_rows is not None
    ):  # the new rows the engine writes (ClientRows.output)
      state, outputs = alg.client_rows.write(state, cohort.rows, outputs)
    comm = (
      None
      if alg.communication is not None
      else upload_communication(outputs, shared[0], cohort.mask.shape[0])
    )
    state, metrics = alg.server_update(state, cohort, outputs, rc)
    metrics, drawn = dict(metrics), {}
    if devices is not None:
      metrics[PARTICIPATED] = metrics.get(PARTICIPATED, True) & ~shared[2].lost
      drawn = system_lib.system_metrics(shared[2], sampled.mask)
    counted = cohort_counts(
      alg, state, sampled, metrics, comm
    )  # takes PARTICIPATED out
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
    if (
      cohort is None
    ):  # the host layout runs the phase apart (it streams every client)
      state, phase = fused_pre_round(state, key, round_num, train, val)
    cohort, rc, shared, per_client = pre(state, key, round_num, cohort, train)
    cr = alg.client_rows
    if (
      devices is None
      and ex.writes_rows
      and cr is not None
      and rows_in_place(cr, state, per_client)
    ):
      # The client blocks read and write the state's rows (ClientRows.output).
      outputs, new_rows = ex.run_work(
        alg.client_work,
        make_ctx,
        (shared, train, val),
        per_client,
        active=cohort.mask,
        rows_in_place=(cr.output, BROADCAST_SLOT),
      )
      state = cr.put(
        state, new_rows
      )  # the outputs' field is None: post writes nothing
    else:
      outputs = ex.run_work(
        alg.client_work,
        make_ctx,
        (shared, train, val),
        per_client,
        active=system_lib.uploading(cohort, shared),
      )
    state, metrics = post(state, cohort, outputs, rc, shared)
    return state, {**metrics, **phase}

  return pre, make_ctx, post, fused_round


#: A hosted-rows round whose cohort's rows take at least this many bytes
#: hands the heap's free pages back when it ends (``host.return_free_heap``):
#: the size above which glibc's own defaults return a freed block.
RETURN_HEAP_BYTES = 32 << 20


class RoundRunner:
  """Runs rounds and evaluations of one algorithm on one data set.

  Args:
    algorithm: the FederatedAlgorithm.
    data: FederatedData (device arrays).
    sampler: CohortSampler.
    executor: Executor for client work.
    feed: the host layout's ``placement.CohortFeed`` to share with other runs
      of the same data and sampler (their rounds of the same key then share
      one gather); by default the runner's own.
    matmul_precision: the precision every computation of the run is traced
      at (``numerics``; ``FederatedAlgorithm.at_matmul_precision``), whatever
      JAX's setting: float32 by default, the same numbers on every card.
    system: the clients' devices (``system.SystemConfig``: stragglers, lost
      uploads); None: every sampled client does its work and uploads.
    row_groups: as for ``round_functions`` (rows shuffled in groups).
  """

  def __init__(
    self,
    algorithm: FederatedAlgorithm,
    data,
    sampler: CohortSampler,
    executor: Executor,
    feed: Optional[placement.CohortFeed] = None,
    matmul_precision: str = numerics.DEFAULT_MATMUL_PRECISION,
    system: Optional[system_lib.Devices] = None,
    row_groups: Optional[int] = None,
  ):
    self.host = data if isinstance(data, placement.HostData) else None
    population = self.host.population if self.host else data
    self.system = (
      None
      if system is None
      else system_lib.prepare(system, population.num_clients)
    )
    self.row_groups = row_groups
    for _, problem in (
      self.system.config.problems(algorithm.client_work.batching)
      if self.system
      else []
    )[:1]:
      raise ValueError(problem)
    if sampler.num_clients != population.num_clients:
      raise ValueError(
        f'sampler has {sampler.num_clients} clients, data has '
        f'{population.num_clients}'
      )
    if self.host is not None and jax.process_count() > 1:
      raise ValueError(
        'the host layout runs on one process; several processes use the layout '
        "'device'"
      )
    self.matmul_precision = numerics.check_precision(matmul_precision)
    algorithm = algorithm.at_matmul_precision(self.matmul_precision)
    self.algorithm = algorithm
    # The host layout keeps the algorithm's client rows with the population.
    self.hosted_rows = (
      self.host is not None and algorithm.client_rows is not None
    )
    self.data = data
    self.population = population
    self.sampler = sampler
    if (
      executor.plan_memory
    ):  # auto on an accelerator: blocks by work, blocks that fit
      counts, batching = (
        np.asarray(population.train.num_examples),
        algorithm.client_work.batching,
      )
      executor = fitting.fit_accelerator(
        executor,
        [batching.num_steps_for(int(n), int(counts.max())) for n in counts],
        sampler.capacity,
        memory.estimate(algorithm, population, sampler.capacity),
        memory.device_free_bytes(),
      )
    self.executor = executor.for_run(
      jax.eval_shape(algorithm.init, jax.random.key(0)), population.num_clients
    ).at_matmul_precision(self.matmul_precision)
    self.trace_counts: collections.Counter = collections.Counter()
    if self.host is None:
      work = algorithm.client_work
      max_n = int(data.train.max_examples)
      self._host_steps = np.array(
        [
          work.batching.num_steps_for(int(n), max_n)
          for n in np.asarray(data.train.num_examples)
        ]
      )
      self._build()
    else:
      self._build_host(feed)

  def _jit_round(self, fused_round):
    """The fused round, compiled in its two forms: {donate: jitted}. The
    donating form lets XLA update the state in place (scatters into
    per-client state included), so a round holds one copy of the state."""
    ex = self.executor

    def finished(state, key, round_num, train, val, cohort=None):
      state, metrics = fused_round(state, key, round_num, train, val, cohort)
      if self._state_shardings is not None:
        state = jax.lax.with_sharding_constraint(state, self._state_shardings)
      return state, ex.host_readable(metrics)

    return {False: ex.jit(finished), True: ex.jit(finished, donate_argnums=0)}

  def _dispatched_pre_round(self, client_outputs):
    """``phase(state, key, round) -> (state, diagnostics)``: the algorithm's
    pre-round phase dispatched from Python (the same functions as the fused
    round's); ``client_outputs(phase_client, shared, rc)`` runs its client
    part over every client (all at once on the device layout, streamed in
    blocks on the host layout)."""
    alg, ex = self.algorithm, self.executor
    if alg.pre_round is None:
      return lambda state, key, rnd: (state, {})
    pr = alg.pre_round
    due, rc_of, _, phase_client = pre_round_functions(
      alg, ex, self.trace_counts
    )
    due_j, rc_j = ex.jit(due), ex.jit(rc_of)
    bcast_j, update_j = ex.jit(pr.broadcast), ex.jit(pr.update)

    def phase(state, key, rnd):
      rc = rc_j(key, jnp.asarray(rnd, jnp.int32))
      if not bool(due_j(rc.round)):
        return state, {PRE_ROUND_RAN: False}
      outputs = (
        None
        if pr.client is None
        else client_outputs(phase_client, bcast_j(state, rc), rc)
      )
      state, diag = update_j(state, outputs, rc)
      return state, {PRE_ROUND_RAN: True, PRE_ROUND: diag}

    return phase

  def _dispatched_work(self, pre, make_ctx, post, steps_of):
    """``work(state, key, rnd, train, val, cohort=None) -> (state, metrics)``:
    the round's server steps compiled apart and client work dispatched by a
    non-fused executor; ``steps_of(rows, train)`` gives the real step counts
    of the clients at ``rows`` of the split arrays (padded steps skipped)."""
    alg, ex = self.algorithm, self.executor
    pre_j, post_j = ex.jit(pre), ex.jit(post)

    def work(state, key, rnd, train, val, cohort=None):
      cohort, rc, shared, per_client = pre_j(state, key, rnd, cohort, train)
      rows, mask = jax.device_get(
        (per_client[0], system_lib.uploading(cohort, shared))
      )
      # A system's limits are read off each client's context (steps past them masked).
      steps = None if self.system is not None else steps_of(rows, train)
      outputs = ex.run_work(
        alg.client_work,
        make_ctx,
        (shared, train, val),
        per_client,
        active=mask,
        num_steps=steps,
      )
      return post_j(state, cohort, outputs, rc, shared)

    return work

  def _build(self):
    alg, ex = self.algorithm, self.executor
    pre, make_ctx, post, fused_round = round_functions(
      alg, self.sampler, ex, self.trace_counts, self.system, self.row_groups
    )
    shapes = jax.eval_shape(alg.init, jax.random.key(0))
    self._state_shardings = ex.state_shardings(shapes, self.data.num_clients)
    train, val = self.data.train, self.data.val
    if ex.fused:
      jitted = self._jit_round(fused_round)
      self._round_jit = jitted[False]
      self._round = lambda state, key, rnd, donate, next_key=None: jitted[
        donate
      ](state, key, np.int32(rnd), train, val)
    else:
      n = self.data.num_clients
      phase = self._dispatched_pre_round(
        lambda phase_client, shared, rc: ex.map(
          phase_client,
          (shared, train, val),
          (jnp.arange(n, dtype=jnp.int32), client_keys(rc.key, jnp.arange(n))),
        )
      )
      steps = self._host_steps
      work = self._dispatched_work(
        pre,
        make_ctx,
        post,
        lambda rows, _: steps[np.minimum(rows, len(steps) - 1)],
      )

      def round_py(state, key, rnd, donate, next_key=None):
        del donate, next_key  # client work runs outside one compiled function
        state, ph = phase(state, key, rnd)
        state, metrics = work(state, key, np.int32(rnd), train, val)
        return state, {**metrics, **ph}

      self._round = round_py

    eval_all = eval_function(
      alg,
      ex,
      self.trace_counts,
      test_counts=np.asarray(self.data.test.num_examples),
    )
    models_j = ex.jit(alg.client_models)
    if ex.fused:
      eval_j = ex.jit(
        lambda s, d, k, ft: ex.host_readable(
          eval_all(alg.client_models(s), d, k, ft)
        ),
        static_argnums=3,
      )
      per_client = lambda state, key, ft: eval_j(state, self.data, key, ft)
    else:
      per_client = lambda state, key, ft: eval_all(
        models_j(state), self.data, key, ft
      )
    self._evaluate = evaluation.pooled_where_one_model(
      alg, self.data.test, models_j, per_client, self.trace_counts
    )

  def _build_host(self, feed):
    """The host layout's round, evaluation and pre-round phase (``layout``):
    the round takes the cohort and its gathered examples."""
    alg, ex, host = self.algorithm, self.executor, self._host_data()
    pre, make_ctx, post, fused_round = round_functions(
      alg, self.sampler, ex, self.trace_counts, self.system, self.row_groups
    )
    sampler = self.sampler
    self.feed = feed or placement.CohortFeed(
      host,
      ex.jit(
        lambda key, rnd: system_lib.draw_cohort(sampler, key, rnd, self.system)
      ),
      placement.ShapePlan.for_cohorts(host, sampler.capacity),
    )
    shapes = jax.eval_shape(alg.init, jax.random.key(0))
    # Hosted client rows come to the round as the cohort's: no client axis
    # of N to shard.
    self._state_shardings = (
      None if self.hosted_rows else ex.state_shardings(shapes, host.num_clients)
    )
    phase = self._dispatched_pre_round(self._streamed_phase_outputs)
    if ex.fused:
      jitted = self._jit_round(fused_round)

      def work(state, key, rnd, train, val, cohort, donate):
        return jitted[donate](state, key, rnd, train, val, cohort)
    else:
      batching = alg.client_work.batching
      dispatched = self._dispatched_work(
        pre,
        make_ctx,
        post,
        lambda rows, train: np.array(
          [
            batching.num_steps_for(int(n), train.max_examples)
            for n in np.asarray(train.num_examples)[rows]
          ]
        ),
      )

      def work(state, key, rnd, train, val, cohort, donate):
        del donate
        return dispatched(state, key, rnd, train, val, cohort)

    def round_host(state, key, rnd, donate, next_key=None):
      state, ph = phase(state, key, rnd)
      cohort, train, val = self.feed.get(key, rnd)
      if (
        next_key is not None
      ):  # gathered on the feed's thread while this round runs
        self.feed.request(next_key, rnd + 1)
      state, metrics = work(
        state, key, np.int32(rnd), train, val, cohort, donate
      )
      return state, {**metrics, **ph}

    client_rows = alg.client_rows
    held = (
      None
      if client_rows is None or not self.hosted_rows
      else client_rows.get(shapes)
    )
    row_bytes = (
      0
      if held is None
      else tree_util.tree_bytes(held) // tree_util.leading_size(held)
    )

    def round_hosted(state, key, rnd, donate, next_key=None):
      """The round of an algorithm whose client rows live on the host: the
      cohort's rows gathered into the state, the new ones scattered back."""
      cr, rows = client_rows, state.rows
      assert cr is not None  # hosted_rows: the algorithm has client rows
      inner, ph = phase(
        state.inner, key, rnd
      )  # the phase never touches client rows
      cohort, train, val = self.feed.get(key, rnd)
      if next_key is not None:
        self.feed.request(next_key, rnd + 1)
      idx, mask = jax.device_get((cohort.idx, cohort.mask))
      full = cr.put(inner, rows_in_memory.gather_rows(rows, idx))
      full, metrics = work(
        full,
        key,
        np.int32(rnd),
        train,
        val,
        cohort.with_gathered_rows(host.num_clients),
        donate,
      )
      inner = cr.put(full, rows_in_memory.empty_rows(rows))
      rows_in_memory.scatter_rows(
        rows, idx, mask & (idx < host.num_clients), cr.get(full), inner
      )
      del full
      if row_bytes * len(idx) >= RETURN_HEAP_BYTES:
        host_lib.return_free_heap()
      return rows_in_memory.HostedState(inner, rows, cr), {**metrics, **ph}

    self._round = round_hosted if self.hosted_rows else round_host
    self._evaluate = evaluation.host_evaluation(
      alg, ex, host, self.hosted_rows, self.trace_counts
    )

  def _streamed_phase_outputs(self, phase_client, shared, rc):
    """The pre-round phase's client outputs over the store, in blocks."""
    ex, host = self.executor, self._host_data()
    if not hasattr(self, '_phase_block'):

      def block(shared, train, val, rows, keys, valid):
        return ex.map(
          phase_client, (shared, train, val), (rows, keys), active=valid
        )

      self._phase_block = ex.jit(block) if ex.fused else block
    parts = []
    for ids, valid in placement.blocks(np.arange(host.num_clients), host.block):
      out = self._phase_block(
        shared,
        host.gather('train', ids),
        host.gather('val', ids),
        jnp.arange(len(ids), dtype=jnp.int32),
        client_keys(rc.key, jnp.asarray(ids)),
        valid,
      )
      parts.append((valid, out))
    return placement.join_blocks(parts)

  def init(self, key):
    """The algorithm's initial state (placed where the executor keeps it;
    with hosted client rows, a ``rows_in_memory.HostedState``)."""
    if (
      self._state_shardings is not None
    ):  # made where it lives (every process its shards)
      return self.executor.jit(
        self.algorithm.init, out_shardings=self._state_shardings
      )(key)
    if not self.hosted_rows:
      return self.executor.jit(self.algorithm.init)(key)
    # Client rows need not fit the accelerator: made on the CPU backend, in
    # host memory or in files (each made when its client first trains).
    rows_folder = self._host_data().rows_folder
    if rows_folder is not None:
      os.makedirs(rows_folder, exist_ok=True)
      folder = tempfile.mkdtemp(
        prefix=f'{self.algorithm.name}-', dir=rows_folder
      )
      return rows_in_files.init_on_disk(
        self.algorithm.init, self.algorithm.client_rows, key, folder
      )
    return rows_in_memory.init_hosted(
      self.algorithm.init, self.algorithm.client_rows, key
    )

  def _host_data(self) -> placement.HostData:
    """The host layout's data (raises on the device layout)."""
    if self.host is None:
      raise ValueError('the device layout has no host data')
    return self.host

  def whole_state(self, state):
    """The algorithm's state with every client's rows in it (a
    ``HostedState`` joined; any other state as it is)."""
    return (
      state.whole() if isinstance(state, rows_in_memory.HostedState) else state
    )

  def lowered(self, state, key, round_num: int = 0) -> jax.stages.Lowered:
    """The fused round (the device layout) lowered for XLA, before it
    compiles: its ``as_text()`` is the StableHLO the engine traced."""
    if self.host is not None:
      raise ValueError(
        'the host layout compiles one round per cohort shape; use the layout '
        "'device'"
      )
    if not self.executor.fused:
      raise ValueError(
        f'{self.executor.describe()} dispatches client work from Python: '
        'no single compiled round'
      )
    return self._round_jit.lower(
      state,
      key,
      jnp.asarray(round_num, jnp.int32),
      self.data.train,
      self.data.val,
    )

  def compiled(self, state, key, round_num: int = 0) -> jax.stages.Compiled:
    """XLA's compiled fused round (the device layout): its ``as_text()``,
    ``memory_analysis()``, ``cost_analysis()``."""
    return self.lowered(state, key, round_num).compile()

  def compiled_text(self, state, key, round_num: int = 0) -> str:
    """XLA's compiled HLO of one fused round (with a sharded executor, its
    collectives are the round's communication: ``memory.hlo_collectives``)."""
    return str(self.compiled(state, key, round_num).as_text())

  def round(self, state, key, round_num=0, donate: bool = False, next_key=None):
    """Round ``round_num`` (rounds done before it; per-round schedules read
    it): returns (new state, metrics dict of device scalars).

    With ``donate`` the round consumes ``state`` (its buffers are reused for
    the new state and must not be read afterwards): the round then needs no
    second copy of the per-client state. ``experiment.run`` donates.
    ``next_key`` (the next round's key) lets the host layout gather the next
    cohort while this round runs.
    """
    return self._round(state, key, round_num, donate, next_key)

  def evaluate(self, state, key, finetune: Optional[bool] = None) -> LossStats:
    """Per-client LossStats ([N] arrays) of the model each client uses, on its
    own test split; after the algorithm's fine-tuning when it has one (or when
    ``finetune`` is True)."""
    ft = self.algorithm.finetune is not None if finetune is None else finetune
    if ft and self.algorithm.finetune is None:
      raise ValueError(
        f'algorithm {self.algorithm.name} has no fine-tuning step'
      )
    return self._evaluate(state, key, bool(ft))
