"""Every fault ends in one line with its documented exit status and loses
nothing: Ctrl-C and SIGTERM (stop after the round, checkpoint kept), disk
full while checkpointing (a real small filesystem where one can be mounted,
else Orbax's save failing with the disk's error), a process that never joins
or is killed, two runs racing for one folder. After each, ``--resume``
reaches the uninterrupted run's numbers."""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fedjax_personal.run import faults, run_progress

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'scripts', 'run_experiment.py')
RUN = [
  '--algorithm=fedavg',
  '--dataset=digits',
  '--model=mlp',
  '--num_clients=8',
  '--eval_every=1',
  '--checkpoint_every=2',
  '--progress=false',
]


def _start(args, **kw):
  return subprocess.Popen(
    [sys.executable, SCRIPT, *args],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu', **kw.pop('env', {})},
    **kw,
  )


def _lines(path):
  strip = lambda r: {k: v for k, v in r.items() if 'seconds' not in k}
  return [strip(json.loads(l)) for l in open(path)]


def _errors(stderr):
  return [l for l in stderr.splitlines() if l.startswith('error:')]


def _wait_for_rounds(path, n, proc, timeout=120):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline and proc.poll() is None:
    if os.path.exists(path) and sum(1 for _ in open(path)) >= n:
      return
    time.sleep(0.1)
  raise AssertionError(f'{n} rounds not reached: {proc.poll()}')


