"""q-FFL (Li, Sanjabi, Beirami and Smith, ICLR 2020, "Fair resource
allocation in federated learning"), solved by q-FedAvg (their Algorithm 3).

q-FFL minimizes sum_k p_k F_k^{q+1}(theta) / (q + 1): clients with a larger
loss weigh more, q = 0 being FedAvg's objective. Each round client k, from
the broadcast theta, evaluates F_k(theta) on its training data, runs local
SGD to theta_k, and uploads

    Delta_k = F_k^q(theta) L (theta - theta_k),
    h_k = q F_k^{q-1}(theta) ||L (theta - theta_k)||^2 + L F_k^q(theta),

with L the Lipschitz-constant estimate (1 / the client learning rate, the
paper's choice, unless ``lipschitz`` is given); the server steps
theta <- theta - sum_k Delta_k / sum_k h_k. With q = 0 this is FedAvg with
uniform weights (Delta_k / h_k = theta - theta_k).
"""

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct
from optax import tree_utils as otu

from fedjax_personal.algorithms.fedavg import global_model_communication
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
from fedjax_personal.core import aggregation
from fedjax_personal.core.algorithm import (
  ClientModels,
  FederatedAlgorithm,
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.losses import mean_loss
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import (
  ClientContext,
  LossStats,
  plain_objective,
  sgd_client_work,
)
from fedjax_personal.core.tree_util import PyTree, tree_where
from fedjax_personal.models import Model

__all__ = ['build', 'qffl', 'QFFLConfig', 'QState', 'QUpload', 'SPEC']


@dataclasses.dataclass(frozen=True)
class QFFLConfig(Declared):
  """q-FFL's settings: the ``--qffl_*`` flags.

  Declared once (``hparam``: default, help, range, sweepable)."""

  prefix: ClassVar[str] = 'qffl'
  q: float = hparam(
    1.0,
    'Fairness exponent q (0: FedAvg with uniform weights).',
    minimum=0,
    sweep=True,
  )
  lipschitz: Optional[float] = hparam(
    None,
    "Lipschitz estimate L (default: 1 / --client_lr, the paper's).",
    minimum=0,
    open_min=True,
  )


@struct.dataclass
class QUpload:
  """What one q-FFL client uploads.

  Attributes:
    terms: Sum of (Delta_k, h_k) over the cohort.
    stats: local training LossStats.
  """

  terms: aggregation.Sum
  stats: LossStats


@struct.dataclass
class QState:
  """q-FFL's server state: the global parameters."""

  params: optax.Params


def qffl(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  q: float,
  lipschitz: float,
) -> FederatedAlgorithm:
  """Builds q-FedAvg.

  Args:
    q: the fairness exponent.
    lipschitz: L, the inverse step of the server update (1 / client_lr in
      the paper).

  Returns:
    The ``FederatedAlgorithm``.
  """
  objective = plain_objective(model)

  def final(ctx: ClientContext, carry: PyTree):
    # F_k(theta), the start's mean loss
    f = mean_loss(model, ctx.shared, ctx.data.train)
    dw = jax.tree.map(
      lambda a: lipschitz * a, otu.tree_sub(ctx.shared, carry.params)
    )
    fq = jnp.power(f, q)
    delta = jax.tree.map(lambda a: fq * a, dw)
    # q F^(q-1), 0 at q = 0 (also when F = 0).
    slope = jnp.where(q > 0, q * jnp.power(jnp.maximum(f, 1e-30), q - 1), 0.0)
    h = slope * otu.tree_norm(dw, squared=True) + lipschitz * fq
    return QUpload(
      terms=aggregation.weighted_upload((delta, h), 1.0), stats=carry.stats
    )

  def server_update(
    state: QState, cohort: Cohort, out: QUpload, rc: RoundContext
  ):
    (delta_mean, h_mean), weight = aggregation.upload_mean(out.terms)
    step = jax.tree.map(lambda d: d / jnp.maximum(h_mean, 1e-30), delta_mean)
    params = tree_where(
      weight > 0, otu.tree_sub(state.params, step), state.params
    )
    return QState(params), cohort_train_metrics(out.stats, cohort.mask)

  return FederatedAlgorithm(
    name='qffl',
    model=model,
    init=lambda key: QState(model.init(key)),
    server_broadcast=lambda state, cohort, rc: (state.params, cohort.mask),
    client_work=sgd_client_work(
      lambda ctx: objective, client_optimizer, batching, final
    ),
    server_update=server_update,
    client_models=lambda s: ClientModels.global_model(s.params, num_clients),
    communication=global_model_communication,
  )


def build(
  training: TrainingConfig,
  config: QFFLConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """q-FFL, built as ``AlgorithmSpec.build`` says; its settings ``QFFLConfig``
  (the Lipschitz constant defaults to 1 / client_lr)."""
  lipschitz = (
    config.lipschitz
    if config.lipschitz is not None
    else 1.0 / training.client_lr
  )
  return qffl(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    q=config.q,
    lipschitz=lipschitz,
  )


SPEC = AlgorithmSpec(
  'qffl',
  QFFLConfig,
  build,
  CLIENT_OPTIMIZER | BATCHING | FINETUNE,
  summary='q-FFL / q-FedAvg (Li et al. 2020): fair resource allocation',
)
