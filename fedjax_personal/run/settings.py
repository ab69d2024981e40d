"""The run's settings, declared once, and ``RunSettings``, every setting of
one run of the command.

Declared here (``hparam`` fields, checked when made: ``Declared``): the
experiment (which algorithms, how many rounds, which clients a round draws,
what the tables report), what the run reads of its data, where its outputs
go and what the process sets. The other settings are declared next to what
they configure: the data set (``datasets.DataConfig`` and each data set's
options), the model (``models.ModelConfig``), the engine
(``core.engine.EngineConfig``), the processes
(``run.distributed.DistributedSettings``), the shared training settings
(``config.TrainingConfig``) and each algorithm's (``algorithms``).

Names: a ``*Config`` configures one object the library builds (a data set,
a model, the engine, training, an algorithm) and is what its builder takes;
a ``*Settings`` is what the command adds to run them, and ``RunSettings``
holds them all. ``run/experiment_flags.py`` generates the command's flags from
the declarations and reads them once into a ``RunSettings``, which the main
job (``run/main_job.py``) passes down: each step reads the typed fields it
needs, never a setting by name.

The main job (the defaults): why personalization matters. Real MNIST digits
(the 10k MNIST files embedded in the package) on 40 clients in 4 groups
rotated 0/90/180/270 degrees (covariate shift), an MLP, 60 rounds: FedAvg and
Local against FedFomo, FedAlt and personalized FedDyn + fine-tuning, with
Oracle (one FedAvg per true group) as the reference row. The shared training
settings keep the library's defaults (SGD lr 0.05, B 32, 1 local epoch).
"""

import dataclasses
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

from fedjax_personal import algorithms as algorithms_lib
from fedjax_personal.config import AlgorithmSpec, TrainingConfig
from fedjax_personal.core.engine import EngineConfig
from fedjax_personal.core.sampling import CohortSampler
from fedjax_personal.core.system import SystemConfig
from fedjax_personal.datasets import DataConfig
from fedjax_personal.errors import ConfigError
from fedjax_personal.hparams import Declared, hparam, value_text
from fedjax_personal.models import ModelConfig
from fedjax_personal.run import plots, plugins, reporting, run_identity, sweep
from fedjax_personal.run.distributed import DistributedSettings

__all__ = [
  'AlgorithmSettings',
  'ExperimentSettings',
  'InputSettings',
  'OutputSettings',
  'ProcessSettings',
  'RunSettings',
]


