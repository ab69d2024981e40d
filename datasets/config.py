"""``DataConfig``: how a federated data set is built, declared once.

The fields every data set shares (which data set, how a pool is
partitioned into clients, the per-client splits, where the files are) and
``options``, the data set's own options (its registered class,
``options.DataOptions``). ``check_given`` refuses a setting the command gave
that does nothing for the data set chosen, from the declarations alone.
"""

import dataclasses
from typing import Collection, List, Optional

from fedjax_personal.datasets import local_files, registry
from fedjax_personal.datasets.options import DataOptions
from fedjax_personal.datasets.partition import PARTITIONS
from fedjax_personal.errors import ConfigError
from fedjax_personal.hparams import (
  Declared,
  fill_options,
  flag_fields,
  flag_name,
  hparam,
)

__all__ = [
  'check_given',
  'DataConfig',
  'has_own_test_split',
  'is_natural',
  'LATENT_FEATURES',
  'option_flags',
  'in_memory_clients',
  'streams_to_store',
]


LATENT_FEATURES = ('pixels', 'embedding')


@dataclasses.dataclass(frozen=True)
class DataConfig(Declared):
  """How to build a federated data set.

  A pool partitioned into clients, or a
  natural data set's own clients. Each field is declared once with its help
  and range (``hparam``); the command's data flags are generated from them
  (``--dataset``, ``--partition``, ..., the seed as ``--data_seed``), with the
  main job's own defaults where they differ (``run/experiment_flags.py``), and
  from the fields of each data set's options class.

  Attributes:
    options: the data set's own options, an instance of its registered class
      (``registry.options_class``); None: that class's defaults.
  """

  dataset: str = hparam(
    'mnist',
    'Data set: ' + ', '.join(registry.DATASETS) + ', leaf:<name> (LEAF JSON '
    'files). Natural data sets (emnist, emnist_digits, shakespeare, '
    'stackoverflow, cifar100, gldv2, tinyshakespeare, leaf:*) keep one client '
    'per writer / role / user.',
  )
  partition: str = hparam(
    'dirichlet',
    'Partition: ' + ', '.join(PARTITIONS) + " (the command's "
    'default: natural for the natural data sets, rotation otherwise)',
  )
  num_clients: Optional[int] = hparam(
    20,
    'Number of clients N (a natural data set: its first N '
    'clients; all of them when not given).',
    minimum=1,
  )
  seed: int = hparam(
    0,
    "Seed of the data partition and the per-client splits (the command's "
    'default: --seed). A sweep of seeds (--sweep_seeds) shares one partition, '
    'that of --data_seed or --seed: configuration s equals the single run '
    '--seed=s --data_seed=<that seed>.',
    minimum=0,
    flag='data_seed',
  )
  alpha: float = hparam(
    0.4,
    'Dirichlet concentration (label skew) / quantity-skew beta.',
    minimum=0,
    open_min=True,
  )
  classes_per_client: int = hparam(
    2, 'Classes per client (pathological, sparse_classes).', minimum=1
  )
  num_groups: int = hparam(
    4, 'Groups (rotation, label_permutation, latent_clusters).', minimum=1
  )
  latent_features: str = hparam(
    'pixels',
    "What latent_clusters clusters: 'pixels' or "
    "'embedding' (penultimate layer of a classifier trained centrally "
    "on the pool, FedFomo's recipe; datasets/embedding.py).",
  )
  group_base: str = hparam(
    'iid', "Partition inside groups: 'iid' or 'dirichlet' (uses alpha)."
  )
  examples_per_client: Optional[int] = hparam(
    None, 'sparse_classes: examples per device (default: the most).', minimum=1
  )
  test_fraction: float = hparam(
    0.2,
    'Per-client test share.',
    minimum=0,
    maximum=1,
    open_min=True,
    open_max=True,
  )
  val_fraction: float = hparam(
    0.0,
    "Per-client validation share (the command's default: 0.1 "
    'when a requested algorithm needs a validation split, e.g. '
    'fedfomo, else 0).',
    minimum=0,
    maximum=1,
    open_max=True,
  )
  max_examples: Optional[int] = hparam(
    None, 'Use at most this many examples of the pool.', minimum=1
  )
  data_dir: Optional[str] = hparam(
    None,
    'Folder searched first for data files under their '
    'published names (then $FEDJAX_PERSONAL_DATA, the package, '
    'the cache $FEDJAX_PERSONAL_CACHE or '
    '~/.cache/fedjax_personal); must exist.',
  )
  download: bool = hparam(
    False,
    "Download the data set's files found nowhere from their "
    'published URL into the cache (progress bar, size and checksum '
    'checked).',
  )
  options: DataOptions = hparam(
    None,
    "The data set's own options (its registered class; None: "
    'its defaults); their flags are its fields.',
    command=False,
  )

  def __post_init__(self):
    fill_options(self, 'dataset', registry.options_class(self.dataset))
    super().__post_init__()

  def check(self) -> None:
    """Names a data set, partition and features know; settings that depend
    on each other."""
    if not registry.is_known(self.dataset):
      raise ConfigError(
        'dataset',
        f'unknown dataset {self.dataset!r}; choose from '
        f'{registry.names()} or {registry.LEAF_PREFIX}<name>',
      )
    for name, known in (
      ('partition', PARTITIONS),
      ('latent_features', LATENT_FEATURES),
      ('group_base', ('iid', 'dirichlet')),
    ):
      if getattr(self, name) not in known:
        raise ConfigError(
          name,
          f'unknown {name} {getattr(self, name)!r}; choose from {list(known)}',
        )
    if self.test_fraction + self.val_fraction >= 1:
      raise ConfigError(
        'val_fraction', 'test_fraction + val_fraction must be < 1'
      )
    if self.latent_features != 'pixels' and self.partition != 'latent_clusters':
      raise ConfigError(
        'latent_features',
        f'applies to --partition=latent_clusters, not {self.partition!r}',
      )


