"""Federated data as fixed-shape arrays.

Every client's examples are padded to a common length ``max_examples`` and come
with a count, so that a whole population is a handful of arrays with a leading
client axis. This is what lets one compiled round serve every cohort.
"""

import dataclasses
from typing import NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

__all__ = [
  'client_row',
  'client_splits',
  'ClientData',
  'FederatedData',
  'label_counts',
  'LocalData',
  'PackedClientData',
  'pad_clients',
  'permute_eval_targets',
  'split_client_examples',
  'to_device',
]


#: A split's arrays: on the host (numpy, as loaded) or on the device.
Array = Union[jax.Array, np.ndarray]


@struct.dataclass
class ClientData:
  """One split (train, validation or test) of all clients, padded.

  Attributes:
    x: inputs, shape [N, max_examples, ...]. Padded rows are zeros.
    y: targets, shape [N, max_examples, ...] (int labels, or token sequences).
    num_examples: int32 [N], how many leading rows of client i are real.
    source: one client of a packed cohort (``PackedClientData.client``):
      ``(x, y, start)`` of the packed split, its rows ``x[start + j]``
      being ``self.x[j]``. Batches are gathered from there directly
      (``training.get_batch``), so the client's window ``x`` is only made
      when something reads it whole. None otherwise.
  """

  x: Array
  y: Array
  num_examples: Array
  source: Optional[tuple] = None

  @property
  def num_clients(self) -> int:
    return self.x.shape[0]

  @property
  def max_examples(self) -> int:
    return self.x.shape[1]

  def client(self, i) -> 'ClientData':
    """Client i's data (x [max_examples, ...], y, num_examples scalar)."""
    return jax.tree.map(lambda a: a[i], self)


@struct.dataclass
class PackedClientData:
  """One split of a cohort, its clients' examples back to back.

  The host layout's cohorts: a round moves and holds the cohort's real
  examples, not every client padded to the largest.

  Client j's examples are rows ``offsets[j] .. offsets[j] + num_examples[j]``
  of ``x`` / ``y``; the ``length`` rows from ``offsets[j]`` always exist
  (the next clients' examples, then zeros), so ``client(j)`` is a window of
  static shape, read exactly as a padded client: rows past its count are
  masked wherever a client's data is used (batches, evaluation), never read
  as its own.

  Attributes:
    x: [capacity, ...]; y: [capacity, ...].
    num_examples: int32 [C].
    offsets: int32 [C], where each client's examples start.
    length: static; the window of one client (the ``max_examples`` of a
      padded split).
  """

  x: Array
  y: Array
  num_examples: Array
  offsets: Array
  length: int = struct.field(pytree_node=False, default=0)

  @property
  def num_clients(self) -> int:
    return self.num_examples.shape[0]

  @property
  def max_examples(self) -> int:
    return self.length

  def client(self, i) -> ClientData:
    """Client i's data as a padded client's (x [length, ...], y, count);
    ``i`` is clipped to the cohort, as a padded split's gather clips."""
    i = jnp.clip(i, 0, self.num_clients - 1)
    start = self.offsets[i]
    window = lambda a: jax.lax.dynamic_slice_in_dim(a, start, self.length, 0)
    return ClientData(
      x=window(self.x),
      y=window(self.y),
      num_examples=self.num_examples[i],
      source=(self.x, self.y, start),
    )


