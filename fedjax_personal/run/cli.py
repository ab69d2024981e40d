"""Flags and the main job of ``scripts/run_experiment.py``.

Kept in the package so that scripts stay thin and tests can drive it.
"""

import dataclasses
import os
import sys
import time
from typing import Any, Dict, List

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal import algorithms as algorithms_lib
from fedjax_personal import datasets as datasets_lib
from fedjax_personal.run import (checkpointing, distributed, entry, experiment, faults, reporting,
                                 run_identity)
from fedjax_personal.config import TrainingConfig, field_types, flag_name, validate
from fedjax_personal.errors import ConfigError, DataError
from fedjax_personal.core import layout as layout_lib
from fedjax_personal.core import memory
from fedjax_personal.core.data import to_device
from fedjax_personal.core.layout import HostData
from fedjax_personal.core.store import PopulationStore
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.core.executors import EXECUTOR_NAMES, create_executor
from fedjax_personal.models import INITS, MODELS, REFERENCE, create_model, weights
from fedjax_personal.core.sampling import CohortSampler
from fedjax_personal.core.tree_util import tree_bytes

FLAGS = flags.FLAGS

# Default job (the main job): why personalization matters. Real MNIST digits
# (the 10k MNIST files embedded in the package) on 40 clients in 4 groups
# rotated 0/90/180/270 degrees (covariate shift), an MLP, 60 rounds: FedAvg and
# Local against FedFomo, FedAlt and personalized FedDyn + fine-tuning, with
# Oracle (one FedAvg per true group) as the reference row. Shared training
# settings keep the library's defaults (SGD lr 0.05, B 32, 1 local epoch).
flags.DEFINE_list('algorithm', ['fedavg', 'local', 'oracle', 'fedfomo', 'fedalt', 'pfeddyn_ft'],
                  'Algorithm(s) to run; several give a comparison table. One of: '
                  + '; '.join(f'{n} ({spec.summary})'
                              for n, spec in algorithms_lib.REGISTRY.items()))
flags.DEFINE_string('model', 'mlp', 'Model: ' + ', '.join(sorted(MODELS)) + '; the seeds\' own: '
                    + '; '.join(f'{k} ({v[0]})' for k, v in REFERENCE.items()))
flags.DEFINE_enum('model_init', 'flax', list(INITS), "Initialisation convention of the model's "
                  "layers: each framework's default initialisers (flax: LeCun normal kernels, "
                  "zero biases; pytorch: U(+-1/sqrt(fan_in)) kernels and biases; keras: Glorot "
                  "uniform kernels, zero biases; LSTMs and embeddings too).")
flags.DEFINE_string('init_weights', None, 'Start from these initial global parameters: a .npz '
                    '(Flax parameter paths as keys) or a PyTorch state dict (.pt/.pth, matched '
                    'by layer order and converted).')
flags.DEFINE_string('dataset', 'mnist', 'Data set: ' + ', '.join(datasets_lib.DATASETS)
                    + ', leaf:<name> (LEAF JSON files). Natural data sets (emnist, '
                    'emnist_digits, shakespeare, stackoverflow, cifar100, gldv2, '
                    'tinyshakespeare, leaf:*) keep one client per writer / role / user.')
flags.DEFINE_string('partition', 'rotation', 'Partition: ' + ', '.join(datasets_lib.PARTITIONS)
                    + ' (default: natural for the natural data sets, rotation otherwise)')
flags.DEFINE_float('alpha', 0.4, 'Dirichlet concentration (label skew) / quantity-skew beta.')
flags.DEFINE_integer('classes_per_client', 2, 'Classes per client (pathological, sparse_classes).')
flags.DEFINE_integer('num_groups', 4, 'Groups (rotation, label_permutation, latent_clusters).')
flags.DEFINE_string('latent_features', 'pixels',
                  "What latent_clusters clusters: 'pixels' or 'embedding' (penultimate layer "
                  "of a classifier trained centrally on the pool, FedFomo's recipe).")
flags.DEFINE_string('group_base', 'iid', "Partition inside groups: 'iid' or 'dirichlet'.")
flags.DEFINE_integer('examples_per_client', None, 'sparse_classes: examples per device.')
flags.DEFINE_integer('max_examples', None, 'Use at most this many examples of the pool.')
flags.DEFINE_float('test_fraction', 0.2, 'Per-client test share.')
flags.DEFINE_float('val_fraction', None, 'Per-client validation share (default: 0.1 when a '
                   'requested algorithm needs a validation split, e.g. fedfomo, else 0).')
flags.DEFINE_integer('num_clients', 40, 'Number of clients N (a natural data set: its first N '
                     'clients; all of them when not given).')
flags.DEFINE_integer('cohort_size', None, 'Clients per round (default: all).')
flags.DEFINE_float('participation', None, 'Instead of cohort_size: each client active with this '
                   'probability per round (FedDyn scheme).')
flags.DEFINE_integer('rounds', 60, 'Communication rounds.')
flags.DEFINE_float('target_accuracy', None, 'Report the first evaluated round whose mean '
                   'accuracy reaches this fraction in (0, 1] (use --eval_every=1 for exact '
                   'rounds).')
flags.DEFINE_integer('adapter_dim', 0, 'Add residual adapters of this width to the model '
                     '(for --partial_personal_part=adapter).')
flags.DEFINE_integer('seed', 0, 'Seed of model init and training (and of the data partition '
                     'unless --data_seed is given).')
flags.DEFINE_integer('data_seed', None, 'Seed of the data partition (default: --seed). A sweep of '
                     'seeds (--sweep_seeds) shares one partition, that of --data_seed or --seed: '
                     'configuration s equals the single run --seed=s --data_seed=<that seed>.')
flags.DEFINE_integer('eval_every', 3, 'Evaluate every this many rounds (0: at the end only).')
flags.DEFINE_string('output_dir', None, 'Where to write results (default: runs/<data>_<model>_'
                    '<algorithms>_<hash of the configuration>).')
flags.DEFINE_enum('executor', 'auto', list(EXECUTOR_NAMES), 'How client work runs.')
flags.DEFINE_integer('block_size', None, 'Clients per block for the blocked executor.')
flags.DEFINE_enum('layout', 'auto', list(layout_lib.LAYOUTS), 'Where the clients\' examples live: '
                  'device (every client padded to the largest, on the device), host (the '
                  'population store; each round gathers its cohort) or auto (device when the '
                  'padded population takes at most a quarter of the free memory and, on an '
                  'accelerator, fits beside the largest algorithm state).')
