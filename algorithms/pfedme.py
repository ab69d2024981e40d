"""pFedMe (Dinh, Tran and Nguyen, NeurIPS 2020): personalization with Moreau
envelopes,

    min_w (1/N) sum_i F_i(w),  F_i(w) = min_theta f_i(theta) + lambda/2 ||theta - w||^2.

Each local step on a batch D: the personal model theta approximately solves the
inner problem by K steps theta <- theta - personal_lr (grad f(theta; D) +
lambda (theta - w_local)) (the paper's inner solver, plain gradient steps);
then w_local takes a client-optimizer step on the envelope's gradient
lambda (w_local - theta) (plain SGD at --client_lr is the paper's). The
server takes w <- (1 - beta) w + beta mean_i w_local: the server optimizer
(SGD) at beta = --server_lr on the mean delta. Clients are evaluated with
their personal theta_i. ``--pfedme_weight_decay`` adds mu theta to the inner
step's gradient, as PFLlib's ``pFedMeOptimizer`` does (mu 0.001 there).
"""

import dataclasses
from typing import ClassVar

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

__all__ = ['build', 'pfedme', 'PFedMeConfig', 'SPEC']


@dataclasses.dataclass(frozen=True)
class PFedMeConfig(Declared):
  """pFedMe's settings: the ``--pfedme_*`` flags.

  Declared once (``hparam``: default, help, range, sweepable)."""

  prefix: ClassVar[str] = 'pfedme'
  lam: float = hparam(
    15.0,
    'Moreau envelope coefficient lambda.',
    minimum=0,
    open_min=True,
    sweep=True,
  )
  personal_lr: float = hparam(
    0.01, 'Inner solver learning rate.', minimum=0, open_min=True, sweep=True
  )
  inner_steps: int = hparam(
    5, 'Inner solver steps K per local step.', minimum=1
  )
  weight_decay: float = hparam(
    0.0,
    "The inner solver's weight decay mu on theta (PFLlib's pFedMeOptimizer: "
    "0.001); 0: the paper's step.",
    minimum=0,
  )


def pfedme(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  lam: float = 15.0,
  personal_lr: float = 0.01,
  inner_steps: int = 5,
  server_optimizer=None,
  weighting: str = 'num_examples',
  finetune=None,
  weight_decay: float = 0.0,
):
  """Builds pFedMe (lambda 15, K 5 and personal lr 0.01 as the authors' MNIST
  setup; ``server_optimizer`` ``optax.sgd(beta)``, default beta = 1).

  Args:
    model: the model (pure ``init`` / ``apply``).
    num_clients: N: per-client state has N rows.
    client_optimizer: the optax client optimizer.
    batching: local batching (epochs or steps, batch size).
    lam: lambda, the Moreau envelope's coefficient.
    personal_lr: the personal model's step.
    inner_steps: steps solving the personal problem.
    server_optimizer: applied to the mean update; default ``optax.sgd(1.0)``.
    weighting: ``'num_examples'`` (n_i-weighted mean), ``'tokens'``
      (``fedavg.train_tokens``) or ``'uniform'``.
    finetune: optional evaluation fine-tuning (``training.sgd_finetune``).
    weight_decay: mu, the inner step's weight decay on theta (PFLlib's
      ``pFedMeOptimizer`` adds ``mu * theta``, mu 0.001; 0: the paper's).

  Returns:
    The ``FederatedAlgorithm``.
  """
  # w and theta are carried as (w, v) of two_model_work; theta's update is
  # the inner solver's result, applied through a unit-SGD "optimizer".
  identity_step = optax.sgd(1.0)

  def step(ctx: ClientContext, w: PyTree, theta: PyTree, batch: Batch):
    s = batch_loss(model, theta, batch)[1]
    new = theta
    for _ in range(inner_steps):
      g = jax.grad(lambda t: batch_loss(model, t, batch)[0])(new)
      new = jax.tree.map(
        lambda t, gg, ww: (
          t - personal_lr * (gg + lam * (t - ww) + weight_decay * t)
        ),
        new,
        g,
        w,
      )
    grad_w = jax.tree.map(lambda ww, t: lam * (ww - t), w, new)
    return grad_w, jax.tree.map(lambda a, b: a - b, theta, new), s

  # As the authors' code, theta restarts from the received model every round.
  work = two_model_work(
    step,
    batching,
    client_optimizer,
    identity_step,
    personal_start=lambda ctx: ctx.shared,
  )
  return global_personal_algorithm(
    'pfedme',
    model,
    num_clients,
    work,
    server_optimizer=server_optimizer,
    weighting=weighting,
    finetune=finetune,
  )


def build(
  training: TrainingConfig,
  config: PFedMeConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """pFedMe, built as ``AlgorithmSpec.build`` says; its settings
  ``PFedMeConfig``."""
  return pfedme(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    lam=config.lam,
    personal_lr=config.personal_lr,
    inner_steps=config.inner_steps,
    server_optimizer=training.make_server_optimizer(),
    weighting=training.filled_weighting(),
    weight_decay=config.weight_decay,
  )


SPEC = AlgorithmSpec(
  'pfedme',
  PFedMeConfig,
  build,
  FEDAVG_SETTINGS,
  summary='pFedMe (Dinh et al. 2020): Moreau envelopes; beta = --server_lr',
)
