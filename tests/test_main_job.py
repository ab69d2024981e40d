"""The README's main job, exactly as a newcomer runs it (slow: about 3 minutes
on 2 cores; run with  python -m pytest -m slow)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_main_job_with_no_flags(tmp_path):
  r = subprocess.run([sys.executable, os.path.join(ROOT, 'scripts', 'run_experiment.py'),
                      '--progress=false'], cwd=tmp_path, capture_output=True, text=True,
                     timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  out = r.stdout
  assert 'mnist/dirichlet, lenet5, 30 rounds' in out
  for alg in ('fedavg', 'local', 'fedavg_ft'):
    assert any(line.startswith(alg) and '%' in line for line in out.splitlines()), out
  run_dir = next((tmp_path / 'runs').iterdir())
  assert (run_dir / 'accuracy.png').exists() and (run_dir / 'comparison.json').exists()
