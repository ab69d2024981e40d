"""The main job of ``scripts/run_experiment.py`` as named steps: load the
data in its layout, build the model and executor, build every algorithm (a
bad setting fails before anything trains), settle the layout and the memory
plan, choose the output folder, claim it and restore checkpoints, train each
algorithm, write the comparison. Settings come from ``run/settings.py``.
"""


import dataclasses
import os
import shutil
import time
from typing import Any, Dict

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal import algorithms as algorithms_lib
from fedjax_personal import datasets as datasets_lib
from fedjax_personal import compilation, numerics
from fedjax_personal.datasets import shakespeare, stackoverflow
from fedjax_personal.run import (checkpointing, distributed, experiment, faults, plots,
                                 process_settings, reporting, run_identity)
from fedjax_personal.run.settings import (Settings, check, data_config, default_output_dir,
                                          job_identity, process_flags, row_label, sampler_for,
                                          sweep_configs, sweepable, validate_flags)
from fedjax_personal.config import TrainingConfig
from fedjax_personal.errors import ConfigError, DataError
from fedjax_personal.core.population import layout as layout_lib
from fedjax_personal.core import memory
from fedjax_personal.core.data import to_device
from fedjax_personal.core.population.layout import HostData
from fedjax_personal.core.population.store import PopulationStore
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.core.executors import create_executor
from fedjax_personal.models import create_model, weights
from fedjax_personal.models import inputs as model_inputs
from fedjax_personal.core.tree_util import tree_bytes


__all__ = ['Job', 'load_data', 'main_job', 'say']


def _make_runs(opts: Settings, spec, alg, training, cfg, ignored, model, data, executor, cfgs):
  """The loop's ``Runs`` of one algorithm: a single run, or its
  configurations (sweep, trials) as one vmapped program when the executor is
  fused, else one after another."""
  if cfgs is None:
    return experiment.SingleRun(RoundRunner(alg, data, sampler_for(opts, data), executor),
                                opts.seed)
  from fedjax_personal.run import sweep
  names = sweepable()

  def build(hv):
    hv = {k: v for k, v in hv.items() if k not in ignored}
    shared = {names[k][1]: v for k, v in hv.items() if names[k][0] is TrainingConfig}
    own = {names[k][1]: v for k, v in hv.items() if names[k][0] is spec.config}
    return algorithms_lib.build(spec.name, model, data,
                                training=dataclasses.replace(training, **shared),
                                config=dataclasses.replace(cfg, **own))
  # One program over the configurations needs the whole population on the
  # device; the host layout runs them one after another on shared gathers.
  one_program = executor.fused and not isinstance(data, HostData)
  runs = sweep.SweepRunner if one_program else sweep.LoopRuns
  return runs(build, cfgs, data, sampler_for(opts, data), executor)


@dataclasses.dataclass
class Job:
  """What the main job's steps pass on: the data and its identity, the model
  and executor, the algorithms with their settings and run identities, the
  output folder, and the results so far; ``opts`` holds the command's settings."""
  opts: Settings = None
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
  algs: list = dataclasses.field(default_factory=list)
  output_dir: str = ''
  runs: dict = dataclasses.field(default_factory=dict)
  restored: dict = dataclasses.field(default_factory=dict)
  histories: dict = dataclasses.field(default_factory=dict)
  summaries: dict = dataclasses.field(default_factory=dict)
  groups: dict = dataclasses.field(default_factory=dict)


