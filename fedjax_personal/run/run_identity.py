"""What makes a run a run: its resolved configuration, checked on resume and
before writing into an output folder, so results on disk never mix.

The identity of one algorithm's run is a JSON-able dict of everything that
changes its numbers: the algorithm and its resolved settings, the data set,
partition and their fingerprint (a SHA-256 of the arrays), the model, the
sampler, the seed and the package version. ``--rounds`` is not part of it
(a resumed run may go on longer); the evaluation cadence and executor are
not either (they do not change the numbers of a round).
"""

import dataclasses
import errno
import hashlib
import json
import math
import os
import shutil
import socket
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

try:
  import fcntl
except ImportError:  # not on Windows: runs are not locked against each other
  fcntl = None  # type: ignore[assignment]

import jax
import numpy as np

from fedjax_personal import __version__
from fedjax_personal.datasets.local_files import sha256_file
from fedjax_personal.errors import ConfigError
from fedjax_personal.run import faults

__all__ = [
  'as_json',
  'check_process_count',
  'ALGORITHM_OUTPUTS',
  'claim',
  'JOB_OUTPUTS',
  'data_fingerprint',
  'differences',
  'dumps',
  'file_sha256',
  'finite',
  'identity',
  'lock',
  'padded_fingerprint',
  'read',
  'repaired',
  'short_hash',
  'unlock',
  'write_json',
]


IDENTITY_FILE = 'identity.json'


def data_fingerprint(data) -> str:
  """SHA-256 (16 hex digits) of every array of a FederatedData.

  Args:
    data: a ``FederatedData``.

  Returns:
    16 hex digits.
  """
  h = hashlib.sha256()
  for split in (data.train, data.val, data.test):
    for a in (split.x, split.y, split.num_examples):
      a = np.ascontiguousarray(np.asarray(a))
      h.update(str((a.shape, a.dtype.str)).encode())
      h.update(a.tobytes())
  h.update(np.asarray(data.groups).tobytes())
  return h.hexdigest()[:16]


def padded_fingerprint(store) -> str:
  """``data_fingerprint(store.padded())`` without making the padded arrays:
  every client's rows, then the zero rows padding it to the widest client,
  fed to the same hash split by split (so a run's identity is the same
  whichever layout holds its data).

  Args:
    store: a ``PopulationStore``.

  Returns:
    16 hex digits.
  """
  h = hashlib.sha256()
  num = store.num_clients
  for split in ('train', 'val', 'test'):
    x, y, _ = store.arrays[split]
    counts = np.asarray(store.counts[split])
    starts = np.asarray(store.offsets[split])
    widest = int(counts.max(initial=0))
    for a, dtype in ((x, np.dtype(x.dtype)), (y, np.dtype(np.int32))):
      tail = tuple(a.shape[1:])
      h.update(str(((num, widest) + tail, dtype.str)).encode())
      zero_row = np.zeros(tail, dtype).tobytes()
      for lo, k in zip(starts[:num], counts):
        lo, k = int(lo), int(k)
        h.update(
          np.ascontiguousarray(np.asarray(a[lo : lo + k], dtype)).tobytes()
        )
        h.update(zero_row * (widest - k))
    n = counts.astype(np.int32)
    h.update(str((n.shape, n.dtype.str)).encode())
    h.update(n.tobytes())
  h.update(np.asarray(store.groups, np.int32).tobytes())
  return h.hexdigest()[:16]


def file_sha256(path: str) -> str:
  """The SHA-256 of a file's bytes (hex).

  Args:
    path: the file.

  Returns:
    64 hex digits.
  """
  return sha256_file(path)


def identity(algorithm: str, training, config, job: Dict) -> Dict:
  """One algorithm's run identity: ``job`` holds the shared (data, model,
  sampler, seed) entries.

  Args:
    algorithm: the registry name.
    training: its ``TrainingConfig``.
    config: its own settings.
    job: the shared entries.

  Returns:
    The identity (a JSON-like dict).
  """
  return {
    'algorithm': algorithm,
    'training': dataclasses.asdict(training),
    'config': dataclasses.asdict(config),
    **job,
    'version': __version__,
  }


