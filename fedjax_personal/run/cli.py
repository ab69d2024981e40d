"""The entry of ``scripts/run_experiment.py``: parse the flags (and
flagfiles), run the main job (``run/main_job.py``) and turn every fault into one
line and its exit status. Kept in the package so that scripts stay thin and
tests can drive it; the settings and the job steps are importable from here
too.
"""

import sys
import time

from fedjax_personal.errors import ConfigError
from fedjax_personal.run import distributed, experiment, faults, script_entry
from fedjax_personal.run import main_job as job_lib
from fedjax_personal.run.main_job import *  # noqa: F401,F403  (the main job's steps)
from fedjax_personal.run.settings import *  # noqa: F401,F403  (flags, settings)
from fedjax_personal.run.settings import FLAGS, Settings, read, register  # noqa: F401


__all__ = ['main', 'main_job', 'read_flags', 'run']


def read_flags() -> Settings:
  """The parsed flags as ``Settings``: the one place the library reads them
  (then passed down to the job's steps).

  Returns:
    The settings of ``flags.FLAGS`` as parsed now.
  """
  return read(FLAGS)


def main_job(opts: Settings = None):
  """The main job (``job.main_job``) of ``opts``, by default of the parsed
  flags.

  Args:
    opts: the settings (None: ``read_flags()``).

  Returns:
    {row label: final summary}, as ``job.main_job``.
  """
  return job_lib.main_job(read_flags() if opts is None else opts)



def main(argv):
  """absl's entry: the main job from the parsed flags, every fault one line
  and its exit status.

  Args:
    argv: what absl left of the command line.

  Returns:
    None (exits with the fault's status).
  """
  if len(argv) > 1:
    print(f'error: unexpected arguments {argv[1:]}', file=sys.stderr)
    sys.exit(2)
  try:
    opts = read_flags()
  except ConfigError as e:  # a flag out of its declared range
    _fail(e, faults.EXIT_CONFIG)
  if not opts['verbosity'].present:
    from absl import logging
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
  faults.install_signal_handlers()
  try:
    distributed.initialize(distributed.settings(opts.coordinator_address, opts.num_processes,
                                                opts.process_id),
                           opts.distributed_timeout)
    main_job(opts)
    done = faults.finished_line()
    if done:  # a signal after the last round: nothing was cut short
      print(done, file=faults.error_stream(), flush=True)
  except faults.Fault as e:
    _fail(e, e.status)
  except (ConfigError, FileNotFoundError) as e:
    _fail(e, faults.EXIT_CONFIG)
  except experiment.DivergenceError as e:
    _fail(e, faults.EXIT_DIVERGED)
  except MemoryError as e:  # an allocation the process's limits refused (ulimit -v, a cgroup)
    from fedjax_personal.core.population import layout as layout_lib
    left = layout_lib.host_available_bytes()
    _fail(ConfigError('num_clients', f'out of host memory ({type(e).__name__}'
                      + (f'; {left / layout_lib.GB:.1f} GB left to this process' if left else '')
                      + '): give fewer clients or configurations, a smaller --cohort_size, or '
                      '--client_state=disk; ' + faults.kept()), faults.EXIT_CONFIG)
  except KeyboardInterrupt:
    stop = faults.interrupted(during_round=True)
    _fail(stop, stop.status)
  except Exception as e:  # a storage or lost-process fault: one line; else the traceback
    if faults.storage_reason(e):
      name = getattr(e, 'filename', None) or job_output_dir(opts)
      _fail(faults.storage_error(name, e), faults.EXIT_STORAGE)
    reason = faults.lost_process_reason(e) if distributed.active() else None
    if reason:
      time.sleep(4 * distributed.POLL_SECONDS)  # the lost one's heartbeat goes stale
      silent = distributed.silent_processes()
      reason = f'{silent} stopped answering: {reason}' if silent else reason
      _fail(faults.lost_process(reason, opts.coordinator_address or '(from the environment)'),
            faults.EXIT_LOST_PROCESS)
    if distributed.report_failure(f'{type(e).__name__}: {e}'):
      import traceback
      traceback.print_exc()
      distributed.hard_exit(1)
    raise


def _fail(error, status: int):
  if not faults.claim_report(status):  # a runtime thread already reported this fault
    faults.quiet_exit(faults.reported_status())
  print(f'error: {error}', file=faults.error_stream(), flush=True)
  if status == faults.EXIT_LOST_PROCESS:
    # The others notice the lost process themselves (and the coordinator may
    # be the one gone): end now, before JAX's runtime aborts this process.
    faults.quiet_exit(status)
  if distributed.report_failure(str(error), status):
    # The others learn it from the coordinator; JAX's shutdown at exit would
    # wait for them at a barrier they never reach, and abort.
    distributed.hard_exit(status)
  if status in (faults.EXIT_STORAGE, 130, 143):
    # Background writers (Orbax's threads) may still be failing or running:
    # end now, with nothing more printed.
    faults.quiet_exit(status)
  sys.exit(status)


def job_output_dir(opts: Settings) -> str:
  """The run's output folder as a message names it."""
  return opts.output_dir or 'the output folder'


def run():
  """Entry point of ``scripts/run_experiment.py``.

  Returns:
    None.
  """
  from absl import app
  app.run(main, flags_parser=script_entry.parse_flags)
