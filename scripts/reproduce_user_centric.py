#!/usr/bin/env python
"""The user-centric FL paper's Table I and Fig. 3, and a study of its settings.

Seeds: "User-Centric Federated Learning" (Mestoukirdi et al., arXiv 2110.09869), and
FedFomo's ("Personalized Federated Learning with First Order Model Optimization",
arXiv 2012.08565) for the FedFomo baseline.

Protocol of the paper, kept at both scales: LeNet-5 (at ``--scale=paper`` the
authors' Keras LeNet-5 with average pooling and Keras' initialisation,
``usercentric_lenet5``; at ``cpu`` the library's, max pooling and Flax's
initialisation, as the tables of benchmarks/reproductions/README.md), SGD with momentum 0.9 and
each user's optimizer state kept across rounds (``client_opt_state=persistent``,
as the authors' per-user Keras optimizers), 1 local epoch of batches of 32 per
round, every user in every round, worst-user and mean test accuracy. Scenarios:

  1. label shift: 20 users, Dirichlet 0.4 over the labels of 10k digits;
  2. label + covariate shift: users in 4 groups rotated 0/90/180/270 degrees,
     Dirichlet 0.4 inside groups;
  3. concept shift: CIFAR-10 over 20 users in 4 groups, a random label
     permutation per group; at paper scale all 60,000 images, 3,000 per user:
     2,350 train, 150 validation (FedFomo's), 500 test (the paper: 2,500 per
     user); at cpu scale 1,000 per user (783 / 50 / 167).

Methods: Local, FedAvg, Oracle (one FedAvg per true group; not defined under
pure label shift), CFL (scale-free split test: mean update norm < 0.5 x the
largest, from round 5), FedFomo (M = 5), user-centric with k = 20 and k = 4
streams.

``--scale=cpu`` (3 trials; about 15 minutes per digit scenario and 90 for the
CIFAR one on 2 cores): the embedded MNIST 10k instead of EMNIST in scenarios 1
and 2, 20 users in scenario 2 (the paper: 100 users, 100k EMNIST points),
1,000 CIFAR-10 images per user (one round over 2,350 train images per user
takes 18 s here), 30 rounds, 3 trials. ``--scale=paper``: TFDS EMNIST digits (10k points / 20 users;
100k points / 100 users), 50 rounds (the paper does not state its rounds), 5
trials. Both: SGD learning rate 0.05 on digits and 0.01 on CIFAR-10 (the
paper: 0.1 everywhere; a reference run of scenario 3 at lr 0.1 does not train),
evaluation every 2 rounds, cells are mean ± std over trials of the mean over
the last ``--stat_window`` evaluations.

User-centric's own settings (sigma batch size, warm-up rounds of FedAvg before
W, W recomputation period, k) default to the flagfiles of
``scripts/configs/usercentric_scenario{1,2,3}.flags``, found by ``--study``:
a table of user-centric variants (per scenario) next to Oracle and FedAvg,
with W's diagnostics (effective neighbours per user, adjusted Rand index of
the streams against the true groups).

  python scripts/reproduce_user_centric.py                       # Table I, 3 trials
  python scripts/reproduce_user_centric.py --scenarios=3 --methods=fedavg,oracle
  python scripts/reproduce_user_centric.py --study --trials=1    # the settings study
"""

import dataclasses
import os
from typing import Optional, Tuple

import jax

from fedjax_personal import algorithms
from fedjax_personal.core.data import to_device
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.core.executor_choice import create_executor
from fedjax_personal.core.sampling import CohortSampler
from fedjax_personal.core.tree_util import tree_bytes
from fedjax_personal.datasets import DataConfig, load_federated
from fedjax_personal.errors import ConfigError
from fedjax_personal.hparams import hparam
from fedjax_personal.models import create_model
from fedjax_personal.run import reporting, reproduce, script_entry, timing

SCENARIOS = {
  '1': 'label shift',
  '2': 'label + covariate shift',
  '3': 'concept shift',
}
METHODS = (
  'local',
  'fedavg',
  'oracle',
  'cfl',
  'fedfomo',
  'usercentric_k20',
  'usercentric_k4',
)

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs')


def usercentric_settings(scen: str) -> dict:
  """User-centric's own settings for a scenario (the study's choice), read
  from the ``--usercentric_*`` lines of
  scripts/configs/usercentric_scenario<N>.flags
  (num_streams excluded: Table I's rows set k)."""
  out = {}
  with open(os.path.join(CONFIGS, f'usercentric_scenario{scen}.flags')) as f:
    for line in f:
      if line.startswith('--usercentric_') and not line.startswith(
        '--usercentric_num_streams'
      ):
        key, value = line.strip()[len('--usercentric_') :].split('=', 1)
        out[key] = int(value)
  return out


