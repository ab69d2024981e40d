"""Federated data sets: a pool loader + a partitioner -> FederatedData."""

import dataclasses
import hashlib
import json
import os
import sys
from typing import Optional

import numpy as np

from fedjax_personal.errors import ConfigError
from fedjax_personal.hparams import hparam
from fedjax_personal.core.data import (FederatedData, client_splits, pad_clients,
                                       split_client_examples)
from fedjax_personal.core.population import store as store_lib
from fedjax_personal.datasets import in_memory, local_files, partition
from fedjax_personal.datasets.partition import PARTITIONS, Partition

from fedjax_personal.datasets import readers
from fedjax_personal.datasets.natural_data import NaturalData, client_id

__all__ = ['client_id', 'client_splits', 'ConfigError', 'DataConfig', 'DATASETS', 'FederatedData',
           'has_own_test_split', 'in_memory', 'is_known', 'is_natural', 'LATENT_FEATURES',
           'LEAF_PREFIX', 'load_federated', 'load_pool', 'load_store', 'local_files', 'readers',
           'NaturalData', 'NO_FILES', 'pad_clients', 'partition', 'Partition', 'PARTITIONS',
           'pooled_clients', 'PooledClients', 'split_client_examples', 'store_lib',
           'streams_to_store', 'TEXT_DATASETS']


#: --dataset names; ``leaf:<name>`` is accepted too (LEAF_PREFIX).
DATASETS = ('mnist', 'digits', 'cifar10', 'cifar100', 'emnist', 'emnist_digits', 'shakespeare',
            'stackoverflow', 'gldv2', 'tinyshakespeare', 'synthetic',
            'tfds:mnist', 'tfds:emnist', 'tfds:cifar10', 'tfds:cifar100', 'tfds:tiny_shakespeare')
LEAF_PREFIX = 'leaf:'
LATENT_FEATURES = ('pixels', 'embedding')
#: Natural data sets built in memory (read from files: ``readers.LOADERS``).
POOLED_NATURAL = ('tinyshakespeare', 'synthetic', 'tfds:tiny_shakespeare')
#: Data sets that read no file (--data_dir does nothing for them).
NO_FILES = ('digits', 'synthetic')
#: The data sets whose rows are token windows (--seq_len applies).
TEXT_DATASETS = ('shakespeare', 'stackoverflow', 'tinyshakespeare', 'tfds:tiny_shakespeare')
#: Sequence length of the text data sets when --seq_len is not given.
DEFAULT_SEQ_LEN = {'stackoverflow': 20, 'stackoverflow_held_out': 20}


def is_known(dataset: str) -> bool:
  """Whether ``dataset`` names a data set (a ``DATASETS`` name, ``leaf:<name>``
  or a TFDS name after ``tfds:``).

  Args:
    dataset: a ``--dataset`` name.

  Returns:
    True when it names one.
  """
  if dataset.startswith('tfds:'):  # TFDS's own names: tfds:emnist is its byclass (62 classes)
    from fedjax_personal.datasets import tfds_loader
    return tfds_loader.is_known(dataset[len('tfds:'):])
  return dataset in DATASETS or readers.is_file_dataset(dataset)


