"""A population's clients on the host, unpadded: ``PopulationStore``.

Every client's train / val / test examples back to back per split (arrays
read by row slices: in memory, or ``store.FileArray`` files on disk), the
per-client counts and offsets, the groups, each client's id, and what
builders and the engine may know without the examples (``Population``).
``core/population/store.py`` writes and opens the on-disk form.
"""

import collections
import dataclasses
import hashlib
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import numpy as np

from fedjax_personal.core.data import (
  ClientData,
  FederatedData,
  PackedClientData,
)
from fedjax_personal.errors import DataError

__all__ = [
  'aligned_empty',
  'FORMAT',
  'next_power_of_two',
  'padded_length',
  'Population',
  'PopulationStore',
  'SPLITS',
]


# /2: per-block CRC32s; /3: client ids, eval_only
FORMAT = 'fedjax_personal.population/3'
SPLITS = ('train', 'val', 'test')


def next_power_of_two(n) -> np.ndarray:
  """The least power of two >= each of ``n`` (at least 1), int64.

  Args:
    n: ints.

  Returns:
    int64 powers of two.
  """
  n = np.maximum(np.asarray(n, np.int64), 1)
  return (2 ** np.ceil(np.log2(n))).astype(np.int64)


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
  """``np.empty`` whose data starts on an ``align``-byte boundary: XLA:CPU
  then takes the host array as it is (``jax.device_put`` without a copy:
  a cohort of packed examples reaches the round at no cost).

  Args:
    shape: the shape.
    dtype: the dtype.
    align: the alignment in bytes.

  Returns:
    The array (uninitialised).
  """
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape)) * dtype.itemsize
  buf = np.empty(nbytes + align, np.uint8)
  start = (-buf.ctypes.data) % align
  return buf[start : start + nbytes].view(dtype).reshape(shape)


def padded_length(
  count: int, cap: Optional[int] = None, smallest: int = 32
) -> int:
  """The static length a cohort whose largest client has ``count`` examples
  is padded to: the next power of two >= count (at least ``smallest``), at
  most ``cap``; powers of two keep the number of compiled shapes to a few.

  Args:
    count: the largest client's examples.
    cap: ``--max_client_examples`` (None: none).
    smallest: the shortest length.

  Returns:
    The length.
  """
  length = max(smallest, int(next_power_of_two(count)))
  return length if cap is None else int(min(length, max(cap, 1)))


@dataclasses.dataclass(frozen=True)
class SplitCounts:
  """A split of a population without its examples.

  The clients' example counts ([N] int32, ``ClientData.num_examples``)."""

  num_examples: np.ndarray

  @property
  def max_examples(self) -> int:
    """The widest client's examples: the padded split's width."""
    return int(self.num_examples.max(initial=0))


@dataclasses.dataclass
class Population:
  """What may be known of a population without its examples.

  What builders and the engine may know of a population without its
  examples: per split the example counts ([N] int32, after the cap), the
  groups, the classes, one input example (model shapes).

  It stands where builders take a ``FederatedData`` (``data.num_clients``,
  ``data.train.num_examples``, ``data.groups``...).
  """

  train: 'SplitCounts'
  val: 'SplitCounts'
  test: 'SplitCounts'
  groups: np.ndarray
  num_classes: int
  name: str
  sample_x: np.ndarray
  eval_only: int = 0

  @property
  def num_clients(self) -> int:
    return len(self.groups)

  @property
  def num_trained(self) -> int:
    """Clients a round may sample: all but the ``eval_only`` last."""
    return self.num_clients - self.eval_only

  @property
  def num_groups(self) -> int:
    return (
      int(self.groups.max()) + 1
      if self.groups.size and self.groups.max() >= 0
      else 0
    )

  def describe(self) -> str:
    n = self.train.num_examples
    return (
      f'{self.name}: {self.num_clients:,} clients, {self.num_classes} classes, '
      f'train examples per client min {n.min()} median {int(np.median(n))} '
      f'max {n.max()} (total {int(n.sum()):,}), test total '
      f'{int(self.test.num_examples.sum()):,}'
    )


