"""Server-side clustering as tensor code, traced into the compiled round.

k-means (k-means++ seeding, Lloyd iterations, restarts), the silhouette
score and its choice of k, complete-linkage bipartition and the adjusted
Rand index, on fixed shapes: the number of clusters k may be a traced
value, centroids are padded to a static maximum K with the rows >= k
masked, so a round that clusters compiles once whatever k it picks.
scikit-learn is the test oracle (tests/test_clustering.py): on the same data
the inertia of ``kmeans`` is no worse than scikit-learn's ``KMeans`` (same
restarts), ``silhouette_score`` equals ``sklearn.metrics.silhouette_score``,
``bipartition`` gives ``AgglomerativeClustering(linkage='complete')``'s
partition and ``adjusted_rand_index`` its ARI.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  'adjusted_rand_index',
  'assign',
  'Assignment',
  'bipartition',
  'distances',
  'in_group_chance',
  'in_group_share',
  'kmeans',
  'KMeansResult',
  'silhouette_kmeans',
  'silhouette_score',
]


def sq_distances(x: jax.Array, c: jax.Array) -> jax.Array:
  """Squared Euclidean distances [N, K] between rows of x [N, D] and c [K, D]
  (one matmul; clamped at 0 against rounding)."""
  d = jnp.sum(x * x, 1)[:, None] - 2 * x @ c.T + jnp.sum(c * c, 1)[None, :]
  return jnp.maximum(d, 0.0)


def distances(x: jax.Array) -> jax.Array:
  """Euclidean distances [N, N] between the rows of x (zero diagonal).

  Args:
    x: points [N, d].

  Returns:
    [N, N].
  """
  d = jnp.sqrt(sq_distances(x, x))
  return d * (1 - jnp.eye(x.shape[0], dtype=d.dtype))


def kmeans_plusplus(
  key: jax.Array, x: jax.Array, k: Any, max_k: int, trials: int
) -> jax.Array:
  """Greedy k-means++ seeding (Arthur and Vassilvitskii 2007; scikit-learn's
  variant: at each step ``trials`` candidates drawn with probability
  proportional to D(x)^2, keep the one that most lowers the potential).

  Returns centroids [max_k, D]; rows >= k are zeros (unused).
  """
  n = x.shape[0]
  k_first, key = jax.random.split(key)
  first = jax.random.randint(k_first, (), 0, n)
  centroids = jnp.zeros((max_k, x.shape[1]), x.dtype).at[0].set(x[first])
  d2 = sq_distances(x, x[first][None])[:, 0]

  def body(j, carry):
    centroids, d2 = carry
    sub = jax.random.fold_in(key, j)
    total = jnp.sum(d2)
    logits = jnp.where(total > 0, jnp.log(jnp.where(d2 > 0, d2, 1.0)), 0.0)
    logits = jnp.where((total > 0) & (d2 <= 0), -jnp.inf, logits)
    cand = jax.random.categorical(sub, logits, shape=(trials,))
    dc = sq_distances(x[cand], x).T  # [N, trials]
    potential = jnp.sum(jnp.minimum(d2[:, None], dc), axis=0)
    best = jnp.argmin(potential)
    use = j < k
    centroids = jnp.where(use, centroids.at[j].set(x[cand[best]]), centroids)
    d2 = jnp.where(use, jnp.minimum(d2, dc[:, best]), d2)
    return centroids, d2

  centroids, _ = jax.lax.fori_loop(1, max_k, body, (centroids, d2))
  return centroids


class Assignment(NamedTuple):
  """Each point's nearest centroid.

  Attributes:
    labels: int32 [N], the nearest of the centroids in use.
    distances: [N], the squared distance to it.
  """

  labels: jax.Array
  distances: jax.Array


def assign(x: jax.Array, centroids: jax.Array, k: Any) -> Assignment:
  """Each point's nearest of the first k centroids.

  Args:
    x: points [N, d].
    centroids: centroids [K, d].
    k: the centroids in use (traced).

  Returns:
    The ``Assignment`` (labels and squared distances, [N] each).
  """
  d = sq_distances(x, centroids)
  d = jnp.where(jnp.arange(centroids.shape[0])[None, :] < k, d, jnp.inf)
  return Assignment(jnp.argmin(d, axis=1).astype(jnp.int32), jnp.min(d, axis=1))


class KMeansResult(NamedTuple):
  """What ``kmeans`` finds.

  Attributes:
    centroids: [max_k, D]; rows >= k unused.
    labels: int32 [N], each point's cluster.
    inertia: the sum of squared distances to the assigned centroids.
    k: int32, the number of clusters asked for.
  """

  centroids: jax.Array
  labels: jax.Array
  inertia: jax.Array
  k: jax.Array


def lloyd(
  x: jax.Array,
  centroids: jax.Array,
  k: Any,
  max_iter: int = 300,
  tol: float = 1e-4,
) -> 'KMeansResult':
  """Lloyd iterations from ``centroids`` [max_k, D] (first k used) until the
  total squared centre shift is <= tol * mean feature variance (scikit-learn's
  rule) or ``max_iter``. An empty cluster keeps its centre.

  Returns:
    The ``KMeansResult``.
  """
  max_k = centroids.shape[0]
  threshold = tol * jnp.mean(jnp.var(x, axis=0))

  def step(c):
    labels = assign(x, c, k).labels
    one_hot = jax.nn.one_hot(labels, max_k, dtype=x.dtype)  # [N, K]
    count = one_hot.sum(0)
    new = (one_hot.T @ x) / jnp.maximum(count, 1)[:, None]
    return jnp.where((count > 0)[:, None], new, c)

  def cond(carry):
    i, _, shift = carry
    return (i < max_iter) & (shift > threshold)

  def body(carry):
    i, c, _ = carry
    new = step(c)
    return i + 1, new, jnp.sum((new - c) ** 2)

  _, centroids, _ = jax.lax.while_loop(
    cond, body, (0, centroids, jnp.asarray(jnp.inf, x.dtype))
  )
  nearest = assign(x, centroids, k)
  return KMeansResult(
    centroids,
    nearest.labels,
    jnp.sum(nearest.distances),
    jnp.asarray(k, jnp.int32),
  )


def kmeans(
  key: jax.Array,
  x: jax.Array,
  k: Any,
  max_k: int,
  restarts: int = 10,
  max_iter: int = 300,
  tol: float = 1e-4,
) -> KMeansResult:
  """k-means with ``restarts`` k-means++ seedings (vmapped), keeping the
  lowest inertia (scikit-learn's ``KMeans(k, n_init=restarts)``).

  Args:
    key: draws the seedings.
    x: points [N, d].
    k: clusters (traced).
    max_k: the largest k (static shapes).
    restarts: seedings tried.
    max_iter: Lloyd iterations at most.
    tol: stop when the inertia improves less.

  Returns:
    The best restart's ``KMeansResult``.
  """
  x = jnp.asarray(x, jnp.float32)
  trials = 2 + int(math.log(max(max_k, 1)))

  def one(key):
    return lloyd(x, kmeans_plusplus(key, x, k, max_k, trials), k, max_iter, tol)

  tried = jax.vmap(one)(jax.random.split(key, restarts))
  best = jnp.argmin(tried.inertia)
  return jax.tree.map(lambda a: a[best], tried)


def silhouette_score(
  dist: jax.Array, labels: jax.Array, max_k: int
) -> jax.Array:
  """Mean silhouette coefficient (Rousseeuw 1987) from distances [N, N] and
  labels in [0, max_k): a_i the mean distance to the other members of i's
  cluster, b_i the smallest mean distance to another non-empty cluster,
  s_i = (b_i - a_i) / max(a_i, b_i), and s_i = 0 in a singleton cluster
  (scikit-learn's convention). -inf when fewer than 2 clusters are non-empty.

  Args:
    dist: distances [N, N].
    labels: cluster labels [N].
    max_k: the most clusters (static shapes).

  Returns:
    The mean silhouette.
  """
  one_hot = jax.nn.one_hot(labels, max_k, dtype=dist.dtype)  # [N, K]
  count = one_hot.sum(0)
  sums = dist @ one_hot  # [N, K]: distance of i to all members of each cluster
  own = count[labels]
  a = jnp.sum(sums * one_hot, 1) / jnp.maximum(own - 1, 1)
  means = sums / jnp.maximum(count, 1)[None, :]
  other = jnp.where((count[None, :] > 0) & (one_hot == 0), means, jnp.inf)
  b = jnp.min(other, 1)
  denom = jnp.maximum(a, b)
  s = jnp.where(
    (own > 1) & (denom > 0), (b - a) / jnp.where(denom > 0, denom, 1.0), 0.0
  )
  return jnp.where(jnp.sum(count > 0) >= 2, jnp.mean(s), -jnp.inf)


def silhouette_kmeans(
  key: jax.Array,
  x: jax.Array,
  max_k: int,
  restarts: int = 10,
  max_iter: int = 300,
  tol: float = 1e-4,
) -> KMeansResult:
  """k-means for every k in 2..max_k, keeping the k of the best silhouette
  (the smallest k on ties); k = 1 (the mean) when every row is the same or no
  k gives two non-empty clusters. Centroids are padded to max_k rows (at
  least 1). One loop over k inside the trace, so the compiled function does
  not depend on the k it picks.

  Args:
    key: draws the seedings.
    x: points [N, d].
    max_k: the largest k tried.
    restarts: seedings per k.
    max_iter: Lloyd iterations at most.
    tol: stop when the inertia improves less.

  Returns:
    ``(labels [N], k, silhouette)``.
  """
  x = jnp.asarray(x, jnp.float32)
  n = x.shape[0]
  max_k = max(int(max_k), 1)
  mean = jnp.zeros((max_k, x.shape[1]), x.dtype).at[0].set(jnp.mean(x, 0))
  single = KMeansResult(
    mean,
    jnp.zeros(n, jnp.int32),
    jnp.sum((x - x.mean(0)) ** 2),
    jnp.asarray(1, jnp.int32),
  )
  if max_k < 2:
    return single
  dist = distances(x)

  def body(k, carry):
    best, score = carry
    r = kmeans(jax.random.fold_in(key, k), x, k, max_k, restarts, max_iter, tol)
    s = silhouette_score(dist, r.labels, max_k)
    better = s > score
    return jax.tree.map(
      lambda a, b: jnp.where(better, a, b), r, best
    ), jnp.maximum(s, score)

  best, score = jax.lax.fori_loop(
    2, max_k + 1, body, (single, jnp.asarray(-jnp.inf))
  )
  same = jnp.all(jnp.abs(x - x[:1]) <= 1e-8 + 1e-5 * jnp.abs(x[:1]))
  use_single = same | ~jnp.isfinite(score)
  return jax.tree.map(lambda a, b: jnp.where(use_single, a, b), single, best)


def bipartition(dist: jax.Array, member: jax.Array) -> Any:
  """Complete-linkage agglomerative clustering of the ``member`` rows into
  two clusters (Sattler et al.'s optimal bipartition of the cosine
  similarity structure, computed as scikit-learn's
  ``AgglomerativeClustering(2, linkage='complete')``): merge the two closest
  clusters, where the distance of two clusters is their largest pairwise
  distance (Lance-Williams: d(k, i+j) = max(d(k, i), d(k, j))), until two
  remain. Fixed shapes: N - 2 masked merge steps.

  Args:
    dist: [N, N] symmetric dissimilarities.
    member: bool [N], the points to split (at least 2).
  Returns:
    bool [N], True for the members of the cluster not containing the
    lowest-index member (False outside ``member``).
  """
  n = dist.shape[0]
  off = ~jnp.eye(n, dtype=bool)
  d = jnp.where(member[:, None] & member[None, :] & off, dist, jnp.inf)
  label = jnp.arange(n)

  def body(_, carry):
    d, active, label = carry
    flat = jnp.argmin(d)
    i, j = flat // n, flat % n
    i, j = jnp.minimum(i, j), jnp.maximum(i, j)
    row = jnp.maximum(d[i], d[j]).at[i].set(jnp.inf).at[j].set(jnp.inf)
    merged = (
      d.at[i, :]
      .set(row)
      .at[:, i]
      .set(row)
      .at[j, :]
      .set(jnp.inf)
      .at[:, j]
      .set(jnp.inf)
    )
    go = jnp.sum(active) > 2
    return (
      jnp.where(go, merged, d),
      jnp.where(go, active.at[j].set(False), active),
      jnp.where(go & (label == j), i, label),
    )

  _, _, label = jax.lax.fori_loop(0, max(n - 2, 0), body, (d, member, label))
  first = jnp.argmax(member)  # lowest-index member
  return member & (label != label[first])


def _pairs(x: Any) -> Any:
  return x * (x - 1) / 2


def adjusted_rand_index(
  labels_true: jax.Array, labels_pred: jax.Array, num_true: int, num_pred: int
) -> jax.Array:
  """Adjusted Rand index (Hubert and Arabie 1985) of two labelings of N points
  (labels in [0, num_true) and [0, num_pred)), from their contingency table;
  1 when both are trivial in the same way (scikit-learn's convention).

  Args:
    labels_true: one labeling [N].
    labels_pred: another [N].
    num_true: labels of the first.
    num_pred: labels of the second.

  Returns:
    The index (1: the same partition).
  """
  ct = jax.nn.one_hot(labels_true, num_true).T @ jax.nn.one_hot(
    labels_pred, num_pred
  )
  n = labels_true.shape[0]
  index = jnp.sum(_pairs(ct))
  a, b = jnp.sum(_pairs(ct.sum(1))), jnp.sum(_pairs(ct.sum(0)))
  expected = a * b / max(_pairs(n), 1)
  top = (a + b) / 2
  denom = top - expected
  return jnp.where(
    denom == 0, 1.0, (index - expected) / jnp.where(denom == 0, 1.0, denom)
  )


def in_group_share(w: jax.Array, groups: jax.Array) -> jax.Array:
  """Mean over clients i of the share of row i's off-diagonal weight that
  goes to clients of i's own known group: 1 when W mixes only inside groups,
  about (|G_i| - 1) / (N - 1) (``in_group_chance``) when W ignores them.

  Args:
    w: a mixing matrix [N, N].
    groups: each client's group [N].

  Returns:
    The mean share.
  """
  w = jnp.asarray(w, jnp.float32)
  off = 1.0 - jnp.eye(w.shape[0], dtype=w.dtype)
  same = (groups[:, None] == groups[None, :]).astype(w.dtype) * off
  return jnp.mean(
    jnp.sum(w * same, 1) / jnp.maximum(jnp.sum(w * off, 1), 1e-30)
  )


def in_group_chance(groups: Any) -> float:
  """Mean over clients of (|G_i| - 1) / (N - 1): ``in_group_share`` of a W
  that spreads weight uniformly over the other clients.

  Args:
    groups: each client's group [N].

  Returns:
    The chance share.
  """
  groups = np.asarray(groups)
  sizes = np.array([np.sum(groups == g) for g in groups])
  return float(np.mean((sizes - 1) / max(len(groups) - 1, 1)))