@struct.dataclass
class FederatedData:
  """A federated data set: per-client train / validation / test splits.

  All three splits are drawn from each client's own distribution.

  Attributes:
    train: training split of every client.
    val: validation split (may have max_examples 0 when unused).
    test: test split of every client.
    groups: int32 [N] known group of each client (rotation, permutation or
      latent cluster), or -1 when there is no known group structure.
    num_classes: number of output classes of the task (static).
    name: a short description (static).
    eval_only: how many clients at the end are evaluated and never trained
      (static; e.g. TFF's held-out CIFAR-100 test clients).
  """

  train: ClientData
  val: ClientData
  test: ClientData
  groups: Array
  num_classes: int = struct.field(pytree_node=False)
  name: str = struct.field(pytree_node=False, default='')
  eval_only: int = struct.field(pytree_node=False, default=0)

  @property
  def num_clients(self) -> int:
    return self.train.num_clients

  @property
  def num_trained(self) -> int:
    """Clients a round may sample: all but the ``eval_only`` last."""
    return self.num_clients - self.eval_only

  @property
  def num_groups(self) -> int:
    g = np.asarray(self.groups)
    return int(g.max()) + 1 if g.size and g.max() >= 0 else 0

  def label_skew(self) -> Optional[float]:
    """Mean over clients of the L1 distance between the client's training
    label distribution and the pooled one, sum_c |p_i(c) - p(c)| in [0, 2]
    (the "EMD" of Zhao et al., 2018, Federated learning with non-IID data);
    None for targets that are not one class per example."""
    y, n = np.asarray(self.train.y), np.asarray(self.train.num_examples)
    if y.ndim != 2 or not np.issubdtype(y.dtype, np.integer):
      return None
    counts = np.stack(
      [
        # padding at the end
        np.bincount(y[i, : n[i]], minlength=self.num_classes)
        for i in range(len(y))
      ]
    ).astype(np.float64)
    local = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    pooled = counts.sum(0) / max(counts.sum(), 1)
    return float(np.abs(local - pooled).sum(1)[n > 0].mean())

  def describe(self) -> str:
    n = np.asarray(self.train.num_examples)
    return (
      f'{self.name}: {self.num_clients} clients, {self.num_classes} classes, '
      f'train examples per client min {n.min()} median {int(np.median(n))} '
      f'max {n.max()} (total {n.sum()}), test total '
      f'{int(np.asarray(self.test.num_examples).sum())}'
    )


@struct.dataclass
class LocalData:
  """What a client may train on: its own train and validation splits."""

  train: ClientData
  val: ClientData


def label_counts(train: ClientData, num_classes: int) -> jax.Array:
  """One client's examples per class: float32 [num_classes] over its real
  rows (those below ``num_examples``), for one integer label per example.

  Args:
    train: one client's split (``y`` [max_examples], ``num_examples``).
    num_classes: C.

  Returns:
    The counts.
  """
  y = jnp.asarray(train.y)
  real = jnp.arange(y.shape[0]) < train.num_examples
  return (
    jnp.zeros(num_classes, jnp.float32)
    .at[y]
    .add(real.astype(jnp.float32), mode='drop')
  )


def client_row(tree, i):
  """Client i's data from a split: a padded split's row, or a packed
  cohort's window (``PackedClientData.client``).

  Args:
    tree: a split (``ClientData`` or ``PackedClientData``).
    i: the client's row (traced int).

  Returns:
    That client's ``ClientData``.
  """
  if isinstance(tree, PackedClientData):
    return tree.client(i)
  return jax.tree.map(lambda a: a.at[i].get(mode='clip'), tree)


def pad_clients(
  xs: Sequence[np.ndarray],
  ys: Sequence[np.ndarray],
  x_shape,
  x_dtype,
  y_shape=(),
  y_dtype=np.int32,
  max_examples: Optional[int] = None,
) -> ClientData:
  """Stacks per-client arrays into one padded ClientData (host numpy).

  Args:
    xs: each client's examples.
    ys: each client's targets.
    x_shape: one example's shape.
    x_dtype: the examples' dtype.
    y_shape: one target's shape.
    y_dtype: the targets' dtype.
    max_examples: the padded length (None: the largest client's).

  Returns:
    A ``ClientData`` [N, max_examples, ...] with each client's count.
  """
  n = np.array([len(x) for x in xs], dtype=np.int32)
  m = int(n.max()) if max_examples is None else max_examples
  m = max(m, 0)
  xp = np.zeros((len(xs), m) + tuple(x_shape), dtype=x_dtype)
  yp = np.zeros((len(xs), m) + tuple(y_shape), dtype=y_dtype)
  for i, (x, y) in enumerate(zip(xs, ys)):
    xp[i, : len(x)] = x
    yp[i, : len(y)] = y
  return ClientData(x=xp, y=yp, num_examples=n)


