#!/usr/bin/env python
"""Reproduces the shape of the debiasing slides' tables on CIFAR-10 (scaled).

Seed: the slides "Customizing Federated Learning to the Edge" (Saligrama, MLSys workshop
2021), on FedDyn ("Federated Learning Based on Dynamic Regularization", arXiv 2111.04263)
and its personalized variants.

Table 1 ("communication rounds" to a target accuracy): FedDyn, SCAFFOLD, FedAvg
and FedProx, non-IID (Dirichlet) devices sampled independently with
probability p each round; the server model is evaluated on every device's test
split after every round.

Table 2 (personalization): personalized FedDyn with fine-tuning, MAML and
prototype heads on sparse classes (device i holds classes {(i + j) mod 10 :
j < 5}), with and without a per-device permutation of class indices; average
and lowest per-device accuracy (APL / LPL) and rounds to a target.

``--scale=cpu`` (3 trials; table 1 took about 6 minutes per method and trial
on 2 cores with untiled convolutions, most of it the evaluation after every
round; 150 rounds evaluated every 3 now take 50-74 s): 20 devices of
500 train / 100 test CIFAR-10 images, p = 0.25, LeNet-5 on 32x32x3 inputs,
B = 50; table 1: E = 1 local epoch, 60 rounds, evaluated every round (``--eval_every``); table 2:
K = 5 local steps, 40 rounds, evaluated every 4 rounds (so its rounds-to-target
are multiples of 4). ``--scale=paper`` (the slides): 100 devices (600 images
each, all of CIFAR-10), p = 0.1 active, FedDyn's own CNN with PyTorch's initialisation (``feddyn_cnn``), 1,000
rounds for table 1 and 500 for table 2, 5 trials. Size flags override either.
Results: ``<output_dir>/tables_<scale>.{json,md}``.

  python scripts/reproduce_debiasing.py
  python scripts/reproduce_debiasing.py --scale=paper
"""

import dataclasses
import os
import types
from typing import Optional, Tuple

from fedjax_personal import algorithms
from fedjax_personal.core.data import to_device
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.core.executor_choice import create_executor
from fedjax_personal.core.sampling import CohortSampler
from fedjax_personal.datasets import DataConfig, load_federated
from fedjax_personal.errors import ConfigError
from fedjax_personal.hparams import hparam
from fedjax_personal.models import create_model
from fedjax_personal.run import experiment, reporting, reproduce, script_entry

TABLE1_METHODS = ('feddyn', 'scaffold', 'fedavg', 'fedprox')
TABLE2_METHODS = ('pfeddyn_ft', 'pfeddyn_maml', 'pfeddyn_proto')


