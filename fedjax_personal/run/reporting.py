"""Callbacks and outputs: metrics.jsonl, summary JSON, PNG plots, progress
bar."""

import os
from typing import Any, Dict, List, Optional, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from fedjax_personal.core.population.rows_in_memory import HostedState
from fedjax_personal.core.privacy import worst_epsilon
from fedjax_personal.run import faults, plots, run_identity
from fedjax_personal.run.experiment import Callback
from fedjax_personal.run.plots import plot_runs, plot_trials, trial_curves  # noqa: F401

__all__ = [
  'AffinityRecorder',
  'DeviceCounts',
  'aggregate_trials',
  'final_summary',
  'format_table',
  'MetricsWriter',
  'PAPER_METRICS',
  'pm',
  'PrivacyRecorder',
  'Progress',
  'rounds_without_clients',
  'table_window',
  'trials_summary',
  'worst_clients',
  'write_summary',
]


SUMMARY_KEYS = (
  'accuracy_mean',
  'accuracy_weighted',
  'accuracy_worst',
  'accuracy_q10',
  'accuracy_median',
  'loss_weighted',
)


def _worth_a_line(record: dict) -> bool:
  """Evaluated rounds, and rounds that computed something (pre-round
  diagnostics such as W's statistics or CFL's splits) or diverged."""
  return any(
    k in record for k in ('accuracy_mean', 'pre_round_ran', 'diverged')
  )


class MetricsWriter(Callback):
  """Appends a run's records to ``metrics.jsonl``.

  Appends one JSON line per configuration and evaluated round (or round
  with pre-round diagnostics) to ``<dir>/metrics.jsonl``; a sweep's lines
  carry their configuration (``config``: seed and swept values)."""

  def __init__(
    self, directory: str, histories: Optional[List[List[dict]]] = None
  ):
    self.directory = directory
    os.makedirs(directory, exist_ok=True)
    self.path = os.path.join(directory, 'metrics.jsonl')
    self.histories = histories or []  # a resumed run's records so far

  def on_start(self, runs, state):
    with open(self.path, 'w') as f:
      for t in range(max((len(h) for h in self.histories), default=0)):
        for h in self.histories:
          if t < len(h) and _worth_a_line(h[t]):
            f.write(run_identity.dumps(h[t]) + '\n')

  def on_round_end(self, round_num, records, state):
    lines = [run_identity.dumps(r) for r in records if _worth_a_line(r)]
    if lines:
      try:
        with open(self.path, 'a') as f:
          f.write('\n'.join(lines) + '\n')
      except OSError as e:
        if faults.storage_reason(e) is None:
          raise
        raise faults.storage_error(
          f'{self.path} (round {round_num})', e
        ) from None


class DeviceCounts(Callback):
  """One console line a round for clients as devices.

  Of the clients sampled, how many took part, were stragglers, lost their
  upload, and how many were online (``core.system``'s counts of the round)."""

  def __init__(self, rounds: int, name: str):
    self.rounds, self.name = rounds, name

  def on_round_end(self, round_num, records, state):
    r = records[0]
    parts = [
      f'{int(r["num_active"])} of {int(r["num_sampled"])} sampled took part'
      if 'num_active' in r and 'num_sampled' in r
      else ''
    ]
    for key, what in (
      ('stragglers', 'stragglers'),
      ('uploads_lost', 'uploads lost'),
      ('available', 'online'),
    ):
      if key in r:
        parts.append(f'{int(r[key])} {what}')
    tqdm.write(
      f'{self.name} round {round_num}/{self.rounds}: '
      + ', '.join(p for p in parts if p)
    )


def rounds_without_clients(history: List[dict]) -> int:
  """The rounds of a run in which no sampled client took part (none
  online, every one dropped): its model did not change.

  Args:
    history: a run's records.

  Returns:
    The count.
  """
  return sum(1 for r in history if r.get('num_active', 1) == 0)


