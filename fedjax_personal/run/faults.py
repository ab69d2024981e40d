"""One fault path: every fault a user meets ends in one line and loses nothing.

Exit statuses (documented in the README):

====  ================================================================
2     bad input: a flag, a setting, a data file (``ConfigError``,
      ``DataError``)
3     training diverged (``experiment.DivergenceError``)
69    a process of a several-process run was lost, or never joined
74    a file could not be written: disk full, read-only, quota
      (``StorageError``)
130   interrupted (Ctrl-C, SIGINT)
143   terminated (SIGTERM)
====  ================================================================

A first SIGINT / SIGTERM asks the run to stop after the round in progress:
the loop saves a checkpoint there (when the run checkpoints) and stops with
``Interrupted``; a second one stops at once (``KeyboardInterrupt``), keeping
the last checkpoint. With several processes every process stops after the
same round (the request is shared each round). The line always says what was
kept and the next command.
"""

import contextlib
import ctypes
import errno
import os
import re
import signal
import sys
import tempfile
import threading
from typing import Any, Dict, Optional

from fedjax_personal.core import host
from fedjax_personal.errors import HostLimitError
from fedjax_personal.run.run_progress import current

__all__ = [
  'captured_stderr',
  'claim_report',
  'error_stream',
  'exit_after_report',
  'EXIT_SIGNAL',
  'Fault',
  'printed_report',
  'finished_line',
  'fit_address_space_limit',
  'out_of_address_space',
  'out_of_memory',
  'install_signal_handlers',
  'Interrupted',
  'interrupted',
  'kept',
  'lost_process',
  'lost_process_reason',
  'LostProcess',
  'quiet_exit',
  'reported_status',
  'share_stop_requests',
  'signal_received',
  'stop_requested',
  'storage_error',
  'storage_reason',
  'StorageError',
  'where',
]


EXIT_CONFIG, EXIT_DIVERGED, EXIT_LOST_PROCESS, EXIT_STORAGE = 2, 3, 69, 74
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Fault(Exception):
  """A fault with its exit status; ``str`` is the whole one-line message."""

  status = 1


class Interrupted(Fault):
  """Ctrl-C or SIGTERM: the run stopped after a round (exit 130 / 143)."""

  def __init__(self, message: str, status: int = 130):
    super().__init__(message)
    self.status = status


class StorageError(Fault):
  """A full or read-only disk (exit 74)."""

  status = EXIT_STORAGE


class LostProcess(Fault):
  """A process of a several-process run is gone (exit 69)."""

  status = EXIT_LOST_PROCESS


def kept() -> str:
  """What a resumed run would start from, and the next command.

  Returns:
    The text (``RunProgress.kept`` of the current run).
  """
  return current().kept()


def where() -> str:
  """Where the run is, in words (an algorithm and round, or start-up).

  Returns:
    The text (``RunProgress.where`` of the current run).
  """
  return current().where()


def finished_line(output_dir: Optional[str] = None) -> Optional[str]:
  """The line of a run asked to stop when it had nothing left to stop:
  every algorithm's rounds ran and its results were written.

  Args:
    output_dir: the run's folder (None: the one recorded).

  Returns:
    The line, or None when the run did not finish.
  """
  if not signal_received():
    return None
  name = 'interrupted' if _REQUEST['signal'] == signal.SIGINT else 'terminated'
  return (
    f'{name} after the last round of {current().algorithm}: every algorithm '
    'finished and its results are written in '
    f'{output_dir or current().output_dir or "the output folder"}; '
    'nothing to resume'
  )


# -- signals ------------------------------------------------------------------

_REQUEST: Dict[str, Any] = {'signal': None, 'installed': False, 'agree': None}
#: The signal watcher's own: the signals the interpreter took, its thread,
#: the handler it watches for.
_WATCH: Dict[str, Any] = {
  'handled': 0,
  'received': 0,
  'since': 0,
  'thread': None,
  'handler': None,
}


def share_stop_requests(agree) -> None:
  """Several processes: ``agree(code) -> [every process's code]`` (a small
  collective, ``distributed`` registers it) makes every process stop after
  the same round.

  Args:
    agree: the collective, or None to stop sharing.

  Returns:
    None.
  """
  _REQUEST['agree'] = agree


#: Seconds a signal waits for the interpreter to take it (the main thread
#: may be inside a long computation, a compile or an allocation that returns
#: to Python late or never): a first one asks to stop after the round in
#: progress and is given ``FIRST_SIGNAL_GRACE``, a second
#: ``SECOND_SIGNAL_GRACE``;
#: past them the process ends at once, keeping its last checkpoint.
FIRST_SIGNAL_GRACE, SECOND_SIGNAL_GRACE = 20.0, 2.0


