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
from typing import TYPE_CHECKING, List, Optional

import jax
import numpy as np

from fedjax_personal.core.population import rows_in_memory
from fedjax_personal.core.population.rows_in_memory import HostedState
from fedjax_personal.errors import ConfigError
from fedjax_personal.run import (
  faults,
  row_checkpoints,
  run_identity,
  run_progress,
)
from fedjax_personal.run.experiment import Callback

if TYPE_CHECKING:
  import orbax.checkpoint as ocp


__all__ = [
  'Checkpointer',
  'manager',
  'restore_latest',
  'rows_manifest_of',
  'save',
]


def _ocp():
  """``orbax.checkpoint``, imported when a run first checkpoints or
  resumes: importing it defines absl flags of its own
    (``--experimental_orbax_*``),
  which a command that never checkpoints must not offer."""
  import orbax.checkpoint as ocp

  return ocp


def _is_key(x) -> bool:
  return hasattr(x, 'dtype') and jax.dtypes.issubdtype(
    x.dtype, jax.dtypes.prng_key
  )


def to_saveable(state):
  """The state as saved: PRNG keys as their data; client rows kept on the
  host (``HostedState``) joined into the whole state, so that both layouts
  save and restore the same checkpoint; client rows in files left out (they
  are saved apart, ``row_checkpoints``: the state's other leaves are saved,
  by place). A list of states (configurations run one after another,
  ``sweep.LoopRuns``) is saved state by state."""
  if isinstance(state, list):
    return [to_saveable(s) for s in state]
  if row_checkpoints.has_files(state):
    return _leaves_but_rows(state.inner)
  if isinstance(state, HostedState):
    state = state.whole()
  return _keys_as_data(state)


def _leaves_but_rows(inner):
  """A ``HostedState``'s inner state as saved with its rows in files: its
  leaves by place, but the empty client rows (which Orbax cannot save)."""
  leaves = jax.tree.leaves(_keys_as_data(inner))
  saved = {str(i): a for i, a in enumerate(leaves) if a.size}
  # A state of nothing but client rows (Local's) saves one marker: Orbax
  # refuses an empty item.
  return saved or {_ONLY_ROWS: np.zeros((), np.int8)}


#: The marker saved for a state whose client rows in files are all of it.
_ONLY_ROWS = 'only_client_rows'


def _keys_as_data(state):
  return jax.tree.map(
    lambda x: jax.random.key_data(x) if _is_key(x) else x, state
  )


def _keys_from_data(saved, template):
  return jax.tree.map(
    lambda s, t: (
      jax.random.wrap_key_data(s, impl=jax.random.key_impl(t))
      if _is_key(t)
      else s
    ),
    saved,
    template,
  )


def from_saveable(saved, template):
  """``template``'s structure and types again from what a checkpoint saved
  (``to_saveable``'s inverse)."""
  if isinstance(template, list):
    return [from_saveable(s, t) for s, t in zip(saved, template)]
  if isinstance(template, HostedState):
    return rows_in_memory.hosted(
      from_saveable(saved, template.whole()), template.client_rows
    )
  return _keys_from_data(saved, template)


def _abstract(template):
  """What a restore reads: shapes and dtypes, with hosted client rows read
  into host memory, not the device."""
  if isinstance(template, list):
    return [_abstract(t) for t in template]
  # the whole state (a checkpoint of rows in memory)
  if row_checkpoints.has_files(template):
    abstract = template.client_rows.put(
      jax.tree.map(
        _ocp().utils.to_shape_dtype_struct, _keys_as_data(template.inner)
      ),
      jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), template.rows
      ),
    )
  else:
    abstract = jax.tree.map(
      _ocp().utils.to_shape_dtype_struct, to_saveable(template)
    )
  if isinstance(template, HostedState):
    abstract = rows_in_memory.rows_on_cpu(abstract, template.client_rows)
  return abstract


def _abstract_without_rows(template):
  """What a restore of a checkpoint of rows in files reads: every state's
  leaves but its client rows."""
  if isinstance(template, list):
    return [_abstract_without_rows(t) for t in template]
  return jax.tree.map(
    _ocp().utils.to_shape_dtype_struct, _leaves_but_rows(template.inner)
  )


def _with_saved_inner(saved, template):
  """``template`` (its rows made from ``init``) with the rest of its state
  read from a checkpoint of rows in files."""
  if isinstance(template, list):
    return [_with_saved_inner(s, t) for s, t in zip(saved, template)]
  leaves, treedef = jax.tree.flatten(_keys_as_data(template.inner))
  leaves = [
    saved[str(i)] if str(i) in saved else a for i, a in enumerate(leaves)
  ]
  inner = _keys_from_data(jax.tree.unflatten(treedef, leaves), template.inner)
  return template.replace(inner=jax.device_put(inner, jax.devices()[0]))


