"""The main job of ``scripts/run_experiment.py`` as named steps: load the
data in its layout, build the model and executor, build every algorithm (a
bad setting fails before anything trains), settle the layout and the memory
plan, choose the output folder, claim it and restore checkpoints, train each
algorithm, write the comparison. Each step reads the typed settings it needs
from the run's ``RunSettings`` (``run/settings.py``, read once from the
flags by ``run/command_line.py``).
"""


import dataclasses
import os
import shutil
import time
from typing import Any, Dict, List, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal import algorithms as algorithms_lib
from fedjax_personal import compilation, numerics
from fedjax_personal.config import TrainingConfig
from fedjax_personal.core import memory
from fedjax_personal.core import system as system_lib
from fedjax_personal.core.data import to_device
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.core.executor_choice import create_executor
from fedjax_personal.core.population import placement
from fedjax_personal.core.population.placement import HostData
from fedjax_personal.core.tree_util import tree_bytes
from fedjax_personal.datasets import load_store, loading, streams_to_store
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import build_model
from fedjax_personal.models import inputs as model_inputs
from fedjax_personal.run import (checkpointing, distributed, experiment, faults, plots,
                                 process, reporting, run_identity, tensorboard, user_code)
from fedjax_personal.run.process import say
from fedjax_personal.run.settings import AlgorithmSettings, RunSettings


__all__ = ['Built', 'client_weights', 'Job', 'load_data', 'main_job']


class Built(NamedTuple):
  """One algorithm of the job: its settings, the algorithm, its run identity."""
  settings: AlgorithmSettings
  alg: Any
  identity: dict


def _make_runs(job: 'Job', built: Built, data):
  """The loop's ``Runs`` of one algorithm: a single run, or its
  configurations (sweep, trials) as one vmapped program when the executor is
  fused, else one after another."""
  s, precision = job.settings, job.settings.engine.matmul_precision
  sampler = s.experiment.sampler(data)
  if job.cfgs is None:
    return experiment.SingleRun(RoundRunner(
        built.alg, data, sampler, job.executor, matmul_precision=precision, system=s.system,
        row_groups=s.data.options.row_group_start()), s.experiment.seed)
  from fedjax_personal.run import sweep
  names = sweep.sweepable()
  a = built.settings

  def build(hv):
    hv = {k: v for k, v in hv.items() if k not in a.ignored}
    shared = {names[k][1]: v for k, v in hv.items() if names[k][0] is TrainingConfig}
    own = {names[k][1]: v for k, v in hv.items() if names[k][0] is a.spec.config}
    return algorithms_lib.make(a.spec, dataclasses.replace(a.training, **shared),
                               dataclasses.replace(a.config, **own), job.model, data)
  # A swept setting it does not read: one configuration, not copies of it.
  reads = lambda k: k not in a.ignored and (
      (names[k][0] is TrainingConfig and names[k][1] in a.spec.uses)
      or (names[k][0] is a.spec.config and names[k][1] not in a.spec.ignores))
  cfgs: List[tuple] = []
  for seed, values in job.cfgs:
    own = (seed, {k: v for k, v in values.items() if reads(k)})
    if own not in cfgs:
      cfgs.append(own)
  # One program over the configurations needs the whole population on the
  # device; the host layout runs them one after another on shared gathers.
  one_program = job.executor.fused and not isinstance(data, HostData)
  runs = sweep.SweepRunner if one_program else sweep.LoopRuns
  return runs(build, cfgs, data, sampler, job.executor, matmul_precision=precision,
              system=s.system, row_groups=s.data.options.row_group_start())


@dataclasses.dataclass
class Job:
  """What the main job's steps pass on: the settings, the data and its identity,
  model, executor, algorithms, the output folder, and the results so far."""
  settings: RunSettings
  cfgs: Any = None
  data: Any = None
  population: Any = None
  layout: str = 'device'
  layout_reason: str = ''
  rows_on_disk: bool = False
  store: Any = None
  identity: dict = dataclasses.field(default_factory=dict)
  model: Any = None
  executor: Any = None
  algs: List[Built] = dataclasses.field(default_factory=list)
  output_dir: str = ''
  runs: dict = dataclasses.field(default_factory=dict)
  restored: dict = dataclasses.field(default_factory=dict)
  histories: dict = dataclasses.field(default_factory=dict)
  summaries: dict = dataclasses.field(default_factory=dict)
  groups: dict = dataclasses.field(default_factory=dict)