flags.DEFINE_enum('stackoverflow_accuracy', 'in_vocab', ['in_vocab', 'fedjax_in_vocab'],
                  'stackoverflow: the next-word accuracy reported. in_vocab: targets PAD, BOS, '
                  'EOS and OOV not scored (Reddi et al., the partial-personalization seed); '
                  "fedjax_in_vocab: FedJAX's accuracy_in_vocab (PAD and EOS not scored, OOV a "
                  'miss).')
flags.DEFINE_string('client_ids', None, 'A text file of client ids, one per line (# comments): '
                    'the run is limited to these clients (ids as the data set names them: an '
                    'EMNIST writer, a Stack Overflow user; a partitioned pool\'s clients are '
                    '0..N-1).')
flags.DEFINE_enum('cifar100_test', 'split', ['split', 'tff_clients'],
                  "cifar100 (natural): the test clients. split: each train client's images split "
                  "with --test_fraction (personal models have test data); tff_clients: TFF's 100 "
                  'test clients, held out (evaluated with the global model, never trained), '
                  'as Reddi et al. (arXiv 2003.00295) evaluate.')
flags.DEFINE_bool('verify_store', False, 'Check every block of the population store of a '
                  'natural data set before training (else each block is checked the first time '
                  'a round reads it); a store that fails is rebuilt from its source files.')
flags.DEFINE_integer('vocab_size', None, 'stackoverflow: the vocabulary, its most frequent words '
                     '(plus PAD, BOS, EOS and one OOV id). Default: 10000, as Reddi et al. and '
                     'the partial-personalization seed.')
flags.DEFINE_integer('image_size', None, 'gldv2: the side of the square images, in pixels '
                     '(resized once, into the population store). Default: 224, as the '
                     'partial-personalization seed.')
flags.DEFINE_integer('max_client_examples', None, 'Train on at most this many examples per client '
                     '(its first ones; TFF\'s baselines cap at 1000). Default: all.')
flags.DEFINE_string('data_dir', None, 'Folder searched first for data files under their published '
                    'names (then $FEDJAX_PERSONAL_DATA, the package, the cache '
                    '$FEDJAX_PERSONAL_CACHE or ~/.cache/fedjax_personal); must exist.')
flags.DEFINE_bool('download', False, 'Download the data set\'s files found nowhere from their '
                  'published URL into the cache (progress bar, size and checksum checked).')
flags.DEFINE_bool('progress', True, 'Show a progress bar.')
flags.DEFINE_integer('checkpoint_every', 0, 'Save an Orbax checkpoint of the full state every this '
                     'many rounds (0: never) under <output_dir>/<algorithm>/checkpoints.')
flags.DEFINE_bool('resume', False, 'Continue each algorithm from its latest checkpoint in '
                  '--output_dir (refused when there is none, or when the folder holds another '
                  'configuration; more --rounds are allowed).')
flags.DEFINE_bool('resume_if_found', False, 'Like --resume where a checkpoint exists; start '
                  'fresh (with a note) where there is none.')
flags.DEFINE_bool('overwrite', False, 'Clear --output_dir first when it holds results of another '
                  'configuration (refused otherwise).')
flags.DEFINE_integer('sweep_seeds', 0, 'Run seeds seed..seed+S-1 together (0: off); one table '
                     'row per seed. Device layout: one program; host layout: one after another.')
flags.DEFINE_integer('trials', 1, 'Run T trials (seeds seed..seed+T-1, one shared partition) of '
                     'each algorithm, as one program in the device layout where the executor '
                     'allows it, else one after another (the host layout: on shared cohort '
                     'gathers); the table shows mean ± std over trials.')
flags.DEFINE_integer('stat_window', 5, 'Stable statistics: tables also report the mean over the '
                     'last this many evaluations of the mean and worst-client accuracy.')
flags.DEFINE_float('dp_delta', 1e-5, 'delta at which the DP-SGD epsilon is reported (algorithms '
                   'run with DP-SGD, e.g. --fedfomo_dp_clip_norm > 0).')
flags.DEFINE_bool('dry_run', False, 'Check every flag, load the data and build the model and '
                  'algorithms, then stop: nothing is trained or written.')
flags.DEFINE_string('coordinator_address', None, 'Several processes (one per host, or several '
                    'on one machine): host:port of process 0 (default: $JAX_COORDINATOR_ADDRESS; '
                    'on a SLURM / Open MPI allocation JAX finds the launch settings itself).')
flags.DEFINE_integer('num_processes', None, 'Processes of the run (default: $JAX_NUM_PROCESSES).')
flags.DEFINE_integer('process_id', None, 'This process, 0 .. num_processes - 1 (default: '
                     '$JAX_PROCESS_ID).')
flags.DEFINE_integer('distributed_timeout', 60, 'Seconds to wait for the other processes to '
                     'join, and for a silent one before the others stop.', lower_bound=1)
flags.DEFINE_string('sweep', '', "Hyperparameters swept in the same program, e.g. "
                    "'client_lr:0.01,0.03,0.1;prox_mu:0,0.1' (cross product with the seeds).")


# -- hyperparameter flags, derived from the config dataclasses -----------------

SHARED_FLAGS_MODULE = 'fedjax_personal: shared training settings (every algorithm)'


def _define_config_flags(cls, module_name: str):
  """One flag per field of ``cls`` (name ``<prefix>_<field>``), typed by the
  field's annotation, help and default from its ``hparam`` declaration."""
  types = field_types(cls)
  for f in dataclasses.fields(cls):
    name, meta, t = flag_name(cls, f.name), f.metadata, types[f.name]
    kw = dict(module_name=module_name)
    if t is bool:
      flags.DEFINE_bool(name, f.default, meta['help'], **kw)
    elif t is int:
      flags.DEFINE_integer(name, f.default, meta['help'], **kw)
    elif t is float:
      flags.DEFINE_float(name, f.default, meta['help'], **kw)
    elif meta.get('choices'):
      flags.DEFINE_enum(name, f.default, list(meta['choices']), meta['help'], **kw)
    else:
      flags.DEFINE_string(name, f.default, meta['help'], **kw)


def _algorithm_group(cls) -> str:
  users = [n for n, s in algorithms_lib.REGISTRY.items() if s.config is cls]
  return f'fedjax_personal: --{cls.prefix}_* settings of ' + ', '.join(users)


_define_config_flags(TrainingConfig, SHARED_FLAGS_MODULE)
for _cls in algorithms_lib.config_classes():
  _define_config_flags(_cls, _algorithm_group(_cls))


