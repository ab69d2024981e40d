#!/usr/bin/env python
"""Runs federated experiments from absl flags (and flagfiles).

With no flags: the main job, FedAvg vs Local vs FedAvg + fine-tuning on real
MNIST digits (embedded), 20 clients, Dirichlet 0.4, LeNet-5; prints the table
of mean and worst-client accuracy. Examples:

  python scripts/run_experiment.py
  python scripts/run_experiment.py --flagfile=scripts/configs/digits_fedprox.flags
  python scripts/run_experiment.py --algorithm=fedavg,fedprox --model=mlp --rounds=50
"""

from absl import app

from fedjax_personal import cli

if __name__ == '__main__':
  app.run(cli.main)
