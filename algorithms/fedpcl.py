"""FedPCL (Tan et al., "Federated Learning from Pre-Trained Models: A
Contrastive Learning Approach", NeurIPS 2022, arXiv 2209.10083), as PFLlib's
``clientpcl.py`` / ``serverpcl.py`` run it without pre-trained models: no
model is exchanged; each client keeps its own model (its ``fc`` replaced by
the identity: the features are its output) and uploads its class
prototypes, the L2-normalized features averaged per class.

A round on a client with prototypes (PFLlib's ``train``): E epochs on the
prototype-wise contrastive loss (Eq. 5-6 of the paper) of its normalized
features ``r``: ``L_g = CE(r G^T / tau, y)`` against the global prototypes
``G`` plus ``L_p = (1/N) sum_c CE(r P_c^T / tau, y)`` against every
client's prototype set ``P_c``, each step's gradient clipped to a global
norm of 10 (PyTorch's ``clip_grad_norm_``); then its prototypes: the mean
normalized feature of each class over one more pass (evaluation mode, the
loader's full batches). A client without prototypes yet (never selected
before) does not train; it only computes them.

The server (``serverpcl.py``): the global prototypes are the per-class
means over the round's clients holding the class, unweighted
(``fedproto.server_prototypes``); each uploader's set is its own
prototypes padded with the global one of each class it lacks; a client
that never uploaded gets the global set of the round it was first padded
in, kept until it uploads. Every client receives the global prototypes and
all N sets.

PFLlib's sets are Python dicts stacked in their keys' order, and the loss
indexes their rows by label: the row of class ``y`` is the ``y``-th key,
not class ``y``'s prototype. The keys' order is the order the classes were
first seen: a client's in its prototype pass (the loader's shuffled order),
then the classes it lacks in ascending order; the global's in the upload
order of the round's clients. This module keeps each set in that order
(``first_seen_order``) and indexes it by label as PFLlib does
(``--fedpcl_prototype_rows=labels``: class ``k``'s prototype in row ``k``,
the paper's); the pass's example order is ``collect_order`` (a random
permutation of the client's examples from its key). A client is evaluated as PFLlib's ``test_metrics``:
the class of the largest dot product of its normalized features with its
own (padded) prototypes, 0 for a class without one; before it has
prototypes, nothing is predicted.

PFLlib stops (an assertion) when a class is absent from a round's uploads
while a client lacks it; here the class's global prototype is a zero row
and no client holds it.
"""

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import struct

from fedjax_personal.algorithms.fedproto import server_prototypes
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
from fedjax_personal.core.clipping import clip_grad_norm
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.data import LocalData
from fedjax_personal.core.losses import (
  Batch,
  LossStats,
  features_of_real,
  forward,
  per_example_stats,
  zero_stats,
)
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import (
  ClientContext,
  SGDCarry,
  extended_sgd_work,
  sgd_client_work,
)
from fedjax_personal.core.tree_util import (
  PyTree,
  rows,
  tree_broadcast,
  tree_where,
)
from fedjax_personal.models import Model

__all__ = [
  'build',
  'collect_order',
  'contrastive_loss',
  'fedpcl',
  'FedPCLConfig',
  'first_seen_order',
  'normalize',
  'SPEC',
]

#: PFLlib's ``clip_grad_norm_(..., 10)`` in ``clientpcl.train``.
CLIP_NORM = 10.0


@dataclasses.dataclass(frozen=True)
class FedPCLConfig(Declared):
  """FedPCL's settings: the ``--fedpcl_*`` flags.

  Declared once (``hparam``: default, help, range, sweepable; PFLlib's
  defaults)."""

  prefix: ClassVar[str] = 'fedpcl'
  tau: float = hparam(
    1.0,
    'Temperature tau of the prototype similarities (PFLlib -tau).',
    minimum=0,
    open_min=True,
    sweep=True,
  )
  prototype_rows: str = hparam(
    'keys',
    "Which prototype a label's similarity reads: keys (PFLlib's: the "
    "label-th row of the prototypes stacked in their dict keys' first-seen "
    "order) or labels (the paper's: the prototype of that class).",
    choices=('keys', 'labels'),
  )


@struct.dataclass
class FedPCLState:
  """FedPCL's state.

  Attributes:
    global_protos: [K, D] the global prototypes in their keys' order.
    sets: [N, K, D] each client's prototype set in its keys' order (the
      server's ``client_protos_set``).
    set_labels: int32 [N, K] the class of each row of a set.
    set_valid: bool [N, K] the rows holding a prototype.
    has_set: bool [N] whether a client's set was made.
    has_own: bool [N] whether a client has uploaded prototypes (its own
      set is then its prototypes, padded).
    models: every client's model (client rows).
  """

  global_protos: jax.Array
  sets: jax.Array
  set_labels: jax.Array
  set_valid: jax.Array
  has_set: jax.Array
  has_own: jax.Array
  models: PyTree


