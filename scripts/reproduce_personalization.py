#!/usr/bin/env python
"""Reproduces the shape of the meta-learning and partial-personalization tables.

Seeds: "Personalized Federated Learning with Theoretical Guarantees: A Model-Agnostic
Meta-Learning Approach" (Per-FedAvg, arXiv 2002.07948) and "Federated Learning with Partial
Model Personalization" (FedAlt/FedSim, arXiv 2204.03809).

Table A: Per-FedAvg (FO, HF with the exact Hessian-vector product, HF with
finite differences) vs FedAvg + fine-tuning on real MNIST digits (the embedded
10k), pathological split with 2 classes per client; evaluation after one
alpha-step (fine-tuning step) on each client's *training* data.

Tables B and C: FedAvg, FedAlt and FedSim with the input layer, the output
layer or residual adapters personal, and full personalization (Local: every
parameter personal; FedAvg + fine-tuning of the whole model), on Tiny
Shakespeare split by speaking role (next-character prediction, char LSTM) and
on CIFAR-10 (Dirichlet label skew, LeNet-5).

Every table prints the mean and 10th-percentile client accuracy.
``--scale=cpu`` (about 20 minutes on 2 cores with 3 trials: A 1 min, B 8, C
10): table A 50 clients of the embedded MNIST 10k, 60 rounds; B 10 roles, 30
rounds; C 20 clients of 300 images, 30 rounds. ``--scale=paper``: table A as
Per-FedAvg's experiments (50 users of TFDS MNIST, 1,000 rounds, our reading of
the paper); tables B and C at the largest sizes the offline data allows (the
slides' data sets, StackOverflow / EMNIST / GLDv2 with ~1K clients, are not
available): 100 roles and 100 CIFAR-10 clients, 200 rounds; 5 trials. Size
flags override either. Results: ``<output_dir>/tables_<ABC>_<scale>.{json,md}``.

  python scripts/reproduce_personalization.py
  python scripts/reproduce_personalization.py --tables=A --scale=paper
"""

import types

from absl import flags

from fedjax_personal import algorithms
from fedjax_personal.run import entry, reporting, reproduce
from fedjax_personal.core.data import to_device
from fedjax_personal.datasets import DataConfig, load_federated
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.core.executors import create_executor
from fedjax_personal.models import CharLSTM, create_model, from_flax
from fedjax_personal.core.sampling import CohortSampler

reproduce.define_flags()
flags.DEFINE_integer('mnist_clients', None, 'Table A clients (cpu and paper 50).', lower_bound=2)
flags.DEFINE_integer('mnist_rounds', None, 'Table A rounds (cpu 60, paper 1000).', lower_bound=1)
flags.DEFINE_integer('shakespeare_clients', None, 'Table B clients, speaking roles (cpu 10, '
                     'paper 100).', lower_bound=2)
flags.DEFINE_integer('shakespeare_rounds', None, 'Table B rounds (cpu 30, paper 200).',
                     lower_bound=1)
flags.DEFINE_integer('shakespeare_local_steps', 20, 'Table B local steps per round (5 leaves the '
                     'LSTM at the unigram level).')
flags.DEFINE_list('methods', [], 'Subset of tables B/C rows as method/part, e.g. '
                  'fedavg/-,fedalt/output,local/all (default: all rows).')
flags.DEFINE_integer('cifar_clients', None, 'Table C clients (cpu 20, paper 100).', lower_bound=2)
flags.DEFINE_integer('cifar_rounds', None, 'Table C rounds (cpu 30, paper 200).', lower_bound=1)
flags.DEFINE_list('tables', ['A', 'B', 'C'], 'Which tables to run.')
FLAGS = flags.FLAGS

PARTIAL = [('fedavg', None), ('fedalt', 'input'), ('fedsim', 'input'), ('fedalt', 'output'),
           ('fedsim', 'output'), ('fedalt', 'adapter'), ('fedsim', 'adapter'),
           ('local', 'all (Local)'), ('fedavg_ft', 'all (fine-tune)')]


