"""Where the population's examples live during a run: the device or the host.

``device``: every client padded to the largest (capped) client, on the
device for the whole run (``core.data.FederatedData``); the round indexes
its cohort inside the compiled function. ``host``: the examples stay in the
population store (``core.store``, read from disk); each round gathers only
its cohort, padded to a power of two (``store.padded_length``, at most
``--max_client_examples``), on a host thread while the device runs the
previous round, and evaluation and the algorithm's pre-round phase stream
the population in blocks of clients. Cohorts are drawn by the same sampler
from the same key in both layouts, so the numbers agree (to float
reassociation of padded rows: batches hold the same real examples in the
same order, ``core.batching``). The algorithm never sees which runs it.

Per-client state: on the device layout, all of it in the state on the
device. On the host layout, the part an algorithm declares as its client
rows (``FederatedAlgorithm.client_rows``: personal models, control
variates, FedDyn's gradients, persistent client optimizer states) lives
with the population on the host (``HostedState``); a round receives the
cohort's rows, gathered by index, and its new rows are scattered back
(``Cohort.rows`` tells the algorithm where they are). State that a round
reads across the population (FedFomo's candidates, user-centric's N x N
mixing) stays on the device.
"""

import concurrent.futures
import dataclasses
import functools
from typing import Any, Optional

from flax import struct

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal.core.data import ClientData, PackedClientData
from fedjax_personal.core.store import SPLITS, PopulationStore, padded_length
from fedjax_personal.errors import ConfigError

LAYOUTS = ('auto', 'device', 'host')
#: ``auto`` keeps the padded population on the device when it takes at most
#: this share of the device's free memory (the host's available memory on CPU).
DEVICE_DATA_SHARE = 0.25
GB = 1 << 30


@dataclasses.dataclass(frozen=True)
class HostData:
  """The host layout's data (see module doc).

  Attributes:
    store: the population store.
    cap: at most this many training examples per client (None: all).
    block: clients per block of evaluation and of the pre-round phase.
    smallest: the shortest padded length of a cohort's split.
  """
  store: PopulationStore
  cap: Optional[int] = None
  block: int = 256
  smallest: int = 32

  @property
  def num_clients(self) -> int:
    return self.store.num_clients

  @property
  def eval_only(self) -> int:
    return self.store.eval_only

  @property
  def num_trained(self) -> int:
    return self.store.num_clients - self.store.eval_only

  @property
  def population(self):
    return self.store.population(self.cap)

  @functools.cached_property
  def _counts(self):
    """Per split: example counts after the cap, and the widest client's."""
    out = {}
    for split in SPLITS:
      counts = self.store.counts_capped(split, self.cap)
      out[split] = (counts, int(counts.max(initial=0)))
    return out

  def counts(self, split: str) -> np.ndarray:
    return self._counts[split][0]

  def length(self, split: str, idx) -> int:
    """The padded length of clients ``idx``'s ``split`` (0 when the whole
    population has none: no validation split)."""
    counts, widest = self._counts[split]
    if widest == 0:
      return 0
    idx = np.asarray(idx)
    top = int(counts[idx[idx < self.num_clients]].max(initial=0))
    return min(padded_length(top, self.cap, self.smallest), widest)

  def gather(self, split: str, idx, length: Optional[int] = None) -> ClientData:
    """Clients ``idx`` (host ints; past the last: empty) padded, on the device."""
    length = self.length(split, idx) if length is None else length
    return jax.device_put(self.store.gather(split, idx, length, self.cap, clip=True))

  def gather_packed(self, split: str, idx, at_least=(0, 0)) -> PackedClientData:
    """Clients ``idx`` packed back to back (``PackedClientData``), on the
    device: a round's cohort, whose real examples alone are copied; at least
    ``at_least = (rows, window)`` (shapes an earlier cohort compiled)."""
    length = max(self.length(split, idx), at_least[1])
    return jax.device_put(self.store.gather_packed(split, idx, length, self.cap,
                                                   max(self.smallest, at_least[0])))


