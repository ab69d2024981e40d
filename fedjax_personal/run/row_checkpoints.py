"""Checkpoints of client rows kept in files (``core/population/rows_in_files.py``) that
write only the rows changed since the last checkpoint.

A checkpoint of a state whose client rows are files holds, in its Orbax step,
the state without the rows and a manifest (``client_rows``): the chain of
row deltas from the run's start to this step, each with its files' sha256,
and the run identity's digest. The rows themselves are under
``<checkpoints>/client_rows/``:

* ``delta-<step>-<token>/``: the rows written since the checkpoint before
  (``index-<s>.npy``, the clients of state ``s``; ``leaf-<s>-<i>.npy``, their
  rows of leaf ``i``), written to a temporary folder, synced and renamed
  before the Orbax step is published: a crash at any point leaves either
  the new step with its delta, or the old step with an unreferenced folder
  (removed by the next save).
* ``base/``: the rows of the deltas folded into it (sparse files like the
  live ones, ``meta.npz``: which rows are made, each row's CRC32, which
  deltas are folded, the identity). A delta is folded only once every kept
  Orbax step's chain holds it (the oldest kept step's chain), and ``meta.npz``
  is replaced only after its rows are written: an interrupted fold is redone
  by the replay of that delta, which every kept step still lists.

Restoring step t reads the base's rows (each checked against its CRC) and
replays the deltas of t's chain past the base (each checked against its
sha256), into rows in files or in memory: a run resumes in either placement
from either kind of checkpoint (a checkpoint of rows in memory saves them
whole, as before). A damaged file, or a base of another run, is one line
(``DataError``) naming the file.
"""

import hashlib
import io
import json
import os
import secrets
import shutil
import typing
import zlib
from typing import Any, Dict, List, Optional

import jax
import numpy as np

from fedjax_personal.core.population.rows_in_files import DiskRows
from fedjax_personal.core.population.rows_in_memory import (
  HostedState,
  rows_per_block,
)
from fedjax_personal.errors import DataError
from fedjax_personal.run.run_identity import file_sha256

__all__ = [
  'BLOCK_BYTES',
  'committed',
  'discard',
  'fold',
  'FOLDER',
  'has_files',
  'restore',
  'write_delta',
  'write_whole_rows',
]


FOLDER = 'client_rows'
#: Bytes of rows read or written at once (a block of clients).
BLOCK_BYTES = 1 << 24


def has_files(state) -> bool:
  """Whether a state (or a list of them) keeps client rows in files.

  Args:
    state: a state (or a list of them).

  Returns:
    True with rows in files.
  """
  return any(
    isinstance(s, HostedState)
    and any(isinstance(a, DiskRows) for a in jax.tree.leaves(s.rows))
    for s in _states(state)
  )


def _states(state) -> List[HostedState]:
  return state if isinstance(state, list) else [state]


def _leaves(state: HostedState) -> list:
  return jax.tree.leaves(state.rows)


def _block(leaves) -> int:
  """Clients whose rows of ``leaves`` take BLOCK_BYTES (one at least)."""
  return rows_per_block(leaves, 1 << 62, BLOCK_BYTES)


def _sync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _write_npy(path: str, dtype, shape, blocks) -> str:
  """An .npy file written block by block (through ``write``, not a memory
  map, whose pages would count in the process's RSS), synced; returns its
  SHA-256, hashed as it is written (the file is not read back)."""
  header = io.BytesIO()
  np.lib.format.write_array_header_1_0(
    header,
    {
      'descr': np.lib.format.dtype_to_descr(np.dtype(dtype)),
      'fortran_order': False,
      'shape': tuple(shape),
    },
  )
  h = hashlib.sha256(header.getvalue())
  with open(path, 'wb') as f:
    f.write(header.getvalue())
    for block in blocks:
      data = memoryview(
        typing.cast(Any, np.ascontiguousarray(block, dtype))
      ).cast('B')
      h.update(data)
      f.write(data)
    f.flush()
    os.fsync(f.fileno())
  return h.hexdigest()


