"""Orbax checkpoints of a run: the full algorithm state (server state, every
client's state), the round number and the metrics so far.

Randomness needs no saving: round t's key is ``fold_in(train_key, t)`` with
``train_key`` derived from the seed (``experiment.run``), so a run resumed
from the checkpoint of round t continues exactly as the uninterrupted run.
Typed PRNG keys inside a state are stored as their key data. Saves are
synchronous and atomic (Orbax writes to a temporary directory and renames).
"""

import os
import shutil
import sys
from typing import List, Optional

import jax
import orbax.checkpoint as ocp

from fedjax_personal.core import hosted_state
from fedjax_personal.core.hosted_state import HostedState
from fedjax_personal.run import faults, run_identity
from fedjax_personal.errors import ConfigError
from fedjax_personal.run.experiment import Callback


def _is_key(x) -> bool:
  return hasattr(x, 'dtype') and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_saveable(state):
  """The state as saved: PRNG keys as their data; client rows kept on the
  host (``HostedState``) joined into the whole state, so that both layouts
  save and restore the same checkpoint. A list of states (configurations
  run one after another, ``sweep.LoopRuns``) is saved state by state."""
  if isinstance(state, list):
    return [to_saveable(s) for s in state]
  if isinstance(state, HostedState):
    state = state.whole()
  return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, state)


def from_saveable(saved, template):
  if isinstance(template, list):
    return [from_saveable(s, t) for s, t in zip(saved, template)]
  if isinstance(template, HostedState):
    return hosted_state.hosted(from_saveable(saved, template.whole()), template.client_rows)
  return jax.tree.map(lambda s, t: jax.random.wrap_key_data(s, impl=jax.random.key_impl(t))
                      if _is_key(t) else s, saved, template)


def _abstract(template):
  """What a restore reads: shapes and dtypes, with hosted client rows read
  into host memory, not the device."""
  if isinstance(template, list):
    return [_abstract(t) for t in template]
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, to_saveable(template))
  if isinstance(template, HostedState):
    abstract = hosted_state.rows_on_cpu(abstract, template.client_rows)
  return abstract


def manager(directory: str, max_to_keep: int = 2) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
      os.path.abspath(directory),
      options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                           enable_async_checkpointing=False))


def save(mngr: ocp.CheckpointManager, round_num: int, state, histories: List[List[dict]],
         identity: Optional[dict] = None):
  """Saves the state, every configuration's records so far (strict JSON:
  non-finite values as null) and the run's identity (checked on restore).

  Raises:
    faults.StorageError: the disk is full, read-only or over quota. The
    partial checkpoint is removed (the last complete one stays), and what
    Orbax's writer threads print is muted (``faults.captured_stderr``).
  """
  clean = run_identity.as_json(histories)
  items = dict(state=ocp.args.StandardSave(to_saveable(state)), history=ocp.args.JsonSave(clean))
  if identity is not None:
    items['identity'] = ocp.args.JsonSave(run_identity.as_json(identity))
  with faults.captured_stderr():
    try:
      mngr.save(round_num, args=ocp.args.Composite(**items))
      mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001 -- Orbax wraps OS errors in several types
      _discard_partial(mngr.directory)  # the last complete checkpoint stays the latest
      if faults.storage_reason(e) is None:
        raise
      raise faults.storage_error(f'the checkpoint of round {round_num} to {mngr.directory}',
                                 e) from None
  faults.PROGRESS.checkpoint_round = round_num


def _discard_partial(directory) -> None:
  """Removes Orbax's temporary folders of an unfinished save."""
  directory = str(directory)
  if os.path.isdir(directory):
    for name in os.listdir(directory):
      if 'orbax-checkpoint-tmp' in name:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def restore_latest(directory: str, template_state, identity: Optional[dict] = None):
  """(state, round, histories) of the latest checkpoint (one history per
  configuration), or None when there is none.

  Args:
    template_state: a state of the same structure (e.g. ``runner.init(key)``).
    identity: when given, the run identity the checkpoint must have been
      saved with.

  Raises:
    ConfigError('resume', ...) naming the differences when the checkpoint
    belongs to another configuration.
  """
  if not os.path.isdir(directory):
    return None
  mngr = manager(directory)
  abstract = _abstract(template_state)
  for step in sorted(mngr.all_steps(), reverse=True):
    if identity is not None:
      try:
        saved = mngr.restore(step, args=ocp.args.Composite(identity=ocp.args.JsonRestore()))
        saved = saved['identity']
      except Exception as e:  # noqa: BLE001 -- a corrupted step: try the previous one
        print(f'warning: checkpoint {step} in {directory} is unreadable '
              f'({type(e).__name__}); trying the previous one', file=sys.stderr)
        continue
      want = run_identity.as_json(identity)
      if saved != want:
        diff = run_identity.differences(saved or {}, want)
        raise ConfigError('resume', f'checkpoint {step} in {directory} was saved by another '
                          f'configuration ({"; ".join(diff[:4])})')
    try:
      out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                       history=ocp.args.JsonRestore()))
    except Exception as e:  # a corrupted step: fall back to the newest intact one
      print(f'warning: checkpoint {step} in {directory} is unreadable '
            f'({type(e).__name__}); trying the previous one', file=sys.stderr)
      continue
    return from_saveable(out['state'], template_state), int(step), [list(h) for h in out['history']]
  return None


class Checkpointer(Callback):
  """Saves every ``every`` rounds and at the end of the run (of a single
  run or a whole sweep: the stacked state and every configuration's records)."""

  def __init__(self, directory: str, every: int,
               histories: Optional[List[List[dict]]] = None, max_to_keep: int = 2,
               identity: Optional[dict] = None):
    self.mngr = manager(directory, max_to_keep)
    self.identity = identity
    self.every = every
    self.histories = [list(h) for h in histories] if histories else None

  def on_round_end(self, round_num, records, state):
    if self.histories is None:
      self.histories = [[] for _ in records]
    for h, r in zip(self.histories, records):
      h.append(r)
    if self.every and round_num % self.every == 0:
      save(self.mngr, round_num, state, self.histories, self.identity)

  def on_end(self, histories, state):
    last = histories[0][-1]['round'] if histories and histories[0] else 0
    if last and self.mngr.latest_step() != last:
      save(self.mngr, last, state, histories, self.identity)

  def on_stop(self, round_num, state):
    if self.every and self.mngr.latest_step() != round_num:
      save(self.mngr, round_num, state, self.histories, self.identity)
