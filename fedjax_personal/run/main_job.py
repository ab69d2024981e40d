"""The main job of ``scripts/run_experiment.py``: the set-up steps of
``run/job_setup.py`` (data, model and executor, algorithms, the layout
decided once, identities, the data placed), then the output folder, its
claim and the checkpoints restored, each algorithm trained, the comparison
written. Each step takes the typed settings (``run/settings.py``, read once
from the flags) and the frozen results of the steps before it.
"""

import dataclasses
import os
import shutil
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import jax

from fedjax_personal import algorithms as algorithms_lib
from fedjax_personal import compilation, numerics
from fedjax_personal.config import TrainingConfig
from fedjax_personal.core import system as system_lib
from fedjax_personal.core.data import FederatedData
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.core.executors import Executor
from fedjax_personal.core.population.clients import Population, PopulationStore
from fedjax_personal.core.population.placement import HostData
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import Model
from fedjax_personal.run import (
  checkpointing,
  distributed,
  experiment,
  faults,
  plots,
  process,
  reporting,
  run_identity,
  run_progress,
  sweep,
  tensorboard,
  user_code,
)
from fedjax_personal.run.job_setup import (
  Built,
  build_algorithms,
  build_model_and_executor,
  decide_layout,
  identify,
  load_data,
  place_data,
  prepared_system,
)
from fedjax_personal.run.process import say
from fedjax_personal.run.settings import RunSettings

__all__ = ['Job', 'main_job', 'Results']


@dataclasses.dataclass(frozen=True)
class Job:
  """What training reads, settled before anything trains.

  Attributes:
    settings: the run's settings.
    cfgs: the configurations of a sweep or trials
      (``RunSettings.configurations``), or None.
    store: the population store.
    population: its clients' counts, classes and name.
    data: the data in its layout (device arrays or ``HostData``).
    layout: ``'device'`` or ``'host'``.
    rows_on_disk: the host layout's client rows in files.
    model: the model.
    executor: the executor.
    system: the clients' devices, their files read.
    algs: the algorithms with their run identities.
    output_dir: the run's folder.
    progress: where the run stands, for its fault lines.
  """

  settings: RunSettings
  cfgs: Optional[List[Tuple[int, Dict[str, Any]]]]
  store: PopulationStore
  population: Population
  data: Union[FederatedData, HostData]
  layout: str
  rows_on_disk: bool
  model: Model
  executor: Executor
  system: system_lib.ClientSystem
  algs: Tuple[Built, ...]
  output_dir: str
  progress: run_progress.RunProgress


@dataclasses.dataclass
class Results:
  """The finished algorithms' rows.

  Filled as each finishes (the table is
  written for those that did when a later one fails).

  Attributes:
    histories: ``{row label: history}``.
    summaries: ``{row label: final summary}``.
    groups: ``{row label: [(history, summary)]}``, trials grouped by their
      values.
  """

  histories: Dict[str, list] = dataclasses.field(default_factory=dict)
  summaries: Dict[str, dict] = dataclasses.field(default_factory=dict)
  groups: Dict[str, list] = dataclasses.field(default_factory=dict)


def main_job(
  settings: RunSettings, progress: Optional[run_progress.RunProgress] = None
) -> Dict[str, dict]:
  """Runs every algorithm of --algorithm on the same data (each a single run,
  or with --sweep/--sweep_seeds/--trials its configurations through the same
  loop); writes outputs and prints the comparison table. Returns {row label:
  final summary}. With --dry_run, stops after building everything (nothing
  trained or written) and returns {}.

  Args:
    settings: the run's ``RunSettings``.
    progress: where the run records its progress for its fault lines (None:
      a new ``run_progress.RunProgress``).

  Returns:
    ``{row label: final summary}``.
  """
  progress = progress or run_progress.RunProgress()
  with run_progress.tracking(progress):
    return _main_job(settings, progress)


