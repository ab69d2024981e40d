"""FedAS (Yang et al., "FedAS: Bridging Inconsistency in Personalized
Federated Learning", CVPR 2024): each client keeps its own model; at the
start of its round it aligns a copy of the global model's body to its own
class prototypes and takes that body under its own head (parameter
alignment), trains, and the server averages the trained models weighted by
each client's Fisher information (client synchronization).

A round on client i, as PFLlib's ``clientas.py`` / ``serveras.py``:
1. its class prototypes: the mean of its own model's features per class,
   over its training examples in shuffled batches of 16, the last partial
   batch dropped (its ``load_train_data(batch_size=16)``);
2. a copy of the global model's body takes one epoch of SGD at 0.01 over
   freshly shuffled batches of 16 on the sum over the batch's classes of
   the mean squared error between the global body's features of that
   class's examples and the client's prototype of it (its ``MSELoss``);
3. the client's model becomes that body under its own head, and trains as
   FedAvg's clients do;
4. its Fisher information trace: over its training batches (the run's batch
   size, shuffled, the last partial batch dropped), the sum of the squared
   gradients of the batch's mean negative log-likelihood, in evaluation mode.
The server's global model is the cohort's trained models (heads included)
weighted by their traces, normalized (``aggregate_wrt_fisher``). Clients
are evaluated with their own models.

As PFLlib runs it: a client not in the round computes a trace that nothing
reads (not computed here); every client's alignment starts from its own copy
of the global model. The alignment's rate, batch and epochs are its code's
constants, flags here.
"""

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import struct
from optax import tree_utils as otu

from fedjax_personal.algorithms import pfeddyn
from fedjax_personal.algorithms.fedavg import (
  FEDAVG_SETTINGS,
  global_server_update,
  summed_upload,
)
from fedjax_personal.config import (
  FINETUNE,
  WEIGHTING,
  AlgorithmSpec,
  BuildData,
  Declared,
  TrainingConfig,
  hparam,
)
from fedjax_personal.core.algorithm import (
  ClientModels,
  ClientRows,
  FederatedAlgorithm,
  RoundContext,
)
from fedjax_personal.core.batching import (
  Batching,
  batch_indices,
  epoch_examples,
)
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.data import ClientData
from fedjax_personal.core.losses import (
  Batch,
  LossStats,
  batch_loss,
  features_of_real,
  get_batch,
  plain_objective,
  zero_stats,
)
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import (
  ClientContext,
  SGDCarry,
  extended_sgd_work,
  local_sgd,
  sgd_client_work,
)
from fedjax_personal.core.tree_util import PyTree, rows, tree_broadcast
from fedjax_personal.models import HeadSplit, Model

__all__ = [
  'align_body',
  'build',
  'fedas',
  'FedASConfig',
  'fisher_trace',
  'SPEC',
]


@dataclasses.dataclass(frozen=True)
class FedASConfig(Declared):
  """FedAS's own settings: the ``--fedas_*`` flags (PFLlib's constants)."""

  prefix: ClassVar[str] = 'fedas'
  align_lr: float = hparam(
    0.01,
    "SGD rate of the global body's alignment to the client's prototypes.",
    minimum=0,
    sweep=True,
  )
  align_batch_size: int = hparam(
    16,
    'Batch size of the prototypes and of the alignment (partial batches '
    'dropped).',
    minimum=1,
  )
  align_epochs: int = hparam(1, 'Epochs of the alignment.', minimum=0)


@struct.dataclass
class FedASState:
  """FedAS's state.

  Attributes:
    params: the global model (the Fisher-weighted mean of the last cohort).
    opt_state: the server optimizer's state.
    models: every client's own model (client rows, leading axis N).
  """

  params: optax.Params
  opt_state: optax.OptState
  models: PyTree


@struct.dataclass
class FedASCarry:
  """Local training's carry and the key of the trace's batches."""

  sgd: SGDCarry
  key: jax.Array


