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

Table D: the seed's own next-word task at a size this machine runs: its word
transformer (``transformer_lm_tiny``: 2 blocks, d 128; the paper's is 4
blocks, d 256) on a generated Stack Overflow-shaped population (log-normal
sentences per user, sentences of 4-19 words over a 400-word vocabulary with
PAD / BOS / EOS / OOV, tokenized by the Stack Overflow loader), in which every
user renders a third of the shared grammar's words with a synonym of their own
and continues sentences with personal preferences: FedAvg against FedAlt with
the input layer (embeddings), the output layer (decoder and bias) or
adapters (width 16, with the norms) personal.

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

import dataclasses
import types
from typing import List, Optional, Tuple

import numpy as np

from fedjax_personal import algorithms
from fedjax_personal.core.data import to_device
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.core.executor_choice import create_executor
from fedjax_personal.core.sampling import CohortSampler
from fedjax_personal.datasets import (
  DataConfig,
  TextOptions,
  load_federated,
  stackoverflow,
)
from fedjax_personal.hparams import hparam
from fedjax_personal.models import CharLSTM, create_model, from_flax
from fedjax_personal.run import reporting, reproduce, script_entry


@dataclasses.dataclass(frozen=True)
class PersonalizationTables(reproduce.ReproduceSettings):
  """The script's settings (its flags)."""

  mnist_clients: Optional[int] = hparam(
    None, 'Table A clients (cpu and paper 50).', minimum=2
  )
  mnist_rounds: Optional[int] = hparam(
    None, 'Table A rounds (cpu 60, paper 1000).', minimum=1
  )
  shakespeare_clients: Optional[int] = hparam(
    None, 'Table B clients, speaking roles (cpu 10, paper 100).', minimum=2
  )
  shakespeare_rounds: Optional[int] = hparam(
    None, 'Table B rounds (cpu 30, paper 200).', minimum=1
  )
  shakespeare_local_steps: int = hparam(
    20,
    'Table B local steps per round (5 leaves the LSTM at the unigram level).',
  )
  methods: Tuple[str, ...] = hparam(
    (),
    'Subset of tables B/C rows as method/part, e.g. '
    'fedavg/-,fedalt/output,local/all (default: all rows).',
  )
  cifar_clients: Optional[int] = hparam(
    None, 'Table C clients (cpu 20, paper 100).', minimum=2
  )
  cifar_rounds: Optional[int] = hparam(
    None, 'Table C rounds (cpu 30, paper 200).', minimum=1
  )
  nwp_clients: Optional[int] = hparam(
    None, 'Table D users (cpu 40, paper 1000).', minimum=2
  )
  nwp_rounds: Optional[int] = hparam(
    None, 'Table D rounds (cpu 100, paper 500).', minimum=1
  )
  nwp_grad_clip: float = hparam(
    0.0,
    'Table D: clip client gradients to this global norm (the '
    'seed clips at 0.25; 0: no clipping).',
    minimum=0,
  )
  tables: Tuple[str, ...] = hparam(
    ('A', 'B', 'C'), 'Which tables to run (D: next-word prediction).'
  )


script_entry.define_settings_flags(PersonalizationTables)

PARTIAL = [
  ('fedavg', None),
  ('fedalt', 'input'),
  ('fedsim', 'input'),
  ('fedalt', 'output'),
  ('fedsim', 'output'),
  ('fedalt', 'adapter'),
  ('fedsim', 'adapter'),
  ('local', 'all (Local)'),
  ('fedavg_ft', 'all (fine-tune)'),
]


@dataclasses.dataclass
class TableRun:
  """One run of the script: its settings, the sizes they resolve to, the
  results folder and the tables made so far (title, Markdown)."""

  cfg: PersonalizationTables
  sizes: types.SimpleNamespace
  directory: str
  tables: List[tuple] = dataclasses.field(default_factory=list)


def sizes(cfg):
  return types.SimpleNamespace(
    mnist_clients=cfg.scaled(cfg.mnist_clients, 50, 50),
    mnist_rounds=cfg.scaled(cfg.mnist_rounds, 60, 1000),
    shakespeare_clients=cfg.scaled(cfg.shakespeare_clients, 10, 100),
    shakespeare_rounds=cfg.scaled(cfg.shakespeare_rounds, 30, 200),
    cifar_clients=cfg.scaled(cfg.cifar_clients, 20, 100),
    cifar_rounds=cfg.scaled(cfg.cifar_rounds, 30, 200),
    nwp_clients=cfg.scaled(cfg.nwp_clients, 40, 1000),
    nwp_rounds=cfg.scaled(cfg.nwp_rounds, 100, 500),
  )


