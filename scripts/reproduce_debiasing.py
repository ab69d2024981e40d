#!/usr/bin/env python
"""Reproduces the shape of the debiasing slides' tables on CIFAR-10 (scaled).

Seed: ../shared/seeds/feddyn-debiasing-customizing-fl-to-the-edge-slides.txt.

Table 1 ("communication rounds" to a target accuracy): FedDyn, SCAFFOLD, FedAvg
and FedProx, non-IID (Dirichlet) devices sampled independently with
probability p each round; the server model is evaluated on every device's test
split after every round.

Table 2 (personalization): personalized FedDyn with fine-tuning, MAML and
prototype heads on sparse classes (device i holds classes {(i + j) mod 10 :
j < 5}), with and without a per-device permutation of class indices; average
and lowest per-device accuracy (APL / LPL) and rounds to a target.

``--scale=cpu`` (about 25 minutes on 2 cores with 3 trials): 20 devices of
500 train / 100 test CIFAR-10 images, p = 0.25, LeNet-5 on 32x32x3 inputs,
B = 50; table 1: E = 1 local epoch, 60 rounds, evaluated every round; table 2:
K = 5 local steps, 40 rounds, evaluated every 4 rounds (so its rounds-to-target
are multiples of 4). ``--scale=paper`` (the slides): 100 devices (600 images
each, all of CIFAR-10), 10% active, the 2-conv-2-fc CNN (``cnn_cifar``), 1,000
rounds for table 1 and 500 for table 2, 5 trials. Size flags override either.
Results: ``<output_dir>/tables_<scale>.{json,md}``.

  python scripts/reproduce_debiasing.py
  python scripts/reproduce_debiasing.py --scale=paper
"""

import types

from absl import app
from absl import flags

from fedjax_personal import algorithms, experiment, reporting, reproduce
from fedjax_personal.data import to_device
from fedjax_personal.datasets import DataConfig, load_federated
from fedjax_personal.engine import RoundRunner
from fedjax_personal.executors import create_executor
from fedjax_personal.models import create_model
from fedjax_personal.sampling import CohortSampler

reproduce.define_flags()
flags.DEFINE_integer('num_clients', None, 'Devices (cpu 20, paper 100).', lower_bound=2)
flags.DEFINE_float('participation', None, 'Probability a device is active in a round (cpu 0.25, '
                   'paper 0.1).', lower_bound=0, upper_bound=1)
flags.DEFINE_integer('rounds', None, 'Rounds for table 1 (cpu 60, paper 1000).', lower_bound=1)
flags.DEFINE_integer('personal_rounds', None, 'Rounds for table 2 (cpu 40, paper 500).',
                     lower_bound=1)
flags.DEFINE_string('model', None, 'Model (cpu lenet5; paper cnn_cifar, the slides\' 2-conv-2-fc).')
flags.DEFINE_float('alpha_dirichlet', 0.3, 'Label skew of table 1.')
flags.DEFINE_list('targets', ['0.35', '0.40', '0.45'], 'Target mean accuracies of table 1.')
flags.DEFINE_list('personal_targets', ['0.60', '0.70'], 'Target mean accuracies of table 2.')
flags.DEFINE_float('client_lr', 0.05, 'Client learning rate.')
flags.DEFINE_integer('personal_local_steps', 5, 'Local steps per round in table 2.')
flags.DEFINE_integer('personal_eval_every', 4, 'Evaluation period of table 2 (MAML evaluation '
                     'adapts on 500 images per device: about 14 s per evaluation here).')
FLAGS = flags.FLAGS


S = None  # the sizes of this run: the flags, or the scale's values


def sizes():
  return types.SimpleNamespace(
      num_clients=reproduce.scaled(FLAGS.num_clients, 20, 100),
      participation=reproduce.scaled(FLAGS.participation, 0.25, 0.1),
      rounds=reproduce.scaled(FLAGS.rounds, 60, 1000),
      personal_rounds=reproduce.scaled(FLAGS.personal_rounds, 40, 500),
      model=reproduce.scaled(FLAGS.model, 'lenet5', 'cnn_cifar'))


def run_one(name, data, settings, rounds, eval_every=1):
  model = create_model(S.model, data.num_classes, data.train.x[0, :1])
  alg = algorithms.build(name, model, data, **settings)
  runner = RoundRunner(alg, data, CohortSampler(data.num_clients, participation=S.participation),
                       create_executor('auto', model, data.train.x[0, :1]))
  return reproduce.run_trials(runner, rounds, FLAGS.seed, reproduce.trials(), eval_every)


def to_target(histories, target):
  """Mean over trials of the rounds to reach ``target`` (None unless every
  trial reached it)."""
  got = [experiment.rounds_to_target(h, target) for h in histories]
  return None if None in got else sum(got) / len(got)


def fmt_rounds(r, rounds):
  return f'{r:>6.1f}' if r is not None else f'>{rounds:>5}'


