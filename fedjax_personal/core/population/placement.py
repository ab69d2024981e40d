"""Where the population's examples live during a run: the device or the host.

``device``: every client padded to the largest (capped) client, on the
device for the whole run (``core.data.FederatedData``); the round indexes
its cohort inside the compiled function. ``host``: the examples stay in the
population store (``core.population.store``, read from disk); each round gathers
only its cohort, padded to a power of two (``clients.padded_length``, at most
``--max_client_examples``), on a host thread while the device runs the previous
round, and evaluation and the algorithm's pre-round phase stream the population
in blocks of clients. Cohorts are drawn by the same sampler from the same key in
both layouts, so the numbers agree (to float reassociation of padded rows:
batches hold the same real examples in the same order, ``core.batching``). The
algorithm never sees which runs it.

Per-client state: on the device layout, all of it in the state on the
device. On the host layout, the part an algorithm declares as its client
rows (``FederatedAlgorithm.client_rows``: personal models, control
variates, FedDyn's gradients, persistent client optimizer states) lives
with the population on the host (``core/population/rows_in_memory.py``); a round
receives the cohort's rows, gathered by index, and its new rows are scattered
back (``Cohort.rows`` tells the algorithm where they are). State that a round
reads across the population (FedFomo's candidates, user-centric's N x N mixing)
stays on the device.
"""

import concurrent.futures
import dataclasses
import functools
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal.core import aggregation, host
from fedjax_personal.core.data import ClientData, PackedClientData
from fedjax_personal.core.population.clients import (
  SPLITS,
  PopulationStore,
  next_power_of_two,
  padded_length,
)
from fedjax_personal.errors import SettingError

__all__ = [
  'blocks',
  'choose',
  'CohortFeed',
  'CohortShape',
  'FedCohort',
  'LayoutChoice',
  'PackedSize',
  'DEVICE_DATA_SHARE',
  'GB',
  'host_available_bytes',
  'host_limit_bytes',
  'HostData',
  'join_blocks',
  'LAYOUTS',
  'ShapePlan',
]


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
    rows_folder: where algorithms keep their client rows in files (each
      state its own folder; ``core/population/rows_in_files.py``); None: in host
      memory.
  """

  store: PopulationStore
  cap: Optional[int] = None
  block: int = 256
  smallest: int = 32
  rows_folder: Optional[str] = None

  @property
  def num_clients(self) -> int:
    return self.store.num_clients

  @property
  def eval_only(self) -> int:
    return self.store.eval_only

  @property
  def num_trained(self) -> int:
    return self.store.num_trained

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
    """Clients ``idx`` (host ints; past the last: empty) padded, on the
    device."""
    length = self.length(split, idx) if length is None else length
    return jax.device_put(
      self.store.gather(split, idx, length, self.cap, clip=True)
    )

  def gather_packed(self, split: str, idx, at_least=(0, 0)) -> PackedClientData:
    """Clients ``idx`` packed back to back (``PackedClientData``), on the
    device: a round's cohort, whose real examples alone are copied; at least
    ``at_least = (rows, window)`` (shapes an earlier cohort compiled)."""
    length = max(self.length(split, idx), at_least[1])
    return jax.device_put(
      self.store.gather_packed(
        split, idx, length, self.cap, max(self.smallest, at_least[0])
      )
    )


#: ``ShapePlan``: the smaller row bucket holds this quantile of the totals
#: of random cohorts (the larger one, any cohort).
PLAN_QUANTILE = 0.999
PLAN_DRAWS = 4096


@dataclasses.dataclass(frozen=True)
class ShapePlan:
  """The packed cohort shapes a host-layout run compiles.

  Fixed before its
  first round from the population's example counts and the cohort size.

  Per split: one window, the widest client's examples (``HostData.length``
  of the whole population: a window is a static view, not a copy, so a
  wider one costs no compute), and at most two row buckets, powers of two:
  one holding ``PLAN_QUANTILE`` of ``PLAN_DRAWS`` random cohorts' totals
  plus a window, one holding the ``cohort_size`` largest clients'. A cohort
  takes the smaller bucket that holds it, so a run compiles its round at
  most ``count`` times, in practice once, whatever its cohorts: the shapes
  no longer grow round after round (a heavy-tailed cohort-10 run used to
  compile 3-6 times in its first 20 rounds).

  Attributes:
    windows: {split: window} (0: the split is empty everywhere).
    rows: {split: ascending row buckets}.
  """

  windows: dict
  rows: dict

  @classmethod
  def for_cohorts(
    cls, host: 'HostData', cohort_size: int, seed: int = 0
  ) -> 'ShapePlan':
    """The plan of cohorts of ``cohort_size`` drawn from ``host``'s
    clients that train."""
    windows: Dict[str, int] = {}
    rows: Dict[str, Tuple[int, ...]] = {}
    rng = np.random.default_rng(seed)
    trained = max(1, host.num_trained)
    draws = rng.integers(
      0, trained, (PLAN_DRAWS, max(1, min(cohort_size, trained)))
    )
    for split in ('train', 'val'):
      counts = np.asarray(host.counts(split))[:trained]
      window = host.length(split, np.arange(host.num_clients))
      windows[split] = window
      if window == 0:
        rows[split] = (0,)
        continue
      top = int(np.sort(counts)[::-1][:cohort_size].sum())
      likely = int(np.quantile(counts[draws].sum(1), PLAN_QUANTILE))
      bucket = lambda total: int(
        next_power_of_two(max(host.smallest, total + window))
      )
      rows[split] = tuple(sorted({bucket(min(likely, top)), bucket(top)}))
    return cls(windows, rows)

  def at_least(self, split: str, total: int) -> 'PackedSize':
    """The ``PackedSize`` of a cohort whose ``split`` holds ``total``
    examples: the smallest bucket that holds them and a window."""
    window = self.windows[split]
    if window == 0:
      return PackedSize(0, 0)
    rows = next(
      (r for r in self.rows[split] if r >= total + window), self.rows[split][-1]
    )
    return PackedSize(rows, window)

  @property
  def count(self) -> int:
    """The most shapes (compiled rounds) a run can use."""
    return int(np.prod([len(r) for r in self.rows.values()]))

  def describe(self) -> str:
    parts = [
      f'{s} {"/".join(f"{r:,}" for r in self.rows[s])} rows x window '
      f'{self.windows[s]:,}'
      for s in ('train', 'val')
      if self.windows[s]
    ]
    return f'at most {self.count} packed cohort shape(s): ' + '; '.join(parts)


class PackedSize(NamedTuple):
  """A packed split's shape: its rows and the window a client reads."""

  rows: int
  window: int


