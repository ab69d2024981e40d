"""Personalized FedDyn (Acar et al., ICML 2021, "Debiasing model updates for
improving personalized federated training"; seed: the "Customizing FL to the
edge" slides).

The server/client debiasing of FedDyn (``feddyn.py``) with one of three ways to
make the shared model personal, each evaluated per device:

1. ``finetune``: plain FedDyn training; at evaluation each device takes a few
   full-batch gradient steps on its own training data (1 step, lr 0.1).
2. ``maml``: the data term is the loss on a query batch after ``inner_steps``
   differentiable SGD steps (lr ``inner_lr``) on a support batch (two
   independent batches per local step); evaluation adapts the same way on the
   device's training data.
3. ``prototype`` (metric): penultimate features define class prototypes (class
   means of the support features); logits are minus squared distances; loss is
   cross-entropy on a query batch. Evaluation builds the prototypes from all of
   the device's training data. Robust to per-device class-index permutations,
   since nothing ties class j on one device to class j on another.
"""

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
import optax

from fedjax_personal.algorithms.feddyn import (
  FEDDYN_SETTINGS,
  FedDynConfig,
  feddyn,
  feddyn_options,
)
from fedjax_personal.config import (
  FINETUNE,
  AlgorithmSpec,
  BuildData,
  TrainingConfig,
  hparam,
)
from fedjax_personal.core.algorithm import FederatedAlgorithm
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.training import (
  Batch,
  LossStats,
  batch_loss,
  evaluate_params,
  part,
  per_example_stats,
  sgd_finetune,
)
from fedjax_personal.errors import ConfigError
from fedjax_personal.hparams import require_filled
from fedjax_personal.models import Model

__all__ = [
  'all_examples',
  'class_means',
  'class_prototypes',
  'FT_SPEC',
  'maml_objective',
  'MAML_SPEC',
  'pfeddyn',
  'PFedDynConfig',
  'PROTO_SPEC',
  'prototype_logits',
  'prototype_objective',
]


HEADS = ('finetune', 'maml', 'prototype')


@dataclasses.dataclass(frozen=True)
class PFedDynConfig(FedDynConfig):
  """FedDyn's settings (defaults as FedDyn's but alpha) plus the MAML head's."""

  prefix: ClassVar[str] = 'pfeddyn'
  alpha: Optional[float] = hparam(  # type: ignore[assignment]  # None: the head's default
    None,
    'FedDyn alpha (default 0.01; 0.1 for pfeddyn_proto, as the authors).',
    minimum=0,
    open_min=True,
    sweep=True,
  )
  maml_inner_steps: int = hparam(5, 'pfeddyn_maml: inner SGD steps.', minimum=1)
  maml_inner_lr: float = hparam(
    1e-2, 'pfeddyn_maml: inner learning rate.', minimum=0, open_min=True
  )


def support_query(batch: Batch):
  """Splits a two-batch step ([2, B, ...]) into (support, query)."""
  return part(batch, 0), part(batch, 1)


def inner_sgd(
  model: Model,
  params,
  support: Batch,
  steps: int,
  lr: float,
  first_order: bool = False,
):
  """``steps`` SGD steps on the support batch; differentiable unless
  ``first_order`` (then the inner gradients are constants)."""
  for _ in range(steps):
    g = jax.grad(lambda p: batch_loss(model, p, support)[0])(params)
    if first_order:
      g = jax.lax.stop_gradient(g)
    params = jax.tree.map(lambda p, gg: p - lr * gg, params, g)
  return params


def maml_objective(
  model: Model,
  inner_steps: int = 5,
  inner_lr: float = 1e-2,
  first_order: bool = False,
):
  """MAML data term: query loss after inner SGD on the support batch.

  Args:
    model: the model.
    inner_steps: inner SGD steps.
    inner_lr: the inner step size.
    first_order: drop the second-order term.

  Returns:
    ``objective(params, batch) -> (loss, stats)``.
  """

  def objective(params, batch):
    support, query = support_query(batch)
    return batch_loss(
      model,
      inner_sgd(model, params, support, inner_steps, inner_lr, first_order),
      query,
    )

  return objective


