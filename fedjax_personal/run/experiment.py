"""The training loop, one for single runs and sweeps: rounds, periodic
evaluation, divergence, callbacks (metrics, checkpoints, progress).

The loop drives ``Runs``: S configurations advanced in lock step (S = 1 for
a single run, ``SingleRun``; a vmapped sweep, ``sweep.SweepRunner``). Both
give the loop per-configuration metrics and evaluations; the loop decides
the evaluation rounds, makes the records, merges the pre-round diagnostics
of the rounds where that phase ran, and marks diverged configurations.

Randomness: the key of round t is ``fold_in(train_key, t)`` and a client's key
in that round is ``fold_in(round_key, client_index)``, so the same flags and
seed give the same numbers, whatever the executor, alone or in a sweep.
"""

import dataclasses
import math
import time
from typing import Any, Dict, List, Optional, Sequence

import jax
import numpy as np

from fedjax_personal.core.engine import (
  PRE_ROUND,
  PRE_ROUND_RAN,
  RoundRunner,
  communication_metrics,
  evaluation_record,
)
from fedjax_personal.core.training import LossStats
from fedjax_personal.run import faults, run_progress

__all__ = [
  'Callback',
  'DivergenceError',
  'ProgressRecorder',
  'SingleRun',
  'communication_metrics',
  'run',
  'run_many',
  'rounds_to_target',
  'seed_keys',
]


class DivergenceError(RuntimeError):
  """Training produced a non-finite loss (every configuration, in a sweep).

  Attributes:
    histories: the records up to the divergence, one list per configuration
      (the diverged rounds marked), for callers that report diverged runs.
  """

  def __init__(
    self, message: str, histories: Optional[List[List[dict]]] = None
  ):
    super().__init__(message)
    self.histories = histories


@dataclasses.dataclass
class Callback:
  """Hooks around the loop.

  . ``records`` has one dict per configuration (one
  for a single run); ``histories`` one list of records per configuration."""

  def on_start(self, runs, state) -> None:
    pass

  def on_round_end(self, round_num: int, records: List[dict], state) -> None:
    pass

  def on_end(self, histories: List[List[dict]], state) -> None:
    pass

  def on_stop(self, round_num: int, state) -> None:
    """The run stops after ``round_num`` (a signal asked it to): keep what
    can be kept (a checkpoint of this round)."""
    pass


class ProgressRecorder(Callback):
  """Records each finished round in the run's progress.

  The run's ``run_progress.RunProgress``: its fault lines say after which
  round a run stopped."""

  def __init__(self, progress: run_progress.RunProgress):
    self.progress = progress

  def on_round_end(self, round_num: int, records: List[dict], state) -> None:
    self.progress.round = round_num


def seed_keys(seed: int):
  """(init, train, eval) keys of a run with this seed.

  Args:
    seed: the run's seed.

  Returns:
    Three PRNG keys.
  """
  return jax.random.split(jax.random.key(seed), 3)


#: Round keys drawn at once (``RoundKeys``).
ROUND_KEY_CHUNK = 64


@jax.jit
def _folded(key, first):
  """``fold_in(key, first + i)`` for i < ``ROUND_KEY_CHUNK``, each an output
  of its own (no second program to split them)."""
  keys = jax.vmap(lambda t: jax.random.fold_in(key, t))(
    first + jax.numpy.arange(ROUND_KEY_CHUNK, dtype=jax.numpy.uint32)
  )
  return tuple(keys[i] for i in range(ROUND_KEY_CHUNK))


class RoundKeys:
  """Round keys, drawn many rounds at a time.

  Round t's key, ``fold_in(key, t)``, the same bits as that call's, drawn
  ``ROUND_KEY_CHUNK`` rounds at a time by one compiled call: an eager
  ``fold_in`` costs a dispatch (0.3-0.65 ms measured on a 2-core CPU, two a
  round: this round's key and the next's), a few percent of a small
  cohort's round."""

  def __init__(self, key):
    self.key, self._chunk, self._keys = key, None, ()

  def __call__(self, t: int):
    chunk, i = divmod(int(t), ROUND_KEY_CHUNK)
    if chunk != self._chunk:
      self._chunk = chunk
      self._keys = _folded(self.key, np.uint32(chunk * ROUND_KEY_CHUNK))
    return self._keys[i]


class SingleRun:
  """One configuration: a RoundRunner and its seed, as the loop's ``Runs``."""

  def __init__(self, runner: RoundRunner, seed: int = 0):
    self.runner, self.seed = runner, seed
    self.init_key, self.train_key, self.eval_key = seed_keys(seed)
    self.round_key, self.eval_round_key = (
      RoundKeys(self.train_key),
      RoundKeys(self.eval_key),
    )
    self.labels = [None]

  @property
  def num_configs(self) -> int:
    return 1

  def init(self):
    return self.runner.init(self.init_key)

  def round(self, state, t: int, donate: bool = True):
    """(state, {name: [1] array}) of round t."""
    state, metrics = self.runner.round(
      state, self.round_key(t), t, donate=donate, next_key=self.round_key(t + 1)
    )
    return state, jax.tree.map(
      lambda v: np.asarray(v)[None], jax.device_get(metrics)
    )

  def evaluate(self, state, t: int) -> LossStats:
    """Per-client LossStats with a leading configuration axis [1, N]."""
    stats = self.runner.evaluate(state, self.eval_round_key(t))
    return LossStats(*[np.asarray(a)[None] for a in jax.device_get(stats)])


