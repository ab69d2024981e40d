"""MOON (Li, He and Song, "Model-Contrastive Federated Learning", CVPR
2021, arXiv 2103.16257): FedAvg whose local objective adds a contrastive
term pulling the client's features toward the global model's and away from
its own previous model's (Eq. 3):

  l_con = -log( exp(sim(z, z_glob) / tau)
                / (exp(sim(z, z_glob) / tau) + exp(sim(z, z_prev) / tau)) ),

sim the cosine similarity, z the features before the head (PFLlib's
``clientmoon.py``: ``model.base``; no projection head), z_glob and z_prev
of the broadcast global model and of the client's model after its last
local training (held fixed), averaged over the batch and weighted by mu.

Defaults: tau = 1 (PFLlib's ``-tau``) and mu = 1 (PFLlib's shared ``-mu``
is 0, which turns the term off: ``--moon_mu=0`` for that; the paper tunes
mu in 0.1 - 10). A client's previous model starts as the initial model.
"""

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import struct
from optax import tree_utils as otu

from fedjax_personal.algorithms.fedavg import (
  FEDAVG_SETTINGS,
  global_model_communication,
  global_server_update,
  summed_upload,
)
from fedjax_personal.config import (
  FINETUNE,
  AlgorithmSpec,
  BuildData,
  Declared,
  TrainingConfig,
  hparam,
)
from fedjax_personal.core.algorithm import (
  ClientModels,
  ClientRows,
  FederatedAlgorithm,
  RoundContext,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.losses import Batch, LossStats, forward, logits_loss
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import ClientContext, sgd_client_work
from fedjax_personal.core.tree_util import PyTree, rows, tree_broadcast
from fedjax_personal.models import Model

__all__ = ['build', 'contrastive_loss', 'moon', 'MOONConfig', 'SPEC']


@dataclasses.dataclass(frozen=True)
class MOONConfig(Declared):
  """MOON's own settings: the ``--moon_*`` flags."""

  prefix: ClassVar[str] = 'moon'
  mu: float = hparam(
    1.0, 'Weight mu of the model-contrastive term.', minimum=0, sweep=True
  )
  tau: float = hparam(
    1.0,
    'Temperature tau of the contrastive term (PFLlib -tau).',
    minimum=0,
    open_min=True,
    sweep=True,
  )


@struct.dataclass
class MOONState:
  """MOON's state.

  Attributes:
    params: the global model.
    opt_state: the server optimizer's state.
    previous: every client's model after its last local training (client
      rows).
  """

  params: optax.Params
  opt_state: optax.OptState
  previous: PyTree


@struct.dataclass
class MOONOutput:
  """What one MOON client returns.

  Attributes:
    delta: the global model minus its trained model (its weighted share).
    previous: its trained model (its new row, written by the engine).
    num_examples: its training examples.
    stats: training statistics.
    num_steps: local steps taken.
  """

  delta: PyTree
  previous: PyTree
  num_examples: HostOrDevice
  stats: LossStats
  num_steps: Any = None


def cosine(a, b, eps=1e-8):
  """PyTorch's ``F.cosine_similarity`` along the last axis."""
  na = jnp.maximum(jnp.linalg.norm(a, axis=-1), eps)
  nb = jnp.maximum(jnp.linalg.norm(b, axis=-1), eps)
  return jnp.sum(a * b, axis=-1) / (na * nb)


def contrastive_loss(z, z_global, z_previous, mask, tau):
  """MOON's l_con (Eq. 3) averaged over the batch's real examples.

  Args:
    z: the local features [B, D].
    z_global: the global model's [B, D].
    z_previous: the previous model's [B, D].
    mask: bool [B].
    tau: the temperature.

  Returns:
    A scalar.
  """
  pos = cosine(z, z_global) / tau
  neg = cosine(z, z_previous) / tau
  loss = jnp.logaddexp(pos, neg) - pos
  return jnp.sum(jnp.where(mask, loss, 0)) / jnp.maximum(jnp.sum(mask), 1)


def moon(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  mu: float = 1.0,
  tau: float = 1.0,
  server_optimizer=None,
  weighting: str = 'num_examples',
) -> FederatedAlgorithm:
  """Builds MOON.

  Args:
    model: the model (with a head).
    num_clients: N.
    client_optimizer: the client optimizer.
    batching: local batching.
    mu: the contrastive term's weight.
    tau: its temperature.
    server_optimizer: applied to the mean delta (default ``optax.sgd(1.0)``).
    weighting: the mean's weighting (``fedavg.WEIGHTINGS``).

  Returns:
    The ``FederatedAlgorithm``.
  """
  model.require_head('--algorithm=moon')
  server_optimizer = server_optimizer or optax.sgd(1.0)

  def init(key: jax.Array) -> MOONState:
    params = model.init(key)
    return MOONState(
      params, server_optimizer.init(params), tree_broadcast(params, num_clients)
    )

  def server_broadcast(state: MOONState, cohort: Cohort, rc: RoundContext):
    return state.params, rows(state.previous, cohort.rows)

  def features(params, batch: Batch):
    z = forward(model, params, batch, features=True).features
    return jax.lax.stop_gradient(z.reshape((z.shape[0], -1)))

  def objective(ctx: ClientContext):
    def loss(params, batch: Batch):
      out = forward(model, params, batch, features=True)
      ce, stats = logits_loss(model, out.logits, batch, out.state)
      z = out.features.reshape((out.features.shape[0], -1))
      con = contrastive_loss(
        z,
        features(ctx.shared, batch),
        features(ctx.state, batch),
        batch.mask,
        tau,
      )
      return ce + mu * con, stats

    return loss

  def final(ctx: ClientContext, carry) -> MOONOutput:
    return MOONOutput(
      delta=otu.tree_sub(ctx.shared, carry.params),
      previous=carry.params,
      num_examples=ctx.data.train.num_examples,
      stats=carry.stats,
      num_steps=carry.num_steps,
    )

  work = sgd_client_work(objective, client_optimizer, batching, final)

  return FederatedAlgorithm(
    name='moon',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=summed_upload(work, weighting),
    server_update=global_server_update(server_optimizer),
    client_models=lambda s: ClientModels.global_model(s.params, num_clients),
    communication=global_model_communication,
    client_rows=ClientRows.field(
      'previous', models_from_rows=False, output='previous'
    ),
  )


def build(
  training: TrainingConfig,
  config: MOONConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """MOON, built as ``AlgorithmSpec.build`` says; its settings
  ``MOONConfig``."""
  return moon(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    config.mu,
    config.tau,
    training.make_server_optimizer(),
    training.filled_weighting(),
  )


SPEC = AlgorithmSpec(
  'moon',
  MOONConfig,
  build,
  FEDAVG_SETTINGS - FINETUNE,
  summary='MOON (Li et al. 2021): FedAvg + model-contrastive features',
)