class _NpyRows:
  """Rows ``[lo, hi)`` of an .npy file, read with ``pread`` (no memory map)."""

  def __init__(self, path: str):
    with open(path, 'rb') as f:
      version = np.lib.format.read_magic(f)
      read = (
        np.lib.format.read_array_header_1_0
        if version == (1, 0)
        else np.lib.format.read_array_header_2_0
      )
      self.shape, _, dtype = read(f)
      self.offset = f.tell()
    self.path, self.dtype = path, np.dtype(dtype)
    self.row_bytes = (
      int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
    )

  def __len__(self) -> int:
    return self.shape[0]

  def __getitem__(self, window: slice) -> np.ndarray:
    lo, hi, _ = window.indices(self.shape[0])
    n = max(0, hi - lo)
    with open(self.path, 'rb') as f:
      data = os.pread(
        f.fileno(), n * self.row_bytes, self.offset + lo * self.row_bytes
      )
    if len(data) != n * self.row_bytes:
      raise DataError(
        f'{self.path}: cut short; resume from an earlier run folder or start '
        'afresh without --resume'
      )
    return np.frombuffer(data, self.dtype).reshape((n,) + tuple(self.shape[1:]))


def write_delta(
  directory: str, step: int, state, chain: List[dict], identity: str
) -> dict:
  """Writes the rows changed since the last checkpoint (every state's files'
  ``dirty`` rows) as step ``step``'s delta; returns the manifest to
  publish with the Orbax step (``chain`` plus this delta).

  Raises OSError (naming the folder) when it cannot be written; nothing of
  it is left then.

  Args:
    directory: the checkpoints' folder.
    step: the round.
    state: the state (or a list of them).
    chain: the deltas so far.
    identity: the run identity.

  Returns:
    The step's manifest.
  """
  root = os.path.join(directory, FOLDER)
  name = f'delta-{step}-{secrets.token_hex(4)}'
  tmp = os.path.join(root, name + '.tmp')
  os.makedirs(tmp)
  digests = {}
  try:
    for s, st in enumerate(_states(state)):
      leaves = _leaves(st)
      idx = np.asarray(
        np.flatnonzero(np.any([a.dirty for a in leaves], axis=0))
        if leaves
        else [],
        np.int64,
      )
      digests[f'index-{s}.npy'] = _write_npy(
        os.path.join(tmp, f'index-{s}.npy'), idx.dtype, idx.shape, [idx]
      )
      b = _block(leaves)
      for i, a in enumerate(leaves):
        digests[f'leaf-{s}-{i}.npy'] = _write_npy(
          os.path.join(tmp, f'leaf-{s}-{i}.npy'),
          a.dtype,
          (len(idx),) + tuple(a.shape[1:]),
          (a[idx[lo : lo + b]] for lo in range(0, len(idx), b)),
        )
    _sync_dir(tmp)
    os.rename(tmp, os.path.join(root, name))
    _sync_dir(root)
  except BaseException as e:
    shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(e, OSError) and not e.filename:
      raise OSError(e.errno, e.strerror, tmp) from None
    raise
  shapes = [[list(a.shape) for a in _leaves(st)] for st in _states(state)]
  return dict(
    chain=list(chain) + [dict(name=name, step=int(step), sha256=digests)],
    shapes=shapes,
    identity=identity,
    init_keys=[
      _leaves(st)[0].maker.key_data if _leaves(st) else []
      for st in _states(state)
    ],
  )


def committed(state) -> None:
  """The delta of a published checkpoint holds every changed row: none is
  changed since.

  Args:
    state: the state (or a list of them).

  Returns:
    None.
  """
  for st in _states(state):
    for a in _leaves(st) if isinstance(st, HostedState) else []:
      if isinstance(a, DiskRows):
        a.dirty[:] = False


def discard(directory: str, manifest: Optional[dict]) -> None:
  """Removes the delta of a checkpoint whose Orbax step failed.

  Args:
    directory: the checkpoints' folder.
    manifest: the failed step's manifest.

  Returns:
    None.
  """
  if manifest:
    shutil.rmtree(
      os.path.join(directory, FOLDER, manifest['chain'][-1]['name']),
      ignore_errors=True,
    )


def _load_delta(root: str, entry: dict, num_states: int):
  """[(index, [leaf rows]) per state] of a delta, each file checked."""
  folder = os.path.join(root, entry['name'])
  out = []
  for s in range(num_states):
    files = [f'index-{s}.npy'] + sorted(
      (k for k in entry['sha256'] if k.startswith(f'leaf-{s}-')),
      key=lambda k: int(k[:-4].split('-')[2]),
    )
    arrays = []
    for f in files:
      path = os.path.join(folder, f)
      if not os.path.exists(path):
        raise DataError(
          f'{path}: missing (the rows of checkpoint step {entry["step"]}); '
          'resume from an earlier run folder or start afresh without --resume'
        )
      if file_sha256(path) != entry['sha256'][f]:
        raise DataError(
          f'{path}: damaged (its sha256 is not the one checkpoint step '
          f'{entry["step"]} recorded); resume from an earlier run folder or '
          f'start '
          'afresh without --resume'
        )
      arrays.append(_NpyRows(path))
    out.append((np.asarray(arrays[0][:], np.int64), arrays[1:]))
  return out


