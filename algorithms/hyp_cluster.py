"""HypCluster (Mansour, Mohri, Ro and Suresh, "Three Approaches for
Personalization with Applications to Federated Learning", arXiv:2002.10619,
Algorithm 2), as FedJAX builds it (``fedjax.algorithms.hyp_cluster``),
compiled into one round.

K cluster models (FedJAX's ``random_init``: the model's initialization from
K splits of the key). Each round every client takes the cluster whose model
has its lowest mean training loss (the maximization step; ties: the first),
trains from it and uploads its delta into that cluster's row of a [K, ...]
weighted sum (by examples, FedJAX's weights); the server optimizer runs per
cluster on its mean delta, and a cluster no client chose keeps its model
and optimizer state (the expectation step). A client is evaluated with the
cluster its training data chooses (FedJAX's ``HypClusterEvaluator``).
Downlink: the K models to every client; uplink: one delta.
"""

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import struct
from optax import tree_utils as otu

from fedjax_personal.algorithms.fedavg import (
  ClientOutput,
  server_step,
  summed_upload,
)
from fedjax_personal.config import (
  BATCHING,
  CLIENT_OPTIMIZER,
  SERVER_OPTIMIZER,
  WEIGHTING,
  AlgorithmSpec,
  BuildData,
  Declared,
  TrainingConfig,
  hparam,
)
from fedjax_personal.core.algorithm import (
  ClientModels,
  Communication,
  FederatedAlgorithm,
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.data import ClientData, LocalData
from fedjax_personal.core.losses import (
  LossStats,
  evaluate_params,
  mean_loss,
  plain_objective,
)
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import (
  ClientContext,
  SGDCarry,
  extended_sgd_work,
  sgd_client_work,
)
from fedjax_personal.core.tree_util import PyTree
from fedjax_personal.models import Model

__all__ = [
  'build',
  'choose_cluster',
  'hyp_cluster',
  'HypClusterConfig',
  'HypClusterState',
  'SPEC',
]


@dataclasses.dataclass(frozen=True)
class HypClusterConfig(Declared):
  """HypCluster's own settings: the ``--hyp_cluster_*`` flags."""

  prefix: ClassVar[str] = 'hyp_cluster'
  num_clusters: int = hparam(
    2, 'K, the number of cluster models.', minimum=1, sweep=True
  )


@struct.dataclass
class HypClusterState:
  """HypCluster's server state.

  Attributes:
    cluster_params: the K cluster models, stacked [K, ...].
    opt_state: the server optimizer's state per cluster (leading axis K).
  """

  cluster_params: optax.Params
  opt_state: optax.OptState


@struct.dataclass
class ChosenCarry:
  """A HypCluster client's work: local SGD from the cluster it chose.

  Attributes:
    sgd: the local SGD's carry.
    cluster: int32 scalar, the cluster chosen (once, before the first step).
  """

  sgd: SGDCarry
  cluster: jax.Array


@struct.dataclass
class HypClusterOutput(ClientOutput):
  """A HypCluster client's upload: FedAvg's and the cluster it trained.

  The cluster is its delta's row of the [K, ...] sum."""

  cluster: Any = None


def choose_cluster(model: Model, cluster_params: PyTree, train: ClientData):
  """The maximization step for one client: the cluster whose model has the
  lowest mean loss on its training examples (the first on ties).

  Args:
    model: the model.
    cluster_params: the K models, stacked [K, ...].
    train: the client's training split.

  Returns:
    ``(k, the model of cluster k)``.
  """

  k = jnp.argmin(jax.vmap(lambda p: mean_loss(model, p, train))(cluster_params))
  return k, jax.tree.map(lambda a: a[k], cluster_params)


def hyp_cluster(
  model: Model,
  num_clients: int,
  num_clusters: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  server_optimizer=None,
  weighting: str = 'num_examples',
) -> FederatedAlgorithm:
  """Builds HypCluster.

  Args:
    model: the model.
    num_clients: N.
    num_clusters: K.
    client_optimizer: local optimizer.
    batching: local epochs / steps and batch size.
    server_optimizer: applied per cluster to its mean delta; default
      ``optax.sgd(1.0)``.
    weighting: the means' weights.

  Returns:
    The ``FederatedAlgorithm``.
  """
  server_optimizer = server_optimizer or optax.sgd(1.0)

  def init(key: jax.Array) -> HypClusterState:
    params = jax.vmap(model.init)(jax.random.split(key, num_clusters))
    return HypClusterState(params, jax.vmap(server_optimizer.init)(params))

  def server_broadcast(state: HypClusterState, cohort: Cohort, rc):
    return state.cluster_params, cohort.mask

  sgd = sgd_client_work(
    lambda ctx: plain_objective(model),
    client_optimizer,
    batching,
    final=lambda ctx, carry: carry,
  )

  def work_init(ctx: ClientContext, key) -> ChosenCarry:
    # the maximization step, once a client: a pass over its examples with
    # each of the K models
    k, start = choose_cluster(model, ctx.shared, ctx.data.train)
    return ChosenCarry(sgd.init(dataclasses.replace(ctx, shared=start), key), k)

  def final(ctx: ClientContext, carry: ChosenCarry) -> HypClusterOutput:
    start = jax.tree.map(lambda a: a[carry.cluster], ctx.shared)
    return HypClusterOutput(
      delta=otu.tree_sub(start, carry.sgd.params),
      num_examples=ctx.data.train.num_examples,
      stats=carry.sgd.stats,
      num_steps=carry.sgd.num_steps,
      cluster=carry.cluster,
    )

  def server_update(
    state: HypClusterState, cohort: Cohort, out, rc: RoundContext
  ):
    params, opt_state = jax.vmap(server_step, in_axes=(0, 0, 0, None))(
      state.cluster_params, state.opt_state, out.delta, server_optimizer
    )
    return HypClusterState(params, opt_state), cohort_train_metrics(
      out.stats, cohort.mask
    )

  def evaluate_client(
    cluster_params, local: LocalData, test: ClientData, key
  ) -> LossStats:
    del key
    return evaluate_params(
      model, choose_cluster(model, cluster_params, local.train)[1], test
    )

  def communication(state: HypClusterState) -> Communication:
    return Communication.one_of(state.cluster_params, num_clusters)

  return FederatedAlgorithm(
    name='hyp_cluster',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=summed_upload(
      extended_sgd_work(sgd, work_init, final),
      weighting,
      group_fn=lambda ctx, out: (out.cluster, num_clusters),
    ),
    server_update=server_update,
    # every client holds the K models (one entry); ``evaluate_client``
    # chooses among them on the client's training data
    client_models=lambda s: ClientModels(
      jax.tree.map(lambda a: a[None], s.cluster_params),
      jnp.zeros(num_clients, jnp.int32),
    ),
    evaluate_client=evaluate_client,
    communication=communication,
  )


def build(
  training: TrainingConfig,
  config: HypClusterConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """HypCluster, built as ``AlgorithmSpec.build`` says."""
  return hyp_cluster(
    model,
    data.num_clients,
    config.num_clusters,
    training.make_client_optimizer(),
    training.batching(),
    server_optimizer=training.make_server_optimizer(),
    weighting=training.filled_weighting(),
  )


SPEC = AlgorithmSpec(
  'hyp_cluster',
  HypClusterConfig,
  build,
  CLIENT_OPTIMIZER | BATCHING | WEIGHTING | SERVER_OPTIMIZER,
  summary='HypCluster (Mansour et al. 2020): K models, each client in the '
  'cluster of its lowest loss',
)
