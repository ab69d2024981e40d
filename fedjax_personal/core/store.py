"""The population store: every client's examples on the host, unpadded.

A store is a folder of flat binary arrays, one pair (x, y) per split
(train / val / test) holding every client's examples back to back, the
per-client counts (offsets are their cumulative sums), the clients' group
labels, their ids as the source names them (``client_ids.json``: a writer,
a user, a TFF client id) and a ``manifest.json`` (format, identity, shapes,
dtypes, digest, ``eval_only``: how many clients at the end are evaluated
and never trained, e.g. TFF's held-out CIFAR-100 test clients).
Arrays are read by row slices (``FileArray``), so a round reads only its
cohort's rows and a population larger than RAM works; a store can also
live in memory (``from_federated``). Writers (``StoreWriter``) append client after client
and publish the folder by renaming it when complete, so a reader never sees
half a store.

Integrity: the writer records a CRC32 of every ``BLOCK_BYTES`` block of
every file in the manifest. The small files (counts, groups) are checked
when the store is opened; the example arrays block by block the first
time a read touches the block in a process (``FileArray``), or all at
once with ``verify=True``. A block that fails its check ends the read with
``StoreDamaged`` (a ``DataError``) and the store is removed, so no number
is computed from damaged rows and the next run rebuilds it.

Why flat arrays rather than ``array_record``/``grain``: a
client is a contiguous slice, so a cohort is C slices copied into a padded
block with no decoding; ``benchmarks/probes/store_formats.py`` measured it
against array_record records of whole clients (BUILD.md, "Population store").
"""

import collections
import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import zlib
from typing import Dict, List, Optional, Sequence

import numpy as np

from fedjax_personal.core.data import ClientData, FederatedData, PackedClientData
from fedjax_personal.errors import DataError

FORMAT = 'fedjax_personal.population/3'  # /2: per-block CRC32s; /3: client ids, eval_only
SPLITS = ('train', 'val', 'test')
MANIFEST = 'manifest.json'
IDS = 'client_ids.json'
BLOCK_BYTES = 1 << 20
_BUFFER_BYTES = 64 << 20


class StoreDamaged(DataError):
  """A store whose bytes are not those its writer checked (the message
  names the store, the file and the next command; ``what`` is the damage)."""

  def __init__(self, message: str, what: str = ''):
    super().__init__(message)
    self.what = what


class _BlockChecksums:
  """CRC32s of consecutive ``block_bytes`` blocks of a byte stream, fed in
  pieces of any size."""

  def __init__(self, block_bytes: int = BLOCK_BYTES):
    self.block_bytes, self.crcs, self._crc, self._filled = block_bytes, [], 0, 0

  def update(self, data: bytes) -> None:
    view = memoryview(data)
    while len(view):
      take = min(len(view), self.block_bytes - self._filled)
      self._crc = zlib.crc32(view[:take], self._crc)
      self._filled += take
      view = view[take:]
      if self._filled == self.block_bytes:
        self.crcs.append(self._crc)
        self._crc, self._filled = 0, 0

  def done(self) -> List[int]:
    if self._filled:
      self.crcs.append(self._crc)
      self._crc, self._filled = 0, 0
    return self.crcs


def block_crcs(data: bytes, block_bytes: int = BLOCK_BYTES) -> List[int]:
  """CRC32 of each ``block_bytes`` block of ``data`` (the last one short)."""
  sums = _BlockChecksums(block_bytes)
  sums.update(data)
  return sums.done()


def damaged(folder, what: str) -> StoreDamaged:
  """The fault of a damaged store: the store is removed (the next run
  rebuilds it from its source files), and the line says so."""
  folder = pathlib.Path(folder)
  gone = folder.with_name(folder.name + f'.damaged-{os.getpid()}')
  try:
    os.replace(folder, gone)
    shutil.rmtree(gone, ignore_errors=True)
    after = 'removed it: run the same command again to rebuild it from its source files'
  except OSError:
    after = 'remove it and run the same command again to rebuild it'
  return StoreDamaged(f'{folder}: a damaged population store ({what}); {after}', what)


