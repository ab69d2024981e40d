"""FedSGD (McMahan et al. 2017): each active client takes one gradient step
(on its full local data by default, or on one minibatch) and the server
averages the models, i.e. one large-batch SGD step per round."""

import optax

from fedjax_personal.algorithms.fedavg import fedavg
from fedjax_personal.config import (
  CLIENT_OPTIMIZER,
  FINETUNE,
  SERVER_OPTIMIZER,
  WEIGHTING,
  AlgorithmSpec,
  BuildData,
  Declared,
  NoConfig,
  TrainingConfig,
)
from fedjax_personal.core.algorithm import FederatedAlgorithm
from fedjax_personal.core.batching import Batching
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import Model

__all__ = ['build', 'check', 'fedsgd', 'SPEC']


def fedsgd(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batch_size=None,
  **kw,
):
  """Builds FedSGD (``batch_size=None``: the full local batch); ``kw`` as for
  ``fedavg``.

  Args:
    model: the model (pure ``init`` / ``apply``).
    num_clients: N: per-client state has N rows.
    client_optimizer: the optax client optimizer.
    batch_size: the full-batch gradient's chunk size.
    kw: as for ``fedavg`` (server optimizer, weighting, fine-tuning).

  Returns:
    The ``FederatedAlgorithm``.
  """
  return fedavg(
    model,
    num_clients,
    client_optimizer,
    Batching(batch_size=batch_size, num_epochs=None, num_steps=1),
    name='fedsgd',
    **kw,
  )


def build(
  training: TrainingConfig,
  config: Declared,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedSGD, built as ``AlgorithmSpec.build`` says."""
  del config
  return fedsgd(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    batch_size=training.batch_size or None,
    server_optimizer=training.make_server_optimizer(),
    weighting=training.filled_weighting(),
  )


def check(training, config):
  """One local step from a fresh optimizer state: heavy-ball momentum is then
  plain SGD (its buffer is the first gradient)."""
  del config
  if training.client_momentum and training.client_opt_state == 'reset':
    raise ConfigError(
      'client_momentum',
      'does nothing for fedsgd (one local step from a fresh '
      'momentum buffer); use --server_momentum, or '
      '--client_opt_state=persistent',
    )


# batch_size applies (one minibatch step instead of the full batch); the
# number of local epochs/steps does not (always one step).
SPEC = AlgorithmSpec(
  'fedsgd',
  NoConfig,
  build,
  CLIENT_OPTIMIZER | WEIGHTING | SERVER_OPTIMIZER | FINETUNE | {'batch_size'},
  check=check,
  summary='FedSGD: one local gradient step (full batch default)',
)
