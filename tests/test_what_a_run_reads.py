"""Everything a run reads is in its identity, nothing hangs, no advice
deletes what the run did not write, repeated flags follow absl, and what
cannot apply is said in one line.

Each case was met by a hostile pass (other numbers silently, lost results,
a hang or a traceback). The plugins are written here, as a user writes
them; each command runs as the command does (``main_in_one_process``:
several command lines in one child process, or a process of its own where
the case is the process: a signal, ``ulimit -v``, a changed file imported
again)."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import main_in_one_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = """
import dataclasses, json, os
from typing import ClassVar
import flax.linen as nn
from fedjax_personal import models
from fedjax_personal.hparams import hparam

WIDTH = json.load(open('width.json'))['width']  # read at import


@dataclasses.dataclass(frozen=True)
class MyOptions(models.ModelOptions):
  prefix: ClassVar[str] = 'mymodel'
  scale: float = hparam(1.0, 'Scales the hidden layer.', minimum=0)


class Mine(nn.Module):
  num_classes: int
  scale: float
  width: int

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.relu(nn.Dense(self.width)(x.reshape(x.shape[0], -1))) * self.scale
    return nn.Dense(self.num_classes)(x)


def build(num_classes, scale):
  import helper  # a module imported inside build
  return Mine(num_classes, scale * helper.FACTOR
              * float(os.environ.get('MY_SCALE', '1')), WIDTH)


models.register('mine', build, options=MyOptions)
"""

SMALL = [
  '--dataset=digits',
  '--num_clients=4',
  '--rounds=1',
  '--eval_every=1',
  '--progress=false',
  '--algorithm=fedavg',
]


def _one_line(code, err, status=2):
  lines = [l for l in err.splitlines() if l.startswith('error:')]
  assert code == status and 'Traceback' not in err and len(lines) == 1, err
  return lines[0]


def _write(folder, files):
  for name, text in files.items():
    (folder / name).write_text(text)


@pytest.mark.slow
def test_a_change_to_anything_a_user_model_reads_refuses_resume_and_moves_the_folder(
  tmp_path,
):
  """Its options, a JSON file it reads when imported, a helper module it
  imports inside build, an environment variable build reads: each changed
  refuses --resume naming it, and gives another default folder; unchanged,
  the resume goes on."""
  _write(
    tmp_path,
    {
      'mine.py': MODEL,
      'width.json': '{"width": 8}',
      'helper.py': 'FACTOR = 1.0\n',
    },
  )
  run = [
    '--import=mine.py',
    '--model=mine',
    *SMALL,
    '--checkpoint_every=1',
  ]
  out = f'--output_dir={tmp_path}/out'
  resume = [*run, out, '--resume', '--rounds=2']
  again = (
    "import sys; sys.modules.pop('mine', None); sys.modules.pop('helper', None)"
  )
  got = main_in_one_process(
    [
      [*run, out],
      resume,
      run,
      [*resume, '--mymodel_scale=0.5'],
      [*run, '--mymodel_scale=0.5'],
      "open('width.json', 'w').write('{\"width\": 9}');" + again,
      resume,
      run,
      "open('width.json', 'w').write('{\"width\": 8}');"
      "open('helper.py', 'w').write('FACTOR = 2.0');" + again,
      resume,
      run,
      "open('helper.py', 'w').write('FACTOR = 1.0');" + again,
      "import os; os.environ['MY_SCALE'] = '2'",
      resume,
      run,
    ],
    cwd=str(tmp_path),
  )
  assert [c for c, _ in got[:3]] == [0, 0, 0], got[:3]
  for (refused, fresh), key in zip(
    (got[3:5], got[5:7], got[7:9], got[9:11]),
    ('model_options', 'imports', 'model_reads.files', 'model_reads.env'),
  ):
    line = _one_line(*refused)
    assert 'another configuration' in line and key in line, (key, line)
    assert fresh[0] == 0, (key, fresh)
  folders = sorted(os.listdir(tmp_path / 'runs'))
  assert len(folders) == 5, folders


@pytest.mark.slow
def test_a_devices_file_is_keyed_by_its_contents(tmp_path):
  """--client_speeds edited between a run and its --resume: refused, naming
  it; the same contents under another path resume."""
  (tmp_path / 'speeds.txt').write_text('1\n2\n1\n2\n')
  (tmp_path / 'moved.txt').write_text('1\n2\n1\n2\n')
  run = [
    '--model=mlp',
    *SMALL,
    '--deadline=40',
    '--checkpoint_every=1',
    f'--output_dir={tmp_path}/out',
  ]
  got = main_in_one_process(
    [
      [*run, '--client_speeds=speeds.txt'],
      "open('speeds.txt', 'w').write('1\\n1\\n1\\n1\\n')",
      [*run, '--client_speeds=speeds.txt', '--resume', '--rounds=2'],
      [*run, '--client_speeds=moved.txt', '--resume', '--rounds=2'],
    ],
    cwd=str(tmp_path),
  )
  assert got[0][0] == 0, got[0]
  line = _one_line(*got[1])
  assert 'system.client_speeds' in line, line
  assert got[2][0] == 0, got[2]


READER = """
import os
import numpy as np
from fedjax_personal.datasets import natural_data, registry

