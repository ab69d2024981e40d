"""FedJAX's ``fedjax.core`` data modules under their own names."""

from fedjax_personal.fedjax.core import (
  client_datasets,
  client_samplers,
  federated_data,
  in_memory_federated_data,
  sqlite_federated_data,
)

__all__ = [
  'client_datasets',
  'client_samplers',
  'federated_data',
  'in_memory_federated_data',
  'sqlite_federated_data',
]
