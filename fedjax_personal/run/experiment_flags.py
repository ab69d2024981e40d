"""The command's flags: generated from the settings' declarations, read once.

Every flag of ``scripts/run_experiment.py`` is a field of a settings class
declared next to what it configures (``hparam``): the run's own
(``run/settings.py``), the data set's (``datasets.DataConfig`` and each
data set's options), the model's, the engine's, the processes', the shared
training settings and each algorithm's (``--<prefix>_*``).
``script_entry.define_settings_flags`` makes a class's flags (every script
declares its flags this way); ``read`` turns the parsed flags into one
``RunSettings``, resolving the main job's defaults once and checking what
depends on several classes, and the entry (``run/experiment_entry.py``) passes it down.
"""

import dataclasses
import os
from typing import Dict, FrozenSet, List, Optional, Tuple

from absl import flags

from fedjax_personal import algorithms as algorithms_lib
from fedjax_personal import models as models_lib
from fedjax_personal import numerics
from fedjax_personal.config import TrainingConfig
from fedjax_personal.core.engine import EngineConfig
from fedjax_personal.core.system import SystemConfig
from fedjax_personal.datasets import (
  DataConfig,
  check_given,
  is_natural,
  registry,
  streams_to_store,
)
from fedjax_personal.datasets import config as data_config_lib
from fedjax_personal.errors import ConfigError
from fedjax_personal.hparams import (
  claim_flags,
  field_types,
  fill_from_run,
  flag_fields,
  flag_name,
  is_list,
  validate,
)
from fedjax_personal.models import ModelConfig
from fedjax_personal.run import sweep
from fedjax_personal.run.distributed import DistributedSettings
from fedjax_personal.run.script_entry import define_settings_flags
from fedjax_personal.run.settings import (
  AlgorithmSettings,
  ExperimentSettings,
  InputSettings,
  OutputSettings,
  ProcessSettings,
  RunSettings,
)

__all__ = [
  'algorithm_group',
  'define_flags',
  'DEFAULT_VAL_FRACTION',
  'FLAGS',
  'MAIN_JOB_DEFAULTS',
  'read',
  'register',
  'RUN_SETTINGS',
  'SHARED_FLAGS_MODULE',
]

# where the flags are declared; read by the entry alone (``read``)
FLAGS = flags.FLAGS

#: The run's settings classes and their ``--helpfull`` groups, in the order
#: the help lists them; every flag of the command but the training,
#: algorithm and data set option settings is a field of one of these.
RUN_SETTINGS = (
  (ExperimentSettings, 'fedjax_personal: the experiment'),
  (DataConfig, 'fedjax_personal: the data set (datasets.DataConfig)'),
  (InputSettings, 'fedjax_personal: what the run reads of its data'),
  (ModelConfig, 'fedjax_personal: the model (models.ModelConfig)'),
  (EngineConfig, 'fedjax_personal: the engine (core.engine.EngineConfig)'),
  (
    SystemConfig,
    'fedjax_personal: clients as devices (core.system.SystemConfig)',
  ),
  (ProcessSettings, 'fedjax_personal: the process (compilation cache)'),
  (OutputSettings, 'fedjax_personal: outputs, checkpoints, resuming'),
  (DistributedSettings, 'fedjax_personal: several processes'),
)

for (
  _cls,
  _group,
) in RUN_SETTINGS:
  # every option after them is refused its flags
  claim_flags(_cls, f'a setting of the run ({_cls.__name__})')

#: The main job's defaults where they are not the library's: the command
#: shows personalization on 40 rotated clients (``DataConfig()`` is 20
#: Dirichlet clients); its data seed and validation share follow from
#: --seed and the algorithms when not given (``read``).
MAIN_JOB_DEFAULTS = {
  'partition': 'rotation',
  'num_clients': 40,
  'data_seed': None,
  'val_fraction': None,
}
#: The validation share when an algorithm needs one and --val_fraction is not
#: given.
DEFAULT_VAL_FRACTION = 0.1
SHARED_FLAGS_MODULE = (
  'fedjax_personal: shared training settings (every algorithm)'
)


