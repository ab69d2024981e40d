"""FedJAX's federated data objects that do not depend on where the clients
are kept (``fedjax/core/federated_data.py`` and ``in_memory_federated_data.py``
of FedJAX 0.0.17): the ``ClientPreprocessor`` every view chains, FedJAX's
``SubsetFederatedData`` and ``InMemoryFederatedData``, and the functions
that batch a whole federated data set as one (evaluation over every
client, a centralized baseline's stream).
"""

from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Tuple

import numpy as np

from fedjax_personal.core.population.clients import PopulationStore
from fedjax_personal.datasets import client_datasets
from fedjax_personal.datasets.client_datasets import (
  BatchPreprocessor,
  ClientDataset,
  Examples,
  NoOpBatchPreprocessor,
)

__all__ = [
  'ClientPreprocessor',
  'InMemoryFederatedData',
  'NoOpClientPreprocessor',
  'padded_batch_federated_data',
  'shuffle_repeat_batch_federated_data',
  'SubsetFederatedData',
]

ClientId = bytes


class ClientPreprocessor:
  """A chain of functions on a client's examples and its id.

  FedJAX's ``ClientPreprocessor``.

  Args:
    fns: ``(client_id, examples) -> examples`` functions, applied in order
      to a copy of the examples.
  """

  def __init__(
    self, fns: Iterable[Callable[[ClientId, Examples], Examples]] = ()
  ):
    self._fns = tuple(fns)

  def __call__(self, client_id: ClientId, examples: Examples) -> Examples:
    if not self._fns:
      return examples
    out: Examples = dict(examples)
    for f in self._fns:
      out = f(client_id, out)
    client_datasets.assert_consistent_rows(out)
    return out

  def append(
    self, fn: Callable[[ClientId, Examples], Examples]
  ) -> 'ClientPreprocessor':
    """A new ClientPreprocessor with ``fn`` added to the end."""
    return ClientPreprocessor(self._fns + (fn,))

  def __str__(self) -> str:
    return f'ClientPreprocessor({self._fns})'

  __repr__ = __str__


#: The client preprocessor that does nothing.
NoOpClientPreprocessor = ClientPreprocessor()


class SubsetFederatedData:
  """Some clients of a federated data set, by id.

  FedJAX's ``SubsetFederatedData``: each id once, iterated in sorted order;
  ``client_sizes`` in the base's order.

  Args:
    base: the federated data set (any with FedJAX's methods).
    client_ids: the ids, each among ``base``'s.
    validate: check that they are (a ValueError naming up to 10 otherwise).
  """

  def __init__(
    self, base, client_ids: Iterable[ClientId], validate: bool = True
  ):
    self._base = base
    ids = client_ids if isinstance(client_ids, set) else set(client_ids)
    if validate:
      bad = ids.difference(base.client_ids())
      if bad:
        raise ValueError(
          'Some client ids are not in the base FederatedData, showing up to '
          '10: '
          f'{sorted(bad)[:10]}'
        )
    self._client_ids = ids

  @property
  def store(self):
    """The population store of these clients (``base.store`` of them)."""
    return self._base.store_for(sorted(self._client_ids))

  def store_for(self, client_ids):
    """The population store of some of these clients (``base.store_for``).

    Args:
      client_ids: their ids.

    Returns:
      A ``PopulationStore``.
    """
    return self._base.store_for(client_ids)

  def slice(self, start=None, stop=None) -> 'SubsetFederatedData':
    """The ids in ``[start, stop)``."""
    inside = lambda c: (
      (start is None or start <= c) and (stop is None or c < stop)
    )
    return SubsetFederatedData(
      self._base.slice(start, stop),
      {c for c in self._client_ids if inside(c)},
      validate=False,
    )

  def subset(self, client_ids: Iterable) -> 'SubsetFederatedData':
    """Some of these clients (each once, sorted)."""
    return SubsetFederatedData(self, client_ids)

  def num_clients(self) -> int:
    """How many clients."""
    return len(self._client_ids)

  def client_ids(self) -> Iterator[ClientId]:
    """The ids, sorted."""
    return iter(sorted(self._client_ids))

  def client_sizes(self) -> Iterator[Tuple[ClientId, int]]:
    """``(id, size)`` of these clients, in the base's order."""
    for client_id, size in self._base.client_sizes():
      if client_id in self._client_ids:
        yield client_id, size

  def client_size(self, client_id) -> int:
    """A client's size (KeyError if it is not here)."""
    if client_id not in self._client_ids:
      raise KeyError(client_id)
    return self._base.client_size(client_id)

  def clients(self) -> Iterator[Tuple[ClientId, ClientDataset]]:
    """``(id, ClientDataset)`` of every client, in sorted order."""
    yield from self.get_clients(sorted(self._client_ids))

  def shuffled_clients(
    self, buffer_size: int, seed: Optional[int] = None
  ) -> Iterator[Tuple[ClientId, ClientDataset]]:
    """Every client, pass after pass forever, each pass shuffled through a
    buffer of ``buffer_size``."""
    rng = np.random.RandomState(seed)
    while True:
      yield from client_datasets.buffered_shuffle(
        self.clients(), buffer_size, rng
      )

  def get_clients(
    self, client_ids: Iterable
  ) -> Iterator[Tuple[ClientId, ClientDataset]]:
    """``(id, ClientDataset)`` for each id, in the order given (KeyError
    for one not here)."""
    for client_id, dataset in self._base.get_clients(client_ids):
      if client_id not in self._client_ids:
        raise KeyError(client_id)
      yield client_id, dataset

  def get_client(self, client_id) -> ClientDataset:
    """One client (KeyError if it is not here)."""
    if client_id not in self._client_ids:
      raise KeyError(client_id)
    return self._base.get_client(client_id)

  def preprocess_client(self, fn) -> 'SubsetFederatedData':
    """A view whose clients pass through ``fn(client_id, examples)`` too."""
    return SubsetFederatedData(
      self._base.preprocess_client(fn), self._client_ids, validate=False
    )

  def preprocess_batch(self, fn) -> 'SubsetFederatedData':
    """A view whose batches pass through ``fn(examples)`` too."""
    return SubsetFederatedData(
      self._base.preprocess_batch(fn), self._client_ids, validate=False
    )