class LayoutChoice(NamedTuple):
  """Where a population's examples live (``choose``) and why.

  Attributes:
    layout: ``device`` or ``host``.
    reason: the one line the run prints.
  """

  layout: str
  reason: str


class FedCohort(NamedTuple):
  """A round's cohort and its clients' examples, on the device.

  Attributes:
    cohort: the sampled ``sampling.Cohort``.
    train: the cohort's training examples, packed (``PackedClientData``).
    val: its validation examples, packed.
  """

  cohort: Any
  train: PackedClientData
  val: PackedClientData


class CohortShape(NamedTuple):
  """The shapes a packed cohort compiles for (one compiled round each)."""

  train_rows: int
  train_window: int
  val_rows: int
  val_window: int


class CohortFeed:
  """Prepares rounds' cohorts ahead on a host thread.

  Prepares rounds' cohorts: draws the cohort (``sample(key)``), gathers
  its training and validation examples and puts them on the device, on one
  host thread, so that round t + 1's data is ready when round t ends.

  One feed may serve several runs (``sweep.LoopRuns`` in the host layout):
  runs that ask for the same round with the same key (configurations of one
  seed) get the one gather, prepared once. Cohorts take the shapes of the
  feed's ``plan`` (``ShapePlan``).

  Attributes:
    plan: the shapes cohorts are packed in (None: each cohort's own, never
      smaller than an earlier cohort's).
    shapes: the (train rows, train window, val rows, val window) of the
      packed cohorts the rounds used, in order of first use (one compiled
      round each).
    gathers: how many cohorts were gathered (one per distinct round key).
  """

  def __init__(self, host: HostData, sample, plan: Optional[ShapePlan] = None):
    self.host, self.sample, self.plan = host, sample, plan
    self._pool = concurrent.futures.ThreadPoolExecutor(
      1, thread_name_prefix='cohort-feed'
    )
    self._pending: Dict[Any, concurrent.futures.Future] = {}
    # the last cohort handed out (its key id and the cohort), for runs of the
    # same key
    self._last_id: Any = None
    self._last: Optional[FedCohort] = None
    self._least: Dict[Any, Any] = {}
    self.shapes: List[CohortShape] = []
    self.gathers = 0

  def _prepare(self, key, round_num: int) -> 'FedCohort':
    """The round's ``FedCohort``, each split in the plan's shape (without a
    plan: at least as large as the largest before it, rows and window)."""
    self.gathers += 1
    cohort = self.sample(key, np.int32(round_num))
    idx = np.asarray(jax.device_get(cohort.idx))
    out = {}
    for split in ('train', 'val'):
      if self.plan is not None:
        real = idx[idx < self.host.num_clients]
        least = self.plan.at_least(
          split, int(np.asarray(self.host.counts(split))[real].sum())
        )
      else:
        least = self._least.get(split, (0, 0))
      data = self.host.gather_packed(split, idx, least)
      self._least[split] = (data.x.shape[0], data.length)
      out[split] = data
    return FedCohort(cohort, out['train'], out['val'])

  @staticmethod
  def _key_id(key, round_num: int):
    return round_num, np.asarray(jax.random.key_data(key)).tobytes()

  def request(self, key, round_num: int) -> None:
    """Starts preparing round ``round_num`` (its key ``key``)."""
    k = self._key_id(key, round_num)
    if k not in self._pending and k != self._last_id:
      self._pending = {
        p: v for p, v in self._pending.items() if p[0] >= round_num - 1
      }
      self._pending[k] = self._pool.submit(self._prepare, key, round_num)

  def get(self, key, round_num: int) -> 'FedCohort':
    """The ``FedCohort`` of round ``round_num``: prepared ahead when it was
    requested with the same key, handed out already to a run of the same
    key, else made now."""
    k = self._key_id(key, round_num)
    if k == self._last_id and self._last is not None:
      out = self._last
    else:
      pending = self._pending.pop(k, None)
      # the previous cohort is freed before this one is made
      self._last_id, self._last = None, None
      # Made on the feed's thread, one gather at a time (a shared feed's
      # prefetches run beside the rounds).
      out = (
        pending or self._pool.submit(self._prepare, key, round_num)
      ).result()
      self._last_id, self._last = k, out
    shape = CohortShape(
      out.train.x.shape[0], out.train.length, out.val.x.shape[0], out.val.length
    )
    if shape not in self.shapes:
      self.shapes.append(shape)
    return out