def install_signal_handlers() -> None:
  """SIGINT and SIGTERM ask the loop to stop after the current round; a
  second one raises KeyboardInterrupt at once. A watcher thread ends the
  process in seconds when the interpreter cannot take a signal (its main
  thread stuck in a computation or an allocation): one line, the signal's
  exit status, the last checkpoint kept.

  Returns:
    None.
  """

  def handler(signum, frame):
    _WATCH['handled'] += 1
    if _REQUEST['signal'] is not None:
      signal.signal(signal.SIGINT, signal.default_int_handler)
      raise KeyboardInterrupt
    _REQUEST['signal'] = signum
    print(
      f'\nstopping after {where()} (press Ctrl-C again to stop at once)',
      file=sys.stderr,
      flush=True,
    )

  for s in EXIT_SIGNAL:
    signal.signal(s, handler)
  _REQUEST['installed'] = True
  _WATCH['handler'] = handler
  # signals before this run were taken (or were another run's)
  _WATCH['handled'] = _WATCH['since'] = _WATCH['received']
  _watch_signals()


def _watch_signals() -> None:
  """Starts the watcher of ``install_signal_handlers`` (once): the signals'
  wake-up file descriptor (``signal.set_wakeup_fd``) is written by the C
  handler, whatever the main thread is doing."""
  if _WATCH['thread'] is not None:
    return
  try:
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
  except (OSError, ValueError):  # not the main thread, or no pipes
    return

  def watch():
    while True:
      try:
        got = os.read(read_end, 16)
      except OSError:
        return
      for signum in got:
        if signum not in EXIT_SIGNAL:
          continue
        _WATCH['received'] += 1
        received = _WATCH['received']
        first = received - _WATCH['since'] == 1  # of this run
        grace = FIRST_SIGNAL_GRACE if first else SECOND_SIGNAL_GRACE
        timer = threading.Timer(
          grace, _end_if_untaken, (signum, received, grace)
        )
        timer.daemon = True
        timer.start()

  thread = threading.Thread(target=watch, name='signal-watcher', daemon=True)
  thread.start()
  _WATCH['thread'] = thread


def _end_if_untaken(signum: int, received: int, grace: float) -> None:
  """Ends the process when the interpreter has not taken the ``received``-th
  signal yet (its handler did not run): one line, the signal's status."""
  if _WATCH['handled'] >= received:
    return  # taken: the loop stops after its round, or the entry exits
  # no longer the run's handler (a library user's own)
  if signal.getsignal(signum) not in (
    _WATCH['handler'],
    signal.default_int_handler,
  ):
    return
  if not claim_report(EXIT_SIGNAL[signal.Signals(signum)]):
    return
  if _REQUEST['signal'] is None:
    _REQUEST['signal'] = signum
  stop = interrupted(during_round=True)
  try:
    print(
      f'error: {stop} (stopped at once: the process did not answer the signal '
      f'within {grace:g} s)',
      file=error_stream(),
      flush=True,
    )
  finally:
    printed_report()
    quiet_exit(stop.status)


def signal_received() -> bool:
  """Whether this process was asked to stop (no collective: for loops that
  run before the rounds, e.g. building a population store).

  Returns:
    True after SIGINT or SIGTERM.
  """
  return bool(_REQUEST['installed']) and _REQUEST['signal'] is not None


def stop_requested() -> bool:
  """Whether to stop after the round just finished: this process's signal,
  or (several processes) any process's, agreed by every process.

  Returns:
    True to stop now.
  """
  if not _REQUEST['installed']:
    return False
  mine = _REQUEST['signal'] is not None
  if _REQUEST['agree'] is None:
    return mine
  codes = _REQUEST['agree'](EXIT_SIGNAL[_REQUEST['signal']] if mine else 0)
  if any(codes) and not mine:
    _REQUEST['signal'] = next(
      s for s, c in EXIT_SIGNAL.items() if c == max(codes)
    )
  return any(codes)


def interrupted(during_round: bool = False) -> Interrupted:
  """The ``Interrupted`` fault of the signal received, saying what was kept
  and the next command.

  Args:
    during_round: the signal came inside a round (the round is lost).

  Returns:
    The ``Interrupted`` fault.
  """
  signum = _REQUEST['signal'] or signal.SIGINT
  name = 'interrupted' if signum == signal.SIGINT else 'terminated'
  p = current()
  at = (
    'during start-up'
    if not p.algorithm
    else f'during {where()}'
    if during_round
    else f'after the last round of {p.algorithm}, its results written'
    if p.rounds and p.round >= p.rounds
    else f'after round {p.round} of {p.algorithm}'
  )
  return Interrupted(f'{name} {at}; {kept()}', EXIT_SIGNAL[signum])


