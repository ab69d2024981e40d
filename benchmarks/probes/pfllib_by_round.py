"""PFLlib's own code for one algorithm on the PFLlib leaderboard's
scenario, evaluated after every round: what PFLlib's accuracy is at the
leaderboard's rounds, and whether PFLlib's code diverges where this
project's does.

This runs PFLlib's server and clients (``--algorithm``: the leaderboard's
clients, model, batch, rate and the algorithm's settings,
``scripts/reproduce_pfllib.py``) for ``--rounds`` rounds with PFLlib's
evaluation after each, and prints what PFLlib prints (its averaged train
loss and test accuracy) until it stops. FD, for one, hands the raw global
average logits of an example's label to PyTorch's ``CrossEntropyLoss`` as
target probabilities; a negative target makes that loss unbounded below.

  python benchmarks/probes/pfllib_by_round.py --pfllib=<PFLlib>/system \
      --algorithm=fd --rounds=3
"""

import argparse
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _module(name, path):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--pfllib', required=True, help="PFLlib's system/ folder")
  p.add_argument('--algorithm', default='fd')
  p.add_argument('--rounds', type=int, default=3)
  # torch's seed: the initial weights and PFLlib's shuffles
  p.add_argument('--seed', type=int, default=0)
  a = p.parse_args()
  import torch  # noqa: PLC0415  (the bench extra)

  board = _module(
    'reproduce_pfllib', os.path.join(ROOT, 'scripts', 'reproduce_pfllib.py')
  )
  _, clients, _ = board.federation(None)
  peer = _module('pfllib_reference', board.PEER_FILE)
  sys.path.insert(0, os.path.abspath(a.pfllib))
  peer.stand_ins()
  peer.patch_reader(
    torch,
    lambda i, is_train: clients[i][:2] if is_train else clients[i][2:],
  )
  from flcore.trainmodel.models import FedAvgCNN  # noqa: PLC0415

  torch.manual_seed(a.seed)
  server, _ = peer.pfllib_server(
    torch,
    a.algorithm,
    FedAvgCNN(in_features=1, num_classes=10, dim=1024),
    board.LEADERBOARD[a.algorithm],
    dataset='MNIST',
    num_classes=10,
    batch_size=board.BATCH,
    local_learning_rate=board.LR,
    global_rounds=a.rounds,
    local_epochs=1,
    num_clients=board.NUM_CLIENTS,
    eval_gap=1,
  )
  try:
    server.train()
  except ValueError as e:  # scikit-learn's AUC refuses NaN outputs
    print(f'PFLlib stopped: ValueError: {e}')
  print('PFLlib test accuracy after each evaluation:', server.rs_test_acc)
  print('PFLlib train loss after each evaluation:', server.rs_train_loss)


if __name__ == '__main__':
  main()