LABELS = np.loadtxt('labels.txt').astype(np.int32)  # read at import


def read(num_clients=None, data_dir=None, download=False):
  shift = int(os.environ.get('MY_SHIFT', '0'))
  def stream():
    rng = np.random.default_rng(0)
    for i in range(4):
      x = (rng.normal(size=(12, 5)) + shift).astype(np.float32)
      y = LABELS[:12].copy()
      yield f'c{i}', (x, y), (x[:4], y[:4])
  return natural_data.NaturalData(stream, 4, 3, 4, files=['data.txt'])


registry.register('shifted', read)
"""


@pytest.mark.slow
def test_a_store_is_rebuilt_when_its_reader_reads_something_else(tmp_path):
  """A reader's labels file loaded when its module is imported and an
  environment variable it reads while reading: either changed, the cached
  store is rebuilt (one line says why), not reused stale."""
  _write(
    tmp_path,
    {'shifted.py': READER, 'labels.txt': '0 1 2 ' * 4, 'data.txt': 'data'},
  )
  run = ['--import=shifted.py', '--dataset=shifted', '--model=logreg']
  run += [a for a in SMALL if not a.startswith('--dataset')]
  first = main_in_one_process([run], cwd=str(tmp_path))
  assert first[0][0] == 0, first
  env = main_in_one_process([run], cwd=str(tmp_path), env={'MY_SHIFT': '3'})
  assert env[0][0] == 0 and '$MY_SHIFT, which changed' in env[0][1], env
  (tmp_path / 'labels.txt').write_text('2 1 0 ' * 4)
  labels = main_in_one_process([run], cwd=str(tmp_path))
  assert labels[0][0] == 0, labels
  assert 'written by other loader code' in labels[0][1], labels


BAD_PLUGINS = {
  'option flag of the shared settings': (
    """
import dataclasses
from typing import ClassVar
import flax.linen as nn
from fedjax_personal import models
from fedjax_personal.hparams import hparam

@dataclasses.dataclass(frozen=True)
class O(models.ModelOptions):
  prefix: ClassVar[str] = 'client'
  lr: float = hparam(0.1, 'a rate')

models.register('m1', lambda num_classes, lr: nn.Dense(num_classes), options=O)
""",
    '--client_lr is already a shared training setting',
  ),
  'option flag of the run': (
    """
import dataclasses
import flax.linen as nn
from fedjax_personal import models
from fedjax_personal.hparams import hparam

@dataclasses.dataclass(frozen=True)
class O(models.ModelOptions):
  rounds: int = hparam(3, 'rounds of my own')

models.register('m2', lambda num_classes, rounds: nn.Dense(num_classes), options=O)
""",
    '--rounds is already a setting of the run',
  ),
  'data set option of a built-in data set': (
    """