def main_job(opts: Settings) -> Dict[str, dict]:
  """Runs every algorithm of --algorithm on the same data (each a single run,
  or with --sweep/--sweep_seeds/--trials its configurations through the same
  loop); writes outputs and prints the comparison table. Returns {row label:
  final summary}. With --dry_run, stops after building everything (nothing
  trained or written) and returns {}.

  Args:
    opts: the command's ``Settings``.

  Returns:
    ``{row label: final summary}``.
  """
  settings = validate_flags(opts)
  process_settings.set_numerics(opts)
  process_settings.set_compilation_cache(opts)
  job = Job(opts=opts, cfgs=sweep_configs(opts))
  load_data(job)
  build_model_and_executor(job)
  build_algorithms(job, settings)
  settle_layout(job, settings)
  choose_output_dir(job)
  if opts.dry_run:
    print(f'dry run: {len(job.algs)} algorithm(s) built; nothing trained or written')
    return {}
  try:
    claim_and_restore(job)
    try:
      for entry in job.algs:
        train_algorithm(job, entry)
    finally:  # also when a later algorithm fails: the finished ones keep their table
      write_comparison(job)
  finally:
    run_identity.unlock(job.output_dir)
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
  opts = job.opts
  cfg = data_config(opts)
  cap = opts.max_client_examples
  check(not opts.rebuild_store or datasets_lib.streams_to_store(cfg), 'rebuild_store',
        f'rebuilds the population store of a data set read from its files; {opts.dataset} '
        f'({cfg.partition}) is built in memory every run')
  check(not opts.verify_store or datasets_lib.streams_to_store(cfg), 'verify_store',
         f'checks the population store of a data set read from its files; {opts.dataset} '
         f'({cfg.partition}) is built in memory, with nothing to check')
  if datasets_lib.streams_to_store(cfg):  # written once into the cache, client by client
    store = datasets_lib.load_store(cfg, verify=opts.verify_store, rebuild=opts.rebuild_store,
                                    should_stop=faults.signal_received)
    fingerprint = store.digest
  else:  # built in memory, unpadded (padded only if the device layout holds it)
    store = datasets_lib.load_store(cfg)
    fingerprint = run_identity.padded_fingerprint(store)  # as earlier runs': padded arrays'
  if opts.client_ids:
    store = chosen_clients(store, opts.client_ids)
    fingerprint = store.digest
  population = store.population(cap)
  train_counts = np.asarray(population.train.num_examples)
  check(int(train_counts.sum()) > 0, 'num_clients', 'no client has training data')
  if int(np.asarray(population.test.num_examples).sum()) == 0:
    raise ConfigError('dataset', f'{opts.dataset}: no training client has a test example (the '
                      'test file\'s clients match none of the training file\'s): check the '
                      'test file, or --data_dir')
  trained = population.num_trained
  check(opts.cohort_size is None or opts.cohort_size <= trained, 'cohort_size',
         f'must be in [1, {trained}] (the clients of {opts.dataset} that train), got '
         f'{opts.cohort_size}')
  free = memory.device_free_bytes() or (layout_lib.host_available_bytes()
                                        if jax.default_backend() == 'cpu' else None)
  layout, reason = layout_lib.choose(opts.layout, store.padded_nbytes(cap), free,
                                     int(train_counts.max()), cap)
  if layout == 'host' and jax.process_count() > 1:
    padded_bytes = store.padded_nbytes(cap)
    # The padded population is made on the host, then put on the device: on
    # a CPU both copies share the host's memory.
    need = padded_bytes * (2 if jax.default_backend() == 'cpu' else 1)
    if free is not None and need > free:
      raise ConfigError('num_processes', 'several processes run on the device layout, where this '
                        f'population padded to its widest client needs {need / layout_lib.GB:.1f} '
                        f'GB, {free / layout_lib.GB:.1f} GB free: run on one process (the host '
                        'layout), or give --max_client_examples / --num_clients')
    layout, reason = 'device', 'several processes run on the device layout'
  say(population.describe())
  if opts.dataset in ('emnist', 'emnist_digits'):
    say('pixels: ' + ('fedjax (1 - x, ink 1: FedJAX\'s load_data)' if opts.emnist_pixels == 'fedjax'
                      else 'tff (the raw pixels, ink 0: TFF\'s, as Reddi et al. feed them)'))
  if opts.dataset == 'stackoverflow':
    say('test set: ' + ('the train users\' own test posts (train_users)'
                        if opts.stackoverflow_test == 'train_users' else
                        'every test user, held out, pooled, less 10,000 posts for validation '
                        '(tff_users: Reddi et al.\'s task)'))
  job.layout_reason, job.store = reason, store
  job.identity = job_identity(opts, fingerprint, cap)
  if job.cfgs is not None:
    job.identity['sweep'] = {'sweep': opts.sweep, 'sweep_seeds': opts.sweep_seeds,
                             'trials': opts.trials}
  job.layout = layout
  if layout == 'device':
    job.population = store.padded(cap)
    job.data = to_device(job.population)
  else:
    job.population, job.data = population, HostData(store, cap)


