"""Where a run stands, for its fault lines: ``RunProgress``, made by the entry
(or the main job) for each run and recorded into as the run goes; the fault
lines (``faults``) read the run's own through ``tracking``.
"""

import contextlib
import contextvars
import dataclasses
from typing import List, Optional

__all__ = ['current', 'RunProgress', 'tracking']


@dataclasses.dataclass
class RunProgress:
  """Where a run stands, for its fault lines.

  The algorithm, its last finished round, its last durable checkpoint.

  The entry makes one per run and hands it to the main job, which records
  into it (``start_algorithm``, ``experiment.ProgressRecorder``, the
  ``checkpointing.Checkpointer``); the fault lines read the run's own
  (``tracking``).

  Attributes:
    algorithm: the algorithm running ('' at start-up).
    round: its last finished round.
    checkpoint_round: the round of its latest durable checkpoint, if any.
    checkpoint_dir: where its checkpoints go.
    checkpointing: whether it checkpoints.
    rounds: its total rounds.
    output_dir: the run's folder.
    later: how many algorithms of the run come after it.
  """

  algorithm: str = ''
  round: int = 0
  checkpoint_round: Optional[int] = None
  checkpoint_dir: str = ''
  checkpointing: bool = False
  rounds: int = 0
  output_dir: str = ''
  later: int = 0

  def start_algorithm(
    self,
    name: str,
    start_round: int,
    checkpoint_dir: str,
    checkpointing: bool,
    checkpoint_round: Optional[int] = None,
    rounds: int = 0,
    later: int = 0,
  ) -> None:
    """Records the algorithm that starts, its rounds and checkpoints.

    Args:
      name: the algorithm.
      start_round: rounds already done.
      checkpoint_dir: where its checkpoints go.
      checkpointing: whether it checkpoints.
      checkpoint_round: the round of its latest checkpoint, if any.
      rounds: its total rounds.
      later: how many algorithms of the run come after it (they have no
        checkpoint yet: the next command resumes with --resume_if_found).
    """
    self.algorithm, self.round, self.rounds = name, start_round, rounds
    self.later = later
    self.checkpoint_dir, self.checkpointing = checkpoint_dir, checkpointing
    self.checkpoint_round = checkpoint_round

  def kept(self) -> str:
    """What a resumed run would start from, and the next command."""
    if not self.algorithm:
      return 'nothing was trained yet; run the same command again'
    # (--resume starts the algorithms after it, which have none)
    if self.checkpoint_round:
      return (
        f'checkpoint of round {self.checkpoint_round} of {self.algorithm} '
        f'kept in {self.checkpoint_dir}; continue with the same command and '
        '--resume'
      )
    if self.checkpointing:
      return 'no checkpoint written yet; run the same command again'
    return (
      'no checkpoint (--checkpoint_every=0); run the same command again, '
      'with --checkpoint_every=N to be able to resume'
    )

  def where(self) -> str:
    """Where the run is, in words (an algorithm and round, or start-up)."""
    if not self.algorithm:
      return 'start-up'
    # its rounds are done: evaluating, writing its results
    if self.rounds and self.round >= self.rounds:
      return (
        f'the last round of {self.algorithm} (its results are being written)'
      )
    return f'round {self.round + 1} of {self.algorithm}'


#: The progress of the run this context executes (``tracking``); unset
#: outside a run: its fault lines then say nothing was trained.
_RUN: contextvars.ContextVar[RunProgress] = contextvars.ContextVar('run')

#: The tracked run's progress for threads that do not share its context (the
#: signal watcher's timers: signals are the process's).
_WATCHED: List[Optional[RunProgress]] = [None]


@contextlib.contextmanager
def tracking(progress: RunProgress):
  """The fault lines raised inside read ``progress`` (the entry's run).

  Args:
    progress: the run's ``RunProgress``.

  Yields:
    ``progress``.
  """
  token, watched = _RUN.set(progress), _WATCHED[0]
  _WATCHED[0] = progress
  try:
    yield progress
  finally:
    _RUN.reset(token)
    _WATCHED[0] = watched


def current() -> RunProgress:
  """The progress of the run being executed.

  Returns:
    The tracked run's ``RunProgress`` (a blank one outside a run).
  """
  return _RUN.get(None) or _WATCHED[0] or RunProgress()
