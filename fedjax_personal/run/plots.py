"""The run's PNG plots, drawn in this process or by a child process that
outlives it (``--plots=background``: matplotlib's import and drawing, about
a second, stay off the run's exit path).

This file imports only the standard library, numpy and matplotlib, so the
child runs it by path without importing JAX or the package.
"""

import json
import os
import subprocess
import sys
from typing import Any, Callable, Dict, List

import numpy as np

__all__ = [
  'DEVICE_KEYS',
  'draw',
  'plot_devices',
  'PLOT_MODES',
  'plot_runs',
  'plot_trials',
  'pyplot',
  'trial_curves',
]

#: ``--plots``: where the plots are drawn.
PLOT_MODES = ('background', 'wait', 'off')


def pyplot():
  """matplotlib's pyplot drawing to files (the Agg backend), imported on
  first use (a run without plots never loads matplotlib).

  Returns:
    ``matplotlib.pyplot``.
  """
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  return plt


def _save_accuracy_figure(
  fig, axes, directory: str, title_suffix: str = ''
) -> str:
  """Titles, labels and legend of the two accuracy panels (mean, worst
  client); saves the figure as ``directory``/accuracy.png and closes it."""
  for ax, title in zip(axes, ('mean client accuracy', 'worst client accuracy')):
    ax.set_title(title + title_suffix)
    ax.set_xlabel('round')
    ax.grid(alpha=0.3)
  axes[0].set_ylabel('test accuracy')
  axes[0].legend()
  fig.tight_layout()
  path = os.path.join(directory, 'accuracy.png')
  fig.savefig(path, dpi=100)
  pyplot().close(fig)
  return path


def plot_runs(histories: Dict[str, List[dict]], directory: str) -> List[str]:
  """Writes accuracy.png (mean and worst-client accuracy per round, one line
  per algorithm), client_accuracy_hist.png (final per-client accuracy) and,
  when the clients are devices (``core.system``), devices.png.

  Args:
    histories: algorithm -> its records (``experiment.run``'s history).
    directory: where the files go (made if missing).

  Returns:
    The files' paths.
  """
  plt = pyplot()
  os.makedirs(directory, exist_ok=True)
  fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
  for name, hist in histories.items():
    ev = [r for r in hist if 'accuracy_mean' in r]
    rounds = [r['round'] for r in ev]
    axes[0].plot(
      rounds,
      [_num(r['accuracy_mean']) for r in ev],
      marker='o',
      ms=3,
      label=name,
    )
    axes[1].plot(
      rounds,
      [_num(r['accuracy_worst']) for r in ev],
      marker='o',
      ms=3,
      label=name,
    )
  p1 = _save_accuracy_figure(fig, axes, directory)
  fig, ax = plt.subplots(figsize=(6, 4))
  bins = np.linspace(0, 1, 21)
  for name, hist in histories.items():
    ev = [r for r in hist if 'per_client_accuracy' in r]
    if ev:
      acc = np.array(
        [_num(a) for a in ev[-1]['per_client_accuracy']], dtype=float
      )
      ax.hist(acc[np.isfinite(acc)], bins=bins, alpha=0.5, label=name)
  ax.set_xlabel('final test accuracy of a client')
  ax.set_ylabel('clients')
  ax.legend()
  fig.tight_layout()
  p2 = os.path.join(directory, 'client_accuracy_hist.png')
  fig.savefig(p2, dpi=100)
  plt.close(fig)
  return [p1, p2] + plot_devices(histories, directory)


#: The round metrics of ``core.system`` that devices.png draws.
DEVICE_KEYS = (
  'available',
  'num_active',
  'stragglers',
  'uploads_lost',
  'local_steps',
  'compute_time',
)


def plot_devices(histories: Dict[str, List[dict]], directory: str) -> List[str]:
  """devices.png: per round, the clients online, taking part, straggling and
  lost, and the simulated compute time, one line per algorithm; nothing
  when no round reports stragglers or lost uploads.

  Args:
    histories: algorithm -> its records.
    directory: where the file goes.

  Returns:
    ``[path]``, or ``[]``.
  """
  keys = [
    k for k in DEVICE_KEYS if any(k in r for h in histories.values() for r in h)
  ]
  if 'stragglers' not in keys:
    return []
  plt = pyplot()
  fig, axes = plt.subplots(
    1, len(keys), figsize=(3.2 * len(keys), 3), squeeze=False
  )
  for ax, key in zip(axes[0], keys):
    for name, hist in histories.items():
      rows = [r for r in hist if key in r]
      ax.plot(
        [r['round'] for r in rows], [_num(r[key]) for r in rows], label=name
      )
    ax.set_title(key)
    ax.set_xlabel('round')
  axes[0][0].legend()
  fig.tight_layout()
  path = os.path.join(directory, 'devices.png')
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return [path]


def _num(value) -> float:
  """A record's number (None, as strict JSON writes NaN, is NaN)."""
  return np.nan if value is None else float(value)


