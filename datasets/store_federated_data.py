"""FedJAX's federated data API over the population store: ``FederatedData``,
``load``, and the objects of ``client_datasets`` / ``federated_data`` by
FedJAX's names.

FedJAX 0.0.17's ``<dataset>.load_data`` returns ``FederatedData``: clients
kept by id (bytes), each a ``client_datasets.ClientDataset`` of numpy
examples, preprocessed by one ``ClientPreprocessor`` (per client, with its
id) and one ``BatchPreprocessor`` (per batch) shared by every client. The
data sets read from FedJAX's own files (``emnist``, ``shakespeare``,
``stackoverflow``) give FedJAX's ``SQLiteFederatedData``
(``sqlite_federated_data``); the others (``cifar100``, ``gldv2``, ``leaf``)
give this module's ``FederatedData``, read from the population store the
command line trains on (written once from the publisher's files,
``load_store``). Either way a FedJAX user's cell runs with only the import
changed, and ``.store`` hands the same clients to this project's rounds.
"""

import os
from typing import (
  Callable,
  Iterable,
  Iterator,
  Optional,
  Sequence,
  Tuple,
  Union,
)

import numpy as np

from fedjax_personal.datasets import client_datasets, config, loading, registry
from fedjax_personal.datasets.client_datasets import (  # noqa: F401 (FedJAX's names, here too)
  EXAMPLE_MASK_KEY,
  BatchPreprocessor,
  ClientDataset,
  Examples,
  NoOpBatchPreprocessor,
)
from fedjax_personal.datasets.federated_data import (  # noqa: F401 (FedJAX's names, here too)
  ClientPreprocessor,
  InMemoryFederatedData,
  NoOpClientPreprocessor,
  SubsetFederatedData,
  padded_batch_federated_data,
  shuffle_repeat_batch_federated_data,
)
from fedjax_personal.datasets.natural_data import IGNORE, PAD

__all__ = [
  'data_config',
  'FederatedData',
  'fedjax_targets',
  'HELD_OUT_PREFIX',
  'load',
  'splits',
  'store_of',
  'xy',
]


def _as_bytes(client_id) -> bytes:
  return (
    client_id
    if isinstance(client_id, bytes)
    else str(client_id).encode('utf-8')
  )


