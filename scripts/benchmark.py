#!/usr/bin/env python
"""Speed of a FedAvg round per executor, against the one-client-at-a-time loop.

For each model (MLP, LeNet-5) and population (10, 100, 1000 clients, each with
a small local data set drawn from real MNIST digits), every client runs K local
steps of batch B per round. Each executor of the engine (vmap, blocked,
sequential, and what ``auto`` picks) is timed against the baseline that other
FL libraries use: the same client code run one client at a time from a Python
loop, one jitted step per local batch, batches sliced on the host.

Every configuration runs in its own process, so compile time and peak memory
(max RSS) are its own. Printed per configuration: steady time per round,
compile time (first round minus a steady round), peak RSS, the achieved
GFLOP/s of the round (XLA's cost analysis of a local step x the number of
steps / time), and the speed-up over the baseline; the machine's float32
matmul GFLOP/s is measured in the same run.

  python scripts/benchmark.py                         # the full table (~15 min on 2 cores)
  python scripts/benchmark.py --models=mlp --clients=10,100 --rounds=2
"""

import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from typing import Optional, Tuple

from absl import app, flags

from fedjax_personal.hparams import Declared, hparam
from fedjax_personal.run import costs, script_entry


@dataclasses.dataclass(frozen=True)
class BenchmarkSettings(Declared):
  """The benchmark's settings (its flags)."""

  models: Tuple[str, ...] = hparam(('mlp', 'lenet5'), 'Models to time.')
  clients: Tuple[str, ...] = hparam(
    ('10', '100', '1000'), 'Populations (all clients in every round).'
  )
  executors: Tuple[str, ...] = hparam(
    ('torch', 'baseline', 'sequential', 'blocked', 'vmap', 'auto'),
    'Executors to time; torch = the PyTorch per-client loop (needs the bench '
    'extra; skipped '
    'with a note without torch); baseline = the same loop in JAX, one client, '
    'one jitted step '
    'at a time.',
  )
  conv_impl: str = hparam(
    'auto',
    'How the JAX models compute convolutions (models.Conv): auto = '
    'per platform.',
    choices=('auto', 'xla', 'matmul', 'tiled'),
  )
  rounds: int = hparam(3, 'Timed rounds after the compiling one.')
  local_steps: int = hparam(5, 'K local steps per client per round.')
  timeout: int = hparam(
    420, 'Seconds per configuration before it is reported as timeout.'
  )
  interleave: bool = hparam(
    True,
    'Executor table: start the configurations of one model and population as '
    'processes '
    'side by side (each compiled and warm) and time their rounds in turn, one '
    'round of each, '
    'rounds times; the "vs" columns are the medians of the round-by-round '
    'ratios, so a '
    'machine whose speed drifts moves both sides of each ratio. '
    '--nointerleave: one '
    'configuration after another (the --device preset, as an accelerator holds '
    'one '
    "process's memory at a time).",
  )
  output: Optional[str] = hparam(None, 'Write the results as JSON here.')
  worker: Optional[str] = hparam(
    None, 'Internal: run one configuration model:clients:executor.'
  )
  dry_run: bool = hparam(
    False, 'Print what would run (sections, sizes) and exit.'
  )
  worker_processes: int = hparam(1, 'Internal: processes of a worker group.')
  worker_process_id: int = hparam(0, "Internal: this worker's process.")
  worker_port: int = hparam(0, "Internal: the worker group's coordinator port.")
  process_counts: Tuple[str, ...] = hparam(
    ('1', '2', '4'), 'Processes of --section=processes (one CPU device each).'
  )
  process_clients: Tuple[str, ...] = hparam(
    ('1000', '10000'), 'Populations of --section=processes.'
  )
  plan_clients: Tuple[str, ...] = hparam(
    ('10000', '100000', '1000000'),
    'Populations of --section=memory (bytes by estimate, nothing run).',
  )
  section: str = hparam(
    'executors',
    'executors: the executor table; scale: time per round from '
    '10 to 10,000 clients for FedAvg and Ditto (auto executor vs the loop); '
    'sweep: S configurations in one program vs S separate runs; usercentric: '
    'user-centric rounds with and without the W recomputation (k-means, '
    'silhouette) vs FedAvg.',
    choices=(
      'executors',
      'scale',
      'sweep',
      'usercentric',
      'memory',
      'processes',
      'all',
    ),
  )
  usercentric_clients: Tuple[str, ...] = hparam(
    ('100', '1000'), 'Populations of --section=usercentric.'
  )
  scale_clients: Tuple[str, ...] = hparam(
    ('10', '100', '1000', '10000'), 'Populations of --section=scale.'
  )
  sweep_size: int = hparam(8, 'S of --section=sweep.')
  sweep_clients: str = hparam('100', 'Population of --section=sweep.')
  device: bool = hparam(
    False,
    'Print the devices the run uses (the benchmark runs unchanged on '
    'GPU/TPU: every section times the default backend, where auto picks vmap '
    'or sharded).',
  )


