"""The sections of ``scripts/benchmark.py`` beyond the executors' table:
time per round against the population (``scale``), a sweep's configurations
in one program (``sweep``), user-centric FL's collaboration round
(``usercentric``), the scale plan by estimate (``memory``) and several
processes (``processes``)."""

import dataclasses
import json
import os
import subprocess
import time

from benchmark_common import build, run_worker, worker_command


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
  from fedjax_personal.errors import SettingError

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
          except SettingError:
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
        worker_command(cfg, f'mlp:{clients}:sharded', False)
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
