"""User-centric federated learning (Mestoukirdi, Zecchin, Gesbert, Li and
Gresset, 2023): personalized aggregation by a mixing matrix, with k-means
downlink streams.

Collaboration round (before training, at a common model theta_hat): each
client computes its full-batch gradient delta_i and the variance estimate
sigma_i^2 = (1/K) sum_k ||g_k - delta_i||^2 over K local batches (eq. 7). The
server forms (eq. 6)

    W_ij = (n_j / n_i) exp(-||delta_i - delta_j||^2 / (2 sigma_i sigma_j)) /
    Z_i.

Training rounds: each active client trains locally from its own model; the
server forms theta_i <- sum_j W_ij theta_j, one contraction over the stacked
models. Streams: k-means with k = m_t on the rows of W; client i is served by
its centroid's row, so only m_t distinct models go down. Here the stream
matrix is kept padded to [R, N] with R a static bound on m_t (N for full
personalization, the given m_t, or the silhouette search's bound; rows >= m_t
unused) with a client-to-stream index, so the compiled round does not depend
on m_t and forms only R mixtures of the N models.

Options beyond the paper (docs/algorithm_choices.md says why): the batch
size used for sigma (``sigma_batch_size``; None = K equal parts of the local
data, the authors' reading), computing W after ``warmup_rounds`` of FedAvg
instead of at the initial model, recomputing it every ``recompute_every``
rounds, m_t chosen by the silhouette score over 2..N-1 (bounded by
``max_streams``). The whole collaboration round (gradient statistics, W,
k-means with k-means++ restarts, silhouette) is tensor code inside the
compiled round (``PreRound``); scikit-learn is only the tests' oracle. W's
degeneracy is reported every time it is computed: effective neighbours per row 1
/ sum_j W_ij^2 (1 means Local, N means uniform), and, when the true groups are
known, the adjusted Rand index of the streams against them and W's in-group
share (the share of each row's off-diagonal weight on the user's own group, next
to its chance level).
"""

import dataclasses
from typing import ClassVar, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.flatten_util import ravel_pytree