def _main_job(
  settings: RunSettings, progress: run_progress.RunProgress
) -> Dict[str, dict]:
  """``main_job`` inside its progress's tracking."""
  numerics.check_precision(settings.engine.matmul_precision)  # on this backend
  process.open_compilation_cache(settings.process.compilation_cache)
  job = set_up(settings, progress)
  if settings.output.dry_run:
    for built in job.algs:
      # each round traced abstractly: a broken one fails here
      user_code.trace_round(
        built.alg, settings.experiment.sampler(job.data), job.data, job.system
      )
    print(
      f'dry run: {len(job.algs)} algorithm(s) built and their rounds traced; '
      f'nothing '
      'trained or written'
    )
    return {}
  failed: List[str] = []
  results = Results()
  try:
    restored = claim_and_restore(job)
    try:
      for built in job.algs:
        try:
          train_algorithm(job, built, *restored[built.settings.name], results)
        except Exception as e:
          # the user's code raised: one line, the others still run
          line = user_code.users_failure(built.settings.name, e)
          if line is None:
            raise
          failed.append(line)
          say(f'{line}; the other algorithms go on')
    # also when a later algorithm fails: the finished ones keep their table
    finally:
      table = write_comparison(job, results)
  finally:
    run_identity.unlock(job.output_dir)
  if failed:
    raise ConfigError(
      'algorithm', '; '.join(failed) + " (the others' results are written)"
    )
  return table


def set_up(s: RunSettings, progress: run_progress.RunProgress) -> Job:
  """The set-up steps in order (``run/job_setup.py``), then the output folder.

  Args:
    s: the run's settings.
    progress: where the run records its progress.

  Returns:
    The ``Job``.
  """
  loaded = load_data(s)
  mx = build_model_and_executor(s, loaded)
  system = prepared_system(s, loaded.population.num_clients)
  algs = build_algorithms(s, mx.model, loaded.population)
  weights = ', '.join(f'{n} {w}' for n, w in s.client_weights().items())
  for line in (
    [f'client weights: {weights}'] if weights else []
  ) + s.system.describe(
    [a.spec for a in s.algorithms],
    steps=all(a.training.local_steps is not None for a in s.algorithms),
  ):
    say(line)
  layout = decide_layout(s, loaded, algs)
  algs = identify(s, loaded, mx, layout, algs)
  output_dir = s.output.output_dir or s.default_output_dir(
    {b.settings.name: b.identity for b in algs}
  )
  progress.output_dir = output_dir
  cap = s.inputs.max_client_examples
  # the run's client rows in its folder
  data = place_data(
    loaded,
    layout,
    cap,
    os.path.join(output_dir, 'client_rows') if layout.rows_on_disk else None,
  )
  job = Job(
    s,
    s.configurations(),
    loaded.store,
    loaded.population,
    data,
    layout.name,
    layout.rows_on_disk,
    mx.model,
    mx.executor,
    system,
    algs,
    output_dir,
    progress,
  )
  _announce(job)
  return job


def _announce(job: Job) -> None:
  """Checks every process runs this configuration; says the executor, the
  outputs' folder and how the configurations run."""
  s = job.settings
  distributed.check_same_run(
    {
      'algorithms': {b.settings.name: b.identity for b in job.algs},
      'flags': s.shared_flags(),
    },
    run_identity.differences,
  )
  why = f' ({job.executor.reason})' if job.executor.reason else ''
  say(
    f'executor: {job.executor.describe()} on {jax.default_backend()}{why}; '
    f'outputs in '
    f'{job.output_dir}'
  )
  if job.cfgs is not None:
    say(
      f'{len(job.cfgs)} configurations per algorithm, '
      + (
        'one after another on the host layout, the configurations of one seed '
        'sharing each '
        "round's cohort gather"
        if job.layout == 'host'
        else 'each algorithm one compiled program'
        if job.executor.fused
        else 'one after another'
      )
    )


