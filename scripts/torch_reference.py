#!/usr/bin/env python
"""A plain PyTorch loop of Local, FedAvg and Oracle on this library's data:
the reference a ported protocol is checked against.

The same partition as ``run_experiment.py`` (same data flags and seed), a
PyTorch LeNet-5 with PyTorch's default initialisation, one SGD optimizer
per user kept for the whole run (its momentum buffers persist across rounds,
as the user-centric paper's per-user Keras optimizers), ``--local_epochs``
shuffled passes of ``--batch_size`` per round, every user in every round;
FedAvg averages the users' models weighted by their examples, Oracle does so
within each true group, Local never averages. Prints, per algorithm, the
mean and worst per-user test accuracy at the last evaluation and averaged over
the last ``--stat_window`` evaluations (mean ± std over ``--trials`` seeds),
and where ``--output`` is given writes the histories as JSON.

  python scripts/torch_reference.py --lr=0.1 --pool=avg --trials=3

Needs torch (``pip install -e '.[bench]'``).
"""

import dataclasses
import json
import sys
from typing import Optional, Tuple

import numpy as np

from fedjax_personal.hparams import Declared, hparam
from fedjax_personal.run import script_entry


@dataclasses.dataclass(frozen=True)
class TorchReferenceSettings(Declared):
  """The PyTorch reference loop's settings (its flags)."""

  algorithms: Tuple[str, ...] = hparam(
    ('local', 'fedavg', 'oracle'), 'local, fedavg, oracle.'
  )
  dataset: str = hparam(
    'mnist', 'Data set (an image data set of fedjax_personal).'
  )
  partition: str = hparam('rotation', 'Partition (oracle needs groups).')
  num_clients: int = hparam(40, 'Users.')
  num_groups: int = hparam(
    4, 'Groups of the rotation / label_permutation partitions.'
  )
  data_seed: int = hparam(0, 'Seed of the partition.')
  seed: int = hparam(0, 'Seed of the first trial (initialisation and batches).')
  trials: int = hparam(1, 'Trials (seeds seed..seed+T-1).', minimum=1)
  rounds: int = hparam(50, 'Rounds.', minimum=1)
  eval_every: int = hparam(2, 'Evaluation period.', minimum=1)
  stat_window: int = hparam(
    5, 'Evaluations averaged in the @last columns.', minimum=1
  )
  lr: float = hparam(0.1, 'SGD learning rate.')
  momentum: float = hparam(
    0.9, 'SGD momentum (buffers kept per user across rounds).'
  )
  batch_size: int = hparam(32, 'Batch size.')
  local_epochs: int = hparam(1, 'Local epochs per round.')
  pool: str = hparam('avg', "LeNet-5's pooling.", choices=('max', 'avg'))
  output: Optional[str] = hparam(None, 'Write the histories here (JSON).')
  dry_run: bool = hparam(False, 'Load the data, print it and exit.')


script_entry.define_settings_flags(TorchReferenceSettings)