def _records(t: int, metrics: dict, seconds: float, labels) -> List[dict]:
  """One record per configuration from the round's [S]-leading metrics."""
  phase = metrics.pop(PRE_ROUND, {})
  ran = np.asarray(metrics.pop(PRE_ROUND_RAN, np.zeros(len(labels), bool)))
  records = []
  for s, label in enumerate(labels):
    record: Dict[str, Any] = {'round': t + 1}
    if label is not None:
      record['config'] = label
    record.update({k: float(v[s]) for k, v in metrics.items()})
    if ran.reshape(-1)[s if ran.size > 1 else 0]:
      record[PRE_ROUND_RAN] = True
      record.update({k: float(v[s]) for k, v in phase.items()})
    record['round_seconds'] = seconds
    records.append(record)
  return records


def run_many(
  runs,
  num_rounds: int,
  eval_every: int = 5,
  callbacks: Sequence[Callback] = (),
  state: Any = None,
  start_round: int = 0,
  histories: Optional[List[List[dict]]] = None,
):
  """Runs ``num_rounds`` rounds of S configurations, evaluating every
  ``eval_every`` rounds and at the end.

  A configuration whose training loss is not finite is marked
  (``record['diverged'] = True`` from then on, ``diverged_at_round`` in its
  records); the loop stops with ``DivergenceError`` once every
  configuration has diverged (at once for a single run).

  Args:
    runs: ``SingleRun`` or ``sweep.SweepRunner``.
    num_rounds: total rounds.
    eval_every: evaluation period in rounds (0: only at the end).
    callbacks: Callback instances.
    state, start_round, histories: to continue (resume); a given state is
      consumed.

  Returns:
    (final state, one history per configuration).
  """
  num = runs.num_configs
  if state is None:
    state = runs.init()
  histories = (
    [list(h) for h in histories] if histories else [[] for _ in range(num)]
  )
  diverged = [
    next((r['round'] for r in h if r.get('diverged')), None) for h in histories
  ]
  for cb in callbacks:
    cb.on_start(runs, state)
  for t in range(start_round, num_rounds):
    start = time.perf_counter()
    state, metrics = runs.round(state, t)
    records = _records(
      t, dict(metrics), (time.perf_counter() - start) / num, runs.labels
    )
    evaluated = (
      eval_every and (t + 1) % eval_every == 0
    ) or t + 1 == num_rounds
    stats = runs.evaluate(state, t) if evaluated else None
    for s, record in enumerate(records):
      if diverged[s] is None and not math.isfinite(
        record.get('train_loss', 0.0)
      ):
        diverged[s] = t + 1
      if stats is not None:
        record.update(evaluation_record(LossStats(*(a[s] for a in stats))))
        # the model's outputs are not finite: its accuracy means nothing
        if diverged[s] is None and not math.isfinite(
          record.get('loss_weighted', 0.0)
        ):
          diverged[s] = t + 1
      if diverged[s] is not None:
        record['diverged'], record['diverged_at_round'] = True, diverged[s]
      histories[s].append(record)
    for cb in callbacks:
      cb.on_round_end(t + 1, records, state)
    # A signal (CLI): stop between rounds, keep this one; after the last
    # round the run ends as usual (its results written) and stops after it.
    if t + 1 < num_rounds and faults.stop_requested():
      for cb in callbacks:
        cb.on_stop(t + 1, state)
      raise faults.interrupted()
    if all(d is not None for d in diverged):
      loss = records[0].get('train_loss')
      which = 'training' if num == 1 else f'all {num} configurations'
      first = min(d for d in diverged if d is not None)
      seen = (
        f'train loss {loss}'
        if loss is None or not math.isfinite(loss)
        else f"test loss {records[0].get('loss_weighted')}: the model's "
        'outputs are not finite'
      )
      raise DivergenceError(
        f'{which} diverged (round {first}: {seen}); '
        'lower --client_lr (or --server_lr)',
        histories,
      )
  for cb in callbacks:
    cb.on_end(histories, state)
  return state, histories


def run(
  runner: RoundRunner,
  num_rounds: int,
  seed: int = 0,
  eval_every: int = 5,
  callbacks: Sequence[Callback] = (),
  state: Any = None,
  start_round: int = 0,
  history: Optional[List[dict]] = None,
):
  """One run (``run_many`` of a ``SingleRun``).

  Args:
    runner: the ``RoundRunner``.
    num_rounds: rounds to run.
    seed: the run's seed (``seed_keys``).
    eval_every: evaluate every this many rounds (0: at the end only).
    callbacks: ``Callback`` objects called each round.
    state: a state to continue from (None: ``runner.init``).
    start_round: rounds already done (a resume).
    history: the records so far (a resume).

  Returns:
    (final state, history: one dict per round; evaluated rounds carry the
    summary keys and 'per_client_accuracy'; rounds where the algorithm's
    pre-round phase ran carry its diagnostics).

  Raises:
    DivergenceError: when a round's training loss is not finite.
  """
  state, histories = run_many(
    SingleRun(runner, seed),
    num_rounds,
    eval_every,
    callbacks,
    state,
    start_round,
    [history] if history else None,
  )
  return state, histories[0]


def rounds_to_target(
  history: List[dict], target: float, key: str = 'accuracy_mean'
):
  """First evaluated round whose ``key`` reaches ``target`` (None if never).

  Args:
    history: a run's records.
    target: an accuracy in (0, 1].
    key: the record key compared.

  Returns:
    The round, or None.
  """
  for r in history:
    if key in r and r[key] >= target:
      return r['round']
  return None
