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

Scaled to a 2-core CPU (the slides: 100 devices, 10% active, 2-conv-2-fc CNN
with 64 channels, hundreds of rounds): by default 20 devices of 500 train /
100 test CIFAR-10 images, p = 0.25, LeNet-5 on 32x32x3 inputs, B = 50; table
1: E = 1 local epoch, 60 rounds, evaluated every round; table 2: K = 5 local
steps, 40 rounds, evaluated every 4 rounds (so its rounds-to-target are
multiples of 4). It runs in about 25 minutes; pass larger values to get
closer to the paper.

  python scripts/reproduce_debiasing.py
  python scripts/reproduce_debiasing.py --rounds=300 --num_clients=100 --participation=0.1
"""

import json
import os
import time

from absl import app
from absl import flags

from fedjax_personal import algorithms, experiment, reporting
from fedjax_personal.data import to_device
from fedjax_personal.datasets import DataConfig, load_federated
from fedjax_personal.engine import RoundRunner
from fedjax_personal.executors import create_executor
from fedjax_personal.models import create_model
from fedjax_personal.sampling import CohortSampler

flags.DEFINE_integer('num_clients', 20, 'Devices.')
flags.DEFINE_float('participation', 0.25, 'Probability a device is active in a round.')
flags.DEFINE_integer('rounds', 60, 'Rounds for table 1.')
flags.DEFINE_integer('personal_rounds', 40, 'Rounds for table 2.')
flags.DEFINE_string('model', 'lenet5', 'Model (the slides: cnn_cifar).')
flags.DEFINE_float('alpha_dirichlet', 0.3, 'Label skew of table 1.')
flags.DEFINE_list('targets', ['0.35', '0.40', '0.45'], 'Target mean accuracies of table 1.')
flags.DEFINE_list('personal_targets', ['0.60', '0.70'], 'Target mean accuracies of table 2.')
flags.DEFINE_float('client_lr', 0.05, 'Client learning rate.')
flags.DEFINE_integer('personal_local_steps', 5, 'Local steps per round in table 2.')
flags.DEFINE_integer('personal_eval_every', 4, 'Evaluation period of table 2 (MAML evaluation '
                     'adapts on 500 images per device: about 14 s per evaluation here).')
flags.DEFINE_integer('seed', 0, 'Seed (of the partitions and of the first trial).')
flags.DEFINE_integer('trials', 3, 'Trials per row (seeds seed..seed+T-1, one partition).')
flags.DEFINE_integer('stat_window', 5, 'Stable statistics: mean over the last this many evaluations.')
flags.DEFINE_string('output_dir', 'runs/reproduce_debiasing', 'Where to write results.')
flags.DEFINE_string('data_dir', None, 'Directory with cifar10_jpeg.npz.')
FLAGS = flags.FLAGS


def run_one(name, data, settings, rounds, eval_every=1):
  model = create_model(FLAGS.model, data.num_classes, data.train.x[0, :1])
  alg = algorithms.build(name, model, data, **settings)
  runner = RoundRunner(alg, data, CohortSampler(data.num_clients, participation=FLAGS.participation),
                       create_executor('auto', model, data.train.x[0, :1]))
  start = time.perf_counter()
  histories = [experiment.run(runner, rounds, seed=FLAGS.seed + t, eval_every=eval_every)[1]
               for t in range(FLAGS.trials)]
  return histories, (time.perf_counter() - start) / FLAGS.trials


def to_target(histories, target):
  """Mean over trials of the rounds to reach ``target`` (None unless every
  trial reached it)."""
  got = [experiment.rounds_to_target(h, target) for h in histories]
  return None if None in got else sum(got) / len(got)


def fmt_rounds(r, rounds):
  return f'{r:>6.1f}' if r is not None else f'>{rounds:>5}'


def main(argv):
  del argv
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  results = {}
  n_total = 600 * FLAGS.num_clients
  # The authors' code: SGD with weight decay 1e-3 for every method.
  shared = dict(client_lr=FLAGS.client_lr, batch_size=50, local_epochs=1,
                client_weight_decay=1e-3)
  own = {'fedprox': dict(mu=0.01), 'feddyn': dict(alpha=1e-2)}
  # -- Table 1 -----------------------------------------------------------------
  data = to_device(load_federated(DataConfig(
      dataset='cifar10', partition='dirichlet', alpha=FLAGS.alpha_dirichlet,
      num_clients=FLAGS.num_clients, max_examples=n_total, test_fraction=1 / 6,
      seed=FLAGS.seed, data_dir=FLAGS.data_dir)))
  print(data.describe())
  targets = [float(t) for t in FLAGS.targets]
  rows = {}
  for name in ('feddyn', 'scaffold', 'fedavg', 'fedprox'):
    histories, secs = run_one(name, data, {**shared, **own.get(name, {})}, FLAGS.rounds)
    agg = reporting.trials_summary(histories, FLAGS.stat_window)
    best = [max(r['accuracy_mean'] for r in h if 'accuracy_mean' in r) for h in histories]
    rows[name] = {'rounds_to_target': {t: to_target(histories, t) for t in targets},
                  'summary': agg, 'best_mean': sum(best) / len(best), 'seconds_per_trial': secs}
    print(f'{name}: mean@last{FLAGS.stat_window} {reporting.pm(agg, "accuracy_mean_window")}, '
          f'{secs:.0f} s per trial', flush=True)
  results['table1'] = rows
  print(f'\nTable 1: CIFAR-10, {FLAGS.num_clients} devices, p = {FLAGS.participation}, '
        f'Dirichlet {FLAGS.alpha_dirichlet}, {FLAGS.model}: rounds to mean test accuracy')
  print(f'(rounds: mean over {FLAGS.trials} trials; accuracy: mean ± std over trials of the mean '
        f'over the last {FLAGS.stat_window} evaluations)')
  print(f"{'method':<10}" + ''.join(f'{"@" + str(int(100 * t)) + "%":>8}' for t in targets)
        + f"{'mean@last':>14}{'best':>8}")
  for name, r in rows.items():
    print(f'{name:<10}' + ''.join(f'{fmt_rounds(r["rounds_to_target"][t], FLAGS.rounds):>8}'
                                  for t in targets)
          + f'{reporting.pm(r["summary"], "accuracy_mean_window"):>14}{100 * r["best_mean"]:>7.1f}%')
  # -- Table 2 -----------------------------------------------------------------
  ptargets = [float(t) for t in FLAGS.personal_targets]
  rows2 = {}
  for partition in ('sparse_classes', 'sparse_classes_permuted'):
    pdata = to_device(load_federated(DataConfig(
        dataset='cifar10', partition=partition, classes_per_client=5,
        num_clients=FLAGS.num_clients, examples_per_client=600, test_fraction=1 / 6,
        seed=FLAGS.seed, data_dir=FLAGS.data_dir)))
    for name in ('pfeddyn_ft', 'pfeddyn_maml', 'pfeddyn_proto'):
      settings = {**shared, 'local_epochs': 1, 'local_steps': FLAGS.personal_local_steps,
                  'alpha': 1e-1 if name == 'pfeddyn_proto' else 1e-2}
      histories, secs = run_one(name, pdata, settings, FLAGS.personal_rounds,
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
  print(f'\nTable 2: CIFAR-10 sparse classes (5 per device), {FLAGS.num_clients} devices, '
        f'{FLAGS.personal_rounds} rounds: average / lowest per-device accuracy')
  print(f"{'partition':<26}{'method':<15}{'APL':>14}{'LPL':>14}"
        + ''.join(f'{"@" + str(int(100 * t)) + "%":>8}' for t in ptargets))
  for (partition, name), r in rows2.items():
    print(f'{partition:<26}{name:<15}{r["APL"]:>14}{r["LPL"]:>14}'
          + ''.join(f'{fmt_rounds(r["rounds_to_target"][t], FLAGS.personal_rounds):>8}'
                    for t in ptargets))
  with open(os.path.join(FLAGS.output_dir, 'results.json'), 'w') as f:
    json.dump(results, f, indent=1, default=str)


if __name__ == '__main__':
  app.run(main)
