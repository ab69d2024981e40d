"""The run's settings flow type-checks: mypy finds no error in
``fedjax_personal/run/`` (the settings read once into typed objects and
passed down, every step reading typed fields), with the package laid out as
a wheel installs it (``algorithms/`` and ``datasets/`` inside it)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mypy_finds_no_error_in_the_run(tmp_path):
  pytest.importorskip('mypy')
  view = tmp_path / 'view' / 'fedjax_personal'
  view.mkdir(parents=True)
  for name in os.listdir(os.path.join(ROOT, 'fedjax_personal')):
    if name != '__pycache__':
      os.symlink(os.path.join(ROOT, 'fedjax_personal', name), view / name)
  for name in ('algorithms', 'datasets'):  # where setup.cfg's package_dir puts them
    os.symlink(os.path.join(ROOT, name), view / name)
  r = subprocess.run(
      [sys.executable, '-m', 'mypy', 'fedjax_personal/run', '--config-file',
       os.path.join(ROOT, 'setup.cfg'), '--cache-dir', str(tmp_path / 'cache')],
      cwd=tmp_path / 'view', capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