def is_natural(dataset: str, partition: str) -> bool:
  """Whether (dataset, partition) reads a natural partition (cifar100 is
  pooled from the CIFAR-100 python archive under any other --partition).

  Args:
    dataset: a ``--dataset`` name.
    partition: a ``--partition`` name.

  Returns:
    True when the clients are the files' own (writers, users).
  """
  if dataset == 'cifar100':
    return partition == 'natural'
  return readers.is_file_dataset(dataset) or dataset in POOLED_NATURAL


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """How to build a federated data set: a pool partitioned into clients, or a
  natural data set's own clients. Each field is declared once with its help
  and range (``hparam``); the command's data flags are generated from them
  (``--dataset``, ``--partition``, ..., the seed as ``--data_seed``), with the
  main job's own defaults where they differ (``run/command_flags.py``).
  """
  dataset: str = hparam('mnist', 'Data set: ' + ', '.join(DATASETS) + ', leaf:<name> (LEAF JSON '
                        'files). Natural data sets (emnist, emnist_digits, shakespeare, '
                        'stackoverflow, cifar100, gldv2, tinyshakespeare, leaf:*) keep one client '
                        'per writer / role / user.')
  partition: str = hparam('dirichlet', 'Partition: ' + ', '.join(PARTITIONS) + ' (the command\'s '
                          'default: natural for the natural data sets, rotation otherwise)')
  num_clients: Optional[int] = hparam(20, 'Number of clients N (a natural data set: its first N '
                                      'clients; all of them when not given).', minimum=1)
  seed: int = hparam(0, 'Seed of the data partition and the per-client splits (the command\'s '
                     'default: --seed). A sweep of seeds (--sweep_seeds) shares one partition, '
                     'that of --data_seed or --seed: configuration s equals the single run '
                     '--seed=s --data_seed=<that seed>.', minimum=0, flag='data_seed')
  alpha: float = hparam(0.4, 'Dirichlet concentration (label skew) / quantity-skew beta.',
                        minimum=0, open_min=True)
  classes_per_client: int = hparam(2, 'Classes per client (pathological, sparse_classes).',
                                   minimum=1)
  num_groups: int = hparam(4, 'Groups (rotation, label_permutation, latent_clusters).', minimum=1)
  latent_features: str = hparam('pixels', "What latent_clusters clusters: 'pixels' or "
                                "'embedding' (penultimate layer of a classifier trained centrally "
                                "on the pool, FedFomo's recipe; datasets/embedding.py).")
  group_base: str = hparam('iid', "Partition inside groups: 'iid' or 'dirichlet' (uses alpha).")
  examples_per_client: Optional[int] = hparam(None, 'sparse_classes: examples per device '
                                              '(default: the most).', minimum=1)
  test_fraction: float = hparam(0.2, 'Per-client test share.', minimum=0, maximum=1,
                                open_min=True, open_max=True)
  val_fraction: float = hparam(0.0, 'Per-client validation share (the command\'s default: 0.1 '
                               'when a requested algorithm needs a validation split, e.g. '
                               'fedfomo, else 0).', minimum=0, maximum=1, open_max=True)
  max_examples: Optional[int] = hparam(None, 'Use at most this many examples of the pool.',
                                       minimum=1)
  synthetic_alpha: float = hparam(1.0, 'synthetic: Synthetic(alpha, beta)\'s model '
                                  'heterogeneity alpha (Li et al., FedProx). As in their '
                                  'generator, u_k ~ N(0, alpha) shifts every entry of W_k and '
                                  'b_k alike, hence every class\'s logit alike: no label '
                                  'changes, so the command has no flag for it.', minimum=0,
                                  command=False)
  synthetic_beta: float = hparam(1.0, 'synthetic: Synthetic(alpha, beta)\'s data heterogeneity '
                                 'beta.', minimum=0)
  seq_len: Optional[int] = hparam(None, 'Text data sets (' + ', '.join(TEXT_DATASETS) + '): the '
                                  'rows\' length in tokens (default: 80 characters, 20 words for '
                                  'stackoverflow).', minimum=1)
  vocab_size: Optional[int] = hparam(None, 'stackoverflow: the vocabulary, its most frequent '
                                     'words (plus PAD, BOS, EOS and one OOV id). Default: 10000, '
                                     'as Reddi et al. and the partial-personalization seed.',
                                     minimum=1)
  image_size: Optional[int] = hparam(None, 'gldv2: the side of the square images, in pixels '
                                     '(resized once, into the population store). Default: 224, '
                                     'as the partial-personalization seed.', minimum=8)
  cifar100_test: str = hparam('split', "cifar100 (natural): the test clients. split: each train "
                              "client's images split with --test_fraction (personal models have "
                              "test data); tff_clients: TFF's 100 test clients, held out "
                              '(evaluated with the global model, never trained), as Reddi et al. '
                              '(arXiv 2003.00295) evaluate.', choices=('split', 'tff_clients'))
  shakespeare_windows: str = hparam('fedjax', "shakespeare: how snippets become x/y windows. "
                                    "fedjax: a client's snippets joined with BOS/EOS and cut into "
                                    "--seq_len (FedJAX's load_data); tff: each snippet padded to "
                                    'a multiple of seq_len + 1 and cut into 80/80 pairs, BOS '
                                    'never a target, PAD targets in the loss but not in the '
                                    'accuracy (TFF, Reddi et al.).', choices=('fedjax', 'tff'))
  emnist_pixels: str = hparam('fedjax', "emnist: the pixel convention. fedjax: 1 - pixels, ink 1 "
                              "(FedJAX's load_data); tff: the files' raw pixels, ink 0, as TFF "
                              "and Reddi et al.'s code feed them.", choices=('fedjax', 'tff'))
  stackoverflow_test: str = hparam('train_users', "stackoverflow: the test set. train_users: the "
                                   "train users' own posts in the test file; tff_users: every "
                                   'user of the test file (204,088) held out, their pooled posts '
                                   'the test set after 10,000 are taken out for validation, as '
                                   "Reddi et al.'s task (google-research/federated) evaluates.",
                                   choices=('train_users', 'tff_users'))
  data_dir: Optional[str] = hparam(None, 'Folder searched first for data files under their '
                                   'published names (then $FEDJAX_PERSONAL_DATA, the package, '
                                   'the cache $FEDJAX_PERSONAL_CACHE or '
                                   '~/.cache/fedjax_personal); must exist.')
  download: bool = hparam(False, "Download the data set's files found nowhere from their "
                          'published URL into the cache (progress bar, size and checksum '
                          'checked).')

  @property
  def sequence_length(self) -> int:
    return self.seq_len or DEFAULT_SEQ_LEN.get(self.dataset, 80)