#: ``--device``: the accelerator run (MLP and LeNet-5 at 100 / 1,000 /
#: 10,000 clients on every fused executor, the scale, sweep and user-centric
#: sections); flags given on the command line win.
DEVICE_PRESET = {
  'clients': ('100', '1000', '10000'),
  'models': ('mlp', 'lenet5'),
  'executors': ('torch', 'auto', 'vmap', 'blocked', 'sharded'),
  'usercentric_clients': ('100', '1000'),
  'timeout': 600,
  'interleave': False,
}

script_entry.define_settings_flags(BenchmarkSettings)

# As in the foundation issue's measurements; the CNNs as LeNet-5.
BATCH = {'mlp': 10, 'lenet5': 32, 'cnn': 32, 'cnn_cifar': 32}
# examples per client
EXAMPLES = {
  'mlp': 50,
  'lenet5': 64,
  'cnn': 64,
  'cnn_cifar': 64,
}


def peak_rss_mb():
  """This process's peak RSS: VmHWM (``ru_maxrss`` survives ``execve``, so a
  worker would report its parent's peak when that was larger)."""
  try:
    with open('/proc/self/status') as f:
      for line in f:
        if line.startswith('VmHWM:'):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def stream_gbps(mib=64, reps=10):
  """Memory bandwidth as XLA sees it (``costs.stream_bytes_per_second``),
  GB/s."""
  return costs.stream_bytes_per_second(mib, reps) / 1e9


def matmul_gflops(n=2048, reps=10):
  return costs.matmul_flops_per_second(n, reps) / 1e9


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


def step_cost(model, opt, batch_size, in_shape=(28, 28, 1)):
  """XLA's cost analysis of one local SGD step: (flops, bytes, step)
  (``costs.local_step_cost``)."""
  return costs.local_step_cost(model, opt, batch_size, in_shape)


