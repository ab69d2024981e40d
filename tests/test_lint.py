"""The formatter's and the linter's checks pass on every folder of the
project (``ruff.toml``: Google's layout, two-space indents and 80 columns;
pyflakes' unused and undefined names and imports, f-strings without
placeholders, syntax errors, imports sorted), as the JAX projects run them."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = (
  'fedjax_personal',
  'algorithms',
  'datasets',
  'scripts',
  'benchmarks',
  'tests',
)


@pytest.mark.parametrize('command', [['check'], ['format', '--check']])
def test_ruff_finds_nothing(command):
  pytest.importorskip('ruff')
  r = subprocess.run(
    [sys.executable, '-m', 'ruff', *command, '--no-cache', *FOLDERS],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