S = None  # the sizes of this run: the flags, or the scale's values


def sizes():
  return types.SimpleNamespace(
      mnist_clients=reproduce.scaled(FLAGS.mnist_clients, 50, 50),
      mnist_rounds=reproduce.scaled(FLAGS.mnist_rounds, 60, 1000),
      shakespeare_clients=reproduce.scaled(FLAGS.shakespeare_clients, 10, 100),
      shakespeare_rounds=reproduce.scaled(FLAGS.shakespeare_rounds, 30, 200),
      cifar_clients=reproduce.scaled(FLAGS.cifar_clients, 20, 100),
      cifar_rounds=reproduce.scaled(FLAGS.cifar_rounds, 30, 200))


def run(name, data, model, settings, rounds, cohort, eval_every):
  alg = algorithms.build(name, model, data, **settings)
  runner = RoundRunner(alg, data, CohortSampler(data.num_clients, cohort_size=cohort),
                       create_executor('auto', model, data.train.x[0, :1]))
  histories, seconds = reproduce.run_trials(runner, rounds, FLAGS.seed, reproduce.trials(),
                                            eval_every, cell={'algorithm': name,
                                                              'settings': settings})
  agg = reporting.trials_summary(histories, FLAGS.stat_window)
  return {'mean': reporting.pm(agg, 'accuracy_mean_window', digits=2),
          'q10': reporting.pm(agg, 'accuracy_q10', digits=2),
          'worst': reporting.pm(agg, 'accuracy_worst_window', digits=2), 'summary': agg,
          'seconds_per_trial': seconds}


TABLES = []  # (title, Markdown table) of each table run


def print_table(title, rows):
  print(f'\n{title}')
  print(f'(mean ± std over {reproduce.trials()} trials; mean@last and worst@last: mean over the last '
        f'{FLAGS.stat_window} evaluations; 10th pct: last evaluation)')
  print(f"{'method':<14}{'personal':<18}{'mean@last':>16}{'worst@last':>16}{'10th pct':>16}"
        f"{'s/trial':>8}")
  for (name, part), r in rows.items():
    print(f'{name:<14}{str(part or "-"):<18}{r["mean"]:>16}{r["worst"]:>16}{r["q10"]:>16}'
          f'{r["seconds_per_trial"]:>8.0f}')
  TABLES.append((title, reproduce.markdown_table(
      ['method', 'personal', 'mean (last evals)', 'worst (last evals)', '10th pct'],
      [[n, p or '-', r['mean'], r['worst'], r['q10']] for (n, p), r in rows.items()])))


def partial_table(data, make_model, settings, rounds, cohort, eval_every):
  rows = {}
  wanted = PARTIAL
  if FLAGS.methods:
    keys = {tuple(m.split('/')) for m in FLAGS.methods}
    wanted = [(n, p) for n, p in PARTIAL if (n, (p or '-').split(' ')[0]) in keys]
  for name, part in wanted:
    adapter = part == 'adapter'
    model = make_model(8 if adapter else 0)
    own = dict(personal_part=part) if name in ('fedalt', 'fedsim') else {}
    rows[(name, part)] = run(name, data, model, {**settings, **own}, rounds, cohort, eval_every)
    print(f'  {name} {part}: mean {rows[(name, part)]["mean"]} worst {rows[(name, part)]["worst"]}',
          flush=True)
  return rows


def main(argv):
  del argv
  global S
  S = sizes()
  if reproduce.dry_run(vars(S)):
    return
  directory = reproduce.output_dir('reproduce_personalization')
  results = {}
  # -- Table A: Per-FedAvg on MNIST, 2 classes per client ------------------------
  if 'A' in FLAGS.tables:
    table_a(results)
  if 'B' in FLAGS.tables:
    table_b(results)
  if 'C' in FLAGS.tables:
    table_c(results)
  title = (f'Personalization tables {", ".join(FLAGS.tables)}, scale {FLAGS.scale}: mean ± std '
           f'over {reproduce.trials()} trials')
  md = '\n\n'.join(f'{t}\n\n{m}' for t, m in TABLES)
  print('wrote', *reproduce.write_results(directory, f'tables_{"".join(FLAGS.tables)}', title, md,
                                          results))


