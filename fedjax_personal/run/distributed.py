"""One experiment over several processes: JAX's multi-controller runtime.

Every process runs the same command (its ``--process_id`` aside): it builds
the same data and state from the same seed, the client axis is sharded over
the global mesh of all processes' devices (``executors.ShardedExecutor``), and
each process computes its own clients' share of every compiled round. What the
round returns to the host (metrics, evaluation statistics) is replicated, so
every process reads the same numbers; process 0 alone writes metrics, tables,
plots and identity files, and every process takes part in Orbax's
checkpointing of the sharded state.

Launch (``initialize``): ``--coordinator_address=host:port``,
``--num_processes`` and ``--process_id`` (or the environment variables
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``; on a
SLURM or Open MPI allocation JAX finds all three itself). On CPU the
processes' collectives run over Gloo, so several processes on one machine
(``JAX_NUM_CPU_DEVICES`` devices each) exercise the same code as several
hosts.

Failures (``faults``): a process that stops posts its one-line message and
exit status to the coordinator's key-value store; a watchdog thread in every
other process reads it and ends that process with the same line and status
instead of waiting in a collective. Every process also posts a heartbeat
each ``POLL_SECONDS``: a process whose heartbeat stops for
``--distributed_timeout`` seconds (killed, its machine gone), or a
coordinator that stops answering, ends the others with one line naming it
(exit 69), before JAX's own heartbeat would abort them. A process that never
joins is reported the same way by a timer around ``jax.distributed.initialize``
(whose own time-out aborts the process with a C++ stack trace).
"""

import atexit
import dataclasses
import hashlib
import json
import os
import socket
import sys
import threading
import time
from typing import Any, Dict, Optional

import jax
import numpy as np
from jax._src import (
  distributed as jax_distributed,  # its client: no public accessor
)
from jax.experimental import multihost_utils

from fedjax_personal.errors import ConfigError
from fedjax_personal.hparams import Declared, hparam
from fedjax_personal.run import faults

__all__ = [
  'active',
  'barrier',
  'check_same_run',
  'describe',
  'DistributedSettings',
  'hard_exit',
  'initialize',
  'is_primary',
  'POLL_SECONDS',
  'report_failure',
  'silent_processes',
]


ERROR_KEY = 'fedjax_personal/error'
ENV = {
  'coordinator_address': 'JAX_COORDINATOR_ADDRESS',
  'num_processes': 'JAX_NUM_PROCESSES',
  'process_id': 'JAX_PROCESS_ID',
}
CLUSTER_ENV = ('SLURM_JOB_ID', 'OMPI_COMM_WORLD_SIZE')

_STATE: Dict[str, Any] = {'initialized': False}


@dataclasses.dataclass(frozen=True)
class DistributedSettings(Declared):
  """The processes of one run.

  Declared once (``hparam``; the command's flags are generated from these
  fields). Not given: the environment's, else one process (``settings``)."""

  coordinator_address: Optional[str] = hparam(
    None,
    'Several processes (one per host, or several on one machine): host:port of '
    'process '
    '0 (default: $JAX_COORDINATOR_ADDRESS; on a SLURM / Open MPI allocation '
    'JAX finds the '
    'launch settings itself).',
  )
  num_processes: Optional[int] = hparam(
    None, 'Processes of the run (default: $JAX_NUM_PROCESSES).', minimum=1
  )
  process_id: Optional[int] = hparam(
    None,
    'This process, 0 .. num_processes - 1 (default: $JAX_PROCESS_ID).',
    minimum=0,
  )
  distributed_timeout: int = hparam(
    60,
    'Seconds to wait for the other processes to join, and '
    'for a silent one before the others stop.',
    minimum=1,
  )

  def check(self) -> None:
    """The process below the count; the coordinator as host:port."""
    n, i = self.num_processes, self.process_id
    if n is not None and i is not None and i >= n:
      raise ConfigError('process_id', f'must be in [0, {n}), got {i}')
    address = self.coordinator_address
    if address is not None and ':' not in address:
      raise ConfigError(
        'coordinator_address', f'expected host:port, got {address!r}'
      )

  def with_environment(self) -> 'DistributedSettings':
    """These settings, what they leave unset taken from the environment
    (``ENV``), checked again.

    Returns:
      The settings.
    """
    env: Dict[str, Any] = {}
    for k, var in ENV.items():
      if getattr(self, k) is None and os.environ.get(var):
        env[k] = (
          os.environ[var] if k == 'coordinator_address' else _int_env(var)
        )
    return dataclasses.replace(self, **env)

  def launch(self) -> Optional[dict]:
    """The launch settings (``jax.distributed.initialize``'s), from these
    settings, else the environment; ``{}`` where JAX finds a cluster's own;
    None for a single process.

    Returns:
      The launch settings, or None.

    Raises:
      ConfigError: the three settings not given together.
    """
    s = self.with_environment()
    given: Dict[str, Any] = {k: getattr(s, k) for k in ENV}
    if all(v is None for v in given.values()):
      if any(os.environ.get(v) for v in CLUSTER_ENV):
        return {}  # JAX detects the cluster's own settings
      return None
    if s.num_processes == 1 and s.process_id in (None, 0):
      return None
    for k, v in given.items():
      if v is None:
        raise ConfigError(
          k,
          'give --coordinator_address, --num_processes and --process_id '
          f'together (or {", ".join(ENV.values())})',
        )
    return given