def algorithm_group(cls) -> str:
  """The ``--helpfull`` group of an algorithm's settings class: the
  algorithms using it.

  Args:
    cls: a settings class.

  Returns:
    The group's name.
  """
  users = [n for n, s in algorithms_lib.REGISTRY.items() if s.config is cls]
  return f'fedjax_personal: --{cls.prefix}_* settings of ' + ', '.join(users)


def _options_group(cls) -> str:
  users = [n for n, c in registry.OPTIONS.items() if c is cls]
  return 'fedjax_personal: options of --dataset=' + ', '.join(users)


def _model_options_group(cls) -> str:
  users = [n for n, e in models_lib.REGISTERED.items() if e.options is cls]
  return 'fedjax_personal: options of --model=' + ', '.join(users)


def _model_config(fl: '_Flags') -> ModelConfig:
  """The model as the flags give it, with its registered options; an option
  of another model is refused."""
  model = fl.values['model']
  own = models_lib.options_class(model)
  for cls in models_lib.option_classes():
    if cls is own:
      continue
    for f in flag_fields(cls):
      flag = flag_name(cls, f.name)
      if flag in fl.given and flag not in {
        flag_name(own, g.name) for g in flag_fields(own)
      }:
        users = [
          n for n, e in models_lib.REGISTERED.items() if e.options is cls
        ]
        raise ConfigError(
          flag,
          f'an option of --model={"/".join(users)}, not of --model={model}',
        )
  return fl.make(ModelConfig, options=fl.make(own))


def define_flags(flag_values: Optional[flags.FlagValues] = None) -> None:
  """The command's flags: the run's settings classes, the shared training
  settings, every registered algorithm's and data set's options (those
  registered since the last call included; ``script_entry.parse_flags``
  calls it before parsing).

  Args:
    flag_values: where to define them (default: absl's ``FLAGS``).

  Returns:
    None.
  """
  for cls, group in RUN_SETTINGS:
    define_settings_flags(cls, group, MAIN_JOB_DEFAULTS, flag_values)
  for options in registry.option_classes():
    define_settings_flags(options, _options_group(options), None, flag_values)
  for options in models_lib.option_classes():
    define_settings_flags(
      options, _model_options_group(options), None, flag_values
    )
  define_settings_flags(TrainingConfig, SHARED_FLAGS_MODULE, None, flag_values)
  for config in algorithms_lib.config_classes():
    define_settings_flags(config, algorithm_group(config), None, flag_values)


def register(spec) -> None:
  """Adds an algorithm defined outside the package (``AlgorithmSpec``) to
  the registry and defines its config's ``--<prefix>_*`` flags, before the
  flags are parsed (docs/add_an_algorithm.md): ``--algorithm=<its name>``
  then works as for a built-in one.

  Args:
    spec: the algorithm's ``AlgorithmSpec``.

  Returns:
    None.
  """
  algorithms_lib.register(spec)
  define_flags()


class _Flags:
  """The parsed flags while ``read`` makes the settings.

  Each class made
  from its fields' flags (checked when made), and which flags were given."""

  def __init__(self, flag_values: flags.FlagValues):
    self.values = flag_values.flag_values_dict()
    self.given: FrozenSet[str] = frozenset(
      n for n in self.values if flag_values[n].present
    )
    self.own = sorted(
      f.name
      for module, fl in flag_values.flags_by_module_dict().items()
      if not module.startswith('absl')
      for f in fl
    )

  def fields(self, cls) -> dict:
    """{field: value} of ``cls``'s fields that have a flag (comma lists as
    tuples)."""
    types = field_types(cls)
    out = {}
    for f in flag_fields(cls):
      v = self.values[flag_name(cls, f.name)]
      out[f.name] = tuple(v) if is_list(types[f.name]) and v is not None else v
    return out

  def make(self, cls, **resolved):
    """``cls`` from its flags, with ``resolved`` fields replacing theirs."""
    return cls(**{**self.fields(cls), **resolved})


