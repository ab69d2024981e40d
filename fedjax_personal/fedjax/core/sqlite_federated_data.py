"""FedJAX's ``fedjax.core.sqlite_federated_data`` (0.0.17): the project's
``SQLiteFederatedData`` (FedJAX's reading of its files) and
``SQLiteFederatedDataBuilder``, which writes them as FedJAX does."""

import sqlite3
from typing import Iterable, Tuple

from fedjax_personal.datasets import sqlite_formats
from fedjax_personal.datasets.client_datasets import Examples, num_examples
from fedjax_personal.datasets.sqlite_federated_data import SQLiteFederatedData  # noqa: F401
from fedjax_personal.fedjax.core.federated_data import FederatedDataBuilder

__all__ = ['SQLiteFederatedData', 'SQLiteFederatedDataBuilder']


class SQLiteFederatedDataBuilder(FederatedDataBuilder):
  """Writes a FedJAX SQLite file.

  FedJAX's builder: the table ``federated_data(client_id, data,
  num_examples)`` made when the builder is, each added client one row (``data``
  its zlib msgpack examples), the file closed when the ``with`` block ends.

  Args:
    path: the file (created; FedJAX's builder fails on an existing table).
  """

  def __init__(self, path: str):
    self._connection = sqlite3.connect(path)
    self._connection.execute(sqlite_formats.FEDJAX_TABLE)
    self._connection.commit()

  def __enter__(self) -> 'SQLiteFederatedDataBuilder':
    return self

  def __exit__(self, exc_type, exc_value, exc_traceback) -> None:
    self._connection.close()

  def add_many(
    self, client_ids_examples: Iterable[Tuple[bytes, Examples]]
  ) -> None:
    """Adds clients, one row each, in the order given.

    Args:
      client_ids_examples: ``(client id, examples)`` pairs (every feature
        the same number of rows).

    Returns:
      None.
    """
    rows = (
      (cid, sqlite_formats.encode_client(ex), num_examples(ex, validate=True))
      for cid, ex in client_ids_examples
    )
    self._connection.executemany(
      'INSERT INTO federated_data VALUES (?, ?, ?);', rows
    )
    self._connection.commit()
