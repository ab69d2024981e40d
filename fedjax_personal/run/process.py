"""What a job sets for its whole process and reads back from it: the
compilation cache (``--compilation_cache``, set afresh by each job so that
one process's jobs never inherit another's), the convolution a model
resolved to, what the run's compiles and wall clock cost (``summary.json``),
and the lines it prints (process 0 only).
"""

import os
import sys
import tempfile
import time
import warnings

from fedjax_personal import compilation
from fedjax_personal.core.executor_choice import model_has_conv
from fedjax_personal.models import resolve_conv_impl
from fedjax_personal.run import distributed

__all__ = [
  'conv_impl_of',
  'open_compilation_cache',
  'process_seconds',
  'say',
  'time_to_result',
]


def say(text: str) -> None:
  """Prints ``text`` on process 0 only (every process computes the same
  numbers).

  Args:
    text: the line.

  Returns:
    None.
  """
  if distributed.is_primary():
    print(text)


def open_compilation_cache(choice) -> None:
  """The run's compilation cache, set afresh by each job (``choice``:
  ``--compilation_cache``, a folder or ``off``; None: the command's default,
  ``compilation.command_default``); the header names it.

  Args:
    choice: the folder, ``off`` or None.

  Returns:
    None.
  """
  if choice is None:
    choice = compilation.command_default() or 'off'
  if choice.strip().lower() == 'off':
    compilation.disable()
  else:
    try:
      _check_writable(compilation.enable(choice))
    except OSError as e:
      compilation.disable()
      if distributed.is_primary():
        print(
          f'compilation cache: {choice} cannot be written ({e.strerror or e}); '
          f'compiling '
          'without it (the numbers are the same; give a writable folder, or '
          'off)',
          file=sys.stderr,
          flush=True,
        )
      return
    _one_line_for_failed_cache_writes()
  where = compilation.directory()
  if where:
    entries, nbytes = compilation.size(where)
    say(
      f'compilation cache: {where} ({entries} entries, {nbytes / 2**20:.0f} '
      f'MB, bounded to '
      f'{compilation.MAX_BYTES / 2**30:.0f} GB)'
    )
  else:
    say('compilation cache: off')


def _check_writable(folder: str) -> None:
  """Raises OSError unless a file can be written in ``folder``."""
  with tempfile.NamedTemporaryFile(dir=folder, prefix='.writable-'):
    pass


#: JAX's warnings of a cache entry it cannot write or read, and what the
#: command says instead (once each).
_CACHE_FAILURES = {
  'Error writing persistent compilation cache entry': 'programs cannot be saved ({why}); compiling without saving them',
  'Error reading persistent compilation cache entry': 'entries cannot be read ({why}: written by a run that ran out of disk?); compiling '
  'those programs again',
}


def _one_line_for_failed_cache_writes() -> None:
  """JAX warns once per program it cannot save to or read from the cache
  (a disk filled during the run: dozens of lines); the command says each
  kind once, in one line, and drops the rest (the programs still run, only
  uncached; the numbers are the same)."""
  shown = warnings.showwarning
  if getattr(shown, 'collapses_cache_writes', False):
    return
  said = set()

  def showwarning(message, category, filename, lineno, file=None, line=None):
    text = str(message)
    kind = next((k for k in _CACHE_FAILURES if k in text), None)
    if kind is None:
      return shown(message, category, filename, lineno, file, line)
    if kind not in said:
      said.add(kind)
      why = text.split(': ', 1)[-1]
      print(
        f'compilation cache: {compilation.directory()}: '
        f'{_CACHE_FAILURES[kind].format(why=why)} (the numbers are the same)',
        file=sys.stderr,
        flush=True,
      )
    return None

  showwarning.collapses_cache_writes = True  # type: ignore[attr-defined]
  warnings.showwarning = showwarning


def conv_impl_of(model, sample_x):
  """The convolution implementation ``model`` runs with here (``auto``
  resolved for this backend), or None when it has no convolution.

  Args:
    model: the model.
    sample_x: one input batch.

  Returns:
    The implementation, or None without convolutions.
  """
  if not model_has_conv(model, sample_x):
    return None
  impl = getattr(getattr(model, 'module', None), 'conv_impl', None)
  return resolve_conv_impl(impl) if impl is not None else 'xla'


def time_to_result(runs, began: float, compiled: dict) -> dict:
  """What one algorithm's runs cost besides their rounds' median:
  ``wall_seconds`` (its runs built, trained and evaluated), ``compile_seconds``
  (XLA's compiles meanwhile; a persistent cache hit costs its read),
  ``compiled_shapes`` (the host layout's packed cohort shapes; 1 on the
  device layout) and ``process_seconds`` (since this process started); for
  the printed line only, ``_programs`` compiled and ``_hits`` of the cache.

  Args:
    runs: the algorithm's runs.
    began: when they started (``perf_counter``).
    compiled: ``compilation.stats()`` then.

  Returns:
    The figures.
  """
  now = compilation.stats()
  runners = [getattr(runs, 'runner', None)] + [
    getattr(r, 'runner', None) for r in getattr(runs, 'runs', [])
  ]
  feeds = {
    id(r.feed): r.feed for r in runners if r is not None and r.host is not None
  }
  feeds.update(
    {id(runs.feed): runs.feed}
    if getattr(runs, 'feed', None) is not None
    else {}
  )
  return {
    'wall_seconds': time.perf_counter() - began,
    'compile_seconds': now['compile_seconds'] - compiled['compile_seconds'],
    'compiled_shapes': max([len(f.shapes) for f in feeds.values()], default=1),
    'process_seconds': process_seconds(),
    '_programs': now['compiles'] - compiled['compiles'],
    '_hits': now['cache_hits'] - compiled['cache_hits'],
  }


def process_seconds() -> float:
  """Seconds since this process started (Linux: its start time in
  /proc/self/stat; elsewhere since the package was imported).

  Returns:
    Seconds.
  """
  try:
    with open('/proc/self/stat') as f:
      start_ticks = int(f.read().rsplit(')', 1)[1].split()[19])
    with open('/proc/uptime') as f:
      uptime = float(f.read().split()[0])
    return max(0.0, uptime - start_ticks / os.sysconf('SC_CLK_TCK'))
  except (OSError, ValueError, IndexError):
    return time.perf_counter() - compilation.IMPORTED_AT
