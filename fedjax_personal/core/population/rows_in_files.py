"""Client rows on disk, each made the first time its client trains.

The host layout's client rows (``rows_in_memory``) can live in files instead
of host memory: one sparse file per state leaf, ``[N, row]`` fixed-size rows
read and written by index with ``os.pread`` / ``os.pwrite`` (a cohort's rows
only; the OS page cache is the in-memory cache). A row is written when its
client first trains (its round's new row is scattered back), so a client
never met costs no disk: the file is sparse until then. Until a row is
written, reading it gives the value the memory layout holds for it, made
from the algorithm's ``init`` with the same key (``RowMaker``): evaluating a
client never trained stores nothing and uses that value (the global model
for Ditto's personal model, zeros for SCAFFOLD's control). The numbers are
those of rows in memory (tested), whenever a row is made.

Each leaf marks the rows written since the last checkpoint (``dirty``): a
checkpoint saves those alone (``run/row_checkpoints.py``).

``DiskRows`` is indexed as the numpy arrays it stands for are
(``rows[idx]``, ``rows[idx] = new`` with a 1-D index array), so
``rows_in_memory.gather_rows`` / ``scatter_rows`` and the engine use it as
they use memory rows.
"""

import os
from typing import List, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal.core.population.rows_in_memory import (
  HostedState,
  cpu_device,
  state_without_rows,
)

__all__ = ['disk_bytes', 'DiskRows', 'init_on_disk', 'RowMaker']


#: Clients whose initial rows one call of ``RowMaker`` makes: a cohort's in
#: a few calls of one compiled program per leaf, each holding 8 rows.
MADE_PER_CALL = 8


class RowMaker:
  """Makes the initial client rows of any clients.

  The initial rows of any clients: ``init(key)``'s client rows at the
  given indices, one leaf at a time, on the CPU backend (one compiled
  program per leaf, ``MADE_PER_CALL`` clients a call; XLA reads a
  broadcast's rows without making the rest, and computes only the leaf
  asked for). Nothing is kept between calls: a cohort's new rows are made
  once, leaf by leaf, as the gather reads them.
  """

  def __init__(self, init, client_rows, key):
    self._cpu = cpu_device()
    self._key = jax.device_put(key, self._cpu)

    def rows_at(k, idx, leaf):
      return jax.tree.leaves(client_rows.get(init(k)))[leaf][idx]

    self._fn = jax.jit(rows_at, static_argnums=2)

  @property
  def key_data(self) -> List[int]:
    """The key's data (what a checkpoint records of the rows not written)."""
    return [int(v) for v in np.asarray(jax.random.key_data(self._key)).ravel()]

  def rekey(self, key_data: List[int]) -> None:
    """Makes rows from the key whose data is ``key_data`` (a checkpoint's)."""
    data = np.asarray(key_data, np.uint32).reshape(
      jax.random.key_data(self._key).shape
    )
    key = jax.random.wrap_key_data(
      jnp.asarray(data), impl=jax.random.key_impl(self._key)
    )
    self._key = jax.device_put(key, self._cpu)

  def __call__(
    self, idx: np.ndarray, leaf: int, out: Optional[np.ndarray] = None
  ) -> np.ndarray:
    """The initial rows of clients ``idx`` of one leaf (its place in
    ``jax.tree.leaves`` of the client rows), written into ``out`` ([len(idx),
    ...]; None: a new array) ``MADE_PER_CALL`` clients a call (one compiled
    program per leaf), so that a cohort's new rows are made without a
    second copy of them; returns ``out``."""
    idx = np.asarray(idx, np.int64)
    if out is None:
      shape = jax.eval_shape(
        self._fn, self._key, idx[:1].astype(np.int32), leaf
      )
      out = np.empty((len(idx),) + shape.shape[1:], shape.dtype)
    for start in range(0, len(idx), MADE_PER_CALL):
      part = idx[start : start + MADE_PER_CALL]
      padded = np.concatenate(
        [part, np.repeat(part[:1], MADE_PER_CALL - len(part))]
      )
      padded = padded.astype(np.int32)
      with jax.default_device(self._cpu):
        made = self._fn(self._key, padded, leaf)
      out[start : start + len(part)] = np.asarray(made)[: len(part)]
      del made
    return out