def next_power_of_two(n) -> np.ndarray:
  n = np.maximum(np.asarray(n, np.int64), 1)
  return (2 ** np.ceil(np.log2(n))).astype(np.int64)


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
  """``np.empty`` whose data starts on an ``align``-byte boundary: XLA:CPU
  then takes the host array as it is (``jax.device_put`` without a copy:
  a cohort of packed examples reaches the round at no cost)."""
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape)) * dtype.itemsize
  buf = np.empty(nbytes + align, np.uint8)
  start = (-buf.ctypes.data) % align
  return buf[start:start + nbytes].view(dtype).reshape(shape)


def padded_length(count: int, cap: Optional[int] = None, smallest: int = 32) -> int:
  """The static length a cohort whose largest client has ``count`` examples
  is padded to: the next power of two >= count (at least ``smallest``), at
  most ``cap``; powers of two keep the number of compiled shapes to a few."""
  length = int(max(smallest, next_power_of_two(count)))
  return length if cap is None else int(min(length, max(cap, 1)))


@dataclasses.dataclass
class Population:
  """What builders and the engine may know of a population without its
  examples: per split the example counts ([N] int32, after the cap), the
  groups, the classes, one input example (model shapes).

  It stands where builders take a ``FederatedData`` (``data.num_clients``,
  ``data.train.num_examples``, ``data.groups``...).
  """
  train: ClientData
  val: ClientData
  test: ClientData
  groups: np.ndarray
  num_classes: int
  name: str
  sample_x: np.ndarray
  eval_only: int = 0

  @property
  def num_clients(self) -> int:
    return len(self.groups)

  @property
  def num_trained(self) -> int:
    """Clients a round may sample: all but the ``eval_only`` last."""
    return self.num_clients - self.eval_only

  @property
  def num_groups(self) -> int:
    return int(self.groups.max()) + 1 if self.groups.size and self.groups.max() >= 0 else 0

  def describe(self) -> str:
    n = self.train.num_examples
    return (f'{self.name}: {self.num_clients:,} clients, {self.num_classes} classes, '
            f'train examples per client min {n.min()} median {int(np.median(n))} '
            f'max {n.max()} (total {int(n.sum()):,}), test total '
            f'{int(self.test.num_examples.sum()):,}')


