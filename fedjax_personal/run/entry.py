"""How every script starts: absl's ``app.run`` with one-line errors.

A bad flag, a bad setting (``ConfigError``) or a missing, corrupt or
undownloadable data file (``DataError``, ``FileNotFoundError``) ends in one
line on stderr and exit status 2, never a traceback.
"""

import sys

from absl import app, flags

from fedjax_personal.errors import ConfigError


def parse_flags(argv):
  """absl's flag parsing, but a bad flag is a one-line error with exit
  status 2 (absl exits 1)."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)


def run_script(main) -> None:
  """Runs ``main(argv)`` as a script with one-line errors (exit status 2)."""
  def guarded(argv):
    try:
      return main(argv)
    except (ConfigError, FileNotFoundError) as e:
      print(f'error: {e}', file=sys.stderr, flush=True)
      sys.exit(2)
  app.run(guarded, flags_parser=parse_flags)