def short_hash(obj) -> str:
  """The first 8 hex digits of the SHA-256 of ``obj`` as sorted JSON.

  Args:
    obj: a JSON-like value.

  Returns:
    8 hex digits.
  """
  return hashlib.sha256(
    json.dumps(obj, sort_keys=True, default=str).encode()
  ).hexdigest()[:8]


def differences(old: Dict, new: Dict, prefix: str = '') -> List[str]:
  """'key: old -> new' for every leaf that differs.

  Args:
    old: a nested dict.
    new: another.
    prefix: the keys' path so far.

  Returns:
    The differing leaves, one line each.
  """
  out = []
  for k in sorted(set(old) | set(new)):
    a, b = old.get(k), new.get(k)
    if isinstance(a, dict) and isinstance(b, dict):
      out += differences(a, b, f'{prefix}{k}.')
    elif a != b:
      out.append(f'{prefix}{k}: {a!r} -> {b!r}')
  return out


def read(directory: str) -> Optional[Dict]:
  """The identity written in ``directory``, or None when it has none.

  Args:
    directory: the output folder.

  Returns:
    The identity, or None.

  Raises:
    ConfigError('output_dir', ...): the file is empty, damaged or unreadable.
  """
  path = os.path.join(directory, IDENTITY_FILE)
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding='utf-8') as f:
      ident = json.load(f)
  except (
    OSError,
    ValueError,
  ) as e:
    # JSONDecodeError and UnicodeDecodeError are ValueErrors
    why = getattr(e, 'strerror', None) or (
      'empty'
      if not os.path.getsize(path)
      else 'not the JSON this library writes'
    )
    raise ConfigError(
      'output_dir',
      f'{path} is damaged ({why}), so the run in {directory} '
      'cannot be told apart from another: pass --overwrite to start that '
      'folder '
      'again, or choose another --output_dir',
    ) from None
  if not isinstance(ident, dict):
    raise ConfigError(
      'output_dir',
      f'{path} is damaged (not an identity); pass --overwrite to '
      'start that folder again, or choose another --output_dir',
    )
  return ident


def repaired(directory: str, ident: Dict) -> bool:
  """Whether ``directory`` holds a run of ``ident`` (a job's identity,
  ``{'algorithms': {name: identity}}``) to resume. A damaged top-level
  ``identity.json`` is rebuilt from the algorithms' own when every one that
  is there is intact and this run's (one line on stderr says so): nothing
  finished is lost to ``--overwrite``.

  Args:
    directory: the job's output folder.
    ident: its identity.

  Returns:
    True when the folder holds this run (its top-level identity equal, or
    rebuilt).
  """
  try:
    return read(directory) == ident
  except ConfigError:
    pass
  subs = ident.get('algorithms', {})
  try:
    found = {name: read(os.path.join(directory, name)) for name in subs}
  except ConfigError:
    return False
  if not any(found.values()) or any(
    v is not None and v != subs[n] for n, v in found.items()
  ):
    return False
  write_json(os.path.join(directory, IDENTITY_FILE), ident)
  print(
    f'{os.path.join(directory, IDENTITY_FILE)} was damaged; rebuilt from its '
    f"algorithms' "
    "own, which are this run's",
    file=sys.stderr,
    flush=True,
  )
  return True


_LOCKS: Dict[str, Any] = {}


def lock(directory: str) -> None:
  """Takes ``directory`` for this process until ``unlock`` or its end (a
  lock file beside it, ``.<name>.lock``; the operating system releases the
  lock even when the process is killed, so no lock is ever stale).

  Args:
    directory: the output folder.

  Returns:
    None.

  Raises:
    ConfigError('output_dir', ...) when another run holds it.
  """
  path = os.path.abspath(directory)
  if path in _LOCKS:
    return
  if fcntl is None:
    return
  lock_file = os.path.join(
    os.path.dirname(path), f'.{os.path.basename(path)}.lock'
  )
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
  except OSError as e:
    raise _unwritable(os.path.dirname(path), e) from None
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    holder = ''
    for _ in range(20):  # the holder writes its name just after taking the lock
      holder = os.pread(fd, 200, 0).decode(errors='replace').strip()
      if holder:
        break
      time.sleep(0.05)
    os.close(fd)
    holder = holder or 'another process'
    raise ConfigError(
      'output_dir',
      f'{directory} is in use by another run ({holder}); wait for '
      'it to finish, or choose another --output_dir',
    ) from None
  os.ftruncate(fd, 0)
  os.pwrite(fd, f'process {os.getpid()} on {socket.gethostname()}'.encode(), 0)
  _LOCKS[path] = (fd, lock_file)


