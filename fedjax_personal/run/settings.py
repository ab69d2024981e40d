"""What the flags of ``scripts/run_experiment.py`` (declared in
``run/command_flags.py``) make, from a ``Settings`` the entry reads once:
the shared and per-algorithm settings (declared once in the config classes),
their validation, the data configuration, the sampler, the run identity.
``run/main_job.py`` runs the main job from them; ``run/cli.py`` is the entry.
"""


import dataclasses
import os
import types
from typing import Any, Dict, FrozenSet, List, Mapping, NamedTuple

import jax

from fedjax_personal import algorithms as algorithms_lib
from fedjax_personal import datasets as datasets_lib
from fedjax_personal.run import run_identity
from fedjax_personal.run.command_flags import FLAGS, RUN_SETTINGS, register  # noqa: F401
from fedjax_personal.config import TrainingConfig
from fedjax_personal.hparams import flag_fields, flag_name, validate
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import MODELS
from fedjax_personal.core.sampling import CohortSampler

__all__ = ['check', 'data_config', 'default_output_dir', 'DEFAULT_VAL_FRACTION', 'Flag', 'FLAGS',
           'job_identity', 'num_clients', 'partition', 'process_flags', 'read', 'register',
           'resolve_algorithm_settings', 'row_label', 'sampler_for', 'Settings', 'sweep_configs',
           'sweepable', 'training_config', 'UsageError', 'val_fraction', 'validate_flags']


class Flag(NamedTuple):
  """One flag of a ``Settings``: its value, and whether the command gave it."""
  value: Any
  present: bool


@dataclasses.dataclass(frozen=True)
class Settings:
  """The command's settings, read once from the parsed flags by the entry
  (``run/cli.py``, ``read``) and passed down: the library reads no flag
  itself. ``opts.rounds`` is a value; ``opts['rounds']`` a ``Flag`` (with
  ``present``: given on the command line or in a flagfile).

  Attributes:
    values: every flag's value by name.
    given: the names the command gave.
    own: this library's flags (absl's own left out).
  """
  values: Mapping[str, Any]
  given: FrozenSet[str] = frozenset()
  own: FrozenSet[str] = frozenset()

  def __getattr__(self, name: str):
    try:
      return self.__dict__['values'][name]
    except KeyError:
      raise AttributeError(f'no flag --{name}') from None

  def __getitem__(self, name: str) -> Flag:
    return Flag(self.values[name], name in self.given)

  def __contains__(self, name: str) -> bool:
    return name in self.values

  def flag_values_dict(self) -> Dict[str, Any]:
    """Every flag's value, as absl's ``FlagValues.flag_values_dict``."""
    return dict(self.values)

  def of(self, cls):
    """The settings class ``cls`` (``hparam`` fields) as the flags give it:
    ``opts.of(EngineSettings).layout``.

    Args:
      cls: a settings dataclass whose flags were defined.

    Returns:
      Its instance (the main job's defaults where a flag was not given; a
      field without a flag keeps its default).
    """
    return cls(**{f.name: self.values[flag_name(cls, f.name)] for f in flag_fields(cls)})


def read(flag_values) -> Settings:
  """The settings of parsed absl flags (``flags.FLAGS`` after parsing), each
  of the run's settings classes checked against its declarations (the
  training and algorithm settings are checked with the algorithms, by
  ``resolve_algorithm_settings``).

  Args:
    flag_values: an absl ``FlagValues``, parsed.

  Returns:
    Their ``Settings``: values, the names given, this library's names.

  Raises:
    ConfigError naming the first flag out of its declared range.
  """
  values = flag_values.flag_values_dict()
  own = frozenset(f.name for module, fl in flag_values.flags_by_module_dict().items()
                  if not module.startswith('absl') for f in fl)
  opts = Settings(types.MappingProxyType(values),
                  frozenset(n for n in values if flag_values[n].present), own)
  for cls, _ in RUN_SETTINGS:
    validate(opts.of(cls))
  return opts

#: The one error type of bad settings (the scripts exit with status 2).
UsageError = ConfigError


def check(cond, flag, msg):
  """Raises ``ConfigError(flag, msg)`` unless ``cond``.

  Args:
    cond: what must hold.
    flag: the flag named if not.
    msg: what is wrong.

  Returns:
    None.
  """
  if not cond:
    raise ConfigError(flag, msg)