def trial_curves(
  hists: List[List[dict]], keys=('accuracy_mean', 'accuracy_worst')
):
  """Evaluated rounds, per-key (mean, sample std) over trials, and the
  trial count as text. As the tables, diverged trials are left out of the
  mean (used only when every trial diverged, up to the first divergence).

  Args:
    hists: one history (list of records) per trial.
    keys: the record keys averaged.

  Returns:
    ``(rounds, {key: (mean, std)}, count text)``.
  """
  ok = [h for h in hists if not any(r.get('diverged') for r in h)]
  used = ok or hists
  count = (
    f'{len(hists)} trials'
    if len(ok) == len(hists)
    else f'{len(used)} of {len(hists)} trials, {len(hists) - len(ok)} diverged'
  )
  evs = [
    [r for r in h if 'accuracy_mean' in r and not r.get('diverged')]
    for h in used
  ]
  n = min((len(e) for e in evs), default=0)
  rounds = [r['round'] for r in evs[0][:n]] if n else []
  stats = {}
  for key in keys:
    vals = np.array([[_num(r.get(key)) for r in e[:n]] for e in evs])
    # Sample std (ddof = 1), as the tables' (aggregate_trials); 0 for one trial.
    mu = np.nanmean(vals, 0) if n else np.zeros(0)
    sd = (
      np.nanstd(vals, 0, ddof=1) if len(vals) > 1 and n else np.zeros_like(mu)
    )
    stats[key] = (mu, sd)
  return rounds, stats, count


def plot_trials(groups: Dict[str, List[List[dict]]], directory: str) -> str:
  """accuracy.png with one line per algorithm (mean over trials) and a band
  of ± one standard deviation, mean and worst-client accuracy.

  Args:
    groups: algorithm -> one history per trial.
    directory: where the file goes (made if missing).

  Returns:
    The file's path.
  """
  plt = pyplot()
  os.makedirs(directory, exist_ok=True)
  fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
  for name, hists in groups.items():
    rounds, stats, count = trial_curves(hists)
    if not rounds:
      continue
    for ax, key in zip(axes, ('accuracy_mean', 'accuracy_worst')):
      mu, sd = stats[key]
      (line,) = ax.plot(rounds, mu, marker='o', ms=3, label=f'{name} ({count})')
      ax.fill_between(
        rounds, mu - sd, mu + sd, color=line.get_color(), alpha=0.2
      )
  return _save_accuracy_figure(
    fig, axes, directory, ' (mean ± std over trials)'
  )


_KINDS: Dict[str, Callable[..., Any]] = {
  'runs': plot_runs,
  'trials': plot_trials,
}


def _plain(value):
  """JSON of what a history holds (numpy scalars and arrays as numbers)."""
  return value.tolist() if hasattr(value, 'tolist') else str(value)


def draw(kind: str, histories: dict, directory: str, mode: str = 'wait'):
  """Draws ``plot_runs`` (``kind='runs'``) or ``plot_trials``
  (``'trials'``) of ``histories`` into ``directory``.

  Args:
    kind: ``'runs'`` or ``'trials'``.
    histories: what that function takes.
    directory: where the files go.
    mode: ``'wait'``: here and now; ``'background'``: by a child process
      that outlives this one (started here, the histories sent on its
      stdin, its output discarded; a failure is one line in
      ``directory``/plots_error.txt); ``'off'``: not drawn.

  Returns:
    The child process (``'background'``), else None.
  """
  if mode == 'off':
    return None
  if mode == 'wait':
    _KINDS[kind](histories, directory)
    return None
  payload = json.dumps(
    {'kind': kind, 'histories': histories, 'directory': directory},
    default=_plain,
  )
  # By path, without the script's folder on sys.path (it holds this package's
  # run/ modules).
  code = (
    'import runpy, sys; sys.path[:1] = []; '
    f'runpy.run_path({os.path.abspath(__file__)!r}, run_name="__main__")'
  )
  # Its output goes nowhere: a reader of this process's pipes (a sweep's
  # subprocess.run, tee) must see them close when this process exits; a failure
  # is written to plots_error.txt.
  child = subprocess.Popen(
    [sys.executable, '-c', code],
    stdin=subprocess.PIPE,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
    start_new_session=True,
  )
  assert child.stdin is not None  # stdin=PIPE
  child.stdin.write(payload.encode())
  child.stdin.close()
  return child


def _main() -> int:
  job = json.loads(sys.stdin.read())
  try:
    _KINDS[job['kind']](job['histories'], job['directory'])
  except Exception as e:  # noqa: BLE001 - the run is over: say what was not drawn
    line = (
      f'fedjax_personal: the plots of {job["directory"]} were not drawn '
      f"({type(e).__name__}: {e}); the run's other outputs are complete"
    )
    print(line, file=sys.stderr)
    try:
      with open(os.path.join(job['directory'], 'plots_error.txt'), 'w') as f:
        f.write(line + '\n')
    except OSError:
      pass
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(_main())
