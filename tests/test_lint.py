"""The linter's checks pass on every folder of the project (``ruff.toml``:
pyflakes' unused and undefined names and imports, f-strings without
placeholders, syntax errors), as the JAX projects run one."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ('fedjax_personal', 'algorithms', 'datasets', 'scripts', 'benchmarks', 'tests')


def test_the_linter_finds_nothing():
  r = subprocess.run([sys.executable, '-m', 'ruff', 'check', '--no-cache', *FOLDERS],
                     cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
