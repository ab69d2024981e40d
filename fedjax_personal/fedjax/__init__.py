"""FedJAX's data API (FedJAX 0.0.17) under FedJAX's own names and module
paths: FedJAX's data code runs with ``fedjax`` replaced by
``fedjax_personal.fedjax`` in its imports and nothing else
(``import fedjax_personal.fedjax as fedjax``).

The objects are the project's (``fedjax_personal.datasets``: the same
``ClientDataset``, federated data and ``load_data`` that give FedJAX's
arrays, ids, orders and errors on FedJAX's files), with what FedJAX has
beside them: its hyperparameter classes, ``RepeatableIterator``, its client
samplers (the same clients and keys for a seed and round), the SQLite
builder, the ``FederatedData`` interface, and FedJAX's lookup of ids. Every
data set's ``.store`` hands its clients to this project's compiled rounds.
"""

from fedjax_personal.fedjax import core, datasets
from fedjax_personal.fedjax.core import client_samplers
from fedjax_personal.fedjax.core.client_datasets import (
  EXAMPLE_MASK_KEY,
  BatchHParams,
  BatchPreprocessor,
  ClientDataset,
  PaddedBatchHParams,
  ShuffleRepeatBatchHParams,
  buffered_shuffle_batch_client_datasets,
  padded_batch_client_datasets,
)
from fedjax_personal.fedjax.core.federated_data import (
  ClientId,
  ClientPreprocessor,
  FederatedData,
  FederatedDataBuilder,
  RepeatableIterator,
  SubsetFederatedData,
  padded_batch_federated_data,
  shuffle_repeat_batch_federated_data,
)
from fedjax_personal.fedjax.core.in_memory_federated_data import (
  InMemoryFederatedData,
)
from fedjax_personal.fedjax.core.sqlite_federated_data import (
  SQLiteFederatedData,
  SQLiteFederatedDataBuilder,
)

__all__ = [
  'BatchHParams',
  'BatchPreprocessor',
  'buffered_shuffle_batch_client_datasets',
  'client_samplers',
  'ClientDataset',
  'ClientId',
  'ClientPreprocessor',
  'core',
  'datasets',
  'EXAMPLE_MASK_KEY',
  'FederatedData',
  'FederatedDataBuilder',
  'InMemoryFederatedData',
  'padded_batch_client_datasets',
  'padded_batch_federated_data',
  'PaddedBatchHParams',
  'RepeatableIterator',
  'shuffle_repeat_batch_federated_data',
  'ShuffleRepeatBatchHParams',
  'SQLiteFederatedData',
  'SQLiteFederatedDataBuilder',
  'SubsetFederatedData',
]