def chosen_clients(store: PopulationStore, path: str) -> PopulationStore:
  """The clients listed in ``path`` (--client_ids: one id per line, blank
  lines and # comments skipped) as a view of ``store``."""
  try:
    with open(path, encoding='utf-8-sig') as f:  # a byte order mark is not part of an id
      ids = [line.strip() for line in f]
  except (OSError, UnicodeDecodeError) as e:
    raise ConfigError('client_ids', f'{path}: {getattr(e, "strerror", None) or e}') from None
  ids = [c for c in ids if c and not c.startswith('#')]
  check(bool(ids), 'client_ids', f'{path} lists no client id')
  try:
    return store.subset(ids, f'from {os.path.basename(path)}')
  except DataError as e:
    raise ConfigError('client_ids', f'{path}: {e}') from None


def build_model_and_executor(job: Job) -> None:
  """The model (its initialisation convention, or weights from a file) and
  the executor."""
  opts = job.opts
  sample_x = (job.population.sample_x if job.layout == 'host'
              else job.data.train.x[0, :1])
  transform = (None if opts.cifar100_preprocess == 'none'
               else model_inputs.TRANSFORMS[opts.cifar100_preprocess]())
  raw_x = sample_x
  if transform is not None:  # the model is built on, and sees, transformed inputs
    sample_x = np.asarray(transform.evaluate(jnp.asarray(sample_x)))
    job.identity['inputs'] = transform.name
    say(f'inputs: {transform.name}, {transform.description}')
  job.model = create_model(opts.model, job.population.num_classes, sample_x, opts.adapter_dim,
                           conv_impl=opts.conv_impl, init=opts.model_init)
  conv = process_settings.conv_impl_of(job.model, sample_x)
  check(conv is not None or not opts['conv_impl'].present, 'conv_impl',
        f'does nothing: --model={opts.model} has no convolution')
  # The host layout's pooled evaluation runs a forward pass alone (Model.forward_only).
  forward = (conv and job.layout == 'host'
             and process_settings.conv_impl_of(job.model.forward_only(), sample_x)) or conv
  job.identity['numerics'] = numerics.record(conv, forward)
  convolutions = ''
  if conv:
    why = f'auto on {jax.default_backend()}' + (
        f'; a forward pass alone {forward}' if forward != conv else '')
    convolutions = f'; convolutions {conv}' + (f' ({why})' if opts.conv_impl == 'auto' else '')
  say('numerics: matmul precision ' + numerics.effective_matmul() + convolutions)
  if opts.dataset == 'stackoverflow':  # next-word accuracy as one publisher defines it
    unscored, unpredicted, definition = stackoverflow.stackoverflow_accuracy(
        opts.stackoverflow_accuracy, job.population.num_classes)
    job.model = job.model.scoring_only_words(unscored, unpredicted=unpredicted,
                                             definition=definition)
    say(f'accuracy: {opts.stackoverflow_accuracy}, {definition}')
  if opts.dataset == 'shakespeare' and opts.shakespeare_windows == 'tff':
    job.model = job.model.scoring_only_words(
        shakespeare.PAD_UNSCORED['tff'], top_k=0,
        definition='TFF windows: accuracy over the targets but PAD (PAD targets in the loss)')
    say(f'windows: tff, {job.model.accuracy_definition}')
  if opts.init_weights:
    job.model = job.model.starting_from(weights.load(opts.init_weights, job.model, sample_x))
  if transform is not None:
    job.model = model_inputs.with_inputs(job.model, transform)
  _check_model_fits_targets(opts, job.model, raw_x, job.store.y_spec()[0], job.population.num_classes)
  try:
    job.executor = create_executor(opts.executor, job.model, sample_x, opts.block_size)
  except ValueError as e:
    raise ConfigError('executor', str(e)) from None