@dataclasses.dataclass(frozen=True)
class DebiasingTables(reproduce.ReproduceSettings):
  """The script's settings (its flags)."""

  num_clients: Optional[int] = hparam(
    None, 'Devices (cpu 20, paper 100).', minimum=2
  )
  participation: Optional[float] = hparam(
    None,
    'Probability a device is active in a round (cpu 0.25, paper 0.1).',
    minimum=0,
    maximum=1,
  )
  rounds: Optional[int] = hparam(
    None, 'Rounds for table 1 (cpu 60, paper 1000).', minimum=1
  )
  personal_rounds: Optional[int] = hparam(
    None, 'Rounds for table 2 (cpu 40, paper 500).', minimum=1
  )
  model: Optional[str] = reproduce.model_field()
  model_init: Optional[str] = reproduce.model_init_field()
  tables: Tuple[str, ...] = hparam(
    ('1', '2'), 'Tables to run: 1 (rounds to target), 2 (personalized FedDyn).'
  )
  methods: Tuple[str, ...] = hparam(
    TABLE1_METHODS,
    "Table 1's methods (a subset, e.g. "
    'scaffold,fedavg with --participation and --client_lr for '
    "SCAFFOLD's study).",
  )
  alpha_dirichlet: float = hparam(0.3, 'Label skew of table 1.')
  targets: Tuple[str, ...] = hparam(
    ('0.35', '0.40', '0.45'), 'Target mean accuracies of table 1.'
  )
  personal_methods: Tuple[str, ...] = hparam(
    TABLE2_METHODS,
    "Table 2's methods (a subset, "
    'e.g. pfeddyn_maml with --personal_rounds to train '
    'MAML to convergence).',
  )
  max_grad_norm: float = hparam(
    0.0,
    'FedDyn family (both tables): clip the data-term gradient '
    "to this norm (0: no clipping; the authors' code: 10).",
    minimum=0,
  )
  personal_targets: Tuple[str, ...] = hparam(
    ('0.60', '0.70'), 'Target mean accuracies of table 2.'
  )
  client_lr: float = hparam(0.05, 'Client learning rate.')
  personal_local_steps: int = hparam(5, 'Local steps per round in table 2.')
  eval_every: int = hparam(
    1,
    'Evaluation period of table 1 (its rounds-to-target are then '
    'multiples of it; each evaluation of the 20 devices costs about as '
    'much as a round here).',
    minimum=1,
  )
  personal_eval_every: int = hparam(
    4,
    'Evaluation period of table 2 (MAML evaluation adapts on '
    '500 images per device: about 14 s per evaluation here).',
  )

  def check(self) -> None:
    for name, values, known in (
      ('tables', self.tables, ('1', '2')),
      ('methods', self.methods, TABLE1_METHODS),
      ('personal_methods', self.personal_methods, TABLE2_METHODS),
    ):
      for v in values:
        if v not in known:
          raise ConfigError(
            name, f'unknown value {v!r}; choose from {list(known)}'
          )
    # when not given
    default = {f.name: f.default for f in dataclasses.fields(self)}
    for table, names in (
      ('1', ('methods', 'eval_every', 'rounds', 'targets')),
      (
        '2',
        (
          'personal_methods',
          'personal_eval_every',
          'personal_rounds',
          'personal_targets',
          'personal_local_steps',
        ),
      ),
    ):
      for name in names:
        if getattr(self, name) != default[name] and table not in self.tables:
          raise ConfigError(
            name, f'applies to table {table} only; add {table} to --tables'
          )


script_entry.define_settings_flags(DebiasingTables)


@dataclasses.dataclass
class TableRun:
  """One run of the script: its settings, the sizes they resolve to and the
  results folder."""

  cfg: DebiasingTables
  sizes: types.SimpleNamespace
  directory: str


def sizes(cfg):
  return types.SimpleNamespace(
    num_clients=cfg.scaled(cfg.num_clients, 20, 100),
    participation=cfg.scaled(cfg.participation, 0.25, 0.1),
    rounds=cfg.scaled(cfg.rounds, 60, 1000),
    personal_rounds=cfg.scaled(cfg.personal_rounds, 40, 500),
    model=cfg.scaled(cfg.model, 'lenet5', 'feddyn_cnn'),
    model_init=cfg.scaled(cfg.model_init, 'flax', 'pytorch'),
  )


def run_one(r: TableRun, name, data, settings, rounds, eval_every=1):
  cfg, S = r.cfg, r.sizes
  model = create_model(
    S.model, data.num_classes, data.train.x[0, :1], init=S.model_init
  )
  alg = algorithms.build(name, model, data, **settings)
  runner = RoundRunner(
    alg,
    data,
    CohortSampler(data.num_clients, participation=S.participation),
    create_executor('auto', model, data.train.x[0, :1]),
  )
  return reproduce.run_trials(
    runner,
    rounds,
    cfg.seed,
    cfg.num_trials,
    eval_every,
    cell={'algorithm': name, 'settings': settings},
    reuse=cfg.reuse_trials,
    directory=r.directory,
  )


def clipping(cfg):
  """The FedDyn family's data-term gradient clipping, when asked for."""
  return {'max_grad_norm': cfg.max_grad_norm} if cfg.max_grad_norm else {}


def to_target(histories, target):
  """Mean over trials of the rounds to reach ``target`` (None unless every
  trial reached it)."""
  got = [experiment.rounds_to_target(h, target) for h in histories]
  return None if None in got else sum(got) / len(got)


def fmt_rounds(r, rounds):
  return f'{r:>6.1f}' if r is not None else f'>{rounds:>5}'