def _int_env(var):
  try:
    return int(os.environ[var])
  except ValueError:
    raise ConfigError(
      var.lower().replace('jax_', ''),
      f'${var} is not an integer: {os.environ[var]!r}',
    ) from None


def initialize(launch: Optional[dict], timeout: int = 60) -> None:
  """Joins the processes (``jax.distributed.initialize``) before anything
  touches a device; nothing for a single process.

  Args:
    launch: the launch settings (``settings``), or None.
    timeout: seconds to wait for the others.

  Returns:
    None.

  Raises:
    ConfigError: the coordinator cannot be reached within ``timeout`` s.
  """
  if launch is None or _STATE['initialized']:
    return
  if launch.get('coordinator_address'):
    _preflight(launch['coordinator_address'], launch['process_id'], timeout)
  # The CPU backend's collectives between processes (no effect on GPU/TPU ones).
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  _STATE['address'] = launch.get('coordinator_address') or '(detected)'
  _STATE['timeout'] = timeout
  n, pid = launch.get('num_processes', '?'), launch.get('process_id', '?')
  # JAX aborts the process (C++ check failure) when its initialization times
  # out: this timer says which process waited for what, first.
  timer = threading.Timer(
    timeout, _never_joined, (pid, n, _STATE['address'], timeout)
  )
  timer.daemon = True
  timer.start()
  try:
    jax.distributed.initialize(
      **launch,
      initialization_timeout=timeout + JAX_GRACE_SECONDS,
      heartbeat_timeout_seconds=2 * timeout + JAX_GRACE_SECONDS,
    )
  except Exception as e:
    # JAX raises several types for an unreachable coordinator
    first = (
      str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    )
    raise ConfigError(
      'coordinator_address',
      f'could not join the coordinator at '
      f'{launch.get("coordinator_address", "(detected)")} within {timeout} s '
      f'as process {launch.get("process_id", "?")} of '
      f'{launch.get("num_processes", "?")}: {first[:200]}',
    ) from None
  finally:
    timer.cancel()
  _STATE['initialized'] = True
  faults.share_stop_requests(lambda code: allgather_ints([code]))
  _start_watchdog()


#: Seconds JAX's own time-outs wait beyond ours (ours report first, in one
#: line).
JAX_GRACE_SECONDS = 15


def _never_joined(pid, n, address, timeout) -> None:
  if pid == 0:
    what = (
      f'the other processes of {n} did not all join the coordinator at '
      f'{address} within '
      f'{timeout} s; start each with the same command and its --process_id '
      f'(1..{n - 1 if isinstance(n, int) else "?"})'
    )
  else:
    what = (
      f'the run did not start within {timeout} s: not every process of {n} '
      f'joined the '
      f'coordinator at {address}; start the missing ones with the same command'
    )
  print(
    f'error: process {pid}: {what} (or raise --distributed_timeout)',
    file=sys.stderr,
    flush=True,
  )
  faults.quiet_exit(faults.EXIT_LOST_PROCESS)


