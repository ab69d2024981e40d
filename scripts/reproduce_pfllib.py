#!/usr/bin/env python
"""PFLlib's algorithms at PFLlib's default scenario, with the time per round
of PFLlib's own code on the same work beside each.

PFLlib (TsingZ0/PFLlib, ``system/main.py`` defaults; its data from
``dataset/generate_MNIST.py noniid - dir``): MNIST, 20 clients, a
Dirichlet(0.1) label split by its ``separate_data`` (``np.random.seed(1)``,
its minimum of 40 examples a client) and each client's examples split 75/25
into train and test by its ``split_data`` (scikit-learn's
``train_test_split``, drawn from the same seeded generator), pixels
normalized to [-1, 1]; its ``FedAvgCNN`` (``pfllib_cnn``, PyTorch's
initialisation), batch 10 with each epoch's partial batch dropped (its
``DataLoader(drop_last=True)``: ``--drop_last``), SGD at 0.005, 1 local
epoch, every client every round. Reported as PFLlib reports it: the test
accuracy over all clients' test examples (``accuracy_weighted``: its
``sum(correct) / sum(samples)``)
after the last round, mean ± std over trials, and the best over the
evaluated rounds (PFLlib prints its best).

Reductions, stated in the table's title: rounds (PFLlib's default is 2,000;
``cpu`` runs 10, ``paper`` 2,000); MNIST's 10,000 test images alone when the
60,000 training images are not found (``mnist/train-images-idx3-ubyte.gz``
and its labels under ``--data_dir`` or ``$FEDJAX_PERSONAL_DATA``; the
package carries the test split only).

Speed: this project's median round (rounds after the first, which
compiles) against PFLlib's own server loop on the same arrays
(``--pfllib=<PFLlib>/system``, its ``train`` with ``eval_gap`` past the
rounds: the mean of its ``Budget`` after the first round, as it prints
"Average time cost per round"), in one run, on the same machine. Without
``--pfllib`` (or without torch) that column says so.

  python scripts/reproduce_pfllib.py --pfllib=/tmp/pfllib/system
  python scripts/reproduce_pfllib.py --algorithms=fedavg,fedrod --rounds=3
"""

import dataclasses
import functools
import os
import sys
import time
import types
from typing import Optional, Tuple

import numpy as np

from fedjax_personal import algorithms
from fedjax_personal.core.data import FederatedData, pad_clients, to_device
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.core.executor_choice import create_executor
from fedjax_personal.core.sampling import CohortSampler
from fedjax_personal.datasets.in_memory import load_mnist, read_idx
from fedjax_personal.datasets.local_files import find_file
from fedjax_personal.errors import ConfigError, DataError
from fedjax_personal.hparams import hparam
from fedjax_personal.models import create_model
from fedjax_personal.run import reporting, reproduce, script_entry

#: PFLlib's own code run beside this project's (its server loops, its
#: arguments): ``benchmarks/peers/pfllib_reference.py``, loaded by path.
PEER_FILE = os.path.join(
  os.path.dirname(os.path.abspath(__file__)),
  '..',
  'benchmarks',
  'peers',
  'pfllib_reference.py',
)
#: The algorithms of the leaderboard, each with the settings PFLlib's code
#: runs it with here (its argument names): this project's defaults where
#: PFLlib's would switch the method off or fail (FedNTD's beta 0, FedCAC's
#: beta 0 and tau 1, FedPHP's lamda 1: its labels' weight 1 - lamda is 0).
LEADERBOARD = {
  'fedavg': {},
  'fedlc': {},
  'fedntd': dict(beta=1.0),
  'fedbabu': {},
  'fedrod': {},
  'feddbe': {},
  'fedgh': {},
  'pflda': {},
  'fedgc': {},
  'fedcac': dict(tau=0.5, beta=100),
  'fedas': {},
  'fedpac': {},
  'fedcp': {},
  'gpfl': {},
  'moon': dict(mu=1.0),
  'fedproto': {},
  'fd': {},
  'fml': {},
  'fedala': {},
  # PFLlib's FedAMP as it runs (its term without a gradient: Local); the
  # live term at its defaults extrapolates over 20 clients (docs)
  'fedamp': dict(detached=True),
  # PFLlib's FedMTL as it runs (its regularizer reads the flattened
  # state_dict, without a gradient)
  'fedmtl': dict(detached=True),
  # this project's defaults (the authors' FedRepo range): PFLlib's -lam 1
  # -mu 0 train on the MMD alone, never on the labels
  'fedphp': dict(lamda=0.1, mu=0.9),
  'fedcross': {},
  'fedkd': {},
  'fedgen': {},
  'fedpcl': {},
  'apple': {},
  # the seeds' baselines PFLlib also has; FedProx at this project's mu
  # (PFLlib's -mu 0 is FedAvg)
  'local': {},
  'fedprox': dict(mu=0.01),
  'fedper': {},
  'fedrep': {},
  'lg_fedavg': {},
  # this project's lambda (PFLlib's -mu 0 trains the personal models alone)
  'ditto': dict(mu=0.1),
  'scaffold': {},
  # this project's lambda on both sides; PFLlib's -bt 0 keeps the global
  # model at its initialization (beta 1: the mean, this project's server)
  'pfedme': dict(lamda=15.0, beta=1.0),
}
#: This project's settings, by their flag names, where PFLlib's default is an
#: argument this project spells otherwise (FedRep's head epochs: PFLlib's
#: -pls 1; this project's preset: 5 x the shared phase's) or not an argument.
OWN_FLAGS = {
  'fedrep': dict(partial_personal_epochs=1),
  # PFLlib's pFedMeOptimizer decays theta by 0.001 (not an argument)
  'pfedme': dict(pfedme_weight_decay=0.001),
}
NUM_CLIENTS, ALPHA, TRAIN_RATIO, BATCH, LR, SEED = 20, 0.1, 0.75, 10, 0.005, 1