def main(cfg: DebiasingTables):
  S = sizes(cfg)
  if cfg.show_dry_run(vars(S)):
    return
  r = TableRun(cfg, S, cfg.results_dir('reproduce_debiasing'))
  # The authors' code: SGD with weight decay 1e-3 for every method.
  shared = dict(
    client_lr=cfg.client_lr,
    batch_size=50,
    local_epochs=1,
    client_weight_decay=1e-3,
  )
  results, parts = {}, []
  if '1' in cfg.tables:
    results['table1'], md1 = table_one(r, shared)
    parts.append(f'Table 1\n\n{md1}')
  if '2' in cfg.tables:
    results['table2'], md2 = table_two(r, shared)
    parts.append(f'Table 2\n\n{md2}')
  what = (
    [
      f'table 1 {S.rounds} rounds (Dirichlet {cfg.alpha_dirichlet}'
      + (f', evaluated every {cfg.eval_every}' if cfg.eval_every > 1 else '')
      + ')'
    ]
    if '1' in cfg.tables
    else []
  )
  what += (
    [f'table 2 {S.personal_rounds} rounds (sparse classes)']
    if '2' in cfg.tables
    else []
  )
  title = (
    f'Debiasing slides, scale {cfg.scale}: CIFAR-10, {S.num_clients} devices, '
    f'p = {S.participation}, {S.model}, client lr {cfg.client_lr}'
    + (
      f', FedDyn data-term clip {cfg.max_grad_norm:g}'
      if cfg.max_grad_norm
      else ''
    )
    + f'; {", ".join(what)}; '
    f'mean ± std over {cfg.num_trials} trials of the mean over the last '
    f'{cfg.stat_window} evaluations; rounds to target: mean over trials'
  )
  print(
    'wrote',
    *reproduce.write_results(
      cfg, r.directory, 'tables', title, '\n\n'.join(parts), results
    ),
  )


def curves(histories, keys=('accuracy_mean', 'train_loss')):
  """Per trial, [round, *keys] of every evaluated round (for the JSON)."""
  return [
    [[r['round']] + [r.get(k) for k in keys] for r in h if 'accuracy_mean' in r]
    for h in histories
  ]


def fr(r, rounds):
  """A rounds-to-target cell: the mean over trials, '>R' unless all reached
  it."""
  return f'>{rounds}' if r is None else f'{r:.1f}'


def table_one(r: TableRun, shared):
  cfg, S, directory = r.cfg, r.sizes, r.directory
  """Rounds to target accuracy (the slides' table 1); returns (rows,
  Markdown)."""
  own = {'fedprox': dict(mu=0.01), 'feddyn': dict(alpha=1e-2, **clipping(cfg))}
  data = to_device(
    load_federated(
      DataConfig(
        dataset='cifar10',
        partition='dirichlet',
        alpha=cfg.alpha_dirichlet,
        num_clients=S.num_clients,
        max_examples=600 * S.num_clients,
        test_fraction=1 / 6,
        seed=cfg.seed,
        data_dir=cfg.data_dir,
      )
    )
  )
  print(data.describe())
  targets = [float(t) for t in cfg.targets]
  rows, all_histories = {}, {}
  for name in cfg.methods:
    histories, secs = run_one(
      r, name, data, {**shared, **own.get(name, {})}, S.rounds, cfg.eval_every
    )
    all_histories[name] = histories
    agg = reporting.trials_summary(histories, cfg.stat_window)
    best = [
      max(
        (
          r['accuracy_mean']
          for r in h
          if 'accuracy_mean' in r and not r.get('diverged')
        ),
        default=float('nan'),
      )
      for h in histories
    ]
    rows[name] = {
      'rounds_to_target': {t: to_target(histories, t) for t in targets},
      'summary': agg,
      'best_mean': sum(best) / len(best),
      'seconds_per_trial': secs,
      'curves': curves(histories),
    }
    print(
      f'{name}: mean@last{cfg.stat_window} '
      f'{reproduce.cell(agg, "accuracy_mean_window")}, '
      f'{secs:.0f} s per trial',
      flush=True,
    )
  print(
    f'\nTable 1: CIFAR-10, {S.num_clients} devices, p = {S.participation}, '
    f'Dirichlet {cfg.alpha_dirichlet}, {S.model}: rounds to mean test accuracy'
  )
  print(
    f'(rounds: mean over {cfg.num_trials} trials; accuracy: mean ± std over '
    f'trials of '
    f'the mean '
    f'over the last {cfg.stat_window} evaluations)'
  )
  print(
    f'{"method":<10}'
    + ''.join(f'{"@" + str(int(100 * t)) + "%":>8}' for t in targets)
    + f'{"mean@last":>14}{"best":>8}'
  )
  for name, r in rows.items():
    print(
      f'{name:<10}'
      + ''.join(
        f'{fmt_rounds(r["rounds_to_target"][t], S.rounds):>8}' for t in targets
      )
      + f'{reproduce.cell(r["summary"], "accuracy_mean_window"):>14}'
      + f'{100 * r["best_mean"]:>7.1f}%'
    )
  print(
    'wrote',
    reporting.plot_trials(
      all_histories, os.path.join(directory, f'table1_{cfg.scale}_curves')
    ),
  )
  md = reproduce.markdown_table(
    ['method']
    + [f'rounds to {100 * t:.0f}%' for t in targets]
    + ['mean acc. (last evals)', 'best mean acc. (mean over trials)'],
    [
      [n]
      + [fr(r['rounds_to_target'][t], S.rounds) for t in targets]
      + [
        reproduce.cell(r['summary'], 'accuracy_mean_window'),
        f'{100 * r["best_mean"]:.1f}',
      ]
      for n, r in rows.items()
    ],
  )
  return rows, md