class FederatedData:
  """One split of a population store's clients, by id.

  FedJAX's ``FederatedData``; ids are bytes as there, str accepted.

  Args:
    store: a ``core.population.store.PopulationStore``.
    split: ``train``, ``val`` or ``test``.
    rows: the store's rows in this view, in order.
    features: ``(x, y) -> {feature: array}`` of a client's examples.
    preprocess_client: the ``ClientPreprocessor`` of every client.
    preprocess_batch: the ``BatchPreprocessor`` of every client's batches
      (one object, shared, as ``padded_batch_client_datasets`` requires).
    size_rows: the rows ``client_sizes`` lists, in its order (None: ``rows``).
    held_out_prefix: the prefix the store gives held-out test clients' ids
      (``test/<id>``), left out of the ids this view shows: its publisher's.
  """

  def __init__(
    self,
    store,
    split: str,
    rows: Union[Sequence[int], np.ndarray],
    features: Callable[[np.ndarray, np.ndarray], Examples],
    preprocess_client: ClientPreprocessor = NoOpClientPreprocessor,
    preprocess_batch: BatchPreprocessor = NoOpBatchPreprocessor,
    size_rows: Optional[Sequence[int]] = None,
    held_out_prefix: str = '',
  ):
    self._store = store
    self._split = split
    self._rows = np.asarray(rows, np.int64)
    # client_sizes() in the base's order (FedJAX's SubsetFederatedData)
    self._size_rows = (
      self._rows if size_rows is None else np.asarray(size_rows, np.int64)
    )
    self._features = features
    self._preprocess_client = preprocess_client
    self._preprocess_batch = preprocess_batch
    self._prefix = held_out_prefix
    ids = store.client_ids
    self._ids = [self._shown(ids[i]) for i in self._rows]
    self._row_of = dict(zip(self._ids, self._rows.tolist()))

  def _shown(self, store_id) -> bytes:
    """A store id as this view shows it (a held-out client's publisher id)."""
    if self._prefix and str(store_id).startswith(self._prefix):
      store_id = str(store_id)[len(self._prefix) :]
    return _as_bytes(store_id)

  def _with(self, **changes) -> 'FederatedData':
    args = dict(
      store=self._store,
      split=self._split,
      rows=self._rows,
      features=self._features,
      preprocess_client=self._preprocess_client,
      preprocess_batch=self._preprocess_batch,
      size_rows=self._size_rows,
      held_out_prefix=self._prefix,
    )
    args.update(changes)
    return FederatedData(**args)

  @property
  def store(self):
    """The population store of these clients alone (``store.subset``):
    what this project's rounds train on (``store.padded()``,
    ``fedjax_personal.data.to_device``)."""
    return self.store_for(self._ids)

  def store_for(self, client_ids):
    """The population store of some of these clients (``store``).

    Args:
      client_ids: their ids (as this view shows them).

    Returns:
      A ``PopulationStore``.
    """
    return self._store.subset(
      [self._store.client_ids[self._row(c)] for c in client_ids], 'of a slice'
    )

  def num_clients(self) -> int:
    """How many clients."""
    return len(self._ids)

  def client_ids(self) -> Iterator[bytes]:
    """The clients' ids (bytes), in the store's order."""
    return iter(self._ids)

  def client_sizes(self) -> Iterator[Tuple[bytes, int]]:
    """(id, number of examples) of every client (a subset's in its base's order,
    as FedJAX's)."""
    counts, ids = self._store.counts[self._split], self._store.client_ids
    return (
      (self._shown(ids[r]), int(counts[r])) for r in self._size_rows.tolist()
    )

  def client_size(self, client_id) -> int:
    """A client's number of examples (KeyError if it is not here)."""
    return int(self._store.counts[self._split][self._row(client_id)])

  def _row(self, client_id) -> int:
    try:
      return self._row_of[_as_bytes(client_id)]
    except KeyError:
      raise KeyError(client_id) from None

  def _client(self, row: int, client_id: bytes) -> ClientDataset:
    lo = int(self._store.offsets[self._split][row])
    hi = lo + int(self._store.counts[self._split][row])
    x, y, _ = self._store.arrays[self._split]
    examples = self._features(np.asarray(x[lo:hi]), np.asarray(y[lo:hi]))
    return ClientDataset(
      self._preprocess_client(client_id, examples), self._preprocess_batch
    )

  def get_client(self, client_id) -> ClientDataset:
    """One client's examples (KeyError if it is not here)."""
    return self._client(self._row(client_id), _as_bytes(client_id))

  def get_clients(
    self, client_ids: Iterable
  ) -> Iterator[Tuple[bytes, ClientDataset]]:
    """(id, ClientDataset) for each id, in the order given (ids as given)."""
    for c in client_ids:
      yield c, self.get_client(c)

  def clients(self) -> Iterator[Tuple[bytes, ClientDataset]]:
    """(id, ClientDataset) of every client, in the store's order."""
    for c, r in zip(self._ids, self._rows.tolist()):
      yield c, self._client(r, c)

  def shuffled_clients(
    self, buffer_size: int, seed: Optional[int] = None
  ) -> Iterator[Tuple[bytes, ClientDataset]]:
    """Every client, pass after pass forever, each pass shuffled through a
    buffer of ``buffer_size`` clients (``seed`` fixes the order)."""
    rng = np.random.RandomState(seed)
    while True:
      for c, r in client_datasets.buffered_shuffle(
        zip(self._ids, self._rows.tolist()), buffer_size, rng
      ):
        yield c, self._client(r, c)

  def slice(self, start=None, stop=None) -> 'FederatedData':
    """The clients whose ids are >= ``start`` and < ``stop`` (bytes order;
    None: unbounded)."""
    lo = None if start is None else _as_bytes(start)
    hi = None if stop is None else _as_bytes(stop)
    inside = lambda c: (lo is None or c >= lo) and (hi is None or c < hi)
    ids = self._store.client_ids
    return self._with(
      rows=[r for c, r in zip(self._ids, self._rows.tolist()) if inside(c)],
      size_rows=[
        r for r in self._size_rows.tolist() if inside(self._shown(ids[r]))
      ],
    )

  def subset(self, client_ids: Iterable) -> 'FederatedData':
    """The clients named ``client_ids``, as FedJAX's ``SubsetFederatedData``
    makes them: each id once, iterated in sorted order (``client_ids``,
    ``clients``, ``shuffled_clients``), ``client_sizes`` in this view's
    order; an id not here is a ValueError naming up to 10.

    Args:
      client_ids: the ids (bytes, or str).

    Returns:
      The ``FederatedData`` of those clients.

    Raises:
      ValueError: ids not among this view's clients.
    """
    wanted = {_as_bytes(c) for c in client_ids}
    missing = wanted.difference(self._ids)
    if missing:
      raise ValueError(
        'Some client ids are not in the base FederatedData, showing up to 10: '
        f'{sorted(missing)[:10]}'
      )
    return self._with(
      rows=[self._row_of[c] for c in sorted(wanted)],
      size_rows=[
        r for c, r in zip(self._ids, self._rows.tolist()) if c in wanted
      ],
    )

  def preprocess_client(
    self, fn: Callable[[bytes, Examples], Examples]
  ) -> 'FederatedData':
    """A view whose clients' examples pass through ``fn(client_id, examples)``
    too."""
    return self._with(preprocess_client=self._preprocess_client.append(fn))

  def preprocess_batch(
    self, fn: Callable[[Examples], Examples]
  ) -> 'FederatedData':
    """A view whose batches pass through ``fn(examples)`` too."""
    return self._with(preprocess_batch=self._preprocess_batch.append(fn))


