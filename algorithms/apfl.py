"""APFL (Deng, Kamani and Mahdavi, 2020): adaptive personalized FL.

Each client keeps a personal model v_i and uses the mixture
alpha v_i + (1 - alpha) w of it with the global model w. Locally, on each
batch, w follows grad f(w) and v_i follows grad_v f(alpha v_i + (1 - alpha) w),
each with its own state of the client optimizer (SGD is the paper's). The
server averages the global models. alpha = 0 is FedAvg's global model;
alpha = 1 trains v_i alone (Local). The mixing weight is a fixed alpha here
(the paper's adaptive alpha update is not implemented).
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
from fedjax_personal.core.algorithm import ClientModels, FederatedAlgorithm
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.losses import Batch
from fedjax_personal.core.training import ClientContext, batch_loss
from fedjax_personal.core.tree_util import (
  PyTree,
  is_concrete,
  leading_size,
  tree_broadcast,
)
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import Model

__all__ = ['apfl', 'APFLConfig', 'build', 'mixture', 'SPEC']


@dataclasses.dataclass(frozen=True)
class APFLConfig(Declared):
  """APFL's settings: the ``--apfl_*`` flags.

  Declared once (``hparam``: default, help, range, sweepable)."""

  prefix: ClassVar[str] = 'apfl'
  alpha: float = hparam(
    0.25,
    'Mixing weight alpha of the personal model.',
    minimum=0,
    maximum=1,
    sweep=True,
  )


def mixture(alpha, personal, global_params):
  """APFL's mixed model ``alpha v + (1 - alpha) w`` (Deng et al., eq. 3).

  Args:
    alpha: the mixing weight.
    personal: the personal model v.
    global_params: the global model w.

  Returns:
    The mixed model.
  """
  return jax.tree.map(
    lambda v, w: alpha * v + (1 - alpha) * w, personal, global_params
  )


def apfl(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  alpha: float = 0.25,
  server_optimizer: Optional[optax.GradientTransformation] = None,
  weighting: str = 'num_examples',
  finetune=None,
):
  """Builds APFL with a fixed mixing weight ``alpha`` in [0, 1].

  Args:
    model: the model (pure ``init`` / ``apply``).
    num_clients: N: per-client state has N rows.
    client_optimizer: the optax client optimizer.
    batching: local batching (epochs or steps, batch size).
    alpha: the mixing weight of the personal model, in [0, 1].
    server_optimizer: applied to the mean update; default ``optax.sgd(1.0)``.
    weighting: ``'num_examples'`` (n_i-weighted mean), ``'tokens'``
      (``fedavg.train_tokens``) or ``'uniform'``.
    finetune: optional evaluation fine-tuning (``training.sgd_finetune``).

  Returns:
    The ``FederatedAlgorithm``.
  """
  if is_concrete(alpha) and not 0 <= alpha <= 1:
    raise ConfigError('apfl_alpha', f'must be in [0, 1], got {alpha}')

  def step(ctx: ClientContext, w: PyTree, v: PyTree, batch: Batch):
    gw = jax.grad(lambda q: batch_loss(model, q, batch)[0])(w)
    (_, s), gv = jax.value_and_grad(
      lambda vv: batch_loss(model, mixture(alpha, vv, w), batch), has_aux=True
    )(v)
    return gw, gv, s

  def eval_models(state):
    return ClientModels.personal(
      mixture(
        alpha,
        state.personal,
        tree_broadcast(state.params, leading_size(state.personal)),
      ),
      num_clients,
    )

  work = two_model_work(step, batching, client_optimizer, client_optimizer)
  return global_personal_algorithm(
    'apfl',
    model,
    num_clients,
    work,
    server_optimizer,
    weighting,
    eval_models=eval_models,
    finetune=finetune,
  )


def build(
  training: TrainingConfig,
  config: APFLConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """APFL, built as ``AlgorithmSpec.build`` says; its settings
  ``APFLConfig``."""
  return apfl(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    alpha=config.alpha,
    server_optimizer=training.make_server_optimizer(),
    weighting=training.filled_weighting(),
  )


SPEC = AlgorithmSpec(
  'apfl',
  APFLConfig,
  build,
  FEDAVG_SETTINGS,
  summary='APFL (Deng et al. 2020), fixed mixing weight',
)