def load_pool(cfg: DataConfig):
  """(x, y, num_classes) pool of a non-natural data set.

  Args:
    cfg: the data set (``DataConfig``).

  Returns:
    ``(x, y, num_classes)``.
  """
  if cfg.dataset == 'mnist':
    x, y, c = in_memory.load_mnist(cfg.data_dir)
  elif cfg.dataset == 'digits':
    x, y, c = in_memory.load_digits()
  elif cfg.dataset in ('cifar10', 'cifar100'):
    from fedjax_personal.datasets import cifar
    which = 'cifar10' if cfg.dataset == 'cifar10' else 'cifar100_python'
    x, y, c = cifar.load(which, cfg.data_dir, download=cfg.download)
  elif cfg.dataset.startswith('tfds:'):
    from fedjax_personal.datasets.tfds_loader import load_tfds
    x, y, c = load_tfds(cfg.dataset[5:], data_dir=cfg.data_dir, max_examples=cfg.max_examples)
  else:
    raise ConfigError('dataset', f'unknown dataset {cfg.dataset!r}; choose one of {list(DATASETS)}')
  if cfg.max_examples is not None and cfg.max_examples < len(y):
    keep = np.random.default_rng(cfg.seed + 7).permutation(len(y))[:cfg.max_examples]
    x, y = x[np.sort(keep)], y[np.sort(keep)]
  return x, y, c