def xy(x: np.ndarray, y: np.ndarray) -> Examples:
  """A client's examples as ``{'x', 'y'}`` (FedJAX's feature names).

  Args:
    x: a client's inputs.
    y: its targets.

  Returns:
    ``{'x': x, 'y': y}``.
  """
  return {'x': x, 'y': y}


#: The prefix of a held-out test client's id in the population store
#: (``cifar100`` and ``stackoverflow`` readers: ``test/<its id>``).
HELD_OUT_PREFIX = 'test/'


def splits(
  store, features: Callable[[np.ndarray, np.ndarray], Examples] = xy
) -> Tuple[FederatedData, FederatedData]:
  """``(train, test)`` of a population store: the clients that train
  (every one but the held-out ``eval_only``), and the clients with test
  examples (as a publisher's test file lists them; held-out test clients
  by their publisher's ids, ``test/<id>`` in the store shown as ``<id>``:
  TFF's CIFAR-100 test clients ``0``..``99``).

  Args:
    store: a ``PopulationStore``.
    features: ``(x, y) -> examples`` of a client.

  Returns:
    ``(train, test)`` ``FederatedData``.
  """
  trained = np.arange(store.num_trained)
  tested = np.flatnonzero(np.asarray(store.counts['test']) > 0)
  return (
    FederatedData(store, 'train', trained, features),
    FederatedData(
      store, 'test', tested, features, held_out_prefix=HELD_OUT_PREFIX
    ),
  )


def fedjax_targets(x: np.ndarray, y: np.ndarray) -> Examples:
  """Sequence examples as FedJAX's ``{'x', 'y'}``: padded targets PAD (0)
  there, ``IGNORE`` (-1) in the store.

  Args:
    x: a client's token rows.
    y: its targets (``IGNORE`` where padded).

  Returns:
    ``{'x': x, 'y': y}`` with padded targets PAD.
  """
  return {'x': x, 'y': np.where(y == IGNORE, PAD, y)}


