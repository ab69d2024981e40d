"""Per-client state on the host layout: an algorithm's client rows (personal
models, control variates, FedDyn's gradients, persistent client optimizer
states; ``FederatedAlgorithm.client_rows``) kept with the population on the
host (``HostedState``), made in blocks of clients (``init_hosted``); a round
receives its cohort's rows gathered by index and its new rows are scattered
back (``Cohort.rows`` tells the algorithm where they are).
"""

import dataclasses
import gc
import mmap
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

__all__ = [
  'cpu_device',
  'empty_rows',
  'gather_rows',
  'hosted',
  'HostedState',
  'init_hosted',
  'ROW_BLOCK_BYTES',
  'rows_on_cpu',
  'rows_per_block',
  'scatter_rows',
  'state_without_rows',
]


@struct.dataclass
class HostedState:
  """The host layout's state of an algorithm with client rows.

  Attributes:
    inner: the algorithm's state with its client rows left out (empty
      [0, ...] leaves), on the device.
    rows: every client's rows, host (numpy) arrays [N, ...]; each round
      writes its cohort's rows in place (the loop consumes the state it
      passes to a round, as with donation on the device).
    client_rows: the algorithm's ``ClientRows`` (static).
  """

  inner: Any
  rows: Any
  client_rows: Any = struct.field(pytree_node=False, default=None)

  def whole(self):
    """The algorithm's state with every client's rows in it (what the
    device layout holds, and what a checkpoint saves in both layouts)."""
    return self.client_rows.put(self.inner, self.rows)

  @staticmethod
  def split(whole, client_rows) -> 'HostedState':
    """A whole state (consumed) with its client rows moved to the host, leaf
    by leaf: each device leaf is freed once copied, so the move holds one
    leaf twice, not every row."""
    moved = {}  # id -> copy: a leaf that appears twice is copied once

    def move(a):
      if id(a) not in moved:
        moved[id(a)] = np.array(a)
        if isinstance(a, jax.Array):
          a.delete()
      return moved[id(a)]

    rows = jax.tree.map(move, client_rows.get(whole))
    return HostedState(
      client_rows.put(whole, empty_rows(rows)), rows, client_rows
    )


def cpu_device():
  """The CPU backend's device: where the host layout makes and reads client
  rows, so that they never have to fit the accelerator.

  Returns:
    The device.
  """
  return jax.devices('cpu')[0]


#: Bytes of client rows one block of clients holds (init, evaluation).
ROW_BLOCK_BYTES = 1 << 28