@struct.dataclass
class FedPCLCarry:
  """A FedPCL client's work in progress: local SGD and its pass's key."""

  sgd: SGDCarry
  pass_key: jax.Array


@struct.dataclass
class FedPCLOutput:
  """What one FedPCL client returns.

  Attributes:
    protos: [K, D] its prototypes by class.
    present: bool [K] its classes.
    order: int32 [K] the classes in the order its pass first saw them
      (those it lacks after, ascending).
    model: its model (its row, written by the engine).
    num_examples: its training examples.
    stats: training statistics.
    num_steps: local steps taken.
  """

  protos: jax.Array
  present: jax.Array
  order: jax.Array
  model: PyTree
  num_examples: HostOrDevice
  stats: LossStats
  num_steps: Any = None


def normalize(z: jax.Array) -> jax.Array:
  """Rows scaled to unit L2 norm (PyTorch's ``F.normalize``: eps 1e-12).

  Args:
    z: [n, D].

  Returns:
    [n, D].
  """
  norm = jnp.sqrt(jnp.sum(z * z, axis=-1, keepdims=True))
  return z / jnp.maximum(norm, 1e-12)


def collect_order(key: jax.Array, num_examples, max_examples: int):
  """The order of a client's prototype pass over its examples: a random
  permutation of its real examples (PFLlib's shuffled loader), padding last.

  Args:
    key: the client's key for the pass.
    num_examples: its real examples (traced).
    max_examples: the padded length.

  Returns:
    int32 [max_examples] example indices.
  """
  draw = jax.random.uniform(key, (max_examples,))
  draw = jnp.where(jnp.arange(max_examples) < num_examples, draw, 2.0)
  return jnp.argsort(draw).astype(jnp.int32)


def first_seen_order(ranks: jax.Array, present: jax.Array) -> jax.Array:
  """The classes in the order of a dict's keys: present ones by ``ranks``
  (when each was first seen), then the absent ones ascending.

  Args:
    ranks: int32 [..., K].
    present: bool [..., K].

  Returns:
    int32 [..., K] classes.
  """
  k = ranks.shape[-1]
  big = jnp.iinfo(jnp.int32).max // 2
  key = jnp.where(present, ranks, big + jnp.arange(k))
  return jnp.argsort(key, axis=-1, stable=True).astype(jnp.int32)


def _keyed_ce(rep, table, y, mask, tau):
  """PyTorch's ``CrossEntropyLoss`` (mean over the real examples) of the
  similarities ``rep table^T / tau``, the target ``y`` a row index."""
  logits = rep @ table.T / tau
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0]
  per = jnp.where(mask, lse - picked, 0.0)
  return jnp.sum(per) / jnp.maximum(jnp.sum(mask), 1)


def contrastive_loss(rep, y, mask, global_protos, sets, tau: float):
  """FedPCL's local loss (PFLlib's ``clientpcl.train``): ``L_g + L_p``.

  Args:
    rep: [B, D] the normalized features.
    y: int [B] labels (row indices of each table, as PFLlib's).
    mask: bool [B] real examples.
    global_protos: [K, D] in its keys' order.
    sets: [N, K, D] every client's set in its keys' order.
    tau: the temperature.

  Returns:
    The scalar loss.
  """
  y = jnp.clip(y, 0, global_protos.shape[0] - 1)
  l_g = _keyed_ce(rep, global_protos, y, mask, tau)
  l_p = jax.vmap(lambda t: _keyed_ce(rep, t, y, mask, tau))(sets)
  return l_g + jnp.mean(l_p)