def all_examples(data) -> Batch:
  """A client's every real example as one masked ``Batch``.

  Args:
    data: one client's ``ClientData``.

  Returns:
    Every real example as one ``Batch``.
  """
  return Batch(data.x, data.y, jnp.arange(data.x.shape[0]) < data.num_examples)


def maml_evaluate(model: Model, inner_steps: int = 5, inner_lr: float = 1e-2):
  """Adapt with the inner loop on the device's training data, then test."""

  def evaluate(params, local, test, key):
    del key
    adapted = inner_sgd(
      model, params, all_examples(local.train), inner_steps, inner_lr
    )
    return evaluate_params(model, adapted, test)

  return evaluate


def class_means(features, labels, mask, num_classes: int):
  """Per class, the masked examples counted and their features' mean (0
  where none): the class means every prototype method here takes (FedProto's,
  FedGH's, FedAS's prototypes, FedPAC's statistics).

  Args:
    features: embeddings [n, d].
    labels: labels [n].
    mask: the examples counted [n].
    num_classes: K.

  Returns:
    ``(counts [K], means [K, d])``.
  """
  one_hot = (labels[:, None] == jnp.arange(num_classes)[None, :]) & mask[
    :, None
  ]
  one_hot = one_hot.astype(features.dtype)
  counts = one_hot.sum(axis=0)
  return counts, one_hot.T @ features / jnp.maximum(counts, 1.0)[:, None]


def class_prototypes(features, labels, mask, num_classes: int):
  """Class means of the masked features: ([C, d] prototypes, [C] present).

  Args:
    features: embeddings [n, d].
    labels: labels [n].
    mask: real examples [n].
    num_classes: K.

  Returns:
    ``(prototypes [K, d], present [K])``.
  """
  counts, protos = class_means(features, labels, mask, num_classes)
  return protos, counts > 0


def prototype_logits(features, prototypes, present):
  """Logits = minus squared Euclidean distance to each present prototype.

  Args:
    features: embeddings [n, d].
    prototypes: class prototypes [K, d].
    present: classes with a prototype [K].

  Returns:
    Logits [n, K].
  """
  d2 = (
    jnp.sum(features**2, -1, keepdims=True)
    - 2 * features @ prototypes.T
    + jnp.sum(prototypes**2, -1)[None, :]
  )
  return jnp.where(present[None, :], -d2, -1e9)


def prototype_objective(model: Model, num_classes: int):
  """Prototypical-network data term: support prototypes, query cross-entropy.

  Args:
    model: the model.
    num_classes: K.

  Returns:
    ``objective(params, batch) -> (loss, stats)``.
  """

  def objective(params, batch):
    support, query = support_query(batch)
    protos, present = class_prototypes(
      model.features(params, support.x), support.y, support.mask, num_classes
    )
    logits = prototype_logits(model.features(params, query.x), protos, present)
    stats = per_example_stats(logits, query.y, query.mask)
    return stats.loss_sum / jnp.maximum(stats.count, 1.0), stats

  return objective


def prototype_evaluate(model: Model, num_classes: int):
  """Prototypes from all the device's training data; test by nearest
  prototype."""

  def evaluate(params, local, test, key) -> LossStats:
    del key
    train = all_examples(local.train)
    protos, present = class_prototypes(
      model.features(params, train.x), train.y, train.mask, num_classes
    )
    logits = prototype_logits(model.features(params, test.x), protos, present)
    return per_example_stats(
      logits, test.y, jnp.arange(test.x.shape[0]) < test.num_examples
    )

  return evaluate


