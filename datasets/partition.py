"""Partitioners: split a pool of labelled examples among clients.

Each partitioner returns a ``Partition``: for every client the indices of its
examples in the pool (every example assigned at most once; the label-skew and
IID partitioners assign every example exactly once) and, where the partition
has one, the known group of each client. Transforms that change a client's
examples (rotations, label permutations, class re-indexing) are returned as a
``client_transform(i, x_i, y_i) -> (x_i, y_i)``.

All partitioners are deterministic for a given ``numpy.random.Generator``.
"""

import dataclasses
from typing import Callable, List, Optional

import numpy as np

from fedjax_personal.errors import ConfigError

__all__ = [
  'dirichlet',
  'iid',
  'label_permutation_groups',
  'latent_clusters',
  'Partition',
  'PARTITIONS',
  'pathological',
  'quantity_skew',
  'rotation_groups',
  'sparse_classes',
]


@dataclasses.dataclass
class Partition:
  """A split of an example pool among clients.

  Attributes:
    client_indices: list of N int arrays into the example pool.
    groups: optional int [N] known group per client.
    client_transform: optional ``(i, x_i, y_i) -> (x_i, y_i)``.
    num_classes: optional override of the task's number of classes (sparse
      classes with per-device re-indexing has c outputs).
  """

  client_indices: List[np.ndarray]
  groups: Optional[np.ndarray] = None
  client_transform: Optional[Callable] = None
  num_classes: Optional[int] = None

  @property
  def num_clients(self) -> int:
    return len(self.client_indices)

  def sizes(self) -> np.ndarray:
    return np.array([len(i) for i in self.client_indices])


def _check(num_examples: int, num_clients: int, min_size: int = 1):
  if num_clients < 1:
    raise ConfigError(
      'num_clients', f'num_clients must be >= 1, got {num_clients}'
    )
  if num_examples < num_clients * min_size:
    raise ConfigError(
      'num_clients',
      f'cannot give {num_clients} clients at least {min_size} example(s) each '
      f'from {num_examples} examples; lower num_clients',
    )


def _top_up(
  client_indices: List[np.ndarray], min_size: int, rng
) -> List[np.ndarray]:
  """Moves examples from the largest clients to those below ``min_size``.

  Deterministic, terminates in one pass (no resampling loop), and keeps every
  example assigned exactly once. Needs N * min_size <= total examples.
  """
  lists = [list(i) for i in client_indices]
  sizes = np.array([len(l) for l in lists])
  need = np.nonzero(sizes < min_size)[0]
  if need.size == 0:
    return [np.asarray(l, dtype=np.int64) for l in lists]
  for i in need:
    while len(lists[i]) < min_size:
      donor = int(np.argmax([len(l) for l in lists]))
      k = min(min_size - len(lists[i]), len(lists[donor]) - min_size)
      take = [
        lists[donor].pop(int(rng.integers(len(lists[donor])))) for _ in range(k)
      ]
      lists[i].extend(take)
  return [np.asarray(l, dtype=np.int64) for l in lists]


def iid(
  labels: np.ndarray, num_clients: int, rng: np.random.Generator
) -> Partition:
  """Shuffled examples dealt into equal shares.

  Args:
    labels: the pool's labels.
    num_clients: N.
    rng: the generator.

  Returns:
    The ``Partition``.
  """
  _check(len(labels), num_clients)
  return Partition(
    list(np.array_split(rng.permutation(len(labels)), num_clients))
  )


def dirichlet(
  labels: np.ndarray,
  num_clients: int,
  alpha: float,
  rng: np.random.Generator,
  min_size: int = 1,
) -> Partition:
  """Label skew: for every class c, the class's examples are divided among
  clients in proportions q_c ~ Dir(alpha * 1_N) (Hsu et al. 2019).

  Vectorized per class (cost O(num_examples + C * N)), so 10,000 clients with
  alpha = 0.01 take well under a second. Empty clients: instead of resampling
  until every client is large enough (which can loop for ever at small alpha),
  clients with fewer than ``min_size`` examples get examples moved from the
  largest clients; every example stays assigned exactly once.

  Args:
    labels: the pool's labels.
    num_clients: N.
    alpha: the concentration.
    rng: the generator.
    min_size: the fewest examples a client gets.

  Returns:
    The ``Partition``.
  """
  if not alpha > 0:
    raise ConfigError('alpha', f'dirichlet alpha must be > 0, got {alpha}')
  _check(len(labels), num_clients, min_size)
  owner = np.empty(len(labels), dtype=np.int64)
  for c in np.unique(labels):
    idx = np.nonzero(labels == c)[0]
    idx = idx[rng.permutation(len(idx))]
    q = rng.dirichlet(np.full(num_clients, alpha))
    # numerical guard at tiny alpha
    if not np.all(np.isfinite(q)) or q.sum() <= 0:
      q = np.zeros(num_clients)
      q[rng.integers(num_clients)] = 1.0
    # Cumulative split points: client j gets idx[cuts[j]:cuts[j+1]].
    cuts = np.concatenate(
      [[0], np.round(np.cumsum(q) / q.sum() * len(idx)).astype(np.int64)]
    )
    cuts[-1] = len(idx)
    owner[idx] = np.repeat(np.arange(num_clients), np.diff(cuts))
  order = np.argsort(owner, kind='stable')
  bounds = np.searchsorted(owner[order], np.arange(num_clients + 1))
  clients = [order[bounds[j] : bounds[j + 1]] for j in range(num_clients)]
  return Partition(_top_up(clients, min_size, rng))


