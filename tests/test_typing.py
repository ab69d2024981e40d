"""The type checker: mypy (``setup.cfg``'s ``[mypy]``: every body checked,
annotated or not) finds no error in the package, ``algorithms/`` and
``datasets/`` laid out as a wheel installs them, and it does find a
misspelled attribute where the project reads typed settings and outputs
(``run/experiment_entry.py``'s distributed settings, an algorithm's client output)."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _view(tmp_path, changed=None):
  """The package as a wheel lays it out (symlinks), with ``changed``'s files
  ({path under the package: (old, new)}) copied and edited."""
  view = tmp_path / 'view' / 'fedjax_personal'
  view.mkdir(parents=True)
  sources = {
    n: os.path.join(ROOT, 'fedjax_personal', n)
    for n in os.listdir(os.path.join(ROOT, 'fedjax_personal'))
    if n != '__pycache__'
  }
  sources.update({n: os.path.join(ROOT, n) for n in ('algorithms', 'datasets')})
  changed = changed or {}
  for name, src in sources.items():
    if any(p.split('/')[0] == name for p in changed):
      shutil.copytree(
        src, view / name, ignore=shutil.ignore_patterns('__pycache__')
      )
    else:
      os.symlink(src, view / name)
  for path, (old, new) in changed.items():
    text = (view / path).read_text()
    assert old in text, (path, old)
    (view / path).write_text(text.replace(old, new, 1))
  return view.parent


def _mypy(cache, view):
  pytest.importorskip('mypy')
  return subprocess.run(
    [
      sys.executable,
      '-m',
      'mypy',
      'fedjax_personal',
      '--config-file',
      os.path.join(ROOT, 'setup.cfg'),
      '--cache-dir',
      str(cache),
    ],
    cwd=view,
    capture_output=True,
    text=True,
    timeout=600,
  )


#: A misspelled attribute planted where the project reads typed settings and
#: outputs (the distributed settings, an algorithm's client output), in an
#: algorithm's client work, its server update, its shared work, a data set's
#: loading and the engine: each ``(file, (old, new), the attribute mypy
#: names)``.
PLANTED = {
  'run/experiment_entry.py': (
    'd.distributed_timeout',
    'd.distributed_timeouts',
    'distributed_timeouts',
  ),
  'algorithms/fedavg.py': (
    'dp_steps = state.dp_steps',
    'dp_steps = state.dp_step',
    'dp_step',
  ),
  'algorithms/ditto.py': ('gv, v, ctx.shared)', 'gv, v, ctx.sharde)', 'sharde'),
  'algorithms/usercentric.py': (
    'tree_gather(streams, state.assignment)',
    'tree_gather(streams, state.asignment)',
    'asignment',
  ),
  'algorithms/global_personal.py': (
    'delta=otu.tree_sub(ctx.shared, w)',
    'delta=otu.tree_sub(ctx.shard, w)',
    'shard',
  ),
  'datasets/loading.py': (
    'if not nat.files:',
    'if not nat.file:',
    'file',
  ),
  'core/engine.py': (
    'work = algorithm.client_work',
    'work = algorithm.client_wrk',
    'client_wrk',
  ),
  # an algorithm's builder (its data typed ``config.BuildData``)
  'algorithms/fedpcl.py': (
    '    data.num_clients,',
    '    data.num_client,',
    'num_client',
  ),
}


def test_mypy_finds_no_error_and_every_planted_misspelling(tmp_path):
  """With a misspelled attribute planted in each of ``PLANTED``'s files,
  mypy reports an error naming each, and nothing else: every error line is
  a planted one (the rest of the package has none). The seams are typed
  (``ClientContext``, the algorithms' states, the round context,
  ``ClientWork``'s callbacks). One run: a clean run first would check the
  same modules again."""
  view = _view(
    tmp_path / 'planted',
    {f: (old, new) for f, (old, new, _) in PLANTED.items()},
  )
  r = _mypy(tmp_path / 'cache', view)
  assert r.returncode == 1, r.stdout[-4000:] + r.stderr[-2000:]
  errors = [l for l in r.stdout.splitlines() if ': error:' in l]
  planted = {
    f'fedjax_personal/{f}:': f'"{attr}"' for f, (_, _, attr) in PLANTED.items()
  }
  others = [
    l
    for l in errors
    if not any(l.startswith(f) and a in l for f, a in planted.items())
  ]
  assert not others, '\n'.join(others)
  for f, attr in planted.items():
    assert any(l.startswith(f) and attr in l for l in errors), (
      f,
      r.stdout[-4000:],
    )
