"""How every script starts: absl's ``app.run`` with one-line errors.

A bad flag, a bad setting (``ConfigError``) or a missing, corrupt or
undownloadable data file (``DataError``, ``FileNotFoundError``) ends in one
line on stderr and exit status 2, and Ctrl-C / SIGTERM in one line saying
what is kept (130 / 143), never a traceback. ``run_experiment.py`` has its
own, finer fault path (``faults``: it stops between rounds).
"""

import signal
import sys

from absl import app, flags

from fedjax_personal.errors import ConfigError
from fedjax_personal.run import faults


def parse_flags(argv):
  """absl's flag parsing, but a bad flag is a one-line error with exit
  status 2 (absl exits 1)."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)


def run_script(main, kept: str = 'nothing is kept; run the same command again') -> None:
  """Runs ``main(argv)`` as a script with one-line errors: exit status 2 for
  bad input; Ctrl-C (130) or SIGTERM (143) end in one line saying what is
  ``kept``."""
  def guarded(argv):
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started ignoring it
    signal.signal(signal.SIGTERM, _terminate)
    try:
      return main(argv)
    except (ConfigError, FileNotFoundError) as e:
      print(f'error: {e}', file=sys.stderr, flush=True)
      sys.exit(2)
    except KeyboardInterrupt:
      name, status = _STOPPED.get('by', ('interrupted', 130))
      print(f'\nerror: {name}; {kept}', file=sys.stderr, flush=True)
      # Interrupted inside JAX: no interpreter shutdown (it can crash there).
      faults.quiet_exit(status)
  app.run(guarded, flags_parser=parse_flags)


_STOPPED = {}


def _terminate(signum, frame):
  _STOPPED['by'] = ('terminated', 143)
  raise KeyboardInterrupt