def _check_model_fits_targets(opts: Settings, model, sample_x, y_shape, num_classes) -> None:
  """Refuses a model whose predictions do not match the data set's targets
  (an image model on token sequences, a sequence model on labels), before
  anything is built: one line naming --model."""
  if model.loss != 'cross_entropy':
    return
  params = jax.eval_shape(model.init, jax.random.key(0))
  try:
    out = jax.eval_shape(model.apply, params, jnp.asarray(sample_x)[:1]).shape[1:]
  except Exception as e:  # the model cannot even read these inputs
    raise ConfigError('model', f'--model={opts.model} cannot read {opts.dataset}\'s inputs '
                      f'{tuple(np.shape(sample_x)[1:])}: {type(e).__name__}') from None
  want = tuple(y_shape) + (num_classes,)
  if tuple(out) != want:
    kind = 'a sequence of targets' if len(y_shape) else 'one label'
    raise ConfigError('model', f'--model={opts.model} predicts {tuple(out)} per example, '
                      f'{opts.dataset} has {kind} per example ({want} expected): choose a '
                      + ('sequence model (char_lstm, lstm_lm, transformer_lm)' if len(y_shape)
                         else 'classifier (mlp, cnn, lenet5, ...)'))


def build_algorithms(job: Job, settings) -> None:
  """Every algorithm, built before any trains (a bad setting fails fast), with
  its run identity."""
  opts = job.opts
  job.algs = [(spec, algorithms_lib.build(spec.name, job.model, job.population, training=t,
                                          config=cfg),
               t, cfg, ignored, run_identity.identity(spec.name, t, cfg, job.identity))
              for spec, t, cfg, ignored in settings]
  if job.population.eval_only:
    for _, alg, *_ in job.algs:
      _check_global_evaluation(opts, alg, job.population.eval_only)
  if opts['dp_delta'].present and not any(a.privacy is not None for _, a, *_ in job.algs):
    raise ConfigError('dp_delta', 'does nothing: no requested algorithm runs DP-SGD '
                      '(--fedfomo_dp_clip_norm > 0)')


def _check_global_evaluation(opts: Settings, alg, held_out: int) -> None:
  """Held-out clients (``eval_only``) never train: an algorithm that
  evaluates personal models, or adapts a model to a client's own training
  data before evaluating it, would report untrained or unadapted models
  under its name. Refused in one line."""
  models = jax.eval_shape(lambda k: alg.client_models(alg.init(k)), jax.random.key(0))
  num_models = jax.tree.leaves(models.params)[0].shape[0]
  if num_models != 1 or alg.finetune is not None or alg.evaluate_client is not None:
    how = ('fine-tunes on' if alg.finetune is not None else 'adapts to'
           if alg.evaluate_client is not None else 'evaluates personal models trained on')
    flag, other = (('stackoverflow_test', 'train_users (the train users\' own test posts)')
                   if opts.dataset == 'stackoverflow' else
                   ('cifar100_test', 'split (each client\'s images split for test)'))
    raise ConfigError(flag, f'{alg.name} {how} each client\'s own training data; the '
                      f'{held_out:,} held-out test clients have none: give --{flag}={other} '
                      'or a global-model algorithm')