import dataclasses
from typing import ClassVar
from fedjax_personal.datasets import registry
from fedjax_personal.datasets.options import DataOptions
from fedjax_personal.hparams import hparam

@dataclasses.dataclass(frozen=True)
class O(DataOptions):
  prefix: ClassVar[str] = 'synthetic'
  beta: float = hparam(1.0, 'mine')

def read(num_clients=None, data_dir=None, download=False, beta=1.0):
  raise AssertionError

registry.register('mine', read, options=O)
""",
    '--synthetic_beta is already an option of --dataset=synthetic',
  ),
  'an algorithm named ..': (
    """
from fedjax_personal import algorithms
spec = algorithms.spec('fedavg')
import dataclasses
algorithms.register(dataclasses.replace(spec, name='..'))
""",
    "algorithm name '..': must be a plain identifier",
  ),
  'a data set named ../../x': (
    """
import numpy as np
from fedjax_personal.datasets import registry
registry.register_arrays('../../x', {'a': {'x': np.zeros((4, 2), np.float32),
                                          'y': np.zeros(4, np.int32)}})
""",
    "data set name '../../x': must be a plain identifier",
  ),
  'KeyboardInterrupt at import': (
    'raise KeyboardInterrupt\n',
    'KeyboardInterrupt',
  ),
}


def test_plugins_that_would_collide_or_escape_are_one_line(tmp_path):
  """A model's or data set's option whose flag is a shared one, a plugin
  algorithm named ``..``, a data set named ``../../x``, a plugin raising
  KeyboardInterrupt while imported: one line naming it, exit 2, nothing
  written."""
  runs = []
  for i, (case, (source, _)) in enumerate(BAD_PLUGINS.items()):
    (tmp_path / f'p{i}.py').write_text(source)
    runs.append([f'--import=p{i}.py', '--model=mlp', *SMALL, '--dry_run'])
  got = main_in_one_process(runs, cwd=str(tmp_path))
  for (case, (_, why)), (code, err) in zip(BAD_PLUGINS.items(), got):
    line = _one_line(code, err)
    assert why in line, (case, line)
  assert not os.path.exists(tmp_path / 'runs')
  assert not os.path.exists(os.path.join(os.path.dirname(tmp_path), 'x'))


@pytest.mark.slow
def test_overwrite_removes_only_the_runs_own_outputs(tmp_path):
  """--overwrite of a folder holding another configuration and a file of the
  user's: the run's outputs are replaced, the user's file and folder kept."""
  out = tmp_path / 'out'
  run = ['--model=mlp', *SMALL, f'--output_dir={out}']
  got = main_in_one_process(
    [
      run,
      f"open({str(out / 'notes.txt')!r}, 'w').write('mine');"
      f"__import__('os').makedirs({str(out / 'data')!r})",
      [*run, '--seed=1'],
      [*run, '--seed=1', '--overwrite'],
    ],
    cwd=str(tmp_path),
  )
  assert got[0][0] == 0, got[0]
  assert 'another configuration' in _one_line(*got[1])
  assert got[2][0] == 0, got[2]
  assert (out / 'notes.txt').read_text() == 'mine' and (out / 'data').is_dir()
  assert json.loads((out / 'identity.json').read_text())
  assert (out / 'fedavg' / 'summary.json').is_file()


