"""The README's main job, exactly as a newcomer runs it (slow: about 2 minutes
on 2 cores; run with  python -m pytest -m slow)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED_METHODS = ('fedfomo', 'fedalt', 'pfeddyn_ft')


@pytest.mark.slow
def test_main_job_with_no_flags(tmp_path):
  """Runs, writes its outputs, and tells the README's story: a seed method
  above both FedAvg and Local on the mean and on the worst client (final
  evaluation and the mean over the last 5 evaluations)."""
  r = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, 'scripts', 'run_experiment.py'),
      '--progress=false',
      '--plots=wait',
    ],
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  out = r.stdout
  assert 'mnist/rotation, mlp, 60 rounds' in out
  for alg in ('fedavg', 'local', 'oracle') + SEED_METHODS:
    assert any(
      line.startswith(alg) and '%' in line for line in out.splitlines()
    ), out
  run_dir = next((tmp_path / 'runs').iterdir())
  assert (run_dir / 'accuracy.png').exists()
  rows = json.load(open(run_dir / 'comparison.json'))
  keys = (
    'accuracy_mean',
    'accuracy_worst',
    'accuracy_mean_window',
    'accuracy_worst_window',
  )
  assert any(
    all(rows[m][k] > max(rows['fedavg'][k], rows['local'][k]) for k in keys)
    for m in SEED_METHODS
  ), {m: [rows[m][k] for k in keys] for m in rows}


def test_main_flagfile_spells_out_the_defaults():
  """scripts/configs/main.flags is the main job: every value in it is the
  flag's default."""
  from absl import flags

  from fedjax_personal.run import experiment_entry  # noqa: F401  defines the flags

  for line in open(os.path.join(ROOT, 'scripts', 'configs', 'main.flags')):
    line = line.strip()
    if not line or line.startswith('#'):
      continue
    name, value = line[2:].split('=', 1)
    flag = flags.FLAGS[name]
    default = flag.default
    if name == 'val_fraction':  # default None: 0.1 because fedfomo needs it
      assert value == '0.1' and default is None
      continue
    assert flag.parser.parse(value) == default, (name, value, default)
