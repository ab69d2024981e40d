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

from fedjax_personal.run import cli

if __name__ == '__main__':
  cli.run()