@dataclasses.dataclass(frozen=True)
class ExperimentSettings(Declared):
  """Which algorithms run, for how long and on which clients.

  The algorithms, the rounds, the clients of each round, and what the tables
  report."""

  algorithm: Tuple[str, ...] = hparam(
    ('fedavg', 'local', 'oracle', 'fedfomo', 'fedalt', 'pfeddyn_ft'),
    'Algorithm(s) to run; several give a comparison table. One of: '
    + '; '.join(
      f'{n} ({spec.summary})' for n, spec in algorithms_lib.REGISTRY.items()
    ),
  )
  rounds: int = hparam(60, 'Communication rounds.', minimum=1)
  seed: int = hparam(
    0,
    'Seed of model init and training (and of the data partition unless '
    '--data_seed is given).',
    minimum=0,
  )
  cohort_size: Optional[int] = hparam(
    None, 'Clients per round (default: all).', minimum=1
  )
  participation: Optional[float] = hparam(
    None,
    'Instead of cohort_size: each client active '
    'with this probability per round (FedDyn scheme).',
    minimum=0,
    maximum=1,
    open_min=True,
  )
  cohort_sampler: str = hparam(
    'uniform',
    "How cohorts are drawn. uniform: from the run's keys "
    "inside the round; tff: as google-research/federated's code "
    "draws them (Reddi et al.'s runs; FedJAX's UniformGetClientSampler: "
    'a Lehmer-seeded NumPy choice per round, from --cohort_seed), the '
    "clients in the data set's order.",
    choices=('uniform', 'tff'),
  )
  cohort_seed: int = hparam(
    1,
    "--cohort_sampler=tff's seed (the publisher's "
    "client_datasets_random_seed, 1 in its runs; NumPy's RandomState "
    'seed, below 2**32).',
    minimum=0,
    maximum=2**32 - 1,
  )
  eval_every: int = hparam(
    3, 'Evaluate every this many rounds (0: at the end only).', minimum=0
  )
  target_accuracy: Optional[float] = hparam(
    None,
    'Report the first evaluated round whose mean accuracy reaches this '
    'fraction in '
    '(0, 1] (use --eval_every=1 for exact rounds).',
    minimum=0,
    maximum=1,
    open_min=True,
    refusal='is a fraction in (0, 1] (0.8 for 80%)',
  )
  stat_window: int = hparam(
    5,
    'Stable statistics: tables also report the mean over the last '
    'this many evaluations of the mean and worst-client accuracy.',
    minimum=1,
  )
  paper_metric: Optional[str] = hparam(
    None,
    "The table's column a reproduced paper reports (a flagfile that reproduces "
    'one names '
    'it): mean, worst, mean@last, worst@last, q10 or weighted (pooled over '
    'every scored test '
    'target). The header names it and summary.json carries it (paper_metric).',
    choices=tuple(reporting.PAPER_METRICS),
  )
  dp_delta: float = hparam(
    1e-5,
    'delta at which the DP-SGD epsilon is reported (algorithms run '
    'with DP-SGD, e.g. --fedfomo_dp_clip_norm > 0).',
    minimum=0,
    maximum=1,
    open_min=True,
    open_max=True,
  )
  sweep_seeds: int = hparam(
    0,
    'Run seeds seed..seed+S-1 together (0: off); one table row per '
    'seed. Device layout: one program; host layout: one after another.',
    minimum=0,
  )
  trials: int = hparam(
    1,
    'Run T trials (seeds seed..seed+T-1, one shared partition) of each '
    'algorithm, as one program in the device layout where the executor allows '
    'it, else one after another (the host layout: on shared cohort gathers); '
    'the table shows mean ± std over trials.',
    minimum=1,
  )
  sweep: str = hparam(
    '',
    'Hyperparameters swept in the same program, e.g. '
    "'client_lr:0.01,0.03,0.1;fedprox_mu:0,0.1' (cross product with the "
    'seeds).',
  )

  def check(self) -> None:
    """Known algorithms; settings that exclude each other."""
    if not self.algorithm:
      raise ConfigError('algorithm', 'give at least one algorithm')
    for a in self.algorithm:
      algorithms_lib.spec(a)  # refuses an unknown name
    if self.cohort_size is not None and self.participation is not None:
      raise ConfigError(
        'participation',
        'give either --cohort_size or --participation, not both',
      )
    if self.cohort_sampler == 'tff' and self.participation is not None:
      raise ConfigError(
        'participation',
        'does nothing with --cohort_sampler=tff (it draws '
        '--cohort_size clients a round)',
      )
    if self.cohort_sampler != 'tff' and self.cohort_seed != 1:
      raise ConfigError('cohort_seed', 'seeds --cohort_sampler=tff only')
    if self.trials > 1 and self.sweep_seeds:
      raise ConfigError(
        'trials',
        'give --trials (mean ± std rows) or --sweep_seeds (one row per '
        'seed), not both',
      )

  def sampler(self, data) -> CohortSampler:
    """The cohort sampler of ``data`` (a FederatedData or HostData): its
    clients that train (all but the ``eval_only`` last) are drawn.

    Args:
      data: the federated data.

    Returns:
      The ``CohortSampler``.
    """
    n, trained = data.num_clients, data.num_trained
    eligible = None if trained == n else trained
    if self.participation is not None:
      return CohortSampler(
        n, participation=self.participation, eligible=eligible
      )
    tff = (
      {'tff_seed': self.cohort_seed, 'rounds': self.rounds}
      if self.cohort_sampler == 'tff'
      else {}
    )
    return CohortSampler(
      n, cohort_size=self.cohort_size or trained, eligible=eligible, **tff
    )

  def row_label(self, name: str, config_label) -> str:
    """A table row's label: the algorithm and its swept values.

    Args:
      name: the algorithm.
      config_label: the configuration's swept values, or None.

    Returns:
      The label.
    """
    del self
    if config_label is None:
      return name
    return f'{name} ' + ' '.join(
      f'{k}={value_text(v)}' for k, v in config_label.items()
    )


