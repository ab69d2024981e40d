"""Federated data sets: a pool partitioned into clients, or a natural data
set's own clients, as ``FederatedData`` or a population store.

Where things are:

- ``config``: ``DataConfig`` (how a data set is built) and ``check_given``;
- ``options``: ``DataOptions``, the base of a data set's own options;
- ``registry``: the data sets' readers and options classes, ``register``;
- ``loading``: ``load_federated``, ``load_store``, ``load_pool``,
  ``pooled_clients``;
- one module per natural data set (``emnist``, ``shakespeare``,
  ``stackoverflow``, ``cifar100``, ``gldv2``, ``leaf``) with FedJAX's
  ``load_data``; ``in_memory`` and ``cifar`` for the pools, ``partition``
  for the partitioners; FedJAX's data objects in ``client_datasets``,
  ``federated_data``, ``store_federated_data`` (over the population store) and
  ``sqlite_federated_data`` (FedJAX's files); the file formats
  (``sqlite_formats``, ``tf_example``), sources and local files.
"""

import functools

from fedjax_personal.datasets import (
  cifar,
  cifar100,
  emnist,
  gldv2,
  in_memory,
  leaf,
  local_files,
  partition,
  registry,
  shakespeare,
  stackoverflow,
  tfds_loader,
)
from fedjax_personal.datasets.config import (
  LATENT_FEATURES,
  DataConfig,
  check_given,
  has_own_test_split,
  is_natural,
  streams_to_store,
)
from fedjax_personal.datasets.loading import (
  PooledClients,
  load_federated,
  load_pool,
  load_store,
  pooled_clients,
)
from fedjax_personal.datasets.natural_data import NaturalData, client_id
from fedjax_personal.datasets.options import DataOptions, NoOptions, TextOptions
from fedjax_personal.datasets.partition import PARTITIONS, Partition
from fedjax_personal.datasets.registry import DATASETS, is_known

__all__ = [
  'check_given',
  'client_id',
  'DataConfig',
  'DataOptions',
  'DATASETS',
  'has_own_test_split',
  'in_memory',
  'is_known',
  'is_natural',
  'LATENT_FEATURES',
  'load_federated',
  'load_pool',
  'load_store',
  'local_files',
  'NaturalData',
  'NoOptions',
  'partition',
  'Partition',
  'PARTITIONS',
  'pooled_clients',
  'PooledClients',
  'registry',
  'streams_to_store',
  'TextOptions',
]

# The built-in data sets' registry entries: each module holds its readers and
# options; the pools (read whole, partitioned by --partition) and the clients
# made in memory (Synthetic, Tiny Shakespeare) are entries of their own.
Pool = registry.Pool
registry.register_builtin('mnist', pool=Pool(in_memory.load_mnist))
registry.register_builtin('digits', pool=Pool(in_memory.load_digits))
registry.register_builtin(
  'cifar10', pool=Pool(functools.partial(cifar.load, 'cifar10'))
)
registry.register_builtin('emnist', emnist.read_clients, emnist.EmnistOptions)
registry.register_builtin(
  'emnist_digits',
  functools.partial(emnist.read_clients, only_digits=True),
  emnist.EmnistOptions,
)
registry.register_builtin(
  'shakespeare', shakespeare.read_clients, shakespeare.ShakespeareOptions
)
registry.register_builtin(
  'stackoverflow',
  stackoverflow.read_clients,
  stackoverflow.StackOverflowOptions,
)
registry.register_builtin(
  'stackoverflow_held_out',
  stackoverflow.read_held_out,
  stackoverflow.StackOverflowOptions,
)
registry.register_builtin(  # its clients (natural), else the archive's pool
  'cifar100',
  cifar100.read_clients,
  cifar100.Cifar100Options,
  pool=Pool(functools.partial(cifar.load, 'cifar100_python')),
)
registry.register_builtin('gldv2', gldv2.read_clients, gldv2.Gldv2Options)
registry.register_builtin(
  'synthetic',
  options=in_memory.SyntheticOptions,
  pool=Pool(in_memory.synthetic_clients, kind='clients'),
)
registry.register_builtin(
  'tinyshakespeare',
  options=TextOptions,
  pool=Pool(in_memory.tinyshakespeare_clients, kind='clients'),
)
registry.register_builtin(
  'tfds:tiny_shakespeare',
  options=TextOptions,
  pool=Pool(tfds_loader.tiny_shakespeare_clients, kind='clients'),
)
registry.TFDS_POOL.append(Pool(tfds_loader.tfds_pool))
registry.LEAF_READER.append(leaf.read_clients)