def main_job(settings: RunSettings) -> Dict[str, dict]:
  """Runs every algorithm of --algorithm on the same data (each a single run,
  or with --sweep/--sweep_seeds/--trials its configurations through the same
  loop); writes outputs and prints the comparison table. Returns {row label:
  final summary}. With --dry_run, stops after building everything (nothing
  trained or written) and returns {}.

  Args:
    settings: the run's ``RunSettings``.

  Returns:
    ``{row label: final summary}``.
  """
  numerics.check_precision(settings.engine.matmul_precision)  # on this backend
  process.open_compilation_cache(settings.process.compilation_cache)
  job = Job(settings=settings, cfgs=settings.configurations())
  load_data(job)
  build_model_and_executor(job)
  build_algorithms(job)
  weights = ', '.join(f'{n} {w}' for n, w in client_weights(settings).items())
  for line in ([f'client weights: {weights}'] if weights else []) + settings.system.describe(
      [a.spec for a in settings.algorithms]):
    say(line)
  settle_layout(job)
  choose_output_dir(job)
  if settings.output.dry_run:
    for built in job.algs:  # each round traced abstractly: a broken one fails here
      user_code.trace_round(built.alg, settings.experiment.sampler(job.data), job.data,
                            settings.system)
    print(f'dry run: {len(job.algs)} algorithm(s) built and their rounds traced; nothing '
          'trained or written')
    return {}
  failed: List[str] = []
  try:
    claim_and_restore(job)
    try:
      for built in job.algs:
        try:
          train_algorithm(job, built)
        except Exception as e:  # the user's code raised: one line, the others still run
          line = user_code.users_failure(built.settings.name, e)
          if line is None:
            raise
          failed.append(line)
          say(f'{line}; the other algorithms go on')
    finally:  # also when a later algorithm fails: the finished ones keep their table
      write_comparison(job)
  finally:
    run_identity.unlock(job.output_dir)
  if failed:
    raise ConfigError('algorithm', '; '.join(failed) + ' (the others\' results are written)')
  return job.summaries


def load_data(job: Job) -> None:
  """The federated data in its layout (``--layout``: padded on the device,
  or the population store on the host) and what every algorithm's run
  identity shares (the same in both layouts).

  Args:
    job: the ``Job``.

  Returns:
    None (fills ``job``).
  """
  s = job.settings
  cfg, inputs, cohort_size = s.data, s.inputs, s.experiment.cohort_size
  cap = inputs.max_client_examples
  if streams_to_store(cfg):  # written once into the cache, client by client
    store = load_store(cfg, verify=inputs.verify_store, rebuild=inputs.rebuild_store,
                       should_stop=faults.signal_received)
    fingerprint = store.digest
  else:  # built in memory, unpadded (padded only if the device layout holds it)
    store = load_store(cfg)
    fingerprint = run_identity.padded_fingerprint(store)  # as earlier runs': padded arrays'
  if inputs.client_ids:
    store = loading.chosen_clients(store, inputs.client_ids)
    fingerprint = store.digest
  population = store.population(cap)
  train_counts = np.asarray(population.train.num_examples)
  if int(train_counts.sum()) == 0:
    raise ConfigError('num_clients', 'no client has training data')
  if int(np.asarray(population.test.num_examples).sum()) == 0:
    raise ConfigError('dataset', f'{cfg.dataset}: no training client has a test example (the '
                      'test file\'s clients match none of the training file\'s): check the '
                      'test file, or --data_dir')
  trained = population.num_trained
  if cohort_size is not None and cohort_size > trained:
    raise ConfigError('cohort_size', f'must be in [1, {trained}] (the clients of {cfg.dataset} '
                      f'that train), got {cohort_size}')
  free = memory.device_free_bytes() or (placement.host_available_bytes()
                                        if jax.default_backend() == 'cpu' else None)
  layout, reason = placement.choose(s.engine.layout, store.padded_nbytes(cap), free,
                                     int(train_counts.max()), cap)
  if layout == 'host' and jax.process_count() > 1:
    padded_bytes = store.padded_nbytes(cap)
    # The padded population is made on the host, then put on the device: on
    # a CPU both copies share the host's memory.
    need = padded_bytes * (2 if jax.default_backend() == 'cpu' else 1)
    if free is not None and need > free:
      raise ConfigError('num_processes', 'several processes run on the device layout, where this '
                        f'population padded to its widest client needs {need / placement.GB:.1f} '
                        f'GB, {free / placement.GB:.1f} GB free: run on one process (the host '
                        'layout), or give --max_client_examples / --num_clients')
    layout, reason = 'device', 'several processes run on the device layout'
  say(population.describe())
  for line in cfg.options.describe():
    say(line)
  job.layout_reason, job.store = reason, store
  job.identity = s.identity(fingerprint, cap, jax.process_count())
  if job.cfgs is not None:
    e = s.experiment
    job.identity['sweep'] = {'sweep': e.sweep, 'sweep_seeds': e.sweep_seeds, 'trials': e.trials}
  job.layout = layout
  if layout == 'device':
    job.population = store.padded(cap)
    job.data = to_device(job.population)
  else:
    job.population, job.data = population, HostData(store, cap)


