"""The two SQLite formats federated data sets are published in.

- FedJAX (``fedjax/core/sqlite_federated_data.py``): one row per client,
  ``federated_data(client_id BLOB PRIMARY KEY, data BLOB, num_examples
  INTEGER)``, ``data`` the zlib-compressed msgpack of a dict of arrays in
  FedJAX's encoding (``fedjax/core/serialization.py``: numeric arrays are
  msgpack ext type 1 holding ``(shape, dtype name, C-order bytes)``, arrays of
  bytes ext type 4 holding ``(shape, flat list of bytes)``, NumPy scalars
  ext type 3). Clients are read in ``rowid`` order, as FedJAX does.
- TensorFlow Federated: one row per example,
  ``examples(split_name, client_id, serialized_example_proto)`` plus
  ``client_metadata(client_id, split_name, num_examples)``; each example is
  a serialized ``tf.train.Example``, parsed here without TensorFlow
  (``datasets/tf_example.py``, a reader of the proto's wire format).
"""

import sqlite3
import zlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

import msgpack
import numpy as np

from fedjax_personal.datasets import tf_example
from fedjax_personal.errors import DataError

__all__ = [
  'decode_client',
  'encode_client',
  'FEDJAX_TABLE',
  'fedjax_connection',
  'fedjax_num_clients',
  'fedjax_sizes',
  'parse_example',
  'read_fedjax',
  'read_tff',
  'tff_num_clients',
  'write_fedjax',
]


_EXT_NDARRAY, _EXT_COMPLEX, _EXT_SCALAR, _EXT_BYTES_NDARRAY = 1, 2, 3, 4


def _ndarray(data: bytes) -> np.ndarray:
  shape, dtype, buffer = msgpack.unpackb(data, raw=True)
  return np.frombuffer(buffer, dtype=np.dtype(dtype.decode())).reshape(shape)


def _ext_hook(code: int, data: bytes):
  if code == _EXT_NDARRAY:
    return _ndarray(data)
  if code == _EXT_SCALAR:
    return _ndarray(data)[()]
  if code == _EXT_BYTES_NDARRAY:
    shape, flat = msgpack.unpackb(data, raw=True)
    out = np.empty(len(flat), dtype=object)
    out[:] = flat
    return out.reshape(shape)
  if code == _EXT_COMPLEX:
    re, im = msgpack.unpackb(data)
    return complex(re, im)
  raise ValueError(f'unknown msgpack extension type {code}')


def decode_client(blob: bytes) -> Dict[str, np.ndarray]:
  """One client's examples from a FedJAX ``data`` blob.

  Args:
    blob: the zlib-compressed msgpack of a dict of arrays (FedJAX's encoding).

  Returns:
    ``{feature: array}``.
  """
  return msgpack.unpackb(zlib.decompress(blob), ext_hook=_ext_hook, raw=False)


def _pack(x):
  """FedJAX's msgpack ext types (``serialization.py``): 1 a numeric array,
  4 an array of bytes, 3 a NumPy scalar."""
  if isinstance(x, np.ndarray) and x.dtype == object:
    return msgpack.ExtType(
      _EXT_BYTES_NDARRAY,
      msgpack.packb((x.shape, list(x.flatten())), use_bin_type=True),
    )
  if isinstance(x, np.ndarray):
    return msgpack.ExtType(
      _EXT_NDARRAY,
      msgpack.packb((x.shape, x.dtype.name, x.tobytes('C')), use_bin_type=True),
    )
  if isinstance(x, np.generic):
    a = np.asarray(x)
    return msgpack.ExtType(
      _EXT_SCALAR,
      msgpack.packb((a.shape, a.dtype.name, a.tobytes('C')), use_bin_type=True),
    )
  raise TypeError(f'FedJAX files hold arrays, not {type(x).__name__}')


def encode_client(examples) -> bytes:
  """A client's ``data`` blob as FedJAX writes it: the zlib-compressed
  msgpack of its examples (``decode_client``'s inverse).

  Args:
    examples: ``{feature: array}``.

  Returns:
    The blob.
  """
  return zlib.compress(
    msgpack.packb(dict(examples), default=_pack, strict_types=True)
  )