class PopulationStore:
  """Every client's train / val / test examples, unpadded (see module doc).

  Args:
    arrays: {split: (x [total, ...], y [total, ...], counts [N])}.
    groups: int32 [N].
    manifest: the store's manifest (name, num_classes, identity, digest).
    folder: where it is on disk (None in memory).
    client_ids: each client's id (None: its index).
  """

  def __init__(self, arrays: Dict[str, tuple], groups, manifest: dict, folder=None,
               client_ids: Optional[List[str]] = None):
    self.arrays = arrays
    self.groups = np.asarray(groups, np.int32)
    self.manifest = manifest
    self.folder = folder
    self.counts = {s: np.asarray(arrays[s][2], np.int64) for s in SPLITS}
    self.offsets = {s: np.concatenate([[0], np.cumsum(c)]) for s, c in self.counts.items()}
    self._ids = client_ids
    self._index = None

  @property
  def num_clients(self) -> int:
    return len(self.groups)

  @property
  def eval_only(self) -> int:
    """How many clients at the end are evaluated and never trained."""
    return int(self.manifest.get('eval_only', 0))

  @property
  def client_ids(self) -> List[str]:
    """Each client's id as its source names it (row i is client i); a
    partitioned pool's clients are named by their index."""
    if self._ids is None:
      self._ids = [str(i) for i in range(self.num_clients)]
    return self._ids

  def client_index(self, client_id) -> int:
    """The row of the client named ``client_id``.

    Raises:
      DataError: no client has that id.
    """
    if self._index is None:
      self._index = {c: i for i, c in enumerate(self.client_ids)}
    try:
      return self._index[str(client_id)]
    except KeyError:
      where = self.folder or self.name
      raise DataError(f'{where}: no client has id {client_id!r} ({self.num_clients:,} clients, '
                      f'e.g. {self.client_ids[0]!r})') from None

  def client(self, client_id) -> Dict[str, tuple]:
    """One client's examples by id: {split: (x, y)} as numpy arrays."""
    i = self.client_index(client_id)
    out = {}
    for s in SPLITS:
      x, y, _ = self.arrays[s]
      lo = int(self.offsets[s][i])
      hi = lo + int(self.counts[s][i])
      out[s] = (np.asarray(x[lo:hi]), np.asarray(y[lo:hi]))
    return out

  def subset(self, client_ids: Sequence[str], why: str = 'chosen by id') -> 'PopulationStore':
    """The clients named ``client_ids`` alone, in the store's order (a
    view: the same files, their counts and offsets selected). Its digest
    and name say which clients it holds.

    Raises:
      DataError: an id no client has, or one given twice.
    """
    rows = [self.client_index(c) for c in client_ids]
    if len(set(rows)) != len(rows):
      twice = next(c for c, k in collections.Counter(map(str, client_ids)).items() if k > 1)
      raise DataError(f'client id {twice!r} is given twice')
    rows = np.sort(np.asarray(rows, np.int64))
    h = hashlib.sha256(self.digest.encode())
    h.update(rows.tobytes())
    held_out = int(np.sum(rows >= self.num_clients - self.eval_only))
    manifest = {**self.manifest, 'digest': h.hexdigest()[:16], 'eval_only': held_out,
                'name': f'{self.name}, {len(rows):,} clients {why}'}
    sub = PopulationStore(self.arrays, self.groups[rows], manifest, self.folder,
                          [self.client_ids[i] for i in rows])
    sub.counts = {s: c[rows] for s, c in self.counts.items()}
    sub.offsets = {s: o[rows] for s, o in self.offsets.items()}  # starts (ends: + counts)
    return sub

  @property
  def num_classes(self) -> int:
    return int(self.manifest['num_classes'])

  @property
  def name(self) -> str:
    return self.manifest['name']

  @property
  def digest(self) -> str:
    return self.manifest['digest']

  def x_spec(self):
    x = self.arrays['train'][0]
    return x.shape[1:], x.dtype

  def y_spec(self):
    y = self.arrays['train'][1]
    return y.shape[1:], y.dtype

  def nbytes(self) -> int:
    return int(sum(a.nbytes for s in SPLITS for a in self.arrays[s][:2]))

  def counts_capped(self, split: str, cap: Optional[int] = None) -> np.ndarray:
    c = self.counts[split]
    return (c if cap is None or split != 'train' else np.minimum(c, cap)).astype(np.int32)

  def population(self, cap: Optional[int] = None) -> Population:
    """The store's ``Population`` (training counts capped at ``cap``)."""
    splits = {s: ClientData(x=None, y=None, num_examples=self.counts_capped(s, cap))
              for s in SPLITS}
    x = self.arrays['train'][0]
    return Population(**splits, groups=self.groups, num_classes=self.num_classes,
                      name=self.name, sample_x=np.zeros((1,) + x.shape[1:], x.dtype),
                      eval_only=self.eval_only)

  def check_clients(self, idx) -> None:
    idx = np.asarray(idx)
    bad = idx[(idx < 0) | (idx >= self.num_clients)]
    if bad.size:
      where = self.folder or 'the in-memory store'
      raise DataError(f'{where}: client {int(bad[0])} is not in the store '
                      f'({self.num_clients:,} clients, 0..{self.num_clients - 1})')

  def _cohort(self, split: str, idx, length: int, cap: Optional[int], clip: bool):
    """What ``gather`` and ``gather_packed`` read: the split's arrays, the
    clients' counts (capped at ``cap`` on the training split and at
    ``length``; 0 past the last client with ``clip``), where their examples
    start, and the targets' dtype as gathered (integers as int32)."""
    idx = np.asarray(idx, np.int64)
    empty = np.zeros(len(idx), bool)
    if clip:
      empty = idx >= self.num_clients
      idx = np.where(empty, 0, idx)
    self.check_clients(idx)
    x, y, _ = self.arrays[split]
    n = self.counts[split][idx]  # the gathered clients' counts alone (not all N capped)
    if cap is not None and split == 'train':
      n = np.minimum(n, cap)
    n = np.where(empty, 0, np.minimum(n, length)).astype(np.int32)
    ydtype = np.int32 if np.issubdtype(y.dtype, np.integer) else y.dtype
    return x, y, n, self.offsets[split][idx], ydtype

  def gather(self, split: str, idx, length: int, cap: Optional[int] = None,
             clip: bool = False) -> ClientData:
    """Clients ``idx``'s ``split`` padded to ``length`` rows (host numpy).

    A client keeps its first ``min(n, cap, length)`` examples (``cap``
    applies to the training split: TFF's ``max_elements``); padded rows are
    zeros. With ``clip`` an index past the last client (a sampler's padded
    cohort slot) reads as an empty client; otherwise it is an error. The
    arrays are 64-byte aligned (``aligned_empty``).
    """
    x, y, n, starts, ydtype = self._cohort(split, idx, length, cap, clip)
    xp = aligned_empty((len(n), length) + x.shape[1:], x.dtype)
    yp = aligned_empty((len(n), length) + y.shape[1:], ydtype)
    for j, (s, k) in enumerate(zip(starts, n)):
      xp[j, :k] = x[s:s + k]
      yp[j, :k] = y[s:s + k]
      xp[j, k:] = 0
      yp[j, k:] = 0
    return ClientData(x=xp, y=yp, num_examples=n)

  def gather_packed(self, split: str, idx, length: int, cap: Optional[int] = None,
                    smallest: int = 32) -> PackedClientData:
    """Clients ``idx``'s ``split`` packed back to back (host numpy): as
    ``gather(..., clip=True)`` gives them, without the padding. The
    ``length`` rows after the last client are zeros (the last windows read
    them); the total is a power of two (at least ``smallest``; rows past the
    zeros are never read) so that cohorts share a few compiled shapes."""
    x, y, n, starts, ydtype = self._cohort(split, idx, length, cap, clip=True)
    offsets = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int32)
    total = int(n.sum())
    capacity = int(next_power_of_two(max(smallest, total + length))) if length else 0
    xp = aligned_empty((capacity,) + x.shape[1:], x.dtype)
    yp = aligned_empty((capacity,) + y.shape[1:], ydtype)
    xp[total:total + length] = 0  # what the last windows read past the examples; rows after
    yp[total:total + length] = 0  # them are never read (left as they are)
    for s, o, k in zip(starts, offsets, n):
      xp[o:o + k] = x[s:s + k]
      yp[o:o + k] = y[s:s + k]
    return PackedClientData(x=xp, y=yp, num_examples=n, offsets=offsets, length=int(length))

  def padded(self, cap: Optional[int] = None) -> FederatedData:
    """The whole population padded to its largest client (the device
    layout), host numpy; training splits capped at ``cap``."""
    out = {}
    every = np.arange(self.num_clients)
    for s in SPLITS:
      length = int(self.counts_capped(s, cap).max(initial=0))
      out[s] = self.gather(s, every, length, cap)
    return FederatedData(**out, groups=self.groups, num_classes=self.num_classes, name=self.name,
                         eval_only=self.eval_only)

  def padded_nbytes(self, cap: Optional[int] = None) -> int:
    """Bytes of ``padded(cap)``: what the device layout would hold."""
    total = 0
    for s in SPLITS:
      x, y, _ = self.arrays[s]
      length = int(self.counts_capped(s, cap).max(initial=0))
      row = (int(np.prod(x.shape[1:])) * x.dtype.itemsize
             + int(np.prod(y.shape[1:])) * max(y.dtype.itemsize, 4))
      total += self.num_clients * length * row
    return total

  @staticmethod
  def from_federated(data: FederatedData) -> 'PopulationStore':
    """An in-memory store of a padded FederatedData (its real rows)."""
    arrays = {}
    h = hashlib.sha256()
    for s in SPLITS:
      d = getattr(data, s)
      n = np.asarray(d.num_examples)
      x, y = np.asarray(d.x), np.asarray(d.y)
      keep = (np.arange(x.shape[1])[None, :] < n[:, None]).reshape(-1)
      xs = x.reshape((-1,) + x.shape[2:])[keep]
      ys = y.reshape((-1,) + y.shape[2:])[keep]
      arrays[s] = (xs, ys, n)
      for a in (xs, ys, n):
        h.update(np.ascontiguousarray(a).tobytes())
    manifest = {'format': FORMAT, 'name': data.name, 'num_classes': int(data.num_classes),
                'identity': {}, 'digest': h.hexdigest()[:16], 'eval_only': int(data.eval_only)}
    return PopulationStore(arrays, np.asarray(data.groups), manifest)