class Progress(Callback):
  """A tqdm progress bar showing the current mean and worst-client accuracy."""

  def __init__(self, total: int, desc: str = ''):
    self.total, self.desc = total, desc
    self.bar: Any = None  # a tqdm bar from on_start

  def on_start(self, runner, state):
    self.bar = tqdm(
      total=self.total, desc=self.desc, leave=False, dynamic_ncols=True
    )

  def on_stop(self, round_num, state):
    self.bar.close()

  def on_round_end(self, round_num, records, state):
    ev = [r for r in records if 'accuracy_mean' in r and not r.get('diverged')]
    if ev:
      self.bar.set_postfix(
        mean=f'{np.mean([r["accuracy_mean"] for r in ev]):.3f}',
        worst=f'{np.mean([r["accuracy_worst"] for r in ev]):.3f}',
      )
    self.bar.update(1)

  def on_end(self, histories, state):
    self.bar.close()


def final_summary(history: List[dict], window: int = 5) -> dict:
  """The last evaluation, stable statistics and totals (rounds, bytes, seconds).

  ``accuracy_mean_window`` / ``accuracy_worst_window``: the mean over the
  last ``window`` evaluations (``stat_window`` of them at most: fewer when
  the run had fewer) of the mean and worst-client accuracy, steadier than
  the last evaluation alone when accuracy swings between rounds.
  ``round_seconds_median``: the median time of a round after the first (the
  first compiles), evaluations not included; ``first_round_seconds``: the
  first round's (of this process: after a resume, the first resumed one).

  Args:
    history: a run's records.
    window: evaluations averaged.

  Returns:
    The summary.
  """
  evals = [r for r in history if 'accuracy_mean' in r]
  last = dict(evals[-1]) if evals else {}
  tail = evals[-max(window, 1) :]
  for key in ('accuracy_mean', 'accuracy_worst'):
    vals = [r[key] for r in tail if r.get(key) is not None]
    if vals:
      last[f'{key}_window'] = float(np.mean(vals))
  last['stat_window'] = len(tail)
  div = next((r for r in history if r.get('diverged')), None)
  # a diverged run's summary says so (aggregate_trials leaves it out)
  if div is not None:
    last['diverged'], last['diverged_at_round'] = (
      True,
      div.get('diverged_at_round', div['round']),
    )
  last['total_bytes_up'] = float(sum(r.get('bytes_up', 0) for r in history))
  last['total_bytes_down_broadcast'] = float(
    sum(r.get('bytes_down_broadcast', 0) for r in history)
  )
  seconds = [r['round_seconds'] for r in history if 'round_seconds' in r]
  last['train_seconds'] = float(sum(seconds))
  if seconds:  # its compiles included
    last['first_round_seconds'] = float(seconds[0])
  # the first round compiles: the steady cost is the rest's median
  if len(seconds) > 1:
    last['round_seconds_median'] = float(np.median(seconds[1:]))
  return last


def worst_clients(
  per_client_accuracy, client_ids: Sequence[str], k: int = 5
) -> List[dict]:
  """The ``k`` clients of lowest test accuracy at the last evaluation, by
  id (``[{'client_id', 'accuracy'}]``, worst first; ties in client order);
  clients without test data are left out.

  Args:
    per_client_accuracy: accuracies [N].
    client_ids: the clients' ids.
    k: how many.

  Returns:
    ``[{'client_id', 'accuracy'}]``.
  """
  if per_client_accuracy is None:
    return []
  acc = np.array(
    [np.nan if a is None else a for a in per_client_accuracy], np.float64
  )
  has = np.flatnonzero(~np.isnan(acc))
  order = has[np.argsort(acc[has], kind='stable')][:k]
  return [
    {'client_id': client_ids[i], 'accuracy': float(acc[i])} for i in order
  ]


def write_summary(directory: str, summary: dict) -> str:
  """Writes ``summary`` as ``summary.json`` in ``directory`` (made if missing).

  Args:
    directory: the folder.
    summary: the summary.

  Returns:
    The file's path.
  """
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, 'summary.json')
  run_identity.write_json(path, summary)
  return path