def build_model_and_executor(job: Job) -> None:
  """The model (its initialisation convention, or weights from a file; the
  data set's scoring and inputs) and the executor."""
  s = job.settings
  cfg = s.model
  sample_x = (job.population.sample_x if job.layout == 'host'
              else job.data.train.x[0, :1])
  transform = s.data.options.input_transform()
  raw_x = sample_x
  if transform is not None:  # the model is built on, and sees, transformed inputs
    sample_x = np.asarray(transform.evaluate(jnp.asarray(sample_x)))
    say(f'inputs: {transform.name}, {transform.description}')
  job.model = build_model(cfg, job.population.num_classes, sample_x)
  conv = process.conv_impl_of(job.model, sample_x)
  if conv is None and cfg.conv_impl != 'auto':
    raise ConfigError('conv_impl', f'does nothing: --model={cfg.model} has no convolution')
  # The host layout's pooled evaluation runs a forward pass alone (Model.forward_only).
  forward = (conv and job.layout == 'host'
             and process.conv_impl_of(job.model.forward_only(), sample_x)) or conv
  precision = s.engine.matmul_precision
  job.identity['numerics'] = numerics.record(precision, conv, forward)
  convolutions = ''
  if conv:
    why = f'auto on {jax.default_backend()}' + (
        f'; a forward pass alone {forward}' if forward != conv else '')
    convolutions = f'; convolutions {conv}' + (f' ({why})' if cfg.conv_impl == 'auto' else '')
  say('numerics: matmul precision ' + numerics.effective_matmul(precision) + convolutions)
  job.model, scoring = s.data.options.scored(job.model, job.population.num_classes)
  if scoring:  # next-word accuracy as the data set's publisher defines it
    say(scoring)
  if transform is not None:
    job.model = model_inputs.with_inputs(job.model, transform)
  _check_model_fits_targets(s, job.model, raw_x, job.store.y_spec()[0],
                            job.population.num_classes)
  try:
    job.executor = create_executor(s.engine.executor, job.model, sample_x, s.engine.block_size)
  except ValueError as e:
    raise ConfigError('executor', str(e)) from None


def _check_model_fits_targets(s: RunSettings, model, sample_x, y_shape, num_classes) -> None:
  """Refuses a model whose predictions do not match the data set's targets
  (an image model on token sequences, a sequence model on labels), before
  anything is built: one line naming --model."""
  if model.loss != 'cross_entropy':
    return
  name, dataset = s.model.model, s.data.dataset
  params = jax.eval_shape(model.init, jax.random.key(0))
  try:
    out = jax.eval_shape(model.apply, params, jnp.asarray(sample_x)[:1]).shape[1:]
  except Exception as e:  # the model cannot even read these inputs
    raise ConfigError('model', f'--model={name} cannot read {dataset}\'s inputs '
                      f'{tuple(np.shape(sample_x)[1:])}: {type(e).__name__}') from None
  want = tuple(y_shape) + (num_classes,)
  if tuple(out) != want:
    kind = 'a sequence of targets' if len(y_shape) else 'one label'
    raise ConfigError('model', f'--model={name} predicts {tuple(out)} per example, '
                      f'{dataset} has {kind} per example ({want} expected): choose a '
                      + ('sequence model (char_lstm, lstm_lm, transformer_lm)' if len(y_shape)
                         else 'classifier (mlp, cnn, lenet5, ...)'))