def fedpcl(
  model: Model,
  num_clients: int,
  num_classes: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  tau: float = 1.0,
  prototype_rows: str = 'keys',
) -> FederatedAlgorithm:
  """Builds FedPCL.

  Args:
    model: the model (with a head: its features are what is trained).
    num_clients: N.
    num_classes: K.
    client_optimizer: the client optimizer.
    batching: local batching.
    tau: the similarities' temperature.
    prototype_rows: ``keys`` (PFLlib's rows: the prototypes in their keys'
      first-seen order) or ``labels`` (class ``k``'s prototype in row ``k``).

  Returns:
    The ``FederatedAlgorithm``.
  """
  if prototype_rows not in ('keys', 'labels'):
    raise ValueError(
      f"prototype_rows must be 'keys' or 'labels', got {prototype_rows!r}"
    )
  head = model.require_head('--algorithm=fedpcl')
  dim = math.prod(head.feature_shape)
  k = num_classes

  def flat(z):
    return z.reshape((z.shape[0], -1))

  def keys_order(ranks, present):
    if prototype_rows == 'labels':
      return jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), ranks.shape)
    return first_seen_order(ranks, present)

  def init(key: jax.Array) -> FedPCLState:
    return FedPCLState(
      global_protos=jnp.zeros((k, dim), jnp.float32),
      sets=jnp.zeros((num_clients, k, dim), jnp.float32),
      set_labels=jnp.broadcast_to(
        jnp.arange(k, dtype=jnp.int32), (num_clients, k)
      ),
      set_valid=jnp.zeros((num_clients, k), bool),
      has_set=jnp.zeros(num_clients, bool),
      has_own=jnp.zeros(num_clients, bool),
      models=tree_broadcast(model.init(key), num_clients),
    )

  def server_broadcast(state: FedPCLState, cohort: Cohort, rc: RoundContext):
    shared = {'global': state.global_protos, 'sets': state.sets}
    own = state.has_own.at[cohort.idx].get(mode='clip')
    return shared, {'model': rows(state.models, cohort.rows), 'has_own': own}

  def objective(ctx: ClientContext):
    def loss(params, batch: Batch):
      out = forward(model, params, batch, features=True)
      rep = normalize(flat(out.features))
      total = contrastive_loss(
        rep,
        batch.y,
        batch.mask,
        ctx.shared['global'],
        ctx.shared['sets'],
        tau,
      )
      # accuracy: the row (the label, as PFLlib indexes it) of the nearest
      # global prototype
      guess = jnp.argmax(rep @ ctx.shared['global'].T, axis=-1)
      real = batch.mask.astype(jnp.float32)
      stats = zero_stats()._replace(
        loss_sum=total * jnp.sum(real),
        correct=jnp.sum((guess == batch.y) * real),
        count=jnp.sum(real),
        scored=jnp.sum(real),
      )
      return total, stats

    return loss

  def grad_transform(grads, params, ctx: ClientContext):
    del params
    clipped = clip_grad_norm(grads, CLIP_NORM)
    # a client without prototypes yet does not train (PFLlib's ``train``)
    return jax.tree.map(lambda g: g * ctx.state['has_own'], clipped)

  base = sgd_client_work(
    objective,
    client_optimizer,
    batching,
    final=lambda ctx, carry: carry,
    start_fn=lambda ctx: ctx.state['model'],
    grad_transform=grad_transform,
  )

  def work_init(ctx: ClientContext, key: jax.Array) -> FedPCLCarry:
    return FedPCLCarry(base.init(ctx, key), jax.random.fold_in(key, 3))

  def work_final(ctx: ClientContext, carry: FedPCLCarry) -> FedPCLOutput:
    start = ctx.state['model']
    params = jax.tree.map(
      lambda a, b: jnp.where(ctx.state['has_own'], a, b),
      carry.sgd.params,
      start,
    )
    train = ctx.data.train
    m = train.x.shape[0]
    # the prototype pass: its shuffled order, full batches, evaluation mode
    order = collect_order(carry.pass_key, train.num_examples, m)
    seen = train.num_examples
    if batching.drop_last and batching.batch_size:
      b = batching.batch_size
      seen = train.num_examples // b * b
    included = jnp.arange(m) < seen
    # real examples first in the order: the pass stops after them
    feats = features_of_real(
      model, params, jnp.asarray(train.x)[order], train.num_examples
    )
    rep = normalize(flat(feats))
    y = train.y[order]
    one_hot = ((y[:, None] == jnp.arange(k)) & included[:, None]).astype(
      rep.dtype
    )
    counts = one_hot.sum(axis=0)
    positions = jnp.where(one_hot > 0, jnp.arange(m)[:, None], m)
    first = jnp.min(positions, axis=0)
    present = counts > 0
    return FedPCLOutput(
      protos=(one_hot.T @ rep) / jnp.maximum(counts, 1)[:, None],
      present=present,
      order=keys_order(first, present),
      model=params,
      num_examples=train.num_examples,
      stats=carry.sgd.stats,
      num_steps=carry.sgd.num_steps,
    )

  work = extended_sgd_work(base, work_init, work_final)

  def server_update(
    state: FedPCLState, cohort: Cohort, out: FedPCLOutput, rc: RoundContext
  ):
    active = cohort.mask
    c = active.shape[0]
    g_mean, g_present = server_prototypes(out.protos, out.present, active)
    # each class's position in its client's keys, then the global keys'
    # order: first seen over the uploads in their order
    pos = jnp.argsort(out.order, axis=-1).astype(jnp.int32)
    held = out.present & active[:, None]
    big = jnp.iinfo(jnp.int32).max // 2
    g_rank = jnp.min(
      jnp.where(held, jnp.arange(c)[:, None] * k + pos, big), axis=0
    )
    g_order = keys_order(g_rank, g_present)
    global_protos = g_mean[g_order]
    # an uploader's set: its prototypes padded with the global ones, its
    # keys then the classes it lacks
    padded = jnp.where(out.present[..., None], out.protos, g_mean[None])
    valid = out.present | g_present[None]
    take = lambda a: jnp.take_along_axis(a, out.order, axis=1)
    up_sets = jnp.take_along_axis(padded, out.order[..., None], axis=1)
    idx = jnp.where(active, cohort.idx, num_clients)
    sets = state.sets.at[idx].set(up_sets, mode='drop')
    labels = state.set_labels.at[idx].set(out.order, mode='drop')
    set_valid = state.set_valid.at[idx].set(take(valid), mode='drop')
    has_set = state.has_set.at[idx].set(True, mode='drop')
    has_own = state.has_own.at[idx].set(True, mode='drop')
    # a client never padded gets this round's global set
    fresh = ~has_set
    sets = jnp.where(fresh[:, None, None], global_protos[None], sets)
    labels = jnp.where(fresh[:, None], g_order[None], labels)
    set_valid = jnp.where(fresh[:, None], g_present[g_order][None], set_valid)
    new = dict(
      global_protos=global_protos,
      sets=sets,
      set_labels=labels,
      set_valid=set_valid,
      has_set=jnp.ones_like(has_set),
      has_own=has_own,
    )
    # a round without uploads changes nothing (the models are client rows)
    some = jnp.any(active)
    kept = dataclasses.replace(
      state,
      **{n: tree_where(some, v, getattr(state, n)) for n, v in new.items()},
    )
    return kept, cohort_train_metrics(out.stats, active)

  def client_models(state: FedPCLState) -> ClientModels:
    n = state.sets.shape[0]
    row = jnp.arange(n)[:, None]
    table = jnp.zeros_like(state.sets).at[row, state.set_labels].set(state.sets)
    valid = (
      jnp.zeros_like(state.set_valid)
      .at[row, state.set_labels]
      .set(state.set_valid)
    )
    return ClientModels.personal(
      {
        'model': state.models,
        'table': table,
        'valid': valid & state.has_own[:, None],
        'has_own': state.has_own,
      },
      num_clients,
    )

  def evaluate_client(parts, local: LocalData, test, key) -> LossStats:
    """PFLlib's ``test_metrics``: the class of the largest dot product with
    the client's own prototypes (0 for a class without one)."""
    del local, key
    _, z = model.and_features(model.apply)(parts['model'], test.x)
    rep = normalize(flat(z))
    logits = jnp.where(parts['valid'][None], rep @ parts['table'].T, 0.0)
    mask = jnp.arange(test.x.shape[0]) < test.num_examples
    stats = per_example_stats(logits, test.y, mask)
    return stats._replace(
      correct=jnp.where(parts['has_own'], stats.correct, 0.0)
    )

  up = k * (dim * 4 + 1)
  down = (num_clients + 1) * k * dim * 4
  return FederatedAlgorithm(
    name='fedpcl',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=work,
    server_update=server_update,
    client_models=client_models,
    evaluate_client=evaluate_client,
    # prototypes up; the global prototypes and every client's set down
    communication=lambda state: Communication(up, down, 1),
    client_rows=ClientRows.field('models', output='model'),
  )


def build(
  training: TrainingConfig,
  config: FedPCLConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedPCL, built as ``AlgorithmSpec.build`` says; its settings
  ``FedPCLConfig``."""
  return fedpcl(
    model,
    data.num_clients,
    data.num_classes,
    training.make_client_optimizer(),
    training.batching(),
    config.tau,
    config.prototype_rows,
  )


SPEC = AlgorithmSpec(
  'fedpcl',
  FedPCLConfig,
  build,
  CLIENT_OPTIMIZER | BATCHING,
  summary='FedPCL (Tan et al. 2022): personal models, prototype-wise '
  "contrastive learning against the global and every client's prototypes",
)