def settle_layout(job: Job, settings) -> None:
  """The layout once the algorithms' states are known, the header line
  saying which and why, and the memory plan: the padded population beside
  the largest state (times the configurations of a sweep, whose states the
  device layout stacks) must fit the accelerator's free memory, or on a CPU
  the available host memory beside the padded copy it is made from. When it
  cannot, ``auto`` moves to the host layout (client rows with the
  population) and ``device`` is refused; in the host layout every
  configuration's client rows must fit the host. Refused in one line before
  anything is made, never left to the out-of-memory killer."""
  opts = job.opts
  num = len(job.cfgs) if job.cfgs is not None else 1
  times = f' x {num} configurations' if num > 1 else ''
  if job.layout == 'device':
    free = memory.device_free_bytes()
    copies = 1
    if free is None and jax.default_backend() == 'cpu':  # the device is the host
      free, copies = layout_lib.host_available_bytes(), 2
    sizes = {alg.name: tree_bytes(jax.eval_shape(alg.init, jax.random.key(0)))
             for _, alg, *_ in job.algs}
    name = max(sizes, key=sizes.get)
    need = copies * job.store.padded_nbytes(opts.max_client_examples) + num * sizes[name]
    if free is not None and need > free:
      what = (f'the padded population and {name}\'s state{times} need '
              f'{need / layout_lib.GB:.2f} GB, {free / layout_lib.GB:.1f} GB free')
      if opts.layout == 'device' or jax.process_count() > 1:
        raise ConfigError('layout', f'--layout=device: {what}; give --layout=host (one '
                          'process) or fewer clients')
      job.layout, job.layout_reason = 'host', f'auto: {what}; client rows on the host'
      job.population = job.store.population(opts.max_client_examples)
      job.data = HostData(job.store, opts.max_client_examples)
      build_algorithms(job, settings)
  say(f'layout: {job.layout} ({job.layout_reason})')
  check(opts.client_state in ('memory', 'auto') or job.layout == 'host', 'client_state',
        'keeps client rows in files in the host layout; this run is on the device layout '
        '(give --layout=host)')
  if job.layout == 'host':
    available = layout_lib.host_available_bytes()
    sizes = {alg.name: num * tree_bytes(alg.client_rows.get(jax.eval_shape(alg.init,
                                                                         jax.random.key(0))))
             for _, alg, *_ in job.algs if alg.client_rows is not None}
    most = max(sizes.values(), default=0)
    why = ''
    if opts.client_state == 'disk' and sizes:
      job.rows_on_disk, why = True, 'asked for'
    elif opts.client_state == 'auto' and available is not None and most > 0.5 * available:
      job.rows_on_disk = True
      why = (f'auto: {most / layout_lib.GB:.1f} GB of rows, more than half of the '
             f'{available / layout_lib.GB:.1f} GB available')
    if job.rows_on_disk:
      for name, nbytes in sizes.items():
        say(f'  {name}: client rows{times} ({nbytes / layout_lib.GB:.3f} GB if all made) in files, '
            f'each written when its client first trains ({why})')
      return
    for _, alg, *_ in job.algs:
      if alg.client_rows is not None:
        nbytes = sizes[alg.name]
        if available is not None and nbytes > 0.9 * available:
          flag = 'algorithm' if num == 1 else 'sweep' if opts.sweep else (
              'trials' if opts.trials > 1 else 'sweep_seeds')
          raise ConfigError(flag, f'{alg.name} keeps {nbytes / layout_lib.GB:.1f} GB of '
                            f'client rows{times} in host memory, '
                            f'{available / layout_lib.GB:.1f} GB available: give fewer '
                            'clients (--num_clients)' + (', fewer configurations'
                                                        if num > 1 else '')
                            + ' or a smaller model, or --client_state=disk')
        say(f'  {alg.name}: client rows{times} ({nbytes / layout_lib.GB:.3f} GB) on the host')