def register(spec) -> None:
  """Adds an algorithm defined outside the package (``AlgorithmSpec``) to
  the registry and defines its config's ``--<prefix>_*`` flags, before the
  flags are parsed (docs/add_an_algorithm.md): ``--algorithm=<its name>``
  then works as for a built-in one."""
  algorithms_lib.register(spec)
  prefix = getattr(spec.config, 'prefix', None)
  if prefix and not any(f'{prefix}_{f.name}' in FLAGS for f in dataclasses.fields(spec.config)):
    _define_config_flags(spec.config, _algorithm_group(spec.config))

#: The one error type of bad settings (the scripts exit with status 2).
UsageError = ConfigError


def _check(cond, flag, msg):
  if not cond:
    raise ConfigError(flag, msg)


def training_config() -> TrainingConfig:
  """The shared settings from their flags; the 'linear' client-rate
  schedule spans --rounds unless --client_lr_horizon says otherwise."""
  cfg = TrainingConfig(**{f.name: FLAGS[f.name].value for f in dataclasses.fields(TrainingConfig)})
  if cfg.client_lr_schedule == 'linear' and cfg.client_lr_horizon is None:
    cfg = dataclasses.replace(cfg, client_lr_horizon=FLAGS.rounds)
  return cfg


def algorithm_config(cls):
  return cls(**{f.name: FLAGS[flag_name(cls, f.name)].value for f in dataclasses.fields(cls)})


def sweepable() -> Dict[str, tuple]:
  """{flag name: (config class, field)} of the settings ``--sweep`` accepts."""
  out = {}
  for cls in [TrainingConfig] + algorithms_lib.config_classes():
    for f in dataclasses.fields(cls):
      if f.metadata.get('sweep'):
        out[flag_name(cls, f.name)] = (cls, f.name)
  return out


def _given(cls, swept=()) -> List[str]:
  """Fields of ``cls`` whose flag differs from its default (or is swept)."""
  return [f.name for f in dataclasses.fields(cls)
          if FLAGS[flag_name(cls, f.name)].value != f.default or flag_name(cls, f.name) in swept]


def resolve_algorithm_settings(names, swept=()):
  """Per algorithm of ``names``: (spec, TrainingConfig, own config, ignored
  flags).

  A setting given (or swept) that applies to none of the algorithms is
  refused; one that applies to some is reset to its default for the others,
  which print a note (and record it as ``ignored_settings``).

  Raises:
    ConfigError naming the flag.
  """
  training = training_config()
  validate(training)
  for cls in algorithms_lib.config_classes():
    validate(algorithm_config(cls))
  training.check()
  specs = [algorithms_lib.spec(n) for n in names]
  ignored = {s.name: [] for s in specs}
  for name in _given(TrainingConfig, swept):
    unused = {s.name: name in s.inapplicable(training) or (name in swept and name not in s.uses)
              for s in specs}
    if all(unused.values()):
      if len(specs) == 1:
        specs[0].validate(training, algorithm_config(specs[0].config))  # its own reason
      raise ConfigError(name, f'does nothing for {", ".join(names)}')
    for s in specs:
      if unused[s.name]:
        ignored[s.name].append(name)
  for cls in algorithms_lib.config_classes():
    for field in _given(cls, swept):
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
    cfg = dataclasses.replace(algorithm_config(s.config),
                              **{f: getattr(own_default, f) for f in s.ignores})
    s.validate(t, cfg)
    if ignored[s.name]:
      print(f'note: {s.name} does not use ' + ', '.join('--' + n for n in ignored[s.name]))
    out.append((s, t, cfg, ignored[s.name]))
  return out