#: FedJAX's table of clients (``SQLiteFederatedDataBuilder``).
FEDJAX_TABLE = (
  'CREATE TABLE federated_data (client_id BLOB NOT NULL PRIMARY KEY, '
  'data BLOB NOT NULL, num_examples INTEGER NOT NULL);'
)


def write_fedjax(path, clients) -> None:
  """A FedJAX SQLite file, as FedJAX's ``SQLiteFederatedDataBuilder``
  writes it: one row per client in the order given, ``data`` the zlib
  msgpack of its examples, ``num_examples`` their rows.

  Args:
    path: the file to write (it must not exist).
    clients: ``(client_id, {feature: array})`` pairs (ids as they are kept:
      bytes, or str as FedJAX keeps TFF's).

  Returns:
    None.
  """
  conn = sqlite3.connect(str(path))
  try:
    conn.execute(FEDJAX_TABLE)
    conn.executemany(
      'INSERT INTO federated_data VALUES (?, ?, ?);',
      (
        (cid, encode_client(ex), len(next(iter(ex.values()))))
        for cid, ex in clients
      ),
    )
    conn.commit()
  finally:
    conn.close()


def _connect(path) -> sqlite3.Connection:
  try:
    return sqlite3.connect(f'file:{path}?mode=ro', uri=True)
  except sqlite3.Error as e:
    raise DataError(f'{path}: cannot open as SQLite ({e})') from None


def _tables(conn, path) -> List[str]:
  try:
    return [
      r[0]
      for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
    ]
  except sqlite3.Error as e:
    raise DataError(
      f'{path}: not an SQLite database ({e}); if it was downloaded, delete it '
      f'and '
      'download it again (--download)'
    ) from None


def fedjax_connection(path) -> sqlite3.Connection:
  """A read-only connection to a FedJAX SQLite file.

  Args:
    path: the file.

  Returns:
    The open connection.

  Raises:
    DataError: not an SQLite file, or without the ``federated_data`` table
      (naming it).
  """
  conn = _connect(path)
  if 'federated_data' not in _tables(conn, path):
    conn.close()
    raise DataError(
      f'{path}: no federated_data table: not a FedJAX SQLite file'
    )
  return conn


def read_fedjax(
  path, limit: Optional[int] = None, client_ids: Optional[List[bytes]] = None
) -> Iterator[Tuple[bytes, Dict[str, np.ndarray]]]:
  """Clients of a FedJAX SQLite file: ``(client_id, {feature: array})``.

  Args:
    path: the file.
    limit: read at most this many clients (in the file's order).
    client_ids: read only these clients, in this order (absent ones yield
      an empty dict).

  Yields:
    ``(client_id, {feature: array})`` per client.

  Raises:
    DataError naming the file when it is not in FedJAX's format.
  """
  conn = fedjax_connection(path)
  try:
    try:
      if client_ids is not None:
        for cid in client_ids:
          row = conn.execute(
            'SELECT data FROM federated_data WHERE client_id = ?', [cid]
          ).fetchone()
          yield cid, (decode_client(row[0]) if row else {})
        return
      query = 'SELECT client_id, data FROM federated_data ORDER BY rowid'
      if limit is not None:
        query += f' LIMIT {int(limit)}'
      for cid, blob in conn.execute(query):
        yield (
          (cid.encode() if isinstance(cid, str) else bytes(cid)),
          decode_client(blob),
        )
    except (
      sqlite3.Error,
      zlib.error,
      ValueError,
      msgpack.ExtraData,
      msgpack.FormatError,
      msgpack.StackError,
      TypeError,
    ) as e:
      raise DataError(
        f'{path}: a client record is unreadable ({type(e).__name__}: {e}): '
        'corrupted or not a FedJAX SQLite file'
      ) from None
  finally:
    conn.close()


def fedjax_num_clients(path) -> int:
  """The number of clients of a FedJAX SQLite file.

  Args:
    path: the file.

  Returns:
    The count.

  Raises:
    DataError: not a FedJAX SQLite file (naming it).
  """
  conn = fedjax_connection(path)
  try:
    return int(
      conn.execute('SELECT COUNT(*) FROM federated_data').fetchone()[0]
    )
  finally:
    conn.close()