def _uninterrupted(tmp_path, rounds):
  out = tmp_path / 'whole'
  r = subprocess.run(
    [sys.executable, SCRIPT, *RUN, f'--rounds={rounds}', f'--output_dir={out}'],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  return _lines(out / 'fedavg' / 'metrics.jsonl')


# the same path
@pytest.mark.parametrize(
  'sig,status,word',
  [
    (signal.SIGINT, 130, 'interrupted'),
    pytest.param(signal.SIGTERM, 143, 'terminated', marks=pytest.mark.slow),
  ],
)
@pytest.mark.slow_variants('2-130-interrupted')
def test_signal_stops_after_the_round_and_resume_equals_uninterrupted(
  tmp_path, sig, status, word
):
  rounds, out = 300, tmp_path / 'run'
  args = [*RUN, f'--rounds={rounds}', f'--output_dir={out}']
  proc = _start(args)
  _wait_for_rounds(out / 'fedavg' / 'metrics.jsonl', 5, proc)
  proc.send_signal(sig)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == status and 'Traceback' not in err, err[-2000:]
  (line,) = _errors(err)
  done = int(line.split(f'{word} after round ')[1].split()[0])
  assert (
    f'checkpoint of round {done} of fedavg kept' in line and '--resume' in line
  )
  metrics = _lines(out / 'fedavg' / 'metrics.jsonl')
  # nothing past the checkpoint that resume would redo
  assert metrics[-1]['round'] == done
  if sig == signal.SIGTERM:
    return
  # Resumed a few rounds past the checkpoint (--rounds may grow on resume):
  # the uninterrupted run's records, without training 300 rounds twice.
  rounds = done + 3
  r = subprocess.run(
    [
      sys.executable,
      SCRIPT,
      *RUN,
      f'--rounds={rounds}',
      f'--output_dir={out}',
      '--resume',
    ],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  got, want = (
    _lines(out / 'fedavg' / 'metrics.jsonl'),
    _uninterrupted(tmp_path, rounds),
  )
  diff = [
    (g['round'], k)
    for g, w in zip(got, want)
    for k in g
    if g.get(k) != w.get(k)
  ]
  assert len(got) == len(want) and not diff, diff[:5]


def _mount_small(folder, size):
  folder.mkdir()
  r = subprocess.run(
    ['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', str(folder)],
    capture_output=True,
    text=True,
  )
  return r.returncode == 0


@pytest.mark.slow
def test_disk_full_while_checkpointing_then_resume(tmp_path):
  small = tmp_path / 'small'
  if not _mount_small(small, '300k'):
    pytest.skip(
      'cannot mount a small tmpfs here (needs root); '
      'test_failed_save_keeps_the_last_checkpoint simulates it'
    )
  try:
    args = [*RUN, '--rounds=30', f'--output_dir={small}/run']
    r = subprocess.run(
      [sys.executable, SCRIPT, *args],
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert r.returncode == faults.EXIT_STORAGE, r.stderr[-3000:]
    assert 'Traceback' not in r.stderr and 'Event loop' not in r.stderr
    (line,) = _errors(r.stderr)
    assert 'No space left on device' in line and '--resume' in line
    kept = int(
      line.split(' of fedavg kept')[0].split('checkpoint of round ')[-1]
    )
    ckpts = os.listdir(small / 'run' / 'fedavg' / 'checkpoints')
    # the partial one is gone
    assert str(kept) in ckpts and not [c for c in ckpts if 'tmp' in c]
    subprocess.run(['mount', '-o', 'remount,size=50m', str(small)], check=True)
    r = subprocess.run(
      [sys.executable, SCRIPT, *args, '--resume'],
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert _lines(small / 'run' / 'fedavg' / 'metrics.jsonl') == _uninterrupted(
      tmp_path, 30
    )
  finally:
    subprocess.run(['umount', str(small)], capture_output=True)


@pytest.mark.slow
def test_disk_full_while_writing_metrics(tmp_path):
  small = tmp_path / 'small'
  if not _mount_small(small, '40k'):
    pytest.skip('cannot mount a small tmpfs here (needs root)')
  try:
    run = [a for a in RUN if not a.startswith('--checkpoint_every')]
    r = subprocess.run(
      [
        sys.executable,
        SCRIPT,
        *run,
        '--checkpoint_every=0',
        '--rounds=300',
        f'--output_dir={small}/run',
      ],
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert (
      r.returncode == faults.EXIT_STORAGE and 'Traceback' not in r.stderr
    ), r.stderr[-2000:]
    (line,) = _errors(r.stderr)
    assert line.startswith(
      f'error: cannot write {small}/run/fedavg/metrics.jsonl (round '
    )
    assert 'No space left on device; no checkpoint written yet' in line
  finally:
    subprocess.run(['umount', str(small)], capture_output=True)


def test_failed_save_keeps_the_last_checkpoint(tmp_path, monkeypatch):
  """Orbax reporting the disk's error (as TensorStore words it) while the
  partial checkpoint lies on disk: one StorageError naming the last good
  checkpoint; the partial one removed."""
  import jax.numpy as jnp
  import orbax.checkpoint as ocp

  from fedjax_personal.run import checkpointing

  progress = run_progress.RunProgress()
  progress.start_algorithm('fedavg', 0, str(tmp_path), True)
  saver = checkpointing.Checkpointer(str(tmp_path), 2, progress=progress)
  with run_progress.tracking(progress):
    saver.on_round_end(2, [{'round': 2}], {'w': jnp.ones(3)})
  assert progress.checkpoint_round == 2

  def full(self, step, *a, **k):
    os.makedirs(
      os.path.join(str(self.directory), f'{step}.orbax-checkpoint-tmp')
    )
    raise ValueError(
      'RESOURCE_EXHAUSTED: Failed to write 231 bytes to file 17: No space left '
      'on '
      "device [os_error_code='28']"
    )

  monkeypatch.setattr(ocp.CheckpointManager, 'save', full)
  with run_progress.tracking(progress), pytest.raises(faults.StorageError) as e:
    saver.on_round_end(4, [{'round': 4}], {'w': jnp.ones(3)})
  assert str(e.value).startswith(
    f'cannot write the checkpoint of round 4 to {tmp_path}: No space'
  )
  assert f'checkpoint of round 2 of fedavg kept in {tmp_path}' in str(e.value)
  assert sorted(os.listdir(tmp_path)) == ['2']


@pytest.mark.parametrize(
  'exc,reason',
  [
    (
      OSError(errno.ENOSPC, 'No space left on device'),
      'No space left on device',
    ),
    (OSError(errno.EROFS, 'Read-only file system'), 'Read-only file system'),
    (ValueError("Failed writing [os_error_code='122']"), 'Disk quota exceeded'),
    (ValueError('some other error'), None),
  ],
)
def test_storage_reasons(exc, reason):
  assert faults.storage_reason(exc) == reason
  wrapped = RuntimeError('outer')
  wrapped.__cause__ = exc
  assert faults.storage_reason(wrapped) == reason


def test_a_peer_that_never_comes(tmp_path):
  from test_distributed import free_port

  start = time.monotonic()
  r = subprocess.run(
    [
      sys.executable,
      SCRIPT,
      *RUN,
      '--rounds=2',
      f'--output_dir={tmp_path}',
      f'--coordinator_address=localhost:{free_port()}',
      '--num_processes=2',
      '--process_id=0',
      '--distributed_timeout=5',
    ],
    capture_output=True,
    text=True,
    timeout=120,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
  )
  assert r.returncode == faults.EXIT_LOST_PROCESS, r.stderr[-2000:]
  # start-up + the timeout, not JAX's abort later
  assert time.monotonic() - start < 5 + 20
  assert (
    'Check failure' not in r.stderr and 'Fatal Python error' not in r.stderr
  )
  (line,) = _errors(r.stderr)
  assert 'process 0:' in line and 'localhost:' in line and 'within 5 s' in line


@pytest.mark.slow
# 2: Gloo's AllGather fails in a checkpoint's sync
@pytest.mark.parametrize('devices', [1, 2])
def test_a_killed_process_is_one_line_and_resume_equals_uninterrupted(
  tmp_path, devices
):
  from test_distributed import SMALL, finish, launch, metrics

  args = [
    '--algorithm=fedavg',
    '--model=mlp',
    *SMALL,
    '--rounds=400',
    '--checkpoint_every=5',
    '--distributed_timeout=10',
  ]
  procs = launch([*args, f'--output_dir={tmp_path}/run'], devices=devices)
  _wait_for_rounds(tmp_path / 'run' / 'fedavg' / 'metrics.jsonl', 20, procs[0])
  procs[1].send_signal(signal.SIGKILL)
  start = time.monotonic()
  _, err = procs[0].communicate(timeout=120)
  assert time.monotonic() - start < 10 + 5
  assert (
    procs[0].returncode == faults.EXIT_LOST_PROCESS and 'Traceback' not in err
  ), err[-2000:]
  (line,) = _errors(err)
  assert (
    'lost a process of the run' in line and 'coordinator localhost:' in line
  )
  assert f'process 1 (pid {procs[1].pid} on ' in line  # which one, where
  assert '--resume' in line
  results = finish(
    launch([*args, f'--output_dir={tmp_path}/run', '--resume'], devices=devices)
  )
  assert [r[0] for r in results] == [0, 0], results[0][2][-2000:]
  results = finish(
    launch([*args, f'--output_dir={tmp_path}/whole'], devices=devices)
  )
  assert [r[0] for r in results] == [0, 0], results[0][2][-2000:]
  strip = lambda rs: [
    {k: v for k, v in r.items() if 'seconds' not in k} for r in rs
  ]
  assert strip(metrics(f'{tmp_path}/run', 'fedavg')) == strip(
    metrics(f'{tmp_path}/whole', 'fedavg')
  )


@pytest.mark.slow
def test_a_signal_to_one_process_stops_all_after_the_same_round(tmp_path):
  from test_distributed import SMALL, finish, launch

  procs = launch(
    [
      '--algorithm=fedavg',
      '--model=mlp',
      *SMALL,
      '--rounds=400',
      '--checkpoint_every=5',
      f'--output_dir={tmp_path}/run',
    ],
    devices=1,
  )
  _wait_for_rounds(tmp_path / 'run' / 'fedavg' / 'metrics.jsonl', 20, procs[0])
  procs[1].send_signal(signal.SIGINT)
  results = finish(procs)
  lines = [_errors(e) for _, _, e in results]
  assert [r[0] for r in results] == [130, 130] and lines[0] == lines[1], results
  assert 'interrupted after round' in lines[0][0]


@pytest.mark.slow
def test_two_runs_racing_for_one_folder(tmp_path):
  """The run that comes second says the folder is in use (the lock is the
  operating system's: it goes with the process that holds it)."""
  holder = subprocess.Popen(
    [
      sys.executable,
      '-c',
      'import sys, time; from fedjax_personal.run import run_identity; '
      'run_identity.lock(sys.argv[1]); print("locked", flush=True); '
      'time.sleep(60)',
      str(tmp_path / 'run'),
    ],
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert holder.stdout.readline().strip() == 'locked'
    r = subprocess.run(
      [
        sys.executable,
        SCRIPT,
        *RUN,
        '--rounds=2',
        f'--output_dir={tmp_path}/run',
      ],
      capture_output=True,
      text=True,
      timeout=120,
    )
    assert r.returncode == 2 and 'Traceback' not in r.stderr
    (line,) = _errors(r.stderr)
    assert (
      f'{tmp_path}/run is in use by another run (process {holder.pid}' in line
    )
  finally:
    holder.kill()
    holder.wait()
  r = subprocess.run(
    [
      sys.executable,
      SCRIPT,
      *RUN,
      '--rounds=2',
      f'--output_dir={tmp_path}/run',
    ],
    capture_output=True,
    text=True,
    timeout=120,
  )
  # a killed holder leaves no stale lock
  assert r.returncode == 0, r.stderr[-2000:]


def test_a_reproduce_script_interrupted_is_one_line(tmp_path):
  """The reproduce scripts (one fault path: ``run.entry``): Ctrl-C is one
  line naming the kept trials, exit 130, no traceback or crash at exit."""
  proc = subprocess.Popen(
    [
      sys.executable,
      os.path.join(ROOT, 'scripts', 'reproduce_user_centric.py'),
      f'--output_dir={tmp_path}',
      '--trials=1',
    ],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONUNBUFFERED': '1'},
  )
  # the data's line: the trial starts
  assert proc.stdout.readline().startswith('mnist/')
  time.sleep(2)
  assert proc.poll() is None
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err[-2000:]
  assert 'Traceback' not in err and 'Fatal Python error' not in err
  (line,) = _errors(err)
  assert line == (
    'error: interrupted; the trials finished so far are kept under '
    '<output_dir>/trials; the same command continues from them'
  )


def test_a_signal_after_the_last_round_says_the_run_finished(capsys):
  """SIGTERM while the last round's results are written: the run names
  the last round (not a round past the end), writes everything, and ends
  with one line saying so, nothing to resume; a signal between two
  algorithms stops before the next one starts."""
  from fedjax_personal.run import faults

  old = {s: signal.getsignal(s) for s in faults.EXIT_SIGNAL}
  saved = dict(faults._REQUEST)
  try:
    faults.install_signal_handlers()
    progress = run_progress.RunProgress()
    progress.start_algorithm(
      'fedavg', 0, '/tmp/x/checkpoints', False, None, rounds=2
    )
    progress.round, progress.output_dir = 2, 'runs/x'
    tracked = run_progress.tracking(progress)
    tracked.__enter__()
    os.kill(os.getpid(), signal.SIGTERM)
    err = capsys.readouterr().err
    assert (
      'stopping after the last round of fedavg (its results are being written)'
      in err
    )
    assert 'round 3' not in err
    assert faults.finished_line() == (
      'terminated after the last round of fedavg: every '
      'algorithm finished and its results are written in runs/x; '
      'nothing to resume'
    )
    stop = faults.interrupted()
    assert str(stop).startswith(
      'terminated after the last round of fedavg, its results written'
    )
    assert stop.status == 143
    tracked.__exit__(None, None, None)
    assert (
      faults.kept() == 'nothing was trained yet; run the same command again'
    )
  finally:
    faults._REQUEST.update(saved)
    for s, h in old.items():
      signal.signal(s, h)


_SWALLOWED = """
import gc, os, signal, sys, time
from fedjax_personal.run import script_entry

def main(argv):
  fired = []
  def callback(phase, info):
    # The handler's KeyboardInterrupt raised here is dropped by Python
    # ("Exception ignored in"), as inside JAX's _xla_gc_callback.
    if phase == 'start' and not fired:
      fired.append(1)
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.2)
  gc.callbacks.append(callback)
  gc.collect()
  print('swallowed', flush=True)
  while True:
    time.sleep(0.05)

script_entry.run_script(main, kept='nothing')
"""


def test_a_signal_swallowed_by_a_gc_callback_is_delivered_again(tmp_path):
  script = tmp_path / 'swallowed.py'
  script.write_text(_SWALLOWED)
  r = subprocess.run(
    [sys.executable, str(script)],
    capture_output=True,
    text=True,
    timeout=60,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
  )
  assert 'swallowed' in r.stdout
  assert r.returncode == 130, r.stderr[-2000:]
  assert r.stderr.rstrip().endswith('error: interrupted; nothing'), r.stderr[
    -2000:
  ]


# SIGTERM sent by the run to itself when an algorithm's metrics of a round are
# written (``--rounds`` of it: its last round), or during start-up.
_SIGNAL_AT = r"""
import json, os, signal, sys
from fedjax_personal.run import experiment_entry, reporting, main_job
alg, at = sys.argv[1], int(sys.argv[2])
if at == 0:  # during start-up: once the data are loaded
  load = main_job.load_data
  def load_data(settings):
    loaded = load(settings)
    os.kill(os.getpid(), signal.SIGTERM)
    return loaded
  main_job.load_data = load_data
else:
  write = reporting.MetricsWriter.on_round_end
  def on_round_end(self, round_num, records, state):
    write(self, round_num, records, state)
    if round_num == at and os.path.basename(os.path.dirname(self.path)) == alg:
      os.kill(os.getpid(), signal.SIGTERM)
  reporting.MetricsWriter.on_round_end = on_round_end
sys.argv = ['run_experiment.py', *json.loads(sys.argv[3])]
experiment_entry.run()
"""


def _terminated_at(alg, at, args):
  return subprocess.run(
    [sys.executable, '-c', _SIGNAL_AT, alg, str(at), json.dumps(args)],
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
  )


@pytest.mark.slow
def test_sigterm_at_an_algorithms_last_round_writes_its_results_and_names_the_next_command(
  tmp_path,
):
  """SIGTERM as FedAvg's last round ends, Local still to come: FedAvg's
  summary and the comparison are written, the line says so and names
  --resume (which starts Local, never reached), and that command finishes
  the run; during start-up the line says nothing was trained."""
  out = tmp_path / 'run'
  args = [
    '--algorithm=fedavg,local',
    '--dataset=digits',
    '--model=mlp',
    '--num_clients=6',
    '--rounds=2',
    '--eval_every=1',
    '--checkpoint_every=1',
    '--progress=false',
    f'--output_dir={out}',
  ]
  r = _terminated_at('fedavg', 2, args)
  assert r.returncode == 143 and 'Traceback' not in r.stderr, r.stderr[-2000:]
  (line,) = _errors(r.stderr)
  assert (
    'terminated after the last round of fedavg, its results written' in line
  ), line
  assert line.endswith('continue with the same command and --resume'), line
  assert (out / 'fedavg' / 'summary.json').exists() and (
    out / 'comparison.json'
  ).exists()
  assert not (out / 'local' / 'summary.json').exists()
  r = subprocess.run(
    [sys.executable, SCRIPT, *args, '--resume'],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  assert (out / 'local' / 'summary.json').exists()
  r = _terminated_at(
    '',
    0,
    [*args[:-1], f'--output_dir={tmp_path}/startup', '--compilation_cache=off'],
  )
  assert r.returncode == 143 and 'Traceback' not in r.stderr, r.stderr[-2000:]
  (line,) = _errors(r.stderr)
  assert line == (
    'error: terminated during start-up; nothing was trained yet; run the same '
    'command again'
  ), line


@pytest.mark.parametrize(
  'every', ['0', pytest.param('1', marks=pytest.mark.slow)]
)
@pytest.mark.slow_variants('0')
def test_sigterm_at_the_runs_last_round_ends_it_with_everything_written(
  tmp_path, every
):
  """The same signal at the last round of the last algorithm, with and
  without checkpoints: every result written, one line saying so, exit 0."""
  out = tmp_path / 'last'
  args = [
    '--algorithm=fedavg,local',
    '--dataset=digits',
    '--model=mlp',
    '--num_clients=6',
    '--rounds=2',
    '--eval_every=1',
    f'--checkpoint_every={every}',
    '--progress=false',
    f'--output_dir={out}',
  ]
  r = _terminated_at('local', 2, args)
  assert r.returncode == 0 and 'Traceback' not in r.stderr, r.stderr[-2000:]
  assert r.stderr.rstrip().splitlines()[-1] == (
    f'terminated after the last round of local: every algorithm finished and '
    f'its results '
    f'are written in {out}; nothing to resume'
  )
  assert (out / 'local' / 'summary.json').exists() and (
    out / 'comparison.json'
  ).exists()


def _under_address_limit(limit_bytes, args):
  """The command under ``ulimit -v`` (set by a shell, not in this
  multithreaded process)."""
  return subprocess.run(
    [
      'bash',
      '-c',
      f'ulimit -v {limit_bytes // 1024} && exec "$0" "$@"',
      sys.executable,
      SCRIPT,
      *args,
    ],
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
  )


@pytest.mark.slow
def test_a_sweep_under_an_address_space_limit(tmp_path):
  """``ulimit -v`` of 1.5 GB: a sweep runs (malloc's arenas limited before
  JAX's threads start: about 0.9 GB reserved, not 1.8); under 1 GB the
  command is refused in one line before anything starts."""
  args = [
    '--algorithm=fedavg',
    '--dataset=digits',
    '--model=mlp',
    '--num_clients=6',
    '--rounds=2',
    '--sweep=client_lr:0.1,0.2',
    '--progress=false',
  ]
  r = _under_address_limit(
    int(1.5 * 2**30), [*args, f'--output_dir={tmp_path}/a']
  )
  assert r.returncode == 0 and 'Traceback' not in r.stderr, r.stderr[-2000:]
  assert (tmp_path / 'a' / 'sweep.json').exists()
  r = _under_address_limit(
    int(0.9 * 2**30), [*args, f'--output_dir={tmp_path}/b']
  )
  assert r.returncode == 2, r.stderr[-2000:]
  (line,) = r.stderr.strip().splitlines()
  assert line.startswith(
    'error: ulimit -v: the process may use 0.90 GB of address space'
  ), line


@pytest.mark.slow
def test_an_output_dir_on_a_read_only_disk_exits_74_and_a_file_in_the_way_2(
  tmp_path,
):
  """A read-only --output_dir is a storage fault (74, as the README says);
  a file where the folder should be is a bad flag (2); each one line."""
  args = [*RUN, '--rounds=1', '--compilation_cache=off']
  (tmp_path / 'a_file').write_text('')
  got = [(2, f'{tmp_path}/a_file/run', '--output_dir: cannot write to')]
  ro = tmp_path / 'ro'
  if _mount_small(ro, '100k'):
    subprocess.run(['mount', '-o', 'remount,ro', str(ro)], check=True)
    got.append((faults.EXIT_STORAGE, f'{ro}/run', 'Read-only file system'))
  try:
    for status, out, says in got:
      r = subprocess.run(
        [sys.executable, SCRIPT, *args, f'--output_dir={out}'],
        capture_output=True,
        text=True,
        timeout=300,
      )
      assert r.returncode == status and 'Traceback' not in r.stderr, r.stderr[
        -2000:
      ]
      (line,) = _errors(r.stderr)
      assert says in line, line
  finally:
    subprocess.run(['umount', str(ro)], capture_output=True)


@pytest.mark.slow
def test_a_damaged_identity_file_is_refused_naming_it_and_overwrite_starts_again(
  tmp_path, capsys
):
  """The folder's identity.json emptied: a ConfigError naming the file and
  --overwrite (the command's one line, exit 2); --overwrite runs. An
  algorithm's made garbage (met when resuming): that algorithm alone is
  redone (one line says so), the other algorithm's results kept as they
  were."""
  from helpers import parse_flags

  from fedjax_personal.errors import ConfigError
  from fedjax_personal.run import experiment_entry

  out = tmp_path / 'run'
  args = [
    *(a for a in RUN if not a.startswith('--algorithm')),
    '--algorithm=fedavg,local',
    '--rounds=2',
    f'--output_dir={out}',
  ]
  parse_flags(*args)
  experiment_entry.main_job()
  path = out / 'identity.json'
  path.write_text('')
  parse_flags(*args)
  with pytest.raises(
    ConfigError, match=f'^--output_dir: {path} is damaged .* --overwrite'
  ):
    experiment_entry.main_job()
  parse_flags(*args, '--overwrite')
  experiment_entry.main_job()
  kept = (out / 'local' / 'metrics.jsonl').read_text()
  (out / 'fedavg' / 'identity.json').write_text('{"algo')
  capsys.readouterr()
  parse_flags(*args, '--resume')
  experiment_entry.main_job()
  err = capsys.readouterr().err
  assert 'is damaged' in err and 'fedavg is redone from its start' in err, err
  assert (
    json.loads((out / 'fedavg' / 'identity.json').read_text())['algorithm']
    == 'fedavg'
  )
  assert (out / 'local' / 'metrics.jsonl').read_text() == kept


@pytest.mark.slow
def test_ctrl_c_of_the_main_jobs_kind_then_the_docs_resume_equals_the_whole_run(
  tmp_path,
):
  """Two algorithms, no --checkpoint_every (as the README's main job runs):
  Ctrl-C during the first keeps the round in progress, and the README's
  --resume continues it and runs the second, which it never reached, to
  the uninterrupted run's numbers; a damaged top-level identity.json is
  rebuilt from the algorithms' own, not answered with --overwrite."""
  args = [
    '--algorithm=fedavg,local',
    '--dataset=digits',
    '--model=mlp',
    '--num_clients=8',
    '--eval_every=1',
    '--progress=false',
  ]
  out, rounds = tmp_path / 'run', 200
  proc = _start([*args, f'--rounds={rounds}', f'--output_dir={out}'])
  _wait_for_rounds(out / 'fedavg' / 'metrics.jsonl', 3, proc)
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130 and 'Traceback' not in err, err[-2000:]
  (line,) = _errors(err)
  assert line.endswith('continue with the same command and --resume'), line
  done = int(line.split('interrupted after round ')[1].split()[0])
  (out / 'identity.json').write_text('{"damaged')
  rounds = done + 2
  r = subprocess.run(
    [
      sys.executable,
      SCRIPT,
      *args,
      f'--rounds={rounds}',
      f'--output_dir={out}',
      '--resume',
    ],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  assert 'rebuilt from its algorithms' in r.stderr
  whole = tmp_path / 'whole'
  r = subprocess.run(
    [
      sys.executable,
      SCRIPT,
      *args,
      f'--rounds={rounds}',
      f'--output_dir={whole}',
    ],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  for alg in ('fedavg', 'local'):
    got, want = (
      _lines(out / alg / 'metrics.jsonl'),
      _lines(whole / alg / 'metrics.jsonl'),
    )
    assert got == want, alg


@pytest.mark.parametrize(
  'sig,status,word',
  [(signal.SIGTERM, 143, 'terminated'), (signal.SIGINT, 130, 'interrupted')],
)
def test_a_signal_while_jax_imports_is_one_line(tmp_path, sig, status, word):
  """A signal before the run's own handlers (JAX importing, 0.3 s in): one
  line, no traceback, nothing written."""
  proc = _start([*RUN, '--rounds=2', f'--output_dir={tmp_path}/run'])
  time.sleep(0.3)
  proc.send_signal(sig)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == status and 'Traceback' not in err, err[-2000:]
  assert _errors(err) == [
    f'error: {word} during start-up; nothing was trained yet; run the '
    'same command again'
  ], err