def make_partition(cfg: DataConfig, x, y, num_classes, rng) -> Partition:
  """The partition named by ``cfg.partition`` of a pool (x, y)."""
  n = cfg.num_clients
  p = cfg.partition
  if p not in PARTITIONS:
    raise ConfigError('partition', f'unknown partition {p!r}; choose one of {list(PARTITIONS)}')
  if p == 'natural':
    raise ConfigError('partition', "partition 'natural' is only for "
                      f"{sorted(readers.LOADERS) + list(POOLED_NATURAL)} and {LEAF_PREFIX}<name>")
  if cfg.latent_features not in LATENT_FEATURES:
    raise ConfigError('latent_features', f'unknown latent_features {cfg.latent_features!r}; '
                      f'choose one of {list(LATENT_FEATURES)}')
  if cfg.latent_features != 'pixels' and p != 'latent_clusters':
    raise ConfigError('latent_features', 'latent_features applies to --partition=latent_clusters, '
                      f'not {p!r}')
  base = None
  if p in ('rotation', 'label_permutation'):
    if cfg.group_base not in ('iid', 'dirichlet'):
      raise ConfigError('group_base', f"group_base must be 'iid' or 'dirichlet', got {cfg.group_base!r}")
    base = (partition.dirichlet(y, n, cfg.alpha, rng) if cfg.group_base == 'dirichlet'
            else partition.iid(y, n, rng))
  if p == 'iid':
    return partition.iid(y, n, rng)
  if p == 'dirichlet':
    return partition.dirichlet(y, n, cfg.alpha, rng)
  if p == 'pathological':
    return partition.pathological(y, n, cfg.classes_per_client, rng)
  if p == 'quantity_skew':
    return partition.quantity_skew(y, n, cfg.alpha, rng)
  if p == 'rotation':
    if x.ndim != 4 or x.shape[1] != x.shape[2]:
      raise ConfigError('partition', f'rotation needs square images, dataset {cfg.dataset} has shape {x.shape[1:]}')
    return partition.rotation_groups(y, n, rng, cfg.num_groups, base)
  if p == 'label_permutation':
    return partition.label_permutation_groups(y, n, num_classes, rng, cfg.num_groups, base)
  if p in ('sparse_classes', 'sparse_classes_permuted'):
    return partition.sparse_classes(y, n, num_classes, cfg.classes_per_client, rng,
                                    cfg.examples_per_client, permute=p.endswith('permuted'))
  if cfg.latent_features == 'embedding':
    from fedjax_personal.datasets import embedding
    x = embedding.semantic_features(x, y, num_classes, cfg.seed)
  return partition.latent_clusters(x, n, cfg.num_groups, rng)


def has_own_test_split(dataset: str, partition: str, cifar100_test: str = 'split') -> bool:
  """Whether the data set's files split each client's examples into train
  and test, or hold the test clients (then --test_fraction does nothing).

  Args:
    dataset: a ``--dataset`` name.
    partition: a ``--partition`` name.
    cifar100_test: ``--cifar100_test``.

  Returns:
    True when the files give the test split.
  """
  return is_natural(dataset, partition) and (dataset.startswith(LEAF_PREFIX) or (
      readers.is_file_dataset(dataset) and (dataset != 'cifar100'
                                            or cifar100_test == 'tff_clients')))


def _check_config(cfg: DataConfig) -> None:
  if cfg.num_clients is not None and cfg.num_clients < 1:
    raise ConfigError('num_clients', f'num_clients must be >= 1, got {cfg.num_clients}')
  for f in ('test_fraction', 'val_fraction'):
    if not 0 <= getattr(cfg, f) < 1:
      raise ConfigError(f, f'{f} must be in [0, 1), got {getattr(cfg, f)}')
  if not is_known(cfg.dataset):
    raise ConfigError('dataset', f'unknown dataset {cfg.dataset!r}; choose one of {list(DATASETS)} '
                      f'or {LEAF_PREFIX}<name>')
  local_files.check_data_dir(cfg.data_dir)
  if is_natural(cfg.dataset, cfg.partition) and cfg.partition not in ('natural', 'dirichlet'):
    # dirichlet is the flag default
    raise ConfigError('partition', f"dataset {cfg.dataset} has a natural partition; use --partition=natural")


def streams_to_store(cfg: DataConfig) -> bool:
  """Whether the data set is read client by client from its files straight
  into a population store (natural data sets with their own test split).

  Args:
    cfg: the data set (``DataConfig``).

  Returns:
    True for a natural data set read from its files with its own test split.
  """
  return has_own_test_split(cfg.dataset, cfg.partition, cfg.cifar100_test)


