"""FedRoD (Chen & Chao, "On Bridging Generic and Personalized Federated
Learning for Image Classification", ICLR 2022, arXiv 2107.00778): one body
and two heads. The body and the generic head are trained by every client on
the balanced softmax loss (its eq. 5: the logits shifted by the log of the
client's class counts, Ren et al. 2020) and averaged by the server, FedAvg's
way; each client keeps a personal head trained, on the same features, to
correct the generic logits: its prediction is g(z) + p_i(z), with z the
body's features (its eq. 7).

As PFLlib's ``clientrod.py``: every step computes z and g(z) once; the body
and the generic head step on the balanced softmax loss; the personal head
steps on CE(g(z) + p_i(z), y) with z and g(z) held fixed (``detach``), from
that same forward pass. Both steps use the client optimizer (PFLlib: two
SGDs at the same rate); as each parameter receives only its own loss's
gradient, one optimizer over both parts is the same step. The personal head
starts as the initial generic head (PFLlib deep-copies it). A client's
counts are its training examples per class (PFLlib counts the examples of
its ``drop_last`` batches).

Evaluation is g(z) + p_i(z): the head's parameters summed (the head is a
dense layer, linear in its kernel and bias, so the sum is the same map up to
float rounding).
"""

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct
from optax import tree_utils as otu

from fedjax_personal.algorithms.fedavg import (
  FEDAVG_SETTINGS,
  global_server_update,
  summed_upload,
)
from fedjax_personal.config import (
  FINETUNE,
  AlgorithmSpec,
  BuildData,
  Declared,
  TrainingConfig,
)
from fedjax_personal.core.algorithm import (
  ClientModels,
  ClientRows,
  FederatedAlgorithm,
  RoundContext,
)
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.data import label_counts
from fedjax_personal.core.losses import Batch, LossStats, forward, logits_loss
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import ClientContext, sgd_client_work
from fedjax_personal.core.tree_util import (
  PyTree,
  leading_size,
  rows,
  tree_broadcast,
)
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import Dense, HeadSplit, Model

__all__ = ['build', 'fedrod', 'FedRoDConfig', 'FedRoDState', 'SPEC']


@dataclasses.dataclass(frozen=True)
class FedRoDConfig(Declared):
  """FedRoD has no settings of its own (PFLlib's has none)."""

  prefix: ClassVar[str] = 'fedrod'


@struct.dataclass
class FedRoDState:
  """FedRoD's state: the global model and the clients' personal heads.

  Attributes:
    params: the global model (body and generic head).
    opt_state: the server optimizer's state.
    heads: every client's personal head, leading axis N (client rows).
  """

  params: optax.Params
  opt_state: optax.OptState
  heads: PyTree


@struct.dataclass
class FedRoDOutput:
  """What one FedRoD client returns.

  Attributes:
    delta: the global model's delta (its weighted share once summed).
    head: the client's new personal head (written by the engine).
    num_examples: the client's training examples.
    stats: the personalized prediction's training statistics.
    num_steps: local steps taken.
  """

  delta: PyTree
  head: PyTree
  num_examples: HostOrDevice
  stats: LossStats
  num_steps: Any = None


def balanced_softmax_logits(logits, counts):
  """The balanced softmax's logits (Ren et al. 2020; FedRoD eq. 5): the
  logits plus log n_c (-inf for a class the client has none of).

  Args:
    logits: [B, ..., C].
    counts: [C] the client's examples per class.

  Returns:
    The shifted logits.
  """
  return logits + jnp.log(counts)


def rod_objective(model: Model, head: HeadSplit, num_classes: int):
  """``ctx -> objective`` over ``{'model', 'head'}``: the balanced softmax
  loss of the global model plus the cross-entropy of the generic logits
  (fixed) plus the personal head on the fixed features."""

  def objective_fn(ctx: ClientContext):
    counts = label_counts(ctx.data.train, num_classes)

    def objective(both, batch: Batch):
      out = forward(model, both['model'], batch, features=True)
      generic, _ = logits_loss(
        model, balanced_softmax_logits(out.logits, counts), batch
      )
      personal_logits = jax.lax.stop_gradient(out.logits) + head.logits(
        both['head'], jax.lax.stop_gradient(out.features)
      )
      personal, stats = logits_loss(model, personal_logits, batch)
      return generic + personal, stats

    return objective

  return objective_fn


def fedrod(
  model: Model,
  num_clients: int,
  num_classes: int,
  client_optimizer: optax.GradientTransformation,
  batching,
  server_optimizer=None,
  weighting: str = 'num_examples',
) -> FederatedAlgorithm:
  """Builds FedRoD.

  Args:
    model: the model; its head must be a dense layer (``Model.head``).
    num_clients: N.
    num_classes: C.
    client_optimizer: the client optimizer (both parts).
    batching: local batching.
    server_optimizer: applied to the mean delta (default ``optax.sgd(1.0)``).
    weighting: the mean's weighting (``fedavg.WEIGHTINGS``).

  Returns:
    The ``FederatedAlgorithm``.
  """
  head = model.require_head('--algorithm=fedrod')
  if not isinstance(head.module, (Dense, nn.Dense)):
    raise ConfigError(
      'model',
      f'--algorithm=fedrod evaluates g(z) + p(z) by summing its two heads, '
      f'which needs a dense head; model {model.name!r} ends in '
      f'{type(head.module).__name__}',
    )
  server_optimizer = server_optimizer or optax.sgd(1.0)

  def init(key: jax.Array) -> FedRoDState:
    params = model.init(key)
    return FedRoDState(
      params,
      server_optimizer.init(params),
      tree_broadcast(head.split(params)[1], num_clients),
    )

  def server_broadcast(state: FedRoDState, cohort: Cohort, rc: RoundContext):
    return state.params, rows(state.heads, cohort.rows)

  def final(ctx: ClientContext, carry):
    return FedRoDOutput(
      delta=otu.tree_sub(ctx.shared, carry.params['model']),
      head=carry.params['head'],
      num_examples=ctx.data.train.num_examples,
      stats=carry.stats,
      num_steps=carry.num_steps,
    )

  work = sgd_client_work(
    rod_objective(model, head, num_classes),
    client_optimizer,
    batching,
    final,
    start_fn=lambda ctx: {'model': ctx.shared, 'head': ctx.state},
    trained_like=lambda p: {'model': p, 'head': head.split(p)[1]},
  )

  def client_models(state: FedRoDState) -> ClientModels:
    body, generic = head.split(state.params)
    n = leading_size(state.heads)
    summed = jax.tree.map(lambda p, g: p + g, state.heads, generic)
    return ClientModels.personal(
      jax.vmap(head.merge)(tree_broadcast(body, n), summed), num_clients
    )

  return FederatedAlgorithm(
    name='fedrod',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=summed_upload(work, weighting),
    server_update=global_server_update(server_optimizer),
    client_models=client_models,
    client_rows=ClientRows.field('heads', output='head'),
  )


def build(
  training: TrainingConfig,
  config: FedRoDConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedRoD, built as ``AlgorithmSpec.build`` says; its settings
  ``FedRoDConfig``."""
  del config
  return fedrod(
    model,
    data.num_clients,
    data.num_classes,
    training.make_client_optimizer(),
    training.batching(),
    training.make_server_optimizer(),
    training.filled_weighting(),
  )


SPEC = AlgorithmSpec(
  'fedrod',
  FedRoDConfig,
  build,
  FEDAVG_SETTINGS - FINETUNE,
  summary='FedRoD (Chen & Chao 2022): balanced-softmax generic head + '
  'personal head',
)
