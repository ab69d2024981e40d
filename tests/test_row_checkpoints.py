"""Checkpoints of client rows in files (``run/row_checkpoints.py``): each
checkpoint writes only the rows changed since the one before; a resume from
any kept checkpoint, in files or in memory, from a checkpoint of either
placement, reaches the uninterrupted run's numbers, also after a crash
between a delta and its Orbax step or in the middle of a fold; a damaged
file or another run's rows end in one line naming the file; a full disk
while writing rows ends in one line (exit status 74) and loses nothing."""

import json
import os
import subprocess
import sys

import jax
import made_files
import numpy as np
import pytest
from helpers import host_runner

from fedjax_personal.config import TrainingConfig
from fedjax_personal.core.population import rows_in_files
from fedjax_personal.core.sampling import CohortSampler
from fedjax_personal.datasets import DataConfig, load_store
from fedjax_personal.errors import ConfigError, DataError
from fedjax_personal.run import checkpointing, faults, row_checkpoints
from fedjax_personal.run.experiment import SingleRun, run_many

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED, COHORT = 3, 4


@pytest.fixture(scope='module')
def store(tmp_path_factory):
  folder = made_files.random_writers(
    tmp_path_factory.mktemp('emnist'), 5, 24, 30, 8
  )
  return load_store(
    DataConfig(
      dataset='emnist',
      partition='natural',
      num_clients=None,
      data_dir=str(folder),
    )
  )


def _runs(store, rows_folder, alg_name='ditto'):
  return SingleRun(
    host_runner(
      store,
      alg_name,
      TrainingConfig(client_lr=0.1, batch_size=8),
      CohortSampler(store.num_clients, cohort_size=COHORT),
      rows_folder,
    ),
    SEED,
  )


def _strip(history):
  return [{k: v for k, v in r.items() if 'seconds' not in k} for r in history]


def _rows(state, n):
  every = np.arange(n)
  return [np.asarray(a[every]) for a in jax.tree.leaves(state.rows)]


@pytest.fixture(scope='module')
def uninterrupted(store):
  state, (history,) = run_many(_runs(store, None), 7, eval_every=2)
  return _strip(history), _rows(state, store.num_clients)


def _cut_run(
  store, tmp_path, placement, rounds=5, keep=3, alg_name='ditto', **kw
):
  """A run checkpointed every 2 rounds (and at its end), as the loop does."""
  folder = str(tmp_path / 'rows_cut') if placement == 'files' else None
  ckpt = str(tmp_path / 'ckpt')
  run_many(
    _runs(store, folder, alg_name),
    rounds,
    eval_every=2,
    callbacks=[
      checkpointing.Checkpointer(ckpt, every=2, max_to_keep=keep, **kw)
    ],
  )
  return ckpt


def _resume(store, tmp_path, ckpt, placement, rounds=7, alg_name='ditto', **kw):
  folder = str(tmp_path / 'rows_resumed') if placement == 'files' else None
  runs = _runs(store, folder, alg_name)
  state, start, histories = checkpointing.restore_latest(
    ckpt, runs.init(), **kw
  )
  cb = checkpointing.Checkpointer(
    ckpt, every=2, max_to_keep=3, histories=histories, resumed_step=start
  )
  state, (history,) = run_many(
    runs,
    rounds,
    eval_every=2,
    state=state,
    start_round=start,
    histories=histories,
    callbacks=[cb],
  )
  return start, state, history


def _assert_same(store, state, history, uninterrupted):
  # The uninterrupted run keeps its rows in memory: a resume with rows in
  # files compiles other programs for the same sums (equal to 1e-6, BUILD.md).
  want_history, want_rows = uninterrupted
  got_history = _strip(history)
  assert [sorted(r) for r in got_history] == [sorted(r) for r in want_history]
  for got, want in zip(got_history, want_history):
    for k, v in want.items():
      np.testing.assert_allclose(
        np.asarray(got[k], np.float64),
        np.asarray(v, np.float64),
        rtol=1e-6,
        atol=1e-7,
        err_msg=k,
      )
  for got, want in zip(_rows(state, store.num_clients), want_rows):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
  'saved,resumed',
  [('files', 'files'), ('files', 'memory'), ('memory', 'files')],
)
@pytest.mark.ci_variants('files-files')
def test_resume_equals_uninterrupted_in_either_placement(
  store, tmp_path, uninterrupted, saved, resumed
):
  ckpt = _cut_run(store, tmp_path, saved)
  # killed before the end-of-run save was published
  checkpointing.manager(ckpt).delete(5)
  start, state, history = _resume(store, tmp_path, ckpt, resumed)
  assert start == 4
  _assert_same(store, state, history, uninterrupted)
  if resumed == 'files':
    assert all(
      isinstance(a, rows_in_files.DiskRows) for a in jax.tree.leaves(state.rows)
    )