# The study: user-centric variants (k = 4 streams unless named), each with
# the settings that differ from the paper's reading (sigma from K = 2 halves
# of the local data, W once at the initial model).
STUDY = {
  'paper': ('halves, W at init', dict(sigma_batch_size=0)),
  'b32': ('sigma B32', dict(sigma_batch_size=32)),
  'wu3': ('halves, warm-up 3', dict(sigma_batch_size=0, warmup_rounds=3)),
  'b32_wu3': (
    'sigma B32, warm-up 3',
    dict(sigma_batch_size=32, warmup_rounds=3),
  ),
  'wu3_every10': (
    'halves, warm-up 3, W every 10',
    dict(sigma_batch_size=0, warmup_rounds=3, recompute_every=10),
  ),
  'b32_wu3_every10': (
    'sigma B32, warm-up 3, W every 10',
    dict(sigma_batch_size=32, warmup_rounds=3, recompute_every=10),
  ),
  'wu10': ('halves, warm-up 10', dict(sigma_batch_size=0, warmup_rounds=10)),
  'b32_wu10': (
    'sigma B32, warm-up 10',
    dict(sigma_batch_size=32, warmup_rounds=10),
  ),
  'wu3_k20': (
    'halves, warm-up 3, k=20',
    dict(sigma_batch_size=0, warmup_rounds=3, num_streams=20),
  ),
  'wu3_silhouette': (
    'halves, warm-up 3, silhouette k <= 8',
    dict(sigma_batch_size=0, warmup_rounds=3, num_streams=0, max_streams=8),
  ),
}


@dataclasses.dataclass(frozen=True)
class UserCentricTables(reproduce.ReproduceSettings):
  """The script's settings (its flags)."""

  model: Optional[str] = reproduce.model_field()
  model_init: Optional[str] = reproduce.model_init_field()
  scenarios: Tuple[str, ...] = hparam(
    ('1', '2', '3'), 'Scenarios to run (1 label, 2 covariate, 3 concept).'
  )
  methods: Tuple[str, ...] = hparam(
    (),
    'Table I methods (default all): local, fedavg, oracle, '
    'cfl, fedfomo, usercentric_k20, usercentric_k4.',
  )
  rounds: Optional[int] = hparam(
    None, "Rounds per run (default: the scale's).", minimum=1
  )
  num_clients: Optional[int] = hparam(
    None, "Users per scenario (default: the scale's).", minimum=2
  )
  examples_per_client: Optional[int] = hparam(
    None,
    "Cap on each user's examples (train + "
    'validation + test), for quick runs (default: '
    'all).',
    minimum=3,
  )
  group_base: str = hparam(
    'dirichlet',
    'Label partition inside the rotation groups of scenario '
    '2 (the paper: Dirichlet 0.4; iid isolates the covariate shift).',
    choices=('dirichlet', 'iid'),
  )
  eval_every: int = hparam(2, 'Evaluation period in rounds.', minimum=1)
  study: bool = hparam(
    False, 'Run the study of user-centric settings instead of Table I.'
  )
  study_variants: Tuple[str, ...] = hparam(
    (), "Subset of the study's variants (default all)."
  )
  study_refs: bool = hparam(
    True, "Run FedAvg and Oracle next to the study's variants."
  )

  def check(self) -> None:
    for flag, values, known in (
      ('scenarios', self.scenarios, SCENARIOS),
      ('methods', self.methods, METHODS),
      ('study_variants', self.study_variants, STUDY),
    ):
      for v in values:
        if v not in known:
          raise ConfigError(
            flag, f'unknown value {v!r}; choose from {list(known)}'
          )
    if self.group_base != 'dirichlet' and '2' not in self.scenarios:
      raise ConfigError(
        'group_base', 'applies to scenario 2 only; add 2 to --scenarios'
      )


script_entry.define_settings_flags(UserCentricTables)


def data_config(s, scen: str) -> DataConfig:
  cpu = s.scale == 'cpu'
  digits = 'mnist' if cpu else 'tfds:emnist/digits'  # TFDS's EMNIST digits
  n = s.scaled(s.num_clients, 20, 100 if scen == '2' else 20)
  per = s.examples_per_client
  common = dict(num_clients=n, seed=s.seed, data_dir=s.data_dir)
  if scen == '1':
    return DataConfig(
      dataset=digits,
      partition='dirichlet',
      alpha=0.4,
      val_fraction=0.1,
      max_examples=per * n if per else (None if cpu else 10_000),
      **common,
    )
  if scen == '2':
    return DataConfig(
      dataset=digits,
      partition='rotation',
      num_groups=4,
      group_base=s.group_base,
      alpha=0.4,
      val_fraction=0.1,
      max_examples=per * n if per else (None if cpu else 100_000),
      **common,
    )
  # 1,000 per user at cpu scale, all (3,000) at paper
  per = s.scaled(per, 1000, None)
  return DataConfig(
    dataset='cifar10',
    partition='label_permutation',
    num_groups=4,
    test_fraction=1 / 6,
    val_fraction=0.05,
    max_examples=per * n if per else None,
    **common,
  )


