"""FedJAX's ``fedjax.core.federated_data`` (0.0.17): ``FederatedData`` as
the interface every federated data set of the project satisfies (its
store-backed splits, ``InMemoryFederatedData``, ``SubsetFederatedData``,
``SQLiteFederatedData``), ``RepeatableIterator`` and
``FederatedDataBuilder``; the rest is the project's
(``fedjax_personal.datasets.federated_data``)."""

import abc
import functools
from typing import Any, Callable, Iterable, Iterator

from fedjax_personal.datasets import sqlite_federated_data, store_federated_data
from fedjax_personal.datasets.federated_data import (  # noqa: F401  (FedJAX's names)
  ClientPreprocessor,
  InMemoryFederatedData,
  NoOpClientPreprocessor,
  SubsetFederatedData,
  padded_batch_federated_data,
  shuffle_repeat_batch_federated_data,
)

__all__ = [
  'ClientId',
  'ClientPreprocessor',
  'FederatedData',
  'FederatedDataBuilder',
  'NoOpClientPreprocessor',
  'padded_batch_federated_data',
  'RepeatableIterator',
  'shuffle_repeat_batch_federated_data',
  'SubsetFederatedData',
  'with_exact_ids',
  'with_exact_ids_of',
]

#: A client's id: bytes, as FedJAX's.
ClientId = bytes


class FederatedData(abc.ABC):
  """FedJAX's ``FederatedData`` interface.

  FedJAX's ``FederatedData``: ``num_clients``, ``client_ids``,
  ``client_sizes``, ``client_size``, ``clients``, ``shuffled_clients``,
  ``get_clients``, ``get_client``, ``slice``, ``preprocess_client``,
  ``preprocess_batch``. The project's federated data classes are
  registered as its subclasses, so ``isinstance(fd, FederatedData)``
  holds for each."""


for _cls in (
  store_federated_data.FederatedData,
  InMemoryFederatedData,
  SubsetFederatedData,
  sqlite_federated_data.SQLiteFederatedData,
):
  FederatedData.register(_cls)


class RepeatableIterator:
  """An iterator that starts over after each pass.

  FedJAX's: values of the first pass are kept (a list, tuple, dict, str or
  bytes is iterated again as it is), and when a pass ends (``StopIteration``)
  the next ``next()`` starts the next pass. Stateful: finish one pass before
  another reader starts one.

  Args:
    base: the iterable.
  """

  def __init__(self, base: Iterable[Any]):
    repeatable = isinstance(base, (list, tuple, dict, str, bytes))
    self._first_pass = not repeatable
    self._iter = iter(base)
    self._buf: Any = base if repeatable else []

  def __iter__(self) -> Iterator[Any]:
    return self

  def __next__(self) -> Any:
    try:
      value = next(self._iter)
    except StopIteration:
      self._first_pass = False
      self._iter = iter(self._buf)
      raise
    if self._first_pass:
      self._buf.append(value)
    return value


class FederatedDataBuilder(abc.ABC):
  """FedJAX's interface of a federated data file writer.

  A context manager that writes ``(client id, examples)`` pairs to a file
  format (FedJAX's interface; ``SQLiteFederatedDataBuilder`` writes
  FedJAX's SQLite files)."""

  @abc.abstractmethod
  def __enter__(self):
    """Returns the builder."""

  @abc.abstractmethod
  def __exit__(self, exc_type, exc_value, exc_traceback):
    """Finishes the file."""

  @abc.abstractmethod
  def add_many(self, client_ids_examples: Iterable) -> None:
    """Adds ``(client id, examples)`` pairs."""


def with_exact_ids(loaded):
  """``load_data`` / ``load_split``'s result with FedJAX's lookup of ids: each
  ``SQLiteFederatedData`` in it finds a client only by the id as its file
  stores it (a str id of a bytes-keyed file is a KeyError, as in FedJAX).

  Args:
    loaded: a federated data object, or a tuple of them.

  Returns:
    The same shape, each object that can be made exact made so.
  """
  if isinstance(loaded, tuple):
    return tuple(with_exact_ids(x) for x in loaded)
  return (
    loaded.with_exact_ids() if hasattr(loaded, 'with_exact_ids') else loaded
  )


def with_exact_ids_of(load: Callable) -> Callable:
  """A data set's ``load_data`` / ``load_split`` (``load``) whose result has
  FedJAX's lookup of ids (``with_exact_ids``), its signature and doc kept.

  Args:
    load: the project's loader.

  Returns:
    The FedJAX loader.
  """

  @functools.wraps(load)
  def loaded(*args, **kwargs):
    return with_exact_ids(load(*args, **kwargs))

  return loaded
