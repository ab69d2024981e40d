"""FedNova (Wang et al., NeurIPS 2020, "Tackling the objective inconsistency
problem in heterogeneous federated optimization"): normalized averaging.

Clients that take more local steps move further; FedAvg's mean of their
deltas then optimizes a skewed objective. FedNova divides each client's
delta by its number of effective steps and rescales the mean (eq. 6):

    d_i = (theta - theta_i) / a_i,     a_i = ||a_i||_1 (the paper's a_i vector),
    theta <- theta - tau_eff * sum_i p_i d_i,     tau_eff = sum_i p_i a_i,

with p_i the aggregation weights (n_i / n by default). For plain SGD a_i =
tau_i, the client's number of local steps; with momentum rho (a fresh
buffer each round) a_i = [tau_i - rho (1 - rho^tau_i) / (1 - rho)] / (1 -
rho) (Appendix, momentum SGD). With equal step counts FedNova is FedAvg.

The pseudo-gradient tau_eff * sum_i p_i d_i goes through the server optimizer
(SGD with learning rate 1 by default: the rule above).
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct
from optax import tree_utils as otu

from fedjax_personal.algorithms.fedavg import (
  ServerState,
  global_model_communication,
  summed_upload,
)
from fedjax_personal.config import (
  BATCHING,
  CLIENT_LR_SCHEDULE,
  FINETUNE,
  SERVER_OPTIMIZER,
  WEIGHTING,
  AlgorithmSpec,
  BuildData,
  Declared,
  NoConfig,
  TrainingConfig,
)
from fedjax_personal.core import aggregation
from fedjax_personal.core.algorithm import (
  ClientModels,
  FederatedAlgorithm,
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import (
  ClientContext,
  LossStats,
  plain_objective,
  sgd_client_work,
)
from fedjax_personal.core.tree_util import PyTree, tree_where
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import Model

__all__ = [
  'build',
  'check',
  'effective_steps',
  'fednova',
  'NovaUpload',
  'SETTINGS',
  'SPEC',
]


@struct.dataclass
class NovaUpload:
  """What one FedNova client uploads.

  Attributes:
    delta: (d_i, a_i): the normalized delta and the effective step count,
      a weighted-mean share (``summed_upload``).
    num_examples: n_i.
    stats: local training LossStats.
  """

  delta: (
    Any  # a client's (d_i, a_i); the cohort's Sum where the server reads it
  )
  num_examples: HostOrDevice
  stats: LossStats


def effective_steps(num_steps, momentum: float = 0.0):
  """a_i = ||a_i||_1 for ``num_steps`` local SGD steps with heavy-ball
  ``momentum`` rho from a zero buffer: tau for plain SGD, else
  [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho) (FedNova, Appendix).

  Args:
    num_steps: local steps tau (int array).
    momentum: the heavy-ball coefficient rho.

  Returns:
    a_i per client.
  """
  tau = jnp.asarray(num_steps, jnp.float32)
  if not momentum:
    return tau
  rho = momentum
  return (tau - rho * (1 - rho**tau) / (1 - rho)) / (1 - rho)


def fednova(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  momentum: float = 0.0,
  server_optimizer: Optional[optax.GradientTransformation] = None,
  weighting: str = 'num_examples',
) -> FederatedAlgorithm:
  """Builds FedNova.

  Args:
    client_optimizer: local SGD (``momentum`` must be its heavy-ball
      coefficient: it sets the normalization a_i).
    momentum: the client optimizer's momentum rho (0 for plain SGD).
    server_optimizer: applied to tau_eff * sum_i p_i d_i; default
      ``optax.sgd(1.0)``.
    weighting: p_i proportional to n_i ('num_examples'), to the client's tokens
      ('tokens', ``fedavg.train_tokens``) or uniform.

  Returns:
    The ``FederatedAlgorithm``.
  """
  server_optimizer = server_optimizer or optax.sgd(1.0)
  objective = plain_objective(model)

  def final(ctx: ClientContext, carry: PyTree):
    a = effective_steps(carry.num_steps, momentum)
    d = jax.tree.map(
      lambda x: x / jnp.maximum(a, 1e-12),
      otu.tree_sub(ctx.shared, carry.params),
    )
    return NovaUpload(
      delta=(d, a), num_examples=ctx.data.train.num_examples, stats=carry.stats
    )

  work = summed_upload(
    sgd_client_work(lambda ctx: objective, client_optimizer, batching, final),
    weighting,
  )

  def init(key: jax.Array) -> ServerState:
    params = model.init(key)
    return ServerState(params=params, opt_state=server_optimizer.init(params))

  def server_update(
    state: ServerState, cohort: Cohort, out: NovaUpload, rc: RoundContext
  ):
    (d_mean, tau_eff), weight = aggregation.upload_mean(out.delta)
    pseudo_grad = jax.tree.map(lambda d: tau_eff * d, d_mean)
    updates, opt_state = server_optimizer.update(
      pseudo_grad, state.opt_state, state.params
    )
    any_client = weight > 0
    new = ServerState(
      params=tree_where(
        any_client, optax.apply_updates(state.params, updates), state.params
      ),
      opt_state=tree_where(any_client, opt_state, state.opt_state),
    )
    return new, cohort_train_metrics(out.stats, cohort.mask)

  return FederatedAlgorithm(
    name='fednova',
    model=model,
    init=init,
    server_broadcast=lambda state, cohort, rc: (state.params, cohort.mask),
    client_work=work,
    server_update=server_update,
    client_models=lambda s: ClientModels.global_model(s.params, num_clients),
    communication=global_model_communication,
  )


def build(
  training: TrainingConfig,
  config: Declared,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedNova, built as ``AlgorithmSpec.build`` says."""
  del config
  return fednova(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    momentum=training.client_momentum,
    server_optimizer=training.make_server_optimizer(),
    weighting=training.filled_weighting(),
  )


def check(training, config):
  """``AlgorithmSpec.check`` of FedNova, which normalizes local SGD steps (a
  ConfigError for settings that cannot apply)."""
  del config
  if training.client_optimizer != 'sgd':
    raise ConfigError(
      'client_optimizer',
      'FedNova normalizes by the steps of local SGD (with '
      'momentum); Adam has no such count',
    )


#: The client optimizer's settings FedNova can normalize (no persistent
#: optimizer state: a_i assumes a fresh momentum buffer every round).
SETTINGS = (
  frozenset(
    {
      'client_optimizer',
      'client_lr',
      'client_momentum',
      'client_weight_decay',
      'client_grad_clip',
    }
  )
  | CLIENT_LR_SCHEDULE
  | BATCHING
  | WEIGHTING
  | SERVER_OPTIMIZER
  | FINETUNE
)

SPEC = AlgorithmSpec(
  'fednova',
  NoConfig,
  build,
  SETTINGS,
  check=check,
  partial_work='keep',
  summary='FedNova (Wang et al. 2020): deltas normalized by local steps',
)