# -- on disk ------------------------------------------------------------------

class FileArray:
  """A read-only [total, ...] array in a flat binary file, read by slices
  with ``os.pread``: a cohort's rows are copied into process memory and
  nothing else of the file is mapped (a memory map would count the page
  cache's large folios around every client in the process's RSS: 200 MB
  for a cohort of 50 Stack Overflow-shaped clients, measured).
  """

  def __init__(self, path, dtype, shape, crcs: Optional[Sequence[int]] = None,
               block_bytes: int = BLOCK_BYTES):
    self.path, self.dtype, self.shape = str(path), np.dtype(dtype), tuple(shape)
    self._row = int(np.prod(self.shape[1:])) * self.dtype.itemsize
    self._fd = os.open(self.path, os.O_RDONLY)
    self._crcs = None if crcs is None else np.asarray(crcs, np.int64)
    self._block = block_bytes
    self._checked = None if crcs is None else np.zeros(len(self._crcs), bool)

  def _check(self, lo: int, hi: int) -> None:
    """Checks the blocks of bytes [lo, hi) not checked before in this
    process (each read once more, with its neighbours' bytes)."""
    if self._checked is None or hi <= lo:
      return
    b0, b1 = lo // self._block, (hi - 1) // self._block + 1
    todo = np.flatnonzero(~self._checked[b0:b1]) + b0
    for b in todo:
      data = os.pread(self._fd, self._block, int(b) * self._block)
      if zlib.crc32(data) != self._crcs[b]:
        raise damaged(os.path.dirname(self.path),
                      f'{os.path.basename(self.path)}: block {b} fails its checksum')
      self._checked[b] = True

  def verify(self) -> None:
    """Checks every block now (``--verify_store``)."""
    self._check(0, self.nbytes)

  @property
  def nbytes(self) -> int:
    return self.shape[0] * self._row

  def __len__(self):
    return self.shape[0]

  def __getitem__(self, rows):
    if not isinstance(rows, slice) or rows.step not in (None, 1):
      raise TypeError('FileArray reads contiguous row slices')
    start, stop, _ = rows.indices(self.shape[0])
    n = max(stop - start, 0)
    self._check(start * self._row, (start + n) * self._row)
    buf = os.pread(self._fd, n * self._row, start * self._row) if n else b''
    if len(buf) != n * self._row:
      raise DataError(f'{self.path}: {len(buf)} bytes read at row {start}, expected '
                      f'{n * self._row}: the file was truncated')
    return np.frombuffer(buf, self.dtype).reshape((n,) + self.shape[1:])

  def __del__(self):
    try:
      os.close(self._fd)
    except (OSError, AttributeError):
      pass