def unlock(directory: str) -> None:
  """Gives ``directory`` back (the lock file removed).

  Args:
    directory: the output folder.

  Returns:
    None.
  """
  got = _LOCKS.pop(os.path.abspath(directory), None)
  if got is not None:
    fd, lock_file = got
    try:
      os.unlink(lock_file)
    except OSError:
      pass
    os.close(fd)


def _unwritable(directory: str, e: OSError) -> Exception:
  """The fault of an output folder that cannot be written: a full,
  read-only or not writable disk is a StorageError (exit 74, as the README
  says), anything else (a file in the way) a ConfigError of --output_dir."""
  if faults.storage_reason(e):
    return faults.StorageError(
      f'cannot write to {directory}: {e.strerror}; nothing was trained '
      'yet; free space, fix the folder or choose another --output_dir, '
      'then run the same command again'
    )
  return ConfigError(
    'output_dir', f'cannot write to {directory}: {e.strerror or e}'
  )


#: What a run writes into its output folder (besides each algorithm's
#: folder): ``--overwrite`` removes these and nothing else.
JOB_OUTPUTS = (
  IDENTITY_FILE,
  IDENTITY_FILE + '.tmp',
  'comparison.json',
  'accuracy.png',
  'client_accuracy_hist.png',
  'devices.png',
  'tensorboard',
  'client_rows',
)
#: What a run writes into an algorithm's folder.
ALGORITHM_OUTPUTS = (
  IDENTITY_FILE,
  IDENTITY_FILE + '.tmp',
  'metrics.jsonl',
  'summary.json',
  'checkpoints',
  'accuracy.png',
  'client_accuracy_hist.png',
  'devices.png',
  'affinity.png',
)


def claim(
  directory: str,
  ident: Dict,
  overwrite: bool,
  resume: bool,
  outputs: Sequence[str] = (),
  damaged_redone: bool = False,
) -> None:
  """Makes ``directory`` hold this run's results.

  A missing or empty folder is used. A folder holding another
  configuration's results (or anything that is not a run of this library) is
  refused unless ``overwrite``, which removes the run outputs in it
  (``outputs``) and nothing else. Without ``resume`` the folder starts
  without them (old checkpoints of even the same configuration are never
  restored into a fresh run); with ``resume`` it must hold this
  configuration.

  Args:
    directory: the output folder.
    ident: the run identity.
    overwrite: replace the outputs of another configuration.
    resume: the run resumes.
    outputs: the names of what a run writes in it (the others are never
      removed); ``JOB_OUTPUTS`` and the algorithm folders by default.
    damaged_redone: a damaged identity file means this folder's run alone is
      redone (an algorithm's folder in a job whose identity is intact),
      rather than a refusal.

  Returns:
    None.

  Raises:
    ConfigError('output_dir', ...) naming the differences, or when the
    folder cannot be written.
  """
  redo = False
  try:
    old = read(directory)
  except ConfigError as e:
    if not (overwrite or damaged_redone):
      raise
    redo = damaged_redone and not overwrite
    if redo:
      print(
        f'{e.message.split(" (")[0]}; {os.path.basename(directory)} is '
        'redone from its start (the other algorithms are kept)',
        file=sys.stderr,
        flush=True,
      )
      resume = False
    old = None  # its outputs are removed below
  names = set(outputs) or set(JOB_OUTPUTS) | set(
    (old or {}).get('algorithms', {})
  ) | set(ident.get('algorithms', {}))
  ours = _present(directory, names)
  others = _present(directory, None) - ours
  if (ours or others) and not overwrite:
    if old is None and not redo:
      raise ConfigError(
        'output_dir',
        f'{directory} is not empty and holds no run of this '
        'library; choose another --output_dir (or pass --overwrite to write '
        'into it: its other files are kept)',
      )
    if old is not None and old != ident:
      diff = differences(old, ident)
      raise ConfigError(
        'output_dir',
        f'{directory} holds results of another configuration '
        f'({"; ".join(diff[:4])}{"; ..." if len(diff) > 4 else ""}); pass '
        '--overwrite to replace them, or choose another --output_dir',
      )
  try:
    if os.path.exists(directory) and not os.path.isdir(directory):
      raise NotADirectoryError(20, 'not a directory')
    if ours and (overwrite or not resume):
      for name in sorted(ours):
        _remove(os.path.join(directory, name))
    os.makedirs(directory, exist_ok=True)
    write_json(os.path.join(directory, IDENTITY_FILE), ident)
  except OSError as e:
    raise _unwritable(directory, e) from None