@dataclasses.dataclass
class PooledClients:
  """A data set built in memory (a partitioned pool, Tiny Shakespeare,
  Synthetic, CIFAR-100 split per client), client by client and unpadded:
  ``padded()`` for the device layout, ``store()`` for the host layout.

  Attributes:
    splits: ``{split: ([x_i], [y_i])}`` (``core.data.client_splits``).
    groups: int32 [N] known groups, or None.
    num_classes, name: as FederatedData's.
    x_spec: (shape, dtype) of one input example; y_shape: of one target.
  """
  splits: dict
  groups: Optional[np.ndarray]
  num_classes: int
  name: str
  x_spec: tuple
  y_shape: tuple = ()

  def _groups(self):
    n = len(self.splits['train'][0])
    return -np.ones(n, np.int32) if self.groups is None else np.asarray(self.groups, np.int32)

  def padded(self) -> FederatedData:
    x_shape, x_dtype = self.x_spec
    out = {k: pad_clients(xs, ys, x_shape, x_dtype, self.y_shape, np.int32)
           for k, (xs, ys) in self.splits.items()}
    return FederatedData(**out, groups=self._groups(), num_classes=self.num_classes,
                         name=self.name)

  def store(self) -> store_lib.PopulationStore:
    return store_lib.PopulationStore.from_clients(self.splits, self._groups(), self.num_classes,
                                                  self.name, self.x_spec, self.y_shape)


def load_federated(cfg: DataConfig) -> FederatedData:
  """Builds the FederatedData described by ``cfg`` (numpy leaves, every
  client padded to the largest: the device layout).

  Args:
    cfg: the data set (``DataConfig``).

  Returns:
    The ``FederatedData`` (host numpy; ``core.data.to_device`` puts it on the device).

  Raises:
    ConfigError / DataError (MissingDataError) naming the flag or file.
  """
  _check_config(cfg)
  if streams_to_store(cfg):
    return load_store(cfg).padded()
  return pooled_clients(cfg).padded()


def pooled_clients(cfg: DataConfig) -> PooledClients:
  """The clients of a data set built in memory (not read client by client
  from its files: ``streams_to_store`` is False), unpadded.

  Args:
    cfg: the data set (``DataConfig``).

  Returns:
    The ``PooledClients``: ``padded()`` for the device layout, ``store()`` for the host layout.
  """
  _check_config(cfg)
  rng = np.random.default_rng(cfg.seed)
  if is_natural(cfg.dataset, cfg.partition):
    if cfg.dataset in ('tinyshakespeare', 'tfds:tiny_shakespeare', 'synthetic'):
      return _pooled_natural(cfg, rng)
    nat = _load_natural(cfg)
    return _split_pool([x for x, _ in nat.train], [y for _, y in nat.train], nat.num_classes,
                       cfg, rng, _natural_name(cfg, nat))
  if cfg.num_clients is None:
    raise ConfigError('num_clients', f'give --num_clients for {cfg.dataset}/{cfg.partition}')
  x, y, num_classes = load_pool(cfg)
  if cfg.num_clients > len(y):
    raise ConfigError('num_clients', f'num_clients={cfg.num_clients} exceeds the {len(y)} examples of {cfg.dataset}')
  part = make_partition(cfg, x, y, num_classes, rng)
  splits = client_splits(x, y, part.client_indices, rng, cfg.test_fraction, cfg.val_fraction,
                         part.client_transform)
  return PooledClients(splits, part.groups, part.num_classes or num_classes,
                       f'{cfg.dataset}/{cfg.partition}', (x.shape[1:], x.dtype), y.shape[1:])