@dataclasses.dataclass(frozen=True)
class PFLlibLeaderboard(reproduce.ReproduceSettings):
  """The script's settings (its flags)."""

  algorithms: Tuple[str, ...] = hparam(
    tuple(LEADERBOARD), 'Algorithms to run (this project names them).'
  )
  rounds: Optional[int] = hparam(
    None, "Rounds (default: the scale's, 10 or 2,000).", minimum=1
  )
  eval_every: int = hparam(5, 'Evaluate every this many rounds.', minimum=1)
  pfllib: Optional[str] = hparam(
    None,
    "PFLlib's system/ folder, for the time per round of its own code (needs "
    'torch: the bench extra).',
  )
  pfllib_rounds: int = hparam(
    3, "Rounds of PFLlib's own loop timed (after its first).", minimum=1
  )

  def check(self) -> None:
    for name in self.algorithms:
      if name not in LEADERBOARD:
        raise ConfigError(
          'algorithms', f'{name!r} is not one of {sorted(LEADERBOARD)}'
        )
    if self.pfllib is not None and not os.path.isdir(
      os.path.join(self.pfllib, 'flcore')
    ):
      raise ConfigError(
        'pfllib', f"{self.pfllib} holds no flcore/: give PFLlib's system/"
      )

  @property
  def num_rounds(self) -> int:
    return self.scaled(self.rounds, 10, 2000)


script_entry.define_settings_flags(PFLlibLeaderboard)


def mnist_pool(data_dir=None):
  """MNIST as PFLlib's generator pools it (its training images, then its
  test images; uint8 [n, 28, 28, 1]), and whether the training images
  were found."""
  x_test, y_test, _ = load_mnist(data_dir)
  try:
    images = find_file('mnist/train-images-idx3-ubyte.gz', data_dir)
    labels = find_file('mnist/train-labels-idx1-ubyte.gz', data_dir)
  except DataError:
    return x_test, y_test, False
  x = np.concatenate([read_idx(images)[..., None], x_test])
  y = np.concatenate([read_idx(labels).astype(np.int32), y_test])
  return x, y, True


def pfllib_partition(labels, rng):
  """PFLlib's ``separate_data(..., niid=True, partition='dir')``: each
  class's examples shuffled and cut by Dirichlet(alpha) proportions among
  the clients that still hold fewer than N / clients, redrawn until every
  client has ``least_samples``; the same calls on the same generator."""
  n, k = len(labels), int(labels.max()) + 1
  least = int(min(BATCH / (1 - TRAIN_RATIO), n / NUM_CLIENTS / 2))
  min_size = 0
  while min_size < least:
    idx_batch = [[] for _ in range(NUM_CLIENTS)]
    for c in range(k):
      idx_k = np.where(labels == c)[0]
      rng.shuffle(idx_k)
      p = rng.dirichlet(np.repeat(ALPHA, NUM_CLIENTS))
      p = np.array(
        [q * (len(j) < n / NUM_CLIENTS) for q, j in zip(p, idx_batch)]
      )
      p = p / p.sum()
      cuts = (np.cumsum(p) * len(idx_k)).astype(int)[:-1]
      idx_batch = [
        j + part.tolist() for j, part in zip(idx_batch, np.split(idx_k, cuts))
      ]
      min_size = min(len(j) for j in idx_batch)
  return idx_batch


