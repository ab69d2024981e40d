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

# Its sections are modules beside it (also when read by runpy, as the flag
# list does).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_common import (  # noqa: E402
  BATCH,
  EXAMPLES,
  build,
  run_config,
  worker_command,
)
from benchmark_sections import (  # noqa: E402
  memory_section,
  processes_section,
  scale_section,
  sweep_section,
  usercentric_section,
)


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


class _Worker:
  """One ``--interleave`` worker process: JSON lines out, commands in."""

  def __init__(self, cfg, spec):
    import tempfile

    self.err = tempfile.TemporaryFile(mode='w+')
    self.proc = subprocess.Popen(
      worker_command(cfg, spec, True),
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


if __name__ == '__main__':
  script_entry.run_script(main)