def training_config(opts: Settings) -> TrainingConfig:
  """The shared settings from their flags; the 'linear' client-rate
  schedule spans --rounds unless --client_lr_horizon says otherwise.

  Args:
    opts: the command's ``Settings``.

  Returns:
    The ``TrainingConfig``.
  """
  cfg = opts.of(TrainingConfig)
  if cfg.client_lr_schedule == 'linear' and cfg.client_lr_horizon is None:
    cfg = dataclasses.replace(cfg, client_lr_horizon=opts.rounds)
  return cfg


def sweepable() -> Dict[str, tuple]:
  """{flag name: (config class, field)} of the settings ``--sweep`` accepts.

  Returns:
    ``{flag: (class, field)}``.
  """
  out = {}
  for cls in [TrainingConfig] + algorithms_lib.config_classes():
    for f in dataclasses.fields(cls):
      if f.metadata.get('sweep'):
        out[flag_name(cls, f.name)] = (cls, f.name)
  return out


def given_fields(opts: Settings, cls, swept=()) -> List[str]:
  """Fields of ``cls`` whose flag differs from its default (or is swept)."""
  return [f.name for f in dataclasses.fields(cls)
          if opts[flag_name(cls, f.name)].value != f.default or flag_name(cls, f.name) in swept]


def resolve_algorithm_settings(opts: Settings, names, swept=()):
  """Per algorithm of ``names``: (spec, TrainingConfig, own config, ignored
  flags).

  A setting given (or swept) that applies to none of the algorithms is
  refused; one that applies to some is reset to its default for the others,
  which print a note (and record it as ``ignored_settings``).

  Args:
    opts: the command's ``Settings``.
    names: the algorithms' names.
    swept: the swept settings' flags.

  Returns:
    ``[(spec, training, config, ignored flags)]``.

  Raises:
    ConfigError naming the flag.
  """
  training = training_config(opts)
  validate(training)
  for cls in algorithms_lib.config_classes():
    validate(opts.of(cls))
  training.check()
  specs = [algorithms_lib.spec(n) for n in names]
  ignored = {s.name: [] for s in specs}
  for name in given_fields(opts, TrainingConfig, swept):
    unused = {s.name: name in s.inapplicable(training) or (name in swept and name not in s.uses)
              for s in specs}
    if all(unused.values()):
      if len(specs) == 1:
        specs[0].validate(training, opts.of(specs[0].config))  # its own reason
      raise ConfigError(name, f'does nothing for {", ".join(names)}')
    for s in specs:
      if unused[s.name]:
        ignored[s.name].append(name)
  for cls in algorithms_lib.config_classes():
    for field in given_fields(opts, cls, swept):
      flag = flag_name(cls, field)
      users = [s for s in specs if s.config is cls and field not in s.ignores]
      if not users:
        owners = [n for n, s in algorithms_lib.REGISTRY.items()
                  if s.config is cls and field not in s.ignores]
        raise ConfigError(flag, f'applies to {", ".join(owners)}, not to '
                          f'--algorithm={",".join(names)}')
      for s in specs:
        if s.config is cls and s not in users:
          ignored[s.name].append(flag)
  out = []
  defaults = TrainingConfig()
  for s in specs:
    t = dataclasses.replace(training, **{n: getattr(defaults, n) for n in ignored[s.name]
                                         if hasattr(defaults, n)})
    own_default = s.config()
    cfg = dataclasses.replace(opts.of(s.config),
                              **{f: getattr(own_default, f) for f in s.ignores})
    s.validate(t, cfg)
    if ignored[s.name]:
      print(f'note: {s.name} does not use ' + ', '.join('--' + n for n in ignored[s.name]))
    out.append((s, t, cfg, ignored[s.name]))
  return out