#: The table's columns: (summary key, header); {L} is the statistics window.
TABLE_COLUMNS = (
  ('accuracy_mean', 'mean'),
  ('accuracy_worst', 'worst'),
  ('accuracy_mean_window', 'mean@last{L}'),
  ('accuracy_worst_window', 'worst@last{L}'),
  ('accuracy_q10', 'q10'),
  ('accuracy_weighted', 'weighted'),
)


#: The table's columns a paper may report (``--paper_metric``): column ->
#: (summary key, what it is).
PAPER_METRICS = {
  'mean': ('accuracy_mean', 'the mean over clients of their test accuracy'),
  'worst': ('accuracy_worst', "the worst client's test accuracy"),
  'mean@last': (
    'accuracy_mean_window',
    'the mean over clients, averaged over the last evaluations',
  ),
  'worst@last': (
    'accuracy_worst_window',
    "the worst client's, averaged over the last evaluations",
  ),
  'q10': ('accuracy_q10', "the clients' 10th percentile"),
  'weighted': (
    'accuracy_weighted',
    'the accuracy pooled over every scored test target (each '
    'client weighted by its scored targets: examples, or tokens of a text '
    'task)',
  ),
}


def table_window(rows: Dict[str, dict]) -> int:
  """L of the table's ``@lastL`` columns: the most evaluations a row's
  window averaged (fewer than ``--stat_window`` on a short run).

  Args:
    rows: ``{label: summary}``.

  Returns:
    L.
  """
  return int(max([s.get('stat_window') or 0 for s in rows.values()] + [1]))


def format_table(rows: Dict[str, dict], columns=TABLE_COLUMNS) -> str:
  """A plain-text table: one row per algorithm (or sweep configuration),
  accuracy columns in percent at the last evaluation and averaged over the
  last L evaluations (``@lastL``); rows of several trials show mean ± std
  over trials (``<key>_std``); a diverged row says so; epsilon when DP.

  Args:
    rows: ``{label: summary}``.
    columns: ``(key, header)`` pairs.

  Returns:
    The table.
  """
  window = table_window(rows)
  cols = [(k, h.format(L=window)) for k, h in columns]
  if any('dp_epsilon' in s for s in rows.values()):
    cols.append(('dp_epsilon', 'epsilon'))
  trials = any(any(k.endswith('_std') for k in s) for s in rows.values())
  cw = 15 if trials else 13
  width = max([14] + [len(n) + 2 for n in rows])
  header = f'{"algorithm":<{width}}' + ''.join(f'{h:>{cw}}' for _, h in cols)
  lines = [header, '-' * len(header)]

  def cell(s, k):
    v = s.get(k)
    if v is None:
      return f'{"-":>{cw}}'
    scale, unit = (1, '') if k == 'dp_epsilon' else (100, '%')
    std = s.get(f'{k}_std')
    text = f'{scale * v:.2f}' + (
      f'±{scale * std:.2f}' if std is not None else unit
    )
    return f'{text:>{cw}}'

  for name, s in rows.items():
    if s.get('diverged'):
      lines.append(
        f'{name:<{width}}  diverged at round {s.get("diverged_at_round")}'
      )
      continue
    lines.append(f'{name:<{width}}' + ''.join(cell(s, k) for k, _ in cols))
  return '\n'.join(lines)


def aggregate_trials(summaries: List[dict]) -> dict:
  """Mean and sample standard deviation (``<key>_std``, ddof = 1) over
  trials of every numeric summary entry; ``trials`` their number; diverged
  trials are left out and counted (``diverged_trials``).

  Args:
    summaries: one summary per trial.

  Returns:
    The aggregate summary.
  """
  ok = [s for s in summaries if not s.get('diverged')]
  out: Dict[str, Any] = {
    'trials': len(summaries),
    'diverged_trials': len(summaries) - len(ok),
  }
  if not ok:
    return {
      **out,
      'diverged': True,
      'diverged_at_round': min(
        s.get('diverged_at_round') or 0 for s in summaries
      ),
    }
  keys = [
    k
    for k, v in ok[0].items()
    if isinstance(v, (int, float)) and not isinstance(v, bool)
  ]
  for k in keys:
    vals = np.array([s[k] for s in ok if s.get(k) is not None], np.float64)
    if vals.size:
      out[k] = float(vals.mean())
      out[f'{k}_std'] = float(vals.std(ddof=1)) if vals.size > 1 else 0.0
  return out