def run(r: TableRun, name, data, model, settings, rounds, cohort, eval_every):
  cfg = r.cfg
  alg = algorithms.build(name, model, data, **settings)
  runner = RoundRunner(
    alg,
    data,
    CohortSampler(data.num_clients, cohort_size=cohort),
    create_executor('auto', model, data.train.x[0, :1]),
  )
  histories, seconds = reproduce.run_trials(
    runner,
    rounds,
    cfg.seed,
    cfg.num_trials,
    eval_every,
    cell={'algorithm': name, 'settings': settings},
    reuse=cfg.reuse_trials,
    directory=r.directory,
  )
  agg = reporting.trials_summary(histories, cfg.stat_window)
  return {
    'mean': reporting.pm(agg, 'accuracy_mean_window', digits=2),
    'q10': reporting.pm(agg, 'accuracy_q10', digits=2),
    'worst': reporting.pm(agg, 'accuracy_worst_window', digits=2),
    'summary': agg,
    'seconds_per_trial': seconds,
  }


def print_table(r: TableRun, title, rows):
  cfg = r.cfg
  print(f'\n{title}')
  print(
    f'(mean ± std over {cfg.num_trials} trials; mean@last and worst@last: mean '
    f'over the last '
    f'{cfg.stat_window} evaluations; 10th pct: last evaluation)'
  )
  print(
    f'{"method":<14}{"personal":<18}{"mean@last":>16}{"worst@last":>16}{"10th pct":>16}'
    f'{"s/trial":>8}'
  )
  for (name, part), row in rows.items():
    print(
      f'{name:<14}{str(part or "-"):<18}{row["mean"]:>16}{row["worst"]:>16}{row["q10"]:>16}'
      f'{row["seconds_per_trial"]:>8.0f}'
    )
  r.tables.append(
    (
      title,
      reproduce.markdown_table(
        [
          'method',
          'personal',
          'mean (last evals)',
          'worst (last evals)',
          '10th pct',
        ],
        [
          [n, p or '-', row['mean'], row['worst'], row['q10']]
          for (n, p), row in rows.items()
        ],
      ),
    )
  )


def partial_table(
  r: TableRun,
  data,
  make_model,
  settings,
  rounds,
  cohort,
  eval_every,
  methods=PARTIAL,
):
  """The rows ``methods`` (those of ``--methods`` only, when given);
  ``make_model(adapter)`` builds the model, with adapters when ``adapter``."""
  rows = {}
  wanted = methods
  if r.cfg.methods:
    keys = {tuple(m.split('/')) for m in r.cfg.methods}
    wanted = [
      (n, p) for n, p in methods if (n, (p or '-').split(' ')[0]) in keys
    ]
  for name, part in wanted:
    model = make_model(part == 'adapter')
    own = dict(personal_part=part) if name in ('fedalt', 'fedsim') else {}
    rows[(name, part)] = run(
      r, name, data, model, {**settings, **own}, rounds, cohort, eval_every
    )
    print(
      f'  {name} {part}: mean {rows[(name, part)]["mean"]} worst '
      f'{rows[(name, part)]["worst"]}',
      flush=True,
    )
  return rows


def main(cfg: PersonalizationTables):
  S = sizes(cfg)
  if cfg.show_dry_run(vars(S)):
    return
  r = TableRun(cfg, S, cfg.results_dir('reproduce_personalization'))
  results = {}
  for name, table in (
    ('A', table_a),
    ('B', table_b),
    ('C', table_c),
    ('D', table_d),
  ):
    if name in cfg.tables:
      table(r, results)
  title = (
    f'Personalization tables {", ".join(cfg.tables)}, scale {cfg.scale}: mean '
    f'± std '
    f'over {cfg.num_trials} trials'
  )
  md = '\n\n'.join(f'{t}\n\n{m}' for t, m in r.tables)
  print(
    'wrote',
    *reproduce.write_results(
      cfg, r.directory, f'tables_{"".join(cfg.tables)}', title, md, results
    ),
  )


