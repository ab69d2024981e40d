"""benchmarks/accelerator.py, the accelerator check, runs every section at
toy sizes on this CPU (``--smoke``), so it cannot rot before a GPU runs it."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_accelerator_check_runs_every_section(tmp_path):
  out = tmp_path / 'accelerator.json'
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, 'benchmarks', 'accelerator.py'),
      '--smoke',
      f'--output={out}',
      f'--work_dir={tmp_path}',
    ],
    capture_output=True,
    text=True,
    timeout=900,
    cwd=ROOT,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
  rows = json.loads(out.read_text())['rows']
  assert not [r for r in rows if r.get('error')], rows
  sections = {r['section'] for r in rows}
  assert sections >= {
    'device',
    'populations',
    'models',
    'main_job',
    'tests',
    'sweep',
  }, sections
  device = next(r for r in rows if r['section'] == 'device')
  assert set(device['peak_flops']) == {'float32', 'tf32', 'bf16'}
  pops = [r for r in rows if r['section'] == 'populations']
  assert {r['layout'] for r in pops} == {'device', 'host'} and any(
    not r['prefetch'] for r in pops
  )
  assert all(r['round_s'] > 0 and r['flops_per_round'] > 0 for r in pops)
  tests = next(r for r in rows if r['section'] == 'tests')
  assert 'collected' in tests['summary'] and tests['returncode'] == 0
  main_job = next(r for r in rows if r['section'] == 'main_job')
  assert main_job['table'] and set(main_job['readme']) >= set(main_job['table'])
  assert 'Accelerator check' in proc.stdout and '% fp32' in proc.stdout


def test_accelerator_check_orchestrates_a_section_in_ci(tmp_path):
  """CI's share (every section at toy sizes is slow): the orchestrator, its
  workers and its JSON rows, with the device section."""
  out = tmp_path / 'accelerator.json'
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, 'benchmarks', 'accelerator.py'),
      '--smoke',
      '--sections=device',
      f'--output={out}',
      f'--work_dir={tmp_path}',
    ],
    capture_output=True,
    text=True,
    timeout=600,
    cwd=ROOT,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
  rows = json.loads(out.read_text())['rows']
  assert {r['section'] for r in rows} == {'device'} and not [
    r for r in rows if r.get('error')
  ], rows
