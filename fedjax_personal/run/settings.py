"""The flags of ``scripts/run_experiment.py`` and what they make: the
shared and per-algorithm settings (declared once in the config classes),
their validation, the data configuration, the sampler, the run identity.
``run/job.py`` runs the main job from them; ``run/cli.py`` is the entry.
"""


import dataclasses
import os
from typing import Dict, List

from absl import flags
import jax

from fedjax_personal import algorithms as algorithms_lib
from fedjax_personal import datasets as datasets_lib
from fedjax_personal import numerics
from fedjax_personal.run import plots, run_identity
from fedjax_personal.config import TrainingConfig, field_types, flag_name, validate
from fedjax_personal.errors import ConfigError
from fedjax_personal.core import layout as layout_lib
from fedjax_personal.core.executors import EXECUTOR_NAMES
from fedjax_personal.models import CONV_IMPLS, INITS, MODELS, REFERENCE
from fedjax_personal.core.sampling import CohortSampler

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
flags.DEFINE_enum('conv_impl', 'auto', list(CONV_IMPLS), 'How convolutional models compute '
                  'convolutions and pooling: xla (XLA\'s convolution op), matmul (one matmul '
                  'over shifted slices), tiled (matmul over cache-sized batch chunks) or auto '
                  '(tiled on a CPU, matmul on a GPU/TPU, where a convolution vmapped over '
                  'clients becomes a slow grouped convolution). Same parameters; the same '
                  'numbers up to float reassociation. Recorded in the run identity.')
flags.DEFINE_string('compilation_cache', None, 'JAX\'s persistent compilation cache: a folder, '
                    'or off (default: $FEDJAX_PERSONAL_COMPILATION_CACHE, else <cache>/xla: '
                    '$FEDJAX_PERSONAL_CACHE or ~/.cache/fedjax_personal). A second run of the '
                    'same experiment starts without compiling; entries are keyed by JAX\'s own '
                    'key, never stale; the folder is bounded (least recently used out).')
flags.DEFINE_enum('matmul_precision', numerics.DEFAULT_MATMUL_PRECISION,
                  list(numerics.MATMUL_PRECISIONS), 'Precision of every float32 matmul and '
                  'convolution of the run (JAX\'s jax_default_matmul_precision): float32 (the '
                  'default: the same numbers on every card), tf32 (TensorFloat-32 products, a '
                  'GPU\'s fast default), bf16x3 (three bfloat16 passes, near float32), bf16 (one '
                  'bfloat16 pass, a TPU\'s default), or JAX\'s default / high / highest. '
                  'XLA:CPU computes float32 whatever the setting. Recorded in the run identity.')
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
flags.DEFINE_enum('client_state', 'auto', ['auto', 'memory', 'disk'],
                  'Host layout: where client rows (personal models, control variates, FedDyn '
                  'gradients, persistent client optimizers) live. memory: host memory, all made '
                  'at the start; disk: files under --output_dir/client_rows, a row written when '
                  'its client first trains (a client never met costs nothing); auto: memory '
                  'unless the rows take more than half the available memory.')
flags.DEFINE_enum('cifar100_test', 'split', ['split', 'tff_clients'],
                  "cifar100 (natural): the test clients. split: each train client's images split "
                  "with --test_fraction (personal models have test data); tff_clients: TFF's 100 "
                  'test clients, held out (evaluated with the global model, never trained), '
                  'as Reddi et al. (arXiv 2003.00295) evaluate.')
flags.DEFINE_enum('cifar100_preprocess', 'none', ['none', 'reddi'],
                  'cifar100: the images the model sees. none: as the file holds them (scaled to '
                  '[0, 1]); reddi: a random 24x24 crop and left-right flip of each training '
                  'image (drawn from the run\'s key for each client, round and step), the '
                  'central 24x24 of the others, each standardized, as Reddi et al.\'s task '
                  '(google-research/federated) feeds them.')