def test_repeated_flags_take_the_last_value_and_a_sweep_takes_its_setting(
  tmp_path,
):
  """--rounds=2 then a flagfile saying 3: 3 rounds, one line naming both;
  --client_lr beside a client_lr sweep refused; values that print alike
  keep distinct labels."""
  from fedjax_personal.run.settings import ExperimentSettings
  from fedjax_personal.run.tensorboard import _config_folder

  (tmp_path / 'base.flags').write_text('--rounds=3\n')
  got = main_in_one_process(
    [
      [
        *(a for a in SMALL if not a.startswith('--rounds')),
        '--model=mlp',
        '--rounds=2',
        '--flagfile=base.flags',
        f'--output_dir={tmp_path}/out',
      ],
      [
        *SMALL,
        '--model=mlp',
        '--client_lr=0.1',
        '--sweep=client_lr:0.1,0.2',
        '--dry_run',
      ],
    ],
    cwd=str(tmp_path),
  )
  assert got[0][0] == 0, got[0]
  assert 'note: --rounds given 2 times (2, 3): using the last, 3' in got[0][1]
  summary = json.loads(
    (tmp_path / 'out' / 'fedavg' / 'summary.json').read_text()
  )
  assert summary['rounds'] == 3
  line = _one_line(*got[1])
  assert '--client_lr' in line and 'beside --sweep' in line, line
  labels = [{'client_lr': 0.1}, {'client_lr': 0.1000001}]
  rows = {ExperimentSettings().row_label('fedavg', l) for l in labels}
  folders = {_config_folder({'config': l}) for l in labels}
  assert len(rows) == 2 and len(folders) == 2, (rows, folders)


MODELS = """
import flax.linen as nn
import jax.numpy as jnp
from fedjax_personal import models


class Deterministic(nn.Module):
  num_classes: int

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    x = nn.Dense(16)(x.reshape(x.shape[0], -1))
    x = nn.Dropout(0.9, deterministic=deterministic)(x)
    return nn.Dense(self.num_classes)(x)


class KerasStyle(nn.Module):
  num_classes: int

  @nn.compact
  def __call__(self, x, training: bool):
    x = nn.Dropout(0.5, deterministic=not training)(nn.Dense(16)(x))
    return nn.Dense(self.num_classes)(x)


class NoTrain(nn.Module):
  num_classes: int

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16)(x.reshape(x.shape[0], -1))
    return nn.Dense(self.num_classes)(nn.Dropout(0.5, deterministic=False)(x))


class Mixes(nn.Module):
  num_classes: int

  @nn.compact
  def __call__(self, x):
    return nn.Dense(self.num_classes)(x.reshape(1, -1)[:, :64])


class NanAtEvaluation(nn.Module):
  num_classes: int

  @nn.compact
  def __call__(self, x, train: bool):
    out = nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1))
    return out if train else out * jnp.nan


class Conv(nn.Module):
  num_classes: int

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(4, (3, 3))(x)
    return nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1))


def builder(cls):
  return lambda num_classes: cls(num_classes)


for name, cls in [('deterministic', Deterministic), ('no_train', NoTrain),
                  ('mixes', Mixes), ('nan_eval', NanAtEvaluation),
                  ('conv', Conv)]:
  models.register(name, builder(cls))
"""


@pytest.mark.slow
def test_models_the_engine_cannot_drive_are_said_not_run(tmp_path):
  """Flax's ``deterministic`` argument trains with dropout (other numbers
  than evaluation's); a module with dropout and no train argument, one whose
  output mixes the batch, and --conv_impl on a module's own convolutions are
  one line before anything trains; NaN evaluation outputs stop the run as
  divergence (exit 3)."""
  (tmp_path / 'models.py').write_text(MODELS)
  run = ['--import=models.py', *SMALL]
  got = main_in_one_process(
    [
      [*run, '--model=deterministic', f'--output_dir={tmp_path}/d'],
      [*run, '--model=no_train', '--dry_run'],
      [*run, '--model=mixes', '--dry_run'],
      [*run, '--model=conv', '--conv_impl=matmul', '--dry_run'],
      [*run, '--model=nan_eval', f'--output_dir={tmp_path}/n'],
      [*run, '--model=unknown_one', '--dry_run'],
    ],
    cwd=str(tmp_path),
  )
  assert got[0][0] == 0, got[0]
  for (code, err), why in zip(
    got[1:4],
    ('takes no train argument', 'one row per example', 'its module computes'),
  ):
    assert why in _one_line(code, err), err
  line = _one_line(*got[4], status=3)
  assert 'diverged' in line and 'not finite' in line, line
  assert '--import=FILE.py' in _one_line(*got[5])

  from fedjax_personal.models.model import from_flax

  sys.path.insert(0, str(tmp_path))
  try:
    import jax
    import jax.numpy as jnp

    mod = __import__('models')
    model = from_flax('d', mod.Deterministic(3), jnp.ones((2, 8)))
    params = model.init(jax.random.key(0))
    x = jnp.ones((2, 8))
    evaluated = model.apply(params, x)
    trained = model.train_apply(params, x, jax.random.key(1))
    assert model.mode_arg == 'deterministic'
    assert not np.allclose(evaluated, trained)  # dropout applies in training
    np.testing.assert_array_equal(evaluated, model.apply(params, x))
    keras = from_flax('k', mod.KerasStyle(3), jnp.ones((2, 8)))
    assert keras.mode_arg == 'training' and keras.evaluate_kwargs == {
      'training': False
    }
  finally:
    sys.path.remove(str(tmp_path))
    sys.modules.pop('models', None)


