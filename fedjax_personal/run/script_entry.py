"""How every script starts: its flags generated from its settings classes,
read once into them, and absl's ``app.run`` with one-line errors.

Every flag of every script is a field of a settings dataclass (``hparam``):
``define_settings_flags`` makes the flags (the one place absl's flags are
defined) and ``read_settings`` the typed object the script passes down.

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
from typing import Any, Dict, List, Optional

from absl import app, flags, logging

from fedjax_personal.errors import SettingError
from fedjax_personal.hparams import (
  as_flag_error,
  field_types,
  flag_fields,
  flag_name,
  is_list,
)
from fedjax_personal.run import faults, plugins

__all__ = [
  'AMBIGUOUS_WHEN_REPEATED',
  'define_settings_flags',
  'given_more_than_once',
  'HELP_FLAGS',
  'parse_flags',
  'quiet_logging_unless_asked',
  'read_settings',
  'run_script',
]


def define_settings_flags(
  cls,
  module_name: Optional[str] = None,
  defaults: Optional[dict] = None,
  flag_values: Optional[flags.FlagValues] = None,
) -> None:
  """One flag per field of the settings class ``cls`` (``flag_name``:
  ``<prefix>_<field>`` or its declared ``flag``), typed by the field's
  annotation (a tuple: a comma list; ``choices``: an enum), help and
  default from its ``hparam``. A flag already defined (a field another
  class declares too) is left as it is.

  Args:
    cls: a settings dataclass.
    module_name: the ``--helpfull`` group (default: the caller's module).
    defaults: ``{flag: default}`` replacing the declared ones.
    flag_values: the absl ``FlagValues`` to define them in (default: absl's
      global ``FLAGS``).

  Returns:
    None.
  """
  fv = flags.FLAGS if flag_values is None else flag_values
  types = field_types(cls)
  for f in flag_fields(cls):
    name, meta, t = flag_name(cls, f.name), f.metadata, types[f.name]
    if name in fv:
      continue
    default = (defaults or {}).get(name, f.default)
    kw: Dict[str, Any] = dict(
      flag_values=fv, **({'module_name': module_name} if module_name else {})
    )
    if is_list(t) and meta.get('repeatable'):
      flags.DEFINE_multi_string(name, list(default or ()), meta['help'], **kw)
    elif is_list(t):
      flags.DEFINE_list(
        name, None if default is None else list(default), meta['help'], **kw
      )
    elif t is bool:
      flags.DEFINE_bool(name, default, meta['help'], **kw)
    elif t is int:
      flags.DEFINE_integer(name, default, meta['help'], **kw)
    elif t is float:
      flags.DEFINE_float(name, default, meta['help'], **kw)
    elif meta.get('choices'):
      flags.DEFINE_enum(
        name, default, list(meta['choices']), meta['help'], **kw
      )
    else:
      flags.DEFINE_string(name, default, meta['help'], **kw)


def read_settings(
  cls, flag_values: Optional[flags.FlagValues] = None, **resolved
):
  """``cls`` made from its fields' parsed flags (comma lists as tuples),
  checked as it is made (``hparams.Declared``).

  Args:
    cls: a settings dataclass whose flags were defined.
    flag_values: the parsed ``FlagValues`` (default: absl's ``FLAGS``).
    **resolved: fields given a value other than their flag's.

  Returns:
    The settings.

  Raises:
    ConfigError naming the flag of a value out of its range.
  """
  fv = flags.FLAGS if flag_values is None else flag_values
  types = field_types(cls)
  values = {}
  for f in flag_fields(cls):
    v = fv[flag_name(cls, f.name)].value
    values[f.name] = tuple(v) if is_list(types[f.name]) and v is not None else v
  return cls(**{**values, **resolved})


def parse_flags(argv):
  """absl's flag parsing, but a bad flag is a one-line error with exit
  status 2 (absl exits 1). A flag given more than once takes its last value,
  as absl does (the command line and flagfiles read in the order given), and
  one line says which value is used; a list flag whose repetition is
  ambiguous (``AMBIGUOUS_WHEN_REPEATED``: ``--algorithm``, ``--sweep``) is
  refused.

  Args:
    argv: the command line.

  Returns:
    What absl leaves of it.
  """
  twice = given_more_than_once(argv, flags.FLAGS)
  for name, values in twice.items():
    if name in AMBIGUOUS_WHEN_REPEATED:
      print(
        f'error: --{name}: given {len(values)} times ({", ".join(values)}); '
        'give it once, with every value in one comma list',
        file=sys.stderr,
      )
      sys.exit(2)
  try:
    left = flags.FLAGS(argv)
  except flags.Error as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  except SystemExit as e:
    # absl's --help / --helpfull print the help and exit 1: asked for, 0
    if e.code == 1 and any(a.split('=')[0] in HELP_FLAGS for a in argv[1:]):
      sys.exit(0)
    raise
  for name, values in twice.items():
    print(
      f'note: --{name} given {len(values)} times ({", ".join(values)}): '
      f'using the last, {values[-1]}',
      file=sys.stderr,
      flush=True,
    )
  return left


#: List flags whose repetition could mean "add" or "replace": refused.
AMBIGUOUS_WHEN_REPEATED = ('algorithm', 'sweep')

#: absl's flags that print the help (and exit).
HELP_FLAGS = (
  '--help',
  '-help',
  '-h',
  '-?',
  '--helpfull',
  '--helpshort',
  '--helpxml',
)


def given_more_than_once(argv, fv: flags.FlagValues) -> Dict[str, List[str]]:
  """The flags given more than once, on the command line and in flagfiles
  together (a flagfile's lines read where it is given, as absl reads them),
  with their values in order (the last is the one used). A repeatable flag
  (``--import``) is not repeated.

  Args:
    argv: the command line.
    fv: the defined flags.

  Returns:
    ``{name: [value as given, ...]}`` of each flag given twice or more.
  """
  seen: Dict[str, List[str]] = {}

  def scan(args, depth=0):
    for a in args:
      if a == '--':
        return
      if not a.startswith('--') or len(a) == 2:
        continue
      name, eq, value = a[2:].partition('=')
      if name == 'flagfile':
        for path in value.split(',') if depth < 10 else ():
          scan(plugins.flagfile_lines(path), depth + 1)
        continue
      if not eq:
        value = 'true'
        if name not in fv and name.startswith('no') and name[2:] in fv:
          name, value = name[2:], 'false'
      if name in fv and not isinstance(fv[name], flags.MultiFlag):
        seen.setdefault(name, []).append(value)

  scan(list(argv[1:]))
  return {k: v for k, v in seen.items() if len(v) > 1}


def import_plugins(argv) -> None:
  """The user's modules of ``--import`` (``plugins.import_all``), imported
  before the flags are defined; a failure is one line, exit 2.

  Args:
    argv: the command line.

  Returns:
    None.
  """
  try:
    plugins.import_all(argv)
  except SettingError as e:
    print(f'error: {as_flag_error(e)}', file=sys.stderr, flush=True)
    sys.exit(2)


def quiet_logging_unless_asked() -> None:
  """absl's logging at WARNING unless ``--verbosity`` was given (Orbax logs
  every save at INFO).

  Returns:
    None.
  """
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
    # A lost process: Orbax's own threads log the collective that failed, with
    # its traceback, before the run's one line names the process
    # (run/faults.py).
    logging.get_absl_logger().addFilter(
      lambda record: (
        not (
          record.levelno >= logging.ERROR
          and 'Gloo' in record.getMessage()
          and 'Connection reset' in record.getMessage()
        )
      )
    )


def run_script(
  main, kept: str = 'nothing is kept; run the same command again', settings=None
) -> None:
  """Runs the script's ``main`` with one-line errors: exit status 2 for bad
  input; Ctrl-C (130) or SIGTERM (143) end in one line saying what is
  ``kept``.

  Args:
    main: the script's ``main(settings)`` (``main(argv)`` without
      ``settings``).
    kept: what an interruption keeps (in its line).
    settings: the script's settings class: ``main`` receives it read from
      the flags (``read_settings``), and arguments that are not flags are
      refused.

  Returns:
    None.
  """

  def guarded(argv):
    _STOPPED['main'] = threading.get_ident()
    signal.signal(signal.SIGINT, _stop)  # also when started ignoring it
    signal.signal(signal.SIGTERM, _stop)
    sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)
    try:
      faults.fit_address_space_limit()
      if settings is None:
        return main(argv)
      if len(argv) > 1:
        print(
          f'error: unexpected arguments {argv[1:]}', file=sys.stderr, flush=True
        )
        sys.exit(2)
      return main(read_settings(settings))
    except (SettingError, FileNotFoundError) as e:
      if isinstance(e, SettingError):
        e = as_flag_error(e)
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


_STOPPED: Dict[str, Any] = {}
#: Seconds after which a signal whose KeyboardInterrupt was swallowed is sent
#: again.
REDELIVER_SECONDS = 1.0


def _stop(signum, frame):
  """SIGINT / SIGTERM: KeyboardInterrupt in the main thread. Python drops an
  exception raised inside a garbage-collection callback or a finalizer
  ("Exception ignored in: <function _xla_gc_callback ...>"), and the run
  would go on as if never interrupted: until the script has caught it, the
  signal is sent again every ``REDELIVER_SECONDS``."""
  del frame
  _STOPPED.setdefault(
    'by',
    ('terminated', 143) if signum == signal.SIGTERM else ('interrupted', 130),
  )
  if 'timer' not in _STOPPED:

    def again():
      while not _STOPPED.get('caught'):
        time.sleep(REDELIVER_SECONDS)
        if not _STOPPED.get('caught'):
          signal.pthread_kill(_STOPPED['main'], signum)

    _STOPPED['timer'] = threading.Thread(target=again, daemon=True)
    _STOPPED['timer'].start()
  raise KeyboardInterrupt