@struct.dataclass
class FedASOutput:
  """What one FedAS client returns.

  Attributes:
    delta: the global model minus its trained model (its weighted share
      once summed, weighted by ``fisher``).
    model: its trained model (its row, written by the engine).
    fisher: its Fisher information trace.
    num_examples: its training examples.
    stats: training statistics.
    num_steps: local steps taken.
  """

  delta: PyTree
  model: PyTree
  fisher: jax.Array
  num_examples: HostOrDevice
  stats: LossStats
  num_steps: Any = None


def dropped_batches(key, train: ClientData, batch_size: int):
  """One shuffled epoch of full batches (PyTorch's ``drop_last``): indices
  [S, B] and mask [S, B]."""
  n_max = train.y.shape[0]
  return batch_indices(
    key,
    jnp.asarray(train.num_examples),
    n_max,
    Batching(batch_size, num_epochs=1, drop_last=True),
  )


def used_prototypes(
  model: Model, params, train: ClientData, key, batch_size, num_classes
):
  """The client's class prototypes over the examples of one shuffled epoch
  of full batches (``clientas.py``'s ``set_parameters``), evaluation mode:
  ``(prototypes [C, D], present [C])``."""
  n_max = train.y.shape[0]
  used = epoch_examples(key, train.num_examples, n_max, batch_size, True)
  z = features_of_real(model, params, train.x, train.num_examples)
  z = z.reshape((n_max, -1))
  return pfeddyn.class_prototypes(z, jnp.asarray(train.y), used, num_classes)


def align_body(
  model: Model,
  head: HeadSplit,
  params,
  prototypes,
  present,
  train: ClientData,
  key,
  lr: float,
  batch_size: int,
  epochs: int,
):
  """The global model's body after the alignment epochs: SGD on, per batch,
  the sum over its classes with a prototype of the mean squared error
  between those examples' features and the prototype.

  Args:
    model: the model.
    head: its split.
    params: the global model.
    prototypes: [C, D] the client's prototypes.
    present: bool [C].
    train: the client's training split.
    key: draws the batches.
    lr: the SGD rate.
    batch_size: the alignment's batch (partial batches dropped).
    epochs: its epochs.

  Returns:
    The aligned body.
  """
  body, top = head.split(params)
  num_classes = prototypes.shape[0]
  align = Batching(batch_size, num_epochs=epochs, drop_last=True)
  if align.num_padded_steps(train.y.shape[0]) == 0:
    return body  # no full batch: PFLlib's loop takes no step

  def objective(b, batch: Batch):
    _, z = model.and_features(model.apply)(head.merge(b, top), batch.x)
    z = z.reshape((z.shape[0], -1))
    of = (batch.y[:, None] == jnp.arange(num_classes)) & batch.mask[:, None]
    of = of & present[None, :]
    sq = jnp.sum((z[:, None, :] - prototypes[None]) ** 2, axis=-1)  # [B, C]
    n = jnp.sum(of, axis=0)
    per_class = jnp.sum(jnp.where(of, sq, 0), axis=0) / jnp.maximum(
      n * z.shape[1], 1
    )
    return jnp.sum(jnp.where(n > 0, per_class, 0)), zero_stats()

  aligned, _ = local_sgd(
    body,
    objective,
    optax.sgd(lr),
    train,
    key,
    align,
    own_steps=True,
  )
  return aligned


def fisher_trace(model: Model, params, train: ClientData, key, batch_size):
  """The trace of the empirical Fisher information as PFLlib's FedAS sums
  it: over one shuffled epoch of full batches, the squared norm of the
  gradient of the batch's mean negative log-likelihood (evaluation mode).

  Args:
    model: the model.
    params: its parameters.
    train: the client's training split.
    key: draws the batches.
    batch_size: B.

  Returns:
    float32 scalar.
  """
  idx, mask = dropped_batches(key, train, batch_size)
  if idx.shape[0] == 0:
    return jnp.zeros(())

  def step(s, total):
    batch = get_batch(train, idx[s], mask[s])
    g = jax.grad(lambda p: batch_loss(model, p, batch)[0])(params)
    return total + sum(jnp.sum(a**2) for a in jax.tree.leaves(g))

  # the client's own full batches only (they come first)
  num = jnp.asarray(train.num_examples) // batch_size
  return jax.lax.fori_loop(0, num, step, jnp.zeros(()))


