"""The main job's set-up as steps, each a function of the run's settings and
the steps before it, returning a frozen result: the data as stored and the
identity every run shares (``load_data``), the model and executor
(``build_model_and_executor``), every algorithm built before any trains
(``build_algorithms``), the layout and memory plan decided once from the
algorithms' state sizes (``decide_layout``), the run identities
(``identify``) and the data placed in the layout (``place_data``).
``run/main_job.py`` runs them in order and trains.
"""

import dataclasses
from typing import Any, Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal import algorithms as algorithms_lib
from fedjax_personal import numerics, user_reads
from fedjax_personal.core import memory
from fedjax_personal.core import system as system_lib
from fedjax_personal.core.algorithm import FederatedAlgorithm
from fedjax_personal.core.data import to_device
from fedjax_personal.core.executor_choice import create_executor
from fedjax_personal.core.executors import Executor
from fedjax_personal.core.population import placement
from fedjax_personal.core.population.clients import Population, PopulationStore
from fedjax_personal.core.population.placement import HostData
from fedjax_personal.core.tree_util import tree_bytes
from fedjax_personal.datasets import load_store, loading, streams_to_store
from fedjax_personal.errors import ConfigError, SettingError
from fedjax_personal.hparams import as_flag_error
from fedjax_personal.models import Model, build_model
from fedjax_personal.models import inputs as model_inputs
from fedjax_personal.run import faults, process, run_identity
from fedjax_personal.run.process import say
from fedjax_personal.run.settings import AlgorithmSettings, RunSettings

__all__ = [
  'Built',
  'build_algorithms',
  'build_model_and_executor',
  'decide_layout',
  'identify',
  'Layout',
  'load_data',
  'LoadedData',
  'ModelAndExecutor',
  'place_data',
]


