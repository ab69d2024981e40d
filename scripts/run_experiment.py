#!/usr/bin/env python
"""Runs federated experiments from absl flags (and flagfiles).

With no flags: the main job (scripts/configs/main.flags spells it out): 40
clients of the embedded MNIST 10k digits in 4 groups rotated 0/90/180/270
degrees, an MLP, 60 rounds; FedAvg, Local, Oracle, FedFomo, FedAlt and
personalized FedDyn + fine-tuning; prints the table of mean and worst-client
accuracy. Examples:

  python scripts/run_experiment.py
  python scripts/run_experiment.py --flagfile=scripts/configs/digits_fedavgm.flags
  python scripts/run_experiment.py --algorithm=fedavg,fedprox --fedprox_mu=0.1 --model=mlp
  python scripts/run_experiment.py --helpfull   # every flag, grouped per algorithm
"""

import os
import signal
import sys


def _during_start_up(signum, frame):
  """Ctrl-C or SIGTERM while JAX and the user's modules import (before the
  run's own handlers): one line, nothing was trained."""
  del frame
  word = 'interrupted' if signum == signal.SIGINT else 'terminated'
  print(
    f'error: {word} during start-up; nothing was trained yet; run the same '
    f'command again',
    file=sys.stderr,
    flush=True,
  )
  os._exit(128 + signum)


if __name__ == '__main__':
  for _signal in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_signal, _during_start_up)
  from fedjax_personal.run import experiment_entry  # noqa: E402  (JAX imports here: seconds)

  experiment_entry.run()