def fedjax_sizes(path) -> np.ndarray:
  """Every client's ``num_examples`` of a FedJAX SQLite file, in the file's
  order (the table's column: no record is decoded).

  Args:
    path: the file.

  Returns:
    int64 [clients].
  """
  conn = fedjax_connection(path)
  try:
    rows = conn.execute(
      'SELECT num_examples FROM federated_data ORDER BY rowid'
    ).fetchall()
    return np.asarray([r[0] for r in rows], np.int64)
  except sqlite3.Error as e:
    raise DataError(f'{path}: cannot read num_examples ({e})') from None
  finally:
    conn.close()


# -- TFF SQLite and tf.train.Example ------------------------------------------


def parse_example(
  serialized: bytes, shapes: Dict[str, tuple]
) -> Dict[str, tf_example.Value]:
  """The features named in ``shapes`` of one serialized tf.train.Example.

  Args:
    serialized: the proto's bytes.
    shapes: {feature: shape} (as ``tf.io.FixedLenFeature``); int64 and
      float lists are reshaped to it, a bytes list gives its bytes.

  Returns:
    ``{feature: array}``.
  """
  features = tf_example.parse(serialized)
  out: Dict[str, Any] = {}
  for name, shape in shapes.items():
    if name not in features:
      raise ValueError(f'feature {name!r} missing')
    values = features[name]
    out[name] = values if isinstance(values, list) else values.reshape(shape)
  return out


def tff_num_clients(path, split: str) -> int:
  """The number of clients of a TFF SQLite file's ``split``.

  Args:
    path: the file.
    split: the split's name.

  Returns:
    The count.

  Raises:
    DataError: not a TFF SQLite file (naming it).
  """
  conn = _connect(path)
  try:
    missing = {'examples', 'client_metadata'} - set(_tables(conn, path))
    if missing:
      raise DataError(
        f'{path}: no {" or ".join(sorted(missing))} table: not a TFF SQLite '
        f'file'
      )
    return int(
      conn.execute(
        'SELECT COUNT(*) FROM client_metadata WHERE split_name = ?', [split]
      ).fetchone()[0]
    )
  finally:
    conn.close()


def read_tff(
  path, split: str, shapes: Dict[str, tuple], limit: Optional[int] = None
) -> Iterator[Tuple[str, Dict[str, np.ndarray]]]:
  """Clients of one split of a TFF SQLite file, in client-id order (as
  FedJAX's ``TFFSQLiteClientsIterator``): ``(client_id, {feature: [n,
    *shape]})``.

  Args:
    path: the file.
    split: the split's name.
    shapes: ``{feature: shape}``.
    limit: read at most this many clients.

  Yields:
    ``(client_id, {feature: [n, *shape]})`` per client.

  Raises:
    DataError naming the file when it is not in TFF's format.
  """
  conn = _connect(path)
  try:
    missing = {'examples', 'client_metadata'} - set(_tables(conn, path))
    if missing:
      raise DataError(
        f'{path}: no {" or ".join(sorted(missing))} table: not a TFF SQLite '
        f'file'
      )
    try:
      query = 'SELECT client_id FROM client_metadata WHERE split_name = ? ORDER BY client_id'
      if limit is not None:
        query += f' LIMIT {int(limit)}'
      for (cid,) in conn.execute(query, [split]).fetchall():
        rows = conn.execute(
          'SELECT serialized_example_proto FROM examples WHERE split_name = ? '
          'AND client_id = ? ORDER BY rowid',
          [split, cid],
        ).fetchall()
        parsed = [parse_example(r[0], shapes) for r in rows]
        yield (
          cid,
          {
            k: np.stack([p[k] for p in parsed])
            if parsed
            else np.zeros((0,) + shapes[k])
            for k in shapes
          },
        )
    except (
      sqlite3.Error,
      ValueError,
      TypeError,
      IndexError,
      OverflowError,
    ) as e:
      raise DataError(
        f'{path}: an example is unreadable ({type(e).__name__}: {e}): '
        f'corrupted '
        'or not a TFF SQLite file of tf.train.Example rows'
      ) from None
  finally:
    conn.close()
