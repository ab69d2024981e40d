"""What stragglers and lost uploads cost a round (``core/system.py``): the same
FedProx (which keeps a straggler's partial work) and FedAvg (which drops it)
rounds with full, reliable clients, with 50% and 90% stragglers, and with
half the uploads lost, on one EMNIST-shaped cohort of a small CNN with the
executor ``auto`` picks; rounds interleaved so that every variant meets the
machine in the same state; the median round of each and its ratio to the
same algorithm without a system, measured in one run. A straggler runs only
the epochs it drew (its steps past them are masked, and the executor groups
clients by the work they do); a client whose upload is lost anyway does none.

    python benchmarks/probes/straggler_cost.py --rounds=12 > benchmarks/probes/straggler_cost.txt
"""

import argparse
import os
import statistics
import sys

import jax

import fedjax_personal as fp
from fedjax_personal import algorithms
from fedjax_personal.core.system import SystemConfig

sys.path.insert(0, os.path.dirname(__file__))
from model_state_cost import CNN, compiled, emnist_shaped, time_interleaved  # noqa: E402  (the same cohort)

SYSTEMS = {
  'none': None,
  'stragglers 50%': SystemConfig(stragglers=0.5),
  'stragglers 90%': SystemConfig(stragglers=0.9),
  'uploads lost 50%': SystemConfig(drop_after=0.5),
}


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--rounds', type=int, default=12)
  p.add_argument('--clients', type=int, default=20)
  p.add_argument('--cohort', type=int, default=10)
  p.add_argument('--epochs', type=int, default=4)
  a = p.parse_args()
  data = emnist_shaped(a.clients)
  sample = data.train.x[0, :1]
  model = fp.models.from_flax('cnn', CNN(62, False, 0.0), sample)
  executor = fp.create_executor('auto', model, sample)
  runs = {}
  for alg_name in ('fedprox', 'fedavg'):
    alg = algorithms.build(
      alg_name,
      model,
      data,
      client_lr=0.05,
      batch_size=20,
      local_epochs=a.epochs,
    )
    for name, system in SYSTEMS.items():
      runs[(alg_name, name)] = compiled(
        fp.RoundRunner(
          alg,
          data,
          fp.CohortSampler(a.clients, cohort_size=a.cohort),
          executor,
          system=system,
        )
      )
  print(
    f'{a.clients} EMNIST-shaped clients (40-160 examples), cohort {a.cohort}, '
    f'batch 20, '
    f'{a.epochs} epochs; executor {executor.describe()}; '
    f'{jax.devices()[0].device_kind}; '
    f'{a.rounds} rounds each, interleaved'
  )
  time_interleaved(runs, a.rounds)
  print(
    f'{"algorithm":<10}{"system":<18}{"median ms":>10}{"min ms":>9}{"max ms":>9}'
    f'{"x none":>8}'
  )
  for (alg_name, name), (_, _, times) in runs.items():
    med, base = (
      statistics.median(times),
      statistics.median(runs[(alg_name, 'none')][2]),
    )
    print(
      f'{alg_name:<10}{name:<18}{1e3 * med:>10.1f}{1e3 * min(times):>9.1f}'
      f'{1e3 * max(times):>9.1f}{med / base:>8.3f}'
    )


if __name__ == '__main__':
  main()
