"""FedJAX's ``fedjax.datasets``: each data set's ``load_data`` /
``load_split`` and preprocessing under FedJAX's module names."""

from fedjax_personal.fedjax.datasets import (
  cifar100,
  emnist,
  shakespeare,
  stackoverflow,
)

__all__ = ['cifar100', 'emnist', 'shakespeare', 'stackoverflow']
