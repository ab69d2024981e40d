"""FedJAX's ``SQLiteFederatedData``: a FedJAX SQLite file's clients, read
as FedJAX 0.0.17 reads them (``fedjax/core/sqlite_federated_data.py``).

The data set modules' ``load_data`` for FedJAX's own files (``emnist``,
``shakespeare``, ``stackoverflow``) return these, so a FedJAX user gets
FedJAX's objects to the last detail: the clients of each file in its
``rowid`` order (the test file's clients for the test split, including
clients found only there), ids as the file stores them (bytes), sizes as
the file's ``num_examples`` (before preprocessing), ``slice`` by id range,
``subset`` as ``federated_data.SubsetFederatedData``, and the raw features with
FedJAX's preprocessing chained on (``preprocess_client`` /
``preprocess_batch``). ``.store`` hands the same clients to this project's
rounds (the population store the command line trains on).
"""

import sqlite3
from typing import Callable, Iterable, Iterator, Optional, Tuple

import numpy as np

from fedjax_personal.datasets import (
  client_datasets,
  federated_data,
  sources,
  sqlite_formats,
  store_federated_data,
)
from fedjax_personal.errors import DataError

__all__ = ['open_split', 'SQLiteFederatedData']


def _other_type(client_id):
  """The id as the other of bytes and str (a lookup by either finds a
  client: an extension, FedJAX matches the stored type only)."""
  if isinstance(client_id, bytes):
    try:
      return client_id.decode('utf-8')
    except UnicodeDecodeError:
      return None
  return client_id.encode('utf-8') if isinstance(client_id, str) else None


