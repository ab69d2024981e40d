#!/usr/bin/env python
"""FedProx's systems-heterogeneity experiment (its Figure 1) and one FedNova
setting, on Synthetic(1, 1).

Paper: Li et al., "Federated Optimization in Heterogeneous Networks" (FedProx,
MLSys 2020, arXiv 1812.06127), Figure 1 and its code litian96/FedProx
(``run_fedprox.sh``, ``flearn/trainers/fedavg.py`` and ``fedprox.py``): 30
devices of Synthetic(1, 1), 10 a round, E = 20 local epochs of batch 10, SGD
at 0.01, 200 rounds, multinomial logistic regression; 0%, 50% and 90% of each
round's devices are stragglers (``--stragglers``, ``core/system.py``: chosen
as its code chooses them, the same for every method, each doing 1 .. 19
epochs); FedAvg drops them, FedProx keeps their partial work, at mu = 0 and
mu = 1. Reported as its code reports it: the training loss of the global
model over every device's training examples (``train_error_and_loss``),
evaluated every ``--eval_every`` rounds.

Table 2 (FedNova: Wang et al., "Tackling the Objective Inconsistency Problem
in Heterogeneous Federated Optimization", NeurIPS 2020, arXiv 2007.07481):
its heterogeneous local work, each client drawing E_i ~ U(2, 5) epochs each
round (``--local_work_min=2`` with E = 5), FedAvg against FedNova. The paper
ran it on non-IID CIFAR-10 with VGG-11; here on the same Synthetic(1, 1)
federation as table 1 (a stated reduction: a CPU runs it in minutes).

The data: the project's generator of Synthetic(1, 1) (``datasets/in_memory.
synthetic``: FedProx's distributions and lognormal(4, 2) + 50 sizes,
uncapped here as its generator; NumPy's ``default_rng`` from ``--seed``, so
not its published file), 90% of each device's examples for training, as its
generator splits them. ``cpu`` and ``paper`` scales differ in trials only
(3 and 5): the paper's protocol runs on a CPU in minutes.

  python scripts/reproduce_fedprox.py
  python scripts/reproduce_fedprox.py --tables=1 --stragglers=0.9
"""

import dataclasses
import os
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal import algorithms
from fedjax_personal.core import system as system_lib
from fedjax_personal.core.data import ClientData, to_device
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.core.executor_choice import create_executor
from fedjax_personal.core.losses import evaluate_params
from fedjax_personal.core.sampling import CohortSampler
from fedjax_personal.datasets import DataConfig, load_federated
from fedjax_personal.datasets.in_memory import SyntheticOptions
from fedjax_personal.errors import ConfigError
from fedjax_personal.hparams import hparam
from fedjax_personal.models import create_model
from fedjax_personal.run import experiment, reproduce, script_entry

#: Figure 1's curves: (algorithm, its settings).
FIGURE_1 = {
  'fedavg': ('fedavg', {}),
  'fedprox_mu0': ('fedprox', {'mu': 0.0}),
  'fedprox_mu1': ('fedprox', {'mu': 1.0}),
}
FEDNOVA = {'fedavg': ('fedavg', {}), 'fednova': ('fednova', {})}
STRAGGLERS = ('0', '0.5', '0.9')
#: What FedProx's Figure 1 and its text (Section 5.2) show on Synthetic(1, 1),
#: per straggler fraction (no numbers are printed in the paper).
PAPER = {
  '0': 'mu = 0 is FedAvg (the same runs); mu = 1 converges more stably',
  '0.5': 'keeping partial work (mu = 0) beats dropping it; mu = 1 lowest',
  '0.9': 'mu = 1 lowest; FedAvg (dropping 90%) and mu = 0 worse, less stable',
}


@dataclasses.dataclass(frozen=True)
class FedProxFigure(reproduce.ReproduceSettings):
  """The script's settings (its flags)."""

  tables: Tuple[str, ...] = hparam(
    ('1', '2'),
    "Tables to run: 1 (FedProx's Figure 1), 2 (FedNova's random local epochs).",
  )
  stragglers: Tuple[str, ...] = hparam(
    STRAGGLERS, "Table 1's straggler fractions."
  )
  rounds: int = hparam(200, 'Rounds (FedProx: 200).', minimum=1)
  eval_every: int = hparam(
    10, "Evaluation period (the global model's training loss).", minimum=1
  )
  num_clients: int = hparam(30, 'Devices (FedProx: 30).', minimum=2)
  cohort_size: int = hparam(10, 'Devices a round (FedProx: 10).', minimum=1)

  def check(self) -> None:
    for name, values, known in (
      ('tables', self.tables, ('1', '2')),
      ('stragglers', self.stragglers, None),
    ):
      for v in values:
        if known is not None and v not in known:
          raise ConfigError(
            name, f'unknown value {v!r}; choose from {list(known)}'
          )
        if known is None and not 0 <= float(v) <= 1:
          raise ConfigError(name, f'{v} is not a fraction in [0, 1]')
    if self.cohort_size > self.num_clients:
      raise ConfigError(
        'cohort_size',
        f'{self.cohort_size} devices a round of {self.num_clients}',
      )