def option_flags(cls) -> dict:
  """{flag: field} of an options class's fields that have a flag.

  Args:
    cls: an ``options.DataOptions`` class.

  Returns:
    ``{flag name: field name}``.
  """
  return {flag_name(cls, f.name): f.name for f in flag_fields(cls)}


def check_given(cfg: DataConfig, given: Collection[str]) -> None:
  """Refuses what the command gave that does nothing for ``cfg``'s data set,
  from the declarations: an option of another data set, a folder or a
  download for a data set without files, a test share for one whose files
  split each client; then the data set's own check of its options
  (``DataOptions.check_given``).

  Args:
    cfg: the ``DataConfig``.
    given: the names of the flags the command gave.

  Returns:
    None.

  Raises:
    ConfigError naming the flag.
  """
  if cfg.dataset in registry.HELD_OUT_ONLY:
    raise ConfigError('dataset', registry.HELD_OUT_ONLY[cfg.dataset])
  own = option_flags(type(cfg.options))
  for cls in registry.option_classes():
    for flag in option_flags(cls):
      if flag in given and flag not in own:
        users = [
          n
          for n, c in registry.OPTIONS.items()
          if flag in option_flags(c) and n not in registry.HELD_OUT_ONLY
        ]
        raise ConfigError(
          flag,
          f'an option of --dataset={"/".join(users)}, not of '
          f'--dataset={cfg.dataset}',
        )
  local_files.check_data_dir(cfg.data_dir)
  # a data set read whole: its reader says what applies
  pool = (
    None
    if is_natural(cfg.dataset, cfg.partition)
    and registry.is_file_dataset(cfg.dataset)
    else registry.pool_of(cfg.dataset)
  )
  if cfg.data_dir and pool is not None and not pool.takes('data_dir'):
    raise ConfigError(
      'data_dir', f'does nothing: dataset {cfg.dataset} reads no file'
    )
  if cfg.download and pool is not None and not pool.takes('download'):
    raise ConfigError(
      'download',
      f'does nothing: dataset {cfg.dataset} has no file to download'
      + (
        ' (TFDS data sets: load_tfds(name, download=True))'
        if cfg.dataset.startswith('tfds:')
        else ''
      ),
    )
  if 'test_fraction' in given and has_own_test_split(cfg):
    raise ConfigError(
      'test_fraction',
      f'does nothing: {cfg.dataset} has its own test split in its files',
    )
  cfg.options.check_given(cfg, given)


def in_memory_clients() -> List[str]:
  """The data sets whose clients are made in memory by their reader
  (``registry.Pool``'s ``kind='clients'``), not read from files.

  Returns:
    The names.
  """
  return [n for n, p in registry.POOLS.items() if p.kind == 'clients']


def is_natural(dataset: str, partition: str) -> bool:
  """Whether (dataset, partition) reads a natural partition (cifar100 is
  pooled from the CIFAR-100 python archive under any other --partition).

  Args:
    dataset: a ``--dataset`` name.
    partition: a ``--partition`` name.

  Returns:
    True when the clients are the files' own (writers, users).
  """
  pool = registry.pool_of(dataset)
  if registry.is_file_dataset(dataset) and pool is not None:
    return partition == 'natural'  # its clients, else its pool (CIFAR-100)
  return registry.is_file_dataset(dataset) or (
    pool is not None and pool.kind == 'clients'
  )


def has_own_test_split(cfg: DataConfig) -> bool:
  """Whether the data set's files split each client's examples into train
  and test, or hold the test clients (then --test_fraction does nothing).

  Args:
    cfg: the data set.

  Returns:
    True when the files give the test split.
  """
  return is_natural(cfg.dataset, cfg.partition) and (
    cfg.dataset.startswith(registry.LEAF_PREFIX)
    or (
      registry.is_file_dataset(cfg.dataset) and cfg.options.files_split_test()
    )
  )


def streams_to_store(cfg: DataConfig) -> bool:
  """Whether the data set is read client by client from its files straight
  into a population store (natural data sets with their own test split).

  Args:
    cfg: the data set (``DataConfig``).

  Returns:
    True for a natural data set read from its files with its own test split.
  """
  return has_own_test_split(cfg)