def _make_runs(job: Job, built: Built):
  """The loop's ``Runs`` of one algorithm: a single run, or its
  configurations (sweep, trials) as one vmapped program when the executor is
  fused, else one after another."""
  s, data, precision = (
    job.settings,
    job.data,
    job.settings.engine.matmul_precision,
  )
  sampler = s.experiment.sampler(data)
  row_groups = s.data.options.row_group_start()
  if job.cfgs is None:
    return experiment.SingleRun(
      RoundRunner(
        built.alg,
        data,
        sampler,
        job.executor,
        matmul_precision=precision,
        system=job.system,
        row_groups=row_groups,
      ),
      s.experiment.seed,
    )
  names = sweep.sweepable()
  a = built.settings

  def build(hv):
    hv = {k: v for k, v in hv.items() if k not in a.ignored}
    shared = {
      names[k][1]: v for k, v in hv.items() if names[k][0] is TrainingConfig
    }
    own = {
      names[k][1]: v for k, v in hv.items() if names[k][0] is a.spec.config
    }
    return algorithms_lib.make(
      a.spec,
      dataclasses.replace(a.training, **shared),
      dataclasses.replace(a.config, **own),
      job.model,
      job.population,
    )

  # A swept setting it does not read: one configuration, not copies of it.
  reads = lambda k: (
    k not in a.ignored
    and (
      (names[k][0] is TrainingConfig and names[k][1] in a.spec.uses)
      or (names[k][0] is a.spec.config and names[k][1] not in a.spec.ignores)
    )
  )
  cfgs: List[tuple] = []
  for seed, values in job.cfgs:
    own = (seed, {k: v for k, v in values.items() if reads(k)})
    if own not in cfgs:
      cfgs.append(own)
  # One program over the configurations needs the whole population on the
  # device; the host layout runs them one after another on shared gathers.
  if job.executor.fused and isinstance(data, FederatedData):
    return sweep.SweepRunner(
      build,
      cfgs,
      data,
      sampler,
      job.executor,
      matmul_precision=precision,
      system=job.system,
      row_groups=row_groups,
    )
  return sweep.LoopRuns(
    build,
    cfgs,
    data,
    sampler,
    job.executor,
    matmul_precision=precision,
    system=job.system,
    row_groups=row_groups,
  )


def claim_and_restore(job: Job) -> Mapping[str, Tuple[Any, Optional[tuple]]]:
  """Makes the output folders this configuration's (process 0 writes, the
  others wait), builds each algorithm's runs, and with --resume restores them
  from their latest checkpoints (every process its own shards).

  Args:
    job: the ``Job``.

  Returns:
    ``{algorithm: (its runs, (state, round, histories) restored or None)}``.
  """
  out, rounds = job.settings.output, job.settings.experiment.rounds
  resume = out.resume or out.resume_if_found
  identities = {b.settings.name: b.identity for b in job.algs}
  # --resume of a run that began here: algorithms it never reached start
  started = False
  if resume:
    started = run_identity.repaired(job.output_dir, {'algorithms': identities})
    run_identity.check_process_count(job.output_dir)
  if distributed.is_primary():
    # held until the job ends (main_job unlocks)
    run_identity.lock(job.output_dir)
    run_identity.claim(
      job.output_dir, {'algorithms': identities}, out.overwrite, resume
    )
    for name, ident in identities.items():
      run_identity.claim(
        os.path.join(job.output_dir, name),
        ident,
        out.overwrite,
        resume,
        outputs=run_identity.ALGORITHM_OUTPUTS,
        damaged_redone=True,
      )
  distributed.barrier('claimed output folders')
  data = job.data
  if isinstance(data, HostData) and data.rows_folder:
    # the live client rows, made afresh (a resume rewrites them)
    shutil.rmtree(data.rows_folder, ignore_errors=True)
  out_runs = {}
  for built in job.algs:
    name = built.settings.name
    runs = _make_runs(job, built)
    plan = getattr(
      getattr(getattr(runs, 'runner', None), 'feed', None), 'plan', None
    )
    if plan is not None and built is job.algs[0]:
      say(f'shape plan: {plan.describe()}, fixed for the run')
    got = None
    if resume:
      ckpt_dir = os.path.join(job.output_dir, name, 'checkpoints')
      if os.path.exists(ckpt_dir) and not os.path.isdir(ckpt_dir):
        raise ConfigError(
          'resume',
          f'{ckpt_dir} is a file, not a folder of checkpoints: move '
          'it away, then run the same command with --resume',
        )
      got = checkpointing.restore_latest(ckpt_dir, runs.init(), built.identity)
      if got is None and out.resume and not started:
        raise ConfigError(
          'resume',
          f'no checkpoint of {name} in {ckpt_dir}; run without '
          '--resume, or with --resume_if_found to start fresh where there is '
          'none',
        )
      if got is None:
        say(f'{name}: no checkpoint in {ckpt_dir}; starting fresh')
      elif got[1] > rounds:
        raise ConfigError(
          'rounds',
          f'the checkpoint of {name} is at round {got[1]}, past '
          f'--rounds={rounds}',
        )
    out_runs[name] = (runs, got)
  return out_runs