@dataclasses.dataclass(frozen=True)
class InputSettings(Declared):
  """What the run reads of its data set.

  Which clients, how many examples each, how its store is checked."""

  client_ids: Optional[str] = hparam(
    None,
    'A text file of client ids, one per line (# '
    'comments): the run is limited to these clients (ids as '
    'the data set names them: an EMNIST writer, a Stack '
    "Overflow user; a partitioned pool's clients are 0..N-1).",
  )
  max_client_examples: Optional[int] = hparam(
    None,
    'Train on at most this many examples per '
    "client (its first ones; TFF's baselines cap at "
    '1000). Default: all.',
    minimum=1,
  )
  verify_store: bool = hparam(
    False,
    'Check every block of the population store of a natural '
    'data set before training (else each block is checked the first '
    'time a round reads it); a store that fails is rebuilt from its '
    'source files.',
  )
  rebuild_store: bool = hparam(
    False,
    'Rebuild the population store of a natural data set from '
    'its source files (a store is otherwise rebuilt by itself when '
    "its files, its format or the loader's code changed, or it is "
    'damaged).',
  )


@dataclasses.dataclass(frozen=True)
class OutputSettings(Declared):
  """Where the run's results go and how it checkpoints.

  Its output folder, checkpoints and resumption, and what it shows while it
  runs."""

  output_dir: Optional[str] = hparam(
    None,
    'Where to write results (default: runs/<data>_<model>_'
    '<algorithms>_<hash of the configuration>).',
  )
  checkpoint_every: int = hparam(
    0,
    'Save an Orbax checkpoint of the full state every this many '
    'rounds (0: only when the run is interrupted, and its final '
    'state, so that --resume never re-runs a finished algorithm) under '
    '<output_dir>/<algorithm>/checkpoints.',
    minimum=0,
  )
  resume: bool = hparam(
    False,
    'Continue the run in --output_dir: each algorithm from its latest '
    'checkpoint, those it never reached from the start (refused when the '
    'folder holds no run, or another configuration; more --rounds are '
    'allowed).',
  )
  resume_if_found: bool = hparam(
    False,
    'Like --resume where a checkpoint exists; start fresh '
    '(with a note) where there is none.',
  )
  overwrite: bool = hparam(
    False,
    'Clear --output_dir first when it holds results of another '
    'configuration (refused otherwise).',
  )
  plots: str = hparam(
    'background',
    'Where accuracy.png and client_accuracy_hist.png are drawn: '
    'background (a child process that outlives the run, so that matplotlib '
    'stays off its exit path: the files appear about a second after it '
    'exits), wait (before the run exits) or off.',
    choices=plots.PLOT_MODES,
  )
  progress: bool = hparam(True, 'Show a progress bar.')
  dry_run: bool = hparam(
    False,
    'Check every flag, load the data and build the model and '
    'algorithms, then stop: nothing is trained or written.',
  )


@dataclasses.dataclass(frozen=True)
class ProcessSettings(Declared):
  """What a job sets for its whole process."""

  imports: Tuple[str, ...] = hparam(
    (),
    "A module of your own to import before the flags are read (a .py file's "
    'path, or a '
    'module name importable from here), so that the algorithms and data sets '
    'it registers '
    'get their flags; repeat it for several. Its source is part of the run '
    'identity.',
    flag='import',
    repeatable=True,
  )
  compilation_cache: Optional[str] = hparam(
    None,
    "JAX's persistent compilation cache: a folder, or off (default: "
    '$FEDJAX_PERSONAL_COMPILATION_CACHE, else <cache>/xla: '
    '$FEDJAX_PERSONAL_CACHE or '
    '~/.cache/fedjax_personal). A second run of the same experiment starts '
    'without compiling; '
    "entries are keyed by JAX's own key, never stale; the folder is bounded "
    '(least recently '
    'used out).',
  )


@dataclasses.dataclass(frozen=True)
class AlgorithmSettings:
  """One algorithm of a run with its settings.

  Checked once when made (``AlgorithmSpec.validate``).

  Attributes:
    spec: its registry entry.
    training: the shared settings as it uses them (those it does not use
      reset to their defaults).
    config: its own settings.
    ignored: the flags given for other algorithms of the run that it does
      not use (its summary records them).
  """

  spec: AlgorithmSpec
  training: TrainingConfig
  config: Any
  ignored: Tuple[str, ...] = ()

  def __post_init__(self):
    self.spec.validate(self.training, self.config)

  @property
  def name(self) -> str:
    """The registry name."""
    return self.spec.name