# -- host limits
# ----------------------------------------------------------------

#: Below this address-space limit (``ulimit -v``) a command refuses to start:
#: JAX's runtime and its threads' reservations need about 0.9 GB on a
#: 2-core x86 machine with malloc's arenas limited
#: (``fit_address_space_limit``),
#: and past that the failures (a thread that cannot start, XLA's abort) are
#: not all catchable.
LEAST_ADDRESS_SPACE = 1 << 30


def fit_address_space_limit() -> None:
  """A command under an address-space limit (``ulimit -v``): malloc's
  per-thread arenas (64 MB of address space each, glibc) are limited to 2
  before JAX's runtime starts its threads, which halves what a run
  reserves (1.8 -> 0.9 GB measured on 2 cores); below
  ``LEAST_ADDRESS_SPACE`` the command is refused in one line. Without a
  limit nothing changes.

  Returns:
    None.

  Raises:
    HostLimitError: the limit is below ``LEAST_ADDRESS_SPACE``.
  """
  limit = host.address_space_limit()
  if limit is None:
    return
  if limit < LEAST_ADDRESS_SPACE:
    raise HostLimitError(
      'ulimit -v',
      f'the process may use {limit / 2**30:.2f} GB of address space; '
      f"JAX's runtime needs {LEAST_ADDRESS_SPACE / 2**30:.0f} GB at least: "
      f'raise '
      'the limit (ulimit -v), or bound memory with a cgroup instead '
      '(systemd-run --scope -p MemoryMax=...)',
    )
  try:
    # M_ARENA_MAX (glibc); elsewhere a no-op or absent
    ctypes.CDLL(None).mallopt(-8, 2)
  except (OSError, AttributeError):
    pass


def out_of_memory(exc: BaseException) -> bool:
  """Whether ``exc`` is memory running out: a ``MemoryError``, the address
  space under ``ulimit -v`` (``out_of_address_space``), or a buffer XLA
  could not allocate (``RESOURCE_EXHAUSTED``).

  Args:
    exc: the error.

  Returns:
    True for those.
  """
  return (
    isinstance(exc, MemoryError)
    or out_of_address_space(exc)
    or (isinstance(exc, RuntimeError) and 'RESOURCE_EXHAUSTED' in str(exc))
  )


def out_of_address_space(exc: BaseException) -> bool:
  """Whether ``exc`` is the address space running out under ``ulimit -v``
  (a library that cannot be mapped, a thread that cannot start).

  Args:
    exc: the error.

  Returns:
    True for those errors while a limit is set.
  """
  text = str(exc)
  return host.address_space_limit() is not None and (
    isinstance(exc, MemoryError)
    or (isinstance(exc, ImportError) and 'failed to map segment' in text)
    or (isinstance(exc, RuntimeError) and "can't start new thread" in text)
  )


# -- storage
# --------------------------------------------------------------------

STORAGE_ERRNOS = {
  errno.ENOSPC: 'No space left on device',
  errno.EROFS: 'Read-only file system',
  errno.EDQUOT: 'Disk quota exceeded',
  errno.EIO: 'Input/output error',
  errno.EACCES: 'Permission denied',
  errno.EFBIG: 'File too large',
}
_CODE = re.compile(r"os_error_code='(\d+)'")


def storage_reason(exc: Optional[BaseException]) -> Optional[str]:
  """The storage failure behind ``exc`` (its cause chain; Orbax's and
  TensorStore's errors carry ``os_error_code``), or None.

  Args:
    exc: the error.

  Returns:
    The reason (no space, read-only, ...), or None.
  """
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
      return exc.strerror or STORAGE_ERRNOS[exc.errno]
    m = _CODE.search(str(exc))
    if m and int(m.group(1)) in STORAGE_ERRNOS:
      return STORAGE_ERRNOS[int(m.group(1))]
    for code, text in STORAGE_ERRNOS.items():
      if code != errno.EACCES and text in str(exc):
        return text
    exc = exc.__cause__ or exc.__context__
  return None


def storage_error(what: str, exc: BaseException) -> StorageError:
  """The ``StorageError`` of failing to write ``what``.

  Args:
    what: the file or folder.
    exc: the error.

  Returns:
    The ``StorageError``.
  """
  return StorageError(
    f'cannot write {what}: {storage_reason(exc)}; {kept()} (free space or '
    'fix the folder first)'
  )


