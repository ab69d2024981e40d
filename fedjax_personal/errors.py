"""The error types of bad input, importable from anywhere in the package.

The scripts turn ``ConfigError`` (and only it) into a one-line message and
exit status 2; ``DataError`` is the data-file case of it. ``user_frame``
finds where a user's own code (a file of ``--import``, a model's builder)
raised, for such a line.
"""

import os
import sys
import sysconfig
import traceback
import types
from typing import Iterable, Optional

__all__ = [
  'caller_file',
  'ConfigError',
  'DataError',
  'HostLimitError',
  'SettingError',
  'installed_or_ours',
  'user_frame',
]

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_LIBRARIES = tuple(
  os.path.abspath(p)
  for p in {
    sysconfig.get_paths()[k]
    for k in ('stdlib', 'platstdlib', 'purelib', 'platlib')
  }
)


def user_frame(e: BaseException, files: Iterable[str] = ()) -> Optional[str]:
  """``file:line`` of the innermost frame of ``e``'s traceback in one of
  ``files`` (a user's modules), else in a file that is neither this
  package's nor an installed library's nor Python's own; None when the
  error arose in neither (this package's or a library's own failure).

  Args:
    e: the exception.
    files: the user's source files, checked first.

  Returns:
    ``'path:line'`` or None.
  """
  own = {os.path.abspath(f) for f in files if f}
  frames = traceback.extract_tb(e.__traceback__)
  mine = [f for f in frames if os.path.abspath(f.filename) in own]
  if not mine:
    mine = [f for f in frames if not installed_or_ours(f.filename)]
  return f'{mine[-1].filename}:{mine[-1].lineno}' if mine else None


def installed_or_ours(path: str) -> bool:
  """Whether a source file is this checkout's (the package, its
  ``algorithms`` and ``datasets``, scripts, tests), an installed library's
  or Python's own, i.e. not a file of the user's.

  Args:
    path: a source file (``'<string>'`` and the like count as not the user's).

  Returns:
    True for any of those.
  """
  path = os.path.abspath(path)
  here = os.path.dirname(_PACKAGE)
  return (
    path.startswith(here + os.sep)
    or path.startswith(_LIBRARIES)
    or path.startswith(sys.prefix)
    or os.path.basename(path).startswith('<')
  )


class SettingError(ValueError):
  """A setting's value that cannot apply.

  Named as the library names it: a field of a settings class (``owner``; None: a
  name of its own). The message starts with ``setting:``; a command's entry says
  it by its flag (``hparams.as_flag_error``).

  Attributes:
    setting: the field.
    message: what is wrong, without the name.
    owner: the settings class that declares the field, or None.
  """

  def __init__(
    self,
    setting: str,
    message: str,
    owner: Optional[type] = None,
    text: Optional[str] = None,
  ):
    super().__init__(f'{setting}: {message}' if text is None else text)
    self.setting, self.message, self.owner = setting, message, owner


class ConfigError(SettingError):
  """An invalid or inapplicable setting, named by its flag.

  ``name`` is the flag (or field) it concerns and the message starts with
  ``--name:``."""

  def __init__(self, name: str, message: str, text: Optional[str] = None):
    super().__init__(
      name, message, text=f'--{name}: {message}' if text is None else text
    )
    self.name = name


class DataError(ConfigError):
  """A data file that is missing, corrupted or not what it claims to be.

  The message starts with the file's path."""

  def __init__(self, message: str):
    super().__init__('data_dir', message, text=message)


class HostLimitError(ConfigError):
  """A host limit on the process below what a run needs.

  A limit the host sets on the process (``ulimit -v``) below what a run
  needs; the message starts with the limit."""

  def __init__(self, limit: str, message: str):
    super().__init__(limit, message, text=f'{limit}: {message}')


def caller_file() -> str:
  """The file of the innermost frame on the stack outside this package (its
  ``fedjax_personal``, ``algorithms`` and ``datasets`` folders): who
  registers something (two files registering one name are refused; one file
  registering it again, a re-run notebook cell, replaces it).

  Returns:
    The path.
  """
  root = os.path.dirname(_PACKAGE)
  inside = tuple(
    os.path.join(d, '')
    for d in (
      _PACKAGE,
      os.path.join(root, 'algorithms'),
      os.path.join(root, 'datasets'),
    )
  )
  frame: Optional[types.FrameType] = sys._getframe(1)
  while frame is not None and os.path.abspath(
    frame.f_code.co_filename
  ).startswith(inside):
    frame = frame.f_back
  return os.path.abspath(frame.f_code.co_filename) if frame is not None else '?'