def federation(data_dir=None):
  """PFLlib's MNIST federation: ``(FederatedData, per-client arrays, whether
  the full MNIST was used)``."""
  from sklearn.model_selection import train_test_split  # noqa: PLC0415

  x, y, full = mnist_pool(data_dir)
  x = ((x.astype(np.float32) / 255.0) - 0.5) / 0.5
  rng = np.random.RandomState(SEED)  # its np.random.seed(1)
  clients = []
  for idx in pfllib_partition(y, rng):
    xi, yi = x[np.asarray(idx, int)], y[np.asarray(idx, int)]
    x_tr, x_te, y_tr, y_te = train_test_split(
      xi, yi, train_size=TRAIN_RATIO, shuffle=True, random_state=rng
    )
    clients.append((x_tr, y_tr, x_te, y_te))
  split = lambda a, b: pad_clients(
    [c[a] for c in clients], [c[b] for c in clients], x.shape[1:], np.float32
  )
  data = FederatedData(
    train=split(0, 1),
    val=split(2, 3),
    test=split(2, 3),
    groups=np.full(NUM_CLIENTS, -1, np.int32),
    num_classes=10,
    name='PFLlib MNIST Dir(0.1)',
  )
  return to_device(data), clients, full


@functools.lru_cache(maxsize=None)
def _peer():
  """``benchmarks/peers/pfllib_reference.py`` (PFLlib's arguments and this
  project's names for them; PyTorch only when PFLlib's code runs)."""
  import importlib.util  # noqa: PLC0415

  spec = importlib.util.spec_from_file_location('pfllib_reference', PEER_FILE)
  peer = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(peer)
  return peer


def own_flags(name):
  """This project's flags for ``name`` on the leaderboard: its
  ``LEADERBOARD`` settings under this project's names (PFLlib's ``-mu`` is
  Ditto's ``--ditto_lam``), and ``OWN_FLAGS``."""
  return {
    **_peer().our_flags(name, LEADERBOARD[name]),
    **OWN_FLAGS.get(name, {}),
  }


def trial_final(history):
  """One trial's row: PFLlib's metric at the last evaluation
  (``accuracy``) and at the best (``best``); a diverged trial says so
  (``reporting.final_summary``'s ``diverged``, ``diverged_at_round``), so
  ``aggregate_trials`` leaves it out and counts it, whether or not an
  evaluation came before."""
  final = reporting.final_summary(history)
  if final.get('diverged'):
    return {k: final[k] for k in ('diverged', 'diverged_at_round')}
  evals = [r for r in history if 'accuracy_weighted' in r]
  if not evals:
    return {}
  return {
    'accuracy': evals[-1]['accuracy_weighted'],
    'best': max(r['accuracy_weighted'] for r in evals),
  }


def run_ours(cfg, directory, data, name):
  """The trials of one algorithm: (summary, median seconds per round)."""
  model = create_model('pfllib_cnn', 10, data.train.x[0, :1], init='pytorch')
  training = dict(
    client_lr=LR, batch_size=BATCH, local_epochs=1, drop_last=True
  )
  own = own_flags(name)
  # what the command sets from the run (FedPHP's and FedKD's horizons,
  # FedCross's models): this run's rounds, every client a round
  run = types.SimpleNamespace(
    rounds=cfg.num_rounds, cohort_size=NUM_CLIENTS, participation=None
  )
  config = algorithms.spec(name).config
  for f in dataclasses.fields(config):
    if f.metadata.get('of_run') and f'{name}_{f.name}' not in own:
      own[f'{name}_{f.name}'] = f.metadata['of_run'](run)
  alg = algorithms.build(name, model, data, **training, **own)
  runner = RoundRunner(
    alg,
    data,
    CohortSampler(data.num_clients, cohort_size=data.num_clients),
    create_executor('auto', model, data.train.x[0, :1]),
  )
  histories, _ = reproduce.run_trials(
    runner,
    cfg.num_rounds,
    cfg.seed,
    cfg.num_trials,
    cfg.eval_every,
    cell={
      'algorithm': name,
      'settings': {**training, **own},
      'data': 'pfllib_mnist',
    },
    reuse=cfg.reuse_trials,
    directory=directory,
  )
  finals = [trial_final(h) for h in histories]
  seconds = [
    r['round_seconds'] for h in histories for r in h[1:] if 'round_seconds' in r
  ]
  return reporting.aggregate_trials(finals), float(np.median(seconds))


