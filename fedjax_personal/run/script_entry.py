"""How every script starts: absl's ``app.run`` with one-line errors.

A bad flag, a bad setting (``ConfigError``) or a missing, corrupt or
undownloadable data file (``DataError``, ``FileNotFoundError``) ends in one
line on stderr and exit status 2, and Ctrl-C / SIGTERM in one line saying
what is kept (130 / 143), never a traceback. ``run_experiment.py`` has its
own, finer fault path (``faults``: it stops between rounds).
"""

import signal
import sys
import threading
import time

from absl import app, flags

from fedjax_personal.errors import ConfigError
from fedjax_personal.run import faults


__all__ = ['parse_flags', 'run_script']


def parse_flags(argv):
  """absl's flag parsing, but a bad flag is a one-line error with exit
  status 2 (absl exits 1).

  Args:
    argv: the command line.

  Returns:
    What absl leaves of it.
  """
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)


def run_script(main, kept: str = 'nothing is kept; run the same command again') -> None:
  """Runs ``main(argv)`` as a script with one-line errors: exit status 2 for
  bad input; Ctrl-C (130) or SIGTERM (143) end in one line saying what is
  ``kept``.

  Args:
    main: the script's ``main(argv)``.
    kept: what an interruption keeps (in its line).

  Returns:
    None.
  """
  def guarded(argv):
    _STOPPED['main'] = threading.get_ident()
    signal.signal(signal.SIGINT, _stop)  # also when started ignoring it
    signal.signal(signal.SIGTERM, _stop)
    sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)
    try:
      return main(argv)
    except (ConfigError, FileNotFoundError) as e:
      print(f'error: {e}', file=sys.stderr, flush=True)
      sys.exit(2)
    except KeyboardInterrupt:
      _STOPPED['caught'] = True
      name, status = _STOPPED.get('by', ('interrupted', 130))
      print(f'\nerror: {name}; {kept}', file=sys.stderr, flush=True)
      # Interrupted inside JAX: no interpreter shutdown (it can crash there).
      faults.quiet_exit(status)
  app.run(guarded, flags_parser=parse_flags)


def _quiet_unraisable(hook):
  """``sys.unraisablehook`` that drops the KeyboardInterrupt ``_stop``
  raised inside a garbage-collection callback or a finalizer (Python would
  print "Exception ignored in ..." and its traceback): ``_stop`` sends the
  signal again until the script catches it, and the script's one line
  follows."""
  def quiet(unraisable):
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
      hook(unraisable)
  return quiet


_STOPPED = {}
#: Seconds after which a signal whose KeyboardInterrupt was swallowed is sent again.
REDELIVER_SECONDS = 1.0


def _stop(signum, frame):
  """SIGINT / SIGTERM: KeyboardInterrupt in the main thread. Python drops an
  exception raised inside a garbage-collection callback or a finalizer
  ("Exception ignored in: <function _xla_gc_callback ...>"), and the run
  would go on as if never interrupted: until the script has caught it, the
  signal is sent again every ``REDELIVER_SECONDS``."""
  del frame
  _STOPPED.setdefault('by', ('terminated', 143) if signum == signal.SIGTERM
                      else ('interrupted', 130))
  if 'timer' not in _STOPPED:
    def again():
      while not _STOPPED.get('caught'):
        time.sleep(REDELIVER_SECONDS)
        if not _STOPPED.get('caught'):
          signal.pthread_kill(_STOPPED['main'], signum)
    _STOPPED['timer'] = threading.Thread(target=again, daemon=True)
    _STOPPED['timer'].start()
  raise KeyboardInterrupt