def build_algorithms(job: Job) -> None:
  """Every algorithm, built before any trains, with its run identity."""
  s = job.settings
  for setting, problem in system_lib.file_problems(s.system, job.population.num_clients)[:1]:
    raise ConfigError(setting, problem)
  weighted = client_weights(s)
  job.algs = [Built(a, algorithms_lib.make(a.spec, a.training, a.config, job.model,
                                           job.population),
                    {**run_identity.identity(a.name, a.training, a.config, job.identity),
                     **({'weighting': weighted[a.name]} if a.name in weighted else {})})
              for a in s.algorithms]
  if job.population.eval_only:
    for built in job.algs:
      _check_global_evaluation(s, built.alg, job.population.eval_only)


def client_weights(s: RunSettings) -> Dict[str, str]:
  """{algorithm: how it weighs client uploads} for the algorithms that
  average them (``--weighting``, else the algorithm's paper's).

  Args:
    s: the run's settings.

  Returns:
    ``{name: weighting}``.
  """
  return {a.name: a.spec.weighting(a.training) for a in s.algorithms
          if 'weighting' in a.spec.uses}


def _check_global_evaluation(s: RunSettings, alg, held_out: int) -> None:
  """Held-out clients (``eval_only``) never train: personal or fine-tuned
  models would be reported untrained. Refused in one line, naming the data
  set's option that chose them (``DataOptions.held_out_choice``)."""
  models = jax.eval_shape(lambda k: alg.client_models(alg.init(k)), jax.random.key(0))
  num_models = jax.tree.leaves(models.params)[0].shape[0]
  if num_models != 1 or alg.finetune is not None or alg.evaluate_client is not None:
    how = ('fine-tunes on' if alg.finetune is not None else 'adapts to'
           if alg.evaluate_client is not None else 'evaluates personal models trained on')
    flag, other = s.data.options.held_out_choice or ('dataset', 'another data set')
    raise ConfigError(flag, f'{alg.name} {how} each client\'s own training data; the '
                      f'{held_out:,} held-out test clients have none: give --{flag}={other} '
                      'or a global-model algorithm')