READERS = """
import numpy as np
from fedjax_personal.datasets import natural_data, registry


def pairs(num_clients=None, data_dir=None, download=False):
  def stream():
    x, y = np.zeros((4, 3), np.float32), np.zeros(4, np.int32)
    yield 'a', (x, y)
  return natural_data.NaturalData(stream, 1, 2, 1)


def fails(num_clients=None, data_dir=None, download=False):
  def stream():
    raise OSError(5, 'Input/output error', 'shard-3.bin')
    yield
  return natural_data.NaturalData(stream, 1, 2, 1)


registry.register('pairs', pairs)
registry.register('fails', fails)
"""


@pytest.mark.slow
def test_faults_of_inputs_are_one_line(tmp_path):
  """A reader yielding 2-tuples, a reader raising OSError, --cohort_seed
  past NumPy's seeds, an availability trace nobody is ever on in, a run in
  which no client ever takes part: one line each, exit 2."""
  (tmp_path / 'readers.py').write_text(READERS)
  (tmp_path / 'off.txt').write_text('0 0 0 0\n')
  (tmp_path / 'once.txt').write_text('0 0 0 0\n1 1 1 1\n')
  small = [a for a in SMALL if not a.startswith('--dataset')]
  got = main_in_one_process(
    [
      ['--import=readers.py', '--dataset=pairs', '--model=logreg', *small],
      ['--import=readers.py', '--dataset=fails', '--model=logreg', *small],
      [*SMALL, '--model=mlp', '--cohort_sampler=tff', f'--cohort_seed={2**33}'],
      [*SMALL, '--model=mlp', '--availability_trace=off.txt', '--dry_run'],
      [
        *SMALL,
        '--model=mlp',
        '--drop_before=0.999999',
        '--rounds=1',
        f'--output_dir={tmp_path}/none',
      ],
      [
        *SMALL,
        '--model=mlp',
        '--availability_trace=once.txt',
        '--rounds=2',
        f'--output_dir={tmp_path}/once',
      ],
    ],
    cwd=str(tmp_path),
  )
  whys = (
    'a 2-tuple',
    'its reader failed',
    '--cohort_seed',
    'no client is ever online',
    'no client took part in any of the 1 rounds',
  )
  for (code, err), why in zip(got, whys):
    assert why in _one_line(code, err), err
  assert got[5][0] == 0, got[5]
  summary = json.loads(
    (tmp_path / 'once' / 'fedavg' / 'summary.json').read_text()
  )
  assert summary['rounds_without_clients'] == 1


def test_the_console_counts_devices_in_the_work_unit(capsys):
  """The header names local steps under --local_steps; each round's device
  counts are printed when clients are devices."""
  from fedjax_personal.core.system import SystemConfig
  from fedjax_personal.run.reporting import DeviceCounts

  (line,) = SystemConfig(stragglers=0.5).describe([], steps=True)
  assert 'of K local steps' in line and 'epochs' not in line, line
  DeviceCounts(3, 'fedprox').on_round_end(
    1,
    [{'num_active': 4, 'num_sampled': 5, 'stragglers': 2, 'uploads_lost': 1}],
    None,
  )
  out = capsys.readouterr().out
  assert (
    'fedprox round 1/3: 4 of 5 sampled took part, 2 stragglers, 1 uploads lost'
    in out
  ), out


