"""JAX's persistent compilation cache for every run, and what compiling cost.

A short experiment costs its compiles more than its rounds: a second run of
the same command, every configuration of a sweep in another process, a
notebook after a restart would compile the same programs again. The
command (``--compilation_cache``) turns JAX's persistent compilation cache
on, and a library user opts in with one call, ``enable()``: in
``<cache>/xla`` (``$FEDJAX_PERSONAL_CACHE``, default
``~/.cache/fedjax_personal``), for programs of any compile time, bounded to
``MAX_BYTES`` (``trim``: the least recently used entries go when the cache
is opened). Importing the package leaves JAX's cache as it is. Entries are
keyed by JAX's own key (the program, the backend and its version, compile
options, JAX's settings such as the matmul precision), so a stale entry is
never used; an entry that cannot be read is compiled again (JAX's
behaviour), never trusted.

For the command, ``$FEDJAX_PERSONAL_COMPILATION_CACHE=DIR`` moves it and
``=off`` turns it off, as ``--compilation_cache`` does; a cache the user
configured for JAX (``JAX_COMPILATION_CACHE_DIR``) is kept as it is
(``command_default``).

``stats()`` counts, from JAX's own monitoring events, the seconds spent
compiling and tracing and the cache's hits and misses in this process since
it was first called: the header and ``summary.json`` report them.
"""

import os
import threading
import time
from typing import List, Optional, Tuple

import jax
from jax import monitoring
from jax.experimental.compilation_cache import compilation_cache as cc

__all__ = [
  'command_default',
  'default_dir',
  'directory',
  'disable',
  'enable',
  'MAX_BYTES',
  'size',
  'stats',
  'trim',
]

#: The cache's bound on disk (``trim``).
MAX_BYTES = 2 << 30
_ENV = 'FEDJAX_PERSONAL_COMPILATION_CACHE'

#: When the package was imported (``run.process.process_seconds``'s fallback).
IMPORTED_AT = time.perf_counter()
_lock = threading.Lock()
_counts = {
  'compile_seconds': 0.0,
  'trace_seconds': 0.0,
  'compiles': 0,
  'cache_hits': 0,
  'cache_misses': 0,
}


def default_dir() -> str:
  """``<$FEDJAX_PERSONAL_CACHE or ~/.cache/fedjax_personal>/xla``.

  Returns:
    The folder's path.
  """
  root = os.environ.get('FEDJAX_PERSONAL_CACHE') or os.path.join(
    '~', '.cache', 'fedjax_personal'
  )
  return os.path.join(os.path.expanduser(root), 'xla')


def enable(path: Optional[str] = None, max_bytes: int = MAX_BYTES) -> str:
  """Turns JAX's persistent compilation cache on in ``path`` (default:
  ``default_dir()``), caching every program whatever its compile time.

  Args:
    path: the cache folder (made if missing).
    max_bytes: its bound on disk (``trim`` now).

  Returns:
    The folder.
  """
  path = os.path.abspath(os.path.expanduser(path or default_dir()))
  os.makedirs(path, exist_ok=True)
  trim(path, max_bytes)
  jax.config.update('jax_compilation_cache_dir', path)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  jax.config.update('jax_enable_compilation_cache', True)
  _reset_jax_cache()
  return path


def trim(path: str, max_bytes: int = MAX_BYTES) -> int:
  """Removes the least recently used entries of the cache folder until it
  holds at most three quarters of ``max_bytes``, when it holds more.

  Done once when the cache is opened, not by JAX during the run: JAX's own
  bound (``jax_compilation_cache_max_size``) evicts while other processes
  of a sweep or a test session write to the same folder, and they then
  warn of entries gone from under them.

  Args:
    path: the cache folder.
    max_bytes: the bound.

  Returns:
    The bytes removed.
  """
  entries = _files(path)
  total = sum(size for _, size, _ in entries)
  if total <= max_bytes:
    return 0
  removed = 0
  for _, size, name in sorted(entries):
    if total - removed <= 0.75 * max_bytes:
      break
    try:
      os.remove(name)
      removed += size
    except OSError:
      pass
  return removed


def disable() -> None:
  """Turns the persistent compilation cache off for this process.

  Returns:
    None.
  """
  jax.config.update('jax_enable_compilation_cache', False)
  _reset_jax_cache()


def _reset_jax_cache() -> None:
  """JAX opens its cache once per process: a changed setting takes effect
  after this (``compilation_cache.reset_cache``, where JAX has it)."""
  try:
    cc.reset_cache()
  except (ImportError, AttributeError):
    pass


def command_default() -> Optional[str]:
  """The cache the command opens when ``--compilation_cache`` is not given:
  ``$FEDJAX_PERSONAL_COMPILATION_CACHE`` (a folder; ``off``: None), else
  the cache the user set up for JAX (``$JAX_COMPILATION_CACHE_DIR`` or
  ``jax.config``), else ``default_dir()``.

  Returns:
    The folder, or None for no cache.
  """
  choice = os.environ.get(_ENV, '').strip()
  if choice.lower() == 'off':
    return None
  return (
    choice
    or os.environ.get('JAX_COMPILATION_CACHE_DIR')
    or _jax_option('jax_compilation_cache_dir')
    or default_dir()
  )


def directory() -> Optional[str]:
  """The cache folder in use, or None when it is off.

  Returns:
    The folder, or None.
  """
  if not _jax_option('jax_enable_compilation_cache'):
    return None
  return _jax_option('jax_compilation_cache_dir') or None


def _jax_option(name: str):
  """``jax.config``'s option ``name`` (its options are attributes made at
  import, unknown to a type checker)."""
  return getattr(jax.config, name)


def size(path: Optional[str] = None):
  """(entries, bytes) of the cache folder (``directory()`` by default).

  Args:
    path: a cache folder (None: ``directory()``).

  Returns:
    ``(entries, bytes)``.
  """
  path = path or directory()
  entries = total = 0
  if path and os.path.isdir(path):
    for _, nbytes, _ in _files(path):
      entries += 1
      total += nbytes
  return entries, total


def _files(path: str) -> List[Tuple[float, int, str]]:
  """(last access, bytes, path) of each file in the cache folder; a file
  another process removes meanwhile (its own probe, an entry it evicted) is
  left out."""
  out: List[Tuple[float, int, str]] = []
  try:
    scanned = list(os.scandir(path))
  except OSError:
    return out
  for e in scanned:
    try:
      if e.is_file():
        st = e.stat()
        out.append((st.st_atime, st.st_size, e.path))
    except FileNotFoundError:
      pass
  return out


def stats() -> dict:
  """This process's compile seconds (XLA's backend compiles), trace seconds,
  compiles, and the persistent cache's hits and misses so far.

  Returns:
    A dict of seconds and counts.
  """
  _listen()
  with _lock:
    return dict(_counts)


_listening: list = []


def _listen() -> None:
  """Registers the monitoring listeners once per process."""
  if _listening:
    return
  _listening.append(True)

  def on_duration(event: str, duration_secs: float, **_) -> None:
    with _lock:
      if event == '/jax/core/compile/backend_compile_duration':
        _counts['compile_seconds'] += duration_secs
        _counts['compiles'] += 1
      elif event == '/jax/core/compile/jaxpr_trace_duration':
        _counts['trace_seconds'] += duration_secs

  def on_event(event, **_):
    with _lock:
      if event == '/jax/compilation_cache/cache_hits':
        _counts['cache_hits'] += 1
      elif event == '/jax/compilation_cache/cache_misses':
        _counts['cache_misses'] += 1

  monitoring.register_event_duration_secs_listener(on_duration)
  monitoring.register_event_listener(on_event)
