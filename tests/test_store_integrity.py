"""A population store never yields other numbers than its source: checked
blocks, stores keyed by their sources' contents, no leftovers of killed or
interrupted builds, a full disk named."""

import errno
import json
import os
import subprocess
import sys
import zlib

import made_files
import numpy as np
import pytest
from helpers import parse_flags

from fedjax_personal.core.population import store as store_lib
from fedjax_personal.core.population.clients import FORMAT
from fedjax_personal.datasets import DataConfig, load_store, local_files
from fedjax_personal.errors import DataError
from fedjax_personal.run import experiment_entry


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
  """Each test its own cache folder (stores, digests)."""
  monkeypatch.setenv('FEDJAX_PERSONAL_CACHE', str(tmp_path / 'cache'))


def _emnist(folder, seed=0, num=6):
  folder.mkdir(exist_ok=True)
  for old in folder.glob('*.sqlite'):
    old.unlink()
  rng = np.random.default_rng(seed)
  made_files.write_emnist(
    folder,
    rng,
    [int(v) for v in rng.integers(3, 30, num)],
    [int(v) for v in rng.integers(1, 6, num)],
  )
  return DataConfig(
    dataset='emnist',
    partition='natural',
    num_clients=None,
    data_dir=str(folder),
  )


def _arrays(store):
  every = np.arange(store.num_clients)
  return [
    (
      np.asarray(store.gather(s, every, 32).x),
      np.asarray(store.gather(s, every, 32).y),
    )
    for s in ('train', 'test')
  ]


def _flip(path, at, count=1):
  with open(path, 'r+b') as f:
    f.seek(at)
    data = bytearray(f.read(count))
    f.seek(at)
    f.write(bytes(b ^ 0x5A for b in data))


def test_block_checksums_are_those_of_the_written_bytes():
  data = np.random.default_rng(0).bytes(3 * 1000 + 17)
  got = store_lib._BlockChecksums(1000)
  for i in range(0, len(data), 333):  # pieces that straddle blocks
    got.update(data[i : i + 333])
  want = [zlib.crc32(data[i : i + 1000]) for i in range(0, len(data), 1000)]
  assert (
    got.done() == want == store_lib.block_crcs(data, 1000) and len(want) == 4
  )


@pytest.mark.parametrize(
  'file,at', [('train.y.bin', 12), ('train.x.bin', 5000), ('test.x.bin', 100)]
)
def test_a_damaged_block_stops_the_read_and_the_store_is_rebuilt(
  tmp_path, capsys, file, at
):
  """Labels or pixels changed inside a store: the first read of the block
  fails its checksum (no number from it), the store is removed, and the
  next load rebuilds it to the original bytes."""
  cfg = _emnist(tmp_path / 'data')
  store = load_store(cfg)
  want = _arrays(store)
  folder = store.folder
  _flip(folder / file, at)
  damaged = load_store(cfg)  # opens: the example arrays are checked as read
  with pytest.raises(
    store_lib.StoreDamaged,
    match=rf'{folder}: a damaged population store '
    rf'\({file}: block 0 fails its checksum\); removed it: run the same '
    'command again to rebuild it from its source files',
  ):
    _arrays(damaged)
  assert not folder.exists()
  again = load_store(cfg)
  for (x, y), (wx, wy) in zip(_arrays(again), want):
    np.testing.assert_array_equal(x, wx)
    np.testing.assert_array_equal(y, wy)