class _Base:
  """The folded rows of client-row checkpoints.

  ``base/``: sparse row files, which rows are made, their CRC32s, the
  folded deltas' names and the run's identity."""

  def __init__(self, root: str, shapes: List[List[list]], dtypes: List[list]):
    self.folder = os.path.join(root, 'base')
    self.shapes, self.dtypes = shapes, dtypes
    self.meta_path = os.path.join(self.folder, 'meta.npz')
    self.folded, self.identity, self.made, self.crc = [], None, [], []
    if os.path.exists(self.meta_path):
      try:
        with np.load(self.meta_path) as meta:
          info = json.loads(str(meta['info']))
          self.folded, self.identity = info['folded'], info['identity']
          self.made = [meta[f'made-{s}'] for s in range(len(shapes))]
          self.crc = [
            [meta[f'crc-{s}-{i}'] for i in range(len(l))]
            for s, l in enumerate(shapes)
          ]
      except Exception as e:  # noqa: BLE001 -- any unreadable meta file is damage
        raise DataError(
          f'{self.meta_path}: damaged ({type(e).__name__}); resume from an '
          'earlier run folder or start afresh without --resume'
        ) from None
    else:
      self.made = [np.zeros(l[0][0] if l else 0, bool) for l in shapes]
      self.crc = [[np.zeros(sh[0], np.uint32) for sh in l] for l in shapes]

  def path(self, s: int, i: int) -> str:
    return os.path.join(self.folder, f'leaf-{s}-{i}.rows')

  def row_bytes(self, s: int, i: int) -> int:
    return (
      int(np.prod(self.shapes[s][i][1:], dtype=np.int64))
      * np.dtype(self.dtypes[s][i]).itemsize
    )

  def write(self, s: int, i: int, idx: np.ndarray, rows: np.ndarray) -> None:
    os.makedirs(self.folder, exist_ok=True)
    rb = self.row_bytes(s, i)
    fd = os.open(self.path(s, i), os.O_RDWR | os.O_CREAT, 0o644)
    try:
      for j, r in enumerate(idx):
        data = np.ascontiguousarray(rows[j], self.dtypes[s][i]).tobytes()
        os.pwrite(fd, data, int(r) * rb)
        self.crc[s][i][r] = zlib.crc32(data)
      os.fsync(fd)
    finally:
      os.close(fd)
    self.made[s][idx] = True

  def read(self, s: int, i: int, idx: np.ndarray) -> np.ndarray:
    rb, shape = self.row_bytes(s, i), tuple(self.shapes[s][i][1:])
    out = np.empty((len(idx),) + shape, self.dtypes[s][i])
    path = self.path(s, i)
    fd = os.open(path, os.O_RDONLY)
    try:
      for j, r in enumerate(idx):
        data = os.pread(fd, rb, int(r) * rb)
        if len(data) != rb or zlib.crc32(data) != self.crc[s][i][r]:
          raise DataError(
            f'{path}: damaged (client row {int(r)} is not the row its '
            f'checkpoint '
            'wrote); resume from an earlier run folder or start afresh without '
            '--resume'
          )
        out[j] = np.frombuffer(data, self.dtypes[s][i]).reshape(shape)
    finally:
      os.close(fd)
    return out

  def publish(self, folded: List[str], identity: str) -> None:
    os.makedirs(self.folder, exist_ok=True)
    arrays = {f'made-{s}': m for s, m in enumerate(self.made)}
    arrays.update(
      {
        f'crc-{s}-{i}': c
        for s, l in enumerate(self.crc)
        for i, c in enumerate(l)
      }
    )
    arrays['info'] = np.asarray(
      json.dumps(dict(folded=folded, identity=identity))
    )
    tmp = self.meta_path + '.tmp'
    with open(tmp, 'wb') as f:
      np.savez(f, **arrays)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, self.meta_path)
    _sync_dir(self.folder)
    self.folded, self.identity = list(folded), identity


def _dtypes(state) -> List[list]:
  return [[np.dtype(a.dtype).str for a in _leaves(st)] for st in _states(state)]


