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

# builtin enters the built-in data sets into the registry when imported
from fedjax_personal.datasets import (
  builtin,
  in_memory,
  local_files,
  partition,
  registry,
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
  'builtin',
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
