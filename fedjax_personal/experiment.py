"""The training loop: rounds, periodic evaluation, callbacks.

Randomness: the key of round t is ``fold_in(train_key, t)`` and a client's key
in that round is ``fold_in(round_key, client_index)``, so the same flags and
seed give the same numbers, whatever the executor.
"""

import dataclasses
import math
import time
from typing import Any, List, Optional, Sequence

import jax

from fedjax_personal.engine import RoundRunner, evaluation_record


class DivergenceError(RuntimeError):
  """Training produced a non-finite loss."""


@dataclasses.dataclass
class Callback:
  """Hooks around the loop (evaluation writing, progress, checkpoints)."""

  def on_start(self, runner: RoundRunner, state) -> None:
    pass

  def on_round_end(self, round_num: int, record: dict, state) -> None:
    pass

  def on_end(self, history: List[dict], state) -> None:
    pass


def communication_metrics(runner: RoundRunner, state, num_active: float) -> dict:
  """Bytes of one round from the algorithm's static sizes and the cohort.

  ``bytes_down_broadcast`` sends each distinct downlink model once (FedAvg: 1,
  streams: m_t); ``bytes_down_unicast`` sends one model to every active client.
  """
  comm = runner.algorithm.communication(state)
  distinct = min(comm.num_downlink_models, num_active) if comm.num_downlink_models else 0
  return {
      'bytes_up': float(num_active * comm.uplink_bytes_per_client),
      'bytes_down_broadcast': float(distinct * comm.downlink_bytes_per_model),
      'bytes_down_unicast': float(num_active * comm.downlink_bytes_per_model
                                  if comm.num_downlink_models else 0),
  }


def run(runner: RoundRunner, num_rounds: int, seed: int = 0, eval_every: int = 5,
        callbacks: Sequence[Callback] = (), state: Any = None, start_round: int = 0,
        history: Optional[List[dict]] = None):
  """Runs ``num_rounds`` rounds, evaluating every ``eval_every`` and at the end.

  Args:
    runner: the RoundRunner.
    num_rounds: total rounds of the run.
    seed: experiment seed (model init and all randomness).
    eval_every: evaluation period in rounds (0: only at the end).
    callbacks: Callback instances.
    state, start_round, history: to continue a run (resume); a given state is
      consumed (rounds update it in place).

  Returns:
    (final state, history: one dict per round; evaluated rounds carry the
    summary keys and 'per_client_accuracy').

  Raises:
    DivergenceError: when a round's training loss is not finite.
  """
  key = jax.random.key(seed)
  init_key, train_key, eval_key = jax.random.split(key, 3)
  if state is None:
    state = runner.init(init_key)
  history = list(history or [])
  for cb in callbacks:
    cb.on_start(runner, state)
  for t in range(start_round, num_rounds):
    start = time.perf_counter()
    info = {}
    if runner.algorithm.between_rounds is not None:
      state, info = runner.algorithm.between_rounds(
          state, t, jax.random.fold_in(jax.random.fold_in(train_key, t), 2), runner)
    state, metrics = runner.round(state, jax.random.fold_in(train_key, t), t, donate=True)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    record = {'round': t + 1, **metrics, **info, 'round_seconds': time.perf_counter() - start}
    loss = metrics.get('train_loss', 0.0)
    if not math.isfinite(loss):
      raise DivergenceError(f'training diverged at round {t + 1}: train loss {loss}; '
                            'lower --client_lr (or --server_lr)')
    record.update(communication_metrics(runner, state, metrics.get('num_active', 0)))
    if (eval_every and (t + 1) % eval_every == 0) or t + 1 == num_rounds:
      stats = runner.evaluate(state, jax.random.fold_in(eval_key, t))
      record.update(evaluation_record(stats))
    history.append(record)
    for cb in callbacks:
      cb.on_round_end(t + 1, record, state)
  for cb in callbacks:
    cb.on_end(history, state)
  return state, history


def rounds_to_target(history: List[dict], target: float, key: str = 'accuracy_mean'):
  """First evaluated round whose ``key`` reaches ``target`` (None if never)."""
  for r in history:
    if key in r and r[key] >= target:
      return r['round']
  return None
