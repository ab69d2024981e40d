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
recursively over rounds.

The absolute thresholds depend on the model's update scale. ``ratio`` > 0
replaces the first test by the scale-free || mean || < ratio * max || dtheta_i ||
(an option of this library, not of the paper).
"""

import dataclasses
from typing import ClassVar

from flax import struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_personal import aggregation
from fedjax_personal.algorithm import (ClientModels, Communication, FederatedAlgorithm,
                                       cohort_train_metrics)
from fedjax_personal.algorithms.fedavg import client_weights
from fedjax_personal.batching import Batching
from fedjax_personal.config import (BATCHING, CLIENT_OPTIMIZER, FINETUNE, WEIGHTING,
                                    AlgorithmSpec, hparam)
from fedjax_personal.models import Model
from fedjax_personal.training import plain_objective, sgd_client_work
from optax import tree_utils as otu
from fedjax_personal.tree_util import rows, tree_broadcast, tree_bytes, tree_scatter


@dataclasses.dataclass(frozen=True)
class CFLConfig:
  prefix: ClassVar[str] = 'cfl'
  eps1: float = hparam(0.4, 'Split when the mean update norm is below this...', minimum=0)
  eps2: float = hparam(1.6, '...and the largest client update norm above this.', minimum=0)
  warmup_rounds: int = hparam(5, 'No split before this round.', minimum=0)
  ratio: float = hparam(0.0, 'If > 0: split when the mean update norm < ratio * the largest '
                        '(scale-free; replaces eps1).', minimum=0)


@struct.dataclass
class CFLState:
  """Attributes:
    personal: stacked [N, ...] model of each client's cluster.
    cluster: int32 [N] cluster of each client.
    updates: stacked [N, ...] each client's last update dtheta_i.
    num_clusters: clusters so far.
  """
  personal: optax.Params
  cluster: jax.Array
  updates: optax.Params
  num_clusters: jax.Array


def bipartition(updates: np.ndarray):
  """Complete-linkage split of flat updates [n, P] on 1 - cosine similarity.

  Returns a bool [n] (True: the second half).
  """
  from sklearn.cluster import AgglomerativeClustering
  u = updates / np.maximum(np.linalg.norm(updates, axis=1, keepdims=True), 1e-12)
  dist = np.clip(1.0 - u @ u.T, 0.0, 2.0)
  labels = AgglomerativeClustering(n_clusters=2, metric='precomputed',
                                   linkage='complete').fit_predict(dist)
  return labels == 1


def split_decisions(updates: np.ndarray, cluster: np.ndarray, weights: np.ndarray,
                    eps1: float, eps2: float, ratio: float = 0.0):
  """New cluster ids after the split test of every cluster (host side).

  Returns (new cluster ids, list of (cluster, mean norm, max norm) split).
  """
  cluster = cluster.copy()
  nxt = int(cluster.max()) + 1
  splits = []
  for c in np.unique(cluster):
    members = np.nonzero(cluster == c)[0]
    if len(members) < 2:
      continue
    u = updates[members]
    w = weights[members] / max(weights[members].sum(), 1e-12)
    mean_norm = float(np.linalg.norm(w @ u))
    max_norm = float(np.linalg.norm(u, axis=1).max())
    stationary = mean_norm < ratio * max_norm if ratio > 0 else mean_norm < eps1
    if stationary and max_norm > eps2:
      second = bipartition(u)
      cluster[members[second]] = nxt
      nxt += 1
      splits.append((int(c), mean_norm, max_norm))
  return cluster, splits


def cfl(model: Model, num_clients: int, num_examples, client_optimizer, batching: Batching,
        eps1: float = 0.4, eps2: float = 1.6, warmup_rounds: int = 5,
        ratio: float = 0.0, weighting: str = 'num_examples') -> FederatedAlgorithm:
  """Builds clustered FL (eps1, eps2 of the split test, or the scale-free
  ``ratio``; no split before ``warmup_rounds``; cluster means weighted by
  ``weighting``). Meant for full participation (every client trains)."""
  n_np = np.asarray(num_examples, np.float64)
  plain = plain_objective(model)

  def init(key):
    params = model.init(key)
    zeros = jax.tree.map(jnp.zeros_like, params)
    return CFLState(tree_broadcast(params, num_clients), jnp.zeros(num_clients, jnp.int32),
                    tree_broadcast(zeros, num_clients), jnp.ones((), jnp.int32))

  def server_broadcast(state, cohort, rc):
    return None, rows(state.personal, cohort.idx)

  work = sgd_client_work(
      lambda ctx: plain, client_optimizer, batching, start_fn=lambda ctx: ctx.state,
      final=lambda ctx, c: (otu.tree_sub(c.params, ctx.state), ctx.data.train.num_examples,
                            c.stats))

  def server_update(state, cohort, out, rc):
    deltas, n, stats = out
    w = client_weights(cohort, n, weighting)
    members = state.cluster.at[cohort.idx].get(mode='clip')
    mean_updates = aggregation.group_means(deltas, members, w, num_clients)  # [clusters, ...]
    personal = jax.tree.map(lambda p, d: p + d[state.cluster], state.personal, mean_updates)
    updates = tree_scatter(state.updates, cohort.idx, deltas)
    metrics = cohort_train_metrics(stats, cohort.mask)
    metrics['num_clusters'] = state.num_clusters
    return state.replace(personal=personal, updates=updates), metrics

  def between_rounds(state, t, key, runner):
    if t < max(warmup_rounds, 1):
      return state, {}
    flat = np.asarray(jax.vmap(lambda u: jax.flatten_util.ravel_pytree(u)[0])(state.updates))
    weights = n_np if weighting == 'num_examples' else np.ones_like(n_np)
    cluster, splits = split_decisions(flat, np.asarray(state.cluster), weights, eps1, eps2, ratio)
    if not splits:
      return state, {}
    new = state.replace(cluster=jnp.asarray(cluster, jnp.int32),
                        num_clusters=jnp.asarray(int(cluster.max()) + 1, jnp.int32))
    return new, {'cfl_splits': len(splits), 'num_clusters': int(cluster.max()) + 1}

  def communication(state):
    b = tree_bytes(jax.tree.map(lambda a: a[0], state.personal))
    return Communication(b, b, int(state.num_clusters))

  return FederatedAlgorithm(
      name='cfl', model=model, init=init, server_broadcast=server_broadcast, client_work=work,
      server_update=server_update,
      client_models=lambda s: ClientModels.personal(s.personal, num_clients),
      communication=communication, between_rounds=between_rounds)


def build(training, config: CFLConfig, model, data):
  return cfl(model, data.num_clients, data.train.num_examples, training.make_client_optimizer(),
             training.batching(), eps1=config.eps1, eps2=config.eps2,
             warmup_rounds=config.warmup_rounds, ratio=config.ratio,
             weighting=training.weighting)


# Cluster models are the weighted mean of their members' updates (no server
# optimizer).
SPEC = AlgorithmSpec('cfl', CFLConfig, build, CLIENT_OPTIMIZER | BATCHING | WEIGHTING | FINETUNE,
                     summary='Clustered FL (Sattler et al. 2020): recursive bipartitions')