def _present(directory: str, names) -> set:
  """The entries of ``directory`` among ``names`` (None: all of them)."""
  try:
    found = set(os.listdir(directory))
  except (FileNotFoundError, NotADirectoryError):
    return set()
  return found if names is None else found & set(names)


def _remove(path: str) -> None:
  """Removes a file or a folder of a run's outputs."""
  if os.path.isdir(path) and not os.path.islink(path):
    _remove_tree(path)
  elif os.path.lexists(path):
    os.unlink(path)


def _remove_tree(directory: str, tries: int = 5) -> None:
  """Removes ``directory``; a file written into it meanwhile (the previous
  run's plots, drawn by a child process after that run returned) is
  removed by the next try."""
  for left in range(tries - 1, -1, -1):
    try:
      shutil.rmtree(directory)
      return
    except OSError as e:
      if e.errno != errno.ENOTEMPTY or not left:
        raise
      time.sleep(0.2)


def finite(obj):
  """``obj`` with every non-finite float replaced by None (strict JSON).

  Args:
    obj: a JSON-like value.

  Returns:
    The value with non-finite floats as None.
  """
  if isinstance(obj, float):
    return obj if math.isfinite(obj) else None
  if isinstance(obj, dict):
    return {k: finite(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [finite(v) for v in obj]
  if isinstance(obj, np.generic):
    return finite(obj.item())
  return obj


def dumps(obj, **kw) -> str:
  """Strict JSON: NaN and infinities are written as null.

  Args:
    obj: a JSON-like value.
    kw: ``json.dumps`` options.

  Returns:
    The JSON text.
  """
  return json.dumps(finite(obj), allow_nan=False, **kw)


def as_json(obj):
  """``obj`` as strict JSON reads it back (tuples as lists, non-finite
  numbers as None, anything else as ``str``): the form compared on resume
  and kept on disk, so a fresh and a re-read value are equal.

  Args:
    obj: a JSON-like value.

  Returns:
    The value as strict JSON reads it back.
  """
  return json.loads(dumps(obj, default=str))


def write_json(path: str, obj) -> None:
  """Writes ``obj`` as JSON to ``path`` atomically (a temporary file renamed).

  Args:
    path: the file.
    obj: a JSON-like value (written strict).

  Returns:
    None.
  """
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    f.write(dumps(obj, indent=1, sort_keys=False, default=str))
  os.replace(tmp, path)


def check_process_count(output_dir: str) -> None:
  """A run resumes with the number of processes it was made with.

  Args:
    output_dir: the job's output folder.

  Returns:
    None.

  Raises:
    ConfigError naming --num_processes.
  """
  old = (read(output_dir) or {}).get('algorithms', {})
  counts = {
    ident.get('num_processes', 1)
    for ident in old.values()
    if isinstance(ident, dict)
  }
  if counts and jax.process_count() not in counts:
    raise ConfigError(
      'num_processes',
      f'{output_dir} was run with {min(counts)} process(es), '
      f'this is {jax.process_count()}: resume with --num_processes='
      f'{min(counts)}',
    )