def validate_flags(opts: Settings):
  """Checks what the flags' declarations cannot (each flag's own range is
  checked from its declaration when the flags are read, ``read``): known
  names, settings that do nothing for the data set or algorithms given,
  settings that depend on each other. The hyperparameters are checked by
  ``resolve_algorithm_settings``.

  Args:
    opts: the command's ``Settings``.

  Returns:
    ``resolve_algorithm_settings``' list, for the algorithms asked for.
  """
  check(opts.algorithm, 'algorithm', 'give at least one algorithm')
  for a in opts.algorithm:
    check(a in algorithms_lib.REGISTRY, 'algorithm',
           f'unknown algorithm {a!r}; choose from {list(algorithms_lib.REGISTRY)}')
  check(opts.model in MODELS, 'model', f'unknown model {opts.model!r}; choose from {sorted(MODELS)}')
  check(datasets_lib.is_known(opts.dataset), 'dataset',
         f'unknown dataset {opts.dataset!r}; choose from {list(datasets_lib.DATASETS)} or leaf:<name>')
  check(opts.dataset != 'stackoverflow_held_out', 'dataset',
        'stackoverflow_held_out holds held-out users only, none to train (the held_out value of '
        'datasets.stackoverflow.load_data); train on --dataset=stackoverflow')
  datasets_lib.local_files.check_data_dir(opts.data_dir)
  check(not opts.data_dir or opts.dataset not in datasets_lib.NO_FILES, 'data_dir',
         f'does nothing: dataset {opts.dataset} reads no file')
  check(not opts.download or opts.dataset not in datasets_lib.NO_FILES + ('mnist',)
         and not opts.dataset.startswith('tfds:'), 'download',
         f'does nothing: dataset {opts.dataset} has no file to download'
         + (' (TFDS data sets: load_tfds(name, download=True))' if opts.dataset.startswith('tfds:')
            else ''))
  check(not (opts['test_fraction'].present
              and datasets_lib.has_own_test_split(opts.dataset, partition(opts),
                                                  opts.cifar100_test)),
         'test_fraction', f'does nothing: {opts.dataset} has its own test split in its files')
  check(partition(opts) in datasets_lib.PARTITIONS, 'partition',
         f'unknown partition {partition(opts)!r}; choose from {list(datasets_lib.PARTITIONS)}')
  check(opts.cohort_size is None or opts.participation is None, 'participation',
         'give either --cohort_size or --participation, not both')
  if opts.cohort_size is not None and num_clients(opts) is not None:
    check(1 <= opts.cohort_size <= opts.num_clients, 'cohort_size',
           f'must be in [1, num_clients={opts.num_clients}], got {opts.cohort_size}')
  check(opts.trials == 1 or not opts.sweep_seeds, 'trials',
         'give --trials (mean ± std rows) or --sweep_seeds (one row per seed), not both')
  check(not opts['stackoverflow_accuracy'].present or opts.dataset == 'stackoverflow',
         'stackoverflow_accuracy', f'defines the Stack Overflow accuracy; --dataset='
         f'{opts.dataset} has no words to score')
  check(not opts['cifar100_test'].present
         or (opts.dataset == 'cifar100' and partition(opts) == 'natural'), 'cifar100_test',
         f'chooses the natural CIFAR-100\'s test clients; --dataset={opts.dataset} '
         f'--partition={partition(opts)} has none')
  check(opts.cifar100_preprocess == 'none' or opts.dataset == 'cifar100', 'cifar100_preprocess',
        f'crops and standardizes CIFAR-100\'s images; --dataset={opts.dataset} is not CIFAR-100')
  check(not opts['stackoverflow_test'].present or opts.dataset == 'stackoverflow',
        'stackoverflow_test', f'chooses Stack Overflow\'s test set; --dataset={opts.dataset} '
        'is not Stack Overflow')
  check(not opts['shakespeare_windows'].present or opts.dataset == 'shakespeare',
        'shakespeare_windows', f'cuts Shakespeare\'s snippets; --dataset={opts.dataset} has none')
  check(not opts['emnist_pixels'].present or opts.dataset in ('emnist', 'emnist_digits'),
        'emnist_pixels', f'sets EMNIST\'s pixel convention; --dataset={opts.dataset} is not '
        'EMNIST from its FedJAX files')
  check(opts.vocab_size is None or opts.dataset == 'stackoverflow', 'vocab_size',
         f'sets the Stack Overflow vocabulary; --dataset={opts.dataset} has none to set')
  check(opts.image_size is None or opts.dataset == 'gldv2', 'image_size',
         f'sets the GLDv2 image size; --dataset={opts.dataset} has its images at their size')
  check(opts.seq_len is None or opts.dataset in datasets_lib.TEXT_DATASETS, 'seq_len',
        f'sets the rows\' length of a text data set; --dataset={opts.dataset} has none')
  check(not opts['synthetic_beta'].present or opts.dataset == 'synthetic', 'synthetic_beta',
        f'sets the heterogeneity of --dataset=synthetic, not of {opts.dataset}')
  check(opts.test_fraction + val_fraction(opts) < 1, 'val_fraction',
         'test_fraction + val_fraction must be < 1')
  check(opts.latent_features in datasets_lib.LATENT_FEATURES, 'latent_features',
         f'unknown value {opts.latent_features!r}; choose from {list(datasets_lib.LATENT_FEATURES)}')
  check(not opts['latent_features'].present or partition(opts) == 'latent_clusters',
         'latent_features', 'applies to --partition=latent_clusters, not '
         f'{partition(opts)!r}')
  check(not (opts.init_weights and opts['model_init'].present), 'model_init',
         'does nothing with --init_weights (the file gives every initial weight)')
  if opts.init_weights:
    check(os.path.isfile(opts.init_weights), 'init_weights',
           f'{opts.init_weights}: no such file')
  swept = {}
  if opts.sweep:
    from fedjax_personal.run import sweep
    try:
      swept = sweep.parse_sweep(opts.sweep, sweepable())
    except ValueError as e:
      raise ConfigError('sweep', str(e)) from None
    for name, values in swept.items():
      cls, field = sweepable()[name]
      for v in values:
        try:
          validate(dataclasses.replace(cls(), **{field: v}))
        except ConfigError as e:
          raise ConfigError('sweep', f'{name}={v:g}: {e}') from None
  return resolve_algorithm_settings(opts, opts.algorithm, swept)