class CohortRead(NamedTuple):
  """What a gather of clients reads from a split's arrays.

  Attributes:
    x: the split's inputs, every client's back to back.
    y: its targets.
    counts: int32, the clients' counts (capped at ``cap`` on the training
      split and at ``length``; 0 past the last client with ``clip``).
    starts: where each client's examples start in ``x`` and ``y``.
    ydtype: the targets' dtype as gathered (integers as int32).
  """

  x: Any
  y: Any
  counts: np.ndarray
  starts: np.ndarray
  ydtype: Any


class PopulationStore:
  """Every client's train / val / test examples, unpadded (see module doc).

  Args:
    arrays: {split: (x [total, ...], y [total, ...], counts [N])}.
    groups: int32 [N].
    manifest: the store's manifest (name, num_classes, identity, digest).
    folder: where it is on disk (None in memory).
    client_ids: each client's id (None: its index).
  """

  def __init__(
    self,
    arrays: Dict[str, tuple],
    groups,
    manifest: dict,
    folder=None,
    client_ids: Optional[List[str]] = None,
  ):
    self.arrays = arrays
    self.groups = np.asarray(groups, np.int32)
    self.manifest = manifest
    self.folder = folder
    self.counts = {s: np.asarray(arrays[s][2], np.int64) for s in SPLITS}
    self.offsets = {
      s: np.concatenate([[0], np.cumsum(c)]) for s, c in self.counts.items()
    }
    self._ids = client_ids
    self._index: Optional[Dict[str, int]] = None

  @property
  def num_clients(self) -> int:
    return len(self.groups)

  @property
  def eval_only(self) -> int:
    """How many clients at the end are evaluated and never trained."""
    return int(self.manifest.get('eval_only', 0))

  @property
  def num_trained(self) -> int:
    """Clients a round may sample: all but the ``eval_only`` last."""
    return self.num_clients - self.eval_only

  @property
  def client_ids(self) -> List[str]:
    """Each client's id as its source names it (row i is client i); a
    partitioned pool's clients are named by their index."""
    if self._ids is None:
      self._ids = [str(i) for i in range(self.num_clients)]
    return self._ids

  def client_index(self, client_id) -> int:
    """The row of the client named ``client_id``.

    Raises:
      DataError: no client has that id.
    """
    if self._index is None:
      self._index = {c: i for i, c in enumerate(self.client_ids)}
    try:
      return self._index[str(client_id)]
    except KeyError:
      where = self.folder or self.name
      raise DataError(
        f'{where}: no client has id {client_id!r} ({self.num_clients:,} '
        f'clients, '
        f'e.g. {self.client_ids[0]!r})'
      ) from None

  def client(self, client_id) -> Dict[str, tuple]:
    """One client's examples by id: {split: (x, y)} as numpy arrays."""
    i = self.client_index(client_id)
    out = {}
    for s in SPLITS:
      x, y, _ = self.arrays[s]
      lo = int(self.offsets[s][i])
      hi = lo + int(self.counts[s][i])
      out[s] = (np.asarray(x[lo:hi]), np.asarray(y[lo:hi]))
    return out

  def subset(
    self, client_ids: Sequence[str], why: str = 'chosen by id'
  ) -> 'PopulationStore':
    """The clients named ``client_ids`` alone, in the store's order (a
    view: the same files, their counts and offsets selected). Its digest
    and name say which clients it holds.

    Raises:
      DataError: an id no client has, or one given twice.
    """
    listed = [self.client_index(c) for c in client_ids]
    if len(set(listed)) != len(listed):
      twice = next(
        c for c, k in collections.Counter(map(str, client_ids)).items() if k > 1
      )
      raise DataError(f'client id {twice!r} is given twice')
    rows = np.sort(np.asarray(listed, np.int64))
    h = hashlib.sha256(self.digest.encode())
    h.update(rows.tobytes())
    held_out = int(np.sum(rows >= self.num_clients - self.eval_only))
    manifest = {
      **self.manifest,
      'digest': h.hexdigest()[:16],
      'eval_only': held_out,
      'name': f'{self.name}, {len(rows):,} clients {why}',
    }
    sub = PopulationStore(
      self.arrays,
      self.groups[rows],
      manifest,
      self.folder,
      [self.client_ids[i] for i in rows],
    )
    sub.counts = {s: c[rows] for s, c in self.counts.items()}
    # starts (ends: + counts)
    sub.offsets = {s: o[rows] for s, o in self.offsets.items()}
    return sub

  @property
  def num_classes(self) -> int:
    return int(self.manifest['num_classes'])

  @property
  def name(self) -> str:
    return self.manifest['name']

  @property
  def digest(self) -> str:
    return self.manifest['digest']

  def x_spec(self):
    x = self.arrays['train'][0]
    return x.shape[1:], x.dtype

  def y_spec(self):
    y = self.arrays['train'][1]
    return y.shape[1:], y.dtype

  def nbytes(self) -> int:
    return int(sum(a.nbytes for s in SPLITS for a in self.arrays[s][:2]))

  def counts_capped(self, split: str, cap: Optional[int] = None) -> np.ndarray:
    c = self.counts[split]
    return (
      c if cap is None or split != 'train' else np.minimum(c, cap)
    ).astype(np.int32)

  def population(self, cap: Optional[int] = None) -> Population:
    """The store's ``Population`` (training counts capped at ``cap``)."""
    splits = {
      s: SplitCounts(num_examples=self.counts_capped(s, cap)) for s in SPLITS
    }
    x = self.arrays['train'][0]
    return Population(
      **splits,
      groups=self.groups,
      num_classes=self.num_classes,
      name=self.name,
      sample_x=np.zeros((1,) + x.shape[1:], x.dtype),
      eval_only=self.eval_only,
    )

  def check_clients(self, idx) -> None:
    idx = np.asarray(idx)
    bad = idx[(idx < 0) | (idx >= self.num_clients)]
    if bad.size:
      where = self.folder or 'the in-memory store'
      raise DataError(
        f'{where}: client {int(bad[0])} is not in the store '
        f'({self.num_clients:,} clients, 0..{self.num_clients - 1})'
      )

  def _cohort(
    self, split: str, idx, length: int, cap: Optional[int], clip: bool
  ) -> 'CohortRead':
    """What ``gather`` and ``gather_packed`` read (``CohortRead``)."""
    idx = np.asarray(idx, np.int64)
    empty = np.zeros(len(idx), bool)
    if clip:
      empty = idx >= self.num_clients
      idx = np.where(empty, 0, idx)
    self.check_clients(idx)
    x, y, _ = self.arrays[split]
    # the gathered clients' counts alone (not all N capped)
    n = self.counts[split][idx]
    if cap is not None and split == 'train':
      n = np.minimum(n, cap)
    n = np.where(empty, 0, np.minimum(n, length)).astype(np.int32)
    ydtype = np.int32 if np.issubdtype(y.dtype, np.integer) else y.dtype
    return CohortRead(x, y, n, self.offsets[split][idx], ydtype)

  def gather(
    self,
    split: str,
    idx,
    length: int,
    cap: Optional[int] = None,
    clip: bool = False,
  ) -> ClientData:
    """Clients ``idx``'s ``split`` padded to ``length`` rows (host numpy).

    A client keeps its first ``min(n, cap, length)`` examples (``cap``
    applies to the training split: TFF's ``max_elements``); padded rows are
    zeros. With ``clip`` an index past the last client (a sampler's padded
    cohort slot) reads as an empty client; otherwise it is an error. The
    arrays are 64-byte aligned (``aligned_empty``).
    """
    x, y, n, starts, ydtype = self._cohort(split, idx, length, cap, clip)
    xp = aligned_empty((len(n), length) + x.shape[1:], x.dtype)
    yp = aligned_empty((len(n), length) + y.shape[1:], ydtype)
    for j, (s, k) in enumerate(zip(starts, n)):
      # nothing read for an empty client (or a split gathered at length 0)
      if k:
        xp[j, :k] = x[s : s + k]
        yp[j, :k] = y[s : s + k]
      xp[j, k:] = 0
      yp[j, k:] = 0
    return ClientData(x=xp, y=yp, num_examples=n)

  def gather_packed(
    self,
    split: str,
    idx,
    length: int,
    cap: Optional[int] = None,
    smallest: int = 32,
  ) -> PackedClientData:
    """Clients ``idx``'s ``split`` packed back to back (host numpy): as
    ``gather(..., clip=True)`` gives them, without the padding. The
    ``length`` rows after the last client are zeros (the last windows read
    them); the total is a power of two (at least ``smallest``; rows past the
    zeros are never read) so that cohorts share a few compiled shapes."""
    x, y, n, starts, ydtype = self._cohort(split, idx, length, cap, clip=True)
    offsets = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int32)
    total = int(n.sum())
    capacity = (
      int(next_power_of_two(max(smallest, total + length))) if length else 0
    )
    xp = aligned_empty((capacity,) + x.shape[1:], x.dtype)
    yp = aligned_empty((capacity,) + y.shape[1:], ydtype)
    xp[total : total + length] = (
      0  # what the last windows read past the examples; rows after
    )
    yp[total : total + length] = 0  # them are never read (left as they are)
    for s, o, k in zip(starts, offsets, n):
      xp[o : o + k] = x[s : s + k]
      yp[o : o + k] = y[s : s + k]
    return PackedClientData(
      x=xp, y=yp, num_examples=n, offsets=offsets, length=int(length)
    )

  def padded(self, cap: Optional[int] = None) -> FederatedData:
    """The whole population padded to its largest client (the device
    layout), host numpy; training splits capped at ``cap``."""
    out = {}
    every = np.arange(self.num_clients)
    for s in SPLITS:
      length = int(self.counts_capped(s, cap).max(initial=0))
      out[s] = self.gather(s, every, length, cap)
    return FederatedData(
      **out,
      groups=self.groups,
      num_classes=self.num_classes,
      name=self.name,
      eval_only=self.eval_only,
    )

  def padded_nbytes(self, cap: Optional[int] = None) -> int:
    """Bytes of ``padded(cap)``: what the device layout would hold."""
    total = 0
    for s in SPLITS:
      x, y, _ = self.arrays[s]
      length = int(self.counts_capped(s, cap).max(initial=0))
      row = int(np.prod(x.shape[1:])) * x.dtype.itemsize + int(
        np.prod(y.shape[1:])
      ) * max(y.dtype.itemsize, 4)
      total += self.num_clients * length * row
    return total

  @staticmethod
  def from_clients(
    splits: dict,
    groups,
    num_classes: int,
    name: str,
    x_spec: tuple,
    y_shape: tuple = (),
    client_ids: Optional[List[str]] = None,
  ) -> 'PopulationStore':
    """An in-memory store of per-client examples, unpadded: ``splits`` is
    ``{split: ([x_i], [y_i])}`` (``core.data.client_splits``); x is kept in
    ``x_spec``'s (shape, dtype), y as int32; ``client_ids`` their ids (None:
    their indices). Its digest is that of ``from_federated`` of the same
    clients padded."""
    x_shape, x_dtype = x_spec
    arrays = {}
    h = hashlib.sha256()
    for s in SPLITS:
      xs, ys = splits[s]
      n = np.asarray([len(a) for a in xs], np.int32)
      xa = (
        np.concatenate([np.asarray(a, x_dtype) for a in xs])
        if n.sum()
        else np.zeros((0,) + tuple(x_shape), x_dtype)
      )
      ya = (
        np.concatenate([np.asarray(a, np.int32) for a in ys])
        if n.sum()
        else np.zeros((0,) + tuple(y_shape), np.int32)
      )
      arrays[s] = (xa, ya, n)
      for a in (xa, ya, n):
        h.update(np.ascontiguousarray(a).tobytes())
    manifest = {
      'format': FORMAT,
      'name': name,
      'num_classes': int(num_classes),
      'identity': {},
      'digest': h.hexdigest()[:16],
      'eval_only': 0,
    }
    return PopulationStore(
      arrays, np.asarray(groups, np.int32), manifest, client_ids=client_ids
    )

  @staticmethod
  def from_federated(data: FederatedData) -> 'PopulationStore':
    """An in-memory store of a padded FederatedData (its real rows)."""
    arrays = {}
    h = hashlib.sha256()
    for s in SPLITS:
      d = getattr(data, s)
      n = np.asarray(d.num_examples)
      x, y = np.asarray(d.x), np.asarray(d.y)
      keep = (np.arange(x.shape[1])[None, :] < n[:, None]).reshape(-1)
      xs = x.reshape((-1,) + x.shape[2:])[keep]
      ys = y.reshape((-1,) + y.shape[2:])[keep]
      arrays[s] = (xs, ys, n)
      for a in (xs, ys, n):
        h.update(np.ascontiguousarray(a).tobytes())
    manifest = {
      'format': FORMAT,
      'name': data.name,
      'num_classes': int(data.num_classes),
      'identity': {},
      'digest': h.hexdigest()[:16],
      'eval_only': int(data.eval_only),
    }
    return PopulationStore(arrays, np.asarray(data.groups), manifest)