def manager(directory: str, max_to_keep: int = 2) -> 'ocp.CheckpointManager':
  """An Orbax ``CheckpointManager`` in ``directory`` keeping the latest
  ``max_to_keep`` steps.

  Args:
    directory: the checkpoints' folder.
    max_to_keep: checkpoints kept.

  Returns:
    The manager.
  """
  return _ocp().CheckpointManager(
    os.path.abspath(directory),
    options=_ocp().CheckpointManagerOptions(
      max_to_keep=max_to_keep, enable_async_checkpointing=False
    ),
  )


def save(
  mngr: 'ocp.CheckpointManager',
  round_num: int,
  state,
  histories: List[List[dict]],
  identity: Optional[dict] = None,
  rows_manifest: Optional[dict] = None,
) -> Optional[dict]:
  """Saves the state, every configuration's records so far (strict JSON:
  non-finite values as null) and the run's identity (checked on restore).

  Client rows in files are saved apart (``row_checkpoints``): the rows
  changed since the checkpoint ``rows_manifest`` describes (None: since the
  start), published with this step; returns this step's manifest (None for a
  state saved whole).

  Args:
    mngr: an Orbax ``CheckpointManager``.
    round_num: the round.
    state: the state.
    histories: every configuration's records.
    identity: the run identity.
    rows_manifest: the rows-in-files manifest (None: rows saved whole).

  Returns:
    None.

  Raises:
    faults.StorageError: the disk is full, read-only or over quota. The
    partial checkpoint is removed (the last complete one stays), and what
    Orbax's writer threads print is muted (``faults.captured_stderr``).
  """
  clean = run_identity.as_json(histories)
  directory = str(mngr.directory)
  manifest = None
  with faults.captured_stderr():
    try:
      if row_checkpoints.has_files(state):
        manifest = row_checkpoints.write_delta(
          directory,
          round_num,
          state,
          (rows_manifest or {}).get('chain', []),
          _digest(identity),
        )
      ocp = _ocp()
      items = dict(
        state=ocp.args.StandardSave(to_saveable(state)),
        history=ocp.args.JsonSave(clean),
      )
      if identity is not None:
        items['identity'] = ocp.args.JsonSave(run_identity.as_json(identity))
      if manifest is not None:
        items[row_checkpoints.FOLDER] = ocp.args.JsonSave(manifest)
      mngr.save(round_num, args=ocp.args.Composite(**items))
      mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001 -- Orbax wraps OS errors in several types
      # the last complete checkpoint stays the latest
      _discard_partial(directory)
      row_checkpoints.discard(directory, manifest)
      if faults.storage_reason(e) is None:
        raise
      raise faults.storage_error(
        f'the checkpoint of round {round_num} to {directory}', e
      ) from None
  if manifest is not None or os.path.isdir(
    os.path.join(directory, row_checkpoints.FOLDER)
  ):
    row_checkpoints.committed(state)
    kept = {step: rows_manifest_of(mngr, step) for step in mngr.all_steps()}
    # (a state saved whole after rows in files: their folder goes with the last
    # step)
    try:
      row_checkpoints.fold(directory, kept, state)
    except OSError as e:
      # the step is published; its delta stays until a fold succeeds
      if faults.storage_reason(e) is None:
        raise
      raise faults.storage_error(
        f'the checkpoint of round {round_num} to {directory}', e
      ) from None
  return manifest


def _digest(identity: Optional[dict]) -> str:
  return (
    run_identity.short_hash(run_identity.as_json(identity)) if identity else ''
  )


def rows_manifest_of(
  mngr: 'ocp.CheckpointManager', step: int
) -> Optional[dict]:
  """The manifest of a step's client rows in files (None: saved whole).

  Args:
    mngr: an Orbax ``CheckpointManager``.
    step: the checkpoint's round.

  Returns:
    The manifest, or None.
  """
  if not os.path.isdir(
    os.path.join(str(mngr.directory), str(step), row_checkpoints.FOLDER)
  ):
    return None
  return mngr.restore(
    step,
    args=_ocp().args.Composite(
      **{row_checkpoints.FOLDER: _ocp().args.JsonRestore()}
    ),
  )[row_checkpoints.FOLDER]


