"""``hparam``: a setting declared once, as a dataclass field with its default,
help line and valid range. Below every other layer but ``errors`` (the
engine's own settings, e.g. DP-SGD's in ``core/privacy.py``, are declared
with it); ``config`` builds the settings of training and algorithms on it.
"""

import dataclasses
from typing import Optional, Tuple


__all__ = ['hparam']


def hparam(default, help: str, *, choices: Optional[Tuple] = None, minimum=None, maximum=None,
           open_min: bool = False, open_max: bool = False, sweep: bool = False):
  """A documented hyperparameter field.

  Args:
    default: its default (the only place it is written).
    help: one line for ``--helpfull`` and the docs.
    choices: allowed values of a string setting.
    minimum, maximum: numeric bounds (closed unless ``open_min`` /
      ``open_max``); None values (when the default is None) are allowed.
    sweep: may be swept inside one compiled program (``--sweep``): the
      builder only uses it arithmetically.

  Returns:
    A ``dataclasses.field`` carrying the metadata.
  """
  return dataclasses.field(default=default, metadata=dict(
      help=help, choices=choices, minimum=minimum, maximum=maximum, open_min=open_min,
      open_max=open_max, sweep=sweep))
