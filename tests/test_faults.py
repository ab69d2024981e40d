"""Runs on disk never mix, resume checks its configuration, bad input is one
line (ConfigError, exit 2), and every JSON file is strict."""

import json
import os

import made_files
import pytest
from helpers import parse_flags

from fedjax_personal.errors import ConfigError
from fedjax_personal.run import experiment_entry
from fedjax_personal.run.run_identity import dumps

SMALL = [
  '--algorithm=fedavg',
  '--dataset=digits',
  '--model=logreg',
  '--num_clients=4',
  '--progress=false',
  '--max_examples=200',
  '--eval_every=1',
]


def job(*args):
  parse_flags(*SMALL, *args)
  return experiment_entry.main_job()


def _strict(text):
  def bad(const):
    raise ValueError(f'non-strict JSON constant {const}')

  return json.loads(text, parse_constant=bad)


@pytest.mark.slow
def test_resume_refuses_another_configuration(tmp_path):
  out = f'--output_dir={tmp_path}'
  job('--rounds=2', '--checkpoint_every=1', out)
  for changed, needle in [
    ('--num_clients=5', 'num_clients'),
    ('--seed=7', 'seed'),
    ('--client_lr=0.5', 'client_lr'),
    ('--batch_size=8', 'batch_size'),
  ]:
    with pytest.raises(ConfigError, match=needle) as e:
      job('--rounds=3', '--resume', changed, out)
    assert e.value.name == 'output_dir'
  # More rounds is a deliberate change: allowed and recorded.
  summary = job('--rounds=3', '--resume', out)['fedavg']
  assert summary['rounds'] == 3 and summary['resumed_after_round'] == 2
  with pytest.raises(ConfigError, match='past --rounds=2'):
    job('--rounds=2', '--resume', out)


def test_resume_without_checkpoint_says_so(tmp_path, capsys):
  with pytest.raises(ConfigError, match='no checkpoint'):
    job('--rounds=1', '--resume', f'--output_dir={tmp_path}/a')
  job('--rounds=1', '--resume_if_found', f'--output_dir={tmp_path}/b')
  assert 'starting fresh' in capsys.readouterr().out


@pytest.mark.slow
def test_output_folder_of_another_configuration_is_refused(tmp_path):
  out = f'--output_dir={tmp_path}'
  job('--rounds=1', out)
  with pytest.raises(ConfigError, match='another configuration.*--overwrite'):
    job('--rounds=1', '--algorithm=fedavg,local', out)
  job('--rounds=1', '--algorithm=fedavg,local', '--overwrite', out)
  comparison = _strict((tmp_path / 'comparison.json').read_text())
  assert set(comparison) == {'fedavg', 'local'}
  # The same configuration again replaces its own results (no stale
  # checkpoints).
  job('--rounds=1', '--algorithm=fedavg,local', out)


def test_folder_that_is_not_a_library_run_is_refused(tmp_path):
  (tmp_path / 'notes.txt').write_text('mine')
  with pytest.raises(ConfigError, match='holds no run'):
    job('--rounds=1', f'--output_dir={tmp_path}')
  assert (tmp_path / 'notes.txt').read_text() == 'mine'


@pytest.mark.slow
def test_default_folder_names_algorithm_and_configuration(
  tmp_path, monkeypatch
):
  monkeypatch.chdir(tmp_path)
  job('--rounds=1')
  job('--rounds=1', '--client_lr=0.1')
  names = sorted(os.listdir(tmp_path / 'runs'))
  assert len(names) == 2 and all('fedavg' in n for n in names)


def test_unwritable_output_fails_before_training(tmp_path):
  (tmp_path / 'file').write_text('x')
  with pytest.raises(ConfigError, match='output_dir'):
    job('--rounds=1', f'--output_dir={tmp_path / "file"}')


@pytest.mark.slow
def test_corrupted_latest_checkpoint_falls_back(tmp_path, capsys):
  full = job('--rounds=4', f'--output_dir={tmp_path}/full')['fedavg']
  job('--rounds=3', '--checkpoint_every=1', f'--output_dir={tmp_path}/cut')
  latest = tmp_path / 'cut' / 'fedavg' / 'checkpoints' / '3'
  for root, _, files in os.walk(latest):
    for name in files:
      with open(os.path.join(root, name), 'wb') as f:
        f.write(b'\0' * 7)
  resumed = job('--rounds=4', '--resume', f'--output_dir={tmp_path}/cut')[
    'fedavg'
  ]
  assert 'checkpoint 3' in capsys.readouterr().err
  assert resumed['resumed_after_round'] == 2
  assert resumed['per_client_accuracy'] == full['per_client_accuracy']