def _discard_partial(directory) -> None:
  """Removes Orbax's temporary folders of an unfinished save."""
  directory = str(directory)
  if os.path.isdir(directory):
    for name in os.listdir(directory):
      if 'orbax-checkpoint-tmp' in name:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def restore_latest(
  directory: str, template_state, identity: Optional[dict] = None
):
  """(state, round, histories) of the latest checkpoint (one history per
  configuration), or None when there is none.

  Args:
    template_state: a state of the same structure (e.g. ``runner.init(key)``).
    identity: when given, the run identity the checkpoint must have been
      saved with.

  Returns:
    ``(state, round, histories)``, or None without a checkpoint.

  Raises:
    ConfigError('resume', ...) naming the differences when the checkpoint
    belongs to another configuration.
  """
  if not os.path.isdir(directory):
    return None
  mngr = manager(directory)
  unreadable = []
  for step in sorted(mngr.all_steps(), reverse=True):
    if identity is not None:
      try:
        ocp = _ocp()
        saved = mngr.restore(
          step, args=ocp.args.Composite(identity=ocp.args.JsonRestore())
        )
        saved = saved['identity']
      except Exception as e:  # noqa: BLE001 -- a corrupted step: try the previous one
        print(
          f'warning: checkpoint {step} in {directory} is unreadable '
          f'({type(e).__name__}); trying the previous one',
          file=sys.stderr,
        )
        unreadable.append(f'{step}: {type(e).__name__}')
        continue
      want = run_identity.as_json(identity)
      if saved != want:
        diff = run_identity.differences(saved or {}, want)
        raise ConfigError(
          'resume',
          f'checkpoint {step} in {directory} was saved by another '
          f'configuration ({"; ".join(diff[:4])})',
        )
    try:
      manifest = rows_manifest_of(mngr, step)
      if manifest is not None and not all(
        isinstance(t, HostedState)
        for t in (
          template_state
          if isinstance(template_state, list)
          else [template_state]
        )
      ):
        raise ConfigError(
          'layout',
          f'checkpoint {step} in {directory} keeps its client rows '
          'in files: resume with --layout=host',
        )
      abstract = (
        _abstract_without_rows(template_state)
        if manifest is not None
        else _abstract(template_state)
      )
      ocp = _ocp()
      out = mngr.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract),
          history=ocp.args.JsonRestore(),
        ),
      )
    except ConfigError:
      raise
    except Exception as e:
      # a corrupted step: fall back to the newest intact one
      print(
        f'warning: checkpoint {step} in {directory} is unreadable '
        f'({type(e).__name__}); trying the previous one',
        file=sys.stderr,
      )
      unreadable.append(f'{step}: {type(e).__name__}')
      continue
    histories = [list(h) for h in out['history']]
    # rows saved whole, into files
    # the rows of files: the base and the deltas past it
    if manifest is not None:
      state = _with_saved_inner(out['state'], template_state)
      row_checkpoints.restore(directory, manifest, state)
    elif row_checkpoints.has_files(template_state):
      whole = from_saveable(out['state'], template_state)
      states = whole if isinstance(whole, list) else [whole]
      row_checkpoints.write_whole_rows([w.rows for w in states], template_state)
      state = _with_inner(template_state, whole)
    else:
      state = from_saveable(out['state'], template_state)
    return state, int(step), histories
  if unreadable:  # never a fresh start whose checkpoints would replace these
    raise ConfigError(
      'resume',
      f'no checkpoint in {directory} can be read into this run '
      f'({", ".join(unreadable)}); they are kept: resume with the command '
      'that wrote them, or start afresh with --overwrite',
    )
  return None


def _with_inner(template, whole):
  if isinstance(template, list):
    return [_with_inner(t, w) for t, w in zip(template, whole)]
  return template.replace(inner=whole.inner)


class Checkpointer(Callback):
  """Saves checkpoints of a run.

  Saves every ``every`` rounds, when the run is interrupted, and (with
  ``final``) at its end (of a single run or a whole sweep: the stacked state
  and every configuration's records). Each durable checkpoint's round is
  recorded in ``progress`` (the run's fault lines name it), when given."""

  def __init__(
    self,
    directory: str,
    every: int,
    histories: Optional[List[List[dict]]] = None,
    max_to_keep: int = 2,
    identity: Optional[dict] = None,
    resumed_step: Optional[int] = None,
    final: bool = True,
    progress: Optional[run_progress.RunProgress] = None,
  ):
    self.mngr = manager(directory, max_to_keep)
    self.progress = progress
    self.identity = identity
    self.every = every
    self.final = final
    self.histories = [list(h) for h in histories] if histories else None
    # Client rows in files: the manifest the next checkpoint's delta follows.
    self.rows_manifest = (
      rows_manifest_of(self.mngr, resumed_step) if resumed_step else None
    )

  def _save(self, round_num, state, histories):
    self.rows_manifest = save(
      self.mngr, round_num, state, histories, self.identity, self.rows_manifest
    )
    if self.progress is not None:
      self.progress.checkpoint_round = round_num

  def on_round_end(self, round_num, records, state):
    if self.histories is None:
      self.histories = [[] for _ in records]
    for h, r in zip(self.histories, records):
      h.append(r)
    if self.every and round_num % self.every == 0:
      self._save(round_num, state, self.histories)

  def on_end(self, histories, state):
    last = histories[0][-1]['round'] if histories and histories[0] else 0
    if self.final and last and self.mngr.latest_step() != last:
      self._save(last, state, histories)

  def on_stop(self, round_num, state):
    """An interruption (Ctrl-C, SIGTERM): the round just finished is kept
    whatever ``every`` is, so that ``--resume`` continues from it."""
    if round_num and self.mngr.latest_step() != round_num:
      self._save(round_num, state, self.histories)