# -- lost processes
# ---------------------------------------------------------------

_LOST = re.compile(
  r'gloo|connection (reset|closed|refused)|another task|heartbeat|'
  r'broken pipe|socket closed|coordination service',
  re.I,
)


def lost_process_reason(exc: BaseException) -> Optional[str]:
  """The first line of an error that means another process is gone (a
  collective whose peer vanished: JAX raises it as JaxRuntimeError or, inside
  Orbax and multihost_utils, ValueError), or None. Only asked while several
  processes run.

  Args:
    exc: the error.

  Returns:
    Its first line, or None.
  """
  text = str(exc)
  if not _LOST.search(text):
    return None
  first = next(
    (l.strip() for l in text.splitlines() if l.strip()), type(exc).__name__
  )
  return first[:160]


def lost_process(reason: str, coordinator: Optional[str]) -> LostProcess:
  """The ``LostProcess`` fault naming the coordinator and the next commands.

  Args:
    reason: what the runtime said.
    coordinator: the coordinator's address.

  Returns:
    The ``LostProcess`` fault.
  """
  return LostProcess(
    f'lost a process of the run ({reason}); coordinator {coordinator}; '
    f'{kept().replace("the same command", "the same commands in every process")}'
  )


_ERR: Dict[str, Any] = {'stream': None}


def error_stream():
  """Where the one-line message goes: stderr, or the original stderr once
  background writers were muted (``captured_stderr``).

  Returns:
    A writable text stream.
  """
  return _ERR['stream'] or sys.stderr


@contextlib.contextmanager
def captured_stderr():
  """Collects what is written to stderr (Python's and the file descriptor)
  inside the block. Normally it is written out afterwards; when the block
  raises a storage fault, stderr stays muted for the rest of the process
  (Orbax's and TensorStore's writer threads go on printing tracebacks of the
  failed write) and ``error_stream`` is the original stderr.

  Yields:
    Nothing; stderr is collected inside the ``with`` block.
  """
  sys.stderr.flush()
  saved_fd, saved_py = os.dup(2), sys.stderr
  buf = tempfile.TemporaryFile()
  os.dup2(buf.fileno(), 2)
  sys.stderr = os.fdopen(os.dup(buf.fileno()), 'w')
  try:
    yield
  except BaseException as e:
    sys.stderr.flush()
    if storage_reason(e) is None and not isinstance(e, StorageError):
      _restore(saved_fd, saved_py, buf)
      raise
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    sys.stderr = open(os.devnull, 'w')
    _ERR['stream'] = os.fdopen(saved_fd, 'w')
    raise
  else:
    _restore(saved_fd, saved_py, buf)


def _restore(saved_fd, saved_py, buf):
  sys.stderr.flush()
  os.dup2(saved_fd, 2)
  os.close(saved_fd)
  sys.stderr = saved_py
  buf.seek(0)
  text = buf.read().decode(errors='replace')
  if text:
    sys.stderr.write(text)
    sys.stderr.flush()


_REPORTED: Dict[str, Optional[int]] = {'status': None}
_REPORT_LOCK = threading.Lock()


def claim_report(status: int) -> bool:
  """True for the first fault of this process (which prints its line);
  later ones (a runtime thread noticing the same fault) exit silently with
  the first one's status.

  Args:
    status: the fault's exit status.

  Returns:
    Whether this process reports it.
  """
  with _REPORT_LOCK:
    if _REPORTED['status'] is not None:
      return False
    _REPORTED['status'] = status
    return True


_PRINTED = threading.Event()


def printed_report() -> None:
  """The fault's line is out (the reporter calls it after printing).

  Returns:
    None.
  """
  _PRINTED.set()


def exit_after_report() -> None:
  """Ends a thread's noticing of a fault another one claimed: waits (5 s at
  most) for its line to be printed, then ends the process with its status,
  so that the process never exits between the claim and the line.

  Returns:
    Never returns.
  """
  _PRINTED.wait(5.0)
  quiet_exit(reported_status())


def reported_status() -> Optional[int]:
  """The exit status of the fault already reported, or None.

  Returns:
    The status, or None.
  """
  return _REPORTED['status']


def quiet_exit(status: Optional[int]) -> None:
  """Ends the process now with ``status`` (no interpreter shutdown in which
  background writer threads could still print).

  Args:
    status: the exit status.

  Returns:
    Never returns.
  """
  sys.stdout.flush()
  sys.stderr.flush()
  error_stream().flush()
  os._exit(1 if status is None else status)