def _preflight(address: str, process_id: int, timeout: int) -> None:
  """What JAX would only report by aborting the process: process 0 must be
  able to listen on the coordinator's port, the others must reach it within
  ``timeout`` seconds."""
  host, _, port_text = address.rpartition(':')
  try:
    port = int(port_text)
  except ValueError:
    raise ConfigError(
      'coordinator_address', f'expected host:port, got {address!r}'
    ) from None
  if process_id == 0:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      try:
        s.bind(('', port))
      except OSError as e:
        raise ConfigError(
          'coordinator_address',
          f'process 0 cannot listen on port {port}: {e.strerror or e}',
        ) from None
    return
  deadline = time.monotonic() + timeout
  while True:
    try:
      with socket.create_connection((host or 'localhost', port), timeout=1):
        return
    except OSError:
      if time.monotonic() > deadline:
        raise ConfigError(
          'coordinator_address',
          f'process {process_id}: nothing answers at '
          f'{address} within {timeout} s: start process 0 there, or fix the '
          'address',
        ) from None
      time.sleep(0.25)


def active() -> bool:
  """Whether this run spans several processes.

  Returns:
    True with several processes.
  """
  return jax.process_count() > 1


def is_primary() -> bool:
  """Whether this process writes the run's files (process 0).

  Returns:
    True on process 0.
  """
  return jax.process_index() == 0


def _client():
  return jax_distributed.global_state.client


_STOP = threading.Event()


def _start_watchdog():
  """Every ``POLL_SECONDS``: posts this process's heartbeat, reads another
  process's error (and stops with its line and status), and stops with one
  line when another process's heartbeat or the coordinator has been silent
  for the run's timeout. Stopped, and joined, before JAX shuts the runtime
  down at exit, so that no call into the runtime is in flight then."""
  me, n = jax.process_index(), jax.process_count()
  timeout = _STATE.get('timeout', 60)

  def watch():
    client = _client()
    beats, last_seen, reached = (
      0,
      _STATE.setdefault('last_seen', {}),
      time.monotonic(),
    )
    who = _STATE.setdefault('who', {})
    try:
      client.key_value_set(
        f'{WHO_KEY}/{me}',
        f'pid {os.getpid()} on {socket.gethostname()}',
        allow_overwrite=True,
      )
    except Exception:  # the coordinator does not answer: found below
      pass
    while not _STOP.wait(POLL_SECONDS):
      now = time.monotonic()
      beats += 1
      try:
        client.key_value_set(
          f'{ALIVE_KEY}/{me}', str(beats), allow_overwrite=True
        )
        reached = now
      except Exception:  # the coordinator does not answer
        if now - reached > timeout and not _STOP.is_set():
          _lost(
            f'the coordinator (process 0 at {_STATE.get("address")}) stopped '
            f'answering '
            f'{timeout} s ago'
          )
        continue
      try:
        msg = client.key_value_try_get(ERROR_KEY)
      except Exception:  # not set yet (NOT_FOUND), or the service is going away
        msg = None
      # this process is already stopping with its own message
      if _STOP.is_set():
        return
      if msg is not None:
        status, _, text = msg.partition(' ')
        status = int(status) if status.isdigit() else 3
        if not faults.claim_report(status):
          faults.exit_after_report()
        print(f'error: {text}', file=faults.error_stream(), flush=True)
        faults.printed_report()
        hard_exit(status)
      for pid in range(n):
        if pid == me:
          continue
        try:
          beat = client.key_value_try_get(f'{ALIVE_KEY}/{pid}')
        except Exception:  # not started beating yet
          beat = None
        if beat is not None and last_seen.get(pid, (None,))[0] != beat:
          last_seen[pid] = (beat, now)
          if pid not in who:
            try:
              who[pid] = client.key_value_try_get(f'{WHO_KEY}/{pid}')
            except Exception:  # not posted yet
              pass
        elif pid in last_seen and now - last_seen[pid][1] > timeout:
          _lost(
            f'{describe(pid)} has been silent for {timeout} s (killed, or its '
            f'machine gone)'
          )

  thread = threading.Thread(
    target=watch, name='fedjax_personal-watchdog', daemon=True
  )
  thread.start()

  def stop():
    _STOP.set()
    thread.join()

  # atexit runs handlers last-registered first: this one before JAX's shutdown.
  atexit.register(stop)


POLL_SECONDS = 0.5
ALIVE_KEY = 'fedjax_personal/alive'
WHO_KEY = 'fedjax_personal/who'