def table_a(r: TableRun, results):
  cfg, S = r.cfg, r.sizes
  mnist = to_device(
    load_federated(
      DataConfig(
        dataset=cfg.scaled(None, 'mnist', 'tfds:mnist'),
        partition='pathological',
        classes_per_client=2,
        num_clients=S.mnist_clients,
        seed=cfg.seed,
      )
    )
  )
  print(mnist.describe())
  model = create_model('mlp', 10, mnist.train.x[0, :1])
  shared = dict(
    client_lr=0.05,
    batch_size=10,
    local_steps=10,
    finetune_steps=1,
    finetune_lr=0.02,
  )
  rows = {}
  for name in ('perfedavg_fo', 'perfedavg_hf', 'perfedavg_hf_fd', 'fedavg_ft'):
    own = dict(alpha=0.02) if name.startswith('perfedavg') else {}
    rows[(name, None)] = run(
      r, name, mnist, model, {**shared, **own}, S.mnist_rounds, 10, 10
    )
    print(
      f'  {name}: mean {rows[(name, None)]["mean"]} worst '
      f'{rows[(name, None)]["worst"]}',
      flush=True,
    )
  print_table(
    r,
    f'Table A: MNIST, {S.mnist_clients} clients with 2 classes each, 10 per '
    f'round, '
    f'{S.mnist_rounds} rounds, MLP; tested after one step (lr 0.02) on train '
    f'data',
    rows,
  )
  results['mnist_perfedavg'] = {k[0]: v for k, v in rows.items()}


def table_b(r: TableRun, results):
  cfg, S = r.cfg, r.sizes
  shakes = to_device(
    load_federated(
      DataConfig(
        dataset='tinyshakespeare',
        partition='natural',
        num_clients=S.shakespeare_clients,
        options=TextOptions(seq_len=40),
        seed=cfg.seed,
        data_dir=cfg.data_dir,
      )
    )
  )
  print(shakes.describe())
  sample = shakes.train.x[0, :1]
  make_lstm = lambda a: from_flax(
    'char_lstm', CharLSTM(shakes.num_classes, hidden=64, adapter_dim=a), sample
  )
  # No evaluation fine-tuning except fedavg_ft's own (5 steps): finetune_steps
  # would add it to every algorithm of the table.
  hp = dict(
    client_lr=1.0, batch_size=16, local_steps=cfg.shakespeare_local_steps
  )
  rows = partial_table(
    r,
    shakes,
    lambda adapter: make_lstm(8 if adapter else 0),
    hp,
    S.shakespeare_rounds,
    S.shakespeare_clients,
    5,
  )
  print_table(
    r,
    f'Table B: Shakespeare, {S.shakespeare_clients} roles, '
    f'{S.shakespeare_rounds} rounds of {cfg.shakespeare_local_steps} steps, '
    f'char LSTM (64): next-character accuracy',
    rows,
  )
  results['shakespeare_partial'] = {
    f'{k[0]}/{k[1]}': v for k, v in rows.items()
  }


def table_c(r: TableRun, results):
  cfg, S = r.cfg, r.sizes
  cifar = to_device(
    load_federated(
      DataConfig(
        dataset='cifar10',
        partition='dirichlet',
        alpha=0.3,
        num_clients=S.cifar_clients,
        max_examples=300 * S.cifar_clients,
        seed=cfg.seed,
        data_dir=cfg.data_dir,
      )
    )
  )
  print(cifar.describe())
  sample = cifar.train.x[0, :1]
  hp = dict(client_lr=0.05, batch_size=32, local_steps=10)
  rows = partial_table(
    r,
    cifar,
    lambda adapter: create_model('lenet5', 10, sample, 8 if adapter else 0),
    hp,
    S.cifar_rounds,
    S.cifar_clients // 2,
    10,
  )
  print_table(
    r,
    f'Table C: CIFAR-10, {S.cifar_clients} clients Dirichlet 0.3, half per '
    f'round, '
    f'{S.cifar_rounds} rounds, LeNet-5',
    rows,
  )
  results['cifar_partial'] = {f'{k[0]}/{k[1]}': v for k, v in rows.items()}


NWP_PARTIAL = [
  ('fedavg', None),
  ('fedalt', 'input'),
  ('fedalt', 'output'),
  ('fedalt', 'adapter'),
]