def read(flag_values: Optional[flags.FlagValues] = None) -> RunSettings:
  """The ``RunSettings`` of parsed flags (absl's ``FLAGS`` after parsing):
  each settings class made from its flags and checked (``Declared``), the
  main job's defaults resolved (the data seed, partition, clients,
  validation share, matmul precision), what depends on several classes
  checked, each algorithm's settings resolved.

  Args:
    flag_values: an absl ``FlagValues``, parsed (default: ``FLAGS``).

  Returns:
    The ``RunSettings``.

  Raises:
    ConfigError naming the first flag that cannot apply.
  """
  fl = _Flags(FLAGS if flag_values is None else flag_values)
  experiment = fl.make(ExperimentSettings)
  data = _data_config(fl, experiment)
  check_given(data, fl.given)
  inputs = fl.make(InputSettings)
  for flag, what in (('rebuild_store', 'rebuilds'), ('verify_store', 'checks')):
    if getattr(inputs, flag) and not streams_to_store(data):
      raise ConfigError(
        flag,
        f'{what} the population store of a data set read from its files; '
        f'{data.dataset} ({data.partition}) is built in memory every run',
      )
  precision = fl.values['matmul_precision']
  # the user's choice for JAX, else the package's
  if 'matmul_precision' not in fl.given:
    precision = os.environ.get('JAX_DEFAULT_MATMUL_PRECISION') or precision
  engine = fl.make(EngineConfig, matmul_precision=numerics.canonical(precision))
  swept = _sweep(fl, experiment.sweep)
  algorithms = resolve_algorithms(fl, experiment, swept)
  if 'dp_delta' in fl.given and not any(
    hasattr(a.config, 'dp') and a.config.dp() is not None for a in algorithms
  ):
    raise ConfigError(
      'dp_delta',
      'does nothing: no requested algorithm runs DP-SGD '
      '(--fedfomo_dp_clip_norm > 0)',
    )
  system = fl.make(SystemConfig)
  if experiment.cohort_sampler == 'tff' and (
    system.availability < 1 or system.availability_trace
  ):
    raise ConfigError(
      'availability' if system.availability < 1 else 'availability_trace',
      'does nothing with --cohort_sampler=tff (its schedule draws every '
      'client)',
    )
  for a in algorithms:
    for setting, problem in system.problems(a.training.batching())[:1]:
      raise ConfigError(setting, f'{a.spec.name}: {problem}')
  return RunSettings(
    experiment=experiment,
    data=data,
    inputs=inputs,
    model=_model_config(fl),
    engine=engine,
    process=fl.make(ProcessSettings),
    output=fl.make(OutputSettings),
    distributed=fl.make(DistributedSettings),
    algorithms=algorithms,
    system=system,
    sweep=swept,
    flags={name: fl.values[name] for name in fl.own},
  )


def _data_config(fl: _Flags, experiment: ExperimentSettings) -> DataConfig:
  """The data set as the flags give it, with the main job's defaults: a
  natural data set's own partition and all of its clients, the data seed
  from --seed, a validation share when an algorithm needs one."""
  dataset = fl.values['dataset']
  options_cls = registry.options_class(dataset)
  options = options_cls(
    **{
      field: fl.values[flag]
      for flag, field in data_config_lib.option_flags(options_cls).items()
    }
  )
  partition = fl.values['partition']
  if 'partition' not in fl.given and is_natural(dataset, 'natural'):
    partition = 'natural'
  num_clients = fl.values['num_clients']
  if (
    'num_clients' not in fl.given
    and partition == 'natural'
    and registry.is_file_dataset(dataset)
  ):
    num_clients = None
  seed = (
    experiment.seed
    if fl.values['data_seed'] is None
    else fl.values['data_seed']
  )
  val = fl.values['val_fraction']
  if val is None:
    needs = any(
      algorithms_lib.REGISTRY[n].needs_validation for n in experiment.algorithm
    )
    val = DEFAULT_VAL_FRACTION if needs else 0.0
  return fl.make(
    DataConfig,
    partition=partition,
    num_clients=num_clients,
    seed=seed,
    val_fraction=val,
    options=options,
  )