def fold(directory: str, manifests: Dict[int, Optional[dict]], state) -> None:
  """After a checkpoint is published: folds into the base the deltas every
  kept step holds (``manifests``: kept step -> manifest, None for a step
  saved whole) and removes the delta folders no kept step needs.

  Args:
    directory: the checkpoints' folder.
    manifests: the kept steps' manifests.
    state: the state (or a list of them).

  Returns:
    None.
  """
  root = os.path.join(directory, FOLDER)
  chains = [m['chain'] for m in manifests.values() if m]
  oldest = manifests[min(manifests)] if manifests else None
  if oldest:
    base = _Base(root, oldest['shapes'], _dtypes(state))
    names = [e['name'] for e in oldest['chain']]
    if base.folded != names[: len(base.folded)] or (
      base.identity not in (None, oldest['identity'])
    ):
      if any(
        [e['name'] for e in c][: len(base.folded)] == base.folded
        for c in chains
      ):
        return  # a kept step still needs this base as it is
      # another line of checkpoints': afresh
      shutil.rmtree(base.folder, ignore_errors=True)
      base = _Base(root, oldest['shapes'], _dtypes(state))
    todo = oldest['chain'][len(base.folded) :]
    for entry in todo:
      for s, (idx, leaves) in enumerate(
        _load_delta(root, entry, len(oldest['shapes']))
      ):
        b = _block(leaves)
        for i, rows in enumerate(leaves):
          for lo in range(0, len(idx), b):
            base.write(s, i, idx[lo : lo + b], rows[lo : lo + b])
    if todo:
      base.publish(names, oldest['identity'])
    folded = set(names)
  else:
    folded = set()
  if not chains:  # every kept step saved its rows whole
    shutil.rmtree(root, ignore_errors=True)
    return
  needed = {e['name'] for c in chains for e in c} - folded
  if os.path.isdir(root):
    for name in os.listdir(root):
      if name.startswith('delta-') and name not in needed:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def restore(directory: str, manifest: dict, state) -> None:
  """Writes the rows of the checkpoint ``manifest`` describes into the client
  rows of ``state`` (files or memory; made from ``init``, nothing written
  yet): the base's rows, then the deltas past it. Rows in files restored
  from it are not changed since (the next delta starts from here). Rows
  never written are made from the checkpointed run's key in files; in
  memory they are the template's (``runs.init()``: the run's own key).

  Args:
    directory: the checkpoints' folder.
    manifest: the step's manifest.
    state: the state whose row files are written.

  Returns:
    None.

  Raises:
    DataError: a file is missing or damaged, or the base is another run's.
  """
  root = os.path.join(directory, FOLDER)
  states = _states(state)
  want = [[list(a.shape) for a in _leaves(st)] for st in states]
  if manifest['shapes'] != want:
    raise DataError(
      f"{root}: its rows are shaped {manifest['shapes']}, this run's {want}; "
      'resume with the flags of the run that wrote it'
    )
  base = _Base(root, manifest['shapes'], _dtypes(state))
  names = [e['name'] for e in manifest['chain']]
  if base.folded and (
    base.folded != names[: len(base.folded)]
    or base.identity != manifest['identity']
  ):
    raise DataError(
      f'{base.meta_path}: the rows of another run (or of a later line of '
      'checkpoints) than the checkpoint being resumed; resume from an earlier '
      'run '
      'folder or start afresh without --resume'
    )
  replay = [
    _load_delta(root, e, len(states))
    for e in manifest['chain'][len(base.folded) :]
  ]
  for s, st in enumerate(states):
    leaves = _leaves(st)
    # rows never written: from the run's key
    if leaves and isinstance(leaves[0], DiskRows):
      leaves[0].maker.rekey(manifest['init_keys'][s])
    later = np.zeros(len(base.made[s]), bool)
    for delta in replay:
      later[delta[s][0]] = True
    from_base = (
      np.flatnonzero(base.made[s] & ~later)
      if base.folded
      else np.zeros(0, np.int64)
    )
    b = _block(leaves)
    for lo in range(0, len(from_base), b):
      idx = from_base[lo : lo + b]
      for i, a in enumerate(leaves):
        a[idx] = base.read(s, i, idx)
    for delta in replay:
      idx, rows = delta[s]
      for lo in range(0, len(idx), b):
        for i, a in enumerate(leaves):
          a[idx[lo : lo + b]] = np.asarray(rows[i][lo : lo + b])
  committed(state)


def write_whole_rows(whole_rows, state) -> None:
  """Rows restored from a checkpoint that saved them whole (rows in memory)
  written into a state's files; they stay changed, so that the next delta
  holds them all.

  Args:
    whole_rows: the rows as saved.
    state: the state whose row files are written.

  Returns:
    None.
  """
  for st, rows in zip(_states(state), whole_rows):
    leaves = _leaves(st)
    b = _block(leaves)
    for a, src in zip(leaves, jax.tree.leaves(rows)):
      for lo in range(0, a.shape[0], b):
        a[np.arange(lo, min(lo + b, a.shape[0]))] = np.asarray(src[lo : lo + b])