def fedas(
  model: Model,
  num_clients: int,
  num_classes: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  align_lr: float = 0.01,
  align_batch_size: int = 16,
  align_epochs: int = 1,
  server_optimizer=None,
) -> FederatedAlgorithm:
  """Builds FedAS.

  Args:
    model: the model (with a head).
    num_clients: N.
    num_classes: C.
    client_optimizer: the client optimizer.
    batching: local batching (its batch size is the trace's too).
    align_lr: the alignment's SGD rate.
    align_batch_size: the prototypes' and the alignment's batch.
    align_epochs: the alignment's epochs.
    server_optimizer: applied to the Fisher-weighted mean delta (default
      ``optax.sgd(1.0)``: the global model is the weighted mean).

  Returns:
    The ``FederatedAlgorithm``.
  """
  head = model.require_head('--algorithm=fedas')
  server_optimizer = server_optimizer or optax.sgd(1.0)
  fisher_batch = batching.batch_size or 1

  def init(key: jax.Array) -> FedASState:
    params = model.init(key)
    return FedASState(
      params, server_optimizer.init(params), tree_broadcast(params, num_clients)
    )

  def server_broadcast(state: FedASState, cohort: Cohort, rc: RoundContext):
    return state.params, rows(state.models, cohort.rows)

  def start(ctx: ClientContext, key) -> PyTree:
    """The client's own head under the global body aligned to its
    prototypes."""
    k_protos, k_align = jax.random.split(key)
    train = ctx.data.train
    protos, present = used_prototypes(
      model, ctx.state, train, k_protos, align_batch_size, num_classes
    )
    body = align_body(
      model,
      head,
      ctx.shared,
      protos,
      present,
      train,
      k_align,
      align_lr,
      align_batch_size,
      align_epochs,
    )
    return head.merge(body, head.split(ctx.state)[1])

  base = sgd_client_work(
    lambda ctx: plain_objective(model),
    client_optimizer,
    batching,
    final=lambda ctx, carry: carry,
    start_fn=lambda ctx: ctx.state,
  )

  def work_init(ctx: ClientContext, key: jax.Array) -> FedASCarry:
    k_start, k_fisher = jax.random.split(jax.random.fold_in(key, 1))
    started = dataclasses.replace(ctx, state=start(ctx, k_start))
    return FedASCarry(base.init(started, key), k_fisher)

  def work_final(ctx: ClientContext, carry: FedASCarry) -> FedASOutput:
    params = carry.sgd.params
    train = ctx.data.train
    return FedASOutput(
      delta=otu.tree_sub(ctx.shared, params),
      model=params,
      fisher=fisher_trace(model, params, train, carry.key, fisher_batch),
      num_examples=train.num_examples,
      stats=carry.sgd.stats,
      num_steps=carry.sgd.num_steps,
    )

  work = extended_sgd_work(base, work_init, work_final)

  return FederatedAlgorithm(
    name='fedas',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=summed_upload(
      work, 'uniform', weight_fn=lambda ctx, out: out.fisher
    ),
    server_update=global_server_update(server_optimizer),
    client_models=lambda state: ClientModels.personal(
      state.models, num_clients
    ),
    client_rows=ClientRows.field('models', output='model'),
  )


def build(
  training: TrainingConfig,
  config: FedASConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedAS, built as ``AlgorithmSpec.build`` says; its settings
  ``FedASConfig``."""
  return fedas(
    model,
    data.num_clients,
    data.num_classes,
    training.make_client_optimizer(),
    training.batching(),
    config.align_lr,
    config.align_batch_size,
    config.align_epochs,
    training.make_server_optimizer(),
  )


SPEC = AlgorithmSpec(
  'fedas',
  FedASConfig,
  build,
  FEDAVG_SETTINGS - FINETUNE - WEIGHTING,
  summary='FedAS (Yang et al. 2024): personal models; the global body '
  'aligned to client prototypes; Fisher-weighted aggregation',
)