def generated_stackoverflow(
  num_users: int,
  seed: int,
  concepts: int = 100,
  synonyms: int = 3,
  seq_len: int = 20,
  median: int = 60,
  personal: float = 0.5,
):
  """A Stack Overflow-shaped population with personal language, tokenized
  as the Stack Overflow loader tokenizes its files
  (``stackoverflow.tokenize_sentences``).

  A shared grammar: ``concepts`` word classes with a sparse bigram chain
  (each continues to 4 classes, Zipf weights). User u renders a random third
  of the classes with one of ``synonyms`` words of its own choosing (the rest
  with the class's common word) and draws each next class from its own 2
  preferred successors with probability ``personal``. Sentences per user:
  log-normal (``median``, the field's long tail), at least 8; a quarter (at
  least 2) are held out for the test split. Vocabulary: the common words and
  synonyms, ``concepts * (1 + synonyms)`` ids plus PAD, BOS, EOS, OOV. With
  the defaults and 40 users, bigram counts over the pooled training splits
  score 13.9% in-vocabulary accuracy on the test splits, each user's own
  counts added (x20) 20.1%: the headroom personalization can take.
  """
  from fedjax_personal.core.data import ClientData, FederatedData, pad_clients

  rng = np.random.default_rng(seed)
  words = [
    [f'c{k}'] + [f'c{k}s{j}' for j in range(synonyms)] for k in range(concepts)
  ]
  vocab = stackoverflow.word_ids(w for group in words for w in group)
  nxt = np.stack(
    [rng.choice(concepts, 4, replace=False) for _ in range(concepts)]
  )
  zipf = 1.0 / np.arange(1, 5)
  zipf /= zipf.sum()
  splits = {'train': [], 'test': []}
  for u in range(num_users):
    own = np.stack(
      [rng.choice(concepts, 2, replace=False) for _ in range(concepts)]
    )
    render = [
      words[k][0]
      if rng.random() > 1 / 3
      else words[k][1 + rng.integers(synonyms)]
      for k in range(concepts)
    ]
    n = max(8, int(rng.lognormal(np.log(median), 0.8)))
    sentences = []
    for _ in range(n):
      k, text = int(rng.integers(concepts)), []
      for _ in range(int(rng.integers(4, 20))):
        text.append(render[k])
        k = int(
          own[k, rng.integers(2)]
          if rng.random() < personal
          else rng.choice(nxt[k], p=zipf)
        )
      sentences.append(' '.join(text))
    held = max(2, n // 4)
    for split, part in (
      ('train', sentences[held:]),
      ('test', sentences[:held]),
    ):
      splits[split].append(
        stackoverflow.tokenize_sentences(part, vocab, seq_len)
      )
  data = {
    s: pad_clients(
      [x for x, _ in v], [y for _, y in v], (seq_len,), np.int32, (seq_len,)
    )
    for s, v in splits.items()
  }
  empty = np.zeros((num_users, 0, seq_len), np.int32)
  val = ClientData(empty, empty, np.zeros(num_users, np.int32))
  return FederatedData(
    data['train'],
    val,
    data['test'],
    np.full(num_users, -1, np.int32),
    num_classes=len(vocab) + 4,
    name=f'generated stackoverflow-shaped ({num_users} users)',
  )


def table_d(r: TableRun, results):
  cfg, S = r.cfg, r.sizes
  data = to_device(generated_stackoverflow(S.nwp_clients, cfg.seed))
  print(data.describe())
  sample = data.train.x[0, :1]
  # The seed's client settings (SGD, one epoch, batch 64 -> 16 for users of
  # ~30 sentences) with a rate tuned for the small model; server SGD 1.
  hp = dict(
    client_lr=0.5,
    batch_size=16,
    local_epochs=1,
    **({'client_grad_clip': cfg.nwp_grad_clip} if cfg.nwp_grad_clip else {}),
  )
  unscored = stackoverflow.stackoverflow_unscored(data.num_classes)
  rows = partial_table(
    r,
    data,
    lambda adapter: create_model(
      'transformer_lm_tiny', data.num_classes, sample, 16 if adapter else 0
    ).scoring_only_words(unscored),
    hp,
    S.nwp_rounds,
    max(2, S.nwp_clients // 4),
    10,
    NWP_PARTIAL,
  )
  print_table(
    r,
    f'Table D: next-word prediction, {S.nwp_clients} generated Stack '
    f'Overflow-shaped '
    f'users (personal synonyms and continuations), a quarter per round, '
    f'{S.nwp_rounds} '
    f"rounds, the seed's transformer at --arch_size tiny"
    + (
      f', client gradients clipped at {cfg.nwp_grad_clip}'
      if cfg.nwp_grad_clip
      else ''
    ),
    rows,
  )
  results['nwp_partial'] = {f'{k[0]}/{k[1]}': v for k, v in rows.items()}


if __name__ == '__main__':
  script_entry.run_script(
    main,
    kept='the trials finished so far are kept under <output_dir>/trials; '
    'the same command continues from them',
    settings=PersonalizationTables,
  )