script_entry.define_settings_flags(FedProxFigure)


@dataclasses.dataclass
class GlobalTrainLoss(experiment.Callback):
  """FedProx's reported training loss: the global model's mean loss over every
  device's training examples (its ``train_error_and_loss``, the devices'
  losses weighted by their examples), added to each evaluated round."""

  model: object = None
  train: ClientData = None

  def __post_init__(self):
    def loss(params, train):
      stats = jax.vmap(
        lambda x, y, n: evaluate_params(self.model, params, ClientData(x, y, n))
      )(train.x, train.y, train.num_examples)
      return jnp.sum(stats.loss_sum) / jnp.sum(stats.count)

    self._loss = jax.jit(loss)

  def on_round_end(self, round_num, records, state) -> None:
    for record in records:
      if 'accuracy_mean' in record:
        record['global_train_loss'] = float(
          self._loss(state.params, self.train)
        )


def federation(cfg: FedProxFigure):
  """Synthetic(1, 1) as FedProx's generator draws it (sizes uncapped, 90%
  train)."""
  return to_device(
    load_federated(
      DataConfig(
        dataset='synthetic',
        partition='natural',
        num_clients=cfg.num_clients,
        test_fraction=0.1,
        seed=cfg.seed,
        options=SyntheticOptions(
          synthetic_alpha=1.0, synthetic_beta=1.0, synthetic_max_examples=0
        ),
      )
    )
  )


def run_cell(cfg, directory, data, name, own, training, system):
  """The trials of one method at one system; (histories, seconds per trial)."""
  model = create_model(
    'logreg', data.num_classes, data.train.x[0, :1], init='keras'
  )
  alg = algorithms.build(name, model, data, **training, **own)
  runner = RoundRunner(
    alg,
    data,
    CohortSampler(data.num_clients, cohort_size=cfg.cohort_size),
    create_executor('auto', model, data.train.x[0, :1]),
    system=system,
  )
  return reproduce.run_trials(
    runner,
    cfg.rounds,
    cfg.seed,
    cfg.num_trials,
    cfg.eval_every,
    callbacks=[GlobalTrainLoss(model, data.train)],
    cell={
      'algorithm': name,
      'settings': {**training, **own},
      'system': dataclasses.asdict(system),
    },
    reuse=cfg.reuse_trials,
    directory=directory,
  )


def final(histories, key):
  """(mean, sample std) over trials of ``key`` at each trial's last
  evaluation; NaN for a trial that diverged."""
  last = [
    next(
      (r.get(key, float('nan')) for r in reversed(h) if key in r), float('nan')
    )
    if not any(r.get('diverged') for r in h)
    else float('nan')
    for h in histories
  ]
  arr = np.asarray(last, np.float64)
  ok = arr[np.isfinite(arr)]
  return (
    float(ok.mean()) if ok.size else float('nan'),
    float(ok.std(ddof=1)) if ok.size > 1 else 0.0,
    int(arr.size - ok.size),
  )


def fmt(m):
  mean, std, bad = m
  text = 'diverged' if not np.isfinite(mean) else f'{mean:.3f} ± {std:.3f}'
  return text + (f' ({bad} diverged)' if bad and np.isfinite(mean) else '')


def table(cfg, directory, data, methods, systems, training):
  """Rows of (system label, {method: (loss, accuracy)}) and their curves."""
  rows, curves = {}, {}
  for label, system in systems:
    row = {}
    for method, (name, own) in methods.items():
      histories, secs = run_cell(
        cfg, directory, data, name, own, training, system
      )
      row[method] = {
        'train_loss': final(histories, 'global_train_loss'),
        'accuracy': final(histories, 'accuracy_weighted'),
        'seconds_per_trial': secs,
      }
      curves[f'{label}/{method}'] = [
        [
          [r['round'], r.get('global_train_loss')]
          for r in h
          if 'global_train_loss' in r
        ]
        for h in histories
      ]
      print(
        f'{label} {method}: training loss {fmt(row[method]["train_loss"])}, '
        f'{secs:.1f} s per trial',
        flush=True,
      )
    rows[label] = row
  return rows, curves


