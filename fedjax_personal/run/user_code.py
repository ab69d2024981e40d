"""The user's own code in a run: every algorithm's round traced abstractly
before anything trains (``--dry_run``), and a failure raised in a user's
file (an algorithm, a model of ``--import``) turned into one line naming the
file, the line and the algorithm.

A round is traced with ``jax.eval_shape`` over the engine's own round
function (``engine.round_functions``) on the data's shapes: nothing is
computed or compiled, and a round that raises when traced (a wrong shape,
a misspelled field, an error of the user's) fails here, in seconds, instead
of after the algorithms before it trained.
"""

from typing import Any, Iterable, Optional

import jax
import jax.numpy as jnp

from fedjax_personal.core.data import ClientData
from fedjax_personal.core.engine import round_functions
from fedjax_personal.core.executors import VmapExecutor
from fedjax_personal.core.population.placement import HostData
from fedjax_personal.errors import ConfigError, SettingError, user_frame
from fedjax_personal.run import faults, plugins

__all__ = ['failure', 'trace_round', 'users_failure']


def _split_shapes(data, split: str):
  """A split of the data as shapes: the device layout's arrays, or the host
  layout's whole population padded (never made: shapes only)."""
  if not isinstance(data, HostData):
    return getattr(data, split)
  store = data.store
  counts = store.counts_capped(split, data.cap if split == 'train' else None)
  x, y, _ = store.arrays[split]
  n, length = store.num_clients, max(int(counts.max(initial=0)), 1)
  shape: Any = jax.ShapeDtypeStruct  # shapes standing for the arrays
  return ClientData(
    x=shape((n, length) + x.shape[1:], x.dtype),
    y=shape((n, length) + y.shape[1:], y.dtype),
    num_examples=shape((n,), jnp.int32),
  )


def trace_round(alg, sampler, data, system=None) -> None:
  """Traces one round of ``alg`` (server broadcast, every client's work,
  the server update, its communication) abstractly.

  Args:
    alg: the ``FederatedAlgorithm``.
    sampler: its cohort sampler.
    data: the run's data (device arrays or ``HostData``).
    system: the clients' devices (``core.system.SystemConfig``), or None.

  Returns:
    None.

  Raises:
    ConfigError: the round raised while traced, naming the algorithm and,
      when the error arose in the user's code, its file and line.
  """
  fused_round = round_functions(
    alg, sampler, VmapExecutor(), system=system
  ).fused_round
  train, val = _split_shapes(data, 'train'), _split_shapes(data, 'val')

  def one_round(key, train, val):
    return fused_round(alg.init(key), key, jnp.int32(0), train, val)

  try:
    jax.eval_shape(one_round, jax.random.key(0), train, val)
  except SettingError:
    raise
  except Exception as e:  # the round cannot be traced: nothing would train
    raise ConfigError(
      'algorithm', failure(alg.name, e, 'when its round is traced')
    ) from None


def users_failure(name: str, e: BaseException) -> Optional[str]:
  """``failure``'s line for an algorithm that raised in the user's own code
  while training, or None for anything else (a setting refused, memory
  running out, this package's or a library's own failure: the command's
  line for those, or the traceback).

  Args:
    name: the algorithm.
    e: what it raised.

  Returns:
    The line, or None.
  """
  if (
    isinstance(e, SettingError)
    or faults.out_of_memory(e)
    or user_frame(e, list(plugins.LOADED.values())) is None
  ):
    return None
  return failure(name, e)


def failure(
  name: str,
  e: BaseException,
  when: str = 'while training',
  files: Iterable[str] = (),
) -> str:
  """One line for an algorithm whose code raised: its name, where (the
  user's file and line, else the innermost frame) and the error.

  Args:
    name: the algorithm.
    e: what it raised.
    when: when it raised, in words.
    files: source files to look in first (default: those of ``--import``).

  Returns:
    The line.
  """
  where = user_frame(e, list(files) or list(plugins.LOADED.values()))
  first = str(e).strip().splitlines()[0] if str(e).strip() else ''
  return (
    f'{name} failed {when}'
    + (f' at {where}' if where else '')
    + f': {type(e).__name__}: {first}'
  )