def _callbacks(job: Job, built: Built, hists, start):
  """The loop's callbacks: metrics, checkpoints, diagnostics, progress (files
  and the bar on process 0; checkpoints on every process)."""
  s, alg_name, alg = job.settings, built.settings.name, built.alg
  out_dir = os.path.join(job.output_dir, alg_name)
  primary = distributed.is_primary()
  callbacks: List[experiment.Callback] = []
  if alg.privacy is not None:
    callbacks.append(
      reporting.PrivacyRecorder(alg.privacy, s.experiment.dp_delta)
    )
  if primary:
    callbacks.append(reporting.MetricsWriter(out_dir, hists))
    callbacks.append(
      tensorboard.TensorBoardWriter(
        os.path.join(job.output_dir, 'tensorboard', alg_name), hists
      )
    )
  # Always: an interruption keeps the round in progress (--resume continues it).
  callbacks.append(
    checkpointing.Checkpointer(
      os.path.join(out_dir, 'checkpoints'),
      s.output.checkpoint_every,
      hists,
      identity=built.identity,
      resumed_step=start or None,
      # the final state always: --resume never re-runs a finished algorithm
      final=True,
      progress=job.progress,
    )
  )
  heatmap = built.settings.spec.state_heatmap
  if heatmap is not None and job.cfgs is None and primary:
    callbacks.append(
      reporting.AffinityRecorder(os.path.join(out_dir, 'affinity.png'), heatmap)
    )
  if s.output.progress and primary:
    callbacks.append(reporting.Progress(s.experiment.rounds - start, alg_name))
  if s.system.active and primary:
    callbacks.append(reporting.DeviceCounts(s.experiment.rounds, alg_name))
  # last: a fault line raised by the others still names the previous round
  callbacks.append(experiment.ProgressRecorder(job.progress))
  return callbacks


def _refuse_runs_without_clients(s, alg_name: str, hists) -> None:
  """A run in which no client ever took part is refused: its result would
  be the untrained model."""
  if not all(
    h and reporting.rounds_without_clients(h) == len(h) for h in hists
  ):
    return
  system = s.system
  flag = (
    'availability_trace'
    if system.availability_trace
    else 'availability'
    if system.availability < 1
    else 'drop_before'
    if system.drop_before
    else 'drop_after'
    if system.drop_after
    else 'participation'
  )
  raise ConfigError(
    flag,
    f'no client took part in any of the {len(hists[0])} rounds of '
    f'{alg_name} (its result would be the untrained model): let more '
    'clients be online or drop out less',
  )