def baseline_runner(model, data, batching, opt):
  """The usual loop: per client, per local batch, one jitted step; host
  batches."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from fedjax_personal.core import batching as batching_lib

  _, _, step = step_cost(model, opt, BATCH[model.name], data.train.x.shape[2:])
  step = jax.jit(step)
  add = jax.jit(lambda acc, p, w: jax.tree.map(lambda a, b: a + w * b, acc, p))
  x = np.asarray(data.train.x)
  y = np.asarray(data.train.y)
  n = np.asarray(data.train.num_examples)
  idx_fn = jax.jit(
    lambda k, m: batching_lib.batch_indices(k, m, x.shape[1], batching)
  )

  def round_fn(params, key):
    acc = jax.tree.map(jnp.zeros_like, params)
    for i in range(len(n)):
      idx, mask = jax.device_get(idx_fn(jax.random.fold_in(key, i), n[i]))
      p, s = params, opt.init(params)
      for t in range(idx.shape[0]):
        sel = idx[t][mask[t]]
        p, s = step(p, s, x[i][sel], y[i][sel])
      acc = add(acc, p, np.float32(n[i] / n.sum()))
    return acc

  return round_fn


def median(xs):
  return sorted(xs)[len(xs) // 2]


def timed_rounds(cfg, run_round):
  """Seconds of the compiling round, then of the timed ones: ``cfg.rounds`` in a
  row, or, under ``--interleave``, one each time the parent writes ``round`` on
  stdin (after ``{"ready": true}`` on stdout; any other line ends)."""

  def timed():
    t = time.perf_counter()
    run_round()
    return time.perf_counter() - t

  times = [timed()]
  if not cfg.interleave:
    return times + [timed() for _ in range(cfg.rounds)]
  print(json.dumps({'ready': True}), flush=True)
  for line in sys.stdin:
    if line.strip() != 'round':
      break
    times.append(timed())
    print(json.dumps({'t': times[-1]}), flush=True)
  return times


def worker(cfg, spec):
  # one of a group of processes (--section=processes)
  if cfg.worker_processes > 1:
    from fedjax_personal.run import distributed

    distributed.initialize(
      {
        'coordinator_address': f'localhost:{cfg.worker_port}',
        'num_processes': cfg.worker_processes,
        'process_id': cfg.worker_process_id,
      },
      timeout=120,
    )
  import jax

  import fedjax_personal as fp
  from fedjax_personal.algorithms.fedavg import fedavg

  parts = spec.split(':')
  model_name, num_clients, executor = parts[:3]
  algorithm = parts[3] if len(parts) > 3 else 'fedavg'
  num_clients = int(num_clients)
  data, model, batching, opt = build(cfg, model_name, num_clients)
  flops, nbytes, _ = step_cost(
    model, opt, BATCH[model_name], data.train.x.shape[2:]
  )
  if executor == 'torch':
    import numpy as np
    import torch
    import torch_loop

    run_round = torch_loop.round_runner(
      model_name,
      np.asarray(data.train.x),
      np.asarray(data.train.y),
      np.asarray(data.train.num_examples),
      BATCH[model_name],
      cfg.local_steps,
      0.05,
    )
    times = timed_rounds(cfg, run_round)
    steady = median(times[1:])
    total_flops = flops * num_clients * cfg.local_steps
    print(
      json.dumps(
        {
          'model': model_name,
          'clients': num_clients,
          'executor': f'torch {torch.__version__} loop ('
          + (
            'cuda'
            if torch_loop.device().type == 'cuda'
            else f'{torch.get_num_threads()} threads'
          )
          + ')',
          'algorithm': 'fedavg',
          'round_s': steady,
          'compile_s': max(times[0] - steady, 0.0),
          'round_times': times[1:],
          'peak_rss_mb': peak_rss_mb(),
          'gflops': total_flops / steady / 1e9,
          'flops_per_round': total_flops,
          'step_flops': flops,
          'step_bytes': nbytes,
        }
      )
    )
    return
  ex = None
  if executor == 'baseline':
    round_fn = baseline_runner(model, data, batching, opt)
    state = model.init(jax.random.key(0))
    run = lambda s, k: round_fn(s, k)
  else:
    # 'blocked<N>': blocks of N clients (e.g. blocked1: one client at a time in
    # the program); 'blocked<N>t<T>': the same on T host threads.
    # 'sequential<N>': N host threads.
    import re

    m = re.fullmatch(r'blocked(\d+)(?:t(\d+))?', executor)
    bs = int(m.group(1)) if m else None
    nt = int(m.group(2) or 1) if m else 0
    nt = (
      int(executor[10:])
      if executor.startswith('sequential') and executor[10:].isdigit()
      else nt
    )
    ex = fp.create_executor(
      'blocked' if bs else 'sequential' if nt else executor,
      model,
      data.train.x[0, :1],
      block_size=bs,
      num_threads=nt,
    )
    if algorithm == 'ditto':
      from fedjax_personal.algorithms.ditto import ditto

      alg = ditto(model, num_clients, opt, batching, lam=0.1)
    else:
      alg = fedavg(model, num_clients, opt, batching)
    runner = fp.RoundRunner(
      alg, data, fp.CohortSampler(num_clients, cohort_size=num_clients), ex
    )
    state = runner.init(jax.random.key(0))
    run = lambda s, k: runner.round(s, k, donate=True)[0]
    executor = (
      f'{executor}->{ex.describe()}' if executor == 'auto' else ex.describe()
    )
  collectives = {}
  # what the compiled round communicates (XLA's)
  if getattr(ex, 'name', '') == 'sharded':
    from fedjax_personal.core import memory

    collectives = memory.hlo_collectives(
      runner.compiled_text(state, jax.random.key(0))
    )
  box = {'state': state, 'round': 0}

  def run_round():
    box['state'] = jax.block_until_ready(
      run(box['state'], jax.random.key(box['round']))
    )
    box['round'] += 1

  times = timed_rounds(cfg, run_round)
  steady = median(times[1:])
  total_flops = (
    flops * num_clients * cfg.local_steps * (2 if algorithm == 'ditto' else 1)
  )
  if jax.process_index() != 0:
    return
  print(
    json.dumps(
      {
        'model': model_name,
        'clients': num_clients,
        'executor': executor,
        'algorithm': algorithm,
        'processes': jax.process_count(),
        'devices': jax.device_count(),
        'collectives': collectives,
        'round_s': steady,
        'compile_s': max(times[0] - steady, 0.0),
        'round_times': times[1:],
        'peak_rss_mb': peak_rss_mb(),
        'gflops': total_flops / steady / 1e9,
        'flops_per_round': total_flops,
        'step_flops': flops,
        'step_bytes': nbytes,
      }
    )
  )


def main(argv):
  """The entry: the settings read once from the flags (with ``--device``,
  ``DEVICE_PRESET`` where a flag was not given), then the sections."""
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments {argv[1:]}')
  preset = {
    k: v for k, v in DEVICE_PRESET.items() if not flags.FLAGS[k].present
  }
  cfg = script_entry.read_settings(BenchmarkSettings)
  if cfg.device:
    cfg = dataclasses.replace(cfg, **preset)
  if cfg.dry_run:  # what would run, nothing timed
    keys = (
      'section',
      'models',
      'clients',
      'executors',
      'rounds',
      'local_steps',
      'interleave',
      'scale_clients',
      'process_counts',
      'process_clients',
      'plan_clients',
      'output',
    )
    for k in keys:
      value = getattr(cfg, k)
      print(f'{k}: {list(value) if isinstance(value, tuple) else value}')
    return
  if cfg.worker:
    worker(cfg, cfg.worker)
    return
  import jax

  from fedjax_personal.core import host

  if jax.default_backend() == 'cpu':
    host.tune_allocator()  # as the engine does on CPU (fedjax_personal/host.py)
  if cfg.device:
    print(
      f'devices: {[d.device_kind for d in jax.devices()]} '
      f'({jax.default_backend()})'
    )
  peak = matmul_gflops()
  dram, bandwidth = stream_gbps(256), stream_gbps(16)
  print(
    f'backend {jax.default_backend()}, {os.cpu_count()} cores; float32 matmul '
    f'{peak:.1f} GFLOP/s (2048x2048); a * 1.5 streams {dram:.1f} GB/s over 256 '
    f'MiB, '
    f'{bandwidth:.1f} GB/s over 16 MiB (cache-resident); this run'
  )
  print(
    '% roof: of min(peak, FLOP per byte of one local step (XLA cost analysis) '
    'x the '
    '16 MiB bandwidth)'
  )
  print(
    f'FedAvg round, all clients active, K={cfg.local_steps} local steps; '
    f'batch {BATCH}, examples per client {EXAMPLES}'
  )
  results = []
  if cfg.section in ('executors', 'all'):
    results += executors_section(cfg, peak, bandwidth)
  if cfg.section in ('scale', 'all'):
    results += scale_section(cfg, peak)
  if cfg.section in ('sweep', 'all'):
    results += sweep_section(cfg)
  if cfg.section in ('usercentric', 'all'):
    results += usercentric_section(cfg)
  if cfg.section in ('memory', 'all'):
    results += memory_section(cfg)
  if cfg.section in ('processes', 'all'):
    results += processes_section(cfg)
  save(cfg, results, peak, bandwidth)


def run_config(cfg, spec):
  """One worker process; its JSON, ``{'timeout': True}`` or ``{'failed':
  ...}``."""
  cmd = _worker_cmd(cfg, spec, False)
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


def _worker_cmd(cfg, spec, interleave):
  return [
    sys.executable,
    os.path.abspath(__file__),
    f'--worker={spec}',
    f'--conv_impl={cfg.conv_impl}',
    f'--rounds={cfg.rounds}',
    f'--local_steps={cfg.local_steps}',
    '--interleave' if interleave else '--nointerleave',
  ]


class _Worker:
  """One ``--interleave`` worker process: JSON lines out, commands in."""

  def __init__(self, cfg, spec):
    import tempfile

    self.err = tempfile.TemporaryFile(mode='w+')
    self.proc = subprocess.Popen(
      _worker_cmd(cfg, spec, True),
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=self.err,
      bufsize=0,
    )
    self.buf = b''

  def read(self, timeout):
    """The next JSON line; ``{'timeout': True}`` or ``{'failed': ...}``."""
    import select

    deadline = time.monotonic() + timeout
    while True:
      while b'\n' in self.buf:
        line, self.buf = self.buf.split(b'\n', 1)
        if line.startswith(b'{'):
          return json.loads(line)
      left = deadline - time.monotonic()
      if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
        self.kill()
        return {'timeout': True}
      chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
      if not chunk:
        code = self.proc.wait()
        self.err.seek(0)
        tail = self.err.read().strip().splitlines()[-1:]
        return {'failed': True, 'returncode': code, 'stderr': tail}
      self.buf += chunk

  def send(self, command):
    try:
      self.proc.stdin.write(command.encode() + b'\n')
      return True
    except BrokenPipeError:
      return False

  def kill(self):
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()


def run_interleaved(cfg, specs):
  """``run_config`` for several configurations timed in turn: each worker is
  started, compiled and warmed one after another (so compile times are their
  own), then every timed round runs one configuration at a time, A B C A B C
  ..., and each result carries its ``round_times`` in that order."""
  workers, results = {}, {}
  for spec in specs:
    w = _Worker(cfg, spec)
    r = w.read(cfg.timeout)
    if r.get('ready'):
      workers[spec] = w
    else:
      results[spec] = r
  for _ in range(cfg.rounds):
    for spec, w in list(workers.items()):
      r = (
        w.read(cfg.timeout)
        if w.send('round')
        else {'failed': True, 'returncode': None, 'stderr': ['worker exited']}
      )
      if 't' not in r:
        results[spec] = r
        w.kill()
        del workers[spec]
  for spec, w in workers.items():
    results[spec] = (
      w.read(cfg.timeout)
      if w.send('done')
      else {'failed': True, 'returncode': None, 'stderr': ['worker exited']}
    )
    w.kill()
  return [results[s] for s in specs]


def paired_speedup(cfg, base, row):
  """``base``'s round time over ``row``'s: the median of the round-by-round
  ratios when both were timed interleaved, else the ratio of the medians."""
  if cfg.interleave and len(base.get('round_times', ())) == len(
    row.get('round_times', ())
  ):
    return median(
      [b / t for b, t in zip(base['round_times'], row['round_times'])]
    )
  return base['round_s'] / row['round_s']


def executors_section(cfg, peak, bandwidth):
  """The executor table: every executor against the JAX loop and the
  PyTorch loop, with each row's share of the matmul peak and of its roofline
  (min(peak, FLOP per byte of a local step x memory bandwidth))."""
  import torch_loop

  executors = list(cfg.executors)
  if 'torch' in executors and not torch_loop.available():
    print(
      'note: torch is not installed (pip install -e ".[bench]"): no PyTorch '
      'loop rows, '
      'no "vs torch" column'
    )
    executors.remove('torch')
  header = (
    f'{"model":<9}{"clients":>8}  '
    f'{"executor":<30}{"round s":>9}{"compile s":>10}'
    f'{"peak MB":>9}{"GFLOP/s":>9}{"% peak":>7}{"% roof":>7}{"vs loop":>8}{"vs torch":>9}'
  )
  print(header)
  print('-' * len(header))
  rows = []
  for model_name in cfg.models:
    for clients in cfg.clients:
      base = {}
      specs = [f'{model_name}:{clients}:{executor}' for executor in executors]
      group = (
        run_interleaved(cfg, specs)
        if cfg.interleave
        else [run_config(cfg, s) for s in specs]
      )
      for executor, r in zip(executors, group):
        if r.get('timeout') or r.get('failed'):
          why = (
            f'timeout after {cfg.timeout} s'
            if r.get('timeout')
            else f'failed (exit {r["returncode"]}: {" ".join(r["stderr"])[:80]})'
          )
          print(f'{model_name:<9}{clients:>8}  {executor:<30}{why}', flush=True)
          rows.append(
            {
              'model': model_name,
              'clients': int(clients),
              'executor': executor,
              'error': why,
            }
          )
          continue
        if executor in ('baseline', 'torch'):
          base[executor] = r
        r['speedup_vs_loop'] = (
          paired_speedup(cfg, base['baseline'], r)
          if 'baseline' in base
          else None
        )
        r['speedup_vs_torch'] = (
          paired_speedup(cfg, base['torch'], r) if 'torch' in base else None
        )
        r['percent_of_matmul_peak'] = 100 * r['gflops'] / peak
        roof = min(
          peak, r['step_flops'] / max(r['step_bytes'], 1.0) * bandwidth
        )
        r['roofline_gflops'] = roof
        r['percent_of_roofline'] = 100 * r['gflops'] / roof
        rows.append(r)
        fmt = lambda v: f'{v:.2f}x' if v else '-'
        print(
          f'{model_name:<9}{clients:>8}  '
          f'{r["executor"][:29]:<30}{r["round_s"]:>9.3f}'
          f'{r["compile_s"]:>10.2f}{r["peak_rss_mb"]:>9.0f}{r["gflops"]:>9.2f}'
          f'{r["percent_of_matmul_peak"]:>6.1f}%{r["percent_of_roofline"]:>6.1f}%'
          f'{fmt(r["speedup_vs_loop"]):>8}{fmt(r["speedup_vs_torch"]):>9}',
          flush=True,
        )
  return rows


def save(cfg, results, peak, bandwidth):
  import jax

  if cfg.output:
    from fedjax_personal.run import (
      run_identity,  # strict JSON: a NaN is written as null
    )

    run_identity.write_json(
      cfg.output,
      {
        'matmul_gflops': peak,
        'memory_gbps': bandwidth,
        'backend': jax.default_backend(),
        'devices': [str(d) for d in jax.devices()],
        'cores': os.cpu_count(),
        'results': results,
      },
    )


def run_worker(cfg, spec):
  """``run_config``, None on a timeout."""
  r = run_config(cfg, spec)
  return None if r.get('timeout') else r


def scale_section(cfg, peak):
  """Time per round vs population, FedAvg and Ditto (MLP), auto vs the loop."""
  print(
    '\nScale: MLP, K=5 local steps, all clients active; auto executor vs the '
    'loop'
  )
  print(
    f'{"algorithm":<8}{"clients":>8}  '
    f'{"auto executor":<24}{"round s":>9}{"loop s":>9}'
    f'{"vs loop":>8}{"peak MB":>9}{"GFLOP/s":>9}'
  )
  rows = []
  for alg in ('fedavg', 'ditto'):
    for clients in cfg.scale_clients:
      r = run_worker(cfg, f'mlp:{clients}:auto:{alg}')
      base = (
        run_worker(cfg, f'mlp:{clients}:baseline') if alg == 'fedavg' else None
      )
      base = None if base is None or base.get('failed') else base
      if r is None or r.get('failed'):
        why = (
          'timeout'
          if r is None
          else f'failed (exit {r["returncode"]}; out of memory?)'
        )
        print(f'{alg:<8}{clients:>8}  {why}')
        rows.append({'algorithm': alg, 'clients': int(clients), 'failed': why})
        continue
      loop = base['round_s'] if base else None  # the loop baseline is FedAvg's
      r['loop_round_s'] = loop
      r['speedup_vs_loop'] = loop / r['round_s'] if loop else None
      rows.append(r)
      loop_s = f'{loop:.3f}' if loop else '-'
      ratio = f'{r["speedup_vs_loop"]:.2f}x' if loop else '-'
      print(
        f'{alg:<8}{clients:>8}  '
        f'{r["executor"]:<24}{r["round_s"]:>9.3f}{loop_s:>9}{ratio:>8}'
        f'{r["peak_rss_mb"]:>9.0f}{r["gflops"]:>9.2f}',
        flush=True,
      )
  return rows


def sweep_section(cfg):
  """S configurations (seeds) of FedAvg as the CLI runs them, vs S separate
  runs (one run's steady round x S, the auto executor), all in this process.

  With a fused ``auto`` executor (accelerators) the CLI runs a sweep as one
  program, ``SweepRunner``: every config axis (vmapped, ``lax.map`` loop, host
  loop) is timed. With a threaded one (CPU, dense models) it runs the
  configurations one after another (``LoopRuns``, one compile shared by the
  seeds): that row, plus the config axes of the same executor's fused form
  (one thread), each against the separate runs of ``auto``."""
  import dataclasses as dc

  import jax

  import fedjax_personal as fp
  from fedjax_personal import algorithms
  from fedjax_personal.core.engine import RoundRunner
  from fedjax_personal.run import sweep

  clients = int(cfg.sweep_clients)
  data, model, batching, _ = build(cfg, 'mlp', clients)
  mk = lambda hv: algorithms.build(
    'fedavg', model, data, batch_size=10, local_steps=cfg.local_steps, **hv
  )
  cfgs = sweep.configs(list(range(cfg.sweep_size)), {'client_lr': [0.05]})
  sampler = fp.CohortSampler(clients, cohort_size=clients)
  ex = fp.create_executor('auto', model, data.train.x[0, :1])
  single = RoundRunner(mk({'client_lr': 0.05}), data, sampler, ex)
  state = single.init(jax.random.key(0))
  state = jax.block_until_ready(single.round(state, jax.random.key(0))[0])
  t = time.perf_counter()
  for r in range(cfg.rounds):
    state = jax.block_until_ready(single.round(state, jax.random.key(r), r)[0])
  separate = (time.perf_counter() - t) / cfg.rounds * cfg.sweep_size
  auto = sweep.resolve_config_axis('auto') if ex.fused else 'one after another'
  print(
    f'\nSweep: FedAvg, MLP, {clients} clients ({ex.describe()}), S = '
    f'{cfg.sweep_size} seeds; '
    f'S separate runs: {separate:.3f} s per round of all S; the CLI runs it: '
    f'{auto}'
  )
  fused = ex if ex.fused else dc.replace(ex, num_threads=1)
  variants = (
    []
    if ex.fused
    else [
      (
        'one after another',
        lambda: sweep.LoopRuns(mk, cfgs, data, sampler, ex),
        ex,
      )
    ]
  )
  variants += [
    (
      axis,
      lambda axis=axis: sweep.SweepRunner(
        mk, cfgs, data, sampler, fused, config_axis=axis
      ),
      fused,
    )
    for axis in ('host', 'loop', 'vmap')
  ]
  rows = []
  for axis, make, used in variants:
    runner = make()
    t = time.perf_counter()
    states = jax.block_until_ready(runner.round(runner.init(), 0)[0])
    first = time.perf_counter() - t
    t = time.perf_counter()
    for r in range(cfg.rounds):  # rounds only, as the separate runs are timed
      states = jax.block_until_ready(runner.round(states, r + 1)[0])
    together = (time.perf_counter() - t) / cfg.rounds
    print(
      f'  {axis:<17} ({used.describe()}) {together:.3f} s per round (first '
      f'call incl. '
      f'compile {first:.1f} s): {separate / together:.2f}x of separate runs',
      flush=True,
    )
    rows.append(
      {
        'section': 'sweep',
        'S': cfg.sweep_size,
        'clients': clients,
        'executor': used.describe(),
        'config_axis': axis,
        'auto': axis == auto,
        'one_program_round_s': together,
        'separate_round_s': separate,
        'speedup': separate / together,
      }
    )
  return rows


def _timed(fn, reps):
  import jax

  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return min(times)


def usercentric_section(cfg):
  """User-centric rounds (MLP, K=5, all clients active, the auto executor)
  against FedAvg: a round without the collaboration phase, a round that
  recomputes W and the streams (k-means with k = 4, and the silhouette search
  over 2..max_streams), and the W step alone (gradient statistics of every
  client, eq. 6, clustering), each the best of 3 after compilation; all of
  them one compiled round function."""
  import jax
  import jax.numpy as jnp

  import fedjax_personal as fp
  from fedjax_personal import algorithms
  from fedjax_personal.core.algorithm import RoundContext
  from fedjax_personal.core.engine import RoundRunner, pre_round_functions

  print(
    '\nUser-centric vs FedAvg: MLP, K=5, all clients active, auto executor '
    '(its one-program '
    'form on CPU, so the W step is one compiled function); best of 3 (s)'
  )
  print(
    f'{"clients":>8}  '
    f'{"streams":<22}{"FedAvg":>8}{"UC round":>9}{"UC + W":>8}{"W step":>8}'
    f'{"traces":>7}'
  )
  rows = []
  for clients in map(int, cfg.usercentric_clients):
    data, model, _, _ = build(cfg, 'mlp', clients)
    sample_x = data.train.x[0, :1]
    ex = fp.create_executor('auto', model, sample_x)
    # CPU: blocked on host threads -> the same blocks in one program
    if not ex.fused:
      ex = dataclasses.replace(ex, num_threads=1)
    sampler = fp.CohortSampler(clients, cohort_size=clients)
    common = dict(batch_size=10, local_steps=cfg.local_steps, client_lr=0.05)
    fed = RoundRunner(
      algorithms.build('fedavg', model, data, **common), data, sampler, ex
    )
    state = fed.init(jax.random.key(0))
    state, _ = fed.round(state, jax.random.key(0), 0)
    box = [state]

    def fed_round():
      box[0], m = fed.round(box[0], jax.random.key(1), 1)
      return m

    fedavg_s = _timed(fed_round, 3)
    max_streams = min(clients - 1, 20 if clients > 200 else clients - 1)
    for label, kw in (
      ('k-means k=4', dict(num_streams=4)),
      (f'silhouette 2..{max_streams}', dict(max_streams=max_streams)),
    ):
      alg = algorithms.build(
        'usercentric',
        model,
        data,
        sigma_batch_size=10,
        recompute_every=2,
        **common,
        **kw,
      )
      runner = RoundRunner(alg, data, sampler, ex)
      st = [runner.init(jax.random.key(0))]
      # compiles (both branches)
      st[0], _ = runner.round(st[0], jax.random.key(0), 0)

      def uc_round(t):
        st[0], m = runner.round(st[0], jax.random.key(t), t)
        return m

      plain = _timed(lambda: uc_round(1), 3)  # odd rounds: no W
      with_w = _timed(lambda: uc_round(2), 3)  # even rounds: W recomputed
      run = jax.jit(pre_round_functions(alg, ex)[2])
      rc = RoundContext(jnp.asarray(2, jnp.int32), jax.random.key(5))
      w_step = _timed(lambda: run(st[0], rc, data.train, data.val), 3)
      traces = runner.trace_counts['round']
      print(
        f'{clients:>8}  '
        f'{label:<22}{fedavg_s:>8.3f}{plain:>9.3f}{with_w:>8.3f}{w_step:>8.3f}'
        f'{traces:>7}',
        flush=True,
      )
      rows.append(
        {
          'section': 'usercentric',
          'clients': clients,
          'streams': label,
          'executor': ex.describe(),
          'fedavg_round_s': fedavg_s,
          'usercentric_round_s': plain,
          'usercentric_round_with_w_s': with_w,
          'w_step_s': w_step,
          'round_traces': traces,
        }
      )
    # FedFomo: every client downloads M candidates and weighs them on its
    # validation split (here its training examples; the timing is the same).
    fomo_data = dataclasses.replace(data, val=data.train)
    fomo = RoundRunner(
      algorithms.build('fedfomo', model, fomo_data, **common),
      fomo_data,
      sampler,
      ex,
    )
    fs = [fomo.init(jax.random.key(0))]
    fs[0], _ = fomo.round(fs[0], jax.random.key(0), 0)

    def fomo_round():
      fs[0], m = fomo.round(fs[0], jax.random.key(1), 1)
      return m

    fomo_s = _timed(fomo_round, 3)
    print(
      f'{clients:>8}  FedFomo round {fomo_s:.3f} s (FedAvg {fedavg_s:.3f} s, '
      f'{fomo_s / fedavg_s:.2f}x), traces {fomo.trace_counts["round"]}',
      flush=True,
    )
    rows.append(
      {
        'section': 'fedfomo',
        'clients': clients,
        'executor': ex.describe(),
        'fedavg_round_s': fedavg_s,
        'fedfomo_round_s': fomo_s,
      }
    )
  return rows


# -- several processes and the scale plan
# ----------------------------------------

PLAN_ALGORITHMS = (
  ('fedavg', {}),
  ('fedavg', {'client_momentum': 0.9, 'client_opt_state': 'persistent'}),
  ('scaffold', {}),
  ('feddyn', {}),
  ('ditto', {}),
  ('fedalt', {}),
  ('fedfomo', {}),
  ('usercentric', {}),
)


def memory_section(cfg):
  """The scale plan by estimate (``core.memory``; nothing is run): per-client
  state of each algorithm family (MLP, 199,210 parameters), what a round with
  10% of the clients needs per device, and the devices (powers of two) it
  takes on 16 GB and 80 GB accelerators."""
  import types

  import numpy as np

  import fedjax_personal as fp
  from fedjax_personal import algorithms
  from fedjax_personal.core import memory
  from fedjax_personal.errors import ConfigError

  model = fp.create_model('mlp', 10, np.zeros((1, 28, 28, 1), np.uint8))
  print(
    '\nScale plan (estimate): MLP, 10% of the clients per round, batch 10; per '
    'N: '
    'per-client state, GB per device on one device, devices needed on 16 GB / '
    '80 GB'
  )
  print(
    f'{"algorithm":<20}'
    + ''.join(f'{"N=" + format(int(n), ","):>30}' for n in cfg.plan_clients)
  )
  rows = []
  for name, extra in PLAN_ALGORITHMS:
    label = name + (' +momentum' if extra else '')
    cells = []
    for n in map(int, cfg.plan_clients):
      x = np.zeros((1, 1, 28, 28, 1), np.uint8)
      zeros = np.zeros(n, np.int32)
      split = types.SimpleNamespace(
        max_examples=50,
        x=x,
        y=np.zeros((1, 1), np.int32),
        num_examples=zeros + 50,
      )
      data = types.SimpleNamespace(
        num_clients=n,
        train=split,
        val=split,
        test=split,
        groups=zeros,
        num_classes=10,
      )
      try:
        alg = algorithms.build(name, model, data, batch_size=10, **extra)
        need = memory.estimate(alg, data, cohort_size=max(1, n // 10))
      # an N x N matrix built on the host (user-centric's W)
      except MemoryError:
        cells.append(f'{f"N x N: {4 * n * n / 2**30:,.0f} GB":>30}')
        continue
      fit = []
      for gb in (16, 80):
        d = 1
        while d <= 1 << 16:
          try:
            memory.block_size(need, gb << 30, d)
            break
          except ConfigError:
            d *= 2
        fit.append(d)
      rows.append(
        {
          'section': 'memory',
          'algorithm': label,
          'clients': n,
          'client_state_bytes': need.client_state_bytes,
          'shared_bytes': need.shared_bytes,
          'resident_bytes_one_device': need.resident(1),
          'working_bytes_per_client': need.working_bytes,
          'devices_16gb': fit[0],
          'devices_80gb': fit[1],
        }
      )
      cells.append(
        f'{need.client_state_bytes / 1e6:>9.2f} '
        f'MB{need.resident(1) / 2**30:>9.1f}'
        f'{fit[0]:>5}{fit[1]:>5}'
      )
    print(f'{label:<20}' + ''.join(cells), flush=True)
  return rows


def processes_section(cfg):
  """FedAvg rounds (MLP) with the client axis over 1, 2, 4 processes of one
  CPU device each (jax.distributed on localhost, Gloo collectives), and the
  collectives XLA compiled into the round. On one machine the processes
  share its cores: the figures show the cost of the multi-process runtime,
  not a speed-up."""
  import socket

  print(
    '\nProcesses: FedAvg, MLP, K=5 local steps, all clients active; sharded '
    'executor, '
    '1 CPU device per process'
  )
  print(
    f'{"clients":>8}{"processes":>10}{"round s":>9}{"vs 1":>7}  collectives '
    f'per round '
    '(count, bytes per device)'
  )
  rows = []
  for clients in cfg.process_clients:
    base = None
    for p in map(int, cfg.process_counts):
      with socket.socket() as s:
        s.bind(('', 0))
        port = s.getsockname()[1]
      env = {**os.environ, 'JAX_NUM_CPU_DEVICES': '1', 'JAX_PLATFORMS': 'cpu'}
      cmds = [
        _worker_cmd(cfg, f'mlp:{clients}:sharded', False)
        + [
          f'--worker_processes={p}',
          f'--worker_process_id={i}',
          f'--worker_port={port}',
        ]
        for i in range(p)
      ]
      procs = [
        subprocess.Popen(
          c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for c in cmds
      ]
      try:
        outs = [pr.communicate(timeout=cfg.timeout) for pr in procs]
      except subprocess.TimeoutExpired:
        for pr in procs:
          pr.kill()
        print(f'{clients:>8}{p:>10}  timeout')
        continue
      line = [l for l in outs[0][0].splitlines() if l.startswith('{')]
      if not line:
        print(
          f'{clients:>8}{p:>10}  failed: {outs[0][1].strip().splitlines()[-1:]}'
        )
        continue
      r = json.loads(line[-1])
      base = base or r['round_s']
      r['vs_one_process'] = base / r['round_s']
      r['section'] = 'processes'
      rows.append(r)
      coll = (
        ', '.join(
          f'{k} {c}x {b / 1e6:.2f} MB'
          for k, (c, b) in sorted(r['collectives'].items())
        )
        or 'none'
      )
      print(
        f'{clients:>8}{p:>10}{r["round_s"]:>9.3f}{r["vs_one_process"]:>6.2f}x  '
        f'{coll}',
        flush=True,
      )
  return rows


if __name__ == '__main__':
  script_entry.run_script(main)
