"""Every script's flags keep their names, defaults and types: the list
(``tests/data/flag_list.json``, made by ``tests/flag_list.py``; written
before the settings were reorganised, a flag or choice added since written
into it with its change) against the scripts' flags now."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_flag_keeps_its_name_default_and_type():
  r = subprocess.run(
    [sys.executable, os.path.join(ROOT, 'tests', 'flag_list.py')],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
  )
  assert r.returncode == 0, r.stderr[-2000:]
  now = json.loads(r.stdout)
  with open(os.path.join(ROOT, 'tests', 'data', 'flag_list.json')) as f:
    before = json.load(f)
  assert set(now) == set(before)
  for script in before:
    changed = {
      k: (before[script].get(k), now[script].get(k))
      for k in set(before[script]) | set(now[script])
      if before[script].get(k) != now[script].get(k)
    }
    assert not changed, (script, changed)
