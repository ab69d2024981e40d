"""FD, Federated Distillation (Jeong et al., "Communication-Efficient
On-Device Machine Learning: Federated Distillation and Augmentation under
Non-IID Private Data", 2018, arXiv 1811.11479): no model is exchanged; each
client uploads its per-class average logits, the server averages them per
class, and each client distills the global average logits of an example's
label into its own model.

As PFLlib's ``clientfd.py`` / ``serverfd.py`` (the structure of
``fedproto.class_means_exchange``, logits in place of features): the
distillation term is PyTorch's ``CrossEntropyLoss`` with soft targets whose rows
are the global average logits of the label, used as they are (not passed through
a softmax: PFLlib hands the raw logits to the loss as probabilities), and the
example's own logits, fixed, where the label has no global average; weighted by
lambda; none before the first table. The averages are taken over every step of
the client's epochs, before each step. A client is evaluated with its own model.
"""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import optax

from fedjax_personal.algorithms.fedproto import class_means_exchange
from fedjax_personal.config import (
  BATCHING,
  CLIENT_OPTIMIZER,
  AlgorithmSpec,
  BuildData,
  Declared,
  TrainingConfig,
  hparam,
)
from fedjax_personal.core.algorithm import FederatedAlgorithm
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.data import LocalData
from fedjax_personal.core.losses import Batch, LossStats, evaluate_params
from fedjax_personal.models import Model

__all__ = ['build', 'fd', 'FDConfig', 'raw_logit_distillation', 'SPEC']


@dataclasses.dataclass(frozen=True)
class FDConfig(Declared):
  """FD's own settings: the ``--fd_*`` flags (PFLlib's defaults)."""

  prefix: ClassVar[str] = 'fd'
  lamda: float = hparam(
    1.0,
    'Weight lambda of the distillation (PFLlib -lam).',
    minimum=0,
    sweep=True,
  )


def raw_logit_distillation(logits, labels, mask, table, present):
  """PFLlib's FD term: the soft-target cross-entropy -sum_c t_c
  log_softmax(logits)_c averaged over the batch's real examples, t the
  global average logits of the label (raw) or, without one, the example's
  own logits (fixed).

  Args:
    logits: [B, K].
    labels: int [B] (in range).
    mask: bool [B], the real examples.
    table: [K, K] the global average logits per label.
    present: bool [K], the labels with one.

  Returns:
    A scalar.
  """
  own = jax.lax.stop_gradient(logits)
  target = jnp.where(present[labels][:, None], table[labels], own)
  ce = -jnp.sum(target * jax.nn.log_softmax(logits), axis=-1)
  return jnp.sum(jnp.where(mask, ce, 0)) / jnp.maximum(jnp.sum(mask), 1)


def fd(
  model: Model,
  num_clients: int,
  num_classes: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  lamda: float = 1.0,
) -> FederatedAlgorithm:
  """Builds FD.

  Args:
    model: the model (logits [B, K]).
    num_clients: N.
    num_classes: K.
    client_optimizer: the client optimizer.
    batching: local batching.
    lamda: the distillation's weight.

  Returns:
    The ``FederatedAlgorithm``.
  """

  def represent(out):
    return out.logits

  def penalty(out, batch: Batch, table, present):
    labels = jnp.clip(batch.y, 0, num_classes - 1)
    term = raw_logit_distillation(
      out.logits, labels, batch.mask, table, present
    )
    # no term before the first table (PFLlib's global_logits None)
    return jnp.where(jnp.any(present), lamda * term, 0.0)

  def evaluate_client(parts, local: LocalData, test, key) -> LossStats:
    del local, key
    return evaluate_params(model, parts['model'], test)

  return class_means_exchange(
    'fd',
    model,
    num_clients,
    num_classes,
    num_classes,
    client_optimizer,
    batching,
    represent,
    penalty,
    evaluate_client,
    features=False,
  )


def build(
  training: TrainingConfig,
  config: FDConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FD, built as ``AlgorithmSpec.build`` says; its settings ``FDConfig``."""
  return fd(
    model,
    data.num_clients,
    data.num_classes,
    training.make_client_optimizer(),
    training.batching(),
    config.lamda,
  )


SPEC = AlgorithmSpec(
  'fd',
  FDConfig,
  build,
  CLIENT_OPTIMIZER | BATCHING,
  summary='FD (Jeong et al. 2018): personal models, per-class average '
  'logits exchanged and distilled',
)