def load_store(cfg: DataConfig, verify: bool = False, should_stop=lambda: False,
               rebuild: bool = False) -> store_lib.PopulationStore:
  """The population store of ``cfg`` (unpadded clients, see
  ``core.population.store``). A natural data set read from its files is written once,
  client by client, into the cache (``stores/``), keyed by what it holds
  (the options and the SHA-256 of each source file, ``local_files.content_digest``);
  any other data set is built in memory (``load_federated``) and stored
  there.

  A cached store that fails its checks (``core.population.store``: checksums, sizes),
  was written by another version of the format or by other loader code
  (``readers.loader_code``), or ``rebuild`` asks, is rebuilt from the source
  files, one line on stderr saying so. Leftovers of builds killed midway are
  removed.

  Args:
    cfg: the data set.
    verify: check every block of the store now (``--verify_store``), not
      as its rows are first read.
    should_stop: asked between clients while a store is built; True stops
      the build (``KeyboardInterrupt``, nothing of it kept).
    rebuild: rebuild the cached store from its files (``--rebuild_store``).

  Returns:
    The ``PopulationStore``.
  """
  _check_config(cfg)
  if not streams_to_store(cfg):  # built in memory, stored without padding
    return pooled_clients(cfg).store()
  nat = _load_natural(cfg)
  added = _added_options(cfg)
  identity = {'dataset': cfg.dataset, 'num_clients': nat.num_clients,
              **({'eval_only': nat.eval_only} if nat.eval_only else {}),
              **({'vocab_size': cfg.vocab_size} if cfg.vocab_size else {}),
              **({'image_size': cfg.image_size} if cfg.image_size else {}),
              **({'windows': cfg.shakespeare_windows} if cfg.shakespeare_windows != 'fedjax'
                 else {}),
              **({'pixels': cfg.emnist_pixels} if cfg.emnist_pixels != 'fedjax' else {}),
              **({'stackoverflow_test': cfg.stackoverflow_test, 'validation_seed': cfg.seed}
                 if cfg.stackoverflow_test != 'train_users' else {}),
              **({'options': added} if added else {}),
              'seq_len': cfg.sequence_length, 'val_fraction': cfg.val_fraction,
              'seed': cfg.seed if cfg.val_fraction else None,
              'files': [(os.path.basename(f), local_files.content_digest(f)) for f in nat.files]}
  digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]
  folder = local_files.cache_dir() / 'stores' / f'{cfg.dataset.replace(":", "_")}-{digest}'
  store_lib.remove_leftovers(folder.parent)  # builds killed midway
  code = readers.loader_code(cfg.dataset)
  if store_lib.is_store(folder):
    written = store_lib.store_format(folder)
    made_by = store_lib.store_identity(folder).get('loader_code')
    if rebuild:
      why = 'rebuilding it as --rebuild_store asks'
    elif written != store_lib.FORMAT:
      why = f'written in format {written!r}, this version reads {store_lib.FORMAT!r}'
    elif made_by != code:
      why = (f'written by other loader code ({made_by or "before loaders were recorded"}, '
             f'this is {code})')
    else:
      try:
        return store_lib.open_store(folder, {**identity, 'loader_code': code}, verify=verify)
      except store_lib.StoreDamaged as e:
        why = e.what
    print(f'{folder}: {why}; rebuilding it from {", ".join(map(str, nat.files))}',
          file=sys.stderr, flush=True)
  writer = store_lib.StoreWriter(folder, {**identity, 'loader_code': code})
  try:
    _write_natural(nat, cfg, writer, should_stop)
    return writer.close(_natural_name(cfg, nat), nat.num_classes, nat.eval_only)
  except BaseException:
    writer.abort()
    raise


#: DataConfig fields given to a reader under their own name when it names
#: them; beside these, ``_reader_options`` gives ``seq_len`` (resolved),
#: ``windows`` and ``pixels``.
_OWN_OPTIONS = ('vocab_size', 'image_size', 'cifar100_test', 'stackoverflow_test', 'seed')
#: DataConfig fields that are not reader options: the partition of a pool, the
#: splits the store draws, where the files are.
_NOT_OPTIONS = ('dataset', 'partition', 'num_clients', 'alpha', 'classes_per_client',
                'num_groups', 'latent_features', 'group_base', 'examples_per_client',
                'test_fraction', 'val_fraction', 'max_examples', 'synthetic_alpha',
                'synthetic_beta', 'seq_len', 'shakespeare_windows', 'emnist_pixels', 'data_dir',
                'download')