def blocks(clients: np.ndarray, block: int):
  """``clients`` in blocks of ``min(block, len(clients))`` (the last one
  padded by repeating its first client): yields (ids, valid), both of the
  block's length.

  Args:
    clients: client indices.
    block: clients per block.

  Yields:
    ``(ids, valid)`` per block.
  """
  size = max(1, min(block, len(clients)))
  for start in range(0, len(clients), size):
    part = clients[start : start + size]
    valid = np.arange(size) < len(part)
    yield np.resize(part, size) if len(part) < size else part, valid


def join_blocks(parts):
  """One output over all clients from ``[(valid, outputs)]`` of consecutive
  blocks: ``Sum`` values added, stacked outputs' valid slots concatenated.

  Args:
    parts: ``[(valid, outputs)]`` of consecutive blocks.

  Returns:
    The joined outputs.
  """
  nodes = [jax.tree.flatten(o, is_leaf=aggregation.is_sum)[0] for _, o in parts]
  treedef = jax.tree.structure(parts[0][1], is_leaf=aggregation.is_sum)
  keep = [np.flatnonzero(v) for v, _ in parts]

  def join(*ns):
    if aggregation.is_sum(ns[0]):
      return aggregation.Sum(
        jax.tree.map(lambda *v: sum(v[1:], v[0]), *[n.value for n in ns])
      )
    return jax.tree.map(
      lambda *xs: jnp.concatenate([x[k] for x, k in zip(xs, keep)]), *ns
    )

  return jax.tree.unflatten(treedef, [join(*ns) for ns in zip(*nodes)])


def host_available_bytes() -> Optional[int]:
  """What this process may still allocate on the host: the least of
  MemAvailable (/proc/meminfo), the address space its limit leaves
  (``ulimit -v``: RLIMIT_AS less VmSize) and its cgroup's memory limit less
  its use (a container's: cgroup v2 ``memory.max``, or v1
  ``memory.limit_in_bytes``). None where none is known.

  Returns:
    Bytes, or None where unknown.
  """
  return _least_of_host_limits(_meminfo('MemAvailable'))


