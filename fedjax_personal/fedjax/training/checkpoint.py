"""FedJAX's checkpoints (``fedjax.training.checkpoint``): the state pickled
to ``<root_dir>/checkpoint_<round, 8 digits>``, the newest ``keep`` kept.
FedJAX's checkpoints load here and these in FedJAX."""

import glob
import os
import re
from typing import Any, List, Optional, Tuple

from fedjax_personal.fedjax.core import serialization

__all__ = ['load_latest_checkpoint', 'save_checkpoint']

_CHECKPOINT_PREFIX = 'checkpoint_'


def _checkpoint_paths(base_path: str) -> List[str]:
  """The checkpoints under ``base_path`` (a prefix), oldest first."""
  pattern = re.escape(base_path) + r'[0-9]{8}$'
  paths = [
    p for p in glob.glob(glob.escape(base_path) + '*') if re.match(pattern, p)
  ]
  return sorted(paths, key=lambda p: int(p[len(base_path) :]))


def load_latest_checkpoint(root_dir: str) -> Optional[Tuple[Any, int]]:
  """The newest checkpoint's state and round number, or None.

  Args:
    root_dir: the experiment's folder.

  Returns:
    ``(state, round number)`` or None when there is none.
  """
  base_path = os.path.join(root_dir, _CHECKPOINT_PREFIX)
  paths = _checkpoint_paths(base_path)
  if not paths:
    return None
  return serialization.load_state(paths[-1]), int(paths[-1][len(base_path) :])


def save_checkpoint(
  root_dir: str, state: Any, round_num: int = 0, keep: int = 1
) -> None:
  """Saves ``state`` as round ``round_num``'s checkpoint; removes all but
  the newest ``keep``.

  Args:
    root_dir: the experiment's folder.
    state: the server state.
    round_num: the round it ends.
    keep: how many checkpoints stay.

  Returns:
    None.
  """
  base_path = os.path.join(root_dir, _CHECKPOINT_PREFIX)
  serialization.save_state(state, f'{base_path}{round_num:08d}')
  for path in _checkpoint_paths(base_path)[:-keep]:
    os.remove(path)