class DiskRows:
  """One leaf of client rows ``[N, ...]`` in a sparse file (see module doc).

  Args:
    path: the file (created, truncated to N rows of zeros: sparse).
    shape, dtype: the leaf's.
    maker: ``RowMaker`` of the client rows; ``leaf``: this leaf's place.
  """

  def __init__(self, path, shape, dtype, maker: RowMaker, leaf: int):
    self.path, self.shape, self.dtype = str(path), tuple(shape), np.dtype(dtype)
    self.maker, self.leaf = maker, leaf
    self.row_shape = self.shape[1:]
    self.row_bytes = (
      int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize
    )
    self.made = np.zeros(self.shape[0], bool)
    # written since the last checkpoint
    self.dirty = np.zeros(self.shape[0], bool)
    self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
      os.ftruncate(self._fd, self.shape[0] * self.row_bytes)
    except OSError as e:
      raise OSError(e.errno, e.strerror, self.path) from None

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def nbytes(self) -> int:
    """Bytes of every row (what memory rows would hold)."""
    return self.shape[0] * self.row_bytes

  def disk_bytes(self) -> int:
    """Bytes the file takes on disk (the rows written so far)."""
    return os.fstat(self._fd).st_blocks * 512

  def __getitem__(self, idx) -> np.ndarray:
    idx = np.asarray(idx, np.int64).reshape(-1)
    return self.take(idx, np.empty((len(idx),) + self.row_shape, self.dtype))

  def take(self, idx, out: np.ndarray) -> np.ndarray:
    """Rows ``idx`` read into ``out`` (``np.take``'s ``out``).

    Args:
      idx: row indices.
      out: [len(idx), ...] of the leaf's dtype.

    Returns:
      ``out``.
    """
    idx = np.asarray(idx, np.int64).reshape(-1)
    written = self.made[idx]
    if not written.all():
      new = np.flatnonzero(~written)
      if len(new) == len(idx):  # every row new: made in place
        self.maker(idx, self.leaf, out)
      else:
        made = np.empty((len(new),) + self.row_shape, self.dtype)
        self.maker(idx[new], self.leaf, made)
        out[new] = made
    for j in np.flatnonzero(written):
      data = os.pread(self._fd, self.row_bytes, int(idx[j]) * self.row_bytes)
      if len(data) != self.row_bytes:
        raise OSError(
          f'{self.path}: row {int(idx[j])} is cut short ({len(data)} of '
          f'{self.row_bytes} bytes)'
        )
      out[j] = np.frombuffer(data, self.dtype).reshape(self.row_shape)
    return out

  def __setitem__(self, idx, values) -> None:
    idx = np.asarray(idx, np.int64).reshape(-1)
    values = np.ascontiguousarray(
      np.asarray(values, self.dtype).reshape((len(idx),) + self.row_shape)
    )
    for j, i in enumerate(idx):
      try:
        os.pwrite(self._fd, values[j].tobytes(), int(i) * self.row_bytes)
      except OSError as e:  # a full disk names the row file
        raise OSError(e.errno, e.strerror, self.path) from None
    self.made[idx] = True
    self.dirty[idx] = True

  def __array__(self, dtype=None, copy=None):
    raise TypeError(
      f'{self.path}: client rows on disk are read by index (rows[idx]), not '
      'whole'
    )

  def __del__(self):
    try:
      os.close(self._fd)
    except (OSError, AttributeError, TypeError):
      pass


def init_on_disk(init, client_rows, key, folder):
  """The state ``init(key)`` makes as a ``HostedState`` whose client rows are
  files in ``folder`` (one per leaf, made on first use); the rest of the
  state on the default device.

  Args:
    init: the algorithm's ``init``.
    client_rows: its ``ClientRows``.
    key: the init key.
    folder: where the row files go.

  Returns:
    The ``HostedState``.
  """
  os.makedirs(folder, exist_ok=True)
  key = jax.device_put(key, cpu_device())
  shapes = client_rows.get(jax.eval_shape(init, key))
  maker = RowMaker(init, client_rows, key)
  leaves, treedef = jax.tree.flatten(shapes)
  rows = jax.tree.unflatten(
    treedef,
    [
      DiskRows(
        os.path.join(folder, f'leaf_{i}.rows'), a.shape, a.dtype, maker, i
      )
      for i, a in enumerate(leaves)
    ],
  )
  return HostedState(
    state_without_rows(init, client_rows, key), rows, client_rows
  )


def disk_bytes(rows) -> int:
  """Bytes on disk of a state's client rows held in files (0 in memory).

  Args:
    rows: a ``HostedState``'s rows.

  Returns:
    Bytes.
  """
  return sum(
    a.disk_bytes() for a in jax.tree.leaves(rows) if isinstance(a, DiskRows)
  )
