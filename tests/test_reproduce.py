"""The reproduce scripts run end to end on tiny settings, with trials (slow:
a few minutes; run with  python -m pytest -m slow tests/test_reproduce.py)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPTS = {
    'reproduce_user_centric.py': ['--rounds=2', '--num_clients=4', '--streams=2'],
    'reproduce_debiasing.py': ['--rounds=2', '--personal_rounds=2', '--num_clients=4',
                               '--personal_eval_every=1', '--participation=1'],
    'reproduce_personalization.py': ['--mnist_clients=10', '--mnist_rounds=2',
                                     '--shakespeare_clients=2', '--shakespeare_rounds=1',
                                     '--shakespeare_local_steps=1', '--cifar_clients=4',
                                     '--cifar_rounds=2', '--methods=fedalt/output,fedsim/output'],
}


@pytest.mark.slow
@pytest.mark.parametrize('script', sorted(SCRIPTS))
def test_reproduce_script_runs_with_trials(tmp_path, script):
  r = subprocess.run([sys.executable, os.path.join(ROOT, 'scripts', script), '--trials=2',
                      f'--output_dir={tmp_path}'] + SCRIPTS[script], cwd=tmp_path,
                     capture_output=True, text=True, timeout=1200)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
  assert '±' in r.stdout and '2 trials' in r.stdout, r.stdout[-3000:]
  assert any(f.endswith('.json') for f in os.listdir(tmp_path))