from fedjax_personal.config import (
  BATCHING,
  CLIENT_OPTIMIZER,
  FINETUNE,
  AlgorithmSpec,
  BuildData,
  Declared,
  TrainingConfig,
  hparam,
)
from fedjax_personal.core import aggregation, clustering
from fedjax_personal.core.algorithm import (
  ClientModels,
  Communication,
  FederatedAlgorithm,
  PreRound,
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.clustering import in_group_chance, in_group_share  # noqa: F401 (API)
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import (
  Batch,
  batch_loss,
  plain_objective,
  sgd_client_work,
)
from fedjax_personal.core.tree_util import (
  PyTree,
  rows,
  tree_broadcast,
  tree_gather,
  tree_scatter,
)
from fedjax_personal.models import Model

__all__ = [
  'build',
  'effective_neighbours',
  'fedavg_matrix',
  'mixing_matrix',
  'SPEC',
  'streams',
  'Streams',
  'usercentric',
  'UserCentricConfig',
  'UserCentricState',
]


@dataclasses.dataclass(frozen=True)
class UserCentricConfig(Declared):
  """User-centric FL's settings: the ``--usercentric_*`` flags.

  User-centric FL's own settings, declared once: the ``--usercentric_*``
  flags (``hparam``: default, help, range, sweepable)."""

  prefix: ClassVar[str] = 'usercentric'
  num_streams: int = hparam(
    0,
    'Downlink streams m_t (0: silhouette choice; >= num_clients: '
    'one per client).',
    minimum=0,
  )
  sigma_batches: int = hparam(2, 'K batches for sigma_i^2 (eq. 7).', minimum=1)
  sigma_batch_size: int = hparam(
    0,
    'Size of those batches (0: K equal parts of the local data, '
    "the authors' reading; ~32 mixes usefully under label shift).",
    minimum=0,
  )
  warmup_rounds: int = hparam(
    0, 'FedAvg rounds before W is computed.', minimum=0
  )
  recompute_every: int = hparam(
    0, 'Recompute W every this many rounds (0: once).', minimum=0
  )
  max_streams: int = hparam(
    0,
    'Silhouette search over 2..this many streams (0: num_clients - 1, '
    'capped at 200).',
    minimum=0,
  )
  kmeans_restarts: int = hparam(
    10, 'k-means++ seedings per k-means (the best inertia is kept).', minimum=1
  )


@struct.dataclass
class UserCentricState:
  """User-centric aggregation's state: the clients' models, W and the streams.

  Attributes:
    personal: stacked [N, ...] models; client i's current (stream) model.
    stream_matrix: [R, N]; row s < num_streams is stream s's mixing row
      (a centroid of W's rows, or W's row itself when m_t = N).
    assignment: int32 [N], the stream serving each client.
    num_streams: m_t, distinct downlink models.
  """

  personal: optax.Params
  stream_matrix: jax.Array
  assignment: jax.Array
  num_streams: jax.Array


def fedavg_matrix(num_examples) -> np.ndarray:
  """Every row n_j / sum(n): the mixing matrix of FedAvg (full participation).

  Args:
    num_examples: training examples per client [C].

  Returns:
    W [C, C].
  """
  n = np.asarray(num_examples, np.float64)
  return np.tile(n / n.sum(), (len(n), 1))


def mixing_matrix(grads, sigma2, num_examples):
  """Eq. 6 from stacked flat gradients [N, P], sigma^2 [N] and n [N].

  Computed in log space (a softmax over j of log n_j - Delta_ij / (2 s_i s_j)),
  so that large exponents give the identity instead of NaN. The squared
  distances |g_i|^2 + |g_j|^2 - 2 g_i.g_j are taken on gradients centred on
  their mean: the distances are unchanged, and large, nearly equal gradients
  no longer cancel catastrophically in float32 (centring nearby values is
  exact by Sterbenz's lemma).

  Args:
    grads: the clients' gradients [C, P].
    sigma2: their gradient noise variances [C].
    num_examples: training examples per client [C].

  Returns:
    W [C, C].
  """
  g = jnp.asarray(grads, jnp.float32)
  g = g - jnp.mean(g, axis=0, keepdims=True)
  sq = jnp.sum(g * g, axis=1)
  delta = jnp.maximum(sq[:, None] + sq[None, :] - 2 * g @ g.T, 0.0)
  delta = delta.at[jnp.diag_indices(g.shape[0])].set(0.0)
  s = jnp.sqrt(jnp.maximum(jnp.asarray(sigma2, jnp.float32), 1e-30))
  logits = jnp.log(jnp.asarray(num_examples, jnp.float32)[None, :]) - delta / (
    2 * s[:, None] * s[None, :]
  )
  return jax.nn.softmax(logits, axis=1)


def effective_neighbours(w):
  """1 / sum_j W_ij^2 per row (1: only itself; N: uniform).

  Args:
    w: a mixing matrix [C, C].

  Returns:
    Per client, the effective number of clients it mixes.
  """
  return 1.0 / jnp.sum(jnp.asarray(w, jnp.float32) ** 2, axis=1)


def default_max_streams(num_clients: int, max_streams: int = 0) -> int:
  """The silhouette search bound: 2..N-1 (the paper), capped at
  ``max_streams`` when given, else at 200 (its cost grows as N * k^2)."""
  return max(1, min(num_clients - 1, max_streams or 200))


def stream_rows(
  num_clients: int, num_streams: Optional[int], max_streams: int
) -> int:
  """R, the static number of rows of the stream matrix (a bound on m_t)."""
  if num_streams is None:
    return max_streams
  return min(num_streams, num_clients)


class Streams(NamedTuple):
  """The downlink streams of a round (Sec. 3.2 of the paper).

  Attributes:
    matrix: [R, N]: row s < k stream s's mixing row, the other rows zero.
    assignment: int32 [N]: each client's stream.
    k: int32 scalar: the number of streams in use.
  """

  matrix: jax.Array
  assignment: jax.Array
  k: jax.Array


def streams(
  key, w, num_streams: Optional[int], max_streams: int, restarts: int = 10
) -> Streams:
  """Streams from the rows of W (tensor code, traced into the round).

  ``num_streams`` (static) None picks k in 2..max_streams by the silhouette
  score (1 when every row is the same); >= N gives W itself; 1 gives the mean
  row; else k-means with k streams, ``restarts`` k-means++ seedings from
  ``key``.

  Args:
    key: draws k-means' starts.
    w: the mixing matrix [C, C].
    num_streams: k (None: chosen by silhouette).
    max_streams: the largest k tried.
    restarts: k-means restarts.

  Returns:
    The ``Streams``: R = ``stream_rows(...)`` rows, row s < k stream s's
    mixing row, the others zero.
  """
  w = jnp.asarray(w, jnp.float32)
  n = w.shape[0]
  if num_streams is not None and num_streams >= n:
    return Streams(w, jnp.arange(n, dtype=jnp.int32), jnp.asarray(n, jnp.int32))
  if num_streams is None:
    r = clustering.silhouette_kmeans(key, w, max_streams, restarts)
  elif num_streams == 1:
    mean = jnp.mean(w, 0, keepdims=True)
    r = clustering.KMeansResult(
      mean,
      jnp.zeros(n, jnp.int32),
      jnp.sum((w - mean) ** 2),
      jnp.asarray(1, jnp.int32),
    )
  else:
    r = clustering.kmeans(key, w, num_streams, num_streams, restarts)
  rows = stream_rows(n, num_streams, max_streams)
  padded = (
    jnp.zeros((rows, n), jnp.float32)
    .at[: r.centroids.shape[0]]
    .set(r.centroids[:rows])
  )
  return Streams(padded, r.labels, r.k)


def gradient_statistics(
  model: Model,
  params,
  data,
  key,
  sigma_batches: int,
  sigma_batch_size: Optional[int],
):
  """One client's flat full-batch gradient delta_i and sigma_i^2 (eq. 7).

  The K batches are disjoint: K equal parts of the shuffled local data when
  ``sigma_batch_size`` is None, else K batches of that size (capped at n_i / K).
  """
  max_n = data.x.shape[0]
  n = data.num_examples
  flat = lambda t: ravel_pytree(t)[0]
  full = Batch(data.x, data.y, jnp.arange(max_n) < n)
  delta = flat(jax.grad(lambda p: batch_loss(model, p, full)[0])(params))
  u = jax.vmap(lambda j: jax.random.uniform(jax.random.fold_in(key, j)))(
    jnp.arange(max_n)
  )
  order = jnp.argsort(jnp.where(jnp.arange(max_n) < n, u, 2.0))
  part = n // sigma_batches
  size = (
    part if sigma_batch_size is None else jnp.minimum(sigma_batch_size, part)
  )
  rank = (
    jnp.empty(max_n, jnp.int32)
    .at[order]
    .set(jnp.arange(max_n, dtype=jnp.int32))
  )

  def batch_var(k):
    mask = (rank >= k * part) & (rank < k * part + size)
    g = flat(
      jax.grad(lambda p: batch_loss(model, p, Batch(data.x, data.y, mask))[0])(
        params
      )
    )
    return jnp.sum((g - delta) ** 2)

  sigma2 = jnp.mean(jax.vmap(batch_var)(jnp.arange(sigma_batches)))
  return delta, sigma2


def usercentric(
  model: Model,
  num_clients: int,
  num_examples,
  client_optimizer,
  batching: Batching,
  num_streams: Optional[int] = None,
  sigma_batches: int = 2,
  sigma_batch_size: Optional[int] = None,
  warmup_rounds: int = 0,
  recompute_every: int = 0,
  groups=None,
  max_streams: int = 0,
  kmeans_restarts: int = 10,
) -> FederatedAlgorithm:
  """Builds user-centric FL.

  Args:
    num_examples: int [N] training examples per client.
    client_optimizer: local optimizer (the paper: SGD lr 0.1, momentum 0.9).
    batching: local training (the paper: 1 epoch per round).
    num_streams: m_t (None: silhouette choice; >= N: full personalization).
    sigma_batches: K batches for sigma (paper: 2).
    sigma_batch_size: size of those batches (None: K equal parts).
    warmup_rounds: FedAvg rounds before W is computed (0: at the initial model).
    recompute_every: recompute W every this many rounds (0: once).
    groups: optional known groups [N] for the adjusted Rand index report.
    max_streams: bound of the silhouette search over 2..max_streams (0: N - 1,
      capped at 200).
    kmeans_restarts: k-means++ seedings per k-means (scikit-learn's n_init).

  The collaboration round (gradient statistics of every client, W, k-means,
  silhouette) runs inside the compiled round when its schedule is due; the
  sigma batches and the k-means seedings draw from the round's key.

  Returns:
    The ``FederatedAlgorithm``.
  """
  max_k = default_max_streams(num_clients, max_streams)
  n_np = np.asarray(num_examples)
  groups_np = None if groups is None else np.asarray(groups)
  plain = plain_objective(model)

  def init(key: jax.Array) -> UserCentricState:
    params = model.init(key)
    # FedAvg until W is computed (every row n_j / sum(n); client i on row 0).
    w = jnp.asarray(
      fedavg_matrix(n_np)[: stream_rows(num_clients, num_streams, max_k)],
      jnp.float32,
    )
    return UserCentricState(
      tree_broadcast(params, num_clients),
      w,
      jnp.zeros(num_clients, jnp.int32),
      jnp.ones((), jnp.int32),
    )

  def server_broadcast(
    state: UserCentricState, cohort: Cohort, rc: RoundContext
  ):
    return None, rows(state.personal, cohort.idx)

  work = sgd_client_work(
    lambda ctx: plain,
    client_optimizer,
    batching,
    final=lambda ctx, c: (c.params, c.stats),
    start_fn=lambda ctx: ctx.state,
  )

  def server_update(
    state: UserCentricState, cohort: Cohort, out, rc: RoundContext
  ):
    params, stats = out
    thetas = tree_scatter(state.personal, cohort.idx, params)
    # [R (padded streams), ...]
    streams = aggregation.mix(state.stream_matrix, thetas)
    personal = tree_gather(streams, state.assignment)
    metrics = cohort_train_metrics(stats, cohort.mask)
    metrics['num_streams'] = state.num_streams
    return dataclasses.replace(state, personal=personal), metrics

  # The collaboration round, traced into the compiled round (PreRound).
  def due(t):
    after = t - warmup_rounds
    periodic = (
      (after > 0) & (after % max(recompute_every, 1) == 0)
      if recompute_every
      else False
    )
    return (t == warmup_rounds) | periodic

  def collaboration_broadcast(state: UserCentricState, rc: RoundContext):
    # theta_hat: the n-weighted mean of the current models (the FedAvg model
    # during warm-up, the initial model at round 0).
    w_n = jnp.asarray(n_np / n_np.sum(), jnp.float32)
    return jax.tree.map(lambda a: jnp.tensordot(w_n, a, axes=1), state.personal)

  def collaboration_client(theta_hat, local, key):
    return gradient_statistics(
      model, theta_hat, local.train, key, sigma_batches, sigma_batch_size
    )

  def collaboration_update(
    state: UserCentricState, outputs: PyTree, rc: RoundContext
  ):
    grads, sigma2 = outputs
    w = mixing_matrix(grads, sigma2, n_np)
    k_means = jax.random.split(rc.key)[1]
    stream_matrix, assignment, k = streams(
      k_means, w, num_streams, max_k, kmeans_restarts
    )
    eff = effective_neighbours(w)
    info = {
      'w_effective_neighbours_mean': jnp.mean(eff),
      'w_effective_neighbours_min': jnp.min(eff),
      'w_diagonal_mean': jnp.mean(jnp.diag(w)),
      'num_streams': k,
    }
    if groups_np is not None and groups_np.min() >= 0:
      info['streams_ari'] = clustering.adjusted_rand_index(
        jnp.asarray(groups_np, jnp.int32),
        assignment,
        int(groups_np.max()) + 1,
        num_clients,
      )
      info['w_in_group_share'] = in_group_share(w, jnp.asarray(groups_np))
      info['w_in_group_chance'] = jnp.float32(in_group_chance(groups_np))
    # Serve every client its stream model from now on.
    personal = tree_gather(
      aggregation.mix(stream_matrix, state.personal), assignment
    )
    return dataclasses.replace(
      state,
      personal=personal,
      stream_matrix=stream_matrix,
      assignment=assignment,
      num_streams=k,
    ), info

  def communication(state: UserCentricState):
    return Communication.one_of(state.personal, state.num_streams)

  return FederatedAlgorithm(
    name='usercentric',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=work,
    server_update=server_update,
    client_models=lambda s: ClientModels.personal(s.personal, num_clients),
    communication=communication,
    pre_round=PreRound(
      due=due,
      broadcast=collaboration_broadcast,
      client=collaboration_client,
      update=collaboration_update,
    ),
  )


def build(
  training: TrainingConfig,
  config: UserCentricConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """User-centric FL, built as ``AlgorithmSpec.build`` says; its settings
  ``UserCentricConfig``."""
  return usercentric(
    model,
    data.num_clients,
    data.train.num_examples,
    training.make_client_optimizer(),
    training.batching(),
    num_streams=config.num_streams or None,
    sigma_batches=config.sigma_batches,
    sigma_batch_size=config.sigma_batch_size or None,
    warmup_rounds=config.warmup_rounds,
    recompute_every=config.recompute_every,
    groups=data.groups,
    max_streams=config.max_streams,
    kmeans_restarts=config.kmeans_restarts,
  )


# W weighs clients by n_j / n_i itself (eq. 6) and replaces the server
# optimizer: --weighting and --server_* do not apply.
SPEC = AlgorithmSpec(
  'usercentric',
  UserCentricConfig,
  build,
  CLIENT_OPTIMIZER | BATCHING | FINETUNE,
  summary='User-centric FL (Mestoukirdi et al. 2023): mixing matrix W, '
  'k-means streams',
)