def pathological(
  labels: np.ndarray,
  num_clients: int,
  classes_per_client: int,
  rng: np.random.Generator,
) -> Partition:
  """McMahan et al.'s shards: sort by label, cut into N * k shards, deal k
  random shards to every client (so each client sees about k classes).

  Args:
    labels: the pool's labels.
    num_clients: N.
    classes_per_client: k.
    rng: the generator.

  Returns:
    The ``Partition``.
  """
  num_classes = len(np.unique(labels))
  if not 1 <= classes_per_client <= num_classes:
    raise ConfigError(
      'classes_per_client',
      f'must be in [1, {num_classes}] (the classes of the '
      f'data), got {classes_per_client}',
    )
  _check(len(labels), num_clients * classes_per_client)
  order = np.lexsort((rng.random(len(labels)), labels))
  shards = np.array_split(order, num_clients * classes_per_client)
  deal = rng.permutation(len(shards)).reshape(num_clients, classes_per_client)
  return Partition([np.concatenate([shards[s] for s in row]) for row in deal])


def quantity_skew(
  labels: np.ndarray,
  num_clients: int,
  beta: float,
  rng: np.random.Generator,
  min_size: int = 1,
) -> Partition:
  """IID labels, client sizes in proportions ~ Dir(beta * 1_N).

  Args:
    labels: the pool's labels.
    num_clients: N.
    beta: the sizes' concentration.
    rng: the generator.
    min_size: the fewest examples a client gets.

  Returns:
    The ``Partition``.
  """
  if not beta > 0:
    raise ConfigError('alpha', f'quantity skew beta must be > 0, got {beta}')
  _check(len(labels), num_clients, min_size)
  q = rng.dirichlet(np.full(num_clients, beta))
  cuts = np.concatenate(
    [[0], np.round(np.cumsum(q) * len(labels)).astype(np.int64)]
  )
  cuts[-1] = len(labels)
  perm = rng.permutation(len(labels))
  return Partition(
    _top_up(
      [perm[cuts[j] : cuts[j + 1]] for j in range(num_clients)], min_size, rng
    )
  )