def lenet5(in_shape, num_classes, pool):
  """PyTorch's LeNet-5 (the twin of ``lenet5`` / ``usercentric_lenet5``)."""
  from torch import nn

  h, _, c = in_shape
  side = ((h // 2) - 4) // 2
  pooling = (
    (lambda: nn.MaxPool2d(2)) if pool == 'max' else (lambda: nn.AvgPool2d(2))
  )
  return nn.Sequential(
    nn.Conv2d(c, 6, 5, padding=2),
    nn.ReLU(),
    pooling(),
    nn.Conv2d(6, 16, 5),
    nn.ReLU(),
    pooling(),
    nn.Flatten(),
    nn.Linear(16 * side * side, 120),
    nn.ReLU(),
    nn.Linear(120, 84),
    nn.ReLU(),
    nn.Linear(84, num_classes),
  )


def run(cfg, algorithm, data, seed):
  """One trial: [{'round', 'accuracy_mean', 'accuracy_worst', 'train_loss'}]."""
  import torch

  torch.manual_seed(seed)
  n = data.num_clients
  num = np.asarray(data.train.num_examples)
  tensors = lambda split, i: (
    torch.from_numpy(
      np.ascontiguousarray(
        np.asarray(split.x[i, : int(split.num_examples[i])]).transpose(
          0, 3, 1, 2
        )
      )
    ).float()
    / 255.0,
    torch.from_numpy(
      np.asarray(split.y[i, : int(split.num_examples[i])]).astype(np.int64)
    ),
  )
  train = [tensors(data.train, i) for i in range(n)]
  test = [tensors(data.test, i) for i in range(n)]
  shape = data.train.x.shape[2:]
  init = lenet5(shape, data.num_classes, cfg.pool).state_dict()
  models = [lenet5(shape, data.num_classes, cfg.pool) for _ in range(n)]
  for m in models:
    m.load_state_dict(init)
  opts = [
    torch.optim.SGD(m.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    for m in models
  ]
  groups = (
    np.asarray(data.groups) if algorithm == 'oracle' else np.zeros(n, int)
  )
  gen = torch.Generator().manual_seed(seed)
  history = []
  for r in range(1, cfg.rounds + 1):
    losses, counts = 0.0, 0
    for i in range(n):
      x, y = train[i]
      for _ in range(cfg.local_epochs):
        order = torch.randperm(len(y), generator=gen)
        for s in range(0, len(y), cfg.batch_size):
          b = order[s : s + cfg.batch_size]
          opts[i].zero_grad()
          loss = torch.nn.functional.cross_entropy(models[i](x[b]), y[b])
          loss.backward()
          opts[i].step()
          losses += loss.item() * len(b)
          counts += len(b)
    if algorithm != 'local':
      with torch.no_grad():
        for g in np.unique(groups):
          members = np.flatnonzero(groups == g)
          w = num[members] / num[members].sum()
          mean = {
            k: sum(
              float(wj) * models[j].state_dict()[k] for wj, j in zip(w, members)
            )
            for k in init
          }
          for j in members:
            models[j].load_state_dict(mean)
    if r % cfg.eval_every == 0 or r == cfg.rounds:
      with torch.no_grad():
        acc = [
          float((models[i](test[i][0]).argmax(1) == test[i][1]).float().mean())
          for i in range(n)
          if len(test[i][1])
        ]
      history.append(
        {
          'round': r,
          'accuracy_mean': float(np.mean(acc)),
          'accuracy_worst': float(np.min(acc)),
          'train_loss': losses / counts,
        }
      )
  return history


def main(cfg: TorchReferenceSettings):
  from fedjax_personal.datasets import DataConfig, load_federated

  data = load_federated(
    DataConfig(
      dataset=cfg.dataset,
      partition=cfg.partition,
      num_clients=cfg.num_clients,
      num_groups=cfg.num_groups,
      seed=cfg.data_seed,
    )
  )
  print(data.describe())
  if cfg.dry_run:
    return
  try:
    import torch  # noqa: F401
  except ImportError:
    sys.exit(
      'error: scripts/torch_reference.py needs torch (pip install -e '
      "'.[bench]')"
    )
  out = {}
  print(
    f'{"algorithm":10s} {"mean":>14s} {"worst":>14s} {"mean@last":>14s} '
    f'{"worst@last":>14s}'
  )
  for alg in cfg.algorithms:
    hists = [run(cfg, alg, data, cfg.seed + t) for t in range(cfg.trials)]
    out[alg] = hists
    cols = []
    for key, window in (
      ('accuracy_mean', 1),
      ('accuracy_worst', 1),
      ('accuracy_mean', cfg.stat_window),
      ('accuracy_worst', cfg.stat_window),
    ):
      v = [100 * np.mean([h[key] for h in hist[-window:]]) for hist in hists]
      cols.append(
        f'{np.mean(v):6.2f}±{np.std(v, ddof=1) if len(v) > 1 else 0:5.2f}'
      )
    print(f'{alg:10s} ' + ' '.join(f'{c:>14s}' for c in cols), flush=True)
  if cfg.output:
    with open(cfg.output, 'w') as f:
      json.dump(out, f)


if __name__ == '__main__':
  script_entry.run_script(main, settings=TorchReferenceSettings)