DEFAULT_VAL_FRACTION = 0.1


def val_fraction(opts: Settings) -> float:
  """--val_fraction, or by default 0.1 when a requested algorithm needs a
  validation split (FedFomo) and 0 otherwise (no training data held out for
  nothing).

  Args:
    opts: the command's ``Settings``.

  Returns:
    The validation share.
  """
  if opts.val_fraction is not None:
    return opts.val_fraction
  needs = any(algorithms_lib.REGISTRY[n].needs_validation for n in opts.algorithm
              if n in algorithms_lib.REGISTRY)
  return DEFAULT_VAL_FRACTION if needs else 0.0


def data_config(opts: Settings) -> datasets_lib.DataConfig:
  """The ``DataConfig`` the flags describe.

  Args:
    opts: the command's ``Settings``.

  Returns:
    The ``DataConfig``.
  """
  return dataclasses.replace(
      opts.of(datasets_lib.DataConfig), partition=partition(opts),
      num_clients=num_clients(opts), seed=opts.seed if opts.data_seed is None else opts.data_seed,
      val_fraction=val_fraction(opts))


def partition(opts: Settings) -> str:
  """--partition, or 'natural' for a natural data set when it is not given.

  Args:
    opts: the command's ``Settings``.

  Returns:
    The partition's name.
  """
  if not opts['partition'].present and datasets_lib.is_natural(opts.dataset, 'natural'):
    return 'natural'
  return opts.partition


def num_clients(opts: Settings):
  """--num_clients; None (all clients) for a natural data set read from
  files when it is not given.

  Args:
    opts: the command's ``Settings``.

  Returns:
    N, or None.
  """
  if (not opts['num_clients'].present and partition(opts) == 'natural'
      and datasets_lib.readers.is_file_dataset(opts.dataset)):
    return None
  return opts.num_clients


def sampler_for(opts: Settings, data) -> CohortSampler:
  """The cohort sampler of ``data`` (a FederatedData or HostData): its
  clients that train (all but the ``eval_only`` last) are drawn.

  Args:
    opts: the command's ``Settings``.
    data: the federated data.

  Returns:
    The ``CohortSampler``.
  """
  n, trained = data.num_clients, data.num_trained
  eligible = None if trained == n else trained
  if opts.participation is not None:
    return CohortSampler(n, participation=opts.participation, eligible=eligible)
  return CohortSampler(n, cohort_size=opts.cohort_size or trained, eligible=eligible)


