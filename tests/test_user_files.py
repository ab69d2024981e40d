"""What a user's files and plugins feed a run is checked where it enters and
keys what it reuses: never other numbers, never a hang, one line a fault.

Each case was reproduced by a hostile pass (a fresh cache gave other
numbers, or a traceback, or a hang): labels that are not classes, inputs
that are not finite numbers, a number of classes that is not one, a store
reused after its number of classes changed, a built-in name or one name
from two files, a plugin's helper module changed under ``--resume``, a
plugin exiting while imported, a path with a comma."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import main_in_one_process

from fedjax_personal.datasets import registry

ARRAYS = """
import numpy as np
from fedjax_personal.datasets import registry

rng = np.random.default_rng(0)


def clients():
  out = {{}}
  for i in range(4):
    x = rng.normal(size=(12, 5)).astype(np.float32)
    y = (np.arange(12) % 3).astype(np.int32)
    out[f'c{{i}}'] = {{'x': x, 'y': y}}
  {edit}
  return out


registry.register_arrays({name!r}, clients, clients, num_classes={classes})
"""

RUN = [
  '--model=logreg',
  '--num_clients=4',
  '--rounds=1',
  '--eval_every=1',
  '--progress=false',
  '--algorithm=fedavg',
]


def _plugin(tmp_path, file, name='mine', edit='', classes='None'):
  (tmp_path / file).write_text(
    ARRAYS.format(name=name, edit=edit, classes=classes)
  )
  return [f'--import={file}', f'--dataset={name}']


def _one_line(code, err):
  lines = [l for l in err.splitlines() if l.startswith('error:')]
  assert code == 2 and 'Traceback' not in err and len(lines) == 1, err
  return lines[0]


BAD = {
  'float labels': (
    "out['c1']['y'] = out['c1']['y'] + 0.5",
    "client 'c1'",
    'not a class',
  ),
  'negative label': ("out['c2']['y'][3] = -1", "client 'c2'", 'outside [0, 3)'),
  'label past the classes': (
    "out['c0']['y'][0] = 7",
    "client 'c0'",
    'outside [0, 3)',
  ),
  'NaN input': (
    "out['c3']['x'][2, 1] = np.nan",
    "client 'c3'",
    'inputs must be finite',
  ),
  'rows differ': (
    "out['c1']['y'] = out['c1']['y'][:5]",
    "client 'c1'",
    '12 inputs but 5',
  ),
  'string inputs': (
    "out['c0']['x'] = out['c0']['x'].astype(str)",
    "client 'c0'",
    'not numbers',
  ),
  'shapes differ': (
    "out['c2']['x'] = out['c2']['x'][:, :4]",
    "client 'c2'",
    'one dtype and shape',
  ),
  'a label of 10**9': (
    "out['c1']['y'][0] = 10**9",
    "client 'c1'",
    'more than 1,000,000',
  ),
}


def test_bad_data_is_one_line_naming_the_client_before_anything_is_built(
  tmp_path,
):
  runs = []
  for i, (case, (edit, _, _)) in enumerate(BAD.items()):
    classes = (
      '3' if case in ('negative label', 'label past the classes') else 'None'
    )
    runs.append(
      _plugin(tmp_path, f'bad{i}.py', f'bad{i}', edit, classes)
      + RUN
      + [f'--output_dir={tmp_path}/out{i}']
    )
  results = main_in_one_process(runs, cwd=str(tmp_path))
  for (case, (_, client, why)), (code, err) in zip(BAD.items(), results):
    line = _one_line(code, err)
    assert client in line and why in line, (case, line)


@pytest.mark.slow
def test_the_number_of_classes_keys_the_store(tmp_path):
  """``num_classes`` changed between two runs of one file: a new store and
  the new number (a stale store reported the old one)."""
  results = []
  for i, classes in enumerate(('10', '5')):
    args = _plugin(tmp_path, 'nc.py', 'classes', classes=classes) + RUN
    results += main_in_one_process(
      [args + [f'--output_dir={tmp_path}/nc{i}']], cwd=str(tmp_path)
    )
  for code, err in results:
    assert code == 0, err
  seen = [
    json.load(open(tmp_path / f'nc{i}' / 'fedavg' / 'summary.json'))['identity']
    for i in range(2)
  ]
  assert json.dumps(seen[0]) != json.dumps(seen[1])


def test_names_are_refused_where_they_would_collide(tmp_path, monkeypatch):
  monkeypatch.setattr(registry, 'LOADERS', dict(registry.LOADERS))
  monkeypatch.setattr(registry, 'OPTIONS', dict(registry.OPTIONS))
  for name in ('digits', 'emnist', 'tfds:mine', 'leaf:mine'):
    with pytest.raises(ValueError, match='built-in|loaders'):
      registry.register_arrays(name, {'a': {'x': [[0.0]], 'y': [0]}})
  runs = [
    _plugin(tmp_path, 'one.py', 'twice')
    + _plugin(tmp_path, 'two.py', 'twice')[:1]
    + RUN
  ]
  [(code, err)] = main_in_one_process(runs, cwd=str(tmp_path))
  line = _one_line(code, err)
  assert (
    'two.py' in line and 'registered already' in line and 'one.py' in line
  ), line


HELPER_PLUGIN = """
import helper
from fedjax_personal.datasets import registry