def main(argv):
  del argv
  global S
  S = sizes()
  if reproduce.dry_run(vars(S)):
    return
  directory = reproduce.output_dir('reproduce_debiasing')
  results = {}
  n_total = 600 * S.num_clients
  # The authors' code: SGD with weight decay 1e-3 for every method.
  shared = dict(client_lr=FLAGS.client_lr, batch_size=50, local_epochs=1,
                client_weight_decay=1e-3)
  own = {'fedprox': dict(mu=0.01), 'feddyn': dict(alpha=1e-2)}
  # -- Table 1 -----------------------------------------------------------------
  data = to_device(load_federated(DataConfig(
      dataset='cifar10', partition='dirichlet', alpha=FLAGS.alpha_dirichlet,
      num_clients=S.num_clients, max_examples=n_total, test_fraction=1 / 6,
      seed=FLAGS.seed, data_dir=FLAGS.data_dir)))
  print(data.describe())
  targets = [float(t) for t in FLAGS.targets]
  rows = {}
  for name in ('feddyn', 'scaffold', 'fedavg', 'fedprox'):
    histories, secs = run_one(name, data, {**shared, **own.get(name, {})}, S.rounds)
    agg = reporting.trials_summary(histories, FLAGS.stat_window)
    best = [max(r['accuracy_mean'] for r in h if 'accuracy_mean' in r) for h in histories]
    rows[name] = {'rounds_to_target': {t: to_target(histories, t) for t in targets},
                  'summary': agg, 'best_mean': sum(best) / len(best), 'seconds_per_trial': secs}
    print(f'{name}: mean@last{FLAGS.stat_window} {reporting.pm(agg, "accuracy_mean_window")}, '
          f'{secs:.0f} s per trial', flush=True)
  results['table1'] = rows
  print(f'\nTable 1: CIFAR-10, {S.num_clients} devices, p = {S.participation}, '
        f'Dirichlet {FLAGS.alpha_dirichlet}, {S.model}: rounds to mean test accuracy')
  print(f'(rounds: mean over {reproduce.trials()} trials; accuracy: mean ± std over trials of the mean '
        f'over the last {FLAGS.stat_window} evaluations)')
  print(f"{'method':<10}" + ''.join(f'{"@" + str(int(100 * t)) + "%":>8}' for t in targets)
        + f"{'mean@last':>14}{'best':>8}")
  for name, r in rows.items():
    print(f'{name:<10}' + ''.join(f'{fmt_rounds(r["rounds_to_target"][t], S.rounds):>8}'
                                  for t in targets)
          + f'{reporting.pm(r["summary"], "accuracy_mean_window"):>14}{100 * r["best_mean"]:>7.1f}%')
  # -- Table 2 -----------------------------------------------------------------
  ptargets = [float(t) for t in FLAGS.personal_targets]
  rows2 = {}
  for partition in ('sparse_classes', 'sparse_classes_permuted'):
    pdata = to_device(load_federated(DataConfig(
        dataset='cifar10', partition=partition, classes_per_client=5,
        num_clients=S.num_clients, examples_per_client=600, test_fraction=1 / 6,
        seed=FLAGS.seed, data_dir=FLAGS.data_dir)))
    for name in ('pfeddyn_ft', 'pfeddyn_maml', 'pfeddyn_proto'):
      settings = {**shared, 'local_epochs': 1, 'local_steps': FLAGS.personal_local_steps,
                  'alpha': 1e-1 if name == 'pfeddyn_proto' else 1e-2}
      histories, secs = run_one(name, pdata, settings, S.personal_rounds,
                                FLAGS.personal_eval_every)
      agg = reporting.trials_summary(histories, FLAGS.stat_window)
      rows2[(partition, name)] = {
          'APL': reporting.pm(agg, 'accuracy_mean_window'),
          'LPL': reporting.pm(agg, 'accuracy_worst_window'), 'summary': agg,
          'rounds_to_target': {t: to_target(histories, t) for t in ptargets},
          'seconds_per_trial': secs}
      print(f'{partition} {name}: APL {rows2[(partition, name)]["APL"]} '
            f'LPL {rows2[(partition, name)]["LPL"]}, {secs:.0f} s per trial', flush=True)
  results['table2'] = {f'{k[0]}/{k[1]}': v for k, v in rows2.items()}
  print(f'\nTable 2: CIFAR-10 sparse classes (5 per device), {S.num_clients} devices, '
        f'{S.personal_rounds} rounds: average / lowest per-device accuracy')
  print(f"{'partition':<26}{'method':<15}{'APL':>14}{'LPL':>14}"
        + ''.join(f'{"@" + str(int(100 * t)) + "%":>8}' for t in ptargets))
  for (partition, name), r in rows2.items():
    print(f'{partition:<26}{name:<15}{r["APL"]:>14}{r["LPL"]:>14}'
          + ''.join(f'{fmt_rounds(r["rounds_to_target"][t], S.personal_rounds):>8}'
                    for t in ptargets))
  fr = lambda r, n: 'not reached' if r is None else f'{r:.1f}'
  md1 = reproduce.markdown_table(
      ['method'] + [f'rounds to {100 * t:.0f}%' for t in targets] + ['mean acc. (last evals)'],
      [[n] + [fr(r['rounds_to_target'][t], S.rounds) for t in targets]
       + [reporting.pm(r['summary'], 'accuracy_mean_window')] for n, r in rows.items()])
  md2 = reproduce.markdown_table(
      ['partition', 'method', 'APL', 'LPL'] + [f'rounds to {100 * t:.0f}%' for t in ptargets],
      [[p, n, r['APL'], r['LPL']] + [fr(r['rounds_to_target'][t], S.personal_rounds)
                                     for t in ptargets] for (p, n), r in rows2.items()])
  title = (f'Debiasing slides, scale {FLAGS.scale}: CIFAR-10, {S.num_clients} devices, '
           f'p = {S.participation}, {S.model}; table 1 {S.rounds} rounds (Dirichlet '
           f'{FLAGS.alpha_dirichlet}), table 2 {S.personal_rounds} rounds (sparse classes); '
           f'mean ± std over {reproduce.trials()} trials of the mean over the last '
           f'{FLAGS.stat_window} evaluations; rounds to target: mean over trials')
  print('wrote', *reproduce.write_results(directory, 'tables', title,
                                          f'Table 1\n\n{md1}\n\nTable 2\n\n{md2}', results))


if __name__ == '__main__':
  app.run(main)
