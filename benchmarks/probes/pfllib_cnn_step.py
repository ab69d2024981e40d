"""The bound of the PFLlib leaderboard's rows on a CPU: one local step of
PFLlib's FedAvgCNN (``pfllib_cnn``, MNIST, batch 10), here and in PyTorch.

A FedAvg-shaped round of PFLlib's scenario is 750 such steps (7,491
training examples, batch 10, partial batches dropped), so its time is the
step's time. Printed: the project's step (loss, gradient, SGD update, one
compiled call) per ``--conv_impl``, run alone (XLA may use every core) and
on two host threads at once (what the ``auto`` executor does: two clients
side by side); with ``--pinned``, the same step in two processes pinned to
one core each (``taskset``: the machine's ceiling for two independent
streams of steps); with torch installed, PyTorch's step of PFLlib's own
``FedAvgCNN`` (``--pfllib``: its ``system/`` folder) at 1 and 2 threads.

  python benchmarks/probes/pfllib_cnn_step.py --pfllib=<PFLlib>/system --pinned
"""

import dataclasses
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal.core.losses import Batch, batch_loss
from fedjax_personal.hparams import Declared, hparam
from fedjax_personal.models import create_model
from fedjax_personal.run import script_entry


@dataclasses.dataclass(frozen=True)
class ProbeSettings(Declared):
  """The probe's settings (its flags)."""

  steps: int = hparam(400, 'Steps timed per figure.', minimum=1)
  pfllib: Optional[str] = hparam(
    None, "PFLlib's system/ folder, for PyTorch's step of its FedAvgCNN."
  )
  pinned: bool = hparam(
    False, 'Also time two processes pinned to one core each (taskset).'
  )
  conv_impl: str = hparam(
    'tiled,matmul,xla', 'Convolution implementations, comma-separated.'
  )
  alone: str = hparam(
    '', 'Internal: time one conv_impl alone after a pause (the pinned run).'
  )


script_entry.define_settings_flags(ProbeSettings)

BATCH = 10


def _step(impl: str):
  """The compiled step of ``impl`` and its arguments."""
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.randn(BATCH, 28, 28, 1), jnp.float32)
  y = jnp.asarray(rng.randint(0, 10, BATCH), jnp.int32)
  batch = Batch(x, y, jnp.ones(BATCH, bool))
  model = create_model(
    'pfllib_cnn', 10, np.asarray(x[:1]), init='pytorch', conv_impl=impl
  )
  params = model.init(jax.random.key(0))

  @jax.jit
  def step(p, b):
    g = jax.grad(lambda q: batch_loss(model, q, b)[0])(p)
    return jax.tree.map(lambda v, d: v - 0.005 * d, p, g)

  jax.block_until_ready(step(params, batch))
  return step, params, batch


def _ms_per_step(step, params, batch, n: int) -> float:
  out = step(params, batch)
  jax.block_until_ready(out)
  start = time.perf_counter()
  for _ in range(n):
    out = step(params, batch)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / n * 1e3


def _two_threads(step, params, batch, n: int) -> float:
  times = []

  def run():
    times.append(_ms_per_step(step, params, batch, n))

  threads = [threading.Thread(target=run) for _ in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return float(np.mean(times))


def _pinned(impl: str, n: int) -> Optional[float]:
  """ms per step of each of two processes pinned to cores 0 and 1."""
  if shutil.which('taskset') is None or (os.cpu_count() or 1) < 2:
    return None
  cmd = [sys.executable, os.path.abspath(__file__), f'--alone={impl}']
  cmd.append(f'--steps={n}')
  procs = [
    subprocess.Popen(
      ['taskset', '-c', str(core)] + cmd,
      stdout=subprocess.PIPE,
      stderr=subprocess.DEVNULL,
      text=True,
    )
    for core in (0, 1)
  ]
  outs = [float(p.communicate()[0].strip().split()[-1]) for p in procs]
  return float(np.mean(outs))


def _torch_steps(pfllib: str, n: int):
  """PyTorch's ms per step of PFLlib's FedAvgCNN at 1 and 2 threads."""
  try:
    import torch  # noqa: PLC0415
  except ImportError:
    return None
  sys.path.insert(0, os.path.abspath(pfllib))
  from flcore.trainmodel.models import FedAvgCNN  # noqa: PLC0415

  out = {}
  for threads in (1, 2):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = FedAvgCNN(in_features=1, num_classes=10, dim=1024)
    opt = torch.optim.SGD(model.parameters(), lr=0.005)
    x, y = torch.randn(BATCH, 1, 28, 28), torch.randint(0, 10, (BATCH,))
    loss = torch.nn.CrossEntropyLoss()

    def step():
      opt.zero_grad()
      loss(model(x), y).backward()
      opt.step()

    for _ in range(20):
      step()
    start = time.perf_counter()
    for _ in range(n):
      step()
    out[threads] = (time.perf_counter() - start) / n * 1e3
  return out


def main(cfg: ProbeSettings):
  if cfg.alone:  # one pinned process of ``--pinned``
    fn = _step(cfg.alone)
    time.sleep(2.0)  # both processes compiled: time them together
    print(f'{_ms_per_step(*fn, cfg.steps):.3f}')
    return
  n = cfg.steps
  for impl in cfg.conv_impl.split(','):
    fn = _step(impl)
    line = (
      f'conv_impl={impl}: a step {_ms_per_step(*fn, n):.2f} ms alone, '
      f'{_two_threads(*fn, n):.2f} ms on each of two threads'
    )
    if cfg.pinned:
      pinned = _pinned(impl, n)
      if pinned is not None:
        line += f', {pinned:.2f} ms in each of two processes pinned to a core'
    print(line, flush=True)
  if cfg.pfllib:
    torch_ms = _torch_steps(cfg.pfllib, n)
    if torch_ms is not None:
      print(
        f"PyTorch, PFLlib's FedAvgCNN: {torch_ms[1]:.2f} ms a step on 1 "
        f'thread, {torch_ms[2]:.2f} ms on 2'
      )
  print(
    f'batch {BATCH}; JAX {jax.__version__}, {jax.default_backend()}, '
    f'{os.cpu_count()} cores'
  )


if __name__ == '__main__':
  script_entry.run_script(main, settings=ProbeSettings)