@dataclasses.dataclass(frozen=True)
class RunSettings:
  """Every setting of one run of the command.

  Resolved (the main job's defaults, --data_seed from --seed, the validation
  share from the algorithms) and checked, as ``experiment_flags.read`` makes it.

  Attributes:
    experiment: the algorithms, rounds, cohorts and tables.
    data: the data set (its options included).
    inputs: what the run reads of it.
    model: the model.
    engine: how client work runs, where clients live, the matmul precision.
    process: what the run sets for its process.
    output: outputs, checkpoints, resuming.
    distributed: the processes.
    algorithms: each algorithm with its settings.
    system: the clients' devices (stragglers, lost uploads).
    sweep: the swept settings' values by flag (empty: none).
    flags: every flag of the command and its value, as ``summary.json``
      records them (written, never read back).
  """

  experiment: ExperimentSettings
  data: DataConfig
  inputs: InputSettings
  model: ModelConfig
  engine: EngineConfig
  process: ProcessSettings
  output: OutputSettings
  distributed: DistributedSettings
  algorithms: Tuple[AlgorithmSettings, ...]
  system: SystemConfig = dataclasses.field(default_factory=SystemConfig)
  sweep: Mapping[str, Tuple[float, ...]] = dataclasses.field(
    default_factory=dict
  )
  flags: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def client_weights(self) -> Dict[str, str]:
    """How each algorithm that averages client uploads weighs them.

    Returns:
      ``{name: weighting}``: ``--weighting``, else the algorithm's paper's.
    """
    return {
      a.name: a.spec.weighting(a.training)
      for a in self.algorithms
      if 'weighting' in a.spec.uses
    }

  def configurations(self) -> Optional[List[tuple]]:
    """The (seed, {name: value}) configurations of a sweep or of trials, or
    None for single runs.

    Returns:
      ``[(seed, {name: value})]``, or None.
    """
    e = self.experiment
    if not (e.sweep_seeds or self.sweep or e.trials > 1):
      return None
    seeds = list(range(e.seed, e.seed + max(e.sweep_seeds, e.trials, 1)))
    return sweep.configs(seeds, {k: list(v) for k, v in self.sweep.items()})

  def identity(
    self, fingerprint: str, cap: Optional[int] = None, num_processes: int = 1
  ) -> Dict[str, Any]:
    """What every algorithm of the run shares in its run identity.

    Args:
      fingerprint: the data's (``run_identity.data_fingerprint`` of the
        padded arrays, or a population store's digest).
      cap: ``--max_client_examples`` (None: no cap).
      num_processes: the run's processes.

    Returns:
      The shared identity entries.
    """
    data = dataclasses.asdict(self.data)
    # where the files are does not matter; their content does
    for where in (
      'data_dir',
      'download',
    ):
      data.pop(where)
    if cap is not None:
      data['max_client_examples'] = cap
    model = self.model
    start: Dict[str, Any] = (
      {} if model.model_init == 'flax' else {'model_init': model.model_init}
    )
    if model.init_weights:
      start['init_weights_sha256'] = run_identity.file_sha256(
        model.init_weights
      )
    if model.options is not None and dataclasses.fields(model.options):
      start['model_options'] = dataclasses.asdict(model.options)
    imports = (
      {'imports': plugins.identity(self.process.imports)}
      if self.process.imports
      else {}
    )
    return {
      **imports,
      'data': data,
      'data_fingerprint': fingerprint,
      'model': model.model,
      'adapter_dim': model.adapter_dim,
      'cohort_size': self.experiment.cohort_size,
      'participation': self.experiment.participation,
      'seed': self.experiment.seed,
      **(
        {'cohort_sampler': ['tff', self.experiment.cohort_seed]}
        if self.experiment.cohort_sampler == 'tff'
        else {}
      ),
      **({'system': self.system.identity()} if self.system.active else {}),
      **start,
      **({'num_processes': num_processes} if num_processes > 1 else {}),
    }

  def default_output_dir(self, identities: dict) -> str:
    """``runs/<data>_<partition>_..._<hash of the configurations>``.

    Args:
      identities: each algorithm's run identity.

    Returns:
      The folder's path.
    """
    algs = '+'.join(identities)
    algs = algs if len(algs) <= 60 else f'{len(identities)}algorithms'
    d = self.data
    return os.path.join(
      'runs',
      f'{d.dataset.replace(":", "_")}_{d.partition}_'
      f'{self.model.model}_n{d.num_clients or "all"}_seed'
      f'{self.experiment.seed}_{algs}_{run_identity.short_hash(identities)}',
    )

  def shared_flags(self) -> Dict[str, Any]:
    """The flags every process of one run must share (all but the process's
    own id and progress bar).

    Returns:
      ``{flag: value}``.
    """
    return {
      k: v for k, v in sorted(self.flags.items()) if k not in PER_PROCESS_FLAGS
    }


#: This library's flags that may differ between the processes of one run.
PER_PROCESS_FLAGS = ('process_id', 'progress')