def _assign_groups(num_clients: int, num_groups: int) -> np.ndarray:
  if not 1 <= num_groups <= num_clients:
    raise ConfigError(
      'num_groups',
      f'num_groups must be in [1, num_clients={num_clients}], got {num_groups}',
    )
  return (np.arange(num_clients) * num_groups // num_clients).astype(np.int32)


def rotation_groups(
  labels: np.ndarray,
  num_clients: int,
  rng: np.random.Generator,
  num_groups: int = 4,
  base: Optional[Partition] = None,
) -> Partition:
  """Covariate shift: clients in ``num_groups`` groups, group g's images rotated
  by g * 360 / num_groups degrees (0/90/180/270 with 4 groups, as in the
  user-centric paper). Multiples of 90 degrees are exact (``np.rot90``).

  ``base`` is the partition of examples to rotate (IID by default; pass a
  Dirichlet one for label + covariate shift).

  Args:
    labels: the pool's labels.
    num_clients: N.
    rng: the generator.
    num_groups: G.
    base: the partition of examples (IID by default).

  Returns:
    The ``Partition`` (with each client's rotation).
  """
  base = base or iid(labels, num_clients, rng)
  groups = _assign_groups(num_clients, num_groups)
  if 360 % num_groups or (360 // num_groups) % 90:
    raise ConfigError(
      'num_groups',
      f'rotation groups need 360/num_groups to be a multiple of 90; '
      f'got num_groups={num_groups}',
    )

  def transform(i, x, y):
    k = int(groups[i]) * (360 // num_groups) // 90
    return np.rot90(x, k=k, axes=(1, 2)).copy(), y

  return Partition(base.client_indices, groups, transform)


def label_permutation_groups(
  labels: np.ndarray,
  num_clients: int,
  num_classes: int,
  rng: np.random.Generator,
  num_groups: int = 4,
  base: Optional[Partition] = None,
) -> Partition:
  """Concept shift: group g relabels class c as perm_g[c] (group 0 keeps the
  identity), as in the user-centric paper's CIFAR-10 experiment.

  Args:
    labels: the pool's labels.
    num_clients: N.
    num_classes: C.
    rng: the generator.
    num_groups: G.
    base: the partition of examples (IID by default).

  Returns:
    The ``Partition`` (with each client's label map).
  """
  base = base or iid(labels, num_clients, rng)
  groups = _assign_groups(num_clients, num_groups)
  perms = [np.arange(num_classes)] + [
    rng.permutation(num_classes) for _ in range(num_groups - 1)
  ]

  def transform(i, x, y):
    return x, perms[groups[i]][y].astype(y.dtype)

  return Partition(base.client_indices, groups, transform)


def sparse_classes(
  labels: np.ndarray,
  num_clients: int,
  num_classes: int,
  classes_per_client: int,
  rng: np.random.Generator,
  examples_per_client: Optional[int] = None,
  permute: bool = False,
) -> Partition:
  """Acar et al. (ICML 2021): device i holds classes {(i + j) mod C : j < c}.

  Each class's examples are shared without replacement among the devices that
  hold it, equally per device and class (``examples_per_client / c`` of each,
  default: as many as the data allows). With ``permute``, each device maps its
  c classes to indices 0..c-1 in a random order of its own (so class j means
  different things on different devices; the head has c outputs). Groups: the
  devices' class sets ((i mod C) identifies the set).

  Args:
    labels: the pool's labels.
    num_clients: N.
    num_classes: C.
    classes_per_client: c.
    rng: the generator.
    examples_per_client: examples per device (None: as many as the data allows).
    permute: map each device's classes to 0..c-1 in its own order.

  Returns:
    The ``Partition``.
  """
  c = classes_per_client
  if not 1 <= c <= num_classes:
    raise ConfigError(
      'classes_per_client',
      f'classes_per_client must be in [1, {num_classes}], got {c}',
    )
  _check(len(labels), num_clients)
  holders = [
    [i for i in range(num_clients) if (cls - i) % num_classes < c]
    for cls in range(num_classes)
  ]
  pools = [
    rng.permutation(np.nonzero(labels == cls)[0]) for cls in range(num_classes)
  ]
  per_class = min(
    len(pools[k]) // max(len(holders[k]), 1)
    for k in range(num_classes)
    if holders[k]
  )
  if examples_per_client is not None:
    want = examples_per_client // c
    if want > per_class:
      raise ConfigError(
        'examples_per_client',
        f'examples_per_client={examples_per_client} needs {want} examples per '
        f'class per device, the data allows {per_class}',
      )
    per_class = want
  if per_class < 1:
    raise ConfigError(
      'num_clients',
      'too many clients for sparse_classes: a class has fewer examples '
      'than devices holding it',
    )
  taken = [0] * num_classes
  clients = []
  for i in range(num_clients):
    idx = []
    for j in range(c):
      cls = (i + j) % num_classes
      idx.append(pools[cls][taken[cls] : taken[cls] + per_class])
      taken[cls] += per_class
    clients.append(np.concatenate(idx))
  groups = (np.arange(num_clients) % num_classes).astype(np.int32)
  if not permute:
    return Partition(clients, groups)
  maps = []
  for i in range(num_clients):
    m = -np.ones(num_classes, dtype=np.int64)
    m[[(i + j) % num_classes for j in range(c)]] = rng.permutation(c)
    maps.append(m)

  def transform(i, x, y):
    return x, maps[i][y].astype(y.dtype)

  # Every device has its own labelling: no two devices share a task.
  return Partition(
    clients, np.arange(num_clients, dtype=np.int32), transform, num_classes=c
  )


def latent_clusters(
  features: np.ndarray,
  num_clients: int,
  num_groups: int,
  rng: np.random.Generator,
) -> Partition:
  """Latent groups: k-means (k = num_groups) on the flattened features; the
  examples of cluster g are dealt among the clients of group g.

  Args:
    features: the pool's features (or embeddings).
    num_clients: N.
    num_groups: the clusters.
    rng: the generator.

  Returns:
    The ``Partition`` (groups: the clusters).
  """
  from sklearn.cluster import KMeans

  groups = _assign_groups(num_clients, num_groups)
  f = features.reshape(len(features), -1).astype(np.float32)
  km = KMeans(
    n_clusters=num_groups, n_init=3, random_state=int(rng.integers(2**31))
  )
  assign = km.fit_predict(f)
  clients = [np.zeros(0, np.int64)] * num_clients  # every client is in a group
  for g in range(num_groups):
    members = np.nonzero(groups == g)[0]
    idx = rng.permutation(np.nonzero(assign == g)[0])
    if len(idx) < len(members):
      raise ConfigError(
        'num_clients',
        f'latent cluster {g} has {len(idx)} examples for {len(members)} '
        f'clients',
      )
    for m, part in zip(members, np.array_split(idx, len(members))):
      clients[m] = part
  return Partition(clients, groups)


PARTITIONS = (
  'iid',
  'dirichlet',
  'pathological',
  'quantity_skew',
  'rotation',
  'label_permutation',
  'sparse_classes',
  'sparse_classes_permuted',
  'latent_clusters',
  'natural',
)
