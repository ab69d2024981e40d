"""Ditto (Li, Hu, Beirami and Smith, ICML 2021): fair and robust
personalization.

Global model: FedAvg (local training from the broadcast w). Personal model v_i
of each client: local steps on f_i(v) + lambda/2 ||v - w||^2 with w the
received global model, taken on the same batches, by the client optimizer at
the personal learning rate. lambda -> infinity gives the global model;
lambda = 0 gives Local training. Clients are evaluated with v_i.
"""

import dataclasses
from typing import ClassVar, Optional

import jax
import optax

from fedjax_personal.algorithms.fedavg import FEDAVG_SETTINGS
from fedjax_personal.algorithms.global_personal import (
  global_personal_algorithm,
  two_model_work,
)
from fedjax_personal.config import (
  AlgorithmSpec,
  BuildData,
  Declared,
  TrainingConfig,
  hparam,
)
from fedjax_personal.core.algorithm import FederatedAlgorithm
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.losses import Batch
from fedjax_personal.core.training import ClientContext, batch_loss
from fedjax_personal.core.tree_util import PyTree
from fedjax_personal.models import Model

__all__ = ['build', 'ditto', 'DittoConfig', 'SPEC']


@dataclasses.dataclass(frozen=True)
class DittoConfig(Declared):
  """Ditto's settings: the ``--ditto_*`` flags.

  Declared once (``hparam``: default, help, range, sweepable)."""

  prefix: ClassVar[str] = 'ditto'
  lam: float = hparam(
    0.1,
    'Proximal coefficient lambda of the personal objective.',
    minimum=0,
    sweep=True,
  )
  personal_lr: Optional[float] = hparam(
    None,
    'Learning rate of the personal model (default: --client_lr).',
    minimum=0,
    open_min=True,
    sweep=True,
  )


def ditto(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  lam: float = 0.1,
  personal_optimizer: Optional[optax.GradientTransformation] = None,
  server_optimizer: Optional[optax.GradientTransformation] = None,
  weighting: str = 'num_examples',
  finetune=None,
):
  """Builds Ditto (``personal_optimizer`` default: the client optimizer).

  Args:
    model: the model (pure ``init`` / ``apply``).
    num_clients: N: per-client state has N rows.
    client_optimizer: the optax client optimizer.
    batching: local batching (epochs or steps, batch size).
    lam: lambda, the pull of the personal model toward the global one.
    personal_optimizer: the personal model's optimizer (default: the client
      optimizer).
    server_optimizer: applied to the mean update; default ``optax.sgd(1.0)``.
    weighting: ``'num_examples'`` (n_i-weighted mean), ``'tokens'``
      (``fedavg.train_tokens``) or ``'uniform'``.
    finetune: optional evaluation fine-tuning (``training.sgd_finetune``).

  Returns:
    The ``FederatedAlgorithm``.
  """

  def step(ctx: ClientContext, w: PyTree, v: PyTree, batch: Batch):
    grad = lambda p: jax.value_and_grad(
      lambda q: batch_loss(model, q, batch), has_aux=True
    )(p)
    (_, aux_w), gw = grad(w)
    (_, aux_v), gv = grad(v)
    gv = jax.tree.map(lambda g, a, w0: g + lam * (a - w0), gv, v, ctx.shared)
    return gw, gv, aux_v, aux_w

  work = two_model_work(
    step, batching, client_optimizer, personal_optimizer or client_optimizer
  )
  return global_personal_algorithm(
    'ditto',
    model,
    num_clients,
    work,
    server_optimizer,
    weighting,
    finetune=finetune,
  )


def build(
  training: TrainingConfig,
  config: DittoConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """Ditto, built as ``AlgorithmSpec.build`` says; its settings
  ``DittoConfig``."""
  return ditto(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    lam=config.lam,
    personal_optimizer=(
      None
      if config.personal_lr is None
      else training.make_client_optimizer(config.personal_lr)
    ),
    server_optimizer=training.make_server_optimizer(),
    weighting=training.filled_weighting(),
  )


SPEC = AlgorithmSpec(
  'ditto',
  DittoConfig,
  build,
  FEDAVG_SETTINGS,
  model_state=True,
  summary='Ditto (Li et al. 2021): personal models with a proximal term',
)
