"""Host (CPU) process settings that XLA:CPU rounds depend on.

glibc's malloc serves blocks above its mmap threshold (at most 32 MiB, and
128 KiB until a large block is freed) with fresh ``mmap`` pages and returns
them on ``free``: every XLA:CPU execution then page-faults its temporaries
and outputs in again. On the 2-core machine of benchmarks/speed/README.md this
made a 52 MB elementwise op 4x slower (31 ms vs 7.8 ms) and a LeNet-5 round of
the PyTorch loop 1.2-1.5x slower; keeping freed blocks in the heap removes it.
The cost: the process keeps its peak heap instead of returning it to the OS.
Where a round moves large host buffers that XLA does not reuse (a cohort's
client rows gathered from and scattered back to the host), the round hands the
heap's free pages back when it ends (``return_free_heap``).
"""

import ctypes
import ctypes.util
import os
from typing import Optional

try:
  import resource
except ImportError:  # not on Windows: no address-space limit to read
  resource = None  # type: ignore[assignment]

__all__ = ['address_space_limit', 'return_free_heap', 'tune_allocator']


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_THRESHOLD = 1 << 30
_done: list = []
_trim: list = []


def tune_allocator() -> bool:
  """Raises glibc's mmap and trim thresholds to 1 GiB, once per process.

  Done by the engine on CPU (``executor_choice.create_executor``); does nothing
  (returns False) without glibc or when ``FEDJAX_PERSONAL_MALLOPT=0``.

  Returns:
    None.
  """
  if _done:
    return _done[0]
  ok = False
  if os.environ.get('FEDJAX_PERSONAL_MALLOPT', '1') != '0':
    try:
      libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
      mallopt = getattr(libc, 'mallopt', None)
      ok = bool(
        mallopt
        and mallopt(_M_MMAP_THRESHOLD, _THRESHOLD)
        and mallopt(_M_TRIM_THRESHOLD, _THRESHOLD)
      )
    except OSError:
      ok = False
  _done.append(ok)
  return ok


def return_free_heap() -> bool:
  """Hands the C heap's free pages back to the OS (glibc's ``malloc_trim``):
  what ``tune_allocator`` keeps for XLA's next execution, after a step that
  freed large host buffers (Ditto's cohort rows at cohort 50 of Stack
  Overflow's LSTM: 0.79 GB held between rounds where 0.37 GB is live).

  Returns:
    Whether anything could be asked (False without glibc).
  """
  if not _trim:
    try:
      libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
      _trim.append(getattr(libc, 'malloc_trim', None))
    except OSError:
      _trim.append(None)
  if _trim[0] is None:
    return False
  _trim[0](0)
  return True


def address_space_limit() -> Optional[int]:
  """The process's address-space limit in bytes (``ulimit -v``), or None
  (unlimited, or a platform without one).

  Returns:
    The limit, or None.
  """
  if resource is None:
    return None
  soft, _ = resource.getrlimit(resource.RLIMIT_AS)
  return None if soft == resource.RLIM_INFINITY else soft