# slow: 15 s on CI's 2 cores; CI keeps the resumption from rows in files
# (test_resume_equals_uninterrupted_in_either_placement)
@pytest.mark.slow
def test_a_state_of_nothing_but_rows_in_files_resumes_to_the_same_numbers(
  store, tmp_path
):
  """Local's state is all client rows: with them in files Orbax saves a
  marker (it refuses an empty item), and a resume equals the uninterrupted
  run."""
  state, (history,) = run_many(_runs(store, None, 'local'), 7, eval_every=2)
  uninterrupted = (_strip(history), _rows(state, store.num_clients))
  ckpt = _cut_run(store, tmp_path, 'files', alg_name='local')
  checkpointing.manager(ckpt).delete(5)
  start, state, history = _resume(
    store, tmp_path, ckpt, 'files', alg_name='local'
  )
  assert start == 4
  _assert_same(store, state, history, uninterrupted)


def test_each_checkpoint_writes_only_the_rows_changed_since_the_last(
  store, tmp_path
):
  ckpt = _cut_run(store, tmp_path, 'files', keep=2)
  mngr = checkpointing.manager(ckpt)
  assert sorted(mngr.all_steps()) == [4, 5]
  chain = checkpointing.rows_manifest_of(mngr, 5)['chain']
  assert [e['step'] for e in chain] == [2, 4, 5]
  root = os.path.join(ckpt, row_checkpoints.FOLDER)
  # Deltas 2 and 4 (every kept step holds them) are folded into the base;
  # only delta 5 is left, with the clients of round 5 alone.
  assert sorted(os.listdir(root)) == ['base', chain[-1]['name']]
  index = np.load(os.path.join(root, chain[-1]['name'], 'index-0.npy'))
  assert 0 < len(index) <= COHORT
  with np.load(os.path.join(root, 'base', 'meta.npz')) as meta:
    assert json.loads(str(meta['info']))['folded'] == [
      e['name'] for e in chain[:2]
    ]
    assert 0 < meta['made-0'].sum() <= 4 * COHORT


def test_a_crash_between_delta_and_step_or_inside_a_fold_resumes_to_the_same_numbers(
  store, tmp_path, uninterrupted, monkeypatch
):
  calls = []

  # rows written into the base, its index not replaced
  def crash(self, folded, identity):
    calls.append(folded)
    raise RuntimeError('killed while folding')

  monkeypatch.setattr(row_checkpoints._Base, 'publish', crash)
  with pytest.raises(RuntimeError, match='killed while folding'):
    _cut_run(store, tmp_path, 'files', keep=2)
  monkeypatch.undo()
  assert calls and os.listdir(
    os.path.join(tmp_path, 'ckpt', 'client_rows', 'base')
  )
  ckpt = str(tmp_path / 'ckpt')
  assert checkpointing.manager(ckpt).latest_step() == 2
  # A delta written for a step whose save never finished: ignored, then removed.
  runs = _runs(store, str(tmp_path / 'rows_orphan'))
  orphan = row_checkpoints.write_delta(ckpt, 4, runs.init(), [], '')['chain'][
    -1
  ]['name']
  start, state, history = _resume(store, tmp_path, ckpt, 'files')
  assert start == 2
  _assert_same(store, state, history, uninterrupted)
  assert orphan not in os.listdir(os.path.join(ckpt, row_checkpoints.FOLDER))


def _flip_byte(path, offset):
  with open(path, 'r+b') as f:
    f.seek(offset)
    b = f.read(1)
    f.seek(offset)
    f.write(bytes([b[0] ^ 0xFF]))


def test_damaged_rows_and_another_runs_rows_are_one_line_naming_the_file(
  store, tmp_path
):
  ident = {'algorithm': 'ditto', 'seed': SEED}
  ckpt = _cut_run(store, tmp_path, 'files', keep=2, identity=ident)
  mngr = checkpointing.manager(ckpt)
  root = os.path.join(ckpt, row_checkpoints.FOLDER)
  chain = checkpointing.rows_manifest_of(mngr, 5)['chain']
  restore = lambda: checkpointing.restore_latest(
    ckpt, _runs(store, str(tmp_path / 'r')).init(), ident
  )
  restore()  # intact
  delta = os.path.join(root, chain[-1]['name'], 'leaf-0-1.npy')
  _flip_byte(delta, os.path.getsize(delta) - 3)
  with pytest.raises(DataError, match=f'{delta}: damaged'):
    restore()
  _flip_byte(delta, os.path.getsize(delta) - 3)
  with np.load(os.path.join(root, 'base', 'meta.npz')) as meta:
    made = np.flatnonzero(meta['made-0'])
    info, arrays = (
      json.loads(str(meta['info'])),
      {k: meta[k] for k in meta.files},
    )
  base = os.path.join(root, 'base', 'leaf-0-1.rows')
  row_bytes = jax.tree.leaves(_runs(store, None).init().rows)[1][0].nbytes
  _flip_byte(base, int(made[0]) * row_bytes + 5)
  with pytest.raises(
    DataError, match=f'{base}: damaged \\(client row {int(made[0])} '
  ):
    restore()
  _flip_byte(base, int(made[0]) * row_bytes + 5)
  arrays['info'] = np.asarray(json.dumps({**info, 'identity': 'another'}))
  np.savez(os.path.join(root, 'base', 'meta.npz'), **arrays)
  with pytest.raises(DataError, match='the rows of another run'):
    restore()


