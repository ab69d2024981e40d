#!/usr/bin/env python
"""FedFomo's Table 1 (pathological non-IID) and its DP-SGD table (Table 3).

Seed: "Personalized Federated Learning with First Order Model Optimization" (FedFomo), arXiv 2012.08565.

Table 1: every client holds 2 of the 10 classes (McMahan et al.'s shards);
two federations, 15 clients all active for 20 rounds and 100 clients with 10%
active for 100 rounds; E = 5 local epochs of B = 50, SGD without momentum,
weight decay 1e-4, learning rate 0.01 on MNIST and 0.1 on CIFAR-10, times
0.99 every round; mean test accuracy of the model each client uses. Methods:
Local, FedAvg, FedProx, LG-FedAvg, Per-FedAvg (first order, as the pFedMe
code the paper used), pFedMe, CFL, FedFomo with M = 5 and M = 10 downloads
(eps 0.3 decaying 0.05 per round). Every client splits its training data
80/20 into train and validation (FedFomo's split); the same split is used by
every method so they see the same data (the paper's baselines may have
trained on all of it).

Table 3 (DP): 15 clients in 5 latent distributions (k-means on a centrally
trained LeNet-5's features, the paper's recipe; --dp_latent_features=pixels
clusters the pixels, which gives clients with all 10 classes, benchmarks/reproductions/README.md),
all active, CIFAR-10; FedAvg and FedFomo with DP-SGD local training at noise
multipliers sigma = 0, 1, 2 (clip norm 1; sigma = 0 is plain SGD, as the
paper's baselines), epsilon at delta = 1e-5 from the RDP accountant on each
client's steps (the worst client's).

``--scale=cpu`` (3 trials): the embedded MNIST 10k with the MLP (200, 200) and
CIFAR-10 reduced to 600 images per client (15 clients) and 100 (100 clients)
with LeNet-5; the DP table with 600 CIFAR-10 images per client. ``--scale=paper``
(5 trials; the paper: 3): all of MNIST through TFDS and all of CIFAR-10
with the model of FedFomo's code (its default ``--arch``, the TensorFlow
tutorial CNN: ``fedfomo_cnn``) and PyTorch's initialisation (the paper's
text names McMahan et al.'s CNN; its code trains this one). Rounds, epochs
and learning rates are the paper's at both scales.

  python scripts/reproduce_fedfomo.py                      # Table 1 and the DP table
  python scripts/reproduce_fedfomo.py --tables=1 --datasets=mnist --settings=15
"""

import dataclasses
import types
from typing import Optional, Tuple

import numpy as np

from fedjax_personal import algorithms
from fedjax_personal.core import privacy
from fedjax_personal.core.data import to_device
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.core.executor_choice import create_executor
from fedjax_personal.core.sampling import CohortSampler
from fedjax_personal.datasets import LATENT_FEATURES, DataConfig, load_federated
from fedjax_personal.errors import ConfigError
from fedjax_personal.hparams import hparam
from fedjax_personal.models import create_model
from fedjax_personal.run import reporting, reproduce, script_entry

METHODS = {
  'local': ('local', {}),
  'fedavg': ('fedavg', {}),
  'fedprox': ('fedprox', dict(mu=0.01)),
  'lg_fedavg': ('lg_fedavg', {}),
  'perfedavg': ('perfedavg_fo', {}),
  'pfedme': ('pfedme', {}),
  'cfl': ('cfl', dict(ratio=0.5, eps2=0.0, warmup_rounds=5)),
  'fedfomo_m5': ('fedfomo', dict(candidates=5)),
  'fedfomo_m10': ('fedfomo', dict(candidates=10)),
  # Not in the paper: exploration kept at eps = 0.3 (no decay), the study of why
  # few downloads get a positive weight with 10% participation
  # (benchmarks/reproductions/README.md).
  'fedfomo_m10_explore': ('fedfomo', dict(candidates=10, eps_decay=0.0)),
}
DP_METHODS = ('fedavg', 'fedfomo', 'local')
SETTINGS = {'15': '15 clients, 100%', '100': '100 clients, 10%'}
DATASETS = ('mnist', 'cifar10')
# Table 1 of the paper (mean accuracy, %): MNIST 15, 100; CIFAR-10 15, 100
PAPER = {
  'local': (99.62, 94.25, 92.73, 85.42),
  'fedavg': (91.97, 78.83, 57.12, 53.08),
  'fedprox': (90.94, 79.06, 54.60, 52.92),
  'lg_fedavg': (99.79, 84.17, 92.36, 84.17),
  'perfedavg': (92.39, 85.32, 81.96, 72.40),
  'pfedme': (97.70, 88.40, 83.85, 71.75),
  'cfl': (95.00, 92.26, 85.07, 77.75),
  'fedfomo_m5': (99.62, 98.81, 93.01, 92.10),
  'fedfomo_m10': (99.63, 98.71, 92.73, 92.67),
}