def validate_flags():
  """Checks flag values that can be checked before loading data (the
  hyperparameters are checked by ``resolve_algorithm_settings``)."""
  _check(FLAGS.algorithm, 'algorithm', 'give at least one algorithm')
  for a in FLAGS.algorithm:
    _check(a in algorithms_lib.REGISTRY, 'algorithm',
           f'unknown algorithm {a!r}; choose from {list(algorithms_lib.REGISTRY)}')
  _check(FLAGS.model in MODELS, 'model', f'unknown model {FLAGS.model!r}; choose from {sorted(MODELS)}')
  _check(datasets_lib.is_known(FLAGS.dataset), 'dataset',
         f'unknown dataset {FLAGS.dataset!r}; choose from {list(datasets_lib.DATASETS)} or leaf:<name>')
  datasets_lib.files.check_data_dir(FLAGS.data_dir)
  _check(not FLAGS.data_dir or FLAGS.dataset not in datasets_lib.NO_FILES, 'data_dir',
         f'does nothing: dataset {FLAGS.dataset} reads no file')
  _check(not FLAGS.download or FLAGS.dataset not in datasets_lib.NO_FILES + ('mnist',)
         and not FLAGS.dataset.startswith('tfds:'), 'download',
         f'does nothing: dataset {FLAGS.dataset} has no file to download'
         + (' (TFDS data sets: load_tfds(name, download=True))' if FLAGS.dataset.startswith('tfds:')
            else ''))
  _check(not (FLAGS['test_fraction'].present
              and datasets_lib.has_own_test_split(FLAGS.dataset, partition(),
                                                  FLAGS.cifar100_test)),
         'test_fraction', f'does nothing: {FLAGS.dataset} has its own test split in its files')
  _check(partition() in datasets_lib.PARTITIONS, 'partition',
         f'unknown partition {partition()!r}; choose from {list(datasets_lib.PARTITIONS)}')
  _check(FLAGS.num_clients >= 1, 'num_clients', f'must be >= 1, got {FLAGS.num_clients}')
  _check(FLAGS.alpha > 0, 'alpha', f'must be > 0, got {FLAGS.alpha}')
  _check(FLAGS.rounds >= 1, 'rounds', f'must be >= 1, got {FLAGS.rounds}')
  _check(FLAGS.seed >= 0, 'seed', f'must be >= 0, got {FLAGS.seed}')
  _check(FLAGS.data_seed is None or FLAGS.data_seed >= 0, 'data_seed',
         f'must be >= 0, got {FLAGS.data_seed}')
  _check(FLAGS.classes_per_client >= 1, 'classes_per_client',
         f'must be >= 1, got {FLAGS.classes_per_client}')
  _check(FLAGS.num_groups >= 1, 'num_groups', f'must be >= 1, got {FLAGS.num_groups}')
  _check(FLAGS.examples_per_client is None or FLAGS.examples_per_client >= 1,
         'examples_per_client', f'must be >= 1, got {FLAGS.examples_per_client}')
  _check(FLAGS.target_accuracy is None or 0 < FLAGS.target_accuracy <= 1, 'target_accuracy',
         f'is a fraction in (0, 1] (0.8 for 80%), got {FLAGS.target_accuracy}')
  _check(FLAGS.cohort_size is None or FLAGS.participation is None, 'participation',
         'give either --cohort_size or --participation, not both')
  if FLAGS.cohort_size is not None and num_clients() is not None:
    _check(1 <= FLAGS.cohort_size <= FLAGS.num_clients, 'cohort_size',
           f'must be in [1, num_clients={FLAGS.num_clients}], got {FLAGS.cohort_size}')
  if FLAGS.participation is not None:
    _check(0 < FLAGS.participation <= 1, 'participation',
           f'must be in (0, 1], got {FLAGS.participation}')
  _check(FLAGS.sweep_seeds >= 0, 'sweep_seeds', f'must be >= 0, got {FLAGS.sweep_seeds}')
  _check(FLAGS.trials >= 1, 'trials', f'must be >= 1, got {FLAGS.trials}')
  _check(FLAGS.trials == 1 or not FLAGS.sweep_seeds, 'trials',
         'give --trials (mean ± std rows) or --sweep_seeds (one row per seed), not both')
  _check(FLAGS.stat_window >= 1, 'stat_window', f'must be >= 1, got {FLAGS.stat_window}')
  _check(0 < FLAGS.dp_delta < 1, 'dp_delta', f'must be in (0, 1), got {FLAGS.dp_delta}')
  _check(FLAGS.checkpoint_every >= 0, 'checkpoint_every',
         f'must be >= 0, got {FLAGS.checkpoint_every}')
  _check(FLAGS.eval_every >= 0, 'eval_every', f'must be >= 0, got {FLAGS.eval_every}')
  _check(FLAGS.block_size is None or FLAGS.block_size >= 1, 'block_size',
         f'must be >= 1, got {FLAGS.block_size}')
  _check(not FLAGS['stackoverflow_accuracy'].present or FLAGS.dataset == 'stackoverflow',
         'stackoverflow_accuracy', f'defines the Stack Overflow accuracy; --dataset='
         f'{FLAGS.dataset} has no words to score')
  _check(not FLAGS['cifar100_test'].present
         or (FLAGS.dataset == 'cifar100' and partition() == 'natural'), 'cifar100_test',
         f'chooses the natural CIFAR-100\'s test clients; --dataset={FLAGS.dataset} '
         f'--partition={partition()} has none')
  _check(FLAGS.vocab_size is None or FLAGS.dataset == 'stackoverflow', 'vocab_size',
         f'sets the Stack Overflow vocabulary; --dataset={FLAGS.dataset} has none to set')
  _check(FLAGS.vocab_size is None or FLAGS.vocab_size >= 1, 'vocab_size',
         f'must be >= 1, got {FLAGS.vocab_size}')
  _check(FLAGS.image_size is None or FLAGS.dataset == 'gldv2', 'image_size',
         f'sets the GLDv2 image size; --dataset={FLAGS.dataset} has its images at their size')
  _check(FLAGS.image_size is None or FLAGS.image_size >= 8, 'image_size',
         f'must be >= 8, got {FLAGS.image_size}')
  _check(FLAGS.max_client_examples is None or FLAGS.max_client_examples >= 1,
         'max_client_examples', f'must be >= 1, got {FLAGS.max_client_examples}')
  _check(0 < FLAGS.test_fraction < 1, 'test_fraction', f'must be in (0, 1), got {FLAGS.test_fraction}')
  _check(FLAGS.max_examples is None or FLAGS.max_examples >= 1, 'max_examples',
         f'must be >= 1, got {FLAGS.max_examples}')
  _check(FLAGS.test_fraction + val_fraction() < 1, 'val_fraction',
         'test_fraction + val_fraction must be < 1')
  _check(0 <= val_fraction() < 1, 'val_fraction', f'must be in [0, 1), got {val_fraction()}')
  _check(FLAGS.latent_features in datasets_lib.LATENT_FEATURES, 'latent_features',
         f'unknown value {FLAGS.latent_features!r}; choose from {list(datasets_lib.LATENT_FEATURES)}')
  _check(not FLAGS['latent_features'].present or partition() == 'latent_clusters',
         'latent_features', 'applies to --partition=latent_clusters, not '
         f'{partition()!r}')
  _check(FLAGS.adapter_dim >= 0, 'adapter_dim', f'must be >= 0, got {FLAGS.adapter_dim}')
  _check(not (FLAGS.init_weights and FLAGS['model_init'].present), 'model_init',
         'does nothing with --init_weights (the file gives every initial weight)')
  if FLAGS.init_weights:
    _check(os.path.isfile(FLAGS.init_weights), 'init_weights',
           f'{FLAGS.init_weights}: no such file')
  swept = {}
  if FLAGS.sweep:
    from fedjax_personal.run import sweep
    try:
      swept = sweep.parse_sweep(FLAGS.sweep, sweepable())
    except ValueError as e:
      raise ConfigError('sweep', str(e)) from None
    for name, values in swept.items():
      cls, field = sweepable()[name]
      for v in values:
        try:
          validate(dataclasses.replace(cls(), **{field: v}))
        except ConfigError as e:
          raise ConfigError('sweep', f'{name}={v:g}: {e}') from None
  return resolve_algorithm_settings(FLAGS.algorithm, swept)


DEFAULT_VAL_FRACTION = 0.1


def val_fraction() -> float:
  """--val_fraction, or by default 0.1 when a requested algorithm needs a
  validation split (FedFomo) and 0 otherwise (no training data held out for
  nothing)."""
  if FLAGS.val_fraction is not None:
    return FLAGS.val_fraction
  needs = any(algorithms_lib.REGISTRY[n].needs_validation for n in FLAGS.algorithm
              if n in algorithms_lib.REGISTRY)
  return DEFAULT_VAL_FRACTION if needs else 0.0


def data_config() -> datasets_lib.DataConfig:
  return datasets_lib.DataConfig(
      dataset=FLAGS.dataset, partition=partition(), num_clients=num_clients(),
      seed=FLAGS.seed if FLAGS.data_seed is None else FLAGS.data_seed, alpha=FLAGS.alpha, classes_per_client=FLAGS.classes_per_client,
      num_groups=FLAGS.num_groups, group_base=FLAGS.group_base,
      latent_features=FLAGS.latent_features,
      examples_per_client=FLAGS.examples_per_client, test_fraction=FLAGS.test_fraction,
      val_fraction=val_fraction(), max_examples=FLAGS.max_examples, data_dir=FLAGS.data_dir,
      download=FLAGS.download, vocab_size=FLAGS.vocab_size, image_size=FLAGS.image_size,
      cifar100_test=FLAGS.cifar100_test)