def training(scen: str) -> dict:
  return dict(
    client_lr=0.01 if scen == '3' else 0.05,
    client_momentum=0.9,
    client_opt_state='persistent',
    batch_size=32,
    local_epochs=1,
  )


def method_options(name: str, scen: str):
  """(registry name, own options) of a Table I method."""
  if name.startswith('usercentric'):
    return 'usercentric', dict(
      usercentric_settings(scen), num_streams=int(name.split('_k')[1])
    )
  return name, {
    'cfl': dict(ratio=0.5, eps2=0.0, warmup_rounds=5),
    'fedfomo': dict(candidates=5),
  }.get(name, {})


def run_cell(s, name, opts, data, model, scen, rounds, directory):
  alg = algorithms.build(name, model, data, **training(scen), **opts)
  runner = RoundRunner(
    alg,
    data,
    CohortSampler(data.num_clients, cohort_size=data.num_clients),
    create_executor('auto', model, data.train.x[0, :1]),
  )
  histories, seconds = reproduce.run_trials(
    runner,
    rounds,
    s.seed,
    s.num_trials,
    s.eval_every,
    cell={'algorithm': name, 'settings': training(scen), 'options': opts},
    reuse=s.reuse_trials,
    directory=directory,
  )
  agg = reporting.trials_summary(histories, s.stat_window)
  w_info = [
    {
      k: v
      for r in h
      for k, v in r.items()
      if k.startswith(('w_', 'streams_', 'num_c'))
    }
    for h in histories
  ]
  out = {
    'worst': reproduce.cell(agg, 'accuracy_worst_window'),
    'mean': reproduce.cell(agg, 'accuracy_mean_window'),
    'summary': agg,
    'seconds_per_trial': seconds,
    'w_diagnostics': w_info,
    'per_trial': [
      {
        k: reporting.final_summary(h, s.stat_window).get(k)
        for k in ('accuracy_worst_window', 'accuracy_mean_window')
      }
      for h in histories
    ],
  }
  for key in (
    'w_effective_neighbours_mean',
    'streams_ari',
    'w_in_group_share',
    'w_in_group_chance',
    'num_streams',
    'num_clusters',
  ):
    vals = [w[key] for w in w_info if key in w]
    if vals:
      out[key] = sum(vals) / len(vals)
  return out, histories


def diagnostics(r: dict) -> str:
  parts = []
  if 'w_effective_neighbours_mean' in r:
    parts.append(f'{r["w_effective_neighbours_mean"]:.1f} nbrs')
  if 'streams_ari' in r:
    parts.append(f'ARI {r["streams_ari"]:.2f}')
  if 'w_in_group_share' in r:
    parts.append(
      f'in-group {r["w_in_group_share"]:.2f} (chance '
      f'{r["w_in_group_chance"]:.2f})'
    )
  if 'num_clusters' in r:
    parts.append(f'{r["num_clusters"]:.1f} clusters')
  return ', '.join(parts) or '-'


def load(s, scen):
  data = to_device(load_federated(data_config(s, scen)))
  print(data.describe(), flush=True)
  return data, create_model(
    model_name(s), data.num_classes, data.train.x[0, :1], init=model_init(s)
  )


def model_name(s) -> str:
  """The paper's Keras LeNet-5 (average pooling) at paper scale; the library's
  LeNet-5 at cpu scale (the tables of benchmarks/reproductions/README.md)."""
  return s.scaled(s.model, 'lenet5', 'usercentric_lenet5')


def model_init(s) -> str:
  return s.scaled(s.model_init, 'flax', 'keras')


def table_one(s, directory, rounds):
  methods = s.methods or list(METHODS)
  results, curves = {}, {}
  for scen in s.scenarios:
    data, model = load(s, scen)
    for m in methods:
      if m == 'oracle' and data.num_groups == 0:
        continue
      name, opts = method_options(m, scen)
      r, histories = run_cell(
        s, name, opts, data, model, scen, rounds, directory
      )
      results[f'{scen}/{m}'] = r
      curves[(scen, m)] = histories[0]
      print(
        f'  {SCENARIOS[scen]} {m}: worst {r["worst"]} mean {r["mean"]} '
        f'({diagnostics(r)}; '
        f'{r["seconds_per_trial"]:.0f} s/trial)',
        flush=True,
      )
  header = ['scenario'] + [m for m in methods]
  rows = [
    [SCENARIOS[c]]
    + [
      f'{results[f"{c}/{m}"]["worst"]} / {results[f"{c}/{m}"]["mean"]}'
      if f'{c}/{m}' in results
      else '-'
      for m in methods
    ]
    for c in s.scenarios
  ]
  title = (
    f'User-centric Table I, worst-user / mean test accuracy (%), scale '
    f'{s.scale}: '
    f'{rounds} rounds, mean over the last {s.stat_window} evaluations, mean ± '
    f'std over '
    f'{s.num_trials} trials'
  )
  md = reproduce.markdown_table(header, rows)
  print(f'\n{title}\n{md}')
  paths = reproduce.write_results(s, directory, 'table1', title, md, results)
  print('wrote', *paths)
  if '2' in s.scenarios:
    plot_time(
      s,
      directory,
      {m: h for (s, m), h in curves.items() if s == '2'},
      model_bytes(model),
    )