def _added_fields(cfg: DataConfig) -> dict:
  """The fields a DataConfig subclass adds for a reader of one's own (BUILD.md,
  "Add a data set"): neither built-in options nor pool settings."""
  return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
          if f.name not in _NOT_OPTIONS + _OWN_OPTIONS}


def _reader_options(cfg: DataConfig) -> dict:
  """Every option of ``cfg`` a natural data set's reader may name: the
  built-in ones and the added fields."""
  return dict(seq_len=cfg.sequence_length, windows=cfg.shakespeare_windows,
              pixels=cfg.emnist_pixels, **{k: getattr(cfg, k) for k in _OWN_OPTIONS},
              **_added_fields(cfg))


def _added_options(cfg: DataConfig) -> dict:
  """The added fields that the data set's reader takes: part of its store's
  identity (a store made with another value is not reused). The built-in
  options are named in the identity one by one."""
  return readers.reader_options(cfg.dataset, _added_fields(cfg))


def _load_natural(cfg: DataConfig) -> NaturalData:
  return readers.load(cfg.dataset, cfg.num_clients, cfg.data_dir, cfg.download,
                      **_reader_options(cfg))


def _natural_name(cfg: DataConfig, nat: NaturalData) -> str:
  n = nat.num_clients - nat.eval_only
  return (f'{cfg.dataset}/natural' + (f' (first {n} of {nat.total_clients:,} clients)'
                                      if n < nat.total_clients else '')
          + (f' + {nat.eval_only} held-out test clients' if nat.eval_only else ''))


def _write_natural(nat: NaturalData, cfg: DataConfig, writer,
                   should_stop=lambda: False) -> None:
  """Writes a natural data set's clients with the files' own test split; a
  validation split (--val_fraction) is drawn from each client's training
  examples (in the file's order within each part)."""
  rng = np.random.default_rng(cfg.seed)
  for cid, (x, y), test, *given_val in nat.stream():  # a reader may give a client's validation
    if should_stop():
      raise KeyboardInterrupt
    tr, va, _ = split_client_examples(len(x), rng, 0.0, cfg.val_fraction)
    tr, va = np.sort(tr), np.sort(va)
    val = (x[va], y[va]) if not given_val or not len(given_val[0][0]) else given_val[0]
    writer.add((x[tr], y[tr]), val, test, client_id=client_id(cid))


def _pooled_natural(cfg: DataConfig, rng) -> PooledClients:
  """Tiny Shakespeare by role and FedProx's synthetic clients: each client's
  examples split with --test_fraction / --val_fraction."""
  n = cfg.num_clients or 20
  if cfg.dataset == 'synthetic':
    xs, ys = in_memory.synthetic(n, cfg.synthetic_alpha, cfg.synthetic_beta, rng)
    num_classes = 10
  else:
    text = None
    if cfg.dataset.startswith('tfds:'):
      from fedjax_personal.datasets.tfds_loader import load_tfds
      text = load_tfds('tiny_shakespeare', data_dir=cfg.data_dir)
    xs, ys, vocab = in_memory.load_tinyshakespeare(n, cfg.sequence_length, data_dir=cfg.data_dir,
                                                 text=text, download=cfg.download)
    num_classes = len(vocab)
  return _split_pool(xs, ys, num_classes, cfg, rng, f'{cfg.dataset}/natural')


def _split_pool(xs, ys, num_classes, cfg, rng, name) -> PooledClients:
  x, y = np.concatenate(xs), np.concatenate(ys)
  offs = np.cumsum([0] + [len(a) for a in xs])
  splits = client_splits(x, y, [np.arange(offs[i], offs[i + 1]) for i in range(len(xs))], rng,
                         cfg.test_fraction, cfg.val_fraction)
  return PooledClients(splits, None, num_classes, name, (x.shape[1:], x.dtype), y.shape[1:])