@pytest.mark.parametrize(
  'args,flag',
  [
    (['--test_fraction=0'], 'test_fraction'),
    (['--max_examples=-5'], 'max_examples'),
    (
      ['--partition=pathological', '--classes_per_client=11'],
      'classes_per_client',
    ),
    (['--client_lr=inf'], 'client_lr'),
    (['--algorithm=fedavg,fedfomo', '--val_fraction=0'], 'val_fraction'),
    (['--partition=iid', '--latent_features=embedding'], 'latent_features'),
    (
      ['--partition=latent_clusters', '--latent_features=vgg'],
      'latent_features',
    ),
    # held-out users only: none trains
    (
      ['--dataset=stackoverflow_held_out'],
      'dataset',
    ),
  ],
)
def test_bad_values_are_refused_before_training(tmp_path, args, flag):
  with pytest.raises(ConfigError) as e:
    job('--rounds=1', f'--output_dir={tmp_path}/out', *args)
  assert e.value.name == flag
  assert not (tmp_path / 'out' / 'fedavg' / 'metrics.jsonl').exists()


def test_every_json_file_is_strict(tmp_path):
  assert _strict(dumps({'a': float('nan'), 'b': [1.0, float('inf')]})) == {
    'a': None,
    'b': [1.0, None],
  }
  job(
    '--rounds=2',
    '--algorithm=fedavg,fedavg_ft',
    '--finetune_lr=1e30',
    f'--output_dir={tmp_path}',
  )
  files = [
    os.path.join(r, f)
    for r, _, fs in os.walk(tmp_path)
    for f in fs
    if f.endswith(('.json', '.jsonl'))
  ]
  assert len(files) >= 6
  for path in files:
    with open(path) as f:
      text = f.read()
    for line in text.splitlines() if path.endswith('.jsonl') else [text]:
      _strict(line)


def test_mnist_files_are_checksummed(tmp_path):
  from fedjax_personal.datasets import in_memory, local_files
  from fedjax_personal.errors import DataError

  (tmp_path / 'mnist_t10k').mkdir()
  for name in in_memory.MNIST_MD5:
    raw = bytearray(
      (local_files.PACKAGE_DATA / 'mnist_t10k' / name).read_bytes()
    )
    if 'labels' in name:
      raw[-3] ^= 1  # one flipped bit in the compressed labels
    (tmp_path / 'mnist_t10k' / name).write_bytes(bytes(raw))
  with pytest.raises(DataError, match='labels-idx1-ubyte.gz: md5'):
    in_memory.load_mnist(str(tmp_path))


def test_cifar_cache_is_keyed_by_content(tmp_path, monkeypatch):
  """Two archives of the same size but other labels never share a cache."""
  from fedjax_personal.datasets import cifar
  from fedjax_personal.errors import DataError

  monkeypatch.setenv('FEDJAX_PERSONAL_CACHE', str(tmp_path / 'cache'))
  (tmp_path / 'a').mkdir()
  (tmp_path / 'b').mkdir()
  made_files.write_cifar10_jpeg_npz(
    tmp_path / 'a' / 'cifar10_jpeg.npz', [0, 1, 2]
  )
  made_files.write_cifar10_jpeg_npz(
    tmp_path / 'b' / 'cifar10_jpeg.npz', [3, 4, 5]
  )
  assert os.path.getsize(
    tmp_path / 'a' / 'cifar10_jpeg.npz'
  ) == os.path.getsize(tmp_path / 'b' / 'cifar10_jpeg.npz')
  assert cifar.load('cifar10', str(tmp_path / 'a'), split='test')[
    1
  ].tolist() == [0, 1, 2]
  assert cifar.load('cifar10', str(tmp_path / 'b'), split='test')[
    1
  ].tolist() == [3, 4, 5]
  assert cifar.load('cifar10', str(tmp_path / 'a'), split='test')[
    1
  ].tolist() == [0, 1, 2]
  # A zeroed archive is refused (one line naming it), not served from an old
  # cache.
  path = tmp_path / 'a' / 'cifar10_jpeg.npz'
  path.write_bytes(b'\0' * os.path.getsize(path))
  with pytest.raises(DataError, match='not a valid CIFAR-10 JPEG archive'):
    cifar.load('cifar10', str(tmp_path / 'a'))