class ExampleSplits(NamedTuple):
  """One client's examples split: index arrays into them."""

  train: np.ndarray
  val: np.ndarray
  test: np.ndarray


def split_client_examples(
  num_examples: int,
  rng: np.random.Generator,
  test_fraction: float,
  val_fraction: float,
) -> ExampleSplits:
  """Shuffles one client's examples and splits them into train/val/test.

  Rounding keeps at least one training example when the client has any, and
  gives a test example to every client with at least two examples (so that a
  per-client test accuracy exists).

  Args:
    num_examples: the client's examples.
    rng: draws the shuffle.
    test_fraction: the test share.
    val_fraction: the validation share.

  Returns:
    The ``ExampleSplits``: index arrays into the client's examples.
  """
  perm = rng.permutation(num_examples)
  n_test = int(round(test_fraction * num_examples))
  if test_fraction > 0 and num_examples >= 2:
    n_test = max(n_test, 1)
  n_val = int(round(val_fraction * num_examples))
  if val_fraction > 0 and num_examples - n_test >= 2:
    n_val = max(n_val, 1)
  n_test = min(n_test, max(num_examples - 1, 0))
  n_val = min(n_val, max(num_examples - n_test - 1, 0))
  test = perm[:n_test]
  val = perm[n_test : n_test + n_val]
  train = perm[n_test + n_val :]
  return ExampleSplits(train, val, test)


def client_splits(
  x: np.ndarray,
  y: np.ndarray,
  client_indices: Sequence[np.ndarray],
  rng: np.random.Generator,
  test_fraction: float = 0.2,
  val_fraction: float = 0.0,
  client_transform=None,
) -> dict:
  """Each client's train / val / test examples of a pool, unpadded:
  ``{split: ([x_i], [y_i])}`` (the population store is made from these
  without padding; ``pad_clients`` pads them).

  Args:
    x: the pool's examples.
    y: the pool's targets.
    client_indices: each client's indices into the pool.
    rng: draws each client's split.
    test_fraction: each client's test share.
    val_fraction: each client's validation share.
    client_transform: ``(i, x) -> x`` applied to client i's examples (a
      rotation), or None.

  Returns:
    ``{split: ([x_i], [y_i])}`` for the splits train, val and test.
  """
  splits: dict = {'train': ([], []), 'val': ([], []), 'test': ([], [])}
  for i, idx in enumerate(client_indices):
    idx = np.asarray(idx, dtype=np.int64)
    xi, yi = x[idx], y[idx]
    if client_transform is not None:
      xi, yi = client_transform(i, xi, yi)
    tr, va, te = split_client_examples(
      len(idx), rng, test_fraction, val_fraction
    )
    for key, part in (('train', tr), ('val', va), ('test', te)):
      splits[key][0].append(xi[part])
      splits[key][1].append(yi[part])
  return splits


def to_device(data: FederatedData) -> FederatedData:
  """``data`` with every array on the default device (``jnp.asarray``).

  Args:
    data: a ``FederatedData`` of numpy arrays.

  Returns:
    The same, on the device.
  """
  return jax.tree.map(jnp.asarray, data)


def permute_eval_targets(data: FederatedData, perm) -> FederatedData:
  """Client i's validation and test splits become client perm[i]'s, so that
  targets differ from the local training distribution (FedFomo, Sec. 5).

  Args:
    data: the ``FederatedData``.
    perm: a permutation of the clients.

  Returns:
    The data with permuted validation and test splits.
  """
  perm = np.asarray(perm)
  take = lambda d: jax.tree.map(lambda a: a[perm], d)
  return dataclasses.replace(data, val=take(data.val), test=take(data.test))
