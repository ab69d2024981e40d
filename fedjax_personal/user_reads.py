"""What a user's code reads while it runs: the files it opens, the modules it
imports and the environment variables it reads.

A run's numbers depend on more than its flags when a user's plugin, model
builder or data set reader reads something of its own: a JSON file of
hyperparameters, a labels file, a helper module imported inside ``build``,
``$MY_SCALE``. ``recording()`` records those reads (Python's audit hooks,
``sys.addaudithook``, for files and imports; ``os.environ`` watched for
variables), so that the run identity and a population store's key hold them
(``Reads.record``): a changed one refuses ``--resume`` and rebuilds a store.

Nothing is installed by importing this module: the audit hook is added on
the first ``recording()`` and does nothing outside one.
"""

import contextlib
import dataclasses
import hashlib
import importlib.util
import os
import sys
import types
from typing import Dict, Iterator, List, Optional, Set

__all__ = ['AT_IMPORT', 'digest_of', 'Reads', 'recording', 'so_far']

#: What each user module read while it was imported (``--import``), by its
#: source file: ``Reads.record``. A data set's store key holds its
#: reader's module's (a labels file read at import).
AT_IMPORT: Dict[str, Dict[str, list]] = {}


@dataclasses.dataclass
class Reads:
  """The files and environment variables read while recording.

  The files opened for reading and the environment variables read
  within ``recording()``.

  Attributes:
    files: absolute paths (a module's compiled ``.pyc`` as its source).
    env: ``{name: value or None when unset}``, the value first read.
  """

  files: Set[str] = dataclasses.field(default_factory=set)
  env: Dict[str, Optional[str]] = dataclasses.field(default_factory=dict)

  def update(self, other: 'Reads') -> None:
    """Adds ``other``'s reads to these.

    Args:
      other: more reads.

    Returns:
      None.
    """
    self.files |= other.files
    for k, v in other.env.items():
      self.env.setdefault(k, v)

  def record(self, skip=()) -> Dict[str, list]:
    """The reads as a run identity or a store's key holds them: each user
    file's path and content digest (Python's, installed packages' and this
    library's files, the system's, and the paths in ``skip`` left out), each
    variable's name and the digest of its value (values are not written).

    Args:
      skip: paths recorded elsewhere (a reader's named files).

    Returns:
      ``{'files': [[path, digest]], 'env': [[name, digest or None]]}``,
      sorted; empty lists when nothing was read.
    """
    left = {os.path.abspath(os.fspath(p)) for p in skip}
    caches = _compilation_caches()
    files = [
      [p, digest_of(p)]
      for p in sorted(self.files)
      if p not in left and _users_file(p) and not p.startswith(caches)
    ]
    env = [
      [k, None if v is None else _text_digest(v)]
      for k, v in sorted(self.env.items())
    ]
    return {'files': files, 'env': env}


#: What each user callable read in this process so far (``so_far``).
_SO_FAR: Dict[tuple, Reads] = {}


def so_far(key: tuple, reads: Reads) -> Reads:
  """``reads`` with what the same callable (``key``) read before in this
  process: a module it imported once is not read again when it runs again
  (a notebook's second run), and is still what it runs.

  Args:
    key: the callable's name (``('model', name)``).
    reads: what it read this time.

  Returns:
    Every read of it in this process.
  """
  seen = _SO_FAR.setdefault(key, Reads())
  seen.files |= reads.files
  seen.env.update(reads.env)  # a variable's value now
  return seen


#: The recordings in progress, innermost last.
_ACTIVE: List[Reads] = []
_HOOKED: List[bool] = [False]


def _audit(event: str, args) -> None:
  if not _ACTIVE or event not in ('open', 'sqlite3.connect'):
    return
  path = args[0]
  mode = args[1] if event == 'open' and len(args) > 1 else 'r'
  if isinstance(path, (bytes, int)) or path is None:
    return
  if isinstance(mode, str) and any(c in mode for c in 'wax+'):
    return
  path = os.path.abspath(os.fspath(path))
  if path.endswith('.pyc'):  # a module imported from its cached bytecode
    try:
      path = importlib.util.source_from_cache(path)
    except ValueError:
      pass
  for reads in _ACTIVE:
    reads.files.add(path)


