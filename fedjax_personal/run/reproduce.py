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

Every finished trial is also kept under ``<output_dir>/trials/<cell hash>/``
with its identity (the cell's settings, the data fingerprint, the model's
parameter shapes, the sampler, rounds, seed and a fingerprint of the
library's source). A table run that was killed, or that is run again with
more ``--trials``, reuses the trials whose identity is equal and runs only the
rest (``--noreuse_trials`` runs every trial again); a trial of any other
configuration or code is never read.
"""

import dataclasses
import functools
import hashlib
import importlib
import json
import os
import shlex
import sys
import time
from typing import ClassVar, Dict, List, Optional, Sequence

import jax
import numpy as np

from fedjax_personal import __version__
from fedjax_personal.hparams import Declared, hparam
from fedjax_personal.models import INITS, MODELS
from fedjax_personal.run import experiment, reporting, run_identity

__all__ = [
  'cell',
  'code_fingerprint',
  'markdown_table',
  'model_field',
  'model_init_field',
  'ReproduceSettings',
  'run_trials',
  'source_files',
  'TrialCache',
  'write_results',
]


SCALES = ('cpu', 'paper')


def model_field(what: str = 'Model'):
  """A reproduce script's model setting: None, the scale's model, unless
  given.

  Args:
    what: the help's first words.

  Returns:
    The ``hparam`` field.
  """
  return hparam(
    None,
    f"{what} (default: the scale's; see --dry_run).",
    choices=tuple(sorted(MODELS)),
  )


def model_init_field():
  """A reproduce script's initialisation setting: None, the scale's
  convention, unless given.

  Returns:
    The ``hparam`` field.
  """
  return hparam(
    None,
    "Initialisation convention (default: the scale's: paper, the seed code's "
    'framework; cpu, flax).',
    choices=tuple(INITS),
  )


@dataclasses.dataclass(frozen=True)
class ReproduceSettings(Declared):
  """What every reproduce script shares.

  Its flags generated from these
  fields, ``script_entry.define_settings_flags``. ; a script's own settings
  class adds its fields to these.

  Attributes:
    DEFAULT_TRIALS: ``{scale: trials}`` when ``--trials`` is not given.
  """

  DEFAULT_TRIALS: ClassVar[Dict[str, int]] = {'cpu': 3, 'paper': 5}
  scale: str = hparam(
    'cpu',
    "'cpu': the seed's protocol reduced to ~30 min per table on 2 cores; "
    "'paper': the seed's own sizes (TFDS data where the seed used them).",
    choices=SCALES,
  )
  trials: Optional[int] = hparam(
    None,
    "Trials per cell (default: the scale's, --dry_run says); "
    'seeds seed..seed+T-1 on the partition of --seed.',
    minimum=1,
  )
  seed: int = hparam(
    0, 'Seed of the partitions and of the first trial.', minimum=0
  )
  stat_window: int = hparam(
    5, 'Cells average the last this many evaluations.', minimum=1
  )
  output_dir: Optional[str] = hparam(
    None, 'Where results go (default runs/<script name>).'
  )
  data_dir: Optional[str] = hparam(
    None,
    'Folder searched first for data files (then '
    '$FEDJAX_PERSONAL_DATA, the package, the cache); must exist.',
  )
  dry_run: bool = hparam(
    False, 'Print the sizes this scale resolves to and exit.'
  )
  reuse_trials: bool = hparam(
    True,
    'Reuse the trials a run of the same cell (same settings, '
    'data, seed and library source) finished under '
    '<output_dir>/trials: a killed or extended table run goes on '
    'from them.',
  )

  @property
  def num_trials(self) -> int:
    """``--trials``, or the scale's default."""
    return (
      self.trials
      if self.trials is not None
      else self.DEFAULT_TRIALS[self.scale]
    )

  def scaled(self, value, cpu, paper):
    """``value`` when given (not None), else the scale's default.

    Args:
      value: the setting's value (None: not given).
      cpu: the ``cpu`` scale's default.
      paper: the ``paper`` scale's default.

    Returns:
      The value to use.
    """
    if value is not None:
      return value
    return cpu if self.scale == 'cpu' else paper

  def show_dry_run(self, sizes: dict) -> bool:
    """With ``--dry_run``, prints the resolved sizes (one ``name: value``
    line each, after the scale and trials) and returns True: the script
    exits.

    Args:
      sizes: what the scale resolved, by name.

    Returns:
      Whether this is a dry run.
    """
    if not self.dry_run:
      return False
    print(f'scale: {self.scale}\ntrials: {self.num_trials}')
    for k, v in sizes.items():
      print(f'{k}: {v}')
    return True

  def results_dir(self, script: str) -> str:
    """``--output_dir`` or runs/<script>, created; the trials of this run's
    cells are kept under it (``run_trials``).

    Args:
      script: the script's name.

    Returns:
      The folder.
    """
    d = self.output_dir or os.path.join('runs', script)
    os.makedirs(d, exist_ok=True)
    # of the code this process has loaded, not of later edits
    code_fingerprint()
    return d


SOURCE_PACKAGES = (
  'fedjax_personal.algorithms',
  'fedjax_personal.datasets',
  'fedjax_personal',
)


def source_files() -> List[tuple]:
  """(name, path) of every Python file of the library's packages, sorted by
  name (``package/relative path``; the algorithms and data sets are their own
  folders in a development install, subfolders in a wheel).

  Returns:
    ``[(name, path)]``.
  """
  seen, out = set(), []
  for package in SOURCE_PACKAGES:
    root = os.path.dirname(
      os.path.abspath(importlib.import_module(package).__file__ or '')
    )
    for d, _, files in os.walk(root):
      for name in files:
        path = os.path.realpath(os.path.join(d, name))
        if name.endswith('.py') and path not in seen:
          seen.add(path)
          out.append(
            (f'{package}/{os.path.relpath(os.path.join(d, name), root)}', path)
          )
  return sorted(out)


@functools.lru_cache(maxsize=None)
def code_fingerprint() -> str:
  """SHA-256 (16 hex digits) of the library's Python source (``source_files``):
  a trial made by other code is never reused.

  Read once per process (``output_dir`` reads it when a script starts): the
  code a running job has loaded does not change when its files are edited,
  so neither does the fingerprint its trials are saved under.
  """
  h = hashlib.sha256()
  for name, path in source_files():
    h.update(name.encode())
    with open(path, 'rb') as f:
      h.update(f.read())
  return h.hexdigest()[:16]


def trial_identity(
  runner, cell: dict, num_rounds: int, eval_every: int, callbacks: Sequence = ()
) -> dict:
  """What makes a trial's numbers (its seed aside): the caller's ``cell``
  (algorithm name and settings), the data fingerprint, the model's name and
  parameter shapes, the sampler, the clients' devices (stragglers, lost
  uploads), rounds, evaluation period, the callbacks' settings (e.g. the DP
  delta) and the library's source."""
  alg = runner.algorithm
  shapes = jax.tree.map(
    lambda a: [list(a.shape), str(a.dtype)],
    jax.eval_shape(alg.init, jax.random.key(0)),
  )
  simple = (bool, int, float, str, type(None))
  return run_identity.as_json(
    {
      'cell': cell,
      'algorithm': alg.name,
      'model': alg.model.name,
      'state_shapes': run_identity.short_hash(jax.tree.leaves(shapes)),
      'data_fingerprint': run_identity.data_fingerprint(runner.data),
      'sampler': dataclasses.asdict(runner.sampler),
      'rounds': num_rounds,
      **(
        {'system': runner.system.config.identity()}
        if getattr(runner, 'system', None) is not None
        and runner.system.config.active
        else {}
      ),
      'eval_every': eval_every,
      'callbacks': [
        [
          type(c).__name__,
          {k: v for k, v in vars(c).items() if isinstance(v, simple)},
        ]
        for c in callbacks
      ],
      'code': code_fingerprint(),
      'version': __version__,
    }
  )


class TrialCache:
  """Finished trials of one cell.

  ``<directory>/trials/<hash>/seed_<s>.json``
  holding the identity, the history and the seconds it took."""

  def __init__(self, directory: str, identity: dict):
    self.identity = identity
    self.directory = os.path.join(
      directory, 'trials', run_identity.short_hash(identity)
    )

  def _path(self, seed: int) -> str:
    return os.path.join(self.directory, f'seed_{seed}.json')

  def load(self, seed: int):
    """(history, seconds) of a finished trial of this identity, or None."""
    try:
      with open(self._path(seed)) as f:
        saved = json.load(f)
    except (OSError, ValueError):
      return None  # absent, or cut short while written: run it again
    if saved.get('identity') != self.identity or saved.get('seed') != seed:
      return None
    return saved['history'], saved['seconds']

  def save(self, seed: int, history: List[dict], seconds: float) -> None:
    os.makedirs(self.directory, exist_ok=True)
    run_identity.write_json(
      self._path(seed),
      {
        'identity': self.identity,
        'seed': seed,
        'seconds': seconds,
        'history': history,
      },
    )


def run_trials(
  runner,
  num_rounds: int,
  seed: int,
  num_trials: int,
  eval_every: int,
  callbacks: Sequence = (),
  cell: Optional[dict] = None,
  reuse: bool = True,
  directory: Optional[str] = None,
):
  """``num_trials`` runs of one runner with seeds seed..seed+T-1 (same data);
  a trial that diverges is kept, marked ``diverged`` from its divergence on.

  Args:
    runner: the ``RoundRunner``.
    num_rounds: rounds per trial.
    seed: the first trial's seed.
    num_trials: trials.
    eval_every: the evaluation period.
    callbacks: the loop's callbacks.
    cell: what identifies the runner's configuration beyond what it exposes
      (the algorithm's registry name and settings): with ``directory``,
      finished trials are kept in its ``trials`` folder and reused when
      their identity is equal. Diverged trials are not kept.
    reuse: reuse kept trials (a script's ``--reuse_trials``).
    directory: the script's results folder (``ReproduceSettings.results_dir``).

  Returns:
    (histories, seconds per trial).
  """
  cache = None
  if cell is not None and directory is not None:
    cache = TrialCache(
      directory, trial_identity(runner, cell, num_rounds, eval_every, callbacks)
    )
  histories, seconds = [], []
  for t in range(num_trials):
    saved = cache.load(seed + t) if cache is not None and reuse else None
    if cache is not None and saved is not None:
      print(
        f'trial {t} (seed {seed + t}): reused from {cache.directory}',
        flush=True,
      )
      histories.append(saved[0])
      seconds.append(saved[1])
      continue
    start = time.perf_counter()
    try:
      history = experiment.run(
        runner,
        num_rounds,
        seed=seed + t,
        eval_every=eval_every,
        callbacks=callbacks,
      )[1]
      if cache is not None:
        # As JSON holds it, so that a fresh and a reused trial give one table.
        history = run_identity.as_json(history)
        cache.save(seed + t, history, time.perf_counter() - start)
      histories.append(history)
    except experiment.DivergenceError as e:
      # A table reports a diverged trial (its summary says so and the cells
      # count it in ``diverged_trials``) instead of losing the other trials.
      print(f'trial {t} (seed {seed + t}) diverged: {e}', flush=True)
      histories.append(e.histories[0] if e.histories else [])
    seconds.append(time.perf_counter() - start)
  return histories, float(np.mean(seconds))


def cell(summary: dict, key: str, digits: int = 1) -> str:
  """'mean ± std' in percent of an ``aggregate_trials`` summary's key, over
  the trials that did not diverge ('(d/T diverged)' appended when some did).

  Args:
    summary: an ``aggregate_trials`` summary.
    key: the key.
    digits: decimals.

  Returns:
    The text.
  """
  text = reporting.pm(summary, key, digits=digits)
  d = summary.get('diverged_trials', 0)
  if d and not summary.get('diverged'):
    text += f' ({d}/{summary["trials"]} diverged)'
  return text


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
  """A Markdown table of ``header`` and ``rows``.

  Args:
    header: the columns.
    rows: the rows.

  Returns:
    The table.
  """
  line = lambda cells: '| ' + ' | '.join(str(c) for c in cells) + ' |'
  return '\n'.join(
    [line(header), line(['---'] * len(header))] + [line(r) for r in rows]
  )


def experiment_flags() -> str:
  """This process's command line, quoted for a shell."""
  return ' '.join(
    ['python', os.path.relpath(sys.argv[0])]
    + [shlex.quote(a) for a in sys.argv[1:]]
  )


def write_results(
  settings: ReproduceSettings,
  directory: str,
  table: str,
  title: str,
  markdown: str,
  data: dict,
) -> List[str]:
  """Writes ``<table>_<scale>.json`` (the data, the settings, the command) and
  ``<table>_<scale>.md`` (title, command, Markdown table); returns the paths.

  Args:
    settings: the script's settings (recorded whole).
    directory: where the files go.
    table: the tables' name.
    title: the Markdown title.
    markdown: the Markdown table.
    data: the results.

  Returns:
    The two files' paths.
  """
  base = os.path.join(directory, f'{table}_{settings.scale}')
  meta = {
    'command': experiment_flags(),
    'scale': settings.scale,
    'trials': settings.num_trials,
    'flags': dataclasses.asdict(settings),
  }
  # Strict JSON: a diverged trial's NaN is written as null.
  run_identity.write_json(
    base + '.json', {'title': title, **meta, 'results': data}
  )
  with open(base + '.md', 'w') as fh:
    fh.write(f'{title}\n\n`{meta["command"]}`\n\n{markdown}\n')
  return [base + '.json', base + '.md']