def time_pfllib(cfg, clients, name) -> Optional[float]:
  """Seconds per round of PFLlib's own server loop on the same clients, or
  None without ``--pfllib`` or torch."""
  if cfg.pfllib is None:
    return None
  try:
    import torch  # noqa: PLC0415
  except ImportError:
    return None
  peer = _peer()
  sys.path.insert(0, os.path.abspath(cfg.pfllib))
  peer.stand_ins()
  peer.patch_reader(
    torch,
    lambda i, is_train: clients[i][:2] if is_train else clients[i][2:],
  )
  from flcore.trainmodel.models import FedAvgCNN  # noqa: PLC0415

  torch.manual_seed(0)
  model = FedAvgCNN(in_features=1, num_classes=10, dim=1024)
  server, _ = peer.pfllib_server(
    torch,
    name,
    model,
    LEADERBOARD[name],
    dataset='MNIST',
    num_classes=10,
    batch_size=BATCH,
    local_learning_rate=LR,
    global_rounds=cfg.pfllib_rounds,
    local_epochs=1,
    num_clients=NUM_CLIENTS,
    eval_gap=10**9,
  )
  # FedBABU's fine-tuning after the loop: not a round
  for client in server.clients:
    client.fine_tune = lambda *a, **k: None
  start = time.perf_counter()
  server.train()
  whole = time.perf_counter() - start
  if len(server.Budget) < 2:  # FedPHP's loop keeps no Budget: its mean
    return whole / (cfg.pfllib_rounds + 1)  # round, its first one included
  return float(np.mean(server.Budget[1:]))


def main(cfg: PFLlibLeaderboard):
  if cfg.show_dry_run(
    {
      'rounds': cfg.num_rounds,
      'clients': NUM_CLIENTS,
      'algorithms': ','.join(cfg.algorithms),
    }
  ):
    return
  directory = cfg.results_dir('reproduce_pfllib')
  data, clients, full = federation(cfg.data_dir)
  print(data.describe(), flush=True)
  rows, results = [], {}
  for name in cfg.algorithms:
    summary, ours = run_ours(cfg, directory, data, name)
    theirs = time_pfllib(cfg, clients, name)
    ratio = None if theirs is None else theirs / ours
    results[name] = dict(summary, seconds_per_round=ours, pfllib_seconds=theirs)
    rows.append(
      [
        f'`{name}`',
        reproduce.cell(summary, 'accuracy'),
        reproduce.cell(summary, 'best'),
        f'{ours:.2f}',
        '-' if theirs is None else f'{theirs:.2f}',
        '-' if ratio is None else f'{ratio:.1f}x',
      ]
    )
    print(' | '.join(rows[-1]), flush=True)
  pool = 'MNIST (70,000)' if full else "MNIST's 10,000 test images"
  title = (
    f"PFLlib's default scenario, scale {cfg.scale}: {pool} over 20 clients by "
    "PFLlib's Dir(0.1), its 4-layer CNN, batch 10 (an epoch's partial batch "
    'dropped, as '
    "PFLlib's loader), lr 0.005, 1 local epoch, "
    f'every client, {cfg.num_rounds} rounds; mean ± std over {cfg.num_trials} '
    "trials of the test accuracy over all clients (PFLlib's metric) at the "
    'last round and at the best evaluated round (every '
    f"{cfg.eval_every}); seconds per round here and in PFLlib's own code"
  )
  table = reproduce.markdown_table(
    [
      'algorithm',
      'accuracy',
      'best',
      's/round',
      "PFLlib's s/round",
      'speed-up',
    ],
    rows,
  )
  print(title + '\n\n' + table)
  print(
    'wrote',
    *reproduce.write_results(cfg, directory, 'pfllib', title, table, results),
  )


if __name__ == '__main__':
  script_entry.run_script(
    main,
    kept='the trials finished so far are kept under '
    '<output_dir>/trials; the same command continues from them',
    settings=PFLlibLeaderboard,
  )