def train_algorithm(
  job: Job, built: Built, runs, restored: Optional[tuple], results: Results
) -> None:
  """Trains one algorithm's runs to --rounds and records their summaries in
  ``results`` (and its summary.json on process 0).

  Args:
    job: the ``Job``.
    built: the algorithm.
    runs: its runs (``claim_and_restore``).
    restored: ``(state, round, histories)`` from its checkpoint, or None.
    results: the finished algorithms' rows, this one's added.

  Returns:
    None.
  """
  s = job.settings
  e = s.experiment
  alg_name, ignored, ident = (
    built.settings.name,
    built.settings.ignored,
    built.identity,
  )
  state, start, hists = None, 0, None
  if restored is not None:
    state, start, hists = restored
    say(f'{alg_name}: resuming after round {start}')
  # asked while the previous algorithm wrote its results
  if faults.stop_requested():
    raise faults.interrupted()
  later = (
    len(job.algs) - 1 - [b.settings.name for b in job.algs].index(alg_name)
  )
  job.progress.start_algorithm(
    alg_name,
    start,
    os.path.join(job.output_dir, alg_name, 'checkpoints'),
    True,
    start or None,
    e.rounds,
    later,
  )
  began, compiled = time.perf_counter(), compilation.stats()
  _, hists = experiment.run_many(
    runs,
    e.rounds,
    eval_every=e.eval_every,
    callbacks=_callbacks(job, built, hists, start),
    state=state,
    start_round=start,
    histories=hists,
  )
  _refuse_runs_without_clients(s, alg_name, hists)
  alg_summaries = []
  costs = process.time_to_result(runs, began, compiled)
  programs, hits = costs.pop('_programs'), costs.pop('_hits')
  for label, history in zip(runs.labels, hists):
    summary = reporting.final_summary(history, e.stat_window)
    summary['rounds'] = e.rounds
    summary.update(costs)
    # by id: per_client_accuracy[i] is client_ids[i]'s
    if 'per_client_accuracy' in summary:
      summary['worst_clients'] = reporting.worst_clients(
        summary['per_client_accuracy'], job.store.client_ids
      )
      summary['client_ids'] = list(job.store.client_ids)
    if label is not None:
      summary['config'] = label
    if job.model.accuracy_definition:
      summary['accuracy_definition'] = job.model.accuracy_definition
    if start:
      summary['resumed_after_round'] = start
    empty = reporting.rounds_without_clients(history)
    if empty:
      summary['rounds_without_clients'] = empty
      say(
        f'{alg_name}: no client took part in {empty} of its {len(history)} '
        f'rounds'
      )
    if ignored:
      summary['ignored_settings'] = list(ignored)
    if e.target_accuracy is not None:
      summary['rounds_to_target'] = experiment.rounds_to_target(
        history, e.target_accuracy
      )
    if e.paper_metric is not None:
      key = reporting.PAPER_METRICS[e.paper_metric][0]
      summary['paper_metric'] = {
        'column': e.paper_metric,
        'key': key,
        'value': summary.get(key),
      }
    row = e.row_label(alg_name, label)
    results.histories[row], results.summaries[row] = history, summary
    alg_summaries.append(summary)
    if e.trials > 1:  # rows of the table: trials grouped by their values
      values = {k: v for k, v in label.items() if k != 'seed'}
      results.groups.setdefault(
        e.row_label(alg_name, values or None), []
      ).append((history, summary))
    say(
      f'{row}: '
      + (
        f'diverged at round {summary["diverged_at_round"]}'
        if summary.get('diverged')
        else f'mean {summary["accuracy_mean"]:.4f} worst {summary["accuracy_worst"]:.4f}'
      )
      + f' ({summary["train_seconds"]:.1f} s of rounds, the first '
      f'{summary.get("first_round_seconds", 0):.1f} s; compiling '
      f'{summary["compile_seconds"]:.1f} s, {programs} programs, {hits} from '
      f'the cache)'
      + (
        f', epsilon {summary["dp_epsilon"]:.2f} at delta {e.dp_delta:g}'
        if 'dp_epsilon' in summary
        else ''
      )
    )
  if distributed.is_primary():
    record = (
      alg_summaries[0]
      if job.cfgs is None
      else {'configurations': alg_summaries}
    )
    reporting.write_summary(
      os.path.join(job.output_dir, alg_name),
      {
        **record,
        'algorithm': alg_name,
        'identity': ident,
        'numerics': ident.get('numerics'),
        'flags': dict(s.flags),
      },
    )


def write_comparison(job: Job, results: Results) -> Dict[str, dict]:
  """The comparison table (printed), comparison.json or sweep.json and the
  plots, for the algorithms that finished (process 0 writes).

  Args:
    job: the ``Job``.
    results: the finished algorithms' rows.

  Returns:
    The table's rows: ``{row label: summary}`` (trials: their mean and std).
  """
  s = job.settings
  e, plot_mode = s.experiment, s.output.plots
  if not results.histories:
    return results.summaries
  strip = lambda s: {
    k: v for k, v in s.items() if k not in ('per_client_accuracy', 'client_ids')
  }
  table, primary = results.summaries, distributed.is_primary()
  if e.trials > 1:
    table = {
      g: reporting.aggregate_trials([s for _, s in items])
      for g, items in results.groups.items()
    }
    if primary:
      plots.draw(
        'trials',
        {g: [h for h, _ in items] for g, items in results.groups.items()},
        job.output_dir,
        plot_mode,
      )
      run_identity.write_json(
        os.path.join(job.output_dir, 'comparison.json'),
        {
          g: {**table[g], 'per_trial': [strip(s) for _, s in items]}
          for g, items in results.groups.items()
        },
      )
  elif primary:
    plots.draw('runs', results.histories, job.output_dir, plot_mode)
    run_identity.write_json(
      os.path.join(
        job.output_dir, 'comparison.json' if job.cfgs is None else 'sweep.json'
      ),
      {k: strip(s) for k, s in results.summaries.items()},
    )
  trials = f', mean ± std over {e.trials} trials' if e.trials > 1 else ''
  window = reporting.table_window(table)
  say('')
  say(
    f'{job.population.name}, {s.model.model}, {e.rounds} rounds: per-client '
    f'test accuracy at the '
    f'last evaluation and averaged over the last {window} '
    f'(@last{window}){trials}'
  )
  say(reporting.format_table(table))
  if e.paper_metric is not None:
    say(
      f"the paper's metric: the {e.paper_metric} column, "
      f'{reporting.PAPER_METRICS[e.paper_metric][1]}'
    )
  return table