@pytest.mark.parametrize(
  'content,needle',
  [
    (b'\x00\x00\x42\x01\x00\x00\x00\x02ab', 'bad magic'),  # unknown dtype
    # fewer values than header
    (
      b'\x00\x00\x08\x01\x00\x00\x00\x05ab',
      'holds 2',
    ),
    (b'not gzip at all', 'unreadable'),  # .gz that is not gzip
  ],
)
def test_idx_files_are_validated(tmp_path, content, needle):
  from fedjax_personal.datasets import in_memory
  from fedjax_personal.errors import DataError

  path = tmp_path / ('x.gz' if needle == 'unreadable' else 'x.idx')
  path.write_bytes(content)
  with pytest.raises(DataError, match=needle):
    in_memory.read_idx(path)
  with pytest.raises(DataError, match='5 labels for 10 images'):
    in_memory.check_labels(path, __import__('numpy').zeros(5, int), 10, 10)


@pytest.mark.needs_data(('input.txt', 'tinyshakespeare.txt'))
@pytest.mark.parametrize(
  'mangle,needle',
  [
    (lambda b: b[: len(b) // 2], 'md5'),  # truncated
    (lambda b: b[:100] + b'\xff\xfe' + b[102:], 'md5'),  # not UTF-8 any more
  ],
)
def test_tinyshakespeare_file_is_checked(tmp_path, mangle, needle):
  """A truncated or re-encoded Tiny Shakespeare is one DataError naming the
  file (it used to train with a smaller vocabulary)."""
  from fedjax_personal.datasets import in_memory, local_files

  src = local_files.find_file(['input.txt', 'tinyshakespeare.txt'])
  (tmp_path / 'input.txt').write_bytes(mangle(src.read_bytes()))
  with pytest.raises(ConfigError, match=needle) as e:
    in_memory.load_tinyshakespeare(num_clients=2, data_dir=str(tmp_path))
  assert str(tmp_path) in str(e.value) and e.value.name == 'data_dir'


@pytest.mark.slow
def test_checkpoints_carry_the_run_identity(tmp_path):
  """A checkpoint moved into another configuration's folder is refused on
  resume (the identity is stored inside every Orbax checkpoint)."""
  import shutil

  job('--rounds=2', '--checkpoint_every=1', f'--output_dir={tmp_path}/a')
  job(
    '--rounds=2',
    '--checkpoint_every=1',
    '--client_lr=0.2',
    f'--output_dir={tmp_path}/b',
  )
  shutil.rmtree(tmp_path / 'b' / 'fedavg' / 'checkpoints')
  shutil.copytree(
    tmp_path / 'a' / 'fedavg' / 'checkpoints',
    tmp_path / 'b' / 'fedavg' / 'checkpoints',
  )
  with pytest.raises(
    ConfigError, match='saved by another configuration.*client_lr'
  ) as e:
    job(
      '--rounds=3', '--resume', '--client_lr=0.2', f'--output_dir={tmp_path}/b'
    )
  assert e.value.name == 'resume'


@pytest.mark.slow  # ~25 s: three script runs
def test_kill_during_checkpoint_write_then_resume_is_bit_identical(tmp_path):
  """SIGKILL while Orbax writes a checkpoint (a temporary step folder
  exists), then --resume: metrics.jsonl equals an uninterrupted run's, value
  for value (timings aside)."""
  import signal
  import subprocess
  import sys
  import time

  script = os.path.join(
    os.path.dirname(__file__), '..', 'scripts', 'run_experiment.py'
  )
  args = [sys.executable, script, *SMALL, '--rounds=10', '--checkpoint_every=1']
  subprocess.run(
    args + [f'--output_dir={tmp_path}/full'],
    check=True,
    capture_output=True,
    timeout=300,
  )
  ckpt = tmp_path / 'cut' / 'fedavg' / 'checkpoints'
  proc = subprocess.Popen(
    args + [f'--output_dir={tmp_path}/cut'],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  killed_mid_write = False
  deadline = time.time() + 240
  while proc.poll() is None and time.time() < deadline:
    entries = os.listdir(ckpt) if ckpt.is_dir() else []
    steps = [e for e in entries if e.isdigit()]
    if len(steps) >= 2 and any('tmp' in e for e in entries):
      proc.send_signal(signal.SIGKILL)
      killed_mid_write = True
      break
    time.sleep(0.001)
  proc.wait(timeout=60)
  assert killed_mid_write, (
    'the run finished before a checkpoint write could be interrupted'
  )
  r = subprocess.run(
    args + ['--resume', f'--output_dir={tmp_path}/cut'],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  load = lambda d: [
    {k: v for k, v in json.loads(l).items() if k != 'round_seconds'}
    for l in open(tmp_path / d / 'fedavg' / 'metrics.jsonl')
  ]
  full, resumed = load('full'), load('cut')
  assert [r['round'] for r in resumed] == list(range(1, 11))
  assert resumed == full