def test_damage_found_on_open_or_by_verify_rebuilds_with_one_line(
  tmp_path, capsys
):
  """Damaged counts (checked on every open), a truncated array, a store of
  an older format, and pixels checked up front by ``verify``: one line on
  stderr, then the store rebuilt with the original bytes."""
  cfg = _emnist(tmp_path / 'data', seed=1)
  store = load_store(cfg)
  want = _arrays(store)
  folder = store.folder
  for damage, line in (
    (
      lambda: _flip(folder / 'train.counts.bin', 3),
      'train.counts.bin fails its checksum',
    ),
    (lambda: os.truncate(folder / 'test.y.bin', 4), 'test.y.bin has 4 bytes'),
    (
      lambda: (folder / 'manifest.json').write_text(
        json.dumps(
          {
            **json.loads((folder / 'manifest.json').read_text()),
            'format': 'fedjax_personal.population/1',
          }
        )
      ),
      'written in format '
      f"'fedjax_personal.population/1', this version reads '{FORMAT}'",
    ),
    (
      lambda: _flip(folder / 'train.x.bin', 3000),
      'train.x.bin: block 0 fails its checksum',
    ),
  ):
    damage()
    capsys.readouterr()
    again = load_store(cfg, verify=True)
    err = capsys.readouterr().err
    assert (
      line in err
      and 'rebuilding it from' in err
      and len(err.strip().splitlines()) == 1
    )
    for (x, y), (wx, wy) in zip(_arrays(again), want):
      np.testing.assert_array_equal(x, wx)
      np.testing.assert_array_equal(y, wy)


@pytest.mark.slow
def test_cli_damaged_store_exits_2_naming_it_then_reruns_to_the_same_numbers(
  tmp_path,
):
  """Labels changed in the store of a run: the run stops with the store's
  one line (exit 2 through ``ConfigError``), never with other numbers;
  the same command then rebuilds it and gives the original numbers."""
  cfg = _emnist(tmp_path / 'data', seed=2, num=8)

  def job():
    parse_flags(
      '--algorithm=fedavg',
      '--dataset=emnist',
      f'--data_dir={cfg.data_dir}',
      '--model=logreg',
      '--layout=host',
      '--cohort_size=3',
      '--rounds=2',
      '--progress=false',
      f'--output_dir={tmp_path}/out',
      '--overwrite',
    )
    return experiment_entry.main_job()

  first = job()['fedavg']
  folder = load_store(cfg).folder
  _flip(folder / 'train.y.bin', 0, 64)
  with pytest.raises(
    DataError, match='a damaged population store .* run the same command again'
  ):
    job()
  again = job()['fedavg']
  assert again['per_client_accuracy'] == first['per_client_accuracy']
  assert again['train_loss'] == first['train_loss']


def test_stores_are_keyed_by_their_sources_contents(tmp_path):
  """A source rewritten in place with the same size and modification time
  is hashed again (its change time moved) and gets its own store; an
  unchanged one is hashed once."""
  path = tmp_path / 'f.bin'
  path.write_bytes(b'a' * 1000)
  st = os.stat(path)
  first = local_files.content_digest(path)
  assert local_files.content_digest(path) == first
  with open(path, 'r+b') as f:
    f.write(b'b')
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
  assert (
    os.stat(path).st_size == st.st_size
    and os.stat(path).st_mtime_ns == st.st_mtime_ns
  )
  assert (
    local_files.content_digest(path) == local_files.sha256_file(path) != first
  )
  cfg = _emnist(tmp_path / 'data', seed=3)
  one = load_store(cfg)
  _emnist(tmp_path / 'data', seed=4)  # other examples in the same file names
  other = load_store(cfg)
  assert one.folder != other.folder
  assert [f for f, _ in one.manifest['identity']['files']] == [
    f for f, _ in other.manifest['identity']['files']
  ]


def test_leftovers_of_dead_builds_are_removed_and_an_interrupted_build_keeps_nothing(
  tmp_path,
):
  cfg = _emnist(tmp_path / 'data', seed=5)
  stores = local_files.cache_dir() / 'stores'
  stores.mkdir(parents=True, exist_ok=True)
  dead = subprocess.run(
    [sys.executable, '-c', 'import os; print(os.getpid())'],
    capture_output=True,
    text=True,
    check=True,
  ).stdout.strip()
  for name in (f'emnist-0.partial-{dead}', f'emnist-1.damaged-{dead}'):
    (stores / name).mkdir()
    (stores / name / 'train.x.bin').write_bytes(b'\0' * 64)
  # a live process's build stays
  mine = stores / f'emnist-2.partial-{os.getpid()}'
  mine.mkdir()
  with pytest.raises(KeyboardInterrupt):
    load_store(cfg, should_stop=lambda: True)
  # nothing of the interrupted build
  assert [p.name for p in stores.iterdir()] == [mine.name]