@dataclasses.dataclass(frozen=True)
class LoadedData:
  """The data set as stored (``load_data``).

  Attributes:
    store: the ``PopulationStore`` (the chosen clients, unpadded).
    population: its ``Population`` (example counts after the cap, no
      examples): what the algorithms are built from in either layout.
    identity: the data's part of every algorithm's run identity.
  """

  store: PopulationStore
  population: Population
  identity: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ModelAndExecutor:
  """The model and executor (``build_model_and_executor``).

  Attributes:
    model: the ``Model`` (with the data set's scoring and inputs).
    executor: the ``Executor``.
    conv: the convolution implementation the model runs, or None.
    sample_x: one (transformed) input example, the shapes the model reads.
  """

  model: Model
  executor: Executor
  conv: Optional[str]
  sample_x: np.ndarray


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where the population and the client rows live (``decide_layout``).

  Attributes:
    name: ``'device'`` (padded on the device) or ``'host'`` (the store,
      each round gathering its cohort).
    reason: why, for the header line.
    rows_on_disk: the host layout's client rows in files.
  """

  name: str
  reason: str
  rows_on_disk: bool = False


@dataclasses.dataclass(frozen=True)
class Built:
  """One algorithm of the job.

  Attributes:
    settings: its ``AlgorithmSettings``.
    alg: the ``FederatedAlgorithm``.
    identity: its run identity (empty until ``identify``).
    reads: what its builder read (a user's algorithm: files, modules,
      environment variables; ``user_reads.Reads.record``).
  """

  settings: AlgorithmSettings
  alg: FederatedAlgorithm
  identity: Dict[str, Any] = dataclasses.field(default_factory=dict)
  reads: Dict[str, Any] = dataclasses.field(default_factory=dict)


def load_data(s: RunSettings) -> LoadedData:
  """The data set's population store (written once into the cache from its
  files, or built in memory) with the chosen clients, checked for training
  and test examples and the cohort size.

  Args:
    s: the run's settings.

  Returns:
    The ``LoadedData``.

  Raises:
    ConfigError naming the setting: no training data, no test example, a
      cohort larger than the clients that train.
  """
  cfg, inputs, cohort_size = s.data, s.inputs, s.experiment.cohort_size
  cap = inputs.max_client_examples
  if streams_to_store(cfg):  # written once into the cache, client by client
    store = load_store(
      cfg,
      verify=inputs.verify_store,
      rebuild=inputs.rebuild_store,
      should_stop=faults.signal_received,
    )
    fingerprint = store.digest
  else:  # built in memory, unpadded (padded only if the device layout holds it)
    store = load_store(cfg)
    # as earlier runs': padded arrays'
    fingerprint = run_identity.padded_fingerprint(store)
  if inputs.client_ids:
    store = loading.chosen_clients(store, inputs.client_ids)
    fingerprint = store.digest
  population = store.population(cap)
  if int(np.asarray(population.train.num_examples).sum()) == 0:
    raise ConfigError('num_clients', 'no client has training data')
  if int(np.asarray(population.test.num_examples).sum()) == 0:
    raise ConfigError(
      'dataset',
      f'{cfg.dataset}: no training client has a test example (the '
      "test file's clients match none of the training file's): check the "
      'test file, or --data_dir',
    )
  trained = population.num_trained
  if cohort_size is not None and cohort_size > trained:
    raise ConfigError(
      'cohort_size',
      f'must be in [1, {trained}] (the clients of {cfg.dataset} '
      f'that train), got {cohort_size}',
    )
  say(population.describe())
  for line in cfg.options.describe():
    say(line)
  identity = s.identity(fingerprint, cap, jax.process_count())
  if s.configurations() is not None:
    e = s.experiment
    identity['sweep'] = {
      'sweep': e.sweep,
      'sweep_seeds': e.sweep_seeds,
      'trials': e.trials,
    }
  return LoadedData(store, population, identity)


def build_model_and_executor(
  s: RunSettings, loaded: LoadedData
) -> ModelAndExecutor:
  """The model (its initialisation convention, or weights from a file; the
  data set's scoring and inputs) and the executor, from the shapes of one
  input example.

  Args:
    s: the run's settings.
    loaded: the data.

  Returns:
    The ``ModelAndExecutor``.

  Raises:
    ConfigError naming ``--model``, ``--conv_impl`` or ``--executor``.
  """
  cfg, population = s.model, loaded.population
  raw_x = sample_x = population.sample_x
  transform = s.data.options.input_transform()
  # the model is built on, and sees, transformed inputs
  if transform is not None:
    sample_x = np.asarray(transform.evaluate(jnp.asarray(sample_x)))
    say(f'inputs: {transform.name}, {transform.description}')
  model = build_model(cfg, population.num_classes, sample_x)
  conv = process.conv_impl_of(model, sample_x)
  if conv is None and cfg.conv_impl != 'auto':
    raise ConfigError(
      'conv_impl', f'does nothing: --model={cfg.model} has no convolution'
    )
  # a user's module convolves as it is written: XLA's op
  if (
    cfg.conv_impl != 'auto' and getattr(model.module, 'conv_impl', None) is None
  ):
    raise ConfigError(
      'conv_impl',
      f'does nothing for --model={cfg.model}: its module computes its own '
      'convolutions (as XLA ops, recorded in the run identity); leave '
      '--conv_impl at auto',
    )
  model, scoring = s.data.options.scored(model, population.num_classes)
  if scoring:  # next-word accuracy as the data set's publisher defines it
    say(scoring)
  if transform is not None:
    model = model_inputs.with_inputs(model, transform)
  _check_model_fits_targets(
    s, model, raw_x, loaded.store.y_spec()[0], population.num_classes
  )
  try:
    executor = create_executor(
      s.engine.executor, model, sample_x, s.engine.block_size
    )
  except ValueError as e:
    raise ConfigError('executor', str(e)) from None
  return ModelAndExecutor(model, executor, conv, sample_x)


def _check_model_fits_targets(
  s: RunSettings, model, sample_x, y_shape, num_classes
) -> None:
  """Refuses a model whose predictions do not match the data set's targets
  (an image model on token sequences, a sequence model on labels), before
  anything is built: one line naming --model."""
  name, dataset = s.model.model, s.data.dataset
  params = jax.eval_shape(model.init, jax.random.key(0))
  shapes = []
  for batch in (1, 3):  # one output per example, whatever the batch
    x = jnp.repeat(jnp.asarray(sample_x)[:1], batch, axis=0)
    try:
      shapes.append(jax.eval_shape(model.apply, params, x).shape)
    except Exception as e:  # the model cannot even read these inputs
      raise ConfigError(
        'model',
        f"--model={name} cannot read {dataset}'s inputs "
        f'{tuple(np.shape(sample_x)[1:])} in a batch of {batch}: '
        f'{type(e).__name__}',
      ) from None
  if any(len(o) < 1 or o[0] != b for o, b in zip(shapes, (1, 3))):
    raise ConfigError(
      'model',
      f'--model={name} gives outputs of shape {shapes[0]} for a batch of 1 '
      f'and {shapes[1]} for a batch of 3: its output must have one row per '
      'example of the batch (it mixes or drops the batch axis)',
    )
  if model.loss != 'cross_entropy':
    return
  out = shapes[0][1:]
  want = tuple(y_shape) + (num_classes,)
  if tuple(out) != want:
    kind = 'a sequence of targets' if len(y_shape) else 'one label'
    raise ConfigError(
      'model',
      f'--model={name} predicts {tuple(out)} per example, '
      f'{dataset} has {kind} per example ({want} expected): choose a '
      + (
        'sequence model (char_lstm, lstm_lm, transformer_lm)'
        if len(y_shape)
        else 'classifier (mlp, cnn, lenet5, ...)'
      ),
    )


def build_algorithms(
  s: RunSettings, model: Model, population: Population
) -> Tuple[Built, ...]:
  """Every algorithm, built before any trains, from the population's counts
  (the same in either layout): a bad setting fails here.

  Args:
    s: the run's settings.
    model: the model.
    population: the clients' example counts.

  Returns:
    One ``Built`` per algorithm (identities filled by ``identify``).

  Raises:
    ConfigError naming the setting.
  """
  made = []
  for a in s.algorithms:
    with user_reads.recording() as reads:
      alg = algorithms_lib.make(a.spec, a.training, a.config, model, population)
    reads = user_reads.so_far(('algorithm', a.spec.name), reads)
    made.append(Built(a, alg, reads=reads.record()))
  algs = tuple(made)
  if population.eval_only:
    for built in algs:
      _check_global_evaluation(s, built.alg, population.eval_only)
  return algs


def _check_global_evaluation(s: RunSettings, alg, held_out: int) -> None:
  """Held-out clients (``eval_only``) never train: personal or fine-tuned
  models would be reported untrained. Refused in one line, naming the data
  set's option that chose them (``DataOptions.held_out_choice``)."""
  models = jax.eval_shape(
    lambda k: alg.client_models(alg.init(k)), jax.random.key(0)
  )
  num_models = jax.tree.leaves(models.params)[0].shape[0]
  if (
    num_models != 1
    or alg.finetune is not None
    or alg.evaluate_client is not None
  ):
    how = (
      'fine-tunes on'
      if alg.finetune is not None
      else 'adapts to'
      if alg.evaluate_client is not None
      else 'evaluates personal models trained on'
    )
    flag, other = s.data.options.held_out_choice or (
      'dataset',
      'another data set',
    )
    raise ConfigError(
      flag,
      f"{alg.name} {how} each client's own training data; the "
      f'{held_out:,} held-out test clients have none: give --{flag}={other} '
      'or a global-model algorithm',
    )


def _state_bytes(alg: FederatedAlgorithm) -> Tuple[int, int]:
  """(the whole state's bytes, its client rows' bytes) from shapes alone."""
  shapes = jax.eval_shape(alg.init, jax.random.key(0))
  rows = (
    0 if alg.client_rows is None else tree_bytes(alg.client_rows.get(shapes))
  )
  return tree_bytes(shapes), rows


def _check_one_client_fits(
  s: RunSettings,
  loaded: LoadedData,
  algs: Tuple[Built, ...],
  sizes: Dict[str, Tuple[int, int]],
  free: Optional[int],
) -> None:
  """Refuses, before anything compiles, a round on the host that cannot
  fit even with one client at a time: the server's state beside one
  client's working copies of the model (``memory.MODEL_COPIES``) and the
  activations of one forward pass of its batch, all from shapes
  (``jax.eval_shape``), against the most the process could ever allocate
  (``placement.host_limit_bytes``: the machine's memory, ``ulimit -v``, a
  cgroup). XLA would otherwise try to allocate it, and a machine out of
  memory swaps or stalls rather than fail."""
  if free is None:
    return
  population = loaded.population
  widest = int(np.asarray(population.train.num_examples).max())
  for b in algs:
    model = b.alg.model
    model_bytes = tree_bytes(model.param_shapes())
    batch = b.alg.client_work.batching.effective_batch_size(widest)
    try:
      act = memory.activation_bytes(model, population.sample_x, batch)
    except Exception:  # noqa: BLE001 -- its own failure is reported elsewhere
      act = 0
    shared = sizes[b.alg.name][0] - sizes[b.alg.name][1]
    need = shared + memory.MODEL_COPIES * model_bytes + act
    if need > free:
      raise ConfigError(
        'model',
        f'--model={s.model.model} does not fit: a round of {b.alg.name} '
        f'needs at least {need / placement.GB:.1f} GB with one client at a '
        f'time (the model {model_bytes / placement.GB:.2f} GB, x'
        f'{memory.MODEL_COPIES} working copies, and its state and '
        f'activations), this process can have {free / placement.GB:.1f} GB at '
        "most (the machine's memory, ulimit -v): a smaller model or batch",
      )


def decide_layout(
  s: RunSettings, loaded: LoadedData, algs: Tuple[Built, ...]
) -> Layout:
  """The layout, decided once, before any data are placed: ``--layout`` (or
  ``auto``'s choice from the padded population's size, ``placement.choose``),
  then the memory plan from the algorithms' state sizes (``jax.eval_shape``):
  the padded population beside the largest state (times the configurations
  of a sweep, whose states the device layout stacks) must fit the
  accelerator's free memory, or on a CPU the available host memory beside
  the padded copy it is made from. When it cannot, ``auto`` takes the host
  layout (client rows with the population) and ``device`` is refused; in
  the host layout every configuration's client rows must fit the host, or
  go to files (``--client_state``). Several processes run on the device
  layout. Says the layout and the client rows' place.

  Args:
    s: the run's settings.
    loaded: the data.
    algs: the algorithms.

  Returns:
    The ``Layout``.

  Raises:
    ConfigError naming the setting, before anything is made.
  """
  engine, cap, store = s.engine, s.inputs.max_client_examples, loaded.store
  cfgs = s.configurations()
  num = len(cfgs) if cfgs is not None else 1
  times = f' x {num} configurations' if num > 1 else ''
  padded = store.padded_nbytes(cap)
  cpu = jax.default_backend() == 'cpu'
  # Measured once: the device's free memory, the host's available.
  device_free, host_free = (
    memory.device_free_bytes(),
    placement.host_available_bytes(),
  )
  free = device_free or (host_free if cpu else None)
  widest = int(np.asarray(loaded.population.train.num_examples).max())
  name, reason = placement.choose(engine.layout, padded, free, widest, cap)
  if name == 'host' and jax.process_count() > 1:
    # The padded population is made on the host, then put on the device: on
    # a CPU both copies share the host's memory.
    need = padded * (2 if cpu else 1)
    if free is not None and need > free:
      raise ConfigError(
        'num_processes',
        'several processes run on the device layout, where this '
        f'population padded to its widest client needs '
        f'{need / placement.GB:.1f} '
        f'GB, {free / placement.GB:.1f} GB free: run on one process (the host '
        'layout), or give --max_client_examples / --num_clients',
      )
    name, reason = 'device', 'several processes run on the device layout'
  sizes = {b.alg.name: _state_bytes(b.alg) for b in algs}
  if cpu and device_free is None:  # an accelerator plans its own (fitting)
    _check_one_client_fits(s, loaded, algs, sizes, placement.host_limit_bytes())
  if name == 'device':
    free, copies = device_free, 1
    if free is None and cpu:  # the device is the host
      free, copies = host_free, 2
    largest = max(sizes, key=lambda n: sizes[n][0])
    need = copies * padded + num * sizes[largest][0]
    if free is not None and need > free:
      what = (
        f"the padded population and {largest}'s state{times} need "
        f'{need / placement.GB:.2f} GB, {free / placement.GB:.1f} GB free'
      )
      if engine.layout == 'device' or jax.process_count() > 1:
        raise ConfigError(
          'layout',
          f'--layout=device: {what}; give --layout=host (one '
          'process) or fewer clients',
        )
      name, reason = 'host', f'auto: {what}; client rows on the host'
  say(f'layout: {name} ({reason})')
  if engine.client_state not in ('memory', 'auto') and name != 'host':
    raise ConfigError(
      'client_state',
      'keeps client rows in files in the host layout; this run '
      'is on the device layout (give --layout=host)',
    )
  if name != 'host':
    return Layout(name, reason)
  return Layout(
    name,
    reason,
    _rows_on_disk(
      s,
      {n: num * r for n, (_, r) in sizes.items() if r},
      num,
      times,
      host_free,
    ),
  )


def _rows_on_disk(
  s: RunSettings,
  rows: Dict[str, int],
  num: int,
  times: str,
  available: Optional[int],
) -> bool:
  """Whether the host layout's client rows (``rows``: bytes by algorithm,
  all configurations) go to files: asked for, or ``auto`` when the largest
  takes more than half the available memory; else every algorithm's must
  fit 90% of it (``available``: the host's available bytes, None:
  unknown). Says where each algorithm's rows are."""
  engine = s.engine
  most = max(rows.values(), default=0)
  why = ''
  on_disk = False
  if engine.client_state == 'disk' and rows:
    on_disk, why = True, 'asked for'
  elif (
    engine.client_state == 'auto'
    and available is not None
    and most > 0.5 * available
  ):
    on_disk = True
    why = (
      f'auto: {most / placement.GB:.1f} GB of rows, more than half of the '
      f'{available / placement.GB:.1f} GB available'
    )
  if on_disk:
    for name, nbytes in rows.items():
      say(
        f'  {name}: client rows{times} ({nbytes / placement.GB:.3f} GB if all '
        f'made) in files, '
        f'each written when its client first trains ({why})'
      )
    return True
  for name, nbytes in rows.items():
    if available is not None and nbytes > 0.9 * available:
      e = s.experiment
      flag = (
        'algorithm'
        if num == 1
        else 'sweep'
        if e.sweep
        else ('trials' if e.trials > 1 else 'sweep_seeds')
      )
      raise ConfigError(
        flag,
        f'{name} keeps {nbytes / placement.GB:.1f} GB of '
        f'client rows{times} in host memory, '
        f'{available / placement.GB:.1f} GB available: give fewer '
        'clients (--num_clients)'
        + (', fewer configurations' if num > 1 else '')
        + ' or a smaller model, or --client_state=disk',
      )
    say(
      f'  {name}: client rows{times} ({nbytes / placement.GB:.3f} GB) on the '
      f'host'
    )
  return False


def identify(
  s: RunSettings,
  loaded: LoadedData,
  mx: ModelAndExecutor,
  layout: Layout,
  algs: Tuple[Built, ...],
) -> Tuple[Built, ...]:
  """Every algorithm's run identity: the data's, the numerics the layout
  runs (the host layout's pooled evaluation runs a forward pass alone,
  ``Model.forward_only``, whose convolutions may be another implementation),
  its settings and weighting. Says the numerics.

  Args:
    s: the run's settings.
    loaded: the data.
    mx: the model and executor.
    layout: the layout.
    algs: the algorithms.

  Returns:
    The algorithms with their identities.
  """
  conv, precision = mx.conv, s.engine.matmul_precision
  forward = (
    conv
    and layout.name == 'host'
    and process.conv_impl_of(mx.model.forward_only(), mx.sample_x)
  ) or conv
  convolutions = ''
  if conv:
    why = (
      f'auto on {jax.default_backend()}'
      if getattr(mx.model.module, 'conv_impl', None) is not None
      else "the module's own"
    ) + (f'; a forward pass alone {forward}' if forward != conv else '')
    convolutions = f'; convolutions {conv}' + (
      f' ({why})' if s.model.conv_impl == 'auto' else ''
    )
  say(
    'numerics: matmul precision '
    + numerics.effective_matmul(precision)
    + convolutions
  )
  shared = {
    **loaded.identity,
    'numerics': numerics.record(precision, conv, forward),
    **_read_by('model_reads', mx.model.reads),
  }
  weighted = s.client_weights()
  return tuple(
    dataclasses.replace(
      b,
      identity={
        **run_identity.identity(
          b.settings.name, b.settings.training, b.settings.config, shared
        ),
        **(
          {'weighting': weighted[b.settings.name]}
          if b.settings.name in weighted
          else {}
        ),
        **_read_by('algorithm_reads', b.reads),
      },
    )
    for b in algs
  )


def _read_by(key: str, reads: Optional[Dict[str, Any]]) -> Dict[str, Any]:
  """``{key: reads}`` when a user's code read anything (files, variables),
  else nothing (identities of runs that read nothing stay as they were)."""
  return {key: reads} if reads and any(reads.values()) else {}


def place_data(
  loaded: LoadedData,
  layout: Layout,
  cap: Optional[int],
  rows_folder: Optional[str] = None,
):
  """The data in the layout: the padded population on the device, or the
  store read by each round's cohort (its client rows in ``rows_folder``
  when they go to files).

  Args:
    loaded: the data.
    layout: the layout.
    cap: ``--max_client_examples``.
    rows_folder: where the host layout's client rows go in files, or None.

  Returns:
    A ``FederatedData`` on the device, or the ``HostData``.
  """
  if layout.name == 'device':
    return to_device(loaded.store.padded(cap))
  return HostData(loaded.store, cap, rows_folder=rows_folder)


def prepared_system(
  s: RunSettings, num_clients: int
) -> system_lib.ClientSystem:
  """The clients' devices with their files read once (speeds, availability).

  Args:
    s: the run's settings.
    num_clients: N.

  Returns:
    The ``ClientSystem``.

  Raises:
    ConfigError naming the setting whose file does not fit the population.
  """
  try:
    return system_lib.prepare(s.system, num_clients)
  except SettingError as e:
    raise as_flag_error(e) from None
