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
live in memory (``from_federated``). Writers (``StoreWriter``) append client
after client and publish the folder by renaming it when complete, so a reader
never sees half a store.

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
against array_record records of whole clients (docs/populations.md).
"""

import collections
import errno
import hashlib
import json
import os
import pathlib
import secrets
import shutil
import zlib
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from fedjax_personal.core.population.clients import (
  FORMAT,
  SPLITS,
  PopulationStore,
)
from fedjax_personal.errors import DataError

__all__ = [
  'BLOCK_BYTES',
  'block_crcs',
  'damaged',
  'FileArray',
  'IDS',
  'is_store',
  'MANIFEST',
  'open_store',
  'remove_leftovers',
  'store_format',
  'store_identity',
  'StoreDamaged',
  'StoreWriter',
]

MANIFEST = 'manifest.json'
IDS = 'client_ids.json'
BLOCK_BYTES = 1 << 20
_BUFFER_BYTES = 64 << 20


class StoreDamaged(DataError):
  """A store whose bytes are not those its writer checked.

  The message
  names the store, the file and the next command; ``what`` is the damage."""

  def __init__(self, message: str, what: str = ''):
    super().__init__(message)
    self.what = what

  def then(self, next_command: str) -> 'StoreDamaged':
    """The same fault, its line ending with ``next_command`` instead of
    "run the same command again" (a run with checkpoints resumes)."""
    return StoreDamaged(
      str(self).replace('run the same command again', next_command), self.what
    )


class _BlockChecksums:
  """CRC32s of consecutive blocks of a byte stream.

  Blocks of ``block_bytes``; the stream is fed in pieces of any size."""

  def __init__(self, block_bytes: int = BLOCK_BYTES):
    self.block_bytes, self._crc, self._filled = block_bytes, 0, 0
    self.crcs: List[int] = []

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
  """CRC32 of each ``block_bytes`` block of ``data`` (the last one short).

  Args:
    data: bytes.
    block_bytes: the block size.

  Returns:
    uint32 CRCs, one per block.
  """
  sums = _BlockChecksums(block_bytes)
  sums.update(data)
  return sums.done()


def damaged(folder, what: str) -> StoreDamaged:
  """The fault of a damaged store: the store is removed (the next run
  rebuilds it from its source files), and the line says so.

  Args:
    folder: the store.
    what: what was found.

  Returns:
    The ``StoreDamaged`` fault.
  """
  folder = pathlib.Path(folder)
  gone = folder.with_name(folder.name + f'.damaged-{os.getpid()}')
  try:
    os.replace(folder, gone)
    shutil.rmtree(gone, ignore_errors=True)
    after = 'removed it: run the same command again to rebuild it from its source files'
  except OSError:
    after = 'remove it and run the same command again to rebuild it'
  return StoreDamaged(
    f'{folder}: a damaged population store ({what}); {after}', what
  )


class FileArray:
  """A read-only array in a flat binary file, read by slices.

  A read-only [total, ...] array in a flat binary file, read by slices
  with ``os.pread``: a cohort's rows are copied into process memory and
  nothing else of the file is mapped (a memory map would count the page
  cache's large folios around every client in the process's RSS: 200 MB
  for a cohort of 50 Stack Overflow-shaped clients, measured).
  """

  def __init__(
    self,
    path,
    dtype,
    shape,
    crcs: Optional[Sequence[int]] = None,
    block_bytes: int = BLOCK_BYTES,
  ):
    self.path, self.dtype, self.shape = str(path), np.dtype(dtype), tuple(shape)
    self._row = int(np.prod(self.shape[1:])) * self.dtype.itemsize
    self._fd = os.open(self.path, os.O_RDONLY)
    self._crcs = None if crcs is None else np.asarray(crcs, np.int64)
    self._block = block_bytes
    self._checked = None if crcs is None else np.zeros(len(crcs), np.bool_)

  def _check(self, lo: int, hi: int) -> None:
    """Checks the blocks of bytes [lo, hi) not checked before in this
    process (each read once more, with its neighbours' bytes)."""
    if self._checked is None or self._crcs is None or hi <= lo:
      return
    b0, b1 = lo // self._block, (hi - 1) // self._block + 1
    todo = np.flatnonzero(np.logical_not(self._checked[b0:b1])) + b0
    for b in todo:
      data = os.pread(self._fd, self._block, int(b) * self._block)
      if zlib.crc32(data) != self._crcs[b]:
        raise damaged(
          os.path.dirname(self.path),
          f'{os.path.basename(self.path)}: block {b} fails its checksum',
        )
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
      raise DataError(
        f'{self.path}: {len(buf)} bytes read at row {start}, expected '
        f'{n * self._row}: the file was truncated'
      )
    return np.frombuffer(buf, self.dtype).reshape((n,) + self.shape[1:])

  def __del__(self):
    try:
      os.close(self._fd)
    # TypeError: os torn down at exit
    except (
      OSError,
      AttributeError,
      TypeError,
    ):
      pass


class SplitFiles(NamedTuple):
  """A split's three files in a store: inputs, targets, client counts."""

  x: str
  y: str
  counts: str


def _files(split: str) -> SplitFiles:
  return SplitFiles(f'{split}.x.bin', f'{split}.y.bin', f'{split}.counts.bin')


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's live process
    return True
  return True


def remove_leftovers(parent) -> List[str]:
  """Removes the unfinished stores (``*.partial-<pid>``), the damaged
  ones being removed (``*.damaged-<pid>``) and the replaced ones
  (``*.replaced-<pid>``) of processes that no longer run (killed
  mid-build); returns their names.

  Args:
    parent: the stores' folder.

  Returns:
    None.
  """
  removed: List[str] = []
  parent = pathlib.Path(parent)
  if not parent.is_dir():
    return removed
  for path in parent.iterdir():
    tail = path.name.rpartition('.')[2]
    kind, _, pid = tail.partition('-')
    if (
      kind in ('partial', 'damaged', 'replaced')
      and pid.isdigit()
      and not _alive(int(pid))
    ):
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
    self._before = _inode(self.folder)  # the store this one replaces, if any
    # One per writer, of this process (remove_leftovers reads the pid).
    self.partial = self.folder.with_name(
      f'{self.folder.name}.{secrets.token_hex(4)}.partial-{os.getpid()}'
    )
    remove_leftovers(self.folder.parent)
    if self.partial.exists():
      shutil.rmtree(self.partial)
    self.partial.mkdir(parents=True)
    self.identity = _as_json(identity)
    self.specs: Optional[Dict[str, Tuple[list, str]]] = None
    self.groups: List[int] = []
    self.ids: List[str] = []
    self._files = {}
    self._buffers: Dict[str, Any] = {}
    self._buffered: Dict[str, Any] = {}
    self._crcs: Dict[str, Any] = {}
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
    except OSError as e:
      # the cache's disk is full: name the folder that filled
      raise OSError(e.errno, e.strerror, str(self.partial)) from None
    self._buffers[name], self._buffered[name] = [], 0

  def add(
    self, train, val=None, test=None, group: int = -1, client_id=None
  ) -> None:
    """Appends one client: (x, y) per split (None: no examples), its id
    (None: its index)."""
    if self.specs is None:
      x, y = train if train is not None and len(train[0]) else test
      self.specs = {
        'x': (list(x.shape[1:]), np.dtype(x.dtype).str),
        'y': (list(y.shape[1:]), np.dtype(y.dtype).str),
      }
    for s, part in zip(SPLITS, (train, val, test)):
      fx, fy, fc = _files(s)
      if part is None or len(part[0]) == 0:
        self._put(fc, np.zeros(1, np.int64))
        continue
      x, y = part
      for key, a in (('x', x), ('y', y)):
        shape, dtype = self.specs[key]
        if list(a.shape[1:]) != shape:
          raise DataError(
            f'{self.folder}: client {len(self.groups)}: {key} of shape '
            f'{a.shape[1:]}, the store holds {tuple(shape)}'
          )
      self._put(fx, np.asarray(x, self.specs['x'][1]))
      self._put(fy, np.asarray(y, self.specs['y'][1]))
      self._put(fc, np.asarray([len(x)], np.int64))
    self.ids.append(str(len(self.groups) if client_id is None else client_id))
    self.groups.append(int(group))

  def close(
    self, name: str, num_classes: int, eval_only: int = 0
  ) -> 'PopulationStore':
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
    manifest = {
      'format': FORMAT,
      'name': name,
      'num_classes': int(num_classes),
      'num_clients': len(groups),
      'eval_only': int(eval_only),
      'identity': self.identity,
      'x': self.specs['x'],
      'y': self.specs['y'],
      'digest': self._hash.hexdigest()[:16],
      'blocks': {'bytes': BLOCK_BYTES, 'crc32': crcs},
    }
    (self.partial / MANIFEST).write_text(
      json.dumps(manifest, indent=1, sort_keys=True)
    )
    return self._publish(manifest['digest'])

  def _publish(self, digest: str) -> 'PopulationStore':
    """Moves the written store to its folder. Another process writing the
    same store into the same folder may finish first (runs started side by
    side on a fresh machine): a store published there since this writer
    started, of the same format, identity and content digest, is kept and
    this one dropped; any other store there (the one this writer rebuilds)
    is replaced, moved aside by a rename first so that no reader sees a
    half-removed one."""
    for _ in range(3):
      now = _inode(self.folder)
      if now is not None and now != self._before:
        try:
          theirs = json.loads((self.folder / MANIFEST).read_text())
        except (OSError, ValueError):
          theirs = {}
        if (
          theirs.get('digest') == digest
          and theirs.get('format') == FORMAT
          and theirs.get('identity') == self.identity
        ):
          shutil.rmtree(self.partial, ignore_errors=True)
          return open_store(self.folder, identity=self.identity)
      aside = self.folder.with_name(
        f'{self.folder.name}.replaced-{os.getpid()}'
      )
      try:
        os.replace(self.folder, aside)
      except FileNotFoundError:
        pass
      try:
        os.replace(self.partial, self.folder)
      except OSError as e:  # another process's store took the folder meanwhile
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
          raise
        continue
      finally:
        shutil.rmtree(aside, ignore_errors=True)
      return open_store(self.folder, identity=self.identity)
    raise DataError(
      f'{self.folder}: other processes keep replacing this store; run one at a '
      'time'
    )

  def abort(self) -> None:
    for f in self._files.values():
      f.close()
    shutil.rmtree(self.partial, ignore_errors=True)


def _inode(folder) -> Optional[int]:
  """The folder's inode number (None: no folder): tells a store published
  since from the one that was there."""
  try:
    return os.stat(folder).st_ino
  except FileNotFoundError:
    return None


def _as_json(obj):
  """``obj`` as it reads back from JSON (tuples become lists)."""
  return json.loads(json.dumps(obj, default=str))


def is_store(folder) -> bool:
  """Whether ``folder`` holds a population store (its manifest).

  Args:
    folder: a folder.

  Returns:
    True when it holds a manifest.
  """
  return (pathlib.Path(folder) / MANIFEST).is_file()


def store_format(folder) -> Optional[str]:
  """The format a store folder was written in (None: unreadable).

  Args:
    folder: a store.

  Returns:
    The format's name, or None.
  """
  try:
    return json.loads((pathlib.Path(folder) / MANIFEST).read_text()).get(
      'format'
    )
  except (OSError, ValueError, AttributeError):
    return None


def store_identity(folder) -> dict:
  """What a store folder's manifest says it holds ({}: unreadable).

  Args:
    folder: a store.

  Returns:
    The identity dict.
  """
  try:
    return dict(
      json.loads((pathlib.Path(folder) / MANIFEST).read_text()).get('identity')
      or {}
    )
  except (OSError, ValueError, AttributeError, TypeError):
    return {}


def _checked_file(
  folder: pathlib.Path, name: str, crcs, block_bytes: int
) -> bytes:
  """A small store file read whole and checked against its CRC32s."""
  data = (folder / name).read_bytes()
  if block_crcs(data, block_bytes) != list(crcs):
    raise damaged(folder, f'{name} fails its checksum')
  return data


def open_store(
  folder,
  identity: Optional[dict] = None,
  compare: Optional[Sequence[str]] = None,
  verify: bool = False,
) -> PopulationStore:
  """Opens a store folder (its arrays read by row slices, each block checked
  the first time it is read).

  Args:
    identity: what the caller expects it to hold; ``compare`` names the
      identity keys that must agree (all of ``identity`` when None).
    verify: check every block of every file now (else as rows are read).

  Returns:
    The ``PopulationStore``.

  Raises:
    DataError: not a store, another format version, or another identity.
    StoreDamaged: a file fails its checksum (the store is then removed).
  """
  folder = pathlib.Path(folder)
  try:
    manifest = json.loads((folder / MANIFEST).read_text())
  except (OSError, ValueError) as e:
    raise DataError(
      f'{folder}: not a population store ({MANIFEST}: '
      f'{getattr(e, "strerror", None) or e})'
    ) from None
  if manifest.get('format') != FORMAT:
    raise DataError(
      f'{folder}: a population store of format {manifest.get("format")!r}, '
      f'this '
      f'version reads {FORMAT!r}; remove the folder to rebuild it'
    )
  if identity is not None:
    identity = _as_json(identity)
    have = manifest.get('identity', {})
    keys = list(identity) if compare is None else list(compare)
    diff = [
      f'{k}: {have.get(k)!r} (wanted {identity.get(k)!r})'
      for k in keys
      if have.get(k) != identity.get(k)
    ]
    if diff:
      raise DataError(
        f'{folder}: holds another population ({"; ".join(diff)}); remove it or '
        'choose another folder'
      )
  n = int(manifest['num_clients'])
  arrays = {}
  try:
    block_bytes, crcs = manifest['blocks']['bytes'], manifest['blocks']['crc32']
    for s in SPLITS:
      fx, fy, fc = _files(s)
      counts = np.frombuffer(
        _checked_file(folder, fc, crcs[fc], block_bytes), np.int64
      )
      if len(counts) != n:
        raise ValueError(f'{fc} holds {len(counts)} clients, the manifest {n}')
      total = int(counts.sum())
      mm: List[Any] = []
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
    groups = np.frombuffer(
      _checked_file(folder, 'groups.bin', crcs['groups.bin'], block_bytes),
      np.int32,
    )
    ids = json.loads(_checked_file(folder, IDS, crcs[IDS], block_bytes))
    if len(ids) != n or len(groups) != n:
      raise ValueError(
        f'{IDS} and groups.bin hold {len(ids)} and {len(groups)} clients, the '
        f'manifest {n}'
      )
  except StoreDamaged:
    raise
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise damaged(folder, str(e)) from None
  return PopulationStore(
    arrays, groups, manifest, folder=folder, client_ids=ids
  )
