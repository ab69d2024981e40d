"""What a job sets for its whole process and reads back from it: the
matmul precision and the compilation cache (``--matmul_precision``,
``--compilation_cache``, set afresh by each job so that one process's jobs
never inherit another's), the convolution a model resolved to, and what
the run's compiles and wall clock cost (``summary.json``).
"""

import dataclasses
import os
import time
from typing import Optional

from fedjax_personal import compilation, numerics
from fedjax_personal.core.executors import model_has_conv
from fedjax_personal.errors import ConfigError
from fedjax_personal.hparams import hparam
from fedjax_personal.models import resolve_conv_impl

__all__ = ['ProcessSettings', 'set_numerics', 'set_compilation_cache', 'conv_impl_of', 'time_to_result',
           'process_seconds']


@dataclasses.dataclass(frozen=True)
class ProcessSettings:
  """What a job sets for its whole process, declared once (``hparam``; the
  command's flags are generated from these fields)."""
  compilation_cache: Optional[str] = hparam(
      None, "JAX's persistent compilation cache: a folder, or off (default: "
      '$FEDJAX_PERSONAL_COMPILATION_CACHE, else <cache>/xla: $FEDJAX_PERSONAL_CACHE or '
      '~/.cache/fedjax_personal). A second run of the same experiment starts without compiling; '
      "entries are keyed by JAX's own key, never stale; the folder is bounded (least recently "
      'used out).')
  matmul_precision: str = hparam(
      numerics.DEFAULT_MATMUL_PRECISION, 'Precision of every float32 matmul and convolution of '
      "the run (JAX's jax_default_matmul_precision): float32 (the default: the same numbers on "
      "every card), tf32 (TensorFloat-32 products, a GPU's fast default), bf16x3 (three "
      "bfloat16 passes, near float32), bf16 (one bfloat16 pass, a TPU's default), or JAX's "
      'default / high / highest. XLA:CPU computes float32 whatever the setting. Recorded in the '
      'run identity.', choices=tuple(numerics.MATMUL_PRECISIONS))


def say(text: str) -> None:
  """Prints ``text`` on process 0 only."""
  from fedjax_personal.run import distributed
  if distributed.is_primary():
    print(text)


def set_numerics(opts) -> None:
  """--matmul_precision for every computation of the run (when not given:
  $JAX_DEFAULT_MATMUL_PRECISION if set, else the package's float32), set
  afresh by each job so that one process's jobs never inherit another's.

  Args:
    opts: the run's ``settings.Settings``.

  Returns:
    None.
  """
  name = (opts.matmul_precision if opts['matmul_precision'].present
          else os.environ.get('JAX_DEFAULT_MATMUL_PRECISION') or numerics.DEFAULT_MATMUL_PRECISION)
  numerics.set_matmul_precision(name)


_IMPORT_CACHE = []


def set_compilation_cache(opts) -> None:
  """--compilation_cache for the run (when not given: the cache the
  package opened at import), set afresh by each job; the header names it.

  Args:
    opts: the run's ``settings.Settings``.

  Returns:
    None.
  """
  if not _IMPORT_CACHE:  # what the import chose, restored for jobs that do not say
    _IMPORT_CACHE.append(compilation.directory())
  choice = opts.compilation_cache
  if choice is not None and choice.strip().lower() == 'off':
    compilation.disable()
  elif choice:
    try:
      compilation.enable(choice)
    except OSError as e:
      raise ConfigError('compilation_cache', f'{choice}: {e.strerror or e}; give a writable '
                        'folder, or off') from None
  elif _IMPORT_CACHE[0]:
    compilation.enable(_IMPORT_CACHE[0])
  else:
    compilation.disable()
  where = compilation.directory()
  if where:
    entries, nbytes = compilation.size(where)
    say(f'compilation cache: {where} ({entries} entries, {nbytes / 2**20:.0f} MB, bounded to '
        f'{compilation.MAX_BYTES / 2**30:.0f} GB)')
  else:
    say('compilation cache: off')


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
  runners = [getattr(runs, 'runner', None)] + [getattr(r, 'runner', None)
                                               for r in getattr(runs, 'runs', [])]
  feeds = {id(r.feed): r.feed for r in runners if r is not None and r.host is not None}
  feeds.update({id(runs.feed): runs.feed} if getattr(runs, 'feed', None) is not None else {})
  return {'wall_seconds': time.perf_counter() - began,
          'compile_seconds': now['compile_seconds'] - compiled['compile_seconds'],
          'compiled_shapes': max([len(f.shapes) for f in feeds.values()], default=1),
          'process_seconds': process_seconds(),
          '_programs': now['compiles'] - compiled['compiles'],
          '_hits': now['cache_hits'] - compiled['cache_hits']}


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