@dataclasses.dataclass(frozen=True)
class FedFomoTables(reproduce.ReproduceSettings):
  """The script's settings (its flags)."""

  mnist_model: Optional[str] = reproduce.model_field("MNIST's model")
  cifar_model: Optional[str] = reproduce.model_field("CIFAR-10's model")
  model_init: Optional[str] = reproduce.model_init_field()
  tables: Tuple[str, ...] = hparam(
    ('1', 'dp'), 'Tables: 1 (pathological non-IID), dp (DP-SGD).'
  )
  datasets: Tuple[str, ...] = hparam(DATASETS, "Table 1's data sets.")
  settings: Tuple[str, ...] = hparam(
    tuple(SETTINGS),
    "Table 1's federations: 15 (all active, "
    '20 rounds), 100 (10% active, 100 rounds).',
  )
  methods: Tuple[str, ...] = hparam(
    tuple(m for m in METHODS if m in PAPER),
    "Table 1's methods (also fedfomo_m10_explore: M = 10 without eps decay).",
  )
  dp_sigmas: Tuple[str, ...] = hparam(
    ('0', '1', '2'),
    'DP table: noise multipliers of FedAvg and FedFomo (0: plain SGD).',
  )
  dp_methods: Tuple[str, ...] = hparam(
    ('fedavg', 'fedfomo'),
    'DP table: methods (fedavg, '
    'fedfomo; local: no DP-SGD, one reference row at sigma '
    '0).',
  )
  dp_latent_features: str = hparam(
    'embedding',
    'DP table: what the 5 latent distributions '
    "cluster: 'embedding' (a centrally trained LeNet-5's "
    "penultimate layer, the paper's recipe with a smaller "
    "network) or 'pixels'.",
  )
  dp_clip_norm: float = hparam(1.0, 'DP table: per-example clip norm.')
  dp_delta: float = hparam(1e-5, 'DP table: delta of the reported epsilon.')
  cifar_per_client: Optional[int] = hparam(
    None,
    'CIFAR-10 images per client with 15 clients '
    '(cpu 600; paper all, 4,000); 100 clients get 1/6 of '
    'it.',
    minimum=10,
  )
  local_epochs: int = hparam(5, 'E.', minimum=1)
  rounds_15: int = hparam(20, 'Rounds of the 15-client federation.', minimum=1)
  rounds_100: int = hparam(
    100, 'Rounds of the 100-client federation.', minimum=1
  )
  eval_every_100: int = hparam(
    4,
    'Evaluation period of the 100-client federation (the '
    '15-client one is evaluated every round).',
    minimum=1,
  )

  @property
  def sigmas(self):
    """--dp_sigmas as numbers."""
    return [float(v) for v in self.dp_sigmas]

  def check(self) -> None:
    for name, values, allowed in (
      ('tables', self.tables, ('1', 'dp')),
      ('datasets', self.datasets, DATASETS),
      ('settings', self.settings, tuple(SETTINGS)),
      ('methods', self.methods, tuple(METHODS)),
      ('dp_methods', self.dp_methods, DP_METHODS),
      ('dp_latent_features', [self.dp_latent_features], LATENT_FEATURES),
    ):
      for v in values:
        if v not in allowed:
          raise ConfigError(
            name, f'unknown value {v!r}; choose from {list(allowed)}'
          )
    try:
      sigmas = self.sigmas
    except ValueError:
      raise ConfigError(
        'dp_sigmas', f'not numbers: {list(self.dp_sigmas)}'
      ) from None
    if any(v < 0 for v in sigmas):
      raise ConfigError('dp_sigmas', 'noise multipliers must be >= 0')
    # when not given
    default = {f.name: f.default for f in dataclasses.fields(self)}
    for name in (
      'datasets',
      'settings',
      'methods',
      'rounds_100',
      'eval_every_100',
    ):
      if getattr(self, name) != default[name] and '1' not in self.tables:
        raise ConfigError(name, 'applies to table 1; add 1 to --tables')
    if 'local' in self.dp_methods and not any(v == 0 for v in sigmas):
      raise ConfigError(
        'dp_methods', 'local runs without DP-SGD; add 0 to --dp_sigmas'
      )
    for name in (
      'dp_sigmas',
      'dp_clip_norm',
      'dp_delta',
      'dp_methods',
      'dp_latent_features',
    ):
      if getattr(self, name) != default[name] and 'dp' not in self.tables:
        raise ConfigError(name, 'applies to the DP table; add dp to --tables')