def test_a_full_disk_while_building_names_the_cache_folder(
  tmp_path, monkeypatch
):
  cfg = _emnist(tmp_path / 'data', seed=6)

  class Full:
    def __init__(self, *a):
      pass

    def write(self, data):
      raise OSError(errno.ENOSPC, 'No space left on device')

    def close(self):
      pass

  monkeypatch.setattr(store_lib, 'open', Full, raising=False)
  with pytest.raises(OSError) as e:
    load_store(cfg)
  assert e.value.errno == errno.ENOSPC
  assert str(local_files.cache_dir() / 'stores') in e.value.filename
  from fedjax_personal.run import faults

  assert str(local_files.cache_dir()) in str(
    faults.storage_error(e.value.filename, e.value)
  )
  assert not [
    p
    for p in (local_files.cache_dir() / 'stores').iterdir()
    if 'partial' in p.name
  ]


def test_a_store_never_outlives_the_loader_code_that_made_it(
  tmp_path, capsys, monkeypatch
):
  """The store records the loader's code (``registry.loader_code``: the
  source of the data set's module and the shared registry); other code, or
  --rebuild_store, rebuilds it in one line; a killed build's leftovers are
  removed when the cache is next opened, not only by the next build."""
  from fedjax_personal.datasets import registry

  cfg = _emnist(tmp_path / 'data', seed=7)
  first = load_store(cfg)
  assert first.manifest['identity']['loader_code'] == registry.loader_code(
    'emnist'
  )
  assert registry.loader_code('emnist') != registry.loader_code('shakespeare')
  capsys.readouterr()
  # reused
  assert load_store(cfg).folder == first.folder and not capsys.readouterr().err
  dead = subprocess.run(
    [sys.executable, '-c', 'import os; print(os.getpid())'],
    capture_output=True,
    text=True,
    check=True,
  ).stdout.strip()
  leftover = first.folder.parent / f'emnist-9.partial-{dead}'
  leftover.mkdir()
  monkeypatch.setattr(
    registry, 'loader_code', lambda dataset: 'changed0000code'
  )
  again = load_store(cfg)
  err = capsys.readouterr().err
  assert (
    'written by other loader code' in err and 'this is changed0000code' in err
  )
  assert len(err.strip().splitlines()) == 1 and not leftover.exists()
  assert again.manifest['identity']['loader_code'] == 'changed0000code'
  np.testing.assert_array_equal(_arrays(again)[0][0], _arrays(first)[0][0])
  load_store(cfg, rebuild=True)
  assert 'as --rebuild_store asks' in capsys.readouterr().err


def test_a_store_damaged_mid_run_names_the_resume_command(tmp_path):
  """Damage found after a checkpoint was written: the line names --resume
  (the store is rebuilt on the way), not a fresh start."""
  from fedjax_personal.core.population import store as store_lib

  folder = tmp_path / 'store'
  folder.mkdir()
  fault = store_lib.damaged(folder, 'train.x.bin: block 3 fails its checksum')
  assert (
    str(fault).endswith(
      'removed it: run the same command again to rebuild it from its '
      'source files'
    )
    and not folder.exists()
  )
  resumed = fault.then(
    'run the same command with --resume (the checkpoint of round 4 of fedavg '
    'is kept in out/fedavg/checkpoints)'
  )
  assert (
    isinstance(resumed, store_lib.StoreDamaged) and resumed.what == fault.what
  )
  assert str(resumed).endswith(
    'removed it: run the same command with --resume (the checkpoint '
    'of round 4 of fedavg is kept in out/fedavg/checkpoints) to '
    'rebuild it from its source files'
  )