flags.DEFINE_enum('stackoverflow_test', 'train_users', ['train_users', 'tff_users'],
                  "stackoverflow: the test set. train_users: the train users' own posts in the "
                  "test file; tff_users: every user of the test file (204,088) held out, their "
                  'pooled posts the test set after 10,000 are taken out for validation, as '
                  "Reddi et al.'s task (google-research/federated) evaluates.")
flags.DEFINE_enum('shakespeare_windows', 'fedjax', ['fedjax', 'tff'],
                  "shakespeare: how snippets become x/y windows. fedjax: a client's snippets "
                  "joined with BOS/EOS and cut into --seq_len (FedJAX's load_data); tff: each "
                  'snippet padded to a multiple of seq_len + 1 and cut into 80/80 pairs, BOS '
                  'never a target, PAD targets in the loss but not in the accuracy (TFF, Reddi '
                  'et al.).')
flags.DEFINE_enum('emnist_pixels', 'fedjax', ['fedjax', 'tff'],
                  'emnist: the pixel convention. fedjax: 1 - pixels, ink 1 (FedJAX\'s '
                  'load_data); tff: the files\' raw pixels, ink 0, as TFF and Reddi et al.\'s '
                  'code feed them.')
flags.DEFINE_bool('verify_store', False, 'Check every block of the population store of a '
                  'natural data set before training (else each block is checked the first time '
                  'a round reads it); a store that fails is rebuilt from its source files.')
flags.DEFINE_bool('rebuild_store', False, 'Rebuild the population store of a natural data set '
                  'from its source files (a store is otherwise rebuilt by itself when its files, '
                  'its format or the loader\'s code changed, or it is damaged).')
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
flags.DEFINE_enum('plots', 'background', list(plots.PLOT_MODES), 'Where accuracy.png and '
                  'client_accuracy_hist.png are drawn: background (a child process that outlives '
                  'the run, so that matplotlib stays off its exit path: the files appear about a '
                  'second after it exits), wait (before the run exits) or off.')
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


def define_config_flags(cls, module_name: str):
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


def algorithm_group(cls) -> str:
  """The ``--helpfull`` group of a settings class: the algorithms using it."""
  users = [n for n, s in algorithms_lib.REGISTRY.items() if s.config is cls]
  return f'fedjax_personal: --{cls.prefix}_* settings of ' + ', '.join(users)


define_config_flags(TrainingConfig, SHARED_FLAGS_MODULE)
for _cls in algorithms_lib.config_classes():
  define_config_flags(_cls, algorithm_group(_cls))


def register(spec) -> None:
  """Adds an algorithm defined outside the package (``AlgorithmSpec``) to
  the registry and defines its config's ``--<prefix>_*`` flags, before the
  flags are parsed (docs/add_an_algorithm.md): ``--algorithm=<its name>``
  then works as for a built-in one."""
  algorithms_lib.register(spec)
  prefix = getattr(spec.config, 'prefix', None)
  if prefix and not any(f'{prefix}_{f.name}' in FLAGS for f in dataclasses.fields(spec.config)):
    define_config_flags(spec.config, algorithm_group(spec.config))

#: The one error type of bad settings (the scripts exit with status 2).
UsageError = ConfigError


def check(cond, flag, msg):
  """Raises ``ConfigError(flag, msg)`` unless ``cond``."""
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
  """An algorithm's settings class filled from its flags."""
  return cls(**{f.name: FLAGS[flag_name(cls, f.name)].value for f in dataclasses.fields(cls)})


def sweepable() -> Dict[str, tuple]:
  """{flag name: (config class, field)} of the settings ``--sweep`` accepts."""
  out = {}
  for cls in [TrainingConfig] + algorithms_lib.config_classes():
    for f in dataclasses.fields(cls):
      if f.metadata.get('sweep'):
        out[flag_name(cls, f.name)] = (cls, f.name)
  return out