def settle_layout(job: Job) -> None:
  """The layout once the algorithms' states are known, the header line
  saying which and why, and the memory plan: the padded population beside
  the largest state (times the configurations of a sweep, whose states the
  device layout stacks) must fit the accelerator's free memory, or on a CPU
  the available host memory beside the padded copy it is made from. When it
  cannot, ``auto`` moves to the host layout (client rows with the
  population) and ``device`` is refused; in the host layout every
  configuration's client rows must fit the host. Refused in one line before
  anything is made, never left to the out-of-memory killer."""
  s = job.settings
  engine, cap = s.engine, s.inputs.max_client_examples
  num = len(job.cfgs) if job.cfgs is not None else 1
  times = f' x {num} configurations' if num > 1 else ''
  if job.layout == 'device':
    free = memory.device_free_bytes()
    copies = 1
    if free is None and jax.default_backend() == 'cpu':  # the device is the host
      free, copies = placement.host_available_bytes(), 2
    sizes = {alg.name: tree_bytes(jax.eval_shape(alg.init, jax.random.key(0)))
             for _, alg, _ in job.algs}
    name = max(sizes, key=lambda n: sizes[n])
    need = copies * job.store.padded_nbytes(cap) + num * sizes[name]
    if free is not None and need > free:
      what = (f'the padded population and {name}\'s state{times} need '
              f'{need / placement.GB:.2f} GB, {free / placement.GB:.1f} GB free')
      if engine.layout == 'device' or jax.process_count() > 1:
        raise ConfigError('layout', f'--layout=device: {what}; give --layout=host (one '
                          'process) or fewer clients')
      job.layout, job.layout_reason = 'host', f'auto: {what}; client rows on the host'
      job.population = job.store.population(cap)
      job.data = HostData(job.store, cap)
      build_algorithms(job)
  say(f'layout: {job.layout} ({job.layout_reason})')
  if engine.client_state not in ('memory', 'auto') and job.layout != 'host':
    raise ConfigError('client_state', 'keeps client rows in files in the host layout; this run '
                      'is on the device layout (give --layout=host)')
  if job.layout == 'host':
    available = placement.host_available_bytes()
    sizes = {alg.name: num * tree_bytes(alg.client_rows.get(jax.eval_shape(alg.init,
                                                                         jax.random.key(0))))
             for _, alg, _ in job.algs if alg.client_rows is not None}
    most = max(sizes.values(), default=0)
    why = ''
    if engine.client_state == 'disk' and sizes:
      job.rows_on_disk, why = True, 'asked for'
    elif engine.client_state == 'auto' and available is not None and most > 0.5 * available:
      job.rows_on_disk = True
      why = (f'auto: {most / placement.GB:.1f} GB of rows, more than half of the '
             f'{available / placement.GB:.1f} GB available')
    if job.rows_on_disk:
      for name, nbytes in sizes.items():
        say(f'  {name}: client rows{times} ({nbytes / placement.GB:.3f} GB if all made) in files, '
            f'each written when its client first trains ({why})')
      return
    for _, alg, _ in job.algs:
      if alg.client_rows is not None:
        nbytes = sizes[alg.name]
        if available is not None and nbytes > 0.9 * available:
          e = s.experiment
          flag = 'algorithm' if num == 1 else 'sweep' if e.sweep else (
              'trials' if e.trials > 1 else 'sweep_seeds')
          raise ConfigError(flag, f'{alg.name} keeps {nbytes / placement.GB:.1f} GB of '
                            f'client rows{times} in host memory, '
                            f'{available / placement.GB:.1f} GB available: give fewer '
                            'clients (--num_clients)' + (', fewer configurations'
                                                        if num > 1 else '')
                            + ' or a smaller model, or --client_state=disk')
        say(f'  {alg.name}: client rows{times} ({nbytes / placement.GB:.3f} GB) on the host')


def choose_output_dir(job: Job) -> None:
  """--output_dir or the configuration's default folder; with several
  processes, every process must run the same configuration."""
  s = job.settings
  identities = {b.settings.name: b.identity for b in job.algs}
  job.output_dir = s.output.output_dir or s.default_output_dir(identities)
  faults.PROGRESS.output_dir = job.output_dir
  if job.rows_on_disk:  # the run's client rows, in files under its output folder
    job.data = dataclasses.replace(job.data,
                                   rows_folder=os.path.join(job.output_dir, 'client_rows'))
  distributed.check_same_run({'algorithms': identities, 'flags': s.shared_flags()},
                             run_identity.differences)
  why = f' ({job.executor.reason})' if job.executor.reason else ''
  say(f'executor: {job.executor.describe()} on {jax.default_backend()}{why}; outputs in '
      f'{job.output_dir}')
  if job.cfgs is not None:
    say(f'{len(job.cfgs)} configurations per algorithm, ' + (
        'one after another on the host layout, the configurations of one seed sharing each '
        "round's cohort gather" if job.layout == 'host' else
        'each algorithm one compiled program' if job.executor.fused else 'one after another'))