class InMemoryFederatedData:
  """A federated data set whose clients are already in memory.

  Clients already in memory (FedJAX's ``InMemoryFederatedData``):
  ``{client_id: {feature: array}}``, ids iterated sorted; ``.store`` the
  population store of their ``x`` / ``y`` (integer labels) for this
  project's rounds.

  Args:
    client_to_data_mapping: ``{client_id: {feature: array}}``, the same
      features for every client.
    preprocess_client: the ``ClientPreprocessor`` of every client.
    preprocess_batch: the ``BatchPreprocessor`` of every client's batches.

  Raises:
    ValueError: clients with other features, or features of unequal rows.
  """

  def __init__(
    self,
    client_to_data_mapping,
    preprocess_client: ClientPreprocessor = (NoOpClientPreprocessor),
    preprocess_batch: BatchPreprocessor = NoOpBatchPreprocessor,
  ):
    self._preprocess_client = preprocess_client
    self._preprocess_batch = preprocess_batch
    self._data = client_to_data_mapping
    self._client_ids = sorted(self._data)
    self._features = (
      list(self._data[self._client_ids[0]]) if self._client_ids else []
    )
    for client_id in self._client_ids:
      if list(self._data[client_id]) != self._features:
        raise ValueError(
          f'Inconsistent features, got {list(self._data[client_id])} for '
          f'client '
          f'{client_id}, expect {self._features}'
        )
      try:
        client_datasets.assert_consistent_rows(
          self._client_dataset(client_id).all_examples()
        )
      except ValueError as exc:
        raise ValueError(
          f'Inconsistent examples, for client {client_id}'
        ) from exc

  def _client_dataset(self, client_id) -> ClientDataset:
    return ClientDataset(
      self._preprocess_client(client_id, self._data[client_id]),
      self._preprocess_batch,
    )

  def _with(self, data=None, **changes) -> 'InMemoryFederatedData':
    args: Dict[str, Any] = dict(
      preprocess_client=self._preprocess_client,
      preprocess_batch=self._preprocess_batch,
    )
    args.update(changes)
    return InMemoryFederatedData(self._data if data is None else data, **args)

  @property
  def store(self):
    """The population store of these clients (their ``x`` and integer ``y``
    as the train split; no test split: ``--test_fraction`` splits them)."""
    return self.store_for(self._client_ids)

  def store_for(self, client_ids):
    """The population store of some of these clients (``store``).

    Args:
      client_ids: their ids.

    Returns:
      A ``PopulationStore``.
    """
    ids = list(client_ids)
    xs = [np.asarray(self._data[c]['x']) for c in ids]
    ys = [np.asarray(self._data[c]['y']) for c in ids]
    empty = ([x[:0] for x in xs], [y[:0] for y in ys])
    classes = int(max((int(y.max()) for y in ys if y.size), default=0)) + 1
    return PopulationStore.from_clients(
      {'train': (xs, ys), 'val': empty, 'test': empty},
      np.zeros(len(ids), np.int32),
      classes,
      f'{len(ids)} clients in memory',
      (xs[0].shape[1:], xs[0].dtype),
      ys[0].shape[1:],
      client_ids=[c.decode() if isinstance(c, bytes) else str(c) for c in ids],
    )

  def slice(self, start=None, stop=None) -> 'InMemoryFederatedData':
    """The clients with ids in ``[start, stop)``."""
    inside = lambda c: (
      (start is None or c >= start) and (stop is None or c < stop)
    )
    return self._with({c: self._data[c] for c in self._client_ids if inside(c)})

  def subset(self, client_ids: Iterable) -> SubsetFederatedData:
    """Some of these clients, as FedJAX's ``SubsetFederatedData``."""
    return SubsetFederatedData(self, client_ids)

  def num_clients(self) -> int:
    """How many clients."""
    return len(self._client_ids)

  def client_ids(self) -> Iterator:
    """The ids, sorted."""
    return iter(self._client_ids)

  def client_sizes(self) -> Iterator[Tuple]:
    """``(id, examples after preprocess_client)`` of every client."""
    for c in self._client_ids:
      yield c, self.client_size(c)

  def client_size(self, client_id) -> int:
    """A client's examples (after ``preprocess_client``)."""
    return client_datasets.num_examples(
      self._client_dataset(client_id).all_examples(), validate=False
    )

  def clients(self) -> Iterator[Tuple]:
    """``(id, ClientDataset)`` of every client, sorted by id."""
    yield from self.get_clients(self._client_ids)

  def shuffled_clients(
    self, buffer_size: int, seed: Optional[int] = None
  ) -> Iterator[Tuple]:
    """Every client, pass after pass forever, each pass shuffled through a
    buffer of ``buffer_size``."""
    rng = np.random.RandomState(seed)
    while True:
      yield from client_datasets.buffered_shuffle(
        self.clients(), buffer_size, rng
      )

  def get_clients(self, client_ids: Iterable) -> Iterator[Tuple]:
    """``(id, ClientDataset)`` for each id, in the order given."""
    for c in client_ids:
      yield c, self._client_dataset(c)

  def get_client(self, client_id) -> ClientDataset:
    """One client (KeyError if it is not here)."""
    return self._client_dataset(client_id)

  def preprocess_client(self, fn) -> 'InMemoryFederatedData':
    """A view whose clients pass through ``fn(client_id, examples)`` too."""
    return self._with(preprocess_client=self._preprocess_client.append(fn))

  def preprocess_batch(self, fn) -> 'InMemoryFederatedData':
    """A view whose batches pass through ``fn(examples)`` too."""
    return self._with(preprocess_batch=self._preprocess_batch.append(fn))


