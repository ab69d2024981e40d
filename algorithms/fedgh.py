"""FedGH (Yi et al., "FedGH: Heterogeneous Federated Learning with
Generalized Global Header", ACM MM 2023, arXiv 2303.13137): every client
keeps its own body; the server trains one global head on the clients' class
prototypes.

A round: each client trains its model (its body, the global head) on its
data, then uploads, for every class it has, the mean of its features over
its training examples of that class (in evaluation mode, after training);
the server takes one epoch of SGD on the global head over the uploaded
(prototype, class) pairs, shuffled, in batches of the client batch size,
with the cross-entropy (its eq. 6). Only the head comes down; a client's
body never leaves it.

PFLlib's server head is the first client's head object
(``self.head = self.clients[0].model.head``): when that client trains in
a round, its local steps move the server's head before the server's epoch,
which then starts from that client's trained head. That is the default
here (``--fedgh_head_start=first_client``: the population's first client,
when it is in the cohort); ``global`` starts from the round's global head
(the paper's reading).

As PFLlib's ``clientgh.py`` / ``servergh.py``: the head's SGD rate is
``-slr`` (1.0), its batches those of its ``DataLoader(shuffle=True,
drop_last=False)`` (here the order is drawn from the round's server key,
inside the compiled round), and the prototypes are the means of the
features of the client's training examples (PFLlib's of its ``drop_last``
batches).
"""

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
import optax.losses
from flax import struct

from fedjax_personal.algorithms import pfeddyn
from fedjax_personal.config import (
  BATCHING,
  CLIENT_OPTIMIZER,
  AlgorithmSpec,
  BuildData,
  Declared,
  TrainingConfig,
  hparam,
)
from fedjax_personal.core.aggregation import Sum
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
from fedjax_personal.core.data import ClientData
from fedjax_personal.core.losses import (
  LossStats,
  features_of_real,
  plain_objective,
)
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import ClientContext, sgd_client_work
from fedjax_personal.core.tree_util import (
  PyTree,
  leading_size,
  rows,
  tree_broadcast,
  tree_bytes,
  tree_scatter,
)
from fedjax_personal.models import HeadSplit, Model

__all__ = ['build', 'class_prototypes', 'fedgh', 'FedGHConfig', 'SPEC']

HEAD_STARTS = ('first_client', 'global')


@dataclasses.dataclass(frozen=True)
class FedGHConfig(Declared):
  """FedGH's own settings: the ``--fedgh_*`` flags (PFLlib's defaults)."""

  prefix: ClassVar[str] = 'fedgh'
  server_learning_rate: float = hparam(
    1.0,
    "SGD rate of the server's head training (PFLlib -slr).",
    minimum=0,
    open_min=True,
    sweep=True,
  )
  head_start: str = hparam(
    'first_client',
    "What the server's head epoch starts from: 'first_client' (PFLlib's: "
    "the first client's locally trained head, when it trained) or 'global' "
    "(the round's global head).",
    choices=HEAD_STARTS,
  )


@struct.dataclass
class FedGHState:
  """FedGH's state: the global head and the clients' bodies.

  Attributes:
    head: the global head.
    bodies: every client's body (client rows, leading axis N).
  """

  head: PyTree
  bodies: PyTree


@struct.dataclass
class FedGHOutput:
  """What one FedGH client returns.

  Attributes:
    body: the client's new body.
    prototypes: [C, *features] its per-class feature means (0 where absent).
    present: bool [C], the classes it has.
    first_head: the first client's trained head, summed over the cohort
      (zero from every other client), and how many sent it (0 or 1).
    num_examples: its training examples.
    stats: training statistics.
    num_steps: local steps taken.
  """

  body: PyTree
  prototypes: jax.Array
  present: jax.Array
  first_head: Any
  num_examples: HostOrDevice
  stats: LossStats
  num_steps: Any = None


def class_prototypes(model: Model, params, train: ClientData, num_classes):
  """A client's class prototypes: the mean of its training examples'
  features per class, in evaluation mode (PFLlib's ``collect_protos``).

  Args:
    model: the model (with a head).
    params: its parameters.
    train: the client's training split.
    num_classes: C.

  Returns:
    ``(prototypes [C, *features], present bool [C])``.
  """
  y = jnp.asarray(train.y)
  z = features_of_real(model, params, train.x, train.num_examples)
  real = jnp.arange(y.shape[0]) < train.num_examples
  protos, present = pfeddyn.class_prototypes(
    z.reshape((z.shape[0], -1)), y, real, num_classes
  )
  return protos.reshape((num_classes,) + z.shape[1:]), present


