"""One experiment over several processes (JAX's multi-controller runtime on
CPU: 2 processes x 2 devices on localhost) gives the one-process numbers;
bad launches stop every process with one line.

CI runs FedAvg + Ditto (per-client state) against one process, resumed
across a restart, and the refusals; ``slow`` adds user-centric (W and
streams inside the round) and the failure cases (a killed process, an
error in one process)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'scripts', 'run_experiment.py')
SMALL = [
  '--dataset=digits',
  '--partition=dirichlet',
  '--num_clients=8',
  '--eval_every=1',
  '--progress=false',
]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('', 0))
    return s.getsockname()[1]


def launch(args, n=2, per_process=None, devices=2):
  """Starts ``n`` processes of run_experiment (``per_process[i]``: extra
  arguments of process i); returns the Popen objects."""
  port = free_port()
  env = {
    **os.environ,
    'JAX_NUM_CPU_DEVICES': str(devices),
    'JAX_PLATFORMS': 'cpu',
  }
  procs = []
  for i in range(n):
    extra = (per_process or {}).get(i, [])
    procs.append(
      subprocess.Popen(
        [
          sys.executable,
          SCRIPT,
          *args,
          *extra,
          f'--coordinator_address=localhost:{port}',
          f'--num_processes={n}',
          f'--process_id={i}',
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
      )
    )
  return procs


def finish(procs, timeout=240):
  out = []
  for p in procs:
    o, e = p.communicate(timeout=timeout)
    out.append((p.returncode, o, e))
  return out


def run_single(args):
  r = subprocess.run(
    [sys.executable, SCRIPT, *args],
    capture_output=True,
    text=True,
    timeout=240,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
  )
  assert r.returncode == 0, r.stderr[-3000:]
  return r


def metrics(directory, alg):
  return [
    json.loads(l) for l in open(os.path.join(directory, alg, 'metrics.jsonl'))
  ]


def assert_same_records(a, b):
  assert [r['round'] for r in a] == [r['round'] for r in b]
  for x, y in zip(a, b):
    for k in ('train_loss', 'loss_weighted', 'accuracy_mean', 'accuracy_worst'):
      np.testing.assert_allclose(x[k], y[k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert x['per_client_accuracy'] == pytest.approx(
      y['per_client_accuracy'], abs=1e-6
    )


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
  """The suite's check (the resume and Ditto below, with -m slow)."""
  args = ['--algorithm=fedavg', '--model=logreg', *SMALL, '--rounds=2']
  two, one = str(tmp_path / 'two'), str(tmp_path / 'one')
  results = finish(launch([*args, f'--output_dir={two}']))
  assert [r[0] for r in results] == [0, 0], (
    results[0][2][-3000:] + results[1][2][-3000:]
  )
  assert 'sharded(4 devices, 2 processes)' in results[0][1]
  run_single([*args, f'--output_dir={one}'])
  assert_same_records(metrics(two, 'fedavg'), metrics(one, 'fedavg'))


@pytest.mark.slow
def test_two_processes_equal_one_and_resume(tmp_path):
  args = [
    '--algorithm=fedavg,ditto',
    '--model=logreg',
    *SMALL,
    '--checkpoint_every=1',
  ]
  two, one = str(tmp_path / 'two'), str(tmp_path / 'one')
  results = finish(
    launch([*args, '--rounds=2', '--plots=wait', f'--output_dir={two}'])
  )
  assert [r[0] for r in results] == [0, 0], (
    results[0][2][-3000:] + results[1][2][-3000:]
  )
  assert 'sharded(4 devices, 2 processes)' in results[0][1]
  # Process 1 prints nothing (Gloo's connection lines aside, which its C++
  # threads may split across lines): process 0 reports.
  assert not [
    l
    for l in results[1][1].splitlines()
    if l.strip() and '[Gloo]' not in l and 'peer ranks' not in l
  ]
  # Process 0 alone wrote the run's files; every process took part in the
  # checkpoints.
  assert sorted(os.listdir(two)) == [
    'accuracy.png',
    'client_accuracy_hist.png',
    'comparison.json',
    'ditto',
    'fedavg',
    'identity.json',
    'tensorboard',
  ]
  # Resumed by two processes: the same records as one process's uninterrupted
  # run.
  results = finish(
    launch([*args, '--rounds=3', f'--output_dir={two}', '--resume'])
  )
  assert [r[0] for r in results] == [0, 0], results[0][2][-3000:]
  run_single([*args, '--rounds=3', f'--output_dir={one}'])
  for alg in ('fedavg', 'ditto'):
    assert_same_records(metrics(two, alg), metrics(one, alg))
  # Resuming with another number of processes is refused with one line.
  r = subprocess.run(
    [
      sys.executable,
      SCRIPT,
      *args,
      '--rounds=4',
      f'--output_dir={two}',
      '--resume',
    ],
    capture_output=True,
    text=True,
    timeout=240,
  )
  errors = [l for l in r.stderr.splitlines() if l.startswith('error:')]
  assert (
    r.returncode == 2 and len(errors) == 1 and '--num_processes' in errors[0]
  ), r.stderr


