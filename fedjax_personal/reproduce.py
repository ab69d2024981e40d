"""What the reproduce scripts share: the scale flag, trials, result files.

Every ``scripts/reproduce_*.py`` takes ``--scale=cpu|paper``:

* ``cpu``: the seed's protocol (model, optimizer, local work, data shift)
  reduced to what a 2-core CPU runs in about 30 minutes per table with 3
  trials; each script's docstring and each table's header say what was
  reduced against the paper;
* ``paper``: the seed's own sizes (users, examples per user, rounds, model,
  trials), on TFDS data sets where the seed used one that is not among the
  offline files (EMNIST, CIFAR-100): prepare them once online
  (``datasets.tfds_loader.load_tfds(name, download=True)``).

Size flags given explicitly override the scale's values. Results go to
``<output_dir>/<table>_<scale>.json`` and ``.md`` (a Markdown table with the
command that made it), so runs at different scales never overwrite each
other.
"""

import os
import shlex
import sys
import time
from typing import Dict, List, Optional, Sequence

from absl import flags

from fedjax_personal import experiment, reporting, run_identity

SCALES = ('cpu', 'paper')


def define_flags(default_trials: Optional[Dict[str, int]] = None) -> None:
  """Defines ``--scale``, ``--trials``, ``--seed``, ``--stat_window`` and
  ``--output_dir`` (the flags every reproduce script shares)."""
  trials = default_trials or {'cpu': 3, 'paper': 5}
  flags.DEFINE_enum('scale', 'cpu', SCALES,
                    "'cpu': the seed's protocol reduced to ~30 min per table on 2 cores; "
                    "'paper': the seed's own sizes (TFDS data where the seed used them).")
  flags.DEFINE_integer('trials', None, f'Trials per cell (default: {trials}); seeds '
                       'seed..seed+T-1 on the partition of --seed.', lower_bound=1)
  flags.DEFINE_integer('seed', 0, 'Seed of the partitions and of the first trial.')
  flags.DEFINE_integer('stat_window', 5, 'Cells average the last this many evaluations.',
                       lower_bound=1)
  flags.DEFINE_string('output_dir', None, 'Where results go (default runs/<script name>).')
  flags.DEFINE_string('data_dir', None, 'Directory with the offline data files (default: '
                      '../shared/data and the usual places).')
  flags.DEFINE_bool('dry_run', False, 'Print the sizes this scale resolves to and exit.')
  flags.register_validator('trials', lambda v: v is None or v >= 1, '--trials must be >= 1')
  _TRIALS.update(trials)


_TRIALS: Dict[str, int] = {}


def trials() -> int:
  """``--trials``, or the scale's default."""
  f = flags.FLAGS
  return f.trials if f.trials is not None else _TRIALS[f.scale]


def dry_run(sizes: dict) -> bool:
  """With ``--dry_run``, prints the resolved sizes (one ``name: value`` line
  each, after the scale and trials) and returns True: the script exits."""
  f = flags.FLAGS
  if not f.dry_run:
    return False
  print(f'scale: {f.scale}\ntrials: {trials()}')
  for k, v in sizes.items():
    print(f'{k}: {v}')
  return True


def output_dir(script: str) -> str:
  d = flags.FLAGS.output_dir or os.path.join('runs', script)
  os.makedirs(d, exist_ok=True)
  return d


def scaled(value, cpu, paper):
  """``value`` when given (not None), else the scale's default."""
  if value is not None:
    return value
  return cpu if flags.FLAGS.scale == 'cpu' else paper


def run_trials(runner, num_rounds: int, seed: int, num_trials: int, eval_every: int,
               callbacks: Sequence = ()):
  """``num_trials`` runs of one runner with seeds seed..seed+T-1 (same data);
  a trial that diverges is kept, marked ``diverged`` from its divergence on.

  Returns:
    (histories, seconds per trial).
  """
  start = time.perf_counter()
  histories = []
  for t in range(num_trials):
    try:
      histories.append(experiment.run(runner, num_rounds, seed=seed + t, eval_every=eval_every,
                                      callbacks=callbacks)[1])
    except experiment.DivergenceError as e:
      # A table reports a diverged trial (its summary says so and the cells
      # count it in ``diverged_trials``) instead of losing the other trials.
      print(f'trial {t} (seed {seed + t}) diverged: {e}', flush=True)
      histories.append(e.histories[0])
  return histories, (time.perf_counter() - start) / num_trials


def cell(summary: dict, key: str, digits: int = 1) -> str:
  """'mean ± std' in percent of an ``aggregate_trials`` summary's key, over
  the trials that did not diverge ('(d/T diverged)' appended when some did)."""
  text = reporting.pm(summary, key, digits=digits)
  d = summary.get('diverged_trials', 0)
  if d and not summary.get('diverged'):
    text += f' ({d}/{summary["trials"]} diverged)'
  return text


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
  line = lambda cells: '| ' + ' | '.join(str(c) for c in cells) + ' |'
  return '\n'.join([line(header), line(['---'] * len(header))] + [line(r) for r in rows])


def command_line() -> str:
  return ' '.join(['python', os.path.relpath(sys.argv[0])] + [shlex.quote(a) for a in sys.argv[1:]])


def write_results(directory: str, table: str, title: str, markdown: str, data: dict) -> List[str]:
  """Writes ``<table>_<scale>.json`` (the data, the flags, the command) and
  ``<table>_<scale>.md`` (title, command, Markdown table); returns the paths."""
  f = flags.FLAGS
  base = os.path.join(directory, f'{table}_{f.scale}')
  own = [fl for m in ('__main__', __name__) for fl in f.get_flags_for_module(m)]
  meta = {'command': command_line(), 'scale': f.scale, 'trials': trials(),
          'flags': {fl.name: fl.value for fl in own}}
  # Strict JSON: a diverged trial's NaN is written as null.
  run_identity.write_json(base + '.json', {'title': title, **meta, 'results': data})
  with open(base + '.md', 'w') as fh:
    fh.write(f'{title}\n\n`{meta["command"]}`\n\n{markdown}\n')
  return [base + '.json', base + '.md']
