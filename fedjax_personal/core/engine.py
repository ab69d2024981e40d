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
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal import numerics
from fedjax_personal.core import evaluation, fitting, memory, tree_util
from fedjax_personal.core import host as host_lib
from fedjax_personal.core import system as system_lib
from fedjax_personal.core.algorithm import (
  FederatedAlgorithm,
)
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
  communication_metrics,
)
from fedjax_personal.core.rounds import (  # noqa: F401  (the engine's API)
  PRE_ROUND,
  PRE_ROUND_RAN,
  Broadcast,
  ClientInputs,
  PhaseInputs,
  PreRoundFunctions,
  RoundFunctions,
  RoundShared,
  SharedInputs,
  pre_round_functions,
  round_functions,
  rows_in_place,
)
from fedjax_personal.core.sampling import CohortSampler, client_keys
from fedjax_personal.core.training import LossStats
from fedjax_personal.core.tree_util import PyTree
from fedjax_personal.hparams import Declared, hparam

__all__ = [
  'Broadcast',
  'PreRoundFunctions',
  'RoundFunctions',
  'ClientInputs',
  'RoundShared',
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
  """How the engine runs client work.

  Where clients live and at what matmul precision it computes, declared once
  (``hparam``; the command's flags are generated from these fields). The
  executor and layout change speed and memory, never the numbers (up to float
  reassociation); the precision is recorded with the run."""

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
    "the run, traced into what the engine compiles (JAX's own setting is left "
    'alone): '
    'float32 (the default: the same numbers on every card), tf32 '
    '(TensorFloat-32 products, a '
    "GPU's fast default), bf16x3 (three bfloat16 passes, near float32), bf16 "
    '(one bfloat16 '
    "pass, a TPU's default), or JAX's default / high / highest (the command's "
    'default when '
    'not given: $JAX_DEFAULT_MATMUL_PRECISION if set). On a CPU only float32 '
    'is accepted: '
    'XLA:CPU computes float32 whatever the setting, so a reduced one would be '
    'recorded but not '
    'used. Recorded in the run identity.',
    choices=tuple(numerics.MATMUL_PRECISIONS),
  )


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
    data: Any,
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
    # auto on an accelerator: blocks by work, blocks that fit
    if executor.plan_memory:
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

  def _jit_round(self, fused_round: Callable) -> dict:
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

  def _dispatched_pre_round(self, client_outputs: Callable) -> Callable:
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

  def _dispatched_work(
    self, fns: RoundFunctions, steps_of: Callable
  ) -> Callable:
    """``work(state, key, rnd, train, val, cohort=None) -> (state, metrics)``:
    the round's server steps compiled apart and client work dispatched by a
    non-fused executor; ``steps_of(rows, train)`` gives the real step counts
    of the clients at ``rows`` of the split arrays (padded steps skipped).
    The clients of an algorithm with a ``CohortChain`` run in order as one
    compiled function of their own (``RoundFunctions.chained``)."""
    alg, ex = self.algorithm, self.executor
    make_ctx, phase = fns.make_ctx, fns.cohort_phase
    pre_j, post_j = ex.jit(fns.pre), ex.jit(fns.post)
    chained_j = ex.jit(fns.chained)

    def work(state, key, rnd, train, val, cohort=None):
      cohort, rc, shared, per_client = pre_j(state, key, rnd, cohort, train)
      if alg.cohort_chain is not None:
        outputs = chained_j(state, cohort, rc, shared, per_client, train, val)
        return post_j(state, cohort, outputs, rc, shared)
      if alg.cohort_phase is not None:
        shared = phase(shared, cohort, per_client, rc, train, val)
      rows, mask = jax.device_get(
        (per_client.row, system_lib.uploading(cohort, shared.devices))
      )
      # A system's limits are read off each client's context (steps past them
      # masked).
      steps = None if self.system is not None else steps_of(rows, train)
      outputs = ex.run_work(
        alg.client_work,
        make_ctx,
        SharedInputs(shared, train, val),
        per_client,
        active=mask,
        num_steps=steps,
      )
      return post_j(state, cohort, outputs, rc, shared)

    return work

  def _build(self):
    alg, ex = self.algorithm, self.executor
    fns = round_functions(
      alg, self.sampler, ex, self.trace_counts, self.system, self.row_groups
    )
    fused_round = fns.fused_round
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
          SharedInputs(shared, train, val),
          PhaseInputs(
            jnp.arange(n, dtype=jnp.int32), client_keys(rc.key, jnp.arange(n))
          ),
        )
      )
      steps = self._host_steps
      work = self._dispatched_work(
        fns, lambda rows, _: steps[np.minimum(rows, len(steps) - 1)]
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

  def _build_host(self, feed: Optional[placement.CohortFeed]) -> None:
    """The host layout's round, evaluation and pre-round phase (``layout``):
    the round takes the cohort and its gathered examples."""
    alg, ex, host = self.algorithm, self.executor, self._host_data()
    fns = round_functions(
      alg, self.sampler, ex, self.trace_counts, self.system, self.row_groups
    )
    fused_round = fns.fused_round
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
        fns,
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
      # gathered on the feed's thread while this round runs
      if next_key is not None:
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
      # the phase never touches client rows
      inner, ph = phase(state.inner, key, rnd)
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

  def _streamed_phase_outputs(
    self, phase_client: Callable, shared: PyTree, rc: Any
  ) -> PyTree:
    """The pre-round phase's client outputs over the store, in blocks."""
    ex, host = self.executor, self._host_data()
    if not hasattr(self, '_phase_block'):

      def block(shared, train, val, rows, keys, valid):
        return ex.map(
          phase_client,
          SharedInputs(shared, train, val),
          PhaseInputs(rows, keys),
          active=valid,
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

  def init(self, key: jax.Array) -> PyTree:
    """The algorithm's initial state (placed where the executor keeps it;
    with hosted client rows, a ``rows_in_memory.HostedState``)."""
    # made where it lives (every process its shards)
    if self._state_shardings is not None:
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

  def whole_state(self, state: PyTree) -> PyTree:
    """The algorithm's state with every client's rows in it (a
    ``HostedState`` joined; any other state as it is)."""
    return (
      state.whole() if isinstance(state, rows_in_memory.HostedState) else state
    )

  def lowered(
    self, state: PyTree, key: jax.Array, round_num: int = 0
  ) -> jax.stages.Lowered:
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

  def compiled(
    self, state: PyTree, key: jax.Array, round_num: int = 0
  ) -> jax.stages.Compiled:
    """XLA's compiled fused round (the device layout): its ``as_text()``,
    ``memory_analysis()``, ``cost_analysis()``."""
    return self.lowered(state, key, round_num).compile()

  def compiled_text(
    self, state: PyTree, key: jax.Array, round_num: int = 0
  ) -> str:
    """XLA's compiled HLO of one fused round (with a sharded executor, its
    collectives are the round's communication: ``memory.hlo_collectives``)."""
    return str(self.compiled(state, key, round_num).as_text())

  def round(
    self,
    state: PyTree,
    key: jax.Array,
    round_num: Any = 0,
    donate: bool = False,
    next_key: Optional[jax.Array] = None,
  ) -> tuple:
    """Round ``round_num`` (rounds done before it; per-round schedules read
    it): returns (new state, metrics dict of device scalars).

    With ``donate`` the round consumes ``state`` (its buffers are reused for
    the new state and must not be read afterwards): the round then needs no
    second copy of the per-client state. ``experiment.run`` donates.
    ``next_key`` (the next round's key) lets the host layout gather the next
    cohort while this round runs.
    """
    return self._round(state, key, round_num, donate, next_key)

  def evaluate(
    self, state: PyTree, key: jax.Array, finetune: Optional[bool] = None
  ) -> LossStats:
    """Per-client LossStats ([N] arrays) of the model each client uses, on its
    own test split; after the algorithm's fine-tuning when it has one (or when
    ``finetune`` is True)."""
    ft = self.algorithm.finetune is not None if finetune is None else finetune
    if ft and self.algorithm.finetune is None:
      raise ValueError(
        f'algorithm {self.algorithm.name} has no fine-tuning step'
      )
    return self._evaluate(state, key, bool(ft))