def _files(split: str):
  return f'{split}.x.bin', f'{split}.y.bin', f'{split}.counts.bin'


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's live process
    return True
  return True


def remove_leftovers(parent) -> List[str]:
  """Removes the unfinished stores (``*.partial-<pid>``) and the damaged
  ones being removed (``*.damaged-<pid>``) of processes that no longer
  run (killed mid-build); returns their names."""
  removed = []
  parent = pathlib.Path(parent)
  if not parent.is_dir():
    return removed
  for path in parent.iterdir():
    tail = path.name.rpartition('.')[2]
    kind, _, pid = tail.partition('-')
    if kind in ('partial', 'damaged') and pid.isdigit() and not _alive(int(pid)):
      shutil.rmtree(path, ignore_errors=True)
      removed.append(path.name)
  return removed


class StoreWriter:
  """Writes a store client after client (no client is held after ``add``).

  Args:
    folder: where the store goes; it is written in ``folder.partial`` and
      renamed when ``close`` completes it.
    identity: what the store holds (data set, options, source files);
      ``open_store`` compares it.
  """

  def __init__(self, folder, identity: dict):
    self.folder = pathlib.Path(folder)
    self.partial = self.folder.with_name(self.folder.name + f'.partial-{os.getpid()}')
    remove_leftovers(self.folder.parent)
    if self.partial.exists():
      shutil.rmtree(self.partial)
    self.partial.mkdir(parents=True)
    self.identity = _as_json(identity)
    self.specs = None
    self.groups = []
    self.ids = []
    self._files = {}
    self._buffers, self._buffered, self._crcs = {}, {}, {}
    self._hash = hashlib.sha256()
    for s in SPLITS:
      for f in _files(s):
        self._files[f] = open(self.partial / f, 'wb')
        self._buffers[f], self._buffered[f] = [], 0
        self._crcs[f] = _BlockChecksums()

  def _put(self, name: str, a: np.ndarray) -> None:
    b = np.ascontiguousarray(a).tobytes()
    self._hash.update(b)
    self._crcs[name].update(b)
    self._buffers[name].append(b)
    self._buffered[name] += len(b)
    if self._buffered[name] >= _BUFFER_BYTES:
      self._flush(name)

  def _flush(self, name: str) -> None:
    try:
      self._files[name].write(b''.join(self._buffers[name]))
    except OSError as e:  # the cache's disk is full: name the folder that filled
      raise OSError(e.errno, e.strerror, str(self.partial)) from None
    self._buffers[name], self._buffered[name] = [], 0

  def add(self, train, val=None, test=None, group: int = -1, client_id=None) -> None:
    """Appends one client: (x, y) per split (None: no examples), its id
    (None: its index)."""
    if self.specs is None:
      x, y = train if train is not None and len(train[0]) else test
      self.specs = {'x': (list(x.shape[1:]), np.dtype(x.dtype).str),
                    'y': (list(y.shape[1:]), np.dtype(y.dtype).str)}
    for s, part in zip(SPLITS, (train, val, test)):
      fx, fy, fc = _files(s)
      if part is None or len(part[0]) == 0:
        self._put(fc, np.zeros(1, np.int64))
        continue
      x, y = part
      for key, a in (('x', x), ('y', y)):
        shape, dtype = self.specs[key]
        if list(a.shape[1:]) != shape:
          raise DataError(f'{self.folder}: client {len(self.groups)}: {key} of shape '
                          f'{a.shape[1:]}, the store holds {tuple(shape)}')
      self._put(fx, np.asarray(x, self.specs['x'][1]))
      self._put(fy, np.asarray(y, self.specs['y'][1]))
      self._put(fc, np.asarray([len(x)], np.int64))
    self.ids.append(str(len(self.groups) if client_id is None else client_id))
    self.groups.append(int(group))

  def close(self, name: str, num_classes: int, eval_only: int = 0) -> 'PopulationStore':
    """Completes the store, publishes the folder and opens it; the last
    ``eval_only`` clients are evaluated and never trained."""
    if self.specs is None:
      raise DataError(f'{self.folder}: no client was written')
    if len(set(self.ids)) != len(self.ids):
      twice = next(c for c, k in collections.Counter(self.ids).items() if k > 1)
      raise DataError(f'{self.folder}: client id {twice!r} is written twice')
    for f in self._files:
      self._flush(f)
      try:
        self._files[f].flush()
        os.fsync(self._files[f].fileno())
      except OSError as e:
        raise OSError(e.errno, e.strerror, str(self.partial)) from None
      self._files[f].close()
    groups = np.asarray(self.groups, np.int32)
    groups.tofile(self.partial / 'groups.bin')
    self._hash.update(groups.tobytes())
    crcs = {f: c.done() for f, c in self._crcs.items()}
    crcs['groups.bin'] = block_crcs(groups.tobytes())
    ids = json.dumps(self.ids).encode()
    self._hash.update(ids)
    (self.partial / IDS).write_bytes(ids)
    crcs[IDS] = block_crcs(ids)
    manifest = {'format': FORMAT, 'name': name, 'num_classes': int(num_classes),
                'num_clients': len(groups), 'eval_only': int(eval_only),
                'identity': self.identity,
                'x': self.specs['x'], 'y': self.specs['y'],
                'digest': self._hash.hexdigest()[:16],
                'blocks': {'bytes': BLOCK_BYTES, 'crc32': crcs}}
    (self.partial / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    if self.folder.exists():
      shutil.rmtree(self.folder)
    os.replace(self.partial, self.folder)
    return open_store(self.folder, identity=self.identity)

  def abort(self) -> None:
    for f in self._files.values():
      f.close()
    shutil.rmtree(self.partial, ignore_errors=True)


def _as_json(obj):
  """``obj`` as it reads back from JSON (tuples become lists)."""
  return json.loads(json.dumps(obj, default=str))


def is_store(folder) -> bool:
  return (pathlib.Path(folder) / MANIFEST).is_file()


def store_format(folder) -> Optional[str]:
  """The format a store folder was written in (None: unreadable)."""
  try:
    return json.loads((pathlib.Path(folder) / MANIFEST).read_text()).get('format')
  except (OSError, ValueError, AttributeError):
    return None


def _checked_file(folder: pathlib.Path, name: str, crcs, block_bytes: int) -> bytes:
  """A small store file read whole and checked against its CRC32s."""
  data = (folder / name).read_bytes()
  if block_crcs(data, block_bytes) != list(crcs):
    raise damaged(folder, f'{name} fails its checksum')
  return data


def open_store(folder, identity: Optional[dict] = None,
               compare: Optional[Sequence[str]] = None, verify: bool = False) -> PopulationStore:
  """Opens a store folder (its arrays read by row slices, each block checked
  the first time it is read).

  Args:
    identity: what the caller expects it to hold; ``compare`` names the
      identity keys that must agree (all of ``identity`` when None).
    verify: check every block of every file now (else as rows are read).

  Raises:
    DataError: not a store, another format version, or another identity.
    StoreDamaged: a file fails its checksum (the store is then removed).
  """
  folder = pathlib.Path(folder)
  try:
    manifest = json.loads((folder / MANIFEST).read_text())
  except (OSError, ValueError) as e:
    raise DataError(f'{folder}: not a population store ({MANIFEST}: '
                    f'{getattr(e, "strerror", None) or e})') from None
  if manifest.get('format') != FORMAT:
    raise DataError(f'{folder}: a population store of format {manifest.get("format")!r}, this '
                    f'version reads {FORMAT!r}; remove the folder to rebuild it')
  if identity is not None:
    identity = _as_json(identity)
    have = manifest.get('identity', {})
    keys = list(identity) if compare is None else list(compare)
    diff = [f'{k}: {have.get(k)!r} (wanted {identity.get(k)!r})' for k in keys
            if have.get(k) != identity.get(k)]
    if diff:
      raise DataError(f'{folder}: holds another population ({"; ".join(diff)}); remove it or '
                      'choose another folder')
  n = int(manifest['num_clients'])
  arrays = {}
  try:
    block_bytes, crcs = manifest['blocks']['bytes'], manifest['blocks']['crc32']
    for s in SPLITS:
      fx, fy, fc = _files(s)
      counts = np.frombuffer(_checked_file(folder, fc, crcs[fc], block_bytes), np.int64)
      if len(counts) != n:
        raise ValueError(f'{fc} holds {len(counts)} clients, the manifest {n}')
      total = int(counts.sum())
      mm = []
      for f, key in ((fx, 'x'), (fy, 'y')):
        shape, dtype = manifest[key]
        shape = (total,) + tuple(shape)
        size = (folder / f).stat().st_size
        want = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if size != want:
          raise ValueError(f'{f} has {size} bytes, its clients need {want}')
        if total:
          mm.append(FileArray(folder / f, dtype, shape, crcs[f], block_bytes))
          if verify:
            mm[-1].verify()
        else:
          mm.append(np.zeros(shape, dtype))
      arrays[s] = (mm[0], mm[1], counts)
    groups = np.frombuffer(_checked_file(folder, 'groups.bin', crcs['groups.bin'], block_bytes),
                           np.int32)
    ids = json.loads(_checked_file(folder, IDS, crcs[IDS], block_bytes))
    if len(ids) != n or len(groups) != n:
      raise ValueError(f'{IDS} and groups.bin hold {len(ids)} and {len(groups)} clients, the '
                       f'manifest {n}')
  except StoreDamaged:
    raise
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise damaged(folder, str(e)) from None
  return PopulationStore(arrays, groups, manifest, folder=folder, client_ids=ids)
