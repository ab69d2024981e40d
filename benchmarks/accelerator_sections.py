"""The sections of ``benchmarks/accelerator.py`` (the accelerator check),
each run in a process of its own: ``python benchmarks/accelerator.py
--worker=<section>``. Each prints its progress and its result rows (``ROW``
and one JSON object a line) for the orchestrator."""

import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# scripts/benchmark.py's round: batch, examples per client, K local steps, lr.
BATCH = {'mlp': 10, 'lenet5': 32, 'cnn_cifar': 32}
EXAMPLES = {'mlp': 50, 'lenet5': 64, 'cnn_cifar': 64}
LOCAL_STEPS, LR = 5, 0.05
GB = 1 << 30


def emit(row):
  """A result row, on one line the orchestrator reads."""
  print('ROW ' + json.dumps(row), flush=True)


def median(xs):
  xs = sorted(xs)
  return xs[len(xs) // 2]


def smoke_executor(smoke):
  """``auto``; at smoke sizes ``vmap``, the executor ``auto`` picks on one
  GPU (a CPU's ``auto`` runs threaded blocks: another path, more compiles)."""
  return 'vmap' if smoke else 'auto'


def timed_rounds(step, rounds):
  """(first call's seconds, [seconds of each of ``rounds`` more calls])."""
  t = time.perf_counter()
  step(0)
  first = time.perf_counter() - t
  times = []
  for r in range(rounds):
    t = time.perf_counter()
    step(r + 1)
    times.append(time.perf_counter() - t)
  return first, times


# -- device -------------------------------------------------------------------


def device_section(smoke):
  import jax

  from fedjax_personal.run import costs

  versions = {}
  for name in (
    'jax',
    'jaxlib',
    'flax',
    'optax',
    'chex',
    'orbax.checkpoint',
    'numpy',
    'torch',
  ):
    try:
      mod = __import__(name, fromlist=['__version__'])
      versions[name] = getattr(mod, '__version__', '?')
    except ImportError:
      versions[name] = None
  if versions['torch']:
    import torch

    versions['torch_cuda'] = (
      torch.version.cuda if torch.cuda.is_available() else None
    )
  d = jax.devices()[0]
  stats = d.memory_stats() or {}
  n = 1024 if smoke else 8192
  peaks = {
    p: costs.matmul_flops_per_second(n, 3 if smoke else 20, p)
    for p in ('float32', 'tf32', 'bf16')
  }
  bandwidth = costs.stream_bytes_per_second(
    16 if smoke else 2048, 3 if smoke else 10
  )
  print(
    f'device: {jax.device_count()} x {d.device_kind} '
    f'({jax.default_backend()}), '
    f'memory limit {stats.get("bytes_limit", 0) / GB:.1f} GB; '
    + ', '.join(f'{k} {v}' for k, v in versions.items())
  )
  print(
    f'matmul {n}x{n}: '
    + ', '.join(f'{p} {v / 1e12:.1f} TFLOP/s' for p, v in peaks.items())
    + f'; a * 1.5 streams {bandwidth / 1e9:.0f} GB/s'
  )
  emit(
    {
      'section': 'device',
      'device': d.device_kind,
      'backend': jax.default_backend(),
      'devices': jax.device_count(),
      'versions': versions,
      'memory_limit_gb': stats.get('bytes_limit', 0) / GB,
      'peak_flops': peaks,
      'bandwidth_bytes_s': bandwidth,
      'preallocate': os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'),
    }
  )


# -- models (scripts/benchmark.py's round) -------------------------------------


def client_arrays(model_name, num_clients, seed=0):
  """uint8 [N, M, H, W, C] examples, int32 [N, M] labels and [N] counts: real
  MNIST digits (embedded) for the MLP and LeNet-5, CIFAR-shaped random
  images for the CIFAR CNN (its speed does not depend on the pixels)."""
  import numpy as np

  from fedjax_personal.datasets import in_memory

  rng = np.random.default_rng(seed)
  m = EXAMPLES[model_name]
  if model_name == 'cnn_cifar':
    x = rng.integers(0, 256, (num_clients, m, 32, 32, 3), dtype=np.uint8)
    y = rng.integers(0, 10, (num_clients, m)).astype(np.int32)
  else:
    px, py, _ = in_memory.load_mnist()
    idx = np.stack(
      [rng.choice(len(py), m, replace=False) for _ in range(num_clients)]
    )
    x, y = px[idx], py[idx]
  return x, y, np.full(num_clients, m, np.int32)


def fedavg_setup(model_name, num_clients, conv_impl='auto'):
  """(device data, model, FLOPs of one round) of ``scripts/benchmark.py``'s
  round: FedAvg with K local steps of ``BATCH`` on every client."""
  import numpy as np
  import optax

  import fedjax_personal as fp
  from fedjax_personal.core.data import FederatedData, pad_clients, to_device
  from fedjax_personal.run import costs

  x, y, _ = client_arrays(model_name, num_clients)
  train = pad_clients(list(x), list(y), x.shape[2:], x.dtype)
  empty = pad_clients(
    [x[0, :0]] * num_clients, [y[0, :0]] * num_clients, x.shape[2:], x.dtype
  )
  data = to_device(
    FederatedData(
      train=train,
      val=empty,
      test=train,
      groups=-np.ones(num_clients, np.int32),
      num_classes=10,
    )
  )
  model = fp.create_model(model_name, 10, x[0, :1], conv_impl=conv_impl)
  flops, _, _ = costs.local_step_cost(
    model, optax.sgd(LR), BATCH[model_name], x.shape[2:]
  )
  return data, model, flops * num_clients * LOCAL_STEPS


def fedavg_runner(data, model, seed=0, executor='auto', precision='float32'):
  """A RoundRunner of FedAvg on every client of ``data`` (the ``auto``
  executor, or ``executor``) at matmul precision ``precision``, and its
  first state."""
  import jax

  import fedjax_personal as fp
  from fedjax_personal import algorithms

  n = data.num_clients
  alg = algorithms.build(
    'fedavg',
    model,
    data,
    batch_size=BATCH[model.name],
    local_steps=LOCAL_STEPS,
    client_lr=LR,
  )
  runner = fp.RoundRunner(
    alg,
    data,
    fp.CohortSampler(n, cohort_size=n),
    fp.create_executor(executor, model, data.train.x[0, :1]),
    matmul_precision=precision,
  )
  return runner, runner.init(jax.random.key(seed))


def models_section(smoke, chosen=None):
  import jax

  from fedjax_personal import numerics

  sizes = (2, 3) if smoke else (1000, 10000)
  grid = [
    (m, n, 'auto', 'float32')
    for m in ('mlp', 'lenet5', 'cnn_cifar')
    for n in sizes
  ]
  grid += [
    ('lenet5', sizes[0], 'xla', 'float32'),
    ('lenet5', sizes[0], 'auto', 'tf32'),
    ('cnn_cifar', sizes[0], 'auto', 'tf32'),
  ]
  if smoke:  # each kind of row once
    grid = [
      ('mlp', 2, 'auto', 'float32'),
      ('mlp', 3, 'auto', 'float32'),
      ('lenet5', 2, 'xla', 'float32'),
    ]
  if chosen:
    grid = [
      (m, int(n), c, p)
      for m, n, c, p in (x.split(':') for x in chosen.split(';'))
    ]
  for model_name, n, conv, precision in grid:
    try:
      numerics.check_precision(precision)
      data, model, flops = fedavg_setup(model_name, n, conv)
      runner, state = fedavg_runner(
        data, model, executor=smoke_executor(smoke), precision=precision
      )
      box = {'state': state}

      def step(r):
        box['state'] = jax.block_until_ready(
          runner.round(box['state'], jax.random.key(r), r, donate=True)[0]
        )

      first, times = timed_rounds(step, 1 if smoke or n > 1000 else 2)
      row = {
        'section': 'models',
        'model': model_name,
        'clients': n,
        'conv_impl': conv,
        'precision': precision,
        'executor': runner.executor.describe(),
        'round_s': median(times),
        'first_round_s': first,
        'flops_per_round': flops,
      }
      print(
        f'{model_name:9s} {n:>6,} clients, conv {conv}, {precision}: '
        f'{row["round_s"]:.4f} s/round (first {first:.1f} s), '
        f'{row["executor"]}',
        flush=True,
      )
      emit(row)
      runner = state = box = data = None  # freed before the next row
    except Exception as e:
      # out of memory, a kernel the backend lacks: reported
      emit(
        {
          'section': 'models',
          'model': model_name,
          'clients': n,
          'conv_impl': conv,
          'precision': precision,
          'error': f'{type(e).__name__}: {str(e)[:300]}',
        }
      )


def torch_section(smoke):
  try:
    import torch
  except ImportError:
    print('torch: not installed; the PyTorch rows are skipped')
    return
  sys.path.insert(0, os.path.join(ROOT, 'scripts'))
  import torch_loop

  n = 2 if smoke else 1000
  for model_name in (
    ('mlp', 'lenet5') if smoke else ('mlp', 'lenet5', 'cnn_cifar')
  ):
    x, y, counts = client_arrays(model_name, n)
    warm = torch_loop.round_runner(
      model_name,
      x[:20],
      y[:20],
      counts[:20],
      BATCH[model_name],
      LOCAL_STEPS,
      LR,
    )
    warm()  # kernels chosen and loaded on a few clients
    run_round = torch_loop.round_runner(
      model_name, x, y, counts, BATCH[model_name], LOCAL_STEPS, LR
    )
    t = time.perf_counter()
    run_round()
    seconds = time.perf_counter() - t
    where = torch_loop.device().type
    print(
      f'torch {torch.__version__} loop ({where}) {model_name:9s} {n:,} '
      f'clients: '
      f'{seconds:.2f} s/round',
      flush=True,
    )
    emit(
      {
        'section': 'torch',
        'model': model_name,
        'clients': n,
        'round_s': seconds,
        'device': where,
        'version': torch.__version__,
      }
    )


# -- the EMNIST-shaped population ---------------------------------------------


def populations_section(smoke, work_dir, chosen=None):
  """FedAvg on an EMNIST-shaped population (``benchmarks/populations.py``'s
  generator and model), in one process: one store, every configuration."""
  import jax
  import numpy as np
  import optax

  sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
  import populations

  import fedjax_personal as fp
  from fedjax_personal import algorithms, numerics
  from fedjax_personal.config import TrainingConfig
  from fedjax_personal.core.engine import RoundRunner
  from fedjax_personal.core.population.placement import HostData
  from fedjax_personal.core.sampling import CohortSampler
  from fedjax_personal.run import costs

  clients = 30 if smoke else 3400
  small, big = (2, 4) if smoke else (50, 500)
  cap = 8 if smoke else 256
  settings = populations.PopulationSettings(
    shape='emnist',
    num_clients=clients,
    work_dir=work_dir,
    max_client_examples=cap,
  )
  t = time.perf_counter()
  store = populations.open_or_generate(settings)
  population = store.population(cap)
  mean_examples = float(np.mean(store.counts_capped('train', cap)))
  print(
    f'{store.name}: {store.num_clients:,} writers, {mean_examples:.0f} '
    f'training examples '
    f'each on average (capped at {cap}), ready in '
    f'{time.perf_counter() - t:.0f} s',
    flush=True,
  )
  training = TrainingConfig(client_lr=0.05, batch_size=20)
  device_data = jax.device_put(store.padded(cap))
  rounds = 1 if smoke else 3
  configs = [  # (layout, cohort, executor, block, precision, conv, prefetch)
    ('device', small, 'auto', None, 'float32', 'auto', True),
    ('device', big, 'auto', None, 'float32', 'auto', True),
    ('host', small, 'auto', None, 'float32', 'auto', True),
    ('host', big, 'auto', None, 'float32', 'auto', True),
    ('host', big, 'auto', None, 'float32', 'auto', False),
    ('device', big, 'auto', None, 'tf32', 'auto', True),
    ('device', big, 'auto', None, 'bf16x3', 'auto', True),
    ('device', big, 'blocked', big // 5, 'float32', 'auto', True),
    ('device', big, 'auto', None, 'float32', 'xla', True),
  ]
  # the code paths (each layout, blocks, the prefetch off, another precision)
  if smoke:
    configs = [
      ('device', small, 'blocked', small, 'float32', 'auto', True),
      ('host', big, 'auto', None, 'float32', 'auto', False),
    ]
  if chosen:
    configs = [
      (l, int(c), e, int(b) or None, p, v, f == '1')
      for l, c, e, b, p, v, f in (x.split(':') for x in chosen.split(';'))
    ]
  for layout, cohort, executor, block, precision, conv, prefetch in configs:
    label = (
      f'{layout:6s} cohort {cohort:>3}, {precision}, conv {conv}, {executor}'
      + (f' {block}' if block else '')
      + ('' if prefetch else ', no prefetch')
    )
    try:
      numerics.check_precision(precision)
      model = fp.models.from_flax(
        'emnist', fp.models.CNN(62, conv_impl=conv), population.sample_x
      )
      flops, _, _ = costs.local_step_cost(
        model,
        optax.sgd(0.05),
        20,
        population.sample_x.shape[1:],
        population.sample_x.dtype,
      )
      data = HostData(store, cap) if layout == 'host' else device_data
      alg = algorithms.build('fedavg', model, population, training=training)
      ex = fp.create_executor(
        smoke_executor(smoke) if executor == 'auto' else executor,
        model,
        population.sample_x,
        block_size=block,
      )
      runner = RoundRunner(
        alg,
        data,
        CohortSampler(store.num_clients, cohort_size=cohort),
        ex,
        matmul_precision=precision,
      )
      key = jax.random.key(0)
      box = {'state': runner.init(key)}

      def step(r):
        nxt = jax.random.fold_in(key, r + 1) if prefetch else None
        box['state'], m = runner.round(
          box['state'], jax.random.fold_in(key, r), r, donate=True, next_key=nxt
        )
        float(m['train_loss'])  # the round is done

      first, times = timed_rounds(step, (1 if conv == 'xla' else rounds))
      # one epoch of each client's examples
      per_round = flops / 20 * mean_examples * cohort
      row = {
        'section': 'populations',
        'layout': layout,
        'cohort': cohort,
        'executor': runner.executor.describe(),
        'precision': precision,
        'conv_impl': conv,
        'prefetch': prefetch,
        'round_s': float(np.mean(times)),
        'round_median_s': median(times),
        'first_round_s': first,
        'flops_per_round': per_round,
        'label': label,
      }
      print(
        f'{label}: {row["round_s"]:.3f} s/round (first {first:.1f} s), '
        f'{row["executor"]}',
        flush=True,
      )
      emit(row)
      runner = box = None  # freed before the next row
    except Exception as e:
      emit(
        {
          'section': 'populations',
          'label': label,
          'error': f'{type(e).__name__}: {str(e)[:300]}',
        }
      )


# -- a sweep of seeds
# -----------------------------------------------------------


def sweep_section(smoke):
  import jax

  import fedjax_personal as fp
  from fedjax_personal import algorithms
  from fedjax_personal.run import sweep

  n, seeds = (2, 2) if smoke else (1000, 8)
  data, model, _ = fedavg_setup('mlp', n)
  single, state = fedavg_runner(data, model, executor=smoke_executor(smoke))
  box = {'state': state}

  def one(r):
    box['state'] = jax.block_until_ready(
      single.round(box['state'], jax.random.key(r), r)[0]
    )

  _, times = timed_rounds(one, 1 if smoke else 3)
  separate = median(times) * seeds
  mk = lambda hv: algorithms.build(
    'fedavg',
    model,
    data,
    batch_size=BATCH['mlp'],
    local_steps=LOCAL_STEPS,
    **hv,
  )
  cfgs = sweep.configs(list(range(seeds)), {'client_lr': [LR]})
  sampler, ex = fp.CohortSampler(n, cohort_size=n), single.executor
  together = (sweep.SweepRunner if ex.fused else sweep.LoopRuns)(
    mk, cfgs, data, sampler, ex
  )
  box['states'] = together.init()

  def many(r):
    box['states'] = jax.block_until_ready(together.round(box['states'], r)[0])

  first, times = timed_rounds(many, 1 if smoke else 3)
  print(
    f'sweep: FedAvg, MLP, {n:,} clients, {seeds} seeds as one program '
    f'{median(times):.4f} s/round (first {first:.1f} s) vs {seeds} separate '
    f'runs '
    f'{separate:.4f} s: {separate / median(times):.2f}x',
    flush=True,
  )
  emit(
    {
      'section': 'sweep',
      'clients': n,
      'seeds': seeds,
      'one_program_round_s': median(times),
      'separate_round_s': separate,
      'speedup': separate / median(times),
    }
  )


# -- the main job and the tests ------------------------------------------------

TABLE_ROW = re.compile(r'^(\w+)\s+((?:[\d.]+%\s*)+)$')


def table_cells(text):
  """{algorithm: [cells]} of a printed comparison table."""
  out = {}
  for line in text.splitlines():
    m = TABLE_ROW.match(line.strip())
    if m:
      out[m.group(1)] = [float(c) for c in re.findall(r'([\d.]+)%', m.group(2))]
  return out


def readme_table():
  with open(os.path.join(ROOT, 'README.md')) as f:
    text = f.read()
  block = text.split('ends with', 1)[1].split('```', 2)[1]
  return table_cells(block)


def main_job_section(smoke, work_dir):
  cmd = [
    sys.executable,
    os.path.join(ROOT, 'scripts', 'run_experiment.py'),
    '--noprogress',
    f'--output_dir={os.path.join(work_dir, "main_job")}',
    '--overwrite',
  ]
  if smoke:
    cmd += [
      '--algorithm=fedavg',
      '--num_clients=4',
      '--rounds=1',
      '--max_examples=400',
    ]
  t = time.perf_counter()
  out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
  wall = time.perf_counter() - t
  print('\n'.join(out.stdout.splitlines()[-9:]))
  if out.returncode:
    emit({'section': 'main_job', 'error': out.stderr[-500:], 'wall_s': wall})
    return
  got, want = table_cells(out.stdout), readme_table()
  diffs = {
    a: [round(g - w, 2) for g, w in zip(got[a], want[a])]
    for a in got
    if a in want
  }
  worst = max((abs(d) for ds in diffs.values() for d in ds), default=None)
  print(
    f"main job: {wall:.0f} s; largest difference from the README's table: "
    + (f'{worst:.2f} points' if worst is not None else 'no common row')
    + (' (smoke: another job, not comparable)' if smoke else ''),
    flush=True,
  )
  for a, ds in diffs.items():
    if any(ds):
      print(f'  {a:12s} ' + ' '.join(f'{d:+6.2f}' for d in ds))
  emit(
    {
      'section': 'main_job',
      'wall_s': wall,
      'table': got,
      'readme': want,
      'differences': diffs,
      'largest_difference': worst,
      'comparable': not smoke,
    }
  )


def tests_section(smoke):
  """The backend-dependent tests, their results streamed (a run cut off by
  its time still says which passed and failed)."""
  cmd = [
    sys.executable,
    '-m',
    'pytest',
    '-m',
    'accelerator and not slow',
    '-p',
    'no:cacheprovider',
    '-W',
    'ignore::DeprecationWarning',
    '--tb=line',
  ]
  cmd += (
    ['--collect-only', '-q', '-n', '0']
    if smoke
    else ['-v', '-n', str(min(8, os.cpu_count() or 1))]
  )
  t = time.perf_counter()
  # XLA's default optimisation (tests/conftest.py compiles at LLVM -O0 unless
  # XLA_FLAGS is set): the accelerator's numbers as a user's run has them.
  env = dict(os.environ, XLA_FLAGS=os.environ.get('XLA_FLAGS', ''))
  proc = subprocess.Popen(
    cmd,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    cwd=ROOT,
    env=env,
  )
  counts, failures, last = {}, [], ''
  for line in proc.stdout:
    m = re.search(r'\b(PASSED|FAILED|ERROR|SKIPPED)\b', line)
    if m and '::' in line:
      counts[m.group(1)] = counts.get(m.group(1), 0) + 1
      if m.group(1) in ('FAILED', 'ERROR'):
        failures.append(line.strip()[-200:])
        print(line.rstrip(), flush=True)
    elif line.strip():
      last = line.strip()
      if re.search(r'(passed|failed|collected|error)', last):
        print(last, flush=True)
  proc.wait()
  emit(
    {
      'section': 'tests',
      'returncode': proc.returncode,
      'summary': last,
      'counts': counts,
      'seconds': time.perf_counter() - t,
      'collect_only': smoke,
      'failures': failures[:20],
    }
  )