def job_identity(opts: Settings, fingerprint: str, cap=None) -> dict:
  """What every algorithm of the job shares in its run identity:
  ``fingerprint`` is the data's (``run_identity.data_fingerprint`` of the
  padded arrays, or a population store's digest); the cap on examples per
  client when given.

  Args:
    opts: the command's ``Settings``.
    fingerprint: the data's fingerprint.
    cap: ``--max_client_examples`` (None: no cap).

  Returns:
    The shared identity entries.
  """
  data = data_config(opts)
  cfg = dataclasses.asdict(data)
  if cap is not None:
    cfg['max_client_examples'] = cap
  cfg.pop('data_dir')  # where the files are does not matter; their content does
  cfg.pop('download')
  cfg['seq_len'] = data.sequence_length  # as before seq_len could be None
  for field in ('vocab_size', 'image_size'):
    if cfg[field] is None:  # not given: earlier runs keep their identity
      cfg.pop(field)
  if cfg['cifar100_test'] == 'split':  # the default before the field existed
    cfg.pop('cifar100_test')
  for field in ('shakespeare_windows', 'emnist_pixels'):
    if cfg[field] == 'fedjax':  # the default before the field existed
      cfg.pop(field)
  if cfg['stackoverflow_test'] == 'train_users':  # the default before the field existed
    cfg.pop('stackoverflow_test')
  if cfg['latent_features'] == 'pixels':  # the default before the field existed:
    cfg.pop('latent_features')            # earlier runs keep their identity
  return {'data': cfg, 'data_fingerprint': fingerprint,
          'model': opts.model, 'adapter_dim': opts.adapter_dim,
          'cohort_size': opts.cohort_size, 'participation': opts.participation,
          'seed': opts.seed, **model_start(opts),
          **({'accuracy': opts.stackoverflow_accuracy}
             if opts.dataset == 'stackoverflow' and opts.stackoverflow_accuracy != 'in_vocab'
             else {}),
          **({'num_processes': jax.process_count()} if jax.process_count() > 1 else {})}


def model_start(opts: Settings) -> dict:
  """How the model's first weights are drawn, in the run identity: the
  convention when not Flax's (earlier runs keep their identity) and the
  SHA-256 of an --init_weights file."""
  out = {}
  if opts.model_init != 'flax':
    out['model_init'] = opts.model_init
  if opts.init_weights:
    out['init_weights_sha256'] = run_identity.file_sha256(opts.init_weights)
  return out


def default_output_dir(opts: Settings, identities: dict) -> str:
  """``runs/<data>_<partition>_..._<hash of the configurations>``.

  Args:
    opts: the command's ``Settings``.
    identities: each algorithm's run identity.

  Returns:
    The folder's path.
  """
  algs = '+'.join(identities)
  algs = algs if len(algs) <= 60 else f'{len(identities)}algorithms'
  return os.path.join('runs', f'{opts.dataset.replace(":", "_")}_{partition(opts)}_'
                      f'{opts.model}_n{num_clients(opts) or "all"}_seed{opts.seed}_{algs}_'
                      f'{run_identity.short_hash(identities)}')


def sweep_configs(opts: Settings):
  """The sweep's (seed, {name: value}) configurations, or None without a sweep.

  Args:
    opts: the command's ``Settings``.

  Returns:
    ``[(seed, {name: value})]``, or None.
  """
  if not (opts.sweep_seeds or opts.sweep or opts.trials > 1):
    return None
  from fedjax_personal.run import sweep
  values = sweep.parse_sweep(opts.sweep, sweepable())
  seeds = list(range(opts.seed, opts.seed + max(opts.sweep_seeds, opts.trials, 1)))
  return sweep.configs(seeds, values)


def row_label(name: str, config_label) -> str:
  """A table row's label: the algorithm and its swept values.

  Args:
    name: the algorithm.
    config_label: the configuration's swept values, or None.

  Returns:
    The label.
  """
  if config_label is None:
    return name
  return f'{name} ' + ' '.join(f'{k}={v:g}' for k, v in config_label.items())


#: This library's flags that may differ between the processes of one run.
PER_PROCESS_FLAGS = ('process_id', 'progress')


def process_flags(opts: Settings) -> dict:
  """This library's flags (absl's own left out), as every process must share them.

  Args:
    opts: the command's ``Settings``.

  Returns:
    ``{flag: value}``.
  """
  return {name: opts.values[name] for name in sorted(opts.own) if name not in PER_PROCESS_FLAGS}
