"""The entry of ``scripts/run_experiment.py``: parse the flags (and
flagfiles), read them once into a ``RunSettings`` (``experiment_flags.read``),
run the main job (``run/main_job.py``) and turn every fault into one line
and its exit status. Kept in the package so that scripts stay thin and
tests can drive it.
"""

import sys
import time
import traceback
from typing import Optional

from absl import app

from fedjax_personal.core.population import placement
from fedjax_personal.core.population.store import StoreDamaged
from fedjax_personal.errors import ConfigError, SettingError
from fedjax_personal.hparams import as_flag_error
from fedjax_personal.run import (
  distributed,
  experiment,
  experiment_flags,
  faults,
  run_progress,
  script_entry,
)
from fedjax_personal.run import main_job as job_lib
from fedjax_personal.run.experiment_flags import FLAGS, register  # noqa: F401  (the entry's API)
from fedjax_personal.run.settings import RunSettings

__all__ = ['main', 'main_job', 'parse_flags', 'read_flags', 'register', 'run']

#: The one error type of bad settings (the scripts exit with status 2).
UsageError = ConfigError


def read_flags() -> RunSettings:
  """The parsed flags as a ``RunSettings``: the one place the library reads
  them (then passed down to the job's steps).

  Returns:
    The settings of ``flags.FLAGS`` as parsed now.
  """
  return experiment_flags.read(FLAGS)


def main_job(
  settings: Optional[RunSettings] = None,
  progress: Optional[run_progress.RunProgress] = None,
):
  """The main job (``main_job.main_job``) of ``settings``, by default of the
  parsed flags; a setting that cannot apply is said by its flag, as the
  command says it.

  Args:
    settings: the run's settings (None: ``read_flags()``).
    progress: where the run's fault lines read its progress (None: a new
      ``run_progress.RunProgress``).

  Returns:
    {row label: final summary}, as ``main_job.main_job``.

  Raises:
    ConfigError naming the flag.
  """
  try:
    return job_lib.main_job(
      read_flags() if settings is None else settings, progress
    )
  except SettingError as e:
    raise as_flag_error(e) from e


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
    faults.fit_address_space_limit()
    settings = read_flags()
  except SettingError as e:  # a flag out of its range, or one that cannot apply
    _fail(as_flag_error(e), faults.EXIT_CONFIG)
  script_entry.quiet_logging_unless_asked()
  faults.install_signal_handlers()
  progress = run_progress.RunProgress()
  # every fault line below reads this run's progress
  with run_progress.tracking(progress):
    try:
      d = settings.distributed
      distributed.initialize(d.launch(), d.distributed_timeout)
      main_job(settings, progress)
      done = faults.finished_line()
      if done:  # a signal after the last round: nothing was cut short
        print(done, file=faults.error_stream(), flush=True)
    except faults.Fault as e:
      _fail(e, e.status)
    except (SettingError, FileNotFoundError) as e:
      if isinstance(e, SettingError):
        e = as_flag_error(e)
      p = progress
      # damaged mid-run: resume after
      if isinstance(e, StoreDamaged) and p.checkpoint_round:
        e = e.then(
          'run the same command with --resume '
          f'(the checkpoint of round {p.checkpoint_round} of {p.algorithm} is '
          f'kept in '
          f'{p.checkpoint_dir})'
        )
      _fail(e, faults.EXIT_CONFIG)
    except experiment.DivergenceError as e:
      _fail(e, faults.EXIT_DIVERGED)
    except KeyboardInterrupt:
      stop = faults.interrupted(during_round=True)
      _fail(stop, stop.status)
    except Exception as e:
      # memory, storage or a lost process: one line; else the traceback
      # An allocation, a library or a thread the process's limits refused (ulimit
      # -v, a cgroup), or a buffer XLA could not allocate.
      if faults.out_of_memory(e):
        left = placement.host_available_bytes()
        what = (
          f'out of memory (XLA: {str(e).splitlines()[0][:160]}'
          if 'RESOURCE_EXHAUSTED' in str(e)
          else f'out of host memory ({type(e).__name__}'
        )
        _fail(
          ConfigError(
            'num_clients',
            what
            + (
              f'; {left / placement.GB:.1f} GB left to this process'
              if left
              else ''
            )
            + '): give fewer clients or configurations, a smaller --cohort_size, or '
            '--client_state=disk (or raise ulimit -v); ' + progress.kept(),
          ),
          faults.EXIT_CONFIG,
          quiet=True,
        )
      if faults.storage_reason(e):
        name = (
          getattr(e, 'filename', None)
          or settings.output.output_dir
          or 'the output folder'
        )
        _fail(faults.storage_error(name, e), faults.EXIT_STORAGE)
      reason = faults.lost_process_reason(e) if distributed.active() else None
      if reason:
        # the lost one's heartbeat goes stale
        time.sleep(4 * distributed.POLL_SECONDS)
        silent = distributed.silent_processes()
        reason = f'{silent} stopped answering: {reason}' if silent else reason
        _fail(
          faults.lost_process(
            reason,
            settings.distributed.coordinator_address
            or '(from the environment)',
          ),
          faults.EXIT_LOST_PROCESS,
        )
      if distributed.report_failure(f'{type(e).__name__}: {e}'):
        traceback.print_exc()
        distributed.hard_exit(1)
      raise


def _fail(error, status: int, quiet: bool = False):
  """Prints the fault's one line and exits with ``status`` (``quiet``: at
  once, no interpreter shutdown: out of memory, exit handlers would fail
  again and print)."""
  # a runtime thread already reported this fault
  if not faults.claim_report(status):
    faults.exit_after_report()
  print(f'error: {error}', file=faults.error_stream(), flush=True)
  faults.printed_report()
  if status == faults.EXIT_LOST_PROCESS:
    # The others notice the lost process themselves (and the coordinator may
    # be the one gone): end now, before JAX's runtime aborts this process.
    faults.quiet_exit(status)
  if distributed.report_failure(str(error), status):
    # The others learn it from the coordinator; JAX's shutdown at exit would
    # wait for them at a barrier they never reach, and abort.
    distributed.hard_exit(status)
  if quiet or status in (faults.EXIT_STORAGE, 130, 143):
    # Background writers (Orbax's threads) may still be failing or running:
    # end now, with nothing more printed.
    faults.quiet_exit(status)
  sys.exit(status)


def run():
  """Entry point of ``scripts/run_experiment.py``.

  Returns:
    None.
  """
  app.run(main, flags_parser=parse_flags)


def parse_flags(argv):
  """The command's flags, those of algorithms and data sets registered since
  the import or by the user's modules of ``--import`` included
  (``experiment_flags.define_flags``), parsed with one-line errors
  (``script_entry.parse_flags``).

  Args:
    argv: the command line.

  Returns:
    What absl leaves of it.
  """
  script_entry.import_plugins(argv)
  experiment_flags.define_flags()
  return script_entry.parse_flags(argv)