def _cli(args, env=None, patch=''):
  code = (
    'import sys\n'
    + patch
    + 'from fedjax_personal.run import experiment_entry\n'
    f'sys.argv = ["run_experiment.py"] + {list(args)!r}\ncli.run()\n'
  )
  return subprocess.run(
    [sys.executable, '-c', code],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
  )


@pytest.mark.slow
def test_a_full_disk_while_writing_rows_is_one_line_and_resume_loses_nothing(
  tmp_path,
):
  data_dir = made_files.random_writers(tmp_path / 'data', 2, 10, 20, 6)
  common = [
    '--algorithm=ditto',
    '--dataset=emnist',
    f'--data_dir={data_dir}',
    '--model=logreg',
    '--cohort_size=3',
    '--rounds=5',
    '--eval_every=1',
    '--progress=false',
    '--layout=host',
    '--checkpoint_every=1',
  ]
  out = tmp_path / 'run'
  # The disk fills once the checkpoint of round 2 is published.
  patch = (
    'import errno, os\n_pwrite = os.pwrite\n'
    'def pwrite(fd, data, offset):\n'
    f'  if os.path.isdir({str(out)!r} + "/ditto/checkpoints/2"):\n'
    '    raise OSError(errno.ENOSPC, "No space left on device")\n'
    '  return _pwrite(fd, data, offset)\nos.pwrite = pwrite\n'
  )
  r = _cli([*common, '--client_state=disk', f'--output_dir={out}'], patch=patch)
  assert r.returncode == faults.EXIT_STORAGE and 'Traceback' not in r.stderr, (
    r.stderr[-2000:]
  )
  (line,) = [l for l in r.stderr.splitlines() if l.startswith('error:')]
  assert line.startswith(f'error: cannot write {out}/client_rows/ditto-')
  assert (
    ': No space left on device; checkpoint of round 2 of ditto kept' in line
  )
  assert '--resume' in line
  r = _cli([*common, '--client_state=disk', f'--output_dir={out}', '--resume'])
  assert r.returncode == 0, r.stderr[-2000:]
  r = _cli([*common, '--client_state=memory', f'--output_dir={tmp_path}/whole'])
  assert r.returncode == 0, r.stderr[-2000:]
  lines = lambda p: [
    {k: v for k, v in json.loads(l).items() if 'seconds' not in k}
    for l in open(p / 'ditto' / 'metrics.jsonl')
  ]
  assert lines(out) == lines(tmp_path / 'whole')


@pytest.mark.slow
def test_cli_trials_with_rows_in_files_resume_in_memory_equal_one_whole_run(
  store, tmp_path
):
  """Several configurations (a list of states, each its own rows and delta
  files), checkpointed in files and resumed in memory."""
  from helpers import parse_flags

  from fedjax_personal.run import experiment_entry

  data_dir = made_files.random_writers(tmp_path / 'data', 2, 10, 20, 6)
  common = (
    '--algorithm=ditto',
    '--dataset=emnist',
    f'--data_dir={data_dir}',
    '--model=logreg',
    '--cohort_size=3',
    '--eval_every=1',
    '--progress=false',
    '--layout=host',
    '--trials=2',
  )
  parse_flags(
    *common,
    '--rounds=4',
    '--client_state=memory',
    f'--output_dir={tmp_path}/whole',
  )
  whole = experiment_entry.main_job()
  parse_flags(
    *common,
    '--rounds=2',
    '--client_state=disk',
    '--checkpoint_every=1',
    f'--output_dir={tmp_path}/cut',
  )
  experiment_entry.main_job()
  manifest = checkpointing.rows_manifest_of(
    checkpointing.manager(f'{tmp_path}/cut/ditto/checkpoints'), 2
  )
  assert len(manifest['shapes']) == 2  # one state per trial
  parse_flags(
    *common,
    '--rounds=4',
    '--resume',
    f'--output_dir={tmp_path}/cut',
    '--layout=device',
  )
  with pytest.raises(
    ConfigError,
    match='keeps its client rows in files: resume with --layout=host',
  ):
    experiment_entry.main_job()
  parse_flags(
    *common,
    '--rounds=4',
    '--client_state=memory',
    '--resume',
    f'--output_dir={tmp_path}/cut',
  )
  resumed = experiment_entry.main_job()
  strip = lambda s: {
    k: v
    for k, v in s.items()
    if 'seconds' not in k and not k.startswith('resumed_after_round')
  }
  assert whole.keys() == resumed.keys()
  for k in whole:
    assert strip(resumed[k]) == strip(whole[k]), k
