"""Clustered federated learning (Sattler, Mueller and Samek, IEEE TNNLS 2020).

Clients are partitioned into clusters, each with its own model; at the start
every client is in one cluster. Each round the clients train from their
cluster's model and the server adds to each cluster model the weighted mean
update of its members (a [clusters, cohort] group-averaging contraction; the
cluster ids live in the state, at most N clusters, so shapes never change).
Between rounds, a cluster c splits in two when it is near a stationary point
of its joint objective while its members still disagree:

    || mean_{i in c} dtheta_i || < eps1   and   max_{i in c} || dtheta_i || > eps2;

the bipartition is complete-linkage clustering on the cosine dissimilarity
1 - cos(dtheta_i, dtheta_j) of the members' last updates. Clusters split
recursively over rounds. The test and the bipartitions are tensor code on a
fixed maximum of N clusters, traced into the compiled round (``PreRound``);
scikit-learn's ``AgglomerativeClustering`` is the tests' oracle.

The absolute thresholds depend on the model's update scale. ``ratio`` > 0
replaces the first test by the scale-free || mean || < ratio * max || dtheta_i ||
(an option of this library, not of the paper).
"""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.flatten_util import ravel_pytree
from optax import tree_utils as otu

from fedjax_personal.algorithms.fedavg import client_weights
from fedjax_personal.config import (
  BATCHING,
  CLIENT_OPTIMIZER,
  FINETUNE,
  WEIGHTING,
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
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import plain_objective, sgd_client_work
from fedjax_personal.core.tree_util import (
  PyTree,
  rows,
  tree_broadcast,
  tree_scatter,
)
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import Model

__all__ = ['build', 'cfl', 'CFLConfig', 'CFLState', 'SPEC', 'split_decisions']


@dataclasses.dataclass(frozen=True)
class CFLConfig(Declared):
  """Clustered FL's settings: the ``--cfl_*`` flags.

  Declared once (``hparam``: default, help, range, sweepable)."""

  prefix: ClassVar[str] = 'cfl'
  eps1: float = hparam(
    0.4, 'Split when the mean update norm is below this...', minimum=0
  )
  eps2: float = hparam(
    1.6, '...and the largest client update norm above this.', minimum=0
  )
  warmup_rounds: int = hparam(5, 'No split before this round.', minimum=0)
  ratio: float = hparam(
    0.0,
    'If > 0: split when the mean update norm < ratio * the largest '
    '(scale-free; replaces eps1).',
    minimum=0,
  )


@struct.dataclass
class CFLState:
  """Clustered FL's state: each client's model and its cluster.

  Attributes:
    personal: stacked [N, ...] model of each client's cluster.
    cluster: int32 [N] cluster of each client.
    updates: stacked [N, ...] each client's last update dtheta_i.
    num_clusters: clusters so far.
  """

  personal: optax.Params
  cluster: jax.Array
  updates: optax.Params
  num_clusters: jax.Array


def cosine_dissimilarity(flat):
  """1 - cos(u_i, u_j) of flat updates [N, P], clipped to [0, 2]."""
  u = flat / jnp.maximum(jnp.linalg.norm(flat, axis=1, keepdims=True), 1e-12)
  return jnp.clip(1.0 - u @ u.T, 0.0, 2.0)


def split_decisions(
  flat,
  cluster,
  weights,
  num_clusters,
  eps1: float,
  eps2: float,
  ratio: float = 0.0,
):
  """The split test of every cluster and the bipartitions (tensor code).

  Args:
    flat: [N, P] each client's last update.
    cluster: int32 [N] cluster ids in [0, num_clusters).
    weights: [N] client weights of the cluster means.
    num_clusters: int32 scalar, clusters so far (at most N: fixed shapes).
    eps1, eps2, ratio: the split test (module docstring).
  Returns:
    (new cluster ids, new number of clusters, bool [N] clusters that split).
    A splitting cluster c keeps id c for the half holding its lowest-index
    member; the other half takes the next free id, in order of c.
  """
  n = cluster.shape[0]
  one_hot = jax.nn.one_hot(cluster, n, dtype=flat.dtype)  # [clients, clusters]
  wc = one_hot * weights[:, None]
  share = wc / jnp.maximum(wc.sum(0, keepdims=True), 1e-12)
  mean_norm = jnp.linalg.norm(share.T @ flat, axis=1)
  norms = jnp.linalg.norm(flat, axis=1)
  max_norm = jnp.max(jnp.where(one_hot > 0, norms[:, None], 0.0), axis=0)
  size = one_hot.sum(0)
  stationary = mean_norm < ratio * max_norm if ratio > 0 else mean_norm < eps1
  split = (
    (size >= 2)
    & stationary
    & (max_norm > eps2)
    & (jnp.arange(n) < num_clusters)
  )
  dist = cosine_dissimilarity(flat)

  def body(c, carry):
    def do(carry):
      cluster, nxt = carry
      second = clustering.bipartition(dist, cluster == c)
      return jnp.where(second, nxt, cluster), nxt + 1

    return jax.lax.cond(split[c], do, lambda carry: carry, carry)

  cluster, nxt = jax.lax.fori_loop(
    0, n, body, (cluster, jnp.asarray(num_clusters, jnp.int32))
  )
  return cluster, nxt, split


def cfl(
  model: Model,
  num_clients: int,
  num_examples,
  client_optimizer,
  batching: Batching,
  eps1: float = 0.4,
  eps2: float = 1.6,
  warmup_rounds: int = 5,
  ratio: float = 0.0,
  weighting: str = 'num_examples',
) -> FederatedAlgorithm:
  """Builds clustered FL (eps1, eps2 of the split test, or the scale-free
  ``ratio``; no split before ``warmup_rounds``; cluster means weighted by
  ``weighting``). Meant for full participation (every client trains).

  Args:
    model: the model (pure ``init`` / ``apply``).
    num_clients: N: per-client state has N rows.
    num_examples: training examples per client [N].
    client_optimizer: the optax client optimizer.
    batching: local batching (epochs or steps, batch size).
    eps1: the split test's bound on the mean update's norm.
    eps2: its bound on the largest client update's norm.
    warmup_rounds: rounds before any split.
    ratio: the scale-free test (max / mean norm) when > 0.
    weighting: ``'num_examples'`` (n_i-weighted mean) or ``'uniform'``.

  Returns:
    The ``FederatedAlgorithm``.
  """
  n_np = np.asarray(num_examples, np.float64)
  plain = plain_objective(model)

  def init(key: jax.Array) -> CFLState:
    params = model.init(key)
    zeros = jax.tree.map(jnp.zeros_like, params)
    return CFLState(
      tree_broadcast(params, num_clients),
      jnp.zeros(num_clients, jnp.int32),
      tree_broadcast(zeros, num_clients),
      jnp.ones((), jnp.int32),
    )

  def server_broadcast(state: CFLState, cohort: Cohort, rc: RoundContext):
    return None, rows(state.personal, cohort.idx)

  work = sgd_client_work(
    lambda ctx: plain,
    client_optimizer,
    batching,
    start_fn=lambda ctx: ctx.state,
    final=lambda ctx, c: (
      otu.tree_sub(c.params, ctx.state),
      ctx.data.train.num_examples,
      c.stats,
    ),
  )

  def server_update(state: CFLState, cohort: Cohort, out, rc: RoundContext):
    deltas, n, stats = out
    w = client_weights(cohort, n, weighting)
    members = state.cluster.at[cohort.idx].get(mode='clip')
    # [clusters, ...]
    mean_updates = aggregation.group_means(deltas, members, w, num_clients)
    personal = jax.tree.map(
      lambda p, d: p + d[state.cluster], state.personal, mean_updates
    )
    updates = tree_scatter(state.updates, cohort.idx, deltas)
    metrics = cohort_train_metrics(stats, cohort.mask)
    metrics['num_clusters'] = state.num_clusters
    return dataclasses.replace(
      state, personal=personal, updates=updates
    ), metrics

  # The split test, traced into the compiled round (PreRound) before each
  # round from max(warmup_rounds, 1) on; it needs only the stored updates.
  weights = jnp.asarray(
    n_np if weighting == 'num_examples' else np.ones_like(n_np), jnp.float32
  )

  def split_update(state: CFLState, outputs: PyTree, rc: RoundContext):
    flat = jax.vmap(lambda u: ravel_pytree(u)[0])(state.updates)
    cluster, k, split = split_decisions(
      flat, state.cluster, weights, state.num_clusters, eps1, eps2, ratio
    )
    return dataclasses.replace(state, cluster=cluster, num_clusters=k), {
      'cfl_splits': jnp.sum(split.astype(jnp.int32)),
      'num_clusters': k,
    }

  def communication(state: CFLState):
    return Communication.one_of(state.personal, state.num_clusters)

  return FederatedAlgorithm(
    name='cfl',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=work,
    server_update=server_update,
    client_models=lambda s: ClientModels.personal(s.personal, num_clients),
    communication=communication,
    pre_round=PreRound(
      due=lambda t: t >= max(warmup_rounds, 1), update=split_update
    ),
  )


def build(
  training: TrainingConfig,
  config: CFLConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """Clustered FL, built as ``AlgorithmSpec.build`` says; its settings
  ``CFLConfig``."""
  return cfl(
    model,
    data.num_clients,
    data.train.num_examples,
    training.make_client_optimizer(),
    training.batching(),
    eps1=config.eps1,
    eps2=config.eps2,
    warmup_rounds=config.warmup_rounds,
    ratio=config.ratio,
    weighting=training.filled_weighting(),
  )


def check(training, config):
  """CFL weighs its clusters' members on the server, by examples or
  uniformly: a client's tokens are counted by the client (``summed_upload``).

  Args:
    training: the shared settings.
    config: CFL's own.

  Returns:
    None.
  """
  del config
  if training.weighting == 'tokens':
    raise ConfigError(
      'weighting',
      "cfl weighs its clusters' members by num_examples or uniform, not tokens",
    )


# Cluster models are the weighted mean of their members' updates (no server
# optimizer).
SPEC = AlgorithmSpec(
  'cfl',
  CFLConfig,
  build,
  CLIENT_OPTIMIZER | BATCHING | WEIGHTING | FINETUNE,
  check=check,
  summary='Clustered FL (Sattler et al. 2020): recursive bipartitions',
)
