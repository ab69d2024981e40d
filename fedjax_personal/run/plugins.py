"""A user's own modules, imported by the command before its flags are
defined (``--import=MODULE_OR_PATH``, repeatable, also in a flagfile), so
that the algorithms and data sets they register get their flags.

A module is a ``.py`` file (by path) or a module name importable from the
current folder. Its source's SHA-256 enters the run identity
(``identity``): a run resumed with a changed plugin is refused, and a
changed plugin gets another default output folder.
"""

import hashlib
import importlib
import importlib.util
import os
import sys
import traceback
from typing import Dict, List, Optional, Sequence

from fedjax_personal import user_reads
from fedjax_personal.errors import ConfigError, installed_or_ours

__all__ = [
  'BROUGHT',
  'flagfile_lines',
  'identity',
  'import_all',
  'imports_in',
  'LOADED',
  'load',
]

#: What the command imported, in order: ``{given text: source path}``.
LOADED: Dict[str, str] = {}
#: The modules each import brought in from outside the installed packages (a
#: helper beside the user's file): ``{given text: [source paths]}``.
BROUGHT: Dict[str, List[str]] = {}


def imports_in(argv: Sequence[str]) -> List[str]:
  """The ``--import`` values of a command line, flagfiles included (read
  as absl reads them: one flag per line, ``#`` comments), in order.

  Args:
    argv: the command line (its first item the program).

  Returns:
    The values, each once.
  """
  out: List[str] = []

  def scan(args, depth=0):
    it = iter(args)
    for a in it:
      for flag, into in (('--import', out), ('--flagfile', None)):
        value = None
        if a.startswith(flag + '='):
          value = a[len(flag) + 1 :]
        elif a == flag:
          value = next(it, None)
        if value is None:
          continue
        if into is not None:  # one module a flag: a path may hold a comma
          into.extend([value] if value else [])
        elif depth < 10:
          for path in value.split(','):
            scan(flagfile_lines(path), depth + 1)

  scan(list(argv[1:]))
  return list(dict.fromkeys(out))


def flagfile_lines(path: str) -> List[str]:
  """A flagfile's flags as absl reads them: one a line, blank lines and
  ``#`` comments left out; none when it cannot be read (absl names a
  missing flagfile itself).

  Args:
    path: the flagfile.

  Returns:
    Its lines, stripped.
  """
  try:
    with open(path) as f:
      return [
        l.strip() for l in f if l.strip() and not l.lstrip().startswith('#')
      ]
  except OSError:
    return []


def load(spec: str):
  """Imports one user module: a ``.py`` file by path, or a module name
  (the current folder searched first).

  Args:
    spec: the path or the name.

  Returns:
    The module.

  Raises:
    ConfigError('import', ...): not found, or it failed while importing
    (the line names the file, line and error).
  """
  before = set(sys.modules)
  with user_reads.recording() as reads:
    module = _imported(spec)
  LOADED[spec] = getattr(module, '__file__', None) or spec
  _note_shadowed(module)
  path = os.path.abspath(LOADED[spec])
  if module.__name__ not in before or spec not in BROUGHT:  # it ran now
    BROUGHT[spec] = sorted(
      p
      for p in (_user_source(m) for m in set(sys.modules) - before)
      if p and p != LOADED[spec]
    )
    # besides its helper modules: the files and variables it read
    user_reads.AT_IMPORT[path] = reads.record(skip=[path] + BROUGHT[spec])
  return module