def host_limit_bytes() -> Optional[int]:
  """The most this process could ever allocate on the host: the least of
  the machine's memory (MemTotal), the address space its limit leaves
  (``ulimit -v``) and its cgroup's limit less its use. Past it a round is
  hopeless (the machine swaps or stalls rather than fail), whatever is
  moved to files. None where none is known.

  Returns:
    Bytes, or None where unknown.
  """
  return _least_of_host_limits(_meminfo('MemTotal'))


def _least_of_host_limits(memory: Optional[int]) -> Optional[int]:
  """The least of ``memory`` (a /proc/meminfo figure), the address space
  ``ulimit -v`` leaves and the cgroup's room, never below 0; None when none
  is known."""
  known = [
    v for v in (memory, _address_space_left(), _cgroup_left()) if v is not None
  ]
  return max(0, min(known)) if known else None


def _meminfo(key: str, path: str = '/proc/meminfo') -> Optional[int]:
  try:
    with open(path) as f:
      for line in f:
        if line.startswith(key + ':'):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return None


def _address_space_left() -> Optional[int]:
  soft = host.address_space_limit()
  if soft is None:
    return None
  used = _meminfo('VmSize', '/proc/self/status')
  return None if used is None else soft - used


def _cgroup_left(root: str = '/sys/fs/cgroup') -> Optional[int]:
  """The memory limit of this process's cgroup less its use (None: no limit)."""

  def read(path):
    try:
      with open(path) as f:
        text = f.read().strip()
    except OSError:
      return None
    return None if text in ('', 'max') or not text.isdigit() else int(text)

  try:
    with open('/proc/self/cgroup') as f:
      lines = f.read().splitlines()
  except OSError:
    return None
  for line in lines:
    _, controllers, path = line.split(':', 2)
    if controllers == '':  # cgroup v2
      base = root + path.rstrip('/')
      limit, used = read(base + '/memory.max'), read(base + '/memory.current')
    elif 'memory' in controllers.split(','):  # cgroup v1
      base = root + '/memory' + path.rstrip('/')
      limit, used = (
        read(base + '/memory.limit_in_bytes'),
        read(base + '/memory.usage_in_bytes'),
      )
      if limit is not None and limit >= 1 << 60:  # v1's "no limit"
        limit = None
    else:
      continue
    if limit is not None:
      return limit - (used or 0)
  return None


def choose(
  requested: str,
  padded_bytes: int,
  free_bytes: Optional[int],
  widest: int,
  cap: Optional[int],
) -> 'LayoutChoice':
  """The ``LayoutChoice`` for ``--layout=requested``.

  ``auto``: ``device`` when the padded population takes at most
  ``DEVICE_DATA_SHARE`` of ``free_bytes`` (unknown: device), else ``host``.

  Args:
    requested: ``auto``, ``device`` or ``host``.
    padded_bytes: the padded population's bytes.
    free_bytes: the memory free (None: unknown).
    widest: the largest client's examples.
    cap: ``--max_client_examples``.

  Returns:
    The ``LayoutChoice``.

  Raises:
    SettingError: an unknown layout, or ``device`` asked for a padded
      population that cannot fit (naming the widest client and the cap).
  """
  if requested not in LAYOUTS:
    raise SettingError(
      'layout', f'unknown layout {requested!r}; choose one of {list(LAYOUTS)}'
    )
  need = (
    f'padded to its widest client ({widest:,} examples'
    + (f', capped at {cap:,})' if cap else ')')
    + f' the population needs {padded_bytes / GB:.2f} GB'
  )
  free = (
    'unknown free memory'
    if free_bytes is None
    else f'{free_bytes / GB:.1f} GB free'
  )
  fits = free_bytes is None or padded_bytes <= DEVICE_DATA_SHARE * free_bytes
  if requested == 'device':
    if free_bytes is not None and padded_bytes > free_bytes:
      raise SettingError(
        'layout',
        f"'device': {need}, {free}; cap each client's examples "
        "(max_client_examples=N; TFF caps at 1000) or take the layout 'host'",
      )
    return LayoutChoice('device', f'asked for; {need}, {free}')
  if requested == 'host':
    return LayoutChoice('host', f'asked for; {need}, {free}')
  if fits:
    return LayoutChoice('device', f'auto: {need}, {free}')
  return LayoutChoice(
    'host',
    f'auto: {need}, more than {DEVICE_DATA_SHARE:.0%} of the {free}; '
    'each round gathers its cohort',
  )