def describe(index: int) -> str:
  """'process i (pid P on host H)' as process i posted it at its start.

  Args:
    index: a process index.

  Returns:
    The description.
  """
  who = _STATE.get('who', {}).get(index)
  return f'process {index}' + (f' ({who})' if who else '')


def silent_processes() -> str:
  """The other processes whose heartbeat stopped first (the likely lost
  ones), described, for a collective that failed because one is gone; ''
  when none is known.

  Returns:
    Their descriptions, joined.
  """
  seen = _STATE.get('last_seen', {})
  if not seen:
    return ''
  now = time.monotonic()
  stale = sorted(
    (t, i) for i, (_, t) in seen.items() if now - t > 3 * POLL_SECONDS
  )
  return ', '.join(describe(i) for _, i in stale[:2])


def _lost(what: str) -> None:
  if not faults.claim_report(faults.EXIT_LOST_PROCESS):
    faults.exit_after_report()
  line = faults.lost_process(what, _STATE.get('address')).args[0]
  print(
    f'error: process {jax.process_index()}: {line}',
    file=faults.error_stream(),
    flush=True,
  )
  faults.printed_report()
  faults.quiet_exit(faults.EXIT_LOST_PROCESS)


#: How long process 0, which hosts the coordinator, outlives the others when
#: the run stops with an error: its exit takes the coordinator down, and JAX
#: aborts a process whose coordinator disappears before it could exit itself.
COORDINATOR_GRACE_SECONDS = 2.0


def hard_exit(status: int) -> None:
  """Ends this process at once with ``status`` (no JAX shutdown barrier the
  others would never reach); process 0 last.

  Args:
    status: the exit status.

  Returns:
    Never returns.
  """
  _STOP.set()  # one message per process: its own
  sys.stdout.flush()
  sys.stderr.flush()
  if _STATE['initialized'] and jax.process_index() == 0:
    time.sleep(COORDINATOR_GRACE_SECONDS)
  os._exit(status)


def report_failure(message: str, status: int = 3) -> bool:
  """Tells the other processes this one stops with ``message`` (they stop
  with the same line and ``status``); False on one process.

  Args:
    message: the fault's line.
    status: its exit status.

  Returns:
    True when others were told.
  """
  if not _STATE['initialized']:
    return False
  try:
    _client().key_value_set(
      ERROR_KEY, f'{status} process {jax.process_index()}: {message}'
    )
  except Exception:  # the coordinator is gone: the others stop by its heartbeat
    pass
  return True


def allgather_ints(values) -> list:
  """Every process's int values, concatenated (a small collective)."""
  return (
    np.asarray(multihost_utils.process_allgather(np.asarray(values, np.int32)))
    .reshape(-1)
    .tolist()
  )


def _allgather_bytes(data: bytes):
  """Every process's ``data`` (a list indexed by process)."""
  n = np.asarray([len(data)], np.int64)
  lengths = np.asarray(multihost_utils.process_allgather(n)).reshape(-1)
  buf = np.zeros(int(lengths.max()), np.uint8)
  buf[: len(data)] = np.frombuffer(data, np.uint8)
  got = np.asarray(multihost_utils.process_allgather(buf)).reshape(
    len(lengths), -1
  )
  return [bytes(got[i, : lengths[i]]) for i in range(len(lengths))]


def check_same_run(identity: dict, differences) -> None:
  """Every process must run the same configuration: compares each process's
  run identity with process 0's.

  Args:
    identity: this process's configuration.
    differences: ``(old, new) -> [lines]``.

  Returns:
    None.

  Raises:
    ConfigError naming the first differing setting, in every process.
  """
  if not active():
    return
  mine = json.dumps(identity, sort_keys=True, default=str).encode()
  all_ids = _allgather_bytes(hashlib.sha256(mine).digest())
  if len(set(all_ids)) == 1:
    return
  texts = _allgather_bytes(mine)
  ref = json.loads(texts[0])
  for pid, t in enumerate(texts):
    diff = differences(ref, json.loads(t))
    if diff:
      raise ConfigError(
        diff[0].split(':')[0].split('.')[-1],
        f'process {pid} runs another configuration than process 0: '
        + '; '.join(diff[:3]),
      )


def barrier(name: str) -> None:
  """Waits until every process reaches ``name`` (one process: returns).

  Args:
    name: the barrier's name.

  Returns:
    None.
  """
  if active():
    multihost_utils.sync_global_devices(name)