@pytest.mark.slow
def test_processes_with_other_flags_stop_before_writing(tmp_path):
  out = str(tmp_path / 'run')
  results = finish(
    launch(
      [
        '--algorithm=fedavg',
        '--model=logreg',
        *SMALL,
        '--rounds=2',
        f'--output_dir={out}',
      ],
      per_process={1: ['--client_lr=0.1']},
    )
  )
  for code, _, err in results:
    errors = [l for l in err.splitlines() if l.startswith('error:')]
    assert code == 2 and len(errors) == 1 and '--client_lr' in errors[0], err[
      -2000:
    ]
  assert not os.path.exists(out)


def test_unreachable_coordinator_is_one_line():
  port = free_port()
  r = subprocess.run(
    [
      sys.executable,
      SCRIPT,
      '--algorithm=fedavg',
      '--model=logreg',
      *SMALL,
      f'--coordinator_address=localhost:{port}',
      '--num_processes=2',
      '--process_id=1',
      '--distributed_timeout=2',
    ],
    capture_output=True,
    text=True,
    timeout=120,
  )
  errors = [l for l in r.stderr.splitlines() if l.startswith('error:')]
  assert r.returncode == 2 and len(errors) == 1, r.stderr[-2000:]
  assert '--coordinator_address' in errors[0] and 'Traceback' not in r.stderr


@pytest.mark.parametrize(
  'args',
  [
    ['--num_processes=2'],
    [
      '--process_id=3',
      '--num_processes=2',
      '--coordinator_address=localhost:1',
    ],
    ['--coordinator_address=nohost', '--num_processes=2', '--process_id=0'],
  ],
)
def test_incomplete_launch_settings_are_refused(args):
  r = subprocess.run(
    [sys.executable, SCRIPT, '--algorithm=fedavg', *args],
    capture_output=True,
    text=True,
    timeout=120,
  )
  errors = [l for l in r.stderr.splitlines() if l.startswith('error:')]
  assert r.returncode == 2 and len(errors) == 1, r.stderr[-2000:]


@pytest.mark.slow
def test_two_processes_equal_one_for_user_centric(tmp_path):
  args = [
    '--algorithm=usercentric',
    '--model=logreg',
    *SMALL,
    '--rounds=3',
    '--usercentric_recompute_every=1',
    '--usercentric_sigma_batch_size=8',
  ]
  two, one = str(tmp_path / 'two'), str(tmp_path / 'one')
  results = finish(launch([*args, f'--output_dir={two}']))
  assert [r[0] for r in results] == [0, 0], results[0][2][-3000:]
  run_single([*args, f'--output_dir={one}'])
  a, b = metrics(two, 'usercentric'), metrics(one, 'usercentric')
  assert_same_records(
    [r for r in a if 'accuracy_mean' in r],
    [r for r in b if 'accuracy_mean' in r],
  )
  for x, y in zip(a, b):  # W's diagnostics, recomputed inside every round
    assert x.get('w_effective_neighbours_mean') == pytest.approx(
      y.get('w_effective_neighbours_mean'), rel=1e-5
    )


@pytest.mark.slow
def test_an_error_in_one_process_stops_the_others(tmp_path):
  results = finish(
    launch(
      [
        '--algorithm=fedavg',
        '--model=logreg',
        *SMALL,
        '--rounds=2',
        f'--output_dir={tmp_path}/run',
      ],
      per_process={1: [f'--init_weights={tmp_path}/missing.npz']},
    )
  )
  assert results[1][0] == 2 and 'missing.npz: no such file' in results[1][2]
  # the same line and status as the process that failed
  code, _, err = results[0]
  assert code == 2 and 'error: process 1: --init_weights' in err, err[-2000:]


@pytest.mark.slow
def test_a_killed_process_stops_the_others(tmp_path):
  procs = launch(
    [
      '--algorithm=fedavg',
      '--model=mlp',
      *SMALL,
      '--rounds=100000',
      '--eval_every=100',
      f'--output_dir={tmp_path}/run',
      '--distributed_timeout=10',
    ]
  )
  time.sleep(20)  # both training
  assert procs[0].poll() is None and procs[1].poll() is None
  procs[1].send_signal(signal.SIGKILL)
  start = time.monotonic()
  procs[0].communicate(timeout=120)  # stops (not a hang) ...
  assert time.monotonic() - start < 60  # ... within the heartbeat timeout
  assert procs[0].returncode != 0