def rows_per_block(rows, most: int, block_bytes: Optional[int] = None) -> int:
  """Clients per block: at most ``most``, their rows ``block_bytes`` at most
  (default ROW_BLOCK_BYTES), one client at least.

  Args:
    rows: client rows.
    most: clients per block at most.
    block_bytes: bytes of rows per block at most.

  Returns:
    Clients per block.
  """
  block_bytes = ROW_BLOCK_BYTES if block_bytes is None else block_bytes
  per_row = sum(
    int(np.prod(a.shape[1:])) * np.dtype(a.dtype).itemsize
    for a in jax.tree.leaves(rows)
  )
  return int(max(1, min(most, block_bytes // max(per_row, 1))))


def state_without_rows(init, client_rows, key):
  """The state ``init(key)`` makes with its client rows left out (empty
  leaves), made on the CPU backend and put on the default device: what a
  ``HostedState`` holds beside its rows, in memory or in files.

  Args:
    init: the algorithm's ``init``.
    client_rows: its ``ClientRows``.
    key: the init key.

  Returns:
    The state with empty rows.
  """

  def without_rows(k):
    state = init(k)
    return client_rows.put(state, empty_rows(client_rows.get(state)))

  with jax.default_device(cpu_device()):
    inner = jax.jit(without_rows)(jax.device_put(key, cpu_device()))
  return jax.device_put(inner, jax.devices()[0])


def init_hosted(
  init, client_rows, key, block_bytes: Optional[int] = None
) -> HostedState:
  """The state ``init(key)`` makes, as a ``HostedState``: its client rows
  computed on the CPU backend a block of clients at a time (one compiled
  slice of the rows, ``block_bytes`` at most, default ROW_BLOCK_BYTES) and
  written straight into
  numpy, so that making them holds the rows once plus a block (not the whole
  state and then its copy); the rest of the state on the default device.

  Args:
    init: the algorithm's ``init``.
    client_rows: its ``ClientRows``.
    key: the init key.
    block_bytes: rows made at a time at most.

  Returns:
    The ``HostedState``.
  """
  cpu = cpu_device()
  key = jax.device_put(key, cpu)
  shapes = client_rows.get(jax.eval_shape(init, key))
  n = jax.tree.leaves(shapes)[0].shape[0]
  b = rows_per_block(shapes, n, block_bytes)

  def rows_block(k, lo):
    return jax.tree.map(
      lambda a: jax.lax.dynamic_slice_in_dim(a, lo, b), client_rows.get(init(k))
    )

  with jax.default_device(cpu):
    rows = jax.tree.map(lambda a: np.empty(a.shape, a.dtype), shapes)
    block = jax.jit(rows_block)
    for lo in range(0, n, b):
      lo = min(lo, n - b)  # the last block overlaps the one before: one shape
      for dst, src in zip(
        jax.tree.leaves(rows), jax.tree.leaves(block(key, lo))
      ):
        dst[lo : lo + b] = np.asarray(src)
  return HostedState(
    state_without_rows(init, client_rows, key), rows, client_rows
  )


def hosted(whole, client_rows) -> HostedState:
  """A whole state made or read on the CPU backend as a ``HostedState``: the
  rows moved to numpy, the rest put on the default device.

  Args:
    whole: a whole state.
    client_rows: its ``ClientRows``.

  Returns:
    The ``HostedState``.
  """
  state = HostedState.split(whole, client_rows)
  return dataclasses.replace(
    state, inner=jax.device_put(state.inner, jax.devices()[0])
  )


def rows_on_cpu(abstract, client_rows):
  """An abstract whole state (ShapeDtypeStructs) whose client rows are to be
  read onto the CPU backend (a checkpoint restored in the host layout).

  Args:
    abstract: an abstract whole state.
    client_rows: its ``ClientRows``.

  Returns:
    The abstract state, its rows placed on the CPU.
  """
  cpu = jax.sharding.SingleDeviceSharding(cpu_device())
  rows = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=cpu),
    client_rows.get(abstract),
  )
  return client_rows.put(abstract, rows)


def empty_rows(rows):
  """[0, ...] leaves in the place of client rows (the state between rounds).

  Args:
    rows: client rows.

  Returns:
    Rows of 0 clients.
  """
  return jax.tree.map(
    lambda a: jnp.zeros((0,) + tuple(a.shape[1:]), a.dtype), rows
  )


def gather_rows(rows, idx: np.ndarray):
  """Rows ``idx`` (clipped to the population, as the device layout's gathers
  clip a padded slot) as device arrays.

  Args:
    rows: client rows [N, ...] (host).
    idx: row indices.

  Returns:
    The rows [len(idx), ...].
  """
  n = jax.tree.leaves(rows)[0].shape[0]
  safe = np.minimum(np.asarray(idx), n - 1)
  leaves, treedef = jax.tree.flatten(rows)
  shapes = [(len(safe),) + tuple(a.shape[1:]) for a in leaves]
  most = max(
    [
      int(np.prod(s)) * np.dtype(a.dtype).itemsize
      for s, a in zip(shapes, leaves)
    ],
    default=0,
  )
  scratch = _scratch(most)
  out = []
  for a, s in zip(leaves, shapes):
    host = np.frombuffer(scratch, a.dtype, int(np.prod(s))).reshape(s)
    if isinstance(a, np.ndarray):
      np.take(a, safe, axis=0, out=host)
    else:  # rows in files
      a.take(safe, host)
    out.append(_owned_copy(host))
    del host
  gc.collect(0)  # jaxlib's last hold on the buffer (see _owned_copy)
  if isinstance(scratch, mmap.mmap):
    try:
      scratch.close()  # its pages go back now
    except BufferError:  # still held: unmapped when freed
      pass
  return jax.tree.unflatten(treedef, out)


#: Bytes of a gathered leaf from which the gather's host buffer is mapped
#: apart from the heap (and so handed back to the OS once the rows are copied).
MAPPED_GATHER_BYTES = 1 << 23


def _scratch(nbytes: int):
  """The gather's host buffer, one leaf at a time: an anonymous private
  memory map from ``MAPPED_GATHER_BYTES`` on (where the platform has one),
  so that its pages go back to the OS at once, rather than to the heap,
  which keeps freed blocks for XLA (``host.tune_allocator``) and where a
  round's temporaries (Ditto, cohort 50 of Stack Overflow's LSTM: 62 MB)
  did not fit a freed 61 MB leaf."""
  flags = getattr(mmap, 'MAP_PRIVATE', 0) | getattr(mmap, 'MAP_ANONYMOUS', 0)
  if nbytes >= MAPPED_GATHER_BYTES and flags:
    return mmap.mmap(-1, nbytes, flags=flags)
  return bytearray(max(nbytes, 1))


def _owned_copy(host: np.ndarray) -> jax.Array:
  """A device array of ``host``'s values in a buffer of its own: one that a
  round can donate, ``host`` free once jaxlib drops its hold.

  On the CPU, ``jax.device_put`` of a 64-byte aligned host array shares its
  memory whatever ``may_alias`` says; a round donated such an array cannot
  write its output there and allocates another (Ditto's cohort rows: 122 MB
  more). That array is copied by XLA (``may_alias=False`` of a device
  array). The copy is awaited; jaxlib drops its reference to ``host`` at
  its next garbage collection, which a young-generation pass runs (the
  caller's): otherwise a gather's host buffers lived until the round ended.

  Args:
    host: a host array.

  Returns:
    The device array.
  """
  out = jax.device_put(host)
  if out.unsafe_buffer_pointer() == host.ctypes.data:
    owned = jax.device_put(out, may_alias=False)
    out.delete()
    out = owned
  return out.block_until_ready()


def scatter_rows(
  rows, idx: np.ndarray, valid: np.ndarray, new, keep=()
) -> None:
  """``rows[idx[valid]] = new[valid]``, leaf by leaf, in place on the host:
  each new leaf is fetched, written and freed before the next (``new`` is
  consumed, but for the arrays ``keep`` holds: the rest of the state), so
  that the cohort's new rows are not held twice.

  Args:
    rows: client rows [N, ...] (host).
    idx: row indices.
    valid: which of them to write.
    new: the new rows.
    keep: arrays of the state not to free (the rest of the state).

  Returns:
    None.
  """
  idx, valid = np.asarray(idx), np.asarray(valid, bool)
  leaves = jax.tree.leaves(new)
  del new
  done = {id(x) for x in jax.tree.leaves(keep)}
  every = bool(valid.all())
  for a, b in zip(jax.tree.leaves(rows), leaves):
    host = np.asarray(jax.device_get(b))
    a[idx[valid]] = host if every else host[valid]
    del host
    if isinstance(b, jax.Array) and id(b) not in done:
      done.add(id(b))
      b.delete()
