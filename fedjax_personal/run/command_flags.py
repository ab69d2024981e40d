"""The flags of ``scripts/run_experiment.py``, declared: the run's own (data,
layout, outputs, faults) here, and one per field of the shared and
per-algorithm settings classes (``hparam`` fields, ``define_config_flags``).
Only the entry reads their values (``run/cli.py``, into ``settings.Settings``).
"""

import dataclasses

from absl import flags

from fedjax_personal import algorithms as algorithms_lib
from fedjax_personal import datasets as datasets_lib
from fedjax_personal import numerics
from fedjax_personal.config import TrainingConfig, field_types, flag_name
from fedjax_personal.core.population import layout as layout_lib
from fedjax_personal.core.executors import EXECUTOR_NAMES
from fedjax_personal.models import CONV_IMPLS, INITS, MODELS, REFERENCE
from fedjax_personal.run import plots

__all__ = ['algorithm_group', 'define_config_flags', 'FLAGS', 'register', 'SHARED_FLAGS_MODULE']

FLAGS = flags.FLAGS  # where the flags are declared; read by the entry alone (``settings.read``)

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
  field's annotation, help and default from its ``hparam`` declaration.

  Args:
    cls: a settings dataclass.
    module_name: the ``--helpfull`` group.

  Returns:
    None.
  """
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
  """The ``--helpfull`` group of a settings class: the algorithms using it.

  Args:
    cls: a settings class.

  Returns:
    The group's name.
  """
  users = [n for n, s in algorithms_lib.REGISTRY.items() if s.config is cls]
  return f'fedjax_personal: --{cls.prefix}_* settings of ' + ', '.join(users)


define_config_flags(TrainingConfig, SHARED_FLAGS_MODULE)
for _cls in algorithms_lib.config_classes():
  define_config_flags(_cls, algorithm_group(_cls))


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
  prefix = getattr(spec.config, 'prefix', None)
  if prefix and not any(f'{prefix}_{f.name}' in FLAGS for f in dataclasses.fields(spec.config)):
    define_config_flags(spec.config, algorithm_group(spec.config))