def _imported(spec: str):
  """``load``'s import of one module, its failures as one line."""
  try:
    if spec.endswith('.py') or os.sep in spec:
      path = os.path.abspath(os.path.expanduser(spec))
      if not os.path.isfile(path):
        raise ConfigError('import', f'{spec}: no such file')
      name = os.path.splitext(os.path.basename(path))[0]
      taken = sys.modules.get(name)
      if taken is not None and getattr(taken, '__file__', None) != path:
        # another module has the file's name (a user's json.py): never replace
        # it
        name = f'{name}_{hashlib.sha256(path.encode()).hexdigest()[:8]}'
      if (
        name in sys.modules
        and getattr(sys.modules[name], '__file__', None) == path
      ):
        module = sys.modules[name]
      else:
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
          raise ConfigError('import', f'{spec}: not a Python module')
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = (
          module  # its functions' __module__ resolves (the store's key)
        )
        # its helpers beside it import, as a script's
        if os.path.dirname(path) not in sys.path:
          sys.path.append(os.path.dirname(path))
        try:
          module_spec.loader.exec_module(module)
        except BaseException:
          sys.modules.pop(name, None)
          raise
    else:
      if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
      try:
        module = importlib.import_module(spec)
      except ModuleNotFoundError as e:
        if e.name != spec.split('.')[0] and e.name != spec:
          raise
        raise ConfigError(
          'import',
          f"{spec}: no such module here (give a .py file's path, or "
          'run from the folder that holds it)',
        ) from None
  except ConfigError:
    raise
  except SystemExit as e:
    # a module that exits while imported: nothing would run
    raise ConfigError(
      'import', f'{spec} called sys.exit({e.code!r}) while imported'
    ) from None
  except (Exception, KeyboardInterrupt) as e:  # the user's module failed
    frames = [
      f
      for f in traceback.extract_tb(e.__traceback__)
      if 'importlib' not in f.filename and f.filename != __file__
    ]
    where = f'{frames[-1].filename}:{frames[-1].lineno}' if frames else spec
    raise ConfigError(
      'import', f'{spec} failed at {where}: {type(e).__name__}: {e}'
    ) from None
  return module


def _note_shadowed(module) -> None:
  """One line when the user's module imports a module that has a file of
  the same name beside it which Python did not import (a local ``json.py``
  under the standard ``json``): the user's file is not what runs."""
  folder = os.path.dirname(
    os.path.abspath(getattr(module, '__file__', '') or '')
  )
  for value in list(vars(module).values()):
    name = getattr(value, '__name__', None)
    if not isinstance(value, type(sys)) or not name or value is module:
      continue
    beside = os.path.join(folder, name.split('.')[0] + '.py')
    used = os.path.abspath(getattr(value, '__file__', None) or '')
    if os.path.isfile(beside) and used != beside:
      print(
        f'note: {os.path.basename(module.__file__)} imports {name}, which is '
        f"{used or 'built in'}, not {beside} beside it (Python's own comes "
        f'first: rename '
        'yours)',
        file=sys.stderr,
        flush=True,
      )


def _user_source(name: str) -> Optional[str]:
  """The source file of module ``name`` when it is the user's own (neither
  an installed package's nor Python's), else None."""
  path = getattr(sys.modules.get(name), '__file__', None)
  if not path or not path.endswith('.py') or installed_or_ours(path):
    return None
  return os.path.abspath(path)


def import_all(argv: Sequence[str]) -> List[str]:
  """Imports every ``--import`` of a command line (``imports_in``).

  Args:
    argv: the command line.

  Returns:
    The values imported.
  """
  specs = imports_in(argv)
  for spec in specs:
    load(spec)
  return specs


def identity(specs: Sequence[str]) -> List[List[str]]:
  """``[[name, SHA-256 (16 hex digits)]]`` of imported modules: the run
  identity's ``imports``. The name is the file's (the same file named by
  another path is the same plugin); the digest covers its source and that of
  every module of the user's it brought in (``BROUGHT``: a changed helper
  beside it is a changed plugin).

  Args:
    specs: the ``--import`` values.

  Returns:
    One pair per module.
  """
  out = []
  for spec in specs:
    path = LOADED.get(spec) or spec
    # A plugin alone: its source's digest (as earlier runs recorded it); with
    # helpers: of its source, each helper's name and source after it.
    h, readable = hashlib.sha256(), True
    for source in [path] + BROUGHT.get(spec, []):
      if source != path:
        h.update(b'\0' + os.path.basename(source).encode())
      try:
        with open(source, 'rb') as f:
          h.update(f.read())
      except OSError:
        h.update(b'unreadable')
        readable = readable and source != path
    reads = user_reads.AT_IMPORT.get(os.path.abspath(path))
    if reads and any(reads.values()):  # files and variables it read
      h.update(b'\0reads' + repr(reads).encode())
    digest = (
      h.hexdigest()[:16] if readable or BROUGHT.get(spec) else 'unreadable'
    )
    out.append(
      [os.path.basename(path) if path.endswith('.py') else spec, digest]
    )
  return out