class CohortFeed:
  """Prepares rounds' cohorts: draws the cohort (``sample(key)``), gathers
  its training and validation examples and puts them on the device, on one
  host thread, so that round t + 1's data is ready when round t ends.

  One feed may serve several runs (``sweep.LoopRuns`` in the host layout):
  runs that ask for the same round with the same key (configurations of one
  seed) get the one gather, prepared once.

  Attributes:
    shapes: the (train rows, train window, val rows, val window) of the
      packed cohorts the rounds used, in order of first use (one compiled
      round each).
    gathers: how many cohorts were gathered (one per distinct round key).
  """

  def __init__(self, host: HostData, sample):
    self.host, self.sample = host, sample
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='cohort-feed')
    self._pending = {}
    self._last = (None, None)  # the last cohort handed out, for runs of the same key
    self._least = {}
    self.shapes = []
    self.gathers = 0

  def _prepare(self, key):
    """(cohort, train, val); each split at least as large as the largest
    before it (rows and window), so that the compiled shapes only grow: a
    run compiles its round a few times at the start, then not again."""
    self.gathers += 1
    cohort = self.sample(key)
    idx = np.asarray(jax.device_get(cohort.idx))
    out = [cohort]
    for split in ('train', 'val'):
      data = self.host.gather_packed(split, idx, self._least.get(split, (0, 0)))
      self._least[split] = (data.x.shape[0], data.length)
      out.append(data)
    return tuple(out)

  @staticmethod
  def _key_id(key, round_num: int):
    return round_num, np.asarray(jax.random.key_data(key)).tobytes()

  def request(self, key, round_num: int) -> None:
    """Starts preparing round ``round_num`` (its key ``key``)."""
    k = self._key_id(key, round_num)
    if k not in self._pending and k != self._last[0]:
      self._pending = {p: v for p, v in self._pending.items() if p[0] >= round_num - 1}
      self._pending[k] = self._pool.submit(self._prepare, key)

  def get(self, key, round_num: int):
    """(cohort, train, val) of round ``round_num``: prepared ahead when it was
    requested with the same key, handed out already to a run of the same
    key, else made now."""
    k = self._key_id(key, round_num)
    if k == self._last[0]:
      out = self._last[1]
    else:
      pending = self._pending.pop(k, None)
      self._last = (None, None)  # the previous cohort is freed before this one is made
      # Made on the feed's thread, one gather at a time (a shared feed's
      # prefetches run beside the rounds).
      out = (pending or self._pool.submit(self._prepare, key)).result()
      self._last = (k, out)
    shape = (out[1].x.shape[0], out[1].length, out[2].x.shape[0], out[2].length)
    if shape not in self.shapes:
      self.shapes.append(shape)
    return out


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
    return HostedState(client_rows.put(whole, empty_rows(rows)), rows, client_rows)


def cpu_device():
  """The CPU backend's device: where the host layout makes and reads client
  rows, so that they never have to fit the accelerator."""
  return jax.devices('cpu')[0]


#: Bytes of client rows one block of clients holds (init, evaluation).
ROW_BLOCK_BYTES = 1 << 28


def rows_per_block(rows, most: int, block_bytes: Optional[int] = None) -> int:
  """Clients per block: at most ``most``, their rows ``block_bytes`` at most
  (default ROW_BLOCK_BYTES), one client at least."""
  block_bytes = ROW_BLOCK_BYTES if block_bytes is None else block_bytes
  per_row = sum(int(np.prod(a.shape[1:])) * np.dtype(a.dtype).itemsize
                for a in jax.tree.leaves(rows))
  return int(max(1, min(most, block_bytes // max(per_row, 1))))


def init_hosted(init, client_rows, key, block_bytes: Optional[int] = None) -> HostedState:
  """The state ``init(key)`` makes, as a ``HostedState``: its client rows
  computed on the CPU backend a block of clients at a time (one compiled
  slice of the rows, ``block_bytes`` at most, default ROW_BLOCK_BYTES) and
  written straight into
  numpy, so that making them holds the rows once plus a block (not the whole
  state and then its copy); the rest of the state on the default device."""
  cpu = cpu_device()
  key = jax.device_put(key, cpu)
  shapes = client_rows.get(jax.eval_shape(init, key))
  n = jax.tree.leaves(shapes)[0].shape[0]
  b = rows_per_block(shapes, n, block_bytes)

  def without_rows(k):
    state = init(k)
    return client_rows.put(state, empty_rows(client_rows.get(state)))

  def rows_block(k, lo):
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, lo, b),
                        client_rows.get(init(k)))
  with jax.default_device(cpu):
    inner = jax.jit(without_rows)(key)
    rows = jax.tree.map(lambda a: np.empty(a.shape, a.dtype), shapes)
    block = jax.jit(rows_block)
    for lo in range(0, n, b):
      lo = min(lo, n - b)  # the last block overlaps the one before: one shape
      for dst, src in zip(jax.tree.leaves(rows), jax.tree.leaves(block(key, lo))):
        dst[lo:lo + b] = np.asarray(src)
  return HostedState(jax.device_put(inner, jax.devices()[0]), rows, client_rows)


def hosted(whole, client_rows) -> HostedState:
  """A whole state made or read on the CPU backend as a ``HostedState``: the
  rows moved to numpy, the rest put on the default device."""
  state = HostedState.split(whole, client_rows)
  return state.replace(inner=jax.device_put(state.inner, jax.devices()[0]))


def rows_on_cpu(abstract, client_rows):
  """An abstract whole state (ShapeDtypeStructs) whose client rows are to be
  read onto the CPU backend (a checkpoint restored in the host layout)."""
  cpu = jax.sharding.SingleDeviceSharding(cpu_device())
  rows = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=cpu),
                      client_rows.get(abstract))
  return client_rows.put(abstract, rows)


