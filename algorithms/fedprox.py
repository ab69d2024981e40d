"""FedProx (Li et al., MLSys 2020): FedAvg with a proximal local objective

L_i(theta) + mu/2 ||theta - theta_server||^2.
"""

import dataclasses
from typing import ClassVar

import optax
from optax import tree_utils as otu

from fedjax_personal.algorithms.fedavg import FEDAVG_SETTINGS, fedavg
from fedjax_personal.config import (
  AlgorithmSpec,
  BuildData,
  Declared,
  TrainingConfig,
  hparam,
)
from fedjax_personal.core.algorithm import FederatedAlgorithm
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.training import ClientContext, batch_loss
from fedjax_personal.core.tree_util import is_concrete
from fedjax_personal.models import Model

__all__ = ['build', 'fedprox', 'FedProxConfig', 'SPEC']


@dataclasses.dataclass(frozen=True)
class FedProxConfig(Declared):
  """FedProx's settings: the ``--fedprox_*`` flags.

  Declared once (``hparam``: default, help, range, sweepable)."""

  prefix: ClassVar[str] = 'fedprox'
  mu: float = hparam(0.01, 'Proximal coefficient mu.', minimum=0, sweep=True)


def proximal_objective(model: Model, mu: float):
  """``ctx -> objective`` with FedProx's proximal term around the broadcast."""

  def objective_fn(ctx: ClientContext):
    def objective(params, batch):
      loss, stats = batch_loss(model, params, batch)
      return loss + 0.5 * mu * otu.tree_norm(
        otu.tree_sub(params, ctx.shared), squared=True
      ), stats

    return objective

  return objective_fn


def fedprox(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  mu: float,
  **kw,
):
  """Builds FedProx; ``kw`` as for ``fedavg`` (server optimizer, weighting).

  Args:
    model: the model (pure ``init`` / ``apply``).
    num_clients: N: per-client state has N rows.
    client_optimizer: the optax client optimizer.
    batching: local batching (epochs or steps, batch size).
    mu: the proximal coefficient.
    kw: as for ``fedavg`` (server optimizer, weighting, fine-tuning).

  Returns:
    The ``FederatedAlgorithm``.
  """
  if is_concrete(mu) and mu < 0:
    raise ValueError(f'FedProx mu must be >= 0, got {mu}')
  return fedavg(
    model,
    num_clients,
    client_optimizer,
    batching,
    objective_fn=proximal_objective(model, mu),
    name='fedprox',
    **kw,
  )


def build(
  training: TrainingConfig,
  config: FedProxConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedProx, built as ``AlgorithmSpec.build`` says; its settings
  ``FedProxConfig``."""
  return fedprox(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    config.mu,
    server_optimizer=training.make_server_optimizer(),
    weighting=training.filled_weighting(),
  )


SPEC = AlgorithmSpec(
  'fedprox',
  FedProxConfig,
  build,
  FEDAVG_SETTINGS,
  model_state=True,
  partial_work='keep',
  summary='FedProx (Li et al. 2020): FedAvg + proximal term',
)