def main(cfg: FedProxFigure):
  if cfg.show_dry_run(
    {
      'rounds': cfg.rounds,
      'devices': cfg.num_clients,
      'per round': cfg.cohort_size,
    }
  ):
    return
  directory = cfg.results_dir('reproduce_fedprox')
  data = federation(cfg)
  print(data.describe())
  training = dict(client_lr=0.01, batch_size=10, local_epochs=20)
  results, parts, curves = {}, [], {}
  if '1' in cfg.tables:
    systems = [
      (
        f'{float(s):.0%} stragglers',
        system_lib.SystemConfig(stragglers=float(s)),
      )
      for s in cfg.stragglers
    ]
    rows, c = table(cfg, directory, data, FIGURE_1, systems, training)
    results['figure1'], curves['figure1'] = rows, c
    parts.append(
      "Table 1: FedProx's Figure 1, training loss of the global model after "
      f'{cfg.rounds} rounds\n\n'
      + reproduce.markdown_table(
        ['stragglers'] + list(FIGURE_1) + ['paper (Figure 1)'],
        [
          [label]
          + [fmt(r[m]['train_loss']) for m in FIGURE_1]
          + [PAPER.get(s, '')]
          for (label, r), s in zip(rows.items(), cfg.stragglers)
        ],
      )
    )
  if '2' in cfg.tables:
    nova = dict(training, local_epochs=5)
    rows, c = table(
      cfg,
      directory,
      data,
      FEDNOVA,
      [('E_i ~ U(2, 5)', system_lib.SystemConfig(local_work_min=2))],
      nova,
    )
    results['fednova'], curves['fednova'] = rows, c
    parts.append(
      "Table 2: FedNova's random local epochs, training loss of the global "
      'model '
      f'after {cfg.rounds} rounds (pooled test accuracy)\n\n'
      + reproduce.markdown_table(
        ['local epochs'] + list(FEDNOVA),
        [
          [label]
          + [
            f'{fmt(r[m]["train_loss"])} ({fmt(r[m]["accuracy"])})'
            for m in FEDNOVA
          ]
          for label, r in rows.items()
        ],
      )
    )
  title = (
    f'FedProx Figure 1 and a FedNova setting on Synthetic(1, 1), scale '
    f'{cfg.scale}: '
    f'{cfg.num_clients} devices, {cfg.cohort_size} a round, batch 10, lr 0.01, '
    f'{cfg.rounds} rounds; mean ± std over {cfg.num_trials} trials of the '
    f'training loss '
    'at the last round'
  )
  results['curves'] = curves
  print('\n\n'.join([title] + parts))
  print(
    'wrote',
    *reproduce.write_results(
      cfg, directory, 'fedprox', title, '\n\n'.join(parts), results
    ),
  )
  if '1' in cfg.tables:
    print('wrote', plot_figure_1(curves['figure1'], cfg.stragglers, directory))


def plot_figure_1(curves, stragglers, directory) -> str:
  """``figure1_loss.png``: one panel per straggler fraction, the training
  loss of each method (mean over trials, a band of one std), as FedProx's
  Figure 1 lays them out."""
  import matplotlib  # noqa: PLC0415  (plots only)

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, axes = plt.subplots(
    1, len(stragglers), figsize=(4 * len(stragglers), 3.2), sharey=True
  )
  for ax, s in zip(np.atleast_1d(axes), stragglers):
    label = f'{float(s):.0%} stragglers'
    for method in FIGURE_1:
      trials = [t for t in curves[f'{label}/{method}'] if t]
      if not trials:
        continue
      n = min(len(t) for t in trials)
      rounds = [p[0] for p in trials[0][:n]]
      loss = np.array(
        [[np.nan if p[1] is None else p[1] for p in t[:n]] for t in trials]
      )
      mu, sd = np.nanmean(loss, 0), np.nanstd(loss, 0)
      (line,) = ax.plot(rounds, mu, label=method)
      ax.fill_between(
        rounds, mu - sd, mu + sd, color=line.get_color(), alpha=0.2
      )
    ax.set_title(label)
    ax.set_xlabel('round')
  np.atleast_1d(axes)[0].set_ylabel('training loss')
  np.atleast_1d(axes)[0].legend()
  path = os.path.join(directory, 'figure1_loss.png')
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


if __name__ == '__main__':
  script_entry.run_script(
    main,
    kept='the trials finished so far are kept under '
    '<output_dir>/trials; the same command continues from them',
    settings=FedProxFigure,
  )
