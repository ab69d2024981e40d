"""FedNTD (Lee et al., "Preservation of the Global Knowledge by Not-True
Distillation in Federated Learning", NeurIPS 2022, arXiv 2106.03097): FedAvg
whose local objective adds the not-true distillation loss (its eq. 4)

  L = CE(f(x; theta), y) + beta * tau^2 * KL(q~_g^tau || q~^tau),

q~^tau the softmax at temperature tau of the logits without the true class
(the "not-true" logits), q~_g^tau the same of the broadcast global model,
which is held fixed (evaluation mode, no gradient). As PFLlib's
``clientntd.py`` (after FedNTD's own ``criterion.py``): the KL is PyTorch's
``KLDivLoss(reduction='batchmean')``, summed over classes and divided by
the batch's examples (here its real ones).

Defaults: tau = 1 (PFLlib's ``-tau``) and beta = 1 (the paper's and FedNTD's
own code; PFLlib's shared ``-bt`` defaults to 0, which turns the
distillation off: give ``--fedntd_beta=0`` for that). The server's mean is
uniform over the clients (PFLlib's ``serverntd.py`` overrides
``add_parameters`` to add each upload divided by the number of clients
joined, ignoring their example counts); ``--weighting=num_examples`` gives
FedAvg's example-weighted mean.
"""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from fedjax_personal.algorithms.fedavg import FEDAVG_SETTINGS, fedavg
from fedjax_personal.config import (
  AlgorithmSpec,
  BuildData,
  Declared,
  TrainingConfig,
  hparam,
)
from fedjax_personal.core.algorithm import FederatedAlgorithm
from fedjax_personal.core.losses import Batch, forward, logits_loss
from fedjax_personal.core.training import ClientContext
from fedjax_personal.models import Model

__all__ = ['build', 'FedNTDConfig', 'not_true_distillation', 'SPEC']


@dataclasses.dataclass(frozen=True)
class FedNTDConfig(Declared):
  """FedNTD's own settings: the ``--fedntd_*`` flags."""

  prefix: ClassVar[str] = 'fedntd'
  beta: float = hparam(
    1.0, 'Weight beta of the not-true distillation loss.', minimum=0, sweep=True
  )
  tau: float = hparam(
    1.0,
    'Softmax temperature tau of the distillation.',
    minimum=0,
    open_min=True,
    sweep=True,
  )


def target_mask(batch: Batch) -> jax.Array:
  """bool [B, ...] (the targets' shape): the batch's counted targets, its
  real examples' targets that are not padding (-1)."""
  mask = batch.mask.reshape(batch.mask.shape + (1,) * (batch.y.ndim - 1))
  return mask & (batch.y >= 0)


def not_true_distillation(logits, global_logits, batch: Batch, tau):
  """FedNTD's not-true distillation loss (eq. 4; PFLlib's ``_ntd_loss``):
  tau^2 KL(softmax(g_nt / tau) || softmax(l_nt / tau)) over the classes
  other than each target's, summed over classes and averaged over counted
  targets. The global logits carry no gradient.

  Args:
    logits: the local model's [B, ..., C].
    global_logits: the global model's [B, ..., C].
    batch: the batch (targets, mask).
    tau: the temperature.

  Returns:
    The loss, a scalar.
  """
  num_classes = logits.shape[-1]
  y = jnp.maximum(batch.y, 0)
  not_true = jnp.arange(num_classes) != y[..., None]
  masked = lambda z: jnp.where(not_true, z / tau, -jnp.inf)
  log_p = jax.nn.log_softmax(masked(logits))
  log_q = jax.nn.log_softmax(masked(jax.lax.stop_gradient(global_logits)))
  kl = jnp.sum(
    jnp.where(not_true, jnp.exp(log_q) * (log_q - log_p), 0.0), axis=-1
  )
  counted = target_mask(batch)
  return (
    tau**2
    * jnp.sum(jnp.where(counted, kl, 0.0))
    / jnp.maximum(jnp.sum(counted), 1)
  )


def ntd_objective(model: Model, beta, tau):
  """``ctx -> objective``: the cross-entropy plus beta times the not-true
  distillation from the broadcast global model (``ctx.shared``)."""

  def objective_fn(ctx: ClientContext):
    def objective(params, batch: Batch):
      out = forward(model, params, batch)
      loss, stats = logits_loss(model, out.logits, batch, out.state)
      global_logits = model.apply(ctx.shared, batch.x)
      ntd = not_true_distillation(out.logits, global_logits, batch, tau)
      return loss + beta * ntd, stats

    return objective

  return objective_fn


def build(
  training: TrainingConfig,
  config: FedNTDConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedNTD, built as ``AlgorithmSpec.build`` says; its settings
  ``FedNTDConfig``."""
  return fedavg(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    server_optimizer=training.make_server_optimizer(),
    weighting=training.filled_weighting(),
    objective_fn=ntd_objective(model, config.beta, config.tau),
    name='fedntd',
  )


SPEC = AlgorithmSpec(
  'fedntd',
  FedNTDConfig,
  build,
  FEDAVG_SETTINGS,
  model_state=True,
  default_weighting='uniform',
  summary='FedNTD (Lee et al. 2022): FedAvg + not-true distillation',
)