def claim_and_restore(job: Job) -> None:
  """Makes the output folders this configuration's (process 0 writes, the
  others wait), builds each algorithm's runs, and with --resume restores them
  from their latest checkpoints (every process its own shards)."""
  out, rounds = job.settings.output, job.settings.experiment.rounds
  resume = out.resume or out.resume_if_found
  identities = {b.settings.name: b.identity for b in job.algs}
  started = False  # --resume of a run that began here: algorithms it never reached start
  if resume:
    started = run_identity.repaired(job.output_dir, {'algorithms': identities})
    run_identity.check_process_count(job.output_dir)
  if distributed.is_primary():
    run_identity.lock(job.output_dir)  # held until the job ends (main_job unlocks)
    run_identity.claim(job.output_dir, {'algorithms': identities}, out.overwrite, resume)
    for name, ident in identities.items():
      run_identity.claim(os.path.join(job.output_dir, name), ident, out.overwrite, resume)
  distributed.barrier('claimed output folders')
  if job.rows_on_disk:  # the live client rows, made afresh (a resume rewrites them)
    shutil.rmtree(job.data.rows_folder, ignore_errors=True)
  for built in job.algs:
    name = built.settings.name
    runs = _make_runs(job, built, job.data)
    job.runs[name] = runs
    plan = getattr(getattr(getattr(runs, 'runner', None), 'feed', None), 'plan', None)
    if plan is not None and built is job.algs[0]:
      say(f'shape plan: {plan.describe()}, fixed for the run')
    if not resume:
      continue
    ckpt_dir = os.path.join(job.output_dir, name, 'checkpoints')
    if os.path.exists(ckpt_dir) and not os.path.isdir(ckpt_dir):
      raise ConfigError('resume', f'{ckpt_dir} is a file, not a folder of checkpoints: move it '
                        'away, then run the same command with --resume')
    got = checkpointing.restore_latest(ckpt_dir, runs.init(), built.identity)
    if got is None and out.resume and not started:
      raise ConfigError('resume', f'no checkpoint of {name} in {ckpt_dir}; run without '
                        '--resume, or with --resume_if_found to start fresh where there is none')
    if got is None:
      say(f'{name}: no checkpoint in {ckpt_dir}; starting fresh')
    elif got[1] > rounds:
      raise ConfigError('rounds', f'the checkpoint of {name} is at round {got[1]}, past '
                        f'--rounds={rounds}')
    job.restored[name] = got


def _callbacks(job: Job, built: Built, hists, start):
  """The loop's callbacks: metrics, checkpoints, diagnostics, progress (files
  and the bar on process 0; checkpoints on every process)."""
  s, alg_name, alg = job.settings, built.settings.name, built.alg
  out_dir = os.path.join(job.output_dir, alg_name)
  primary = distributed.is_primary()
  callbacks: List[experiment.Callback] = []
  if alg.privacy is not None:
    callbacks.append(reporting.PrivacyRecorder(alg.privacy, s.experiment.dp_delta))
  if primary:
    callbacks.append(reporting.MetricsWriter(out_dir, hists))
    callbacks.append(tensorboard.TensorBoardWriter(
        os.path.join(job.output_dir, 'tensorboard', alg_name), hists))
  # Always: an interruption keeps the round in progress (--resume continues it).
  callbacks.append(checkpointing.Checkpointer(
      os.path.join(out_dir, 'checkpoints'), s.output.checkpoint_every, hists,
      identity=built.identity, resumed_step=start or None,
      final=bool(s.output.checkpoint_every or s.output.resume or s.output.resume_if_found)))
  if alg_name == 'fedfomo' and job.cfgs is None and primary:
    callbacks.append(reporting.AffinityRecorder(os.path.join(out_dir, 'affinity.png')))
  if s.output.progress and primary:
    callbacks.append(reporting.Progress(s.experiment.rounds - start, alg_name))
  return callbacks