class SQLiteFederatedData:
  """A FedJAX SQLite file's clients (FedJAX's ``SQLiteFederatedData``).

  Args:
    path: the file (``federated_data(client_id BLOB PRIMARY KEY, data BLOB,
      num_examples INTEGER)``).
    parse_examples: a client's ``data`` blob -> examples (FedJAX's zlib
      msgpack by default).
    start, stop: the ids in ``[start, stop)`` (None: unbounded).
    preprocess_client: the ``federated_data.ClientPreprocessor`` of every
      client.
    preprocess_batch: the ``client_datasets.BatchPreprocessor`` every
      client's batches pass through (one object, shared).
    limit: the first ``limit`` clients of the file alone (None: all; this
      project's ``num_clients``, which FedJAX does not have).
    store_of: ``client_ids -> PopulationStore`` of those clients (``.store``).
    connection: an open connection to ``path`` (the views of one file share
      one).
    exact_ids: an id finds a client only as the file stores it (FedJAX's
      lookup: a str id of a bytes-keyed file is a KeyError); by default the
      other of bytes and str finds it too.
  """

  def __init__(
    self,
    path,
    parse_examples: Callable[[bytes], client_datasets.Examples] = (
      sqlite_formats.decode_client
    ),
    start=None,
    stop=None,
    preprocess_client: federated_data.ClientPreprocessor = federated_data.NoOpClientPreprocessor,
    preprocess_batch: client_datasets.BatchPreprocessor = (
      client_datasets.NoOpBatchPreprocessor
    ),
    limit: Optional[int] = None,
    store_of: Optional[Callable] = None,
    connection: Optional[sqlite3.Connection] = None,
    exact_ids: bool = False,
  ):
    self._path = str(path)
    self._connection = connection or sqlite_formats.fedjax_connection(
      self._path
    )
    self._parse = parse_examples
    self._start, self._stop = start, stop
    self._preprocess_client = preprocess_client
    self._preprocess_batch = preprocess_batch
    self._limit = limit
    self._last_rowid = None
    if limit is not None:
      rows = self._query(
        'SELECT rowid FROM federated_data ORDER BY rowid LIMIT 1 OFFSET ?',
        [max(int(limit) - 1, 0)],
        where=False,
      ).fetchone()
      self._last_rowid = rows[0] if rows and limit > 0 else -1
    self._store_of = store_of
    self._exact_ids = exact_ids

  @classmethod
  def new(
    cls,
    path,
    parse_examples: Callable[[bytes], client_datasets.Examples] = (
      sqlite_formats.decode_client
    ),
  ) -> 'SQLiteFederatedData':
    """Every client of the file at ``path`` (FedJAX's ``new``).

    Args:
      path: a FedJAX SQLite file.
      parse_examples: a client's ``data`` blob -> examples.

    Returns:
      The ``SQLiteFederatedData``.
    """
    return cls(path, parse_examples)

  def _with(self, **changes) -> 'SQLiteFederatedData':
    args = dict(
      path=self._path,
      parse_examples=self._parse,
      start=self._start,
      stop=self._stop,
      preprocess_client=self._preprocess_client,
      preprocess_batch=self._preprocess_batch,
      limit=self._limit,
      store_of=self._store_of,
      connection=self._connection,
      exact_ids=self._exact_ids,
    )
    args.update(changes)
    return SQLiteFederatedData(**args)

  def _query(self, sql: str, params=None, where: bool = True):
    """Runs ``sql`` (``{where}`` replaced by this view's range); a damaged
    file is a DataError naming it."""
    if where:
      clauses = ['(1)']
      if self._start is not None:
        clauses.append('(:start <= client_id)')
      if self._stop is not None:
        clauses.append('(client_id < :stop)')
      if self._last_rowid is not None:
        clauses.append('(rowid <= :last)')
      sql = sql.format(where=' AND '.join(clauses))
      params = {
        'start': self._start,
        'stop': self._stop,
        'last': self._last_rowid,
        **(params or {}),
      }
    try:
      return self._connection.execute(sql, params if params is not None else ())
    except sqlite3.Error as e:
      raise DataError(
        f'{self._path}: unreadable as a FedJAX SQLite file ({e})'
      ) from None

  def _in_range(self, client_id) -> bool:
    try:
      return (self._start is None or self._start <= client_id) and (
        self._stop is None or client_id < self._stop
      )
    # bytes against str: SQLite orders every str before every bytes
    except TypeError:
      return (
        self._start is None
        or isinstance(self._start, str)
        or isinstance(client_id, bytes)
      ) and (
        self._stop is None
        or isinstance(client_id, str)
        or isinstance(self._stop, bytes)
      )

  def _lookup(self, column: str, client_id):
    """``(stored id, column)`` of a client in this view, or None."""
    for cid in (client_id,) + (
      () if self._exact_ids else (_other_type(client_id),)
    ):
      if cid is not None and self._in_range(cid):
        row = self._query(
          f'SELECT client_id, {column} FROM federated_data WHERE {{where}} AND '
          'client_id = :cid',
          {'cid': cid},
        ).fetchone()
        if row is not None:
          return row
    return None

  def _client_dataset(
    self, client_id, data: bytes
  ) -> client_datasets.ClientDataset:
    try:
      examples = self._parse(data)
    except Exception as e:  # noqa: BLE001  (zlib, msgpack: a damaged record)
      raise DataError(
        f'{self._path}: client {client_id!r}: its record is unreadable '
        f'({type(e).__name__}: {e})'
      ) from None
    return client_datasets.ClientDataset(
      self._preprocess_client(client_id, examples), self._preprocess_batch
    )

  @property
  def store(self):
    """The population store of these clients (what this project's rounds
    train on: ``store.padded()``, ``fedjax_personal.data.to_device``), built
    once from the same files under ``load_data``'s options; a client with
    no training examples there (a test-only client) is a DataError."""
    return self.store_for(list(self.client_ids()))

  def store_for(self, client_ids):
    """The population store of some of these clients (``store``).

    Args:
      client_ids: their ids.

    Returns:
      A ``PopulationStore``.
    """
    if self._store_of is None:
      raise AttributeError(
        f'{self._path}: this view has no population store (made by hand; '
        "a data set's load_data gives one)"
      )
    return self._store_of(list(client_ids))

  def num_clients(self) -> int:
    """How many clients."""
    return int(
      self._query(
        'SELECT COUNT(*) FROM federated_data WHERE {where}'
      ).fetchone()[0]
    )

  def client_ids(self) -> Iterator[bytes]:
    """The clients' ids, in the file's order."""
    for (cid,) in self._query(
      'SELECT client_id FROM federated_data WHERE {where} ORDER BY rowid'
    ):
      yield cid

  def client_sizes(self) -> Iterator[Tuple[bytes, int]]:
    """``(id, num_examples)`` of every client, in the file's order (the
    file's count, before any preprocessing)."""
    for cid, n in self._query(
      'SELECT client_id, num_examples FROM federated_data WHERE {where} '
      'ORDER BY rowid'
    ):
      yield cid, n

  def client_size(self, client_id) -> int:
    """A client's ``num_examples`` (KeyError if it is not here)."""
    row = self._lookup('num_examples', client_id)
    if row is None:
      raise KeyError(client_id)
    return row[1]

  def _read_clients(self) -> Iterator[Tuple[bytes, bytes]]:
    yield from self._query(
      'SELECT client_id, data FROM federated_data WHERE {where} ORDER BY rowid'
    )

  def clients(self) -> Iterator[Tuple[bytes, client_datasets.ClientDataset]]:
    """``(id, ClientDataset)`` of every client, in the file's order."""
    for cid, data in self._read_clients():
      yield cid, self._client_dataset(cid, data)

  def shuffled_clients(
    self, buffer_size: int, seed: Optional[int] = None
  ) -> Iterator[Tuple[bytes, client_datasets.ClientDataset]]:
    """Every client, pass after pass forever, each pass shuffled through a
    buffer of ``buffer_size`` clients (``numpy.random.RandomState(seed)``)."""
    rng = np.random.RandomState(seed)
    while True:
      for cid, data in client_datasets.buffered_shuffle(
        self._read_clients(), buffer_size, rng
      ):
        yield cid, self._client_dataset(cid, data)

  def get_client(self, client_id) -> client_datasets.ClientDataset:
    """One client (KeyError if it is not here)."""
    row = self._lookup('data', client_id)
    if row is None:
      raise KeyError(client_id)
    return self._client_dataset(row[0], row[1])

  def get_clients(
    self, client_ids: Iterable
  ) -> Iterator[Tuple[bytes, client_datasets.ClientDataset]]:
    """``(id, ClientDataset)`` for each id, in the order given."""
    for client_id in client_ids:
      yield client_id, self.get_client(client_id)

  def slice(self, start=None, stop=None) -> 'SQLiteFederatedData':
    """The clients with ids in ``[start, stop)`` of this view's range."""
    if self._start is not None and (start is None or start < self._start):
      start = self._start
    if self._stop is not None and (stop is None or stop > self._stop):
      stop = self._stop
    return self._with(start=start, stop=stop)

  def subset(
    self, client_ids: Iterable
  ) -> 'federated_data.SubsetFederatedData':
    """The clients named ``client_ids`` (bytes or str), as FedJAX's
    ``SubsetFederatedData`` (each once, sorted; an unknown id a ValueError)."""
    stored = set(self.client_ids())
    as_stored = lambda c: (
      c
      if (self._exact_ids or c in stored or _other_type(c) not in stored)
      else _other_type(c)
    )
    return federated_data.SubsetFederatedData(
      self, [as_stored(c) for c in client_ids]
    )

  def with_exact_ids(self) -> 'SQLiteFederatedData':
    """This view with FedJAX's lookup of ids: only as the file stores them.

    Returns:
      The ``SQLiteFederatedData``.
    """
    return self._with(exact_ids=True)

  def preprocess_client(self, fn) -> 'SQLiteFederatedData':
    """A view whose clients' examples pass through ``fn(client_id, examples)``
    too."""
    return self._with(preprocess_client=self._preprocess_client.append(fn))

  def preprocess_batch(self, fn) -> 'SQLiteFederatedData':
    """A view whose batches pass through ``fn(examples)`` too."""
    return self._with(preprocess_batch=self._preprocess_batch.append(fn))


def open_split(
  cfg,
  file_name: str,
  preprocess_client=(),
  preprocess_batch=(),
  source: Optional[str] = None,
) -> SQLiteFederatedData:
  """One of a data set's FedJAX files as FedJAX's ``load_split`` opens it,
  its preprocessing chained on, ``.store`` the population store of
  ``cfg`` (``store_federated_data.data_config``).

  Args:
    cfg: the ``DataConfig`` of the ``load_data`` call.
    file_name: the file (``sources.FILES[cfg.dataset]``).
    preprocess_client: ``(client_id, examples) -> examples`` functions.
    preprocess_batch: ``examples -> examples`` functions.
    source: the ``sources.FILES`` entry holding ``file_name`` (None:
      ``cfg.dataset``'s).

  Returns:
    The file's clients (the first ``cfg.num_clients`` when given).
  """
  path = sources.fetch(
    source or cfg.dataset, cfg.data_dir, cfg.download, which=[file_name]
  )[file_name]
  return SQLiteFederatedData(
    path,
    limit=cfg.num_clients,
    preprocess_client=federated_data.ClientPreprocessor(preprocess_client),
    preprocess_batch=client_datasets.BatchPreprocessor(preprocess_batch),
    store_of=store_federated_data.store_of(cfg),
  )
