"""FedJAX's ``fedjax.core.in_memory_federated_data`` (0.0.17): the project's
``InMemoryFederatedData``."""

from fedjax_personal.datasets.federated_data import InMemoryFederatedData  # noqa: F401

__all__ = ['InMemoryFederatedData']