def table_a(results):
  mnist = to_device(load_federated(DataConfig(dataset=reproduce.scaled(None, 'mnist', 'tfds:mnist'),
                                              partition='pathological',
                                              classes_per_client=2, num_clients=S.mnist_clients,
                                              seed=FLAGS.seed)))
  print(mnist.describe())
  model = create_model('mlp', 10, mnist.train.x[0, :1])
  shared = dict(client_lr=0.05, batch_size=10, local_steps=10, finetune_steps=1,
                finetune_lr=0.02)
  rows = {}
  for name in ('perfedavg_fo', 'perfedavg_hf', 'perfedavg_hf_fd', 'fedavg_ft'):
    own = dict(alpha=0.02) if name.startswith('perfedavg') else {}
    rows[(name, None)] = run(name, mnist, model, {**shared, **own}, S.mnist_rounds, 10, 10)
    print(f'  {name}: mean {rows[(name, None)]["mean"]} worst {rows[(name, None)]["worst"]}',
          flush=True)
  print_table(f'Table A: MNIST, {S.mnist_clients} clients with 2 classes each, 10 per round, '
              f'{S.mnist_rounds} rounds, MLP; tested after one step (lr 0.02) on train data', rows)
  results['mnist_perfedavg'] = {k[0]: v for k, v in rows.items()}


def table_b(results):
  shakes = to_device(load_federated(DataConfig(dataset='tinyshakespeare', partition='natural',
                                               num_clients=S.shakespeare_clients, seq_len=40,
                                               seed=FLAGS.seed, data_dir=FLAGS.data_dir)))
  print(shakes.describe())
  sample = shakes.train.x[0, :1]
  make_lstm = lambda a: from_flax('char_lstm', CharLSTM(shakes.num_classes, hidden=64,
                                                        adapter_dim=a), sample)
  # No evaluation fine-tuning except fedavg_ft's own (5 steps): finetune_steps
  # would add it to every algorithm of the table.
  hp = dict(client_lr=1.0, batch_size=16, local_steps=FLAGS.shakespeare_local_steps)
  rows = partial_table(shakes, make_lstm, hp, S.shakespeare_rounds,
                       S.shakespeare_clients, 5)
  print_table(f'Table B: Shakespeare, {S.shakespeare_clients} roles, '
              f'{S.shakespeare_rounds} rounds of {FLAGS.shakespeare_local_steps} steps, '
              f'char LSTM (64): next-character accuracy', rows)
  results['shakespeare_partial'] = {f'{k[0]}/{k[1]}': v for k, v in rows.items()}


def table_c(results):
  cifar = to_device(load_federated(DataConfig(dataset='cifar10', partition='dirichlet', alpha=0.3,
                                              num_clients=S.cifar_clients,
                                              max_examples=300 * S.cifar_clients,
                                              seed=FLAGS.seed, data_dir=FLAGS.data_dir)))
  print(cifar.describe())
  sample = cifar.train.x[0, :1]
  hp = dict(client_lr=0.05, batch_size=32, local_steps=10)
  rows = partial_table(cifar, lambda a: create_model('lenet5', 10, sample, a), hp,
                       S.cifar_rounds, S.cifar_clients // 2, 10)
  print_table(f'Table C: CIFAR-10, {S.cifar_clients} clients Dirichlet 0.3, half per round, '
              f'{S.cifar_rounds} rounds, LeNet-5', rows)
  results['cifar_partial'] = {f'{k[0]}/{k[1]}': v for k, v in rows.items()}


if __name__ == '__main__':
  entry.run_script(main, kept='the trials finished so far are kept under <output_dir>/trials; the same command continues from them')
