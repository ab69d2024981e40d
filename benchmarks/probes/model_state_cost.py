"""What dropout and batch normalization cost a round: the same CNN without
either, with dropout, with BatchNorm and with both, each trained by FedAvg
(FedBN for the BatchNorm variants too) on one EMNIST-shaped cohort with the
executor ``auto`` picks, rounds interleaved so that every variant meets the
machine in the same state; the median round of each, and its ratio to the
plain CNN's, measured in one run.

    python benchmarks/probes/model_state_cost.py --rounds=12 > benchmarks/probes/model_state_cost.txt
"""

import argparse
import statistics
import time

import flax.linen as nn
import jax
import numpy as np

import fedjax_personal as fp
from fedjax_personal import algorithms
from fedjax_personal.core.data import FederatedData, pad_clients, to_device

# name -> (batch norm, dropout rate)
VARIANTS = {
  'plain': (False, 0.0),
  'dropout': (False, 0.5),
  'batch_norm': (True, 0.0),
  'both': (True, 0.5),
}


class CNN(nn.Module):
  """conv 32 3x3 - [BatchNorm] - relu - pool - conv 64 3x3 - [BatchNorm] - relu
  - pool -
  dense 128 - [dropout] - output: a user's module in Flax's convention."""

  num_classes: int
  batch_norm: bool
  dropout: float

  @nn.compact
  def __call__(self, x, train: bool):
    for features in (32, 64):
      x = nn.Conv(features, (3, 3))(x)
      if self.batch_norm:
        x = nn.BatchNorm(use_running_average=not train)(x)
      x = nn.max_pool(nn.relu(x), (2, 2), (2, 2))
    x = nn.relu(nn.Dense(128)(x.reshape(x.shape[0], -1)))
    if self.dropout:
      x = nn.Dropout(self.dropout, deterministic=not train)(x)
    return nn.Dense(self.num_classes)(x)


def emnist_shaped(num_clients: int, seed: int = 0):
  """Clients of 28x28x1 images, 40-160 examples each (EMNIST writers'
  middle)."""
  rng = np.random.default_rng(seed)
  sizes = rng.integers(40, 161, num_clients)
  xs = [rng.random((n, 28, 28, 1), np.float32) for n in sizes]
  ys = [rng.integers(0, 62, n).astype(np.int32) for n in sizes]
  train = pad_clients(xs, ys, (28, 28, 1), np.float32, (), np.int32)
  test = pad_clients(
    [x[:10] for x in xs],
    [y[:10] for y in ys],
    (28, 28, 1),
    np.float32,
    (),
    np.int32,
  )
  empty = pad_clients(
    [x[:0] for x in xs],
    [y[:0] for y in ys],
    (28, 28, 1),
    np.float32,
    (),
    np.int32,
  )
  return to_device(
    FederatedData(
      train=train,
      val=empty,
      test=test,
      groups=-np.ones(num_clients, np.int32),
      num_classes=62,
      name='emnist_shaped',
    )
  )


def compiled(runner):
  """``[runner, state, times]`` after its first round (the compile), timed by
  ``time_interleaved``."""
  state = runner.init(jax.random.key(0))
  state, m = runner.round(state, jax.random.key(1000))  # compile
  jax.block_until_ready(m)
  return [runner, state, []]


def time_interleaved(runs: dict, rounds: int) -> None:
  """``rounds`` rounds of every run in turn (each meets the machine in the
  same state), each round's seconds appended to its ``times``."""
  for t in range(rounds):
    for run in runs.values():
      runner, state, times = run
      began = time.perf_counter()
      state, m = runner.round(state, jax.random.key(t))
      jax.block_until_ready((state, m))
      times.append(time.perf_counter() - began)
      run[1] = state


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--rounds', type=int, default=12)
  p.add_argument('--clients', type=int, default=20)
  p.add_argument('--cohort', type=int, default=10)
  a = p.parse_args()
  data = emnist_shaped(a.clients)
  sample = data.train.x[0, :1]
  runs = {}
  for name, (bn, rate) in VARIANTS.items():
    model = fp.models.from_flax(name, CNN(62, bn, rate), sample)
    for alg_name in ('fedavg',) + (('fedbn',) if bn else ()):
      alg = algorithms.build(
        alg_name, model, data, client_lr=0.05, batch_size=20
      )
      executor = fp.create_executor('auto', model, sample)
      runs[(name, alg_name)] = compiled(
        fp.RoundRunner(
          alg, data, fp.CohortSampler(a.clients, cohort_size=a.cohort), executor
        )
      )
  print(
    f'{a.clients} EMNIST-shaped clients (40-160 examples), cohort {a.cohort}, '
    f'batch 20, '
    f'one epoch; executor {executor.describe()}; '
    f'{jax.devices()[0].device_kind}; '
    f'{a.rounds} rounds each, interleaved'
  )
  time_interleaved(runs, a.rounds)
  plain = statistics.median(runs[('plain', 'fedavg')][2])
  print(
    f'{"model":<12}{"algorithm":<10}{"median ms":>10}{"min ms":>9}{"max ms":>9}'
    f'{"x plain":>9}'
  )
  for (name, alg_name), (_, _, times) in runs.items():
    med = statistics.median(times)
    print(
      f'{name:<12}{alg_name:<10}{1e3 * med:>10.1f}{1e3 * min(times):>9.1f}'
      f'{1e3 * max(times):>9.1f}{med / plain:>9.3f}'
    )


if __name__ == '__main__':
  main()