def study(s, directory, rounds):
  variants = list(s.study_variants or STUDY)
  results = {}
  for scen in s.scenarios:
    data, model = load(s, scen)
    refs = (
      (['fedavg'] + (['oracle'] if data.num_groups else []))
      if s.study_refs
      else []
    )
    for m in refs:
      r, _ = run_cell(s, m, {}, data, model, scen, rounds, directory)
      results[f'{scen}/{m}'] = r
      print(
        f'  {SCENARIOS[scen]} {m}: worst {r["worst"]} mean {r["mean"]}',
        flush=True,
      )
    for v in variants:
      opts = {'num_streams': 4, **STUDY[v][1]}
      r, _ = run_cell(
        s, 'usercentric', opts, data, model, scen, rounds, directory
      )
      results[f'{scen}/{v}'] = r
      print(
        f'  {SCENARIOS[scen]} {v}: worst {r["worst"]} mean {r["mean"]} '
        f'({diagnostics(r)})',
        flush=True,
      )
  header = ['variant'] + [
    f'{SCENARIOS[c]}: worst / mean (W)' for c in s.scenarios
  ]
  rows = []
  for v in ['fedavg', 'oracle'] + variants:
    row = [f'{v}: {STUDY[v][0]}' if v in STUDY else v]
    for c in s.scenarios:
      r = results.get(f'{c}/{v}')
      row.append(
        '-'
        if r is None
        else f'{r["worst"]} / {r["mean"]}'
        + (f' ({diagnostics(r)})' if v not in ('fedavg', 'oracle') else '')
      )
    rows.append(row)
  title = (
    f'User-centric settings study (k = 4 unless named), worst-user / mean test '
    f'accuracy '
    f'(%), scale {s.scale}: {rounds} rounds, mean ± std over {s.num_trials} '
    f'trials; W: effective neighbours per user, ARI of the streams against the '
    f'groups, '
    f"share of W's off-diagonal weight inside the user's group"
  )
  md = reproduce.markdown_table(header, rows)
  print(f'\n{title}\n{md}')
  print(
    'wrote', *reproduce.write_results(s, directory, 'study', title, md, results)
  )


def model_bytes(model):
  return tree_bytes(jax.eval_shape(model.init, jax.random.key(0)))


def plot_time(s, directory, histories, per_model):
  """Accuracy against simulated time (Fig. 3) for rho = 4, 2, 1, scenario 2."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=True)
  for ax, (sys_name, tm) in zip(axes, timing.PAPER_SYSTEMS.items()):
    for label, history in histories.items():
      down = lambda r: int(
        round(r.get('bytes_down_broadcast', 0) / max(per_model, 1))
      )
      t = timing.simulated_times(history, tm, down)
      ev = [
        (ti, r['accuracy_mean'])
        for ti, r in zip(t, history)
        if 'accuracy_mean' in r
      ]
      ax.plot(
        [e[0] for e in ev], [e[1] for e in ev], marker='o', ms=3, label=label
      )
    ax.set_title(sys_name)
    ax.set_xlabel('simulated time (units of T_dl)')
    ax.grid(alpha=0.3)
  axes[0].set_ylabel('mean test accuracy')
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  path = os.path.join(directory, f'accuracy_vs_time_{s.scale}.png')
  fig.savefig(path, dpi=100)
  print('wrote', path)


def main(s: UserCentricTables):
  rounds = s.scaled(s.rounds, 30, 50)
  if s.show_dry_run(
    {
      'rounds': rounds,
      'model': model_name(s),
      'model_init': model_init(s),
      **{f'scenario {c}': data_config(s, c) for c in s.scenarios},
    }
  ):
    return
  directory = s.results_dir('reproduce_user_centric')
  (study if s.study else table_one)(s, directory, rounds)


if __name__ == '__main__':
  script_entry.run_script(
    main,
    kept='the trials finished so far are kept under <output_dir>/trials; '
    'the same command continues from them',
    settings=UserCentricTables,
  )