def padded_batch_federated_data(
  fd, hparams=None, **kwargs
) -> Iterator[Examples]:
  """Every client's examples in padded batches across clients' edges, in
  ``fd.clients()`` order (FedJAX's ``padded_batch_federated_data``): the
  whole federated data set evaluated as one.

  Args:
    fd: a federated data set.
    hparams: an object with ``batch_size`` / ``num_batch_size_buckets``.
    **kwargs: the same fields, overriding ``hparams``.

  Yields:
    Preprocessed batches, each with ``EXAMPLE_MASK_KEY``.
  """
  yield from client_datasets.padded_batch_client_datasets(
    (dataset for _, dataset in fd.clients()), hparams, **kwargs
  )


def shuffle_repeat_batch_federated_data(
  fd,
  batch_size: int,
  client_buffer_size: int,
  example_buffer_size: int,
  seed: Optional[int] = None,
) -> Iterator[Examples]:
  """Batches of every client's examples forever, shuffled at two levels
  (clients through ``client_buffer_size``, then examples through
  ``example_buffer_size``): FedJAX's ``shuffle_repeat_batch_federated_data``,
  for a centralized baseline.

  Args:
    fd: a federated data set.
    batch_size: examples per batch.
    client_buffer_size: clients in the first buffer.
    example_buffer_size: examples in the second.
    seed: fixes the order (None: unseeded).

  Yields:
    Preprocessed batches.
  """
  rng = np.random.RandomState(seed)
  datasets = (
    dataset
    for _, dataset in fd.shuffled_clients(
      client_buffer_size, rng.randint(1 << 32)
    )
  )
  yield from client_datasets.buffered_shuffle_batch_client_datasets(
    datasets, batch_size=batch_size, buffer_size=example_buffer_size, rng=rng
  )
