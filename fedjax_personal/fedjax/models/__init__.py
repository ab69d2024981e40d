"""FedJAX's model zoo (``fedjax.models``): each ``create_*_model`` with
FedJAX's layers, Haiku's initialization, FedJAX's loss and metrics (Haiku
models need ``pip install 'fedjax_personal[fedjax]'``)."""

from fedjax_personal.fedjax.missing import refuse as _refuse
from fedjax_personal.fedjax.models import (
  cifar100,
  emnist,
  shakespeare,
  stackoverflow,
  toy_regression,
)

__all__ = [
  'cifar100',
  'emnist',
  'shakespeare',
  'stackoverflow',
  'toy_regression',
]


def __getattr__(name):
  # FedJAX's names not provided here, and misspelled ones: one line each
  raise _refuse('fedjax.models', name)