def data_config(
  dataset: str,
  mode: str = 'sqlite',
  cache_dir=None,
  num_clients=None,
  download: bool = True,
  data_dir=None,
  **options,
):
  """The ``DataConfig`` of a ``load_data`` call (FedJAX's arguments, and
  this project's options by their flags' names).

  Args:
    dataset: the ``--dataset`` name.
    mode: ``'sqlite'``.
    cache_dir: where the files are (made when missing and ``download``, as
      FedJAX's).
    num_clients: the first N clients (None: all).
    download: fetch missing files.
    data_dir: the same as ``cache_dir``.
    **options: the data set's options by their flags' names.

  Returns:
    The ``DataConfig``.

  Raises:
    ValueError: a ``mode`` other than ``'sqlite'``, two folders, or a
      missing folder without ``download``.
  """
  cls = registry.options_class(dataset)
  fields = config.option_flags(cls)
  if mode != 'sqlite':
    raise ValueError(
      f"Unsupported mode={mode!r}: the published files are read (mode='sqlite')"
    )
  if cache_dir is not None and data_dir is not None and cache_dir != data_dir:
    raise ValueError('give cache_dir or data_dir (the same folder), not both')
  folder = cache_dir if cache_dir is not None else data_dir
  if folder is not None:
    folder = os.path.expanduser(str(folder))
    if not os.path.isdir(folder):
      if not download:
        raise ValueError(
          f'cache_dir={folder!r} is not a folder (give the folder of the '
          f'files, '
          'or download=True to fetch them there)'
        )
      # as FedJAX's: the files are downloaded into it
      os.makedirs(folder, exist_ok=True)
  return config.DataConfig(
    dataset=dataset,
    partition='natural',
    num_clients=num_clients,
    data_dir=folder,
    download=download,
    options=cls(**{fields[k]: v for k, v in options.items() if v is not None}),
  )


def store_of(cfg, prefix: str = '') -> Callable[[Sequence], object]:
  """``client_ids -> PopulationStore`` of those clients of ``cfg``'s store
  (built once, on the first call: ``load_store``).

  Args:
    cfg: the ``DataConfig`` of the store.
    prefix: what the store puts before these ids (``HELD_OUT_PREFIX`` for
      held-out test clients).

  Returns:
    The function.
  """
  built: list = []

  def of(client_ids):
    if not built:
      built.append(loading.load_store(cfg))
    ids = [
      prefix + (c.decode('utf-8') if isinstance(c, bytes) else str(c))
      for c in client_ids
    ]
    return built[0].subset(ids, 'of a load_data view')

  return of


def load(
  dataset: str,
  mode: str = 'sqlite',
  cache_dir=None,
  num_clients=None,
  download: bool = True,
  data_dir=None,
  features=xy,
  **options,
) -> Tuple[FederatedData, FederatedData]:
  """``(train, test)`` of a natural data set from its population store
  (``splits``; ``load_store``: written once from the files, then reused).

  Args:
    dataset: the ``--dataset`` name.
    mode: FedJAX's; only ``'sqlite'`` (the published files) is read.
    cache_dir: FedJAX's name for where its files are: looked up there
      first (``data_dir``, the older name, is the same).
    num_clients: the first N clients of the files (None: all).
    download: fetch missing files from their published URL (FedJAX always
      does; False: a missing file is one line naming it).
    data_dir: the same as ``cache_dir``.
    features: ``(x, y) -> examples`` of a client.
    **options: the data set's options by their flags' names (``seq_len``,
      ``emnist_pixels``, ...; ``registry.OPTIONS``).

  Returns:
    The train and test ``FederatedData``.
  """
  cfg = data_config(
    dataset, mode, cache_dir, num_clients, download, data_dir, **options
  )
  return splits(loading.load_store(cfg), features)