def partition() -> str:
  """--partition, or 'natural' for a natural data set when it is not given."""
  if not FLAGS['partition'].present and datasets_lib.is_natural(FLAGS.dataset, 'natural'):
    return 'natural'
  return FLAGS.partition


def num_clients():
  """--num_clients; None (all clients) for a natural data set read from
  files when it is not given."""
  if (not FLAGS['num_clients'].present and partition() == 'natural'
      and (FLAGS.dataset in datasets_lib.FILE_DATASETS
           or FLAGS.dataset.startswith(datasets_lib.LEAF_PREFIX))):
    return None
  return FLAGS.num_clients


def sampler_for(data) -> CohortSampler:
  """The cohort sampler of ``data`` (a FederatedData or HostData): its
  clients that train (all but the ``eval_only`` last) are drawn."""
  n, trained = data.num_clients, data.num_trained
  eligible = None if trained == n else trained
  if FLAGS.participation is not None:
    return CohortSampler(n, participation=FLAGS.participation, eligible=eligible)
  return CohortSampler(n, cohort_size=FLAGS.cohort_size or trained, eligible=eligible)


def job_identity(fingerprint: str, cap=None) -> dict:
  """What every algorithm of the job shares in its run identity:
  ``fingerprint`` is the data's (``run_identity.data_fingerprint`` of the
  padded arrays, or a population store's digest); the cap on examples per
  client when given."""
  cfg = dataclasses.asdict(data_config())
  if cap is not None:
    cfg['max_client_examples'] = cap
  cfg.pop('data_dir')  # where the files are does not matter; their content does
  cfg.pop('download')
  cfg['seq_len'] = data_config().sequence_length  # as before seq_len could be None
  for field in ('vocab_size', 'image_size'):
    if cfg[field] is None:  # not given: earlier runs keep their identity
      cfg.pop(field)
  if cfg['cifar100_test'] == 'split':  # the default before the field existed
    cfg.pop('cifar100_test')
  if cfg['latent_features'] == 'pixels':  # the default before the field existed:
    cfg.pop('latent_features')            # earlier runs keep their identity
  return {'data': cfg, 'data_fingerprint': fingerprint,
          'model': FLAGS.model, 'adapter_dim': FLAGS.adapter_dim,
          'cohort_size': FLAGS.cohort_size, 'participation': FLAGS.participation,
          'seed': FLAGS.seed, **model_start(),
          **({'accuracy': FLAGS.stackoverflow_accuracy}
             if FLAGS.dataset == 'stackoverflow' and FLAGS.stackoverflow_accuracy != 'in_vocab'
             else {}),
          **({'num_processes': jax.process_count()} if jax.process_count() > 1 else {})}


def model_start() -> dict:
  """How the model's first weights are drawn, in the run identity: the
  convention when not Flax's (earlier runs keep their identity) and the
  SHA-256 of an --init_weights file."""
  out = {}
  if FLAGS.model_init != 'flax':
    out['model_init'] = FLAGS.model_init
  if FLAGS.init_weights:
    out['init_weights_sha256'] = run_identity.file_sha256(FLAGS.init_weights)
  return out


def _default_output_dir(identities: dict) -> str:
  algs = '+'.join(identities)
  algs = algs if len(algs) <= 60 else f'{len(identities)}algorithms'
  return os.path.join('runs', f'{FLAGS.dataset.replace(":", "_")}_{partition()}_'
                      f'{FLAGS.model}_n{num_clients() or "all"}_seed{FLAGS.seed}_{algs}_'
                      f'{run_identity.short_hash(identities)}')


def _sweep_configs():
  """The sweep's (seed, {name: value}) configurations, or None without a sweep."""
  if not (FLAGS.sweep_seeds or FLAGS.sweep or FLAGS.trials > 1):
    return None
  from fedjax_personal.run import sweep
  values = sweep.parse_sweep(FLAGS.sweep, sweepable())
  seeds = list(range(FLAGS.seed, FLAGS.seed + max(FLAGS.sweep_seeds, FLAGS.trials, 1)))
  return sweep.configs(seeds, values)


def _label(name: str, config_label) -> str:
  if config_label is None:
    return name
  return f'{name} ' + ' '.join(f'{k}={v:g}' for k, v in config_label.items())


def _make_runs(spec, alg, training, cfg, ignored, model, data, executor, cfgs):
  """The loop's ``Runs`` of one algorithm: a single run, or its
  configurations (sweep, trials) as one vmapped program when the executor is
  fused, else one after another."""
  if cfgs is None:
    return experiment.SingleRun(RoundRunner(alg, data, sampler_for(data), executor),
                                FLAGS.seed)
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
  return runs(build, cfgs, data, sampler_for(data), executor)


@dataclasses.dataclass
class Job:
  """What the main job's steps pass on: the data and its identity, the model
  and executor, the algorithms with their settings and run identities, the
  output folder, and the results so far."""
  cfgs: Any = None
  data: Any = None
  population: Any = None
  layout: str = 'device'
  layout_reason: str = ''
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