def train_head(
  head: HeadSplit, params, prototypes, labels, valid, key, batch_size, lr
):
  """One epoch of SGD on the head over the valid (prototype, label) pairs,
  shuffled by ``key``, in batches of ``batch_size`` (the last one partial),
  each step on the batch's mean cross-entropy.

  Args:
    head: the model's split.
    params: the head's parameters.
    prototypes: [M, *features].
    labels: int [M].
    valid: bool [M].
    key: draws the order.
    batch_size: B.
    lr: the SGD rate.

  Returns:
    The head's parameters.
  """
  m = labels.shape[0]
  order = jnp.argsort(jnp.where(valid, jax.random.uniform(key, (m,)), 2.0))
  num_valid = jnp.sum(valid)
  steps = -(-m // batch_size)
  pad = steps * batch_size - m
  order = jnp.concatenate([order, jnp.zeros(pad, order.dtype)])
  position = jnp.arange(steps * batch_size)

  def step(p, s):
    idx = jax.lax.dynamic_slice_in_dim(order, s * batch_size, batch_size)
    pos = jax.lax.dynamic_slice_in_dim(position, s * batch_size, batch_size)
    mask = (pos < num_valid).astype(jnp.float32)

    def loss(p):
      logits = head.logits(p, prototypes[idx])
      ce = optax.losses.softmax_cross_entropy_with_integer_labels(
        logits, labels[idx]
      )
      return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    g = jax.grad(loss)(p)
    moved = jax.tree.map(lambda a, b: a - lr * b, p, g)
    return jax.tree.map(
      lambda a, b: jnp.where(mask[0] > 0, a, b), moved, p
    ), None

  params, _ = jax.lax.scan(step, params, jnp.arange(steps))
  return params


def fedgh(
  model: Model,
  num_clients: int,
  num_classes: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  server_lr: float = 1.0,
  head_start: str = 'first_client',
) -> FederatedAlgorithm:
  """Builds FedGH.

  Args:
    model: the model (with a head).
    num_clients: N.
    num_classes: C.
    client_optimizer: the client optimizer.
    batching: local batching (its batch size is the server's too).
    server_lr: the server head's SGD rate.
    head_start: 'first_client' (PFLlib's) or 'global'.

  Returns:
    The ``FederatedAlgorithm``.
  """
  if head_start not in HEAD_STARTS:
    raise ValueError(f'head_start must be one of {HEAD_STARTS}: {head_start!r}')
  head = model.require_head('--algorithm=fedgh')
  batch_size = batching.batch_size or 1
  # up: the prototypes and which classes (PFLlib's first-client head is a
  # shared object in its process, not an upload)
  up_bytes = num_classes * (math.prod(head.feature_shape) * 4 + 1)

  def init(key: jax.Array) -> FedGHState:
    body, top = head.split(model.init(key))
    return FedGHState(top, tree_broadcast(body, num_clients))

  def server_broadcast(state: FedGHState, cohort: Cohort, rc: RoundContext):
    return state.head, (rows(state.bodies, cohort.rows), cohort.idx == 0)

  def final(ctx: ClientContext, carry):
    protos, present = class_prototypes(
      model, carry.params, ctx.data.train, num_classes
    )
    body, top = head.split(carry.params)
    first = ctx.state[1]
    return FedGHOutput(
      body=body,
      prototypes=protos,
      present=present,
      first_head=Sum(
        (jax.tree.map(lambda a: jnp.where(first, a, 0), top), first * 1.0)
      ),
      num_examples=ctx.data.train.num_examples,
      stats=carry.stats,
      num_steps=carry.num_steps,
    )

  work = sgd_client_work(
    lambda ctx: plain_objective(model),
    client_optimizer,
    batching,
    final,
    start_fn=lambda ctx: head.merge(ctx.state[0], ctx.shared),
  )

  def server_update(
    state: FedGHState, cohort: Cohort, out: FedGHOutput, rc: RoundContext
  ):
    c = out.present.shape[0]
    valid = (out.present & cohort.mask[:, None]).reshape(-1)
    protos = out.prototypes.reshape((-1,) + out.prototypes.shape[2:])
    labels = jnp.tile(jnp.arange(num_classes), c)
    start = state.head
    if head_start == 'first_client':
      first_head, sent = out.first_head.value
      start = jax.tree.map(
        lambda f, g: jnp.where(sent > 0, f, g), first_head, state.head
      )
    top = train_head(
      head, start, protos, labels, valid, rc.key, batch_size, server_lr
    )
    bodies = tree_scatter(state.bodies, cohort.rows, out.body)
    return (
      dataclasses.replace(state, head=top, bodies=bodies),
      cohort_train_metrics(out.stats, cohort.mask),
    )

  def client_models(state: FedGHState) -> ClientModels:
    n = leading_size(state.bodies)
    return ClientModels.personal(
      jax.vmap(head.merge)(state.bodies, tree_broadcast(state.head, n)),
      num_clients,
    )

  return FederatedAlgorithm(
    name='fedgh',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=work,
    server_update=server_update,
    client_models=client_models,
    communication=lambda state: Communication(
      up_bytes, tree_bytes(state.head), 1
    ),
    client_rows=ClientRows.field('bodies'),
  )


def build(
  training: TrainingConfig,
  config: FedGHConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedGH, built as ``AlgorithmSpec.build`` says; its settings
  ``FedGHConfig``."""
  return fedgh(
    model,
    data.num_clients,
    data.num_classes,
    training.make_client_optimizer(),
    training.batching(),
    config.server_learning_rate,
    config.head_start,
  )


SPEC = AlgorithmSpec(
  'fedgh',
  FedGHConfig,
  build,
  CLIENT_OPTIMIZER | BATCHING,
  summary='FedGH (Yi et al. 2023): personal bodies, a global head trained '
  'on the server from class prototypes',
)