def table_two(r: TableRun, shared):
  cfg, S = r.cfg, r.sizes
  """Personalized FedDyn on sparse classes (the slides' table 2); returns (rows,
  Markdown)."""
  ptargets = [float(t) for t in cfg.personal_targets]
  rows2 = {}
  for partition in ('sparse_classes', 'sparse_classes_permuted'):
    pdata = to_device(
      load_federated(
        DataConfig(
          dataset='cifar10',
          partition=partition,
          classes_per_client=5,
          num_clients=S.num_clients,
          examples_per_client=600,
          test_fraction=1 / 6,
          seed=cfg.seed,
          data_dir=cfg.data_dir,
        )
      )
    )
    for name in cfg.personal_methods:
      settings = {
        **shared,
        'local_epochs': 1,
        'local_steps': cfg.personal_local_steps,
        'alpha': 1e-1 if name == 'pfeddyn_proto' else 1e-2,
        **clipping(cfg),
      }
      histories, secs = run_one(
        r, name, pdata, settings, S.personal_rounds, cfg.personal_eval_every
      )
      agg = reporting.trials_summary(histories, cfg.stat_window)
      rows2[(partition, name)] = {
        'APL': reproduce.cell(agg, 'accuracy_mean_window'),
        'LPL': reproduce.cell(agg, 'accuracy_worst_window'),
        'summary': agg,
        'rounds_to_target': {t: to_target(histories, t) for t in ptargets},
        'seconds_per_trial': secs,
        'curves': curves(histories, ('accuracy_mean', 'accuracy_worst')),
      }
      print(
        f'{partition} {name}: APL {rows2[(partition, name)]["APL"]} '
        f'LPL {rows2[(partition, name)]["LPL"]}, {secs:.0f} s per trial',
        flush=True,
      )
  print(
    f'\nTable 2: CIFAR-10 sparse classes (5 per device), {S.num_clients} '
    f'devices, '
    f'{S.personal_rounds} rounds: average / lowest per-device accuracy'
  )
  print(
    f'{"partition":<26}{"method":<15}{"APL":>14}{"LPL":>14}'
    + ''.join(f'{"@" + str(int(100 * t)) + "%":>8}' for t in ptargets)
  )
  for (partition, name), r in rows2.items():
    print(
      f'{partition:<26}{name:<15}{r["APL"]:>14}{r["LPL"]:>14}'
      + ''.join(
        f'{fmt_rounds(r["rounds_to_target"][t], S.personal_rounds):>8}'
        for t in ptargets
      )
    )
  md = reproduce.markdown_table(
    ['partition', 'method', 'APL', 'LPL']
    + [f'rounds to {100 * t:.0f}%' for t in ptargets],
    [
      [p, n, r['APL'], r['LPL']]
      + [fr(r['rounds_to_target'][t], S.personal_rounds) for t in ptargets]
      for (p, n), r in rows2.items()
    ],
  )
  return {f'{k[0]}/{k[1]}': v for k, v in rows2.items()}, md


if __name__ == '__main__':
  script_entry.run_script(
    main,
    kept='the trials finished so far are kept under <output_dir>/trials; '
    'the same command continues from them',
    settings=DebiasingTables,
  )