script_entry.define_settings_flags(FedFomoTables)


def sizes(cfg):
  return types.SimpleNamespace(
    mnist=cfg.scaled(None, 'mnist', 'tfds:mnist'),
    mnist_model=cfg.scaled(cfg.mnist_model, 'mlp', 'fedfomo_cnn'),
    cifar_model=cfg.scaled(cfg.cifar_model, 'lenet5', 'fedfomo_cnn'),
    model_init=cfg.scaled(cfg.model_init, 'flax', 'pytorch'),
    cifar_per_client=cfg.scaled(cfg.cifar_per_client, 600, None),
  )


def training(cfg, dataset: str) -> dict:
  """The paper's optimizer (appendix A.5)."""
  return dict(
    client_lr=0.01 if dataset != 'cifar10' else 0.1,
    client_lr_decay=0.99,
    client_weight_decay=1e-4,
    batch_size=50,
    local_epochs=cfg.local_epochs,
  )


def load(
  cfg,
  S,
  dataset: str,
  setting: str,
  partition: str = 'pathological',
  latent_features: str = 'pixels',
):
  n = int(setting)
  cifar = dataset == 'cifar10'
  per = S.cifar_per_client and (
    S.cifar_per_client if n == 15 else max(S.cifar_per_client // 6, 10)
  )
  data = to_device(
    load_federated(
      DataConfig(
        dataset='cifar10' if cifar else S.mnist,
        partition=partition,
        classes_per_client=2,
        num_groups=5,
        latent_features=latent_features,
        num_clients=n,
        test_fraction=0.2,
        val_fraction=0.2,
        max_examples=per * n if (cifar and per) else None,
        seed=cfg.seed,
        data_dir=cfg.data_dir,
      )
    )
  )
  print(f'{data.describe()}, label skew {data.label_skew():.2f}', flush=True)
  model = create_model(
    S.cifar_model if cifar else S.mnist_model,
    data.num_classes,
    data.train.x[0, :1],
    init=S.model_init,
  )
  return data, model


def run_cell(cfg, directory, name, opts, data, model, dataset, setting):
  n = int(setting)
  settings = training(cfg, dataset)
  if name.startswith('perfedavg'):
    # Per-FedAvg takes steps of 3 batches each: E epochs' worth of batches.
    per_client = float(np.median(np.asarray(data.train.num_examples)))
    settings['local_steps'] = max(
      1, round(settings.pop('local_epochs') * per_client / (3 * 50))
    )
  alg = algorithms.build(name, model, data, **settings, **opts)
  callbacks = (
    []
    if alg.privacy is None
    else [reporting.PrivacyRecorder(alg.privacy, cfg.dp_delta)]
  )
  sampler = CohortSampler(n, cohort_size=n if n == 15 else n // 10)
  runner = RoundRunner(
    alg, data, sampler, create_executor('auto', model, data.train.x[0, :1])
  )
  rounds = cfg.rounds_15 if n == 15 else cfg.rounds_100
  every = 1 if n == 15 else cfg.eval_every_100
  histories, secs = reproduce.run_trials(
    runner,
    rounds,
    cfg.seed,
    cfg.num_trials,
    every,
    callbacks,
    cell={'algorithm': name, 'settings': settings, 'options': opts},
    reuse=cfg.reuse_trials,
    directory=directory,
  )
  agg = reporting.trials_summary(histories, cfg.stat_window)
  out = {
    'mean': reproduce.cell(agg, 'accuracy_mean_window'),
    'summary': agg,
    'seconds_per_trial': secs,
    'epsilon': agg.get('dp_epsilon'),
  }
  shares = [
    r['fomo_positive_share']
    for h in histories
    for r in h
    if 'fomo_positive_share' in r
  ]
  # FedFomo: share of downloaded models given a positive weight, over rounds
  if shares:
    out['positive_share'] = float(np.mean(shares))
  in_group = [
    (r['fomo_in_group_share'], r['fomo_in_group_chance'])
    for h in histories
    for r in h
    if r.get('fomo_positive_share', 0) > 0 and 'fomo_in_group_share' in r
  ]
  # known groups: share of the positive weight inside the client's own group
  if in_group:
    out['in_group_share'], out['in_group_chance'] = map(
      float, np.mean(in_group, axis=0)
    )
  return out


def table_one(cfg, S, directory):
  results = {}
  for dataset in cfg.datasets:
    for setting in cfg.settings:
      data, model = load(cfg, S, dataset, setting)
      for m in cfg.methods:
        name, opts = METHODS[m]
        r = run_cell(cfg, directory, name, opts, data, model, dataset, setting)
        results[f'{dataset}/{setting}/{m}'] = r
        share = (
          f', {100 * r["positive_share"]:.1f}% of downloads weighted > 0'
          if 'positive_share' in r
          else ''
        )
        print(
          f'  {dataset} {SETTINGS[setting]} {m}: {r["mean"]} '
          f'({r["seconds_per_trial"]:.0f} s/trial{share})',
          flush=True,
        )
  cols = [(d, s) for d in cfg.datasets for s in cfg.settings]
  paper_col = {
    ('mnist', '15'): 0,
    ('mnist', '100'): 1,
    ('cifar10', '15'): 2,
    ('cifar10', '100'): 3,
  }
  header = ['method'] + [f'{d} {SETTINGS[s]} (paper)' for d, s in cols]
  paper = lambda m, c: f'{PAPER[m][paper_col[c]]:.1f}' if m in PAPER else '-'
  rows = [
    [m]
    + [
      f'{results[f"{d}/{s}/{m}"]["mean"]} ({paper(m, (d, s))})' for d, s in cols
    ]
    for m in cfg.methods
  ]
  return results, reproduce.markdown_table(header, rows)


def table_dp(cfg, S, directory):
  sigmas = cfg.sigmas
  data, model = load(
    cfg,
    S,
    'cifar10',
    '15',
    partition='latent_clusters',
    latent_features=cfg.dp_latent_features,
  )
  results, rows = {'label_skew': data.label_skew()}, []
  runs = [
    (name, s)
    for name in cfg.dp_methods
    for s in sigmas
    if name != 'local' or s == 0
  ]
  for name, sigma in runs:
    opts = dict(candidates=5) if name == 'fedfomo' else {}
    if sigma > 0:
      opts.update(dp_clip_norm=cfg.dp_clip_norm, dp_noise_multiplier=sigma)
    r = run_cell(cfg, directory, name, opts, data, model, 'cifar10', '15')
    eps = r['epsilon']  # None without DP-SGD: epsilon is infinite
    key = f'{name}/sigma={sigma:g}'
    results[key] = r
    eps_txt = privacy.epsilon_text(eps)
    rows.append([name, f'{cfg.dp_delta:g}', f'{sigma:g}', eps_txt, r['mean']])
    diag = (
      f', {100 * r["positive_share"]:.1f}% of downloads weighted > 0'
      if 'positive_share' in r
      else ''
    ) + (
      f', {100 * r["in_group_share"]:.0f}% of that weight in the own latent '
      f'distribution (chance {100 * r["in_group_chance"]:.0f}%)'
      if 'in_group_share' in r
      else ''
    )
    print(
      f'  DP {key}: {r["mean"]}, epsilon {eps_txt} '
      f'({r["seconds_per_trial"]:.0f} s/trial'
      f'{diag})',
      flush=True,
    )
  header = ['method', 'delta', 'sigma', 'epsilon', 'accuracy']
  return results, reproduce.markdown_table(header, rows)


def main(cfg: FedFomoTables):
  S = sizes(cfg)
  if cfg.show_dry_run(vars(S)):
    return
  directory = cfg.results_dir('reproduce_fedfomo')
  results, parts = {}, []
  if '1' in cfg.tables:
    results['table1'], md = table_one(cfg, S, directory)
    parts.append(
      f'Table 1 (pathological non-IID, 2 classes per client): mean test '
      f'accuracy (%), '
      f'paper in parentheses\n\n{md}'
    )
  if 'dp' in cfg.tables:
    results['dp'], md = table_dp(cfg, S, directory)
    parts.append(
      f'DP table (CIFAR-10, 15 clients in 5 latent distributions of the '
      f'{cfg.dp_latent_features}, label skew '
      f'{results["dp"]["label_skew"]:.2f}, '
      f'all active)\n\n{md}'
    )
  title = (
    f'FedFomo, scale {cfg.scale}: E = {cfg.local_epochs}, B = 50, mean ± std '
    f'over '
    f'{cfg.num_trials} trials of the mean over the last {cfg.stat_window} '
    f'evaluations'
  )
  text = '\n\n'.join(parts)
  print(f'\n{title}\n\n{text}')
  print(
    'wrote',
    *reproduce.write_results(cfg, directory, 'tables', title, text, results),
  )


if __name__ == '__main__':
  script_entry.run_script(
    main,
    kept='the trials finished so far are kept under <output_dir>/trials; '
    'the same command continues from them',
    settings=FedFomoTables,
  )