@pytest.mark.slow
def test_resume_never_reruns_a_finished_algorithm(tmp_path):
  """Two algorithms without --checkpoint_every, run to the end: --resume
  trains neither again (each resumes after its last round)."""
  run = ['--model=mlp', *SMALL, '--algorithm=fedavg,local', '--rounds=2']
  run = [a for a in run if a != '--algorithm=fedavg' and a != '--rounds=1']
  out = f'--output_dir={tmp_path}/out'
  got = main_in_one_process([[*run, out], [*run, out, '--resume']])
  assert [c for c, _ in got] == [0, 0], got
  for name in ('fedavg', 'local'):
    s = json.loads((tmp_path / 'out' / name / 'summary.json').read_text())
    assert s['resumed_after_round'] == 2, (name, s)


HANG = """
import ctypes
import flax.linen as nn
from fedjax_personal import models


def build(num_classes):
  # a computation that never returns to Python: a mutex locked twice in C
  lock = ctypes.create_string_buffer(64)
  libc = ctypes.CDLL(None)
  libc.pthread_mutex_init(lock, None)
  libc.pthread_mutex_lock(lock)
  open('stuck', 'w').close()
  libc.pthread_mutex_lock(lock)
  return nn.Dense(num_classes)


models.register('stuck', build)
"""

BIG = """
import flax.linen as nn
from fedjax_personal import models


class Big(nn.Module):
  num_classes: int

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(1_000_000)(x.reshape(x.shape[0], -1))
    return nn.Dense(self.num_classes)(x)


models.register('big', lambda num_classes: Big(num_classes))
"""


def _command(tmp_path, *args, address_space_kb=None):
  """The command in a process of its own (under ``ulimit -v`` when given)."""
  command = [
    sys.executable,
    os.path.join(ROOT, 'scripts', 'run_experiment.py'),
    *args,
  ]
  if address_space_kb is not None:
    command = ['bash', '-c', f'ulimit -v {address_space_kb} && exec "$@"', '-']
    command += [
      sys.executable,
      os.path.join(ROOT, 'scripts', 'run_experiment.py'),
    ]
    command += list(args)
  return subprocess.Popen(
    command,
    cwd=str(tmp_path),
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
  )


@pytest.mark.slow
def test_nothing_hangs_a_signal_ends_a_stuck_process_and_memory_is_planned(
  tmp_path,
):
  """A process stuck in C (its interpreter never takes the signal) ends
  within seconds of a second SIGTERM, in one line with SIGTERM's status; a
  model too large for ``ulimit -v`` is refused from its shapes before
  anything compiles."""
  (tmp_path / 'hang.py').write_text(HANG)
  (tmp_path / 'big.py').write_text(BIG)
  p = _command(tmp_path, '--import=hang.py', '--model=stuck', *SMALL)
  deadline = time.time() + 120
  while not (tmp_path / 'stuck').exists() and p.poll() is None:
    assert time.time() < deadline, 'the model was never built'
    time.sleep(0.2)
  p.send_signal(signal.SIGTERM)
  time.sleep(0.5)
  sent = time.time()
  p.send_signal(signal.SIGTERM)
  _, err = p.communicate(timeout=60)
  assert time.time() - sent < 15, err
  assert _one_line(p.returncode, err, status=143).startswith(
    'error: terminated'
  )

  p = _command(
    tmp_path,
    '--import=big.py',
    '--model=big',
    *(a for a in SMALL if not a.startswith('--dataset')),
    '--dataset=mnist',  # 784 inputs: 3.1 GB of weights in the first layer
    address_space_kb=6 << 20,
  )
  _, err = p.communicate(timeout=300)
  line = _one_line(p.returncode, err)
  assert '--model=big does not fit' in line, line