def train_algorithm(job: Job, built: Built) -> None:
  """Trains one algorithm's runs to --rounds and records their summaries."""
  s = job.settings
  e = s.experiment
  alg_name, ignored, ident = built.settings.name, built.settings.ignored, built.identity
  runs = job.runs[alg_name]
  state, start, hists = None, 0, None
  if job.restored.get(alg_name) is not None:
    state, start, hists = job.restored[alg_name]
    say(f'{alg_name}: resuming after round {start}')
  if faults.stop_requested():  # asked while the previous algorithm wrote its results
    raise faults.interrupted()
  later = len(job.algs) - 1 - [b.settings.name for b in job.algs].index(alg_name)
  faults.start_algorithm(alg_name, start, os.path.join(job.output_dir, alg_name, 'checkpoints'),
                         True, start or None, e.rounds, later)
  began, compiled = time.perf_counter(), compilation.stats()
  _, hists = experiment.run_many(runs, e.rounds, eval_every=e.eval_every,
                                 callbacks=_callbacks(job, built, hists, start),
                                 state=state, start_round=start, histories=hists)
  alg_summaries = []
  costs = process.time_to_result(runs, began, compiled)
  programs, hits = costs.pop('_programs'), costs.pop('_hits')
  for label, history in zip(runs.labels, hists):
    summary = reporting.final_summary(history, e.stat_window)
    summary['rounds'] = e.rounds
    summary.update(costs)
    if 'per_client_accuracy' in summary:  # by id: per_client_accuracy[i] is client_ids[i]'s
      summary['worst_clients'] = reporting.worst_clients(summary['per_client_accuracy'],
                                                         job.store.client_ids)
      summary['client_ids'] = list(job.store.client_ids)
    if label is not None:
      summary['config'] = label
    if job.model.accuracy_definition:
      summary['accuracy_definition'] = job.model.accuracy_definition
    if start:
      summary['resumed_after_round'] = start
    if ignored:
      summary['ignored_settings'] = list(ignored)
    if e.target_accuracy is not None:
      summary['rounds_to_target'] = experiment.rounds_to_target(history, e.target_accuracy)
    if e.paper_metric is not None:
      key = reporting.PAPER_METRICS[e.paper_metric][0]
      summary['paper_metric'] = {'column': e.paper_metric, 'key': key, 'value': summary.get(key)}
    row = e.row_label(alg_name, label)
    job.histories[row], job.summaries[row] = history, summary
    alg_summaries.append(summary)
    if e.trials > 1:  # rows of the table: trials grouped by their values
      values = {k: v for k, v in label.items() if k != 'seed'}
      job.groups.setdefault(e.row_label(alg_name, values or None), []).append((history, summary))
    say(f"{row}: " + (f"diverged at round {summary['diverged_at_round']}"
                      if summary.get('diverged') else
                      f"mean {summary['accuracy_mean']:.4f} worst {summary['accuracy_worst']:.4f}")
        + f" ({summary['train_seconds']:.1f} s of rounds, the first "
        f"{summary.get('first_round_seconds', 0):.1f} s; compiling "
        f"{summary['compile_seconds']:.1f} s, {programs} programs, {hits} from the cache)"
        + (f", epsilon {summary['dp_epsilon']:.2f} at delta {e.dp_delta:g}"
           if 'dp_epsilon' in summary else ''))
  if distributed.is_primary():
    record = alg_summaries[0] if job.cfgs is None else {'configurations': alg_summaries}
    reporting.write_summary(os.path.join(job.output_dir, alg_name),
                            {**record, 'algorithm': alg_name, 'identity': ident,
                             'numerics': ident.get('numerics'), 'flags': dict(s.flags)})


def write_comparison(job: Job) -> None:
  """The comparison table (printed), comparison.json or sweep.json and the
  plots, for the algorithms that finished (process 0 writes)."""
  s = job.settings
  e, plot_mode = s.experiment, s.output.plots
  if not job.histories:
    return
  strip = lambda s: {k: v for k, v in s.items() if k not in ('per_client_accuracy', 'client_ids')}
  table, primary = job.summaries, distributed.is_primary()
  if e.trials > 1:
    table = {g: reporting.aggregate_trials([s for _, s in items])
             for g, items in job.groups.items()}
    if primary:
      plots.draw('trials', {g: [h for h, _ in items] for g, items in job.groups.items()},
                 job.output_dir, plot_mode)
      run_identity.write_json(os.path.join(job.output_dir, 'comparison.json'), {
          g: {**table[g], 'per_trial': [strip(s) for _, s in items]}
          for g, items in job.groups.items()})
  elif primary:
    plots.draw('runs', job.histories, job.output_dir, plot_mode)
    run_identity.write_json(os.path.join(job.output_dir, 'comparison.json'
                                         if job.cfgs is None else 'sweep.json'),
                            {k: strip(s) for k, s in job.summaries.items()})
  trials = f', mean ± std over {e.trials} trials' if e.trials > 1 else ''
  window = reporting.table_window(table)
  say('')
  say(f'{job.population.name}, {s.model.model}, {e.rounds} rounds: per-client test accuracy at the '
       f'last evaluation and averaged over the last {window} (@last{window}){trials}')
  say(reporting.format_table(table))
  if e.paper_metric is not None:
    say(f"the paper's metric: the {e.paper_metric} column, "
        f'{reporting.PAPER_METRICS[e.paper_metric][1]}')
  if e.trials > 1:
    job.summaries = table