registry.register_arrays('helped', helper.clients, helper.clients)
"""
HELPER = """
import numpy as np


def clients():
  rng = np.random.default_rng({seed})
  return {{f'c{{i}}': {{'x': rng.normal(size=(10, 4)).astype(np.float32),
                      'y': (np.arange(10) % 2).astype(np.int32)}} for i in range(4)}}
"""


@pytest.mark.slow
def test_a_changed_helper_of_a_plugin_refuses_resume_and_odd_imports_are_one_line(
  tmp_path,
):
  folder = tmp_path / 'with,comma'
  folder.mkdir()
  (folder / 'plug.py').write_text(HELPER_PLUGIN)
  (folder / 'helper.py').write_text(HELPER.format(seed=0))
  (tmp_path / 'exits.py').write_text('import sys\nsys.exit(0)\n')
  args = lambda rounds, *more: [
    f'--import={folder}/plug.py',
    '--dataset=helped',
    '--model=logreg',
    '--num_clients=4',
    f'--rounds={rounds}',
    '--algorithm=fedavg',
    '--progress=false',
    '--checkpoint_every=1',
    f'--output_dir={tmp_path}/run',
    *more,
  ]
  change = (
    f'open({str(folder / "helper.py")!r}, "w").write({HELPER.format(seed=1)!r})'
  )
  results = main_in_one_process(
    [
      args(1),
      change,
      args(2, '--resume'),
      ['--import=exits.py', '--dataset=digits', *RUN],
    ],
    cwd=str(tmp_path),
    env={'PYTHONDONTWRITEBYTECODE': '1'},
  )
  (c0, e0), (c1, e1), (c2, e2) = results
  assert c0 == 0, e0  # a path with a comma in it imports
  line = _one_line(c1, e1)
  assert 'import' in line, line
  line = _one_line(c2, e2)
  assert 'exits.py' in line and 'sys.exit' in line, line


@pytest.mark.slow
def test_a_setting_given_twice_takes_its_last_value_and_the_help_exits_0(
  tmp_path,
):
  """--algorithm twice (a list whose repetition could add or replace), a
  sweep key twice: refused; any other flag given twice, on the command line
  or in a flagfile, takes its last value as absl does, with one line saying
  so; --help exits 0; the --sweep help's own example runs."""
  from fedjax_personal.run import settings

  (tmp_path / 'run.flags').write_text(
    '--algorithm=fedavg\n--rounds=1\n--rounds=2\n'
  )
  (tmp_path / 'ok.flags').write_text('--algorithm=fedavg\n--rounds=1\n')
  example = settings.ExperimentSettings.__dataclass_fields__['sweep'].metadata[
    'help'
  ]
  example = example.split("e.g. '")[1].split("'")[0]
  small = ['--dataset=digits', '--num_clients=6', '--dry_run']
  results = main_in_one_process(
    [
      ['--algorithm=fedavg', '--algorithm=local', *small],
      ['--flagfile=run.flags', *small],
      ['--algorithm=fedavg', '--sweep=client_lr:0.1;client_lr:0.2', *small],
      ['--flagfile=ok.flags', '--rounds=3', *small],
      ['--algorithm=fedprox', f'--sweep={example}', *small],
    ],
    cwd=str(tmp_path),
  )
  for (code, err), why in zip(
    (results[0], results[2]),
    ('--algorithm: given 2 times', 'client_lr is swept twice'),
  ):
    assert why in _one_line(code, err), err
  for code, err in (results[1], *results[3:]):
    assert code == 0, err
  assert (
    'note: --rounds given 2 times (1, 2): using the last, 2' in results[1][1]
  )
  assert (
    'note: --rounds given 2 times (1, 3): using the last, 3' in results[3][1]
  )
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  r = subprocess.run(
    [sys.executable, 'scripts/run_experiment.py', '--help'],
    cwd=root,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 0 and '--algorithm' in r.stdout, r.stderr[-2000:]


def test_settings_that_would_collide_or_do_nothing_are_refused(tmp_path):
  """A plugin's setting named as a shared one (--client_lr) is refused at
  registration; zero local steps or epochs are refused as a setting; a
  Keras .npz with a gap in its numbering is one line."""
  import dataclasses
  from typing import ClassVar

  import numpy as np

  from fedjax_personal import algorithms, models
  from fedjax_personal.algorithms import fedavg
  from fedjax_personal.config import AlgorithmSpec, TrainingConfig, hparam
  from fedjax_personal.errors import ConfigError
  from fedjax_personal.models import weights

  @dataclasses.dataclass(frozen=True)
  class Collides:
    prefix: ClassVar[str] = 'client'
    lr: float = hparam(7.0, 'Its own learning rate.')

  with pytest.raises(
    ValueError, match='--client_lr is already a shared training setting'
  ):
    algorithms.register(
      AlgorithmSpec('collides', Collides, fedavg.build, fedavg.FEDAVG_SETTINGS)
    )
  assert 'collides' not in algorithms.REGISTRY
  for field in ('local_steps', 'local_epochs'):
    with pytest.raises(ConfigError, match=field):
      TrainingConfig(**{field: 0})
  x = np.zeros((1, 4), np.float32)
  model = models.create_model('logreg', 3, x)
  np.savez(tmp_path / 'gap.npz', arr_0=np.zeros((4, 3)), arr_2=np.zeros(3))
  with pytest.raises(ConfigError, match='without arr_1'):
    weights.load(str(tmp_path / 'gap.npz'), model, x)


UNNAMED = """
import numpy as np
from fedjax_personal.datasets import registry
from fedjax_personal.datasets.natural_data import NaturalData, listed


def read_clients(num_clients=None, data_dir=None, download=False):
  x = np.load('inputs.npy')  # named below
  y = np.load('labels.npy')  # read, never named
  ids = [f'c{i}' for i in range(4)]
  parts = [(x[i::4], y[i::4]) for i in range(4)]
  return NaturalData(listed(ids, parts, parts), 4, 3, 4, files=['inputs.npy'])


registry.register('unnamed', read_clients)
"""


@pytest.mark.slow
def test_a_file_a_reader_reads_without_naming_it_keys_its_store(tmp_path):
  """A reader names one file and reads another: the other changed, the
  store is rebuilt (its numbers a fresh cache's), never reused."""
  import numpy as np

  rng = np.random.default_rng(0)
  np.save(tmp_path / 'inputs.npy', rng.normal(size=(40, 5)).astype(np.float32))
  np.save(tmp_path / 'labels.npy', (np.arange(40) % 3).astype(np.int32))
  (tmp_path / 'unnamed.py').write_text(UNNAMED)
  args = lambda out: [
    '--import=unnamed.py',
    '--dataset=unnamed',
    *RUN,
    f'--output_dir={out}',
  ]
  relabel = (
    f'import numpy as np; np.save({str(tmp_path / "labels.npy")!r}, '
    '(np.arange(40) * 2 % 3).astype(np.int32))'
  )
  [(c0, e0), (c1, e1)] = main_in_one_process(
    [args(tmp_path / 'a'), relabel, args(tmp_path / 'b')], cwd=str(tmp_path)
  )
  assert c0 == 0 and c1 == 0, (e0, e1)
  assert 'labels.npy, which changed since; rebuilding it' in e1, e1
  [(c2, e2)] = main_in_one_process(
    [args(tmp_path / 'fresh')],
    cwd=str(tmp_path),
    env={'FEDJAX_PERSONAL_CACHE': str(tmp_path / 'cache')},
  )
  assert c2 == 0, e2
  summary = lambda d: json.load(open(d / 'fedavg' / 'summary.json'))[
    'accuracy_mean'
  ]
  assert (
    summary(tmp_path / 'b')
    == summary(tmp_path / 'fresh')
    != summary(tmp_path / 'a')
  )


@pytest.mark.slow
def test_out_of_memory_a_shadowed_module_and_a_checkpoints_file_are_one_line(
  tmp_path,
):
  """XLA's RESOURCE_EXHAUSTED is the memory line (exit 2, no traceback); a
  plugin importing ``json`` beside a ``json.py`` of its own says which ran;
  a checkpoints folder replaced by a file refuses --resume in one line."""
  (tmp_path / 'mine').mkdir()
  (tmp_path / 'mine' / 'json.py').write_text('MINE = 1\n')
  (tmp_path / 'mine' / 'plug.py').write_text('import json\n')
  small = [
    '--algorithm=fedavg',
    '--dataset=digits',
    '--num_clients=4',
    '--rounds=1',
    '--progress=false',
  ]
  exhaust = (
    'import fedjax_personal.run.experiment_entry as c\n'
    'def main_job(settings):\n'
    '  raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to '
    'allocate '
    '123456789 bytes.")\n'
    'c.main_job = main_job\n'
    f'c.main(c.parse_flags(["run_experiment.py", *{small!r}]))'
  )
  r = subprocess.run(
    [sys.executable, '-c', exhaust],
    cwd=str(tmp_path),
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
  )
  assert 'out of memory (XLA: RESOURCE_EXHAUSTED' in _one_line(
    r.returncode, r.stderr
  )
  out = tmp_path / 'run'
  results = main_in_one_process(
    [
      ['--import=mine/plug.py', *small, '--dry_run'],
      [*small, f'--output_dir={out}'],
      f'import os, shutil; '
      f'shutil.rmtree({str(out / "fedavg" / "checkpoints")!r}, True); '
      f'open({str(out / "fedavg" / "checkpoints")!r}, "w").write("x")',
      [
        *[a for a in small if a != '--rounds=1'],
        '--rounds=2',
        '--resume',
        f'--output_dir={out}',
      ],
    ],
    cwd=str(tmp_path),
  )
  (c0, e0), (c1, e1), (c2, e2) = results
  assert (
    c0 == 0 and 'plug.py imports json' in e0 and 'json.py beside it' in e0
  ), e0
  assert c1 == 0, e1
  assert 'is a file, not a folder of checkpoints' in _one_line(c2, e2)


def test_a_reader_without_a_number_of_classes_and_one_plugin_by_two_paths(
  tmp_path, monkeypatch
):
  """A reader returning ``num_classes=None`` is one line; the same plugin
  file named by another path is the same plugin in the run identity (a
  resume is not refused, nothing advises --overwrite)."""
  from fedjax_personal.datasets.natural_data import NaturalData, listed
  from fedjax_personal.errors import ConfigError
  from fedjax_personal.run import plugins

  monkeypatch.setattr(registry, 'LOADERS', dict(registry.LOADERS))
  monkeypatch.setattr(registry, 'OPTIONS', dict(registry.OPTIONS))
  parts = [(np.zeros((3, 2), np.float32), np.zeros(3, np.int32))]
  registry.register(
    'no_classes',
    lambda num_clients=None, data_dir=None, download=False: NaturalData(
      listed(['a'], parts, parts), 1, None, 1
    ),
  )
  with pytest.raises(ConfigError, match='num_classes=None'):
    registry.load('no_classes')
  (tmp_path / 'same.py').write_text('X = 1\n')
  monkeypatch.chdir(tmp_path)
  a, b = 'same.py', str(tmp_path / '.' / 'same.py')
  for spec in (a, b):
    plugins.load(spec)
  assert plugins.identity([a]) == plugins.identity([b])