def main_job() -> Dict[str, dict]:
  """Runs every algorithm of --algorithm on the same data (each a single run,
  or with --sweep/--sweep_seeds/--trials its configurations through the same
  loop); writes outputs and prints the comparison table. Returns {row label:
  final summary}. With --dry_run, stops after building everything (nothing
  trained or written) and returns {}."""
  settings = validate_flags()
  job = Job(cfgs=_sweep_configs())
  load_data(job)
  build_model_and_executor(job)
  build_algorithms(job, settings)
  settle_layout(job, settings)
  choose_output_dir(job)
  if FLAGS.dry_run:
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
  identity shares (the same in both layouts)."""
  cfg = data_config()
  cap = FLAGS.max_client_examples
  padded = None
  _check(not FLAGS.verify_store or datasets_lib.streams_to_store(cfg), 'verify_store',
         f'checks the population store of a data set read from its files; {FLAGS.dataset} '
         f'({cfg.partition}) is built in memory, with nothing to check')
  if datasets_lib.streams_to_store(cfg):  # written once into the cache, client by client
    store = datasets_lib.load_store(cfg, verify=FLAGS.verify_store,
                                    should_stop=faults.signal_received)
    fingerprint = store.digest
  else:
    padded = datasets_lib.load_federated(cfg)
    fingerprint = run_identity.data_fingerprint(padded)
    store = PopulationStore.from_federated(padded)
    if cap is not None:
      padded = None
  if FLAGS.client_ids:
    store, padded = chosen_clients(store, FLAGS.client_ids), None
    fingerprint = store.digest
  population = store.population(cap)
  train_counts = np.asarray(population.train.num_examples)
  _check(int(train_counts.sum()) > 0, 'num_clients', 'no client has training data')
  if int(np.asarray(population.test.num_examples).sum()) == 0:
    raise ConfigError('dataset', f'{FLAGS.dataset}: no training client has a test example (the '
                      'test file\'s clients match none of the training file\'s): check the '
                      'test file, or --data_dir')
  trained = population.num_trained
  _check(FLAGS.cohort_size is None or FLAGS.cohort_size <= trained, 'cohort_size',
         f'must be in [1, {trained}] (the clients of {FLAGS.dataset} that train), got '
         f'{FLAGS.cohort_size}')
  free = memory.device_free_bytes() or (layout_lib.host_available_bytes()
                                        if jax.default_backend() == 'cpu' else None)
  layout, reason = layout_lib.choose(FLAGS.layout, store.padded_nbytes(cap), free,
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
  _say(population.describe())
  job.layout_reason, job.store = reason, store
  job.identity = job_identity(fingerprint, cap)
  if job.cfgs is not None:
    job.identity['sweep'] = {'sweep': FLAGS.sweep, 'sweep_seeds': FLAGS.sweep_seeds,
                             'trials': FLAGS.trials}
  job.layout = layout
  if layout == 'device':
    job.population = padded if padded is not None else store.padded(cap)
    job.data = to_device(job.population)
  else:
    job.population, job.data = population, HostData(store, cap)


def chosen_clients(store: PopulationStore, path: str) -> PopulationStore:
  """The clients listed in ``path`` (--client_ids: one id per line, blank
  lines and # comments skipped) as a view of ``store``."""
  try:
    with open(path, encoding='utf-8') as f:
      ids = [line.strip() for line in f]
  except (OSError, UnicodeDecodeError) as e:
    raise ConfigError('client_ids', f'{path}: {getattr(e, "strerror", None) or e}') from None
  ids = [c for c in ids if c and not c.startswith('#')]
  _check(bool(ids), 'client_ids', f'{path} lists no client id')
  try:
    return store.subset(ids, f'from {os.path.basename(path)}')
  except DataError as e:
    raise ConfigError('client_ids', f'{path}: {e}') from None


def build_model_and_executor(job: Job) -> None:
  """The model (its initialisation convention, or weights from a file) and
  the executor."""
  sample_x = (job.population.sample_x if job.layout == 'host'
              else job.data.train.x[0, :1])
  job.model = create_model(FLAGS.model, job.population.num_classes, sample_x, FLAGS.adapter_dim,
                           init=FLAGS.model_init)
  if FLAGS.dataset == 'stackoverflow':  # next-word accuracy as one publisher defines it
    unscored, unpredicted, definition = datasets_lib.natural.stackoverflow_accuracy(
        FLAGS.stackoverflow_accuracy, job.population.num_classes)
    job.model = job.model.scoring_only_words(unscored, unpredicted=unpredicted,
                                             definition=definition)
    _say(f'accuracy: {FLAGS.stackoverflow_accuracy}, {definition}')
  if FLAGS.init_weights:
    job.model = job.model.starting_from(weights.load(FLAGS.init_weights, job.model, sample_x))
  _check_model_fits_targets(job.model, sample_x, job.store.y_spec()[0], job.population.num_classes)
  try:
    job.executor = create_executor(FLAGS.executor, job.model, sample_x, FLAGS.block_size)
  except ValueError as e:
    raise ConfigError('executor', str(e)) from None


def _check_model_fits_targets(model, sample_x, y_shape, num_classes) -> None:
  """Refuses a model whose predictions do not match the data set's targets
  (an image model on token sequences, a sequence model on labels), before
  anything is built: one line naming --model."""
  if model.loss != 'cross_entropy':
    return
  params = jax.eval_shape(model.init, jax.random.key(0))
  try:
    out = jax.eval_shape(model.apply, params, jnp.asarray(sample_x)[:1]).shape[1:]
  except Exception as e:  # the model cannot even read these inputs
    raise ConfigError('model', f'--model={FLAGS.model} cannot read {FLAGS.dataset}\'s inputs '
                      f'{tuple(np.shape(sample_x)[1:])}: {type(e).__name__}') from None
  want = tuple(y_shape) + (num_classes,)
  if tuple(out) != want:
    kind = 'a sequence of targets' if len(y_shape) else 'one label'
    raise ConfigError('model', f'--model={FLAGS.model} predicts {tuple(out)} per example, '
                      f'{FLAGS.dataset} has {kind} per example ({want} expected): choose a '
                      + ('sequence model (char_lstm, lstm_lm, transformer_lm)' if len(y_shape)
                         else 'classifier (mlp, cnn, lenet5, ...)'))


def build_algorithms(job: Job, settings) -> None:
  """Every algorithm, built before any trains (a bad setting fails fast), with
  its run identity."""
  job.algs = [(spec, algorithms_lib.build(spec.name, job.model, job.population, training=t,
                                          config=cfg),
               t, cfg, ignored, run_identity.identity(spec.name, t, cfg, job.identity))
              for spec, t, cfg, ignored in settings]
  if job.population.eval_only:
    for _, alg, *_ in job.algs:
      _check_global_evaluation(alg, job.population.eval_only)
  if FLAGS['dp_delta'].present and not any(a.privacy is not None for _, a, *_ in job.algs):
    raise ConfigError('dp_delta', 'does nothing: no requested algorithm runs DP-SGD '
                      '(--fedfomo_dp_clip_norm > 0)')


def _check_global_evaluation(alg, held_out: int) -> None:
  """Held-out clients (``eval_only``) never train: an algorithm that
  evaluates personal models, or adapts a model to a client's own training
  data before evaluating it, would report untrained or unadapted models
  under its name. Refused in one line."""
  models = jax.eval_shape(lambda k: alg.client_models(alg.init(k)), jax.random.key(0))
  num_models = jax.tree.leaves(models.params)[0].shape[0]
  if num_models != 1 or alg.finetune is not None or alg.evaluate_client is not None:
    how = ('fine-tunes on' if alg.finetune is not None else 'adapts to'
           if alg.evaluate_client is not None else 'evaluates personal models trained on')
    raise ConfigError('cifar100_test', f'{alg.name} {how} each client\'s own training data; the '
                      f'{held_out} held-out test clients have none: give --cifar100_test=split '
                      '(each client\'s images split for test) or a global-model algorithm')


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
    need = copies * job.store.padded_nbytes(FLAGS.max_client_examples) + num * sizes[name]
    if free is not None and need > free:
      what = (f'the padded population and {name}\'s state{times} need '
              f'{need / layout_lib.GB:.2f} GB, {free / layout_lib.GB:.1f} GB free')
      if FLAGS.layout == 'device' or jax.process_count() > 1:
        raise ConfigError('layout', f'--layout=device: {what}; give --layout=host (one '
                          'process) or fewer clients')
      job.layout, job.layout_reason = 'host', f'auto: {what}; client rows on the host'
      job.population = job.store.population(FLAGS.max_client_examples)
      job.data = HostData(job.store, FLAGS.max_client_examples)
      build_algorithms(job, settings)
  _say(f'layout: {job.layout} ({job.layout_reason})')
  if job.layout == 'host':
    available = layout_lib.host_available_bytes()
    for _, alg, *_ in job.algs:
      if alg.client_rows is not None:
        rows = alg.client_rows.get(jax.eval_shape(alg.init, jax.random.key(0)))
        nbytes = num * tree_bytes(rows)
        if available is not None and nbytes > 0.9 * available:
          flag = 'algorithm' if num == 1 else 'sweep' if FLAGS.sweep else (
              'trials' if FLAGS.trials > 1 else 'sweep_seeds')
          raise ConfigError(flag, f'{alg.name} keeps {nbytes / layout_lib.GB:.1f} GB of '
                            f'client rows{times} in host memory, '
                            f'{available / layout_lib.GB:.1f} GB available: give fewer '
                            'clients (--num_clients)' + (', fewer configurations'
                                                        if num > 1 else '')
                            + ' or a smaller model')
        _say(f'  {alg.name}: client rows{times} ({nbytes / layout_lib.GB:.3f} GB) on the host')


def choose_output_dir(job: Job) -> None:
  """--output_dir or the configuration's default folder; with several
  processes, every process must run the same configuration."""
  identities = {spec.name: ident for spec, _, _, _, _, ident in job.algs}
  job.output_dir = FLAGS.output_dir or _default_output_dir(identities)
  distributed.check_same_run({'algorithms': identities, 'flags': _process_flags()},
                             run_identity.differences)
  why = f' ({job.executor.reason})' if job.executor.reason else ''
  _say(f'executor: {job.executor.describe()} on {jax.default_backend()}{why}; outputs in '
       f'{job.output_dir}')
  if job.cfgs is not None:
    _say(f'{len(job.cfgs)} configurations per algorithm, ' + (
        'one after another on the host layout, the configurations of one seed sharing each '
        "round's cohort gather" if job.layout == 'host' else
        'each algorithm one compiled program' if job.executor.fused else 'one after another'))


def claim_and_restore(job: Job) -> None:
  """Makes the output folders this configuration's (process 0 writes, the
  others wait), builds each algorithm's runs, and with --resume restores them
  from their latest checkpoints (every process its own shards)."""
  resume = FLAGS.resume or FLAGS.resume_if_found
  identities = {spec.name: ident for spec, _, _, _, _, ident in job.algs}
  if resume:
    _check_process_count(job.output_dir)
  if distributed.is_primary():
    run_identity.lock(job.output_dir)  # held until the job ends (main_job unlocks)
    run_identity.claim(job.output_dir, {'algorithms': identities}, FLAGS.overwrite, resume)
    for spec, *_, ident in job.algs:
      run_identity.claim(os.path.join(job.output_dir, spec.name), ident, FLAGS.overwrite, resume)
  distributed.barrier('claimed output folders')
  for spec, alg, t, cfg, ignored, ident in job.algs:
    runs = _make_runs(spec, alg, t, cfg, ignored, job.model, job.data, job.executor, job.cfgs)
    job.runs[spec.name] = runs
    if not resume:
      continue
    ckpt_dir = os.path.join(job.output_dir, spec.name, 'checkpoints')
    got = checkpointing.restore_latest(ckpt_dir, runs.init(), ident)
    if got is None and FLAGS.resume:
      raise ConfigError('resume', f'no checkpoint of {spec.name} in {ckpt_dir}; run without '
                        '--resume, or with --resume_if_found to start fresh where there is none')
    if got is None:
      _say(f'{spec.name}: no checkpoint in {ckpt_dir}; starting fresh')
    elif got[1] > FLAGS.rounds:
      raise ConfigError('rounds', f'the checkpoint of {spec.name} is at round {got[1]}, past '
                        f'--rounds={FLAGS.rounds}')
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
  out_dir = os.path.join(job.output_dir, alg_name)
  primary = distributed.is_primary()
  callbacks = []
  if alg.privacy is not None:
    callbacks.append(reporting.PrivacyRecorder(alg.privacy, FLAGS.dp_delta))
  if primary:
    callbacks.append(reporting.MetricsWriter(out_dir, hists))
  if FLAGS.checkpoint_every or FLAGS.resume or FLAGS.resume_if_found:
    callbacks.append(checkpointing.Checkpointer(os.path.join(out_dir, 'checkpoints'),
                                                FLAGS.checkpoint_every, hists, identity=ident))
  if alg_name == 'fedfomo' and job.cfgs is None and primary:
    callbacks.append(reporting.AffinityRecorder(os.path.join(out_dir, 'affinity.png')))
  if FLAGS.progress and primary:
    callbacks.append(reporting.Progress(FLAGS.rounds - start, alg_name))
  return callbacks


def train_algorithm(job: Job, entry) -> None:
  """Trains one algorithm's runs to --rounds and records their summaries."""
  spec, alg, _, _, ignored, ident = entry
  alg_name, runs = spec.name, job.runs[spec.name]
  state, start, hists = None, 0, None
  if job.restored.get(alg_name) is not None:
    state, start, hists = job.restored[alg_name]
    _say(f'{alg_name}: resuming after round {start}')
  faults.start_algorithm(alg_name, start, os.path.join(job.output_dir, alg_name, 'checkpoints'),
                         bool(FLAGS.checkpoint_every), start or None)
  _, hists = experiment.run_many(runs, FLAGS.rounds, eval_every=FLAGS.eval_every,
                                 callbacks=_callbacks(job, alg_name, alg, ident, hists, start),
                                 state=state, start_round=start, histories=hists)
  alg_summaries = []
  for label, history in zip(runs.labels, hists):
    s = reporting.final_summary(history, FLAGS.stat_window)
    s['rounds'] = FLAGS.rounds
    if 'per_client_accuracy' in s:
      s['worst_clients'] = reporting.worst_clients(s['per_client_accuracy'], job.store.client_ids)
    if label is not None:
      s['config'] = label
    if job.model.accuracy_definition:
      s['accuracy_definition'] = job.model.accuracy_definition
    if start:
      s['resumed_after_round'] = start
    if ignored:
      s['ignored_settings'] = ignored
    if FLAGS.target_accuracy is not None:
      s['rounds_to_target'] = experiment.rounds_to_target(history, FLAGS.target_accuracy)
    row = _label(alg_name, label)
    job.histories[row], job.summaries[row] = history, s
    alg_summaries.append(s)
    if FLAGS.trials > 1:  # rows of the table: trials grouped by their values
      values = {k: v for k, v in label.items() if k != 'seed'}
      job.groups.setdefault(_label(alg_name, values or None), []).append((history, s))
    _say(f"{row}: " + (f"diverged at round {s['diverged_at_round']}" if s.get('diverged')
                       else f"mean {s['accuracy_mean']:.4f} worst {s['accuracy_worst']:.4f}")
         + f" ({s['train_seconds']:.1f} s of rounds)"
         + (f", epsilon {s['dp_epsilon']:.2f} at delta {FLAGS.dp_delta:g}"
            if 'dp_epsilon' in s else ''))
  if distributed.is_primary():
    record = alg_summaries[0] if job.cfgs is None else {'configurations': alg_summaries}
    reporting.write_summary(os.path.join(job.output_dir, alg_name),
                            {**record, 'algorithm': alg_name, 'identity': ident,
                             'flags': FLAGS.flag_values_dict()})


def write_comparison(job: Job) -> None:
  """The comparison table (printed), comparison.json or sweep.json and the
  plots, for the algorithms that finished (process 0 writes)."""
  if not job.histories:
    return
  strip = lambda s: {k: v for k, v in s.items() if k != 'per_client_accuracy'}
  table, primary = job.summaries, distributed.is_primary()
  if FLAGS.trials > 1:
    table = {g: reporting.aggregate_trials([s for _, s in items])
             for g, items in job.groups.items()}
    if primary:
      reporting.plot_trials({g: [h for h, _ in items] for g, items in job.groups.items()},
                            job.output_dir)
      run_identity.write_json(os.path.join(job.output_dir, 'comparison.json'), {
          g: {**table[g], 'per_trial': [strip(s) for _, s in items]}
          for g, items in job.groups.items()})
  elif primary:
    reporting.plot_runs(job.histories, job.output_dir)
    run_identity.write_json(os.path.join(job.output_dir, 'comparison.json'
                                         if job.cfgs is None else 'sweep.json'),
                            {k: strip(s) for k, s in job.summaries.items()})
  trials = f', mean ± std over {FLAGS.trials} trials' if FLAGS.trials > 1 else ''
  window = reporting.table_window(table)
  _say('')
  _say(f'{job.population.name}, {FLAGS.model}, {FLAGS.rounds} rounds: per-client test accuracy at the '
       f'last evaluation and averaged over the last {window} (@last{window}){trials}')
  _say(reporting.format_table(table))
  if FLAGS.trials > 1:
    job.summaries = table


def _say(text: str) -> None:
  """Prints on process 0 (every process computes the same numbers)."""
  if distributed.is_primary():
    print(text)


#: This library's flags that may differ between the processes of one run.
PER_PROCESS_FLAGS = ('process_id', 'progress')


def _process_flags() -> dict:
  """This library's flags (absl's own left out), as every process must share them."""
  values = FLAGS.flag_values_dict()
  return {f.name: values[f.name] for module, fl in FLAGS.flags_by_module_dict().items()
          if not module.startswith('absl') for f in fl if f.name not in PER_PROCESS_FLAGS}


def main(argv):
  if len(argv) > 1:
    print(f'error: unexpected arguments {argv[1:]}', file=sys.stderr)
    sys.exit(2)
  if not FLAGS['verbosity'].present:
    from absl import logging
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
  faults.install_signal_handlers()
  try:
    distributed.initialize(distributed.settings(FLAGS.coordinator_address, FLAGS.num_processes,
                                                FLAGS.process_id),
                           FLAGS.distributed_timeout)
    main_job()
  except faults.Fault as e:
    _fail(e, e.status)
  except (ConfigError, FileNotFoundError) as e:
    _fail(e, faults.EXIT_CONFIG)
  except experiment.DivergenceError as e:
    _fail(e, faults.EXIT_DIVERGED)
  except KeyboardInterrupt:
    stop = faults.interrupted(during_round=True)
    _fail(stop, stop.status)
  except Exception as e:  # a storage or lost-process fault: one line; else the traceback
    if faults.storage_reason(e):
      name = getattr(e, 'filename', None) or job_output_dir()
      _fail(faults.storage_error(name, e), faults.EXIT_STORAGE)
    reason = faults.lost_process_reason(e) if distributed.active() else None
    if reason:
      time.sleep(4 * distributed.POLL_SECONDS)  # the lost one's heartbeat goes stale
      silent = distributed.silent_processes()
      reason = f'{silent} stopped answering: {reason}' if silent else reason
      _fail(faults.lost_process(reason, FLAGS.coordinator_address or '(from the environment)'),
            faults.EXIT_LOST_PROCESS)
    if distributed.report_failure(f'{type(e).__name__}: {e}'):
      import traceback
      traceback.print_exc()
      distributed.hard_exit(1)
    raise


def _fail(error, status: int):
  if not faults.claim_report(status):  # a runtime thread already reported this fault
    faults.quiet_exit(faults.reported_status())
  print(f'error: {error}', file=faults.error_stream(), flush=True)
  if status == faults.EXIT_LOST_PROCESS:
    # The others notice the lost process themselves (and the coordinator may
    # be the one gone): end now, before JAX's runtime aborts this process.
    faults.quiet_exit(status)
  if distributed.report_failure(str(error), status):
    # The others learn it from the coordinator; JAX's shutdown at exit would
    # wait for them at a barrier they never reach, and abort.
    distributed.hard_exit(status)
  if status in (faults.EXIT_STORAGE, 130, 143):
    # Background writers (Orbax's threads) may still be failing or running:
    # end now, with nothing more printed.
    faults.quiet_exit(status)
  sys.exit(status)


def job_output_dir() -> str:
  return FLAGS.output_dir or 'the output folder'


def run():
  """Entry point of ``scripts/run_experiment.py``."""
  from absl import app
  app.run(main, flags_parser=entry.parse_flags)