def choose_output_dir(job: Job) -> None:
  """--output_dir or the configuration's default folder; with several
  processes, every process must run the same configuration."""
  opts = job.opts
  identities = {spec.name: ident for spec, _, _, _, _, ident in job.algs}
  job.output_dir = opts.output_dir or default_output_dir(opts, identities)
  faults.PROGRESS.output_dir = job.output_dir
  if job.rows_on_disk:  # the run's client rows, in files under its output folder
    job.data = dataclasses.replace(job.data,
                                   rows_folder=os.path.join(job.output_dir, 'client_rows'))
  distributed.check_same_run({'algorithms': identities, 'flags': process_flags(opts)},
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
  opts = job.opts
  resume = opts.resume or opts.resume_if_found
  identities = {spec.name: ident for spec, _, _, _, _, ident in job.algs}
  if resume:
    _check_process_count(job.output_dir)
  if distributed.is_primary():
    run_identity.lock(job.output_dir)  # held until the job ends (main_job unlocks)
    run_identity.claim(job.output_dir, {'algorithms': identities}, opts.overwrite, resume)
    for spec, *_, ident in job.algs:
      run_identity.claim(os.path.join(job.output_dir, spec.name), ident, opts.overwrite, resume)
  distributed.barrier('claimed output folders')
  if job.rows_on_disk:  # the live client rows, made afresh (a resume rewrites them)
    shutil.rmtree(job.data.rows_folder, ignore_errors=True)
  for spec, alg, t, cfg, ignored, ident in job.algs:
    runs = _make_runs(opts, spec, alg, t, cfg, ignored, job.model, job.data, job.executor,
                      job.cfgs)
    job.runs[spec.name] = runs
    plan = getattr(getattr(getattr(runs, 'runner', None), 'feed', None), 'plan', None)
    if plan is not None and spec is job.algs[0][0]:
      say(f'shape plan: {plan.describe()}, fixed for the run')
    if not resume:
      continue
    ckpt_dir = os.path.join(job.output_dir, spec.name, 'checkpoints')
    got = checkpointing.restore_latest(ckpt_dir, runs.init(), ident)
    if got is None and opts.resume:
      raise ConfigError('resume', f'no checkpoint of {spec.name} in {ckpt_dir}; run without '
                        '--resume, or with --resume_if_found to start fresh where there is none')
    if got is None:
      say(f'{spec.name}: no checkpoint in {ckpt_dir}; starting fresh')
    elif got[1] > opts.rounds:
      raise ConfigError('rounds', f'the checkpoint of {spec.name} is at round {got[1]}, past '
                        f'--rounds={opts.rounds}')
    job.restored[spec.name] = got


def _check_process_count(output_dir: str) -> None:
  """A run resumes with the number of processes it was made with."""
  old = (run_identity.read(output_dir) or {}).get('algorithms', {})
  counts = {ident.get('num_processes', 1) for ident in old.values() if isinstance(ident, dict)}
  if counts and jax.process_count() not in counts:
    raise ConfigError('num_processes', f'{output_dir} was run with {min(counts)} process(es), '
                      f'this is {jax.process_count()}: resume with --num_processes='
                      f'{min(counts)}')


def _callbacks(job: Job, alg_name, alg, ident, hists, start):
  """The loop's callbacks: metrics, checkpoints, diagnostics, progress (files
  and the bar on process 0; checkpoints on every process)."""
  opts = job.opts
  out_dir = os.path.join(job.output_dir, alg_name)
  primary = distributed.is_primary()
  callbacks = []
  if alg.privacy is not None:
    callbacks.append(reporting.PrivacyRecorder(alg.privacy, opts.dp_delta))
  if primary:
    callbacks.append(reporting.MetricsWriter(out_dir, hists))
  if opts.checkpoint_every or opts.resume or opts.resume_if_found:
    callbacks.append(checkpointing.Checkpointer(os.path.join(out_dir, 'checkpoints'),
                                                opts.checkpoint_every, hists, identity=ident,
                                                resumed_step=start or None))
  if alg_name == 'fedfomo' and job.cfgs is None and primary:
    callbacks.append(reporting.AffinityRecorder(os.path.join(out_dir, 'affinity.png')))
  if opts.progress and primary:
    callbacks.append(reporting.Progress(opts.rounds - start, alg_name))
  return callbacks


def train_algorithm(job: Job, entry) -> None:
  """Trains one algorithm's runs to --rounds and records their summaries."""
  opts = job.opts
  spec, alg, _, _, ignored, ident = entry
  alg_name, runs = spec.name, job.runs[spec.name]
  state, start, hists = None, 0, None
  if job.restored.get(alg_name) is not None:
    state, start, hists = job.restored[alg_name]
    say(f'{alg_name}: resuming after round {start}')
  if faults.stop_requested():  # asked while the previous algorithm wrote its results
    raise faults.interrupted()
  faults.start_algorithm(alg_name, start, os.path.join(job.output_dir, alg_name, 'checkpoints'),
                         bool(opts.checkpoint_every), start or None, opts.rounds)
  began, compiled = time.perf_counter(), compilation.stats()
  _, hists = experiment.run_many(runs, opts.rounds, eval_every=opts.eval_every,
                                 callbacks=_callbacks(job, alg_name, alg, ident, hists, start),
                                 state=state, start_round=start, histories=hists)
  alg_summaries = []
  costs = process_settings.time_to_result(runs, began, compiled)
  programs, hits = costs.pop('_programs'), costs.pop('_hits')
  for label, history in zip(runs.labels, hists):
    s = reporting.final_summary(history, opts.stat_window)
    s['rounds'] = opts.rounds
    s.update(costs)
    if 'per_client_accuracy' in s:  # by id: per_client_accuracy[i] is client_ids[i]'s
      s['worst_clients'] = reporting.worst_clients(s['per_client_accuracy'], job.store.client_ids)
      s['client_ids'] = list(job.store.client_ids)
    if label is not None:
      s['config'] = label
    if job.model.accuracy_definition:
      s['accuracy_definition'] = job.model.accuracy_definition
    if start:
      s['resumed_after_round'] = start
    if ignored:
      s['ignored_settings'] = ignored
    if opts.target_accuracy is not None:
      s['rounds_to_target'] = experiment.rounds_to_target(history, opts.target_accuracy)
    row = row_label(alg_name, label)
    job.histories[row], job.summaries[row] = history, s
    alg_summaries.append(s)
    if opts.trials > 1:  # rows of the table: trials grouped by their values
      values = {k: v for k, v in label.items() if k != 'seed'}
      job.groups.setdefault(row_label(alg_name, values or None), []).append((history, s))
    say(f"{row}: " + (f"diverged at round {s['diverged_at_round']}" if s.get('diverged')
                       else f"mean {s['accuracy_mean']:.4f} worst {s['accuracy_worst']:.4f}")
         + f" ({s['train_seconds']:.1f} s of rounds, the first {s.get('first_round_seconds', 0):.1f} s; "
         f"compiling {s['compile_seconds']:.1f} s, {programs} programs, {hits} from the cache)"
         + (f", epsilon {s['dp_epsilon']:.2f} at delta {opts.dp_delta:g}"
            if 'dp_epsilon' in s else ''))
  if distributed.is_primary():
    record = alg_summaries[0] if job.cfgs is None else {'configurations': alg_summaries}
    reporting.write_summary(os.path.join(job.output_dir, alg_name),
                            {**record, 'algorithm': alg_name, 'identity': ident,
                             'numerics': ident.get('numerics'),
                             'flags': opts.flag_values_dict()})


def write_comparison(job: Job) -> None:
  """The comparison table (printed), comparison.json or sweep.json and the
  plots, for the algorithms that finished (process 0 writes)."""
  opts = job.opts
  if not job.histories:
    return
  strip = lambda s: {k: v for k, v in s.items() if k not in ('per_client_accuracy', 'client_ids')}
  table, primary = job.summaries, distributed.is_primary()
  if opts.trials > 1:
    table = {g: reporting.aggregate_trials([s for _, s in items])
             for g, items in job.groups.items()}
    if primary:
      plots.draw('trials', {g: [h for h, _ in items] for g, items in job.groups.items()},
                 job.output_dir, opts.plots)
      run_identity.write_json(os.path.join(job.output_dir, 'comparison.json'), {
          g: {**table[g], 'per_trial': [strip(s) for _, s in items]}
          for g, items in job.groups.items()})
  elif primary:
    plots.draw('runs', job.histories, job.output_dir, opts.plots)
    run_identity.write_json(os.path.join(job.output_dir, 'comparison.json'
                                         if job.cfgs is None else 'sweep.json'),
                            {k: strip(s) for k, s in job.summaries.items()})
  trials = f', mean ± std over {opts.trials} trials' if opts.trials > 1 else ''
  window = reporting.table_window(table)
  say('')
  say(f'{job.population.name}, {opts.model}, {opts.rounds} rounds: per-client test accuracy at the '
       f'last evaluation and averaged over the last {window} (@last{window}){trials}')
  say(reporting.format_table(table))
  if opts.trials > 1:
    job.summaries = table


def say(text: str) -> None:
  """Prints on process 0 (every process computes the same numbers).

  Args:
    text: the line.

  Returns:
    None.
  """
  if distributed.is_primary():
    print(text)