def pfeddyn(
  model: Model,
  num_clients: int,
  num_examples,
  num_classes: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  head: str = 'prototype',
  alpha: Optional[float] = None,
  inner_steps: int = 5,
  inner_lr: float = 1e-2,
  finetune_lr: float = 0.1,
  finetune_steps: int = 1,
  **feddyn_kw,
):
  """Builds personalized FedDyn with the given head.

  Args:
    head: 'finetune', 'maml' or 'prototype'.
    alpha: FedDyn alpha (default 1e-2, 1e-1 for prototypes, as the authors).
    inner_steps, inner_lr: MAML inner loop (5 steps at 1e-2).
    finetune_lr, finetune_steps: evaluation fine-tuning of the 'finetune'
      head (full-batch steps on the device's training data).
    feddyn_kw: further FedDyn options (adaptive_alpha, max_grad_norm,
      eval_model).

  Returns:
    The ``FederatedAlgorithm``.
  """
  if head not in HEADS:
    raise ConfigError(
      'algorithm', f'pfeddyn head must be one of {HEADS}, got {head!r}'
    )
  if alpha is None:
    alpha = 1e-1 if head == 'prototype' else 1e-2
  common = dict(
    model=model,
    num_clients=num_clients,
    num_examples=num_examples,
    client_optimizer=client_optimizer,
    batching=batching,
    alpha=alpha,
    **feddyn_kw,
  )
  if head == 'finetune':
    ft = (
      sgd_finetune(
        model,
        finetune_lr,
        Batching(None, num_epochs=None, num_steps=finetune_steps),
      )
      if finetune_steps > 0
      else None
    )
    return feddyn(finetune=ft, name='pfeddyn_ft', **common)
  if head == 'maml':
    return feddyn(
      data_objective=maml_objective(model, inner_steps, inner_lr),
      batches_per_step=2,
      evaluate_client=maml_evaluate(model, inner_steps, inner_lr),
      name='pfeddyn_maml',
      **common,
    )
  return feddyn(
    data_objective=prototype_objective(model, num_classes),
    batches_per_step=2,
    evaluate_client=prototype_evaluate(model, num_classes),
    name='pfeddyn_proto',
    **common,
  )


def _build(head):
  def build(
    training: TrainingConfig,
    config: PFedDynConfig,
    model: Model,
    data: BuildData,
  ) -> FederatedAlgorithm:
    return pfeddyn(
      model,
      data.num_clients,
      data.train.num_examples,
      data.num_classes,
      training.make_client_optimizer(),
      training.batching(),
      head=head,
      alpha=config.alpha,
      inner_steps=config.maml_inner_steps,
      inner_lr=config.maml_inner_lr,
      finetune_lr=0.1 if training.finetune_lr is None else training.finetune_lr,
      finetune_steps=require_filled(training, 'finetune_steps'),
      **feddyn_options(config),
    )

  return build


_MAML = frozenset({'maml_inner_steps', 'maml_inner_lr'})
# The MAML and prototype heads adapt at evaluation in their own way (inner
# loop, prototypes of the training data): evaluation fine-tuning does not apply.
FT_SPEC = AlgorithmSpec(
  'pfeddyn_ft',
  PFedDynConfig,
  _build('finetune'),
  FEDDYN_SETTINGS,
  ignores=_MAML,
  default_finetune_steps=1,
  summary='Personalized FedDyn + fine-tuning (1 full-batch step, lr 0.1)',
)
MAML_SPEC = AlgorithmSpec(
  'pfeddyn_maml',
  PFedDynConfig,
  _build('maml'),
  FEDDYN_SETTINGS - FINETUNE,
  summary='Personalized FedDyn with a MAML objective',
)
PROTO_SPEC = AlgorithmSpec(
  'pfeddyn_proto',
  PFedDynConfig,
  _build('prototype'),
  FEDDYN_SETTINGS - FINETUNE,
  ignores=_MAML,
  summary='Personalized FedDyn with prototypes (metric head)',
)