def _sweep(fl: _Flags, spec: str) -> Dict[str, Tuple[float, ...]]:
  """--sweep's values by flag, each checked against its declaration."""
  if not spec:
    return {}
  names = sweep.sweepable()
  try:
    swept = sweep.parse_sweep(spec, names)
  except ValueError as e:
    raise ConfigError('sweep', str(e)) from None
  for name, values in swept.items():
    if name in fl.given:  # which would the run use? neither silently
      raise ConfigError(
        name,
        f'given beside --sweep of {name}; give its values in --sweep alone',
      )
    cls, field = names[name]
    for v in values:
      try:
        validate(dataclasses.replace(cls(), **{field: v}))
      except ConfigError as e:
        raise ConfigError('sweep', f'{name}={v:g}: {e}') from None
  return {k: tuple(v) for k, v in swept.items()}


def _given_fields(fl: _Flags, cls, swept=()) -> List[str]:
  """Fields of ``cls`` whose flag was given (on the command line or in a
  flagfile, even at its default), differs from its default, or is swept."""
  return [
    f.name
    for f in dataclasses.fields(cls)
    if flag_name(cls, f.name) in swept
    or flag_name(cls, f.name) in fl.given
    or (
      flag_name(cls, f.name) in fl.values
      and fl.values[flag_name(cls, f.name)] != f.default
    )
  ]


def resolve_algorithms(
  fl: _Flags, experiment: ExperimentSettings, swept
) -> Tuple[AlgorithmSettings, ...]:
  """Each algorithm of the run with the settings it runs with.

  A setting given (or swept) that applies to none of the algorithms is
  refused; one that applies to some is reset to its default for the others,
  which print a note (and record it as ``ignored_settings``).

  Args:
    fl: the parsed flags.
    experiment: the experiment (its algorithms and rounds).
    swept: the swept settings' flags.

  Returns:
    The ``AlgorithmSettings``, in the order of --algorithm.

  Raises:
    ConfigError naming the flag.
  """
  names = experiment.algorithm
  fields = fl.fields(TrainingConfig)
  if (
    fields['client_lr_schedule'] == 'linear'
    and fields['client_lr_horizon'] is None
  ):
    # the 'linear' schedule spans --rounds
    fields['client_lr_horizon'] = experiment.rounds
  training = TrainingConfig(**fields)
  configs = {cls: fl.make(cls) for cls in algorithms_lib.config_classes()}
  specs = [algorithms_lib.spec(n) for n in names]
  for s in specs:  # what the run's own algorithms take from the run
    if s.config in configs:
      configs[s.config] = fill_from_run(configs[s.config], experiment)
  ignored: Dict[str, List[str]] = {s.name: [] for s in specs}
  for name in _given_fields(fl, TrainingConfig, swept):
    unused = {
      s.name: name in s.inapplicable(training)
      or (name in swept and name not in s.uses)
      for s in specs
    }
    if all(unused.values()):
      if len(specs) == 1:
        specs[0].validate(
          training, configs.get(specs[0].config) or specs[0].config()
        )
      raise ConfigError(name, f'does nothing for {", ".join(names)}')
    for s in specs:
      if unused[s.name]:
        ignored[s.name].append(name)
  for cls in configs:
    for field in _given_fields(fl, cls, swept):
      flag = flag_name(cls, field)
      users = [s for s in specs if s.config is cls and field not in s.ignores]
      if not users:
        owners = [
          n
          for n, s in algorithms_lib.REGISTRY.items()
          if s.config is cls and field not in s.ignores
        ]
        raise ConfigError(
          flag,
          f'applies to {", ".join(owners)}, not to '
          f'--algorithm={",".join(names)}',
        )
      for s in specs:
        if s.config is cls and s not in users:
          ignored[s.name].append(flag)
  out = []
  defaults = TrainingConfig()
  for s in specs:
    t = dataclasses.replace(
      training,
      **{
        n: getattr(defaults, n) for n in ignored[s.name] if hasattr(defaults, n)
      },
    )
    own = configs.get(s.config) or s.config()
    own_default = s.config()
    cfg = dataclasses.replace(
      own, **{f: getattr(own_default, f) for f in s.ignores}
    )
    settings = AlgorithmSettings(s, t, cfg, tuple(ignored[s.name]))
    if ignored[s.name]:
      print(
        f'note: {s.name} does not use '
        + ', '.join('--' + n for n in ignored[s.name])
      )
    out.append(settings)
  return tuple(out)


define_flags()
