"""FedJAX's API (FedJAX 0.0.17) under FedJAX's own names and module paths:
FedJAX's code runs with ``fedjax`` replaced by ``fedjax_personal.fedjax`` in
its imports and nothing else (``import fedjax_personal.fedjax as fedjax``):
its data, models (Haiku ones with the ``fedjax`` extra), optimizers,
metrics, tree utilities, serialization, ``for_each_client`` (with a vmap
backend beside FedJAX's jit one), ``FederatedAlgorithm`` and
its algorithms and ``training``.

The objects are the project's (``fedjax_personal.datasets``: the same
``ClientDataset``, federated data and ``load_data`` that give FedJAX's
arrays, ids, orders and errors on FedJAX's files), with what FedJAX has
beside them: its hyperparameter classes, ``RepeatableIterator``, its client
samplers (the same clients and keys for a seed and round), the SQLite
builder, the ``FederatedData`` interface, and FedJAX's lookup of ids. Every
data set's ``.store`` hands its clients to this project's compiled rounds.
"""

from fedjax_personal.fedjax import (
  aggregators,
  algorithms,
  core,
  datasets,
  models,
  training,
)
from fedjax_personal.fedjax.core import (
  client_samplers,
  metrics,
  optimizers,
  regularizers,
  serialization,
  tree_util,
)
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
from fedjax_personal.fedjax.core.dataclasses import dataclass
from fedjax_personal.fedjax.core.federated_algorithm import FederatedAlgorithm
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
from fedjax_personal.fedjax.core.for_each_client import (
  ForEachClientBackend,
  for_each_client,
  for_each_client_backend,
  get_for_each_client_backend,
  set_for_each_client_backend,
)
from fedjax_personal.fedjax.core.in_memory_federated_data import (
  InMemoryFederatedData,
)
from fedjax_personal.fedjax.core.models import (
  AverageLossEvaluator,
  Model,
  ModelEvaluator,
  create_model_from_haiku,
  create_model_from_stax,
  evaluate_average_loss,
  evaluate_model,
  grad,
  model_grad,
  model_per_example_loss,
)
from fedjax_personal.fedjax.core.optimizers import Optimizer
from fedjax_personal.fedjax.core.sqlite_federated_data import (
  SQLiteFederatedData,
  SQLiteFederatedDataBuilder,
)
from fedjax_personal.fedjax.core.typing import (
  BatchExample,
  BatchPrediction,
  OptState,
  Params,
  PRNGKey,
  PyTree,
  SingleExample,
  SinglePrediction,
)
from fedjax_personal.fedjax.missing import refuse as _refuse

__all__ = [
  'aggregators',
  'algorithms',
  'AverageLossEvaluator',
  'BatchExample',
  'BatchPrediction',
  'create_model_from_haiku',
  'create_model_from_stax',
  'dataclass',
  'evaluate_average_loss',
  'evaluate_model',
  'FederatedAlgorithm',
  'for_each_client',
  'for_each_client_backend',
  'ForEachClientBackend',
  'get_for_each_client_backend',
  'grad',
  'metrics',
  'Model',
  'model_grad',
  'model_per_example_loss',
  'ModelEvaluator',
  'models',
  'Optimizer',
  'optimizers',
  'OptState',
  'Params',
  'PRNGKey',
  'PyTree',
  'regularizers',
  'serialization',
  'set_for_each_client_backend',
  'SingleExample',
  'SinglePrediction',
  'training',
  'tree_util',
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


def __getattr__(name):
  # FedJAX's names not provided here, and misspelled ones: one line each
  raise _refuse('fedjax', name)