def empty_rows(rows):
  """[0, ...] leaves in the place of client rows (the state between rounds)."""
  return jax.tree.map(lambda a: jnp.zeros((0,) + tuple(a.shape[1:]), a.dtype), rows)


def gather_rows(rows, idx: np.ndarray):
  """Rows ``idx`` (clipped to the population, as the device layout's gathers
  clip a padded slot) as device arrays."""
  n = jax.tree.leaves(rows)[0].shape[0]
  safe = np.minimum(np.asarray(idx), n - 1)
  return jax.tree.map(lambda a: jnp.asarray(a[safe]), rows)


def scatter_rows(rows, idx: np.ndarray, valid: np.ndarray, new) -> None:
  """``rows[idx[valid]] = new[valid]``, leaf by leaf, in place on the host."""
  idx, valid = np.asarray(idx), np.asarray(valid, bool)
  for a, b in zip(jax.tree.leaves(rows), jax.tree.leaves(jax.device_get(new))):
    a[idx[valid]] = np.asarray(b)[valid]


def blocks(clients: np.ndarray, block: int):
  """``clients`` in blocks of ``min(block, len(clients))`` (the last one
  padded by repeating its first client): yields (ids, valid), both of the
  block's length."""
  size = max(1, min(block, len(clients)))
  for start in range(0, len(clients), size):
    part = clients[start:start + size]
    valid = np.arange(size) < len(part)
    yield np.resize(part, size) if len(part) < size else part, valid


def join_blocks(parts):
  """One output over all clients from ``[(valid, outputs)]`` of consecutive
  blocks: ``Sum`` values added, stacked outputs' valid slots concatenated."""
  from fedjax_personal.core import aggregation
  nodes = [jax.tree.flatten(o, is_leaf=aggregation.is_sum)[0] for _, o in parts]
  treedef = jax.tree.structure(parts[0][1], is_leaf=aggregation.is_sum)
  keep = [np.flatnonzero(v) for v, _ in parts]

  def join(*ns):
    if aggregation.is_sum(ns[0]):
      return aggregation.Sum(jax.tree.map(lambda *v: sum(v[1:], v[0]), *[n.value for n in ns]))
    return jax.tree.map(lambda *xs: jnp.concatenate([x[k] for x, k in zip(xs, keep)]), *ns)
  return treedef.unflatten([join(*ns) for ns in zip(*nodes)])


def host_available_bytes() -> Optional[int]:
  """MemAvailable of /proc/meminfo (None where there is none)."""
  try:
    with open('/proc/meminfo') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def choose(requested: str, padded_bytes: int, free_bytes: Optional[int],
           widest: int, cap: Optional[int]):
  """(layout, reason) for ``--layout=requested``.

  ``auto``: ``device`` when the padded population takes at most
  ``DEVICE_DATA_SHARE`` of ``free_bytes`` (unknown: device), else ``host``.

  Raises:
    ConfigError: an unknown layout, or ``device`` asked for a padded
      population that cannot fit (naming the widest client and the cap).
  """
  if requested not in LAYOUTS:
    raise ConfigError('layout', f'unknown layout {requested!r}; choose one of {list(LAYOUTS)}')
  need = f'padded to its widest client ({widest:,} examples' + (
      f', capped at {cap:,})' if cap else ')') + f' the population needs {padded_bytes / GB:.2f} GB'
  free = 'unknown free memory' if free_bytes is None else f'{free_bytes / GB:.1f} GB free'
  fits = free_bytes is None or padded_bytes <= DEVICE_DATA_SHARE * free_bytes
  if requested == 'device':
    if free_bytes is not None and padded_bytes > free_bytes:
      raise ConfigError('layout', f'--layout=device: {need}, {free}; give '
                        '--max_client_examples=N (TFF caps at 1000) or --layout=host')
    return 'device', f'asked for; {need}, {free}'
  if requested == 'host':
    return 'host', f'asked for; {need}, {free}'
  if fits:
    return 'device', f'auto: {need}, {free}'
  return 'host', (f'auto: {need}, more than {DEVICE_DATA_SHARE:.0%} of the {free}; '
                  'each round gathers its cohort')

