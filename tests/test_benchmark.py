"""The accelerator command of scripts/benchmark.py runs end to end (on CPU,
in a tiny configuration, so it cannot rot before a GPU/TPU runs it)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_benchmark(tmp_path, *flags, device=True):
  out = tmp_path / 'bench.json'
  cmd = (
    [sys.executable, os.path.join(ROOT, 'scripts', 'benchmark.py')]
    + (['--device'] if device else [])
    + [
      '--models=lenet5',
      '--clients=3',
      '--executors=torch,baseline,auto',
      '--rounds=1',
      '--local_steps=2',
      f'--output={out}',
      *flags,
    ]
  )
  proc = subprocess.run(
    cmd, capture_output=True, text=True, timeout=600, cwd=ROOT
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  return proc.stdout, json.loads(out.read_text())


@pytest.mark.slow  # ~19 s; the interleaved table below runs in the suite
def test_device_command_executor_table(tmp_path):
  # auto against the PyTorch loop where torch is installed (CI: the MLP and
  # auto alone; LeNet-5 and the JAX-loop rows run in the slow test below).
  text, report = run_benchmark(
    tmp_path, '--section=executors', '--executors=torch,auto', '--models=mlp'
  )
  for part in ('devices:', 'float32 matmul', 'vs torch'):
    assert part in text, (part, text)
  assert report['matmul_gflops'] > 0 and report['memory_gbps'] > 0
  table = [r for r in report['results'] if 'error' not in r]
  executors = {r['executor'].split('->')[0].split(' ')[0] for r in table}
  assert 'auto' in executors, report['results']
  for r in table:
    assert r['round_s'] > 0 and 0 < r['percent_of_matmul_peak'] <= 100
    assert ('torch' in executors) == (r['speedup_vs_torch'] is not None)


@pytest.mark.slow  # ~14 s; the benchmark's commands dry-run in test_docs
def test_interleaved_executor_table_pairs_rounds(tmp_path):
  # The CPU default: workers side by side, rounds timed in turn, "vs" columns
  # from round-by-round ratios.
  text, report = run_benchmark(
    tmp_path,
    '--models=mlp',
    '--executors=baseline,auto',
    '--rounds=3',
    device=False,
  )
  base, auto = report['results']
  assert base['executor'] == 'baseline' and auto['executor'].startswith(
    'auto->'
  )
  assert len(base['round_times']) == len(auto['round_times']) == 3
  ratios = sorted(
    b / a for b, a in zip(base['round_times'], auto['round_times'])
  )
  assert auto['speedup_vs_loop'] == pytest.approx(ratios[1])
  assert base['speedup_vs_loop'] == pytest.approx(1.0)


@pytest.mark.slow  # ~2.5 min: every section's programs compile
def test_device_command_runs_every_section(tmp_path):
  text, report = run_benchmark(
    tmp_path,
    '--section=all',
    '--scale_clients=3',
    '--usercentric_clients=5',
    '--sweep_size=2',
    '--sweep_clients=3',
    '--process_clients=3',
    '--process_counts=1,2',
  )
  for part in (
    'Scale:',
    'Sweep:',
    'User-centric vs FedAvg',
    'FedFomo round',
    'Processes:',
  ):
    assert part in text, (part, text)
  rows = report['results']
  # the executor table's rows
  table = [r for r in rows if 'speedup_vs_torch' in r]
  assert {r['executor'].split('->')[0].split(' ')[0] for r in table} >= {
    'baseline',
    'auto',
  }
  assert all(
    r['executor'].startswith('torch') or r['speedup_vs_loop'] > 0 for r in table
  )
  assert any(r.get('algorithm') == 'ditto' and 'round_s' in r for r in rows), (
    rows
  )
  assert {r['config_axis'] for r in rows if r.get('section') == 'sweep'} >= {
    'host',
    'loop',
    'vmap',
  }
  assert any(r.get('section') == 'fedfomo' for r in rows)


@pytest.mark.parametrize(
  'shape,flags',
  [
    ('emnist', ['--dataset=emnist', '--model=mlp']),
    pytest.param(
      'stackoverflow',
      ['--dataset=stackoverflow', '--model=lstm_lm', '--vocab_size=100'],
      marks=pytest.mark.slow,
    ),
    pytest.param(
      'shakespeare',
      ['--dataset=shakespeare', '--model=reddi_char_lstm'],
      marks=pytest.mark.slow,
    ),
  ],
)
@pytest.mark.slow_variants('emnist-flags0')
def test_peer_benchmark_files_train_here(tmp_path, shape, flags):
  """The peer benchmark's files (benchmarks/peers/make_files.py, FedJAX's
  schema) are read by this project as the published ones are: a small
  population trains 2 rounds through the CLI in the host layout (FedJAX's
  side runs in its own venv, outside the suite)."""
  folder = tmp_path / shape
  made = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, 'benchmarks', 'peers', 'make_files.py'),
      f'--shape={shape}',
      '--num_clients=6',
      f'--folder={folder}',
    ],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert made.returncode == 0, made.stderr[-2000:]
  run = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, 'scripts', 'run_experiment.py'),
      *flags,
      f'--data_dir={folder}',
      '--algorithm=fedavg',
      '--cohort_size=3',
      '--rounds=2',
      '--eval_every=0',
      '--progress=false',
      '--layout=host',
      f'--output_dir={tmp_path}/out',
      '--batch_size=8',
    ],
    capture_output=True,
    text=True,
    timeout=600,
    cwd=ROOT,
    env=dict(os.environ, FEDJAX_PERSONAL_CACHE=str(tmp_path / 'cache')),
  )
  assert run.returncode == 0, run.stderr[-2000:]
  summary = json.loads(
    (tmp_path / 'out' / 'fedavg' / 'summary.json').read_text()
  )
  assert summary['rounds'] == 2 and 'round_seconds_median' in summary
  assert 'executor: blocked' in run.stdout  # auto on this CPU, with its reason


def test_round_bound_counts_every_matmul_of_a_scan_body_per_step():
  """benchmarks/peers/bounds.py's FLOPs: a matmul in a scan of 5 steps
  counts 5 times, beside one outside it (hand-computed)."""
  sys.path.insert(0, os.path.join(ROOT, 'benchmarks', 'peers'))
  import bounds
  import jax
  import jax.numpy as jnp

  def f(a, w, v):
    # [2,3]@[3,3]
    h = jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), a, None, length=5)[0]
    return h @ v  # [2,3]@[3,4]

  jaxpr = jax.make_jaxpr(f)(
    jnp.ones((2, 3)), jnp.ones((3, 3)), jnp.ones((3, 4))
  ).jaxpr
  found = bounds.matmuls(jaxpr)
  assert sorted((c, fl) for c, fl, _ in found.values()) == [
    (1, 2 * 2 * 3 * 4),
    (5, 5 * 2 * 2 * 3 * 3),
  ]
  # the bare loop taken off
  assert all(0 <= bounds.op_seconds(e) < 1 for _, _, e in found.values())
