"""FedJAX's ``fedjax.core`` modules under their own names."""

from fedjax_personal.fedjax.core import (
  client_datasets,
  client_samplers,
  dataclasses,
  federated_algorithm,
  federated_data,
  for_each_client,
  in_memory_federated_data,
  metrics,
  models,
  optimizers,
  regularizers,
  serialization,
  sqlite_federated_data,
  tree_util,
  typing,
)

__all__ = [
  'client_datasets',
  'client_samplers',
  'dataclasses',
  'federated_algorithm',
  'federated_data',
  'for_each_client',
  'in_memory_federated_data',
  'metrics',
  'models',
  'optimizers',
  'regularizers',
  'serialization',
  'sqlite_federated_data',
  'tree_util',
  'typing',
]
