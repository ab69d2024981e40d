"""FedProto (Tan et al., "FedProto: Federated Prototype Learning across
Heterogeneous Clients", AAAI 2022, arXiv 2105.00243): no model is
exchanged; each client keeps its own model and uploads its class
prototypes, the server averages them per class, and each client's features
are pulled toward the global prototypes of their labels. A client predicts
the class whose global prototype is nearest.

A round on a client, as PFLlib's ``clientproto.py``: E epochs on the
cross-entropy plus lambda times PyTorch's ``MSELoss`` between the features
and a copy of them whose rows are replaced by the global prototype of their
label (where there is one; Eq. 6); its prototypes are the per-class means
of the features of every step of those epochs, taken before each step
(training mode), not of the trained model. The server's prototypes are the
per-class means over the round's clients holding the class, unweighted
(``proto_aggregation``), and replace the previous ones. Evaluation: the
client's features against the global prototypes by mean squared distance;
before the first prototypes, nothing is predicted (PFLlib counts no correct
prediction).
"""

import dataclasses
import math
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import struct

from fedjax_personal.algorithms.fedpac import alignment_loss
from fedjax_personal.config import (
  BATCHING,
  CLIENT_OPTIMIZER,
  AlgorithmSpec,
  BuildData,
  Declared,
  TrainingConfig,
  hparam,
)
from fedjax_personal.core.algorithm import (
  ClientModels,
  ClientRows,
  Communication,
  FederatedAlgorithm,
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.data import LocalData
from fedjax_personal.core.losses import (
  Batch,
  LossStats,
  forward,
  logits_loss,
  per_example_stats,
  zero_stats,
)
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import (
  ClientContext,
  ClientWork,
  client_opt_init,
  opt_update,
)
from fedjax_personal.core.tree_util import PyTree, rows, tree_broadcast
from fedjax_personal.models import Model

__all__ = [
  'build',
  'class_means_exchange',
  'fedproto',
  'FedProtoConfig',
  'nearest_prototype_logits',
  'server_prototypes',
  'SPEC',
]


@dataclasses.dataclass(frozen=True)
class FedProtoConfig(Declared):
  """FedProto's settings: the ``--fedproto_*`` flags.

  FedProto's own settings: the ``--fedproto_*`` flags (PFLlib's
  defaults)."""

  prefix: ClassVar[str] = 'fedproto'
  lamda: float = hparam(
    1.0,
    'Weight lambda of the distance to the global prototypes (PFLlib -lam).',
    minimum=0,
    sweep=True,
  )


@struct.dataclass
class FedProtoState:
  """FedProto's state.

  Attributes:
    protos: [K, D] the global prototypes.
    present: bool [K], the classes with one (none before the first round).
    models: every client's model (client rows).
  """

  protos: jax.Array
  present: jax.Array
  models: PyTree


@struct.dataclass
class FedProtoCarry:
  """Local SGD's state and the features summed per class."""

  params: PyTree
  opt_state: Any
  stats: LossStats
  num_steps: jax.Array
  sums: jax.Array
  counts: jax.Array


@struct.dataclass
class FedProtoOutput:
  """What one FedProto client returns.

  Attributes:
    protos: [K, D] its prototypes.
    present: bool [K] its classes.
    model: its trained model (its row, written by the engine).
    num_examples: its training examples.
    stats: training statistics.
    num_steps: local steps taken.
  """

  protos: jax.Array
  present: jax.Array
  model: PyTree
  num_examples: HostOrDevice
  stats: LossStats
  num_steps: Any = None


def server_prototypes(protos, present, active):
  """The per-class mean of the active clients' prototypes over those
  holding the class, unweighted (PFLlib's ``proto_aggregation``).

  Args:
    protos: [C, K, D] each client's.
    present: bool [C, K] the classes each holds.
    active: bool [C].

  Returns:
    ``(protos [K, D], present [K])``.
  """
  holds = (present & active[:, None]).astype(protos.dtype)
  count = jnp.sum(holds, axis=0)
  mean = (
    jnp.einsum('ck,ckd->kd', holds, protos) / jnp.maximum(count, 1)[:, None]
  )
  return mean, count > 0


#: The score of a class without a prototype (never predicted; finite, so
#: that the test loss stays a number).
ABSENT = -1e9


def nearest_prototype_logits(features, protos, present):
  """Minus the mean squared distance of each feature row to each present
  prototype (PyTorch's ``MSELoss``), ``ABSENT`` for a class without one.

  Args:
    features: [n, D].
    protos: [K, D].
    present: bool [K].

  Returns:
    [n, K].
  """
  d = jnp.mean((features[:, None, :] - protos[None]) ** 2, axis=-1)
  return jnp.where(present[None, :], -d, ABSENT)


def class_means_exchange(
  name: str,
  model: Model,
  num_clients: int,
  num_classes: int,
  dim: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  represent: Callable,
  penalty: Callable,
  evaluate_client: Callable,
  features: bool = True,
) -> FederatedAlgorithm:
  """An algorithm that exchanges per-class means of what a model computes
  instead of models (FedProto's features, FD's logits): each client keeps
  its own model and trains it on the cross-entropy plus ``penalty`` against
  the global table; its upload is the per-class mean of ``represent`` over
  every step of its epochs, taken before each step; the server's table is
  the per-class mean over the round's clients holding the class
  (``server_prototypes``).

  Args:
    name: the algorithm's name.
    model: the model.
    num_clients: N.
    num_classes: K.
    dim: D, the size of what is averaged.
    client_optimizer: the client optimizer.
    batching: local batching.
    represent: ``Forward -> [B, D]`` what is averaged per class.
    penalty: ``(Forward, batch, table [K, D], present [K]) -> loss`` added to
      the cross-entropy (weight included).
    evaluate_client: ``(parts, local, test, key) -> LossStats`` over
      ``{'model', 'table', 'present'}``.
    features: whether ``represent`` and ``penalty`` read the features (the
      model's head split) or the logits only.

  Returns:
    The ``FederatedAlgorithm``.
  """

  def init(key: jax.Array) -> FedProtoState:
    return FedProtoState(
      jnp.zeros((num_classes, dim), jnp.float32),
      jnp.zeros(num_classes, bool),
      tree_broadcast(model.init(key), num_clients),
    )

  def server_broadcast(state: FedProtoState, cohort: Cohort, rc: RoundContext):
    return (state.protos, state.present), rows(state.models, cohort.rows)

  def work_init(ctx: ClientContext, key) -> FedProtoCarry:
    del key
    return FedProtoCarry(
      params=ctx.state,
      opt_state=client_opt_init(ctx, client_optimizer.init, ctx.state),
      stats=zero_stats(),
      num_steps=jnp.zeros((), jnp.int32),
      sums=jnp.zeros((num_classes, dim), jnp.float32),
      counts=jnp.zeros(num_classes, jnp.float32),
    )

  def work_step(ctx: ClientContext, carry: FedProtoCarry, batch: Batch, key):
    del key
    table, present = ctx.shared

    def loss(params):
      out = forward(model, params, batch, features=features)
      ce, stats = logits_loss(model, out.logits, batch)
      extra = penalty(out, batch, table, present)
      return ce + extra, (stats, jax.lax.stop_gradient(represent(out)))

    (_, (stats, z)), grads = jax.value_and_grad(loss, has_aux=True)(
      carry.params
    )
    updates, opt_state = opt_update(
      client_optimizer, grads, carry.opt_state, carry.params, ctx
    )
    one_hot = (
      (batch.y[:, None] == jnp.arange(num_classes)) & batch.mask[:, None]
    ).astype(z.dtype)
    return FedProtoCarry(
      params=optax.apply_updates(carry.params, updates),
      opt_state=opt_state,
      stats=jax.tree.map(jnp.add, carry.stats, stats),
      num_steps=carry.num_steps + 1,
      sums=carry.sums + one_hot.T @ z,
      counts=carry.counts + one_hot.sum(axis=0),
    )

  def work_final(ctx: ClientContext, carry: FedProtoCarry) -> FedProtoOutput:
    return FedProtoOutput(
      protos=carry.sums / jnp.maximum(carry.counts, 1)[:, None],
      present=carry.counts > 0,
      model=carry.params,
      num_examples=ctx.data.train.num_examples,
      stats=carry.stats,
      num_steps=carry.num_steps,
    )

  work = ClientWork(
    init=work_init,
    step=work_step,
    final=work_final,
    batching=batching,
    init_opt_state=client_optimizer.init,
    opt_state=lambda carry: carry.opt_state,
  )

  def server_update(
    state: FedProtoState, cohort: Cohort, out: FedProtoOutput, rc: RoundContext
  ):
    protos, present = server_prototypes(out.protos, out.present, cohort.mask)
    some = jnp.any(cohort.mask)
    return (
      dataclasses.replace(
        state,
        protos=jnp.where(some, protos, state.protos),
        present=jnp.where(some, present, state.present),
      ),
      cohort_train_metrics(out.stats, cohort.mask),
    )

  def client_models(state: FedProtoState) -> ClientModels:
    n = jax.tree.leaves(state.models)[0].shape[0]
    return ClientModels.personal(
      {
        'model': state.models,
        'table': tree_broadcast(state.protos, n),
        'present': tree_broadcast(state.present, n),
      },
      num_clients,
    )

  table_bytes = num_classes * (dim * 4 + 1)
  return FederatedAlgorithm(
    name=name,
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=work,
    server_update=server_update,
    client_models=client_models,
    evaluate_client=evaluate_client,
    # the table and its classes up and down; no model
    communication=lambda state: Communication(table_bytes, table_bytes, 1),
    client_rows=ClientRows.field('models', output='model'),
  )


def fedproto(
  model: Model,
  num_clients: int,
  num_classes: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  lamda: float = 1.0,
) -> FederatedAlgorithm:
  """Builds FedProto.

  Args:
    model: the model (with a head).
    num_clients: N.
    num_classes: K.
    client_optimizer: the client optimizer.
    batching: local batching.
    lamda: the prototype distance's weight.

  Returns:
    The ``FederatedAlgorithm``.
  """
  head = model.require_head('--algorithm=fedproto')
  dim = math.prod(head.feature_shape)

  def represent(out):
    return out.features.reshape((out.features.shape[0], -1))

  def penalty(out, batch: Batch, protos, present):
    z = represent(out)
    return lamda * alignment_loss(z, batch.y, batch.mask, protos, present)

  def evaluate_client(parts, local: LocalData, test, key) -> LossStats:
    del local, key
    _, z = model.and_features(model.apply)(parts['model'], test.x)
    z = z.reshape((z.shape[0], -1))
    logits = nearest_prototype_logits(z, parts['table'], parts['present'])
    any_proto = jnp.any(parts['present'])
    logits = jnp.where(any_proto, logits, 0.0)
    mask = jnp.arange(test.x.shape[0]) < test.num_examples
    stats = per_example_stats(logits, test.y, mask)
    return stats._replace(correct=jnp.where(any_proto, stats.correct, 0.0))

  return class_means_exchange(
    'fedproto',
    model,
    num_clients,
    num_classes,
    dim,
    client_optimizer,
    batching,
    represent,
    penalty,
    evaluate_client,
  )


def build(
  training: TrainingConfig,
  config: FedProtoConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedProto, built as ``AlgorithmSpec.build`` says; its settings
  ``FedProtoConfig``."""
  return fedproto(
    model,
    data.num_clients,
    data.num_classes,
    training.make_client_optimizer(),
    training.batching(),
    config.lamda,
  )


SPEC = AlgorithmSpec(
  'fedproto',
  FedProtoConfig,
  build,
  CLIENT_OPTIMIZER | BATCHING,
  summary='FedProto (Tan et al. 2022): personal models, class prototypes '
  'exchanged, nearest-prototype prediction',
)
