"""The run's own settings, declared once (``hparam``): the experiment (which
algorithms, how many rounds, which clients a round draws, what the tables
report), what the run reads of its data, and where its outputs go. The
command's flags are generated from these fields (``run/command_flags.py``),
as from the data set's (``datasets.DataConfig``), the model's
(``models.ModelSettings``), the engine's (``core.engine.EngineSettings``),
the process's (``run.process_settings.ProcessSettings``) and the processes'
(``run.distributed.DistributedSettings``). A setting's range is checked from
its declaration (``hparams.validate``); what depends on several settings is
checked in ``run/settings.py``.

The main job (the defaults): why personalization matters. Real MNIST digits
(the 10k MNIST files embedded in the package) on 40 clients in 4 groups
rotated 0/90/180/270 degrees (covariate shift), an MLP, 60 rounds: FedAvg and
Local against FedFomo, FedAlt and personalized FedDyn + fine-tuning, with
Oracle (one FedAvg per true group) as the reference row. The shared training
settings keep the library's defaults (SGD lr 0.05, B 32, 1 local epoch).
"""

import dataclasses
from typing import Optional, Tuple

from fedjax_personal import algorithms as algorithms_lib
from fedjax_personal.hparams import hparam
from fedjax_personal.run import plots

__all__ = ['ExperimentSettings', 'InputSettings', 'OutputSettings']


@dataclasses.dataclass(frozen=True)
class ExperimentSettings:
  """Which algorithms run, for how long, on which clients per round, and what
  the tables report."""
  algorithm: Tuple[str, ...] = hparam(
      ('fedavg', 'local', 'oracle', 'fedfomo', 'fedalt', 'pfeddyn_ft'),
      'Algorithm(s) to run; several give a comparison table. One of: '
      + '; '.join(f'{n} ({spec.summary})' for n, spec in algorithms_lib.REGISTRY.items()))
  rounds: int = hparam(60, 'Communication rounds.', minimum=1)
  seed: int = hparam(0, 'Seed of model init and training (and of the data partition unless '
                     '--data_seed is given).', minimum=0)
  cohort_size: Optional[int] = hparam(None, 'Clients per round (default: all).', minimum=1)
  participation: Optional[float] = hparam(None, 'Instead of cohort_size: each client active '
                                          'with this probability per round (FedDyn scheme).',
                                          minimum=0, maximum=1, open_min=True)
  eval_every: int = hparam(3, 'Evaluate every this many rounds (0: at the end only).', minimum=0)
  target_accuracy: Optional[float] = hparam(
      None, 'Report the first evaluated round whose mean accuracy reaches this fraction in '
      '(0, 1] (use --eval_every=1 for exact rounds).', minimum=0, maximum=1, open_min=True,
      refusal='is a fraction in (0, 1] (0.8 for 80%)')
  stat_window: int = hparam(5, 'Stable statistics: tables also report the mean over the last '
                            'this many evaluations of the mean and worst-client accuracy.',
                            minimum=1)
  dp_delta: float = hparam(1e-5, 'delta at which the DP-SGD epsilon is reported (algorithms run '
                           'with DP-SGD, e.g. --fedfomo_dp_clip_norm > 0).', minimum=0,
                           maximum=1, open_min=True, open_max=True)
  sweep_seeds: int = hparam(0, 'Run seeds seed..seed+S-1 together (0: off); one table row per '
                            'seed. Device layout: one program; host layout: one after another.',
                            minimum=0)
  trials: int = hparam(1, 'Run T trials (seeds seed..seed+T-1, one shared partition) of each '
                       'algorithm, as one program in the device layout where the executor allows '
                       'it, else one after another (the host layout: on shared cohort gathers); '
                       'the table shows mean ± std over trials.', minimum=1)
  sweep: str = hparam('', "Hyperparameters swept in the same program, e.g. "
                      "'client_lr:0.01,0.03,0.1;prox_mu:0,0.1' (cross product with the seeds).")


@dataclasses.dataclass(frozen=True)
class InputSettings:
  """What the run reads of its data set (which clients, how many examples
  each, how its store is checked) and how a task's inputs and score are
  made."""
  client_ids: Optional[str] = hparam(None, 'A text file of client ids, one per line (# '
                                     'comments): the run is limited to these clients (ids as '
                                     'the data set names them: an EMNIST writer, a Stack '
                                     'Overflow user; a partitioned pool\'s clients are 0..N-1).')
  max_client_examples: Optional[int] = hparam(None, 'Train on at most this many examples per '
                                              'client (its first ones; TFF\'s baselines cap at '
                                              '1000). Default: all.', minimum=1)
  verify_store: bool = hparam(False, 'Check every block of the population store of a natural '
                              'data set before training (else each block is checked the first '
                              'time a round reads it); a store that fails is rebuilt from its '
                              'source files.')
  rebuild_store: bool = hparam(False, 'Rebuild the population store of a natural data set from '
                               'its source files (a store is otherwise rebuilt by itself when '
                               'its files, its format or the loader\'s code changed, or it is '
                               'damaged).')
  stackoverflow_accuracy: str = hparam(
      'in_vocab', 'stackoverflow: the next-word accuracy reported. in_vocab: targets PAD, BOS, '
      'EOS and OOV not scored (Reddi et al., the partial-personalization seed); '
      "fedjax_in_vocab: FedJAX's accuracy_in_vocab (PAD and EOS not scored, OOV a miss).",
      choices=('in_vocab', 'fedjax_in_vocab'))
  cifar100_preprocess: str = hparam(
      'none', 'cifar100: the images the model sees. none: as the file holds them (scaled to '
      '[0, 1]); reddi: a random 24x24 crop and left-right flip of each training image (drawn '
      'from the run\'s key for each client, round and step), the central 24x24 of the others, '
      'each standardized, as Reddi et al.\'s task (google-research/federated) feeds them.',
      choices=('none', 'reddi'))


@dataclasses.dataclass(frozen=True)
class OutputSettings:
  """Where the run's results go, how it checkpoints and resumes, and what it
  shows while it runs."""
  output_dir: Optional[str] = hparam(None, 'Where to write results (default: runs/<data>_<model>_'
                                     '<algorithms>_<hash of the configuration>).')
  checkpoint_every: int = hparam(0, 'Save an Orbax checkpoint of the full state every this many '
                                 'rounds (0: never) under <output_dir>/<algorithm>/checkpoints.',
                                 minimum=0)
  resume: bool = hparam(False, 'Continue each algorithm from its latest checkpoint in '
                        '--output_dir (refused when there is none, or when the folder holds '
                        'another configuration; more --rounds are allowed).')
  resume_if_found: bool = hparam(False, 'Like --resume where a checkpoint exists; start fresh '
                                 '(with a note) where there is none.')
  overwrite: bool = hparam(False, 'Clear --output_dir first when it holds results of another '
                           'configuration (refused otherwise).')
  plots: str = hparam('background', 'Where accuracy.png and client_accuracy_hist.png are drawn: '
                      'background (a child process that outlives the run, so that matplotlib '
                      'stays off its exit path: the files appear about a second after it '
                      'exits), wait (before the run exits) or off.', choices=plots.PLOT_MODES)
  progress: bool = hparam(True, 'Show a progress bar.')
  dry_run: bool = hparam(False, 'Check every flag, load the data and build the model and '
                         'algorithms, then stop: nothing is trained or written.')
