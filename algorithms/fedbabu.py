"""FedBABU (Oh et al., "FedBABU: Towards Enhanced Representation for
Federated Image Classification", ICLR 2022, arXiv 2106.06042): FedAvg of the
body alone, the head frozen at its initialization during federated training
(every client's head is the same random one), then fine-tuned with the body
on each client before it is evaluated.

As PFLlib's ``clientbabu.py`` / ``serverbabu.py``: local SGD moves the body
only (the head's gradient is not applied: ``optax.set_to_zero`` on it); the
server averages the bodies; the head never moves. Its clients fine-tune the
whole model for ``fine_tuning_epochs`` (``-fte``, 10) at the end, starting
from the model of their last round's local training (PFLlib's loop trains
once more after its last aggregation, whose result it never evaluates). So
the evaluation here fine-tunes as PFLlib's last step does: one round's local
training with the head frozen, then ``fine_tuning_epochs`` epochs of the
whole model, at the client learning rate; ``--fedbabu_finetune_from=global``
fine-tunes the aggregated model itself (the paper's reading).
"""

import dataclasses
from typing import ClassVar

import jax
import optax

from fedjax_personal.algorithms.fedavg import fedavg
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
from fedjax_personal.core.algorithm import Communication, FederatedAlgorithm
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.losses import plain_objective
from fedjax_personal.core.training import local_sgd
from fedjax_personal.core.tree_util import tree_bytes
from fedjax_personal.models import HeadSplit, Model

__all__ = ['build', 'FedBABUConfig', 'frozen_head', 'SPEC']

STARTS = ('local', 'global')


@dataclasses.dataclass(frozen=True)
class FedBABUConfig(Declared):
  """FedBABU's own settings: the ``--fedbabu_*`` flags."""

  prefix: ClassVar[str] = 'fedbabu'
  fine_tuning_epochs: int = hparam(
    10,
    'Epochs of whole-model fine-tuning before evaluation (PFLlib -fte).',
    minimum=0,
  )
  finetune_from: str = hparam(
    'local',
    "What the evaluation fine-tunes: 'local' (PFLlib's: the model of one more "
    "round's local training, head frozen) or 'global' (the aggregated model).",
    choices=STARTS,
  )


def head_labels(head: HeadSplit, params):
  """The parameter tree labelled 'body' / 'head' (``optax.multi_transform``)."""
  body, top = head.split(params)
  return head.merge(
    jax.tree.map(lambda _: 'body', body), jax.tree.map(lambda _: 'head', top)
  )


def frozen_head(
  optimizer: optax.GradientTransformation, head: HeadSplit
) -> optax.GradientTransformation:
  """``optimizer`` on the body; the head's updates set to zero (PyTorch's
  ``requires_grad = False``: no step at all, whatever the optimizer).

  Args:
    optimizer: the client optimizer.
    head: the model's split.

  Returns:
    The optax transformation.
  """
  return optax.multi_transform(
    {'body': optimizer, 'head': optax.set_to_zero()},
    lambda params: head_labels(head, params),
  )


def babu_finetune(
  model: Model,
  frozen: optax.GradientTransformation,
  whole: optax.GradientTransformation,
  batching: Batching,
  epochs: int,
  from_local: bool,
):
  """``(params, local_data, key) -> params``: PFLlib's last step (one round
  of body-only training with ``frozen`` when ``from_local``), then
  ``epochs`` epochs of the whole model with ``whole`` (the client
  optimizer, as PFLlib's ``fine_tune`` steps its own)."""
  objective = plain_objective(model)
  full = dataclasses.replace(batching, num_epochs=epochs, num_steps=None)

  def finetune(params, local, key):
    k_round, k_tune = jax.random.split(key)
    if from_local:
      params = local_sgd(
        params, objective, frozen, local.train, k_round, batching
      )[0]
    if epochs == 0:
      return params
    return local_sgd(params, objective, whole, local.train, k_tune, full)[0]

  return finetune


def build(
  training: TrainingConfig,
  config: FedBABUConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedBABU, built as ``AlgorithmSpec.build`` says; its settings
  ``FedBABUConfig``."""
  head = model.require_head('--algorithm=fedbabu')
  client_optimizer = frozen_head(training.make_client_optimizer(), head)
  batching = training.batching()
  alg = fedavg(
    model,
    data.num_clients,
    client_optimizer,
    batching,
    server_optimizer=training.make_server_optimizer(),
    weighting=training.filled_weighting(),
    name='fedbabu',
    finetune=babu_finetune(
      model,
      client_optimizer,
      training.make_client_optimizer(),
      batching,
      config.fine_tuning_epochs,
      config.finetune_from == 'local',
    ),
  )

  def communication(state) -> Communication:
    body = tree_bytes(head.split(state.params).body)
    return Communication(body, body, 1)

  return alg.replace(communication=communication)


SPEC = AlgorithmSpec(
  'fedbabu',
  FedBABUConfig,
  build,
  CLIENT_OPTIMIZER | BATCHING | WEIGHTING | SERVER_OPTIMIZER,
  summary='FedBABU (Oh et al. 2022): FedAvg of the body, head frozen; '
  'fine-tuned before evaluation',
)