#: ``os.environ``'s own class, before any recording.
_PLAIN_ENVIRON = type(os.environ)


class _WatchedEnviron(_PLAIN_ENVIRON):  # type: ignore[valid-type,misc]
  """``os.environ`` that notes each variable read.

  ``os.environ`` while a recording is active: each variable read is
  noted (``os.environ[...]``, ``.get``, ``in``, ``os.getenv``)."""

  def __getitem__(self, key):
    try:
      value = super().__getitem__(key)
    except KeyError:
      _note(key, None)
      raise
    _note(key, value)
    return value


def _note(key, value) -> None:
  """Notes a variable read by the user's own code (the innermost frame
  outside ``os`` and the mapping machinery is a user's file): a library
  reading its own settings (JAX's ``LIBTPU_INIT_ARGS``) is not the user's."""
  if not isinstance(key, str):
    return
  frame: Optional[types.FrameType] = sys._getframe(2)
  while frame is not None and (
    frame.f_code.co_filename in _MAPPING_FILES
    or frame.f_code.co_filename.startswith('<frozen ')
  ):
    frame = frame.f_back
  if frame is None or not _users_file(
    os.path.abspath(frame.f_code.co_filename)
  ):
    return
  for reads in _ACTIVE:
    reads.env.setdefault(key, value)


_MAPPING_FILES = frozenset(
  {os.__file__, __import__('_collections_abc').__file__}
)


@contextlib.contextmanager
def recording() -> Iterator[Reads]:
  """Within the context, every file opened for reading and every
  environment variable read is recorded into the yielded ``Reads`` (and
  into those of enclosing recordings).

  Yields:
    The ``Reads``, filled as the code runs.
  """
  if not _HOOKED[0]:
    sys.addaudithook(_audit)
    _HOOKED[0] = True
  reads = Reads()
  _ACTIVE.append(reads)
  if type(os.environ) is _PLAIN_ENVIRON:
    setattr(os.environ, '__class__', _WatchedEnviron)
  try:
    yield reads
  finally:
    _ACTIVE.remove(reads)
    if not _ACTIVE and type(os.environ) is _WatchedEnviron:
      setattr(os.environ, '__class__', _PLAIN_ENVIRON)


_LIBRARY_ROOTS = tuple(
  {
    sys.prefix,
    sys.base_prefix,
    sys.exec_prefix,
    '/proc',
    '/sys',
    '/dev',
    '/etc',
    '/usr',
  }
)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: This library's own folders (the package, its algorithms and data sets).
_OWN = tuple(
  os.path.join(_ROOT, d, '')
  for d in ('fedjax_personal', 'algorithms', 'datasets')
)


def _users_file(path: str) -> bool:
  """A regular file of the user's: not Python's, an installed library's,
  this checkout's or the system's."""
  return (
    not path.startswith(_LIBRARY_ROOTS)
    and not path.startswith(_OWN)
    and f'{os.sep}.cache{os.sep}fedjax_personal{os.sep}' not in path
    and not os.path.basename(path).startswith('<')
    and os.path.isfile(path)
  )


def _compilation_caches() -> tuple:
  """JAX's persistent compilation cache folder (its files are read while
  compiling, whoever asked), when one is set."""
  jax = sys.modules.get('jax')
  folder = getattr(
    getattr(jax, 'config', None), 'jax_compilation_cache_dir', None
  )
  return (os.path.join(os.path.abspath(folder), ''),) if folder else ()


def digest_of(path: str) -> str:
  """SHA-256 (16 hex digits) of a file's bytes, 'unreadable' when it
  cannot be read.

  Args:
    path: the file.

  Returns:
    16 hex digits, or 'unreadable'.
  """
  h = hashlib.sha256()
  try:
    with open(path, 'rb') as f:
      for chunk in iter(lambda: f.read(1 << 20), b''):
        h.update(chunk)
  except OSError:
    return 'unreadable'
  return h.hexdigest()[:16]


def _text_digest(text: str) -> str:
  return hashlib.sha256(text.encode(errors='replace')).hexdigest()[:16]
