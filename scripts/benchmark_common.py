"""What ``scripts/benchmark.py`` and its sections share: the populations it
times (``build``: MNIST or CIFAR-10 clients of a fixed size) and its worker
processes (``run_config``: one configuration in a process of its own, so
that its compile time and peak memory are its own)."""

import json
import os
import subprocess
import sys

#: The script whose ``--worker`` runs one configuration.
SCRIPT = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), 'benchmark.py'
)


# As in the foundation issue's measurements; the CNNs as LeNet-5.
BATCH = {'mlp': 10, 'lenet5': 32, 'cnn': 32, 'cnn_cifar': 32}


# examples per client
EXAMPLES = {
  'mlp': 50,
  'lenet5': 64,
  'cnn': 64,
  'cnn_cifar': 64,
}


def build(cfg, model_name, num_clients):
  import numpy as np
  import optax

  import fedjax_personal as fp
  from fedjax_personal.core.data import FederatedData, pad_clients, to_device
  from fedjax_personal.datasets import in_memory

  if model_name == 'cnn_cifar':
    from fedjax_personal.datasets import cifar

    x, y, _ = cifar.load('cifar10', None)
  else:
    x, y, _ = in_memory.load_mnist()
  rng = np.random.default_rng(0)
  n = EXAMPLES[model_name]
  idx = [rng.choice(len(y), n, replace=False) for _ in range(num_clients)]
  train = pad_clients(
    [x[i] for i in idx], [y[i] for i in idx], x.shape[1:], x.dtype
  )
  data = to_device(
    FederatedData(
      train=train,
      val=pad_clients(
        [x[:0]] * num_clients, [y[:0]] * num_clients, x.shape[1:], x.dtype
      ),
      test=train,
      groups=-np.ones(num_clients, np.int32),
      num_classes=10,
    )
  )
  model = fp.create_model(model_name, 10, x[:1], conv_impl=cfg.conv_impl)
  batching = fp.Batching(
    BATCH[model_name], num_epochs=None, num_steps=cfg.local_steps
  )
  return data, model, batching, optax.sgd(0.05)


def run_config(cfg, spec):
  """One worker process; its JSON, ``{'timeout': True}`` or ``{'failed':
  ...}``."""
  cmd = worker_command(cfg, spec, False)
  try:
    out = subprocess.run(
      cmd, capture_output=True, text=True, timeout=cfg.timeout
    )
  except subprocess.TimeoutExpired:
    return {'timeout': True}
  line = [l for l in out.stdout.splitlines() if l.startswith('{')]
  # e.g. killed for memory, or torch missing: report, do not stop the table
  if not line:
    return {
      'failed': True,
      'returncode': out.returncode,
      'stderr': out.stderr.strip().splitlines()[-1:] if out.stderr else [],
    }
  return json.loads(line[-1])


def worker_command(cfg, spec, interleave):
  return [
    sys.executable,
    SCRIPT,
    f'--worker={spec}',
    f'--conv_impl={cfg.conv_impl}',
    f'--rounds={cfg.rounds}',
    f'--local_steps={cfg.local_steps}',
    '--interleave' if interleave else '--nointerleave',
  ]


def run_worker(cfg, spec):
  """``run_config``, None on a timeout."""
  r = run_config(cfg, spec)
  return None if r.get('timeout') else r