def trials_summary(histories: List[List[dict]], window: int = 5) -> dict:
  """``aggregate_trials`` of the trials' ``final_summary``: mean and sample
  std over trials of the last evaluation and of the stable statistics.

  Args:
    histories: one history per trial.
    window: evaluations averaged.

  Returns:
    The aggregate summary.
  """
  return aggregate_trials([final_summary(h, window) for h in histories])


def pm(summary: dict, key: str, scale: float = 100.0, digits: int = 1) -> str:
  """``'mean ± std'`` of ``key`` in an ``aggregate_trials`` summary.

  Args:
    summary: an ``aggregate_trials`` summary.
    key: the key.
    scale: multiplier (100: percent).
    digits: decimals.

  Returns:
    The text.
  """
  if summary.get(key) is None:
    return 'diverged' if summary.get('diverged') else '-'
  return (
    f'{scale * summary[key]:.{digits}f} ± '
    f'{scale * summary.get(key + "_std", 0.0):.{digits}f}'
  )


class PrivacyRecorder(Callback):
  """Adds the DP-SGD epsilon to every record.

  The epsilon of the worst client so far at ``delta`` (``dp_epsilon``,
  ``dp_delta``); list it before the MetricsWriter."""

  def __init__(self, privacy, delta: float):
    self.privacy, self.delta = privacy, delta

  def on_round_end(self, round_num, records, state):

    def steps_of(s):  # step counters are not client rows
      return np.asarray(
        jax.device_get(
          self.privacy.steps(s.inner if isinstance(s, HostedState) else s)
        )
      )

    if isinstance(state, list):  # configurations run one after another
      steps = np.stack([steps_of(s) for s in state])
    else:  # one state, or a sweep's stacked [S, ...] state
      steps = steps_of(state)
    for record, st in zip(records, steps.reshape(len(records), -1)):
      record['dp_epsilon'] = worst_epsilon(self.privacy, st, self.delta)
      record['dp_delta'] = self.delta


class AffinityRecorder(Callback):
  """Keeps and draws a matrix-valued part of the state.

  Keeps a matrix-valued part of the state, ``get(state)`` (an
  algorithm's ``AlgorithmSpec.state_heatmap``: FedFomo's affinity P), at
  every evaluated round and writes heat maps of it over rounds to a PNG."""

  def __init__(self, path: str, get, max_panels: int = 6):
    self.path, self.get, self.max_panels = path, get, max_panels
    self.matrices: Dict[int, Any] = {}

  def on_round_end(self, round_num, records, state):
    if 'accuracy_mean' in records[0]:
      self.matrices[round_num] = np.asarray(self.get(state))

  def on_end(self, histories, state):
    if not self.matrices:
      return
    plt = plots.pyplot()
    rounds = sorted(self.matrices)
    pick = [
      rounds[int(i)]
      for i in np.linspace(
        0, len(rounds) - 1, min(self.max_panels, len(rounds))
      )
    ]
    fig, axes = plt.subplots(
      1, len(pick), figsize=(3.2 * len(pick), 3), squeeze=False
    )
    vmax = max(np.abs(self.matrices[r]).max() for r in pick) or 1.0
    for ax, r in zip(axes[0], pick):
      im = ax.imshow(self.matrices[r], cmap='RdBu_r', vmin=-vmax, vmax=vmax)
      ax.set_title(f'round {r}')
      ax.set_xlabel('candidate client')
    axes[0][0].set_ylabel('client')
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label='affinity')
    fig.savefig(self.path, dpi=100)
    plt.close(fig)