def given_fields(cls, swept=()) -> List[str]:
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
  for name in given_fields(TrainingConfig, swept):
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
    for field in given_fields(cls, swept):
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
  check(FLAGS.algorithm, 'algorithm', 'give at least one algorithm')
  for a in FLAGS.algorithm:
    check(a in algorithms_lib.REGISTRY, 'algorithm',
           f'unknown algorithm {a!r}; choose from {list(algorithms_lib.REGISTRY)}')
  check(FLAGS.model in MODELS, 'model', f'unknown model {FLAGS.model!r}; choose from {sorted(MODELS)}')
  check(datasets_lib.is_known(FLAGS.dataset), 'dataset',
         f'unknown dataset {FLAGS.dataset!r}; choose from {list(datasets_lib.DATASETS)} or leaf:<name>')
  check(FLAGS.dataset != 'stackoverflow_held_out', 'dataset',
        'stackoverflow_held_out holds held-out users only, none to train (the held_out value of '
        'datasets.stackoverflow.load_data); train on --dataset=stackoverflow')
  datasets_lib.files.check_data_dir(FLAGS.data_dir)
  check(not FLAGS.data_dir or FLAGS.dataset not in datasets_lib.NO_FILES, 'data_dir',
         f'does nothing: dataset {FLAGS.dataset} reads no file')
  check(not FLAGS.download or FLAGS.dataset not in datasets_lib.NO_FILES + ('mnist',)
         and not FLAGS.dataset.startswith('tfds:'), 'download',
         f'does nothing: dataset {FLAGS.dataset} has no file to download'
         + (' (TFDS data sets: load_tfds(name, download=True))' if FLAGS.dataset.startswith('tfds:')
            else ''))
  check(not (FLAGS['test_fraction'].present
              and datasets_lib.has_own_test_split(FLAGS.dataset, partition(),
                                                  FLAGS.cifar100_test)),
         'test_fraction', f'does nothing: {FLAGS.dataset} has its own test split in its files')
  check(partition() in datasets_lib.PARTITIONS, 'partition',
         f'unknown partition {partition()!r}; choose from {list(datasets_lib.PARTITIONS)}')
  check(FLAGS.num_clients >= 1, 'num_clients', f'must be >= 1, got {FLAGS.num_clients}')
  check(FLAGS.alpha > 0, 'alpha', f'must be > 0, got {FLAGS.alpha}')
  check(FLAGS.rounds >= 1, 'rounds', f'must be >= 1, got {FLAGS.rounds}')
  check(FLAGS.seed >= 0, 'seed', f'must be >= 0, got {FLAGS.seed}')
  check(FLAGS.data_seed is None or FLAGS.data_seed >= 0, 'data_seed',
         f'must be >= 0, got {FLAGS.data_seed}')
  check(FLAGS.classes_per_client >= 1, 'classes_per_client',
         f'must be >= 1, got {FLAGS.classes_per_client}')
  check(FLAGS.num_groups >= 1, 'num_groups', f'must be >= 1, got {FLAGS.num_groups}')
  check(FLAGS.examples_per_client is None or FLAGS.examples_per_client >= 1,
         'examples_per_client', f'must be >= 1, got {FLAGS.examples_per_client}')
  check(FLAGS.target_accuracy is None or 0 < FLAGS.target_accuracy <= 1, 'target_accuracy',
         f'is a fraction in (0, 1] (0.8 for 80%), got {FLAGS.target_accuracy}')
  check(FLAGS.cohort_size is None or FLAGS.participation is None, 'participation',
         'give either --cohort_size or --participation, not both')
  if FLAGS.cohort_size is not None and num_clients() is not None:
    check(1 <= FLAGS.cohort_size <= FLAGS.num_clients, 'cohort_size',
           f'must be in [1, num_clients={FLAGS.num_clients}], got {FLAGS.cohort_size}')
  if FLAGS.participation is not None:
    check(0 < FLAGS.participation <= 1, 'participation',
           f'must be in (0, 1], got {FLAGS.participation}')
  check(FLAGS.sweep_seeds >= 0, 'sweep_seeds', f'must be >= 0, got {FLAGS.sweep_seeds}')
  check(FLAGS.trials >= 1, 'trials', f'must be >= 1, got {FLAGS.trials}')
  check(FLAGS.trials == 1 or not FLAGS.sweep_seeds, 'trials',
         'give --trials (mean ± std rows) or --sweep_seeds (one row per seed), not both')
  check(FLAGS.stat_window >= 1, 'stat_window', f'must be >= 1, got {FLAGS.stat_window}')
  check(0 < FLAGS.dp_delta < 1, 'dp_delta', f'must be in (0, 1), got {FLAGS.dp_delta}')
  check(FLAGS.checkpoint_every >= 0, 'checkpoint_every',
         f'must be >= 0, got {FLAGS.checkpoint_every}')
  check(FLAGS.eval_every >= 0, 'eval_every', f'must be >= 0, got {FLAGS.eval_every}')
  check(FLAGS.block_size is None or FLAGS.block_size >= 1, 'block_size',
         f'must be >= 1, got {FLAGS.block_size}')
  check(not FLAGS['stackoverflow_accuracy'].present or FLAGS.dataset == 'stackoverflow',
         'stackoverflow_accuracy', f'defines the Stack Overflow accuracy; --dataset='
         f'{FLAGS.dataset} has no words to score')
  check(not FLAGS['cifar100_test'].present
         or (FLAGS.dataset == 'cifar100' and partition() == 'natural'), 'cifar100_test',
         f'chooses the natural CIFAR-100\'s test clients; --dataset={FLAGS.dataset} '
         f'--partition={partition()} has none')
  check(FLAGS.cifar100_preprocess == 'none' or FLAGS.dataset == 'cifar100', 'cifar100_preprocess',
        f'crops and standardizes CIFAR-100\'s images; --dataset={FLAGS.dataset} is not CIFAR-100')
  check(not FLAGS['stackoverflow_test'].present or FLAGS.dataset == 'stackoverflow',
        'stackoverflow_test', f'chooses Stack Overflow\'s test set; --dataset={FLAGS.dataset} '
        'is not Stack Overflow')
  check(not FLAGS['shakespeare_windows'].present or FLAGS.dataset == 'shakespeare',
        'shakespeare_windows', f'cuts Shakespeare\'s snippets; --dataset={FLAGS.dataset} has none')
  check(not FLAGS['emnist_pixels'].present or FLAGS.dataset in ('emnist', 'emnist_digits'),
        'emnist_pixels', f'sets EMNIST\'s pixel convention; --dataset={FLAGS.dataset} is not '
        'EMNIST from its FedJAX files')
  check(FLAGS.vocab_size is None or FLAGS.dataset == 'stackoverflow', 'vocab_size',
         f'sets the Stack Overflow vocabulary; --dataset={FLAGS.dataset} has none to set')
  check(FLAGS.vocab_size is None or FLAGS.vocab_size >= 1, 'vocab_size',
         f'must be >= 1, got {FLAGS.vocab_size}')
  check(FLAGS.image_size is None or FLAGS.dataset == 'gldv2', 'image_size',
         f'sets the GLDv2 image size; --dataset={FLAGS.dataset} has its images at their size')
  check(FLAGS.image_size is None or FLAGS.image_size >= 8, 'image_size',
         f'must be >= 8, got {FLAGS.image_size}')
  check(FLAGS.max_client_examples is None or FLAGS.max_client_examples >= 1,
         'max_client_examples', f'must be >= 1, got {FLAGS.max_client_examples}')
  check(0 < FLAGS.test_fraction < 1, 'test_fraction', f'must be in (0, 1), got {FLAGS.test_fraction}')
  check(FLAGS.max_examples is None or FLAGS.max_examples >= 1, 'max_examples',
         f'must be >= 1, got {FLAGS.max_examples}')
  check(FLAGS.test_fraction + val_fraction() < 1, 'val_fraction',
         'test_fraction + val_fraction must be < 1')
  check(0 <= val_fraction() < 1, 'val_fraction', f'must be in [0, 1), got {val_fraction()}')
  check(FLAGS.latent_features in datasets_lib.LATENT_FEATURES, 'latent_features',
         f'unknown value {FLAGS.latent_features!r}; choose from {list(datasets_lib.LATENT_FEATURES)}')
  check(not FLAGS['latent_features'].present or partition() == 'latent_clusters',
         'latent_features', 'applies to --partition=latent_clusters, not '
         f'{partition()!r}')
  check(FLAGS.adapter_dim >= 0, 'adapter_dim', f'must be >= 0, got {FLAGS.adapter_dim}')
  check(not (FLAGS.init_weights and FLAGS['model_init'].present), 'model_init',
         'does nothing with --init_weights (the file gives every initial weight)')
  if FLAGS.init_weights:
    check(os.path.isfile(FLAGS.init_weights), 'init_weights',
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
  """The ``DataConfig`` the flags describe."""
  return datasets_lib.DataConfig(
      dataset=FLAGS.dataset, partition=partition(), num_clients=num_clients(),
      seed=FLAGS.seed if FLAGS.data_seed is None else FLAGS.data_seed, alpha=FLAGS.alpha, classes_per_client=FLAGS.classes_per_client,
      num_groups=FLAGS.num_groups, group_base=FLAGS.group_base,
      latent_features=FLAGS.latent_features,
      examples_per_client=FLAGS.examples_per_client, test_fraction=FLAGS.test_fraction,
      val_fraction=val_fraction(), max_examples=FLAGS.max_examples, data_dir=FLAGS.data_dir,
      download=FLAGS.download, vocab_size=FLAGS.vocab_size, image_size=FLAGS.image_size,
      cifar100_test=FLAGS.cifar100_test, shakespeare_windows=FLAGS.shakespeare_windows,
      emnist_pixels=FLAGS.emnist_pixels, stackoverflow_test=FLAGS.stackoverflow_test)


def partition() -> str:
  """--partition, or 'natural' for a natural data set when it is not given."""
  if not FLAGS['partition'].present and datasets_lib.is_natural(FLAGS.dataset, 'natural'):
    return 'natural'
  return FLAGS.partition


def num_clients():
  """--num_clients; None (all clients) for a natural data set read from
  files when it is not given."""
  if (not FLAGS['num_clients'].present and partition() == 'natural'
      and datasets_lib.natural.is_file_dataset(FLAGS.dataset)):
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
  for field in ('shakespeare_windows', 'emnist_pixels'):
    if cfg[field] == 'fedjax':  # the default before the field existed
      cfg.pop(field)
  if cfg['stackoverflow_test'] == 'train_users':  # the default before the field existed
    cfg.pop('stackoverflow_test')
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


def default_output_dir(identities: dict) -> str:
  """``runs/<data>_<partition>_..._<hash of the configurations>``."""
  algs = '+'.join(identities)
  algs = algs if len(algs) <= 60 else f'{len(identities)}algorithms'
  return os.path.join('runs', f'{FLAGS.dataset.replace(":", "_")}_{partition()}_'
                      f'{FLAGS.model}_n{num_clients() or "all"}_seed{FLAGS.seed}_{algs}_'
                      f'{run_identity.short_hash(identities)}')


def sweep_configs():
  """The sweep's (seed, {name: value}) configurations, or None without a sweep."""
  if not (FLAGS.sweep_seeds or FLAGS.sweep or FLAGS.trials > 1):
    return None
  from fedjax_personal.run import sweep
  values = sweep.parse_sweep(FLAGS.sweep, sweepable())
  seeds = list(range(FLAGS.seed, FLAGS.seed + max(FLAGS.sweep_seeds, FLAGS.trials, 1)))
  return sweep.configs(seeds, values)


def row_label(name: str, config_label) -> str:
  """A table row's label: the algorithm and its swept values."""
  if config_label is None:
    return name
  return f'{name} ' + ' '.join(f'{k}={v:g}' for k, v in config_label.items())


#: This library's flags that may differ between the processes of one run.
PER_PROCESS_FLAGS = ('process_id', 'progress')


def process_flags() -> dict:
  """This library's flags (absl's own left out), as every process must share them."""
  values = FLAGS.flag_values_dict()
  return {f.name: values[f.name] for module, fl in FLAGS.flags_by_module_dict().items()
          if not module.startswith('absl') for f in fl if f.name not in PER_PROCESS_FLAGS}
