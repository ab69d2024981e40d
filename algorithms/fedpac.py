"""FedPAC (Xu et al., "Personalized Federated Learning with Feature
Alignment and Classifier Collaboration", ICLR 2023, arXiv 2306.11867): a
shared body whose features are pulled toward global class prototypes, and a
personal head each client receives as a combination of the cohort's heads,
weighted by a small quadratic program per client.

A round, as PFLlib's ``clientpac.py`` / ``serverpac.py``:
1. the client takes the global body under its own head and computes, with
   it, its feature statistics (``statistics_extraction``): the label shares
   p_k and per class the mean feature mu_k; h_k = p_k mu_k and the variance
   term v = sum_k p_k E||z||^2 - p_k^2 ||mu_k||^2, divided by its examples;
2. it trains its head alone for one epoch (cross-entropy), then its body
   alone for E epochs on the cross-entropy plus lambda times the mean
   squared error between its features and the global prototypes of their
   labels (Eq. 5; a label without a prototype adds 0);
3. it uploads its body, head, class prototypes (the trained body's feature
   means, evaluation mode), v and h;
4. the server averages the bodies (examples-weighted), the prototypes per
   class over the clients holding it, and gives client i the heads
   combined by alpha_i = argmin a^T (diag(v) + D_i) a over the simplex,
   D_i[j, l] = sum_k (h_ik - h_jk) . (h_ik - h_lk) (Eq. 9), weights below
   1e-3 set to 0 (not renormalized), as its ``solve_quadratic``.

The quadratic program is solved inside the round, vectorized over the
cohort (``simplex_qp``: accelerated projected gradient, then the KKT system
on the support found), where PFLlib calls cvxpy per client.

As PFLlib's code runs: its server pairs the weights it solved for the
clients in their selection order with the clients in the order of its
upload sampling (``random.sample``), a second random permutation, and
combines the heads in the upload order, so client tau(i) receives the
combination solved for client sigma(i) over the heads of tau; and it writes
each new head into the module its upload list holds, so a later
combination reads the heads already replaced
(``--fedpac_head_assignment=pfllib``, the default; ``in_order``: the same
in the cohort's order; ``own``: each client its own solution over the
uploaded heads, the paper's). Its statistics and prototypes are taken
over its shuffled loader's full batches (``--drop_last``), each pass a new
shuffle. P is positive semi-definite by construction; PFLlib's clean-up of
a P with negative eigenvalues is not reproduced.
"""

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import struct
from optax import tree_utils as otu

from fedjax_personal.algorithms import pfeddyn
from fedjax_personal.algorithms.fedavg import server_step, summed_upload
from fedjax_personal.algorithms.partial import combined_batching
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
from fedjax_personal.core.batching import (
  Batching,
  epoch_examples,
  traced_num_steps,
)
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.data import ClientData
from fedjax_personal.core.losses import (
  Batch,
  LossStats,
  features_of_real,
  forward,
  logits_loss,
  zero_stats,
)
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import (
  ClientContext,
  ClientWork,
  client_opt_init,
  opt_update,
)
from fedjax_personal.core.tree_util import (
  PyTree,
  leading_size,
  rows,
  tree_broadcast,
  tree_bytes,
  tree_scatter_where,
  tree_where,
)
from fedjax_personal.models import Model

__all__ = [
  'build',
  'fedpac',
  'FedPACConfig',
  'feature_statistics',
  'head_weights',
  'pfllib_assignment',
  'simplex_qp',
  'upload_order',
  'SPEC',
]

HEAD_ASSIGNMENTS = ('pfllib', 'in_order', 'own')
#: PFLlib's ``solve_quadratic``: weights at most this are set to 0.
SMALL_WEIGHT = 1e-3


@dataclasses.dataclass(frozen=True)
class FedPACConfig(Declared):
  """FedPAC's own settings: the ``--fedpac_*`` flags (PFLlib's defaults)."""

  prefix: ClassVar[str] = 'fedpac'
  lamda: float = hparam(
    1.0,
    'Weight lambda of the feature alignment to the global prototypes '
    '(PFLlib -lam).',
    minimum=0,
    sweep=True,
  )
  head_assignment: str = hparam(
    'pfllib',
    "How the heads are combined: 'pfllib' (its server's: the weights "
    'solved for the i-th selected client go to the i-th of a second random '
    'order, each combination reading the heads already replaced), '
    "'in_order' (the same without the second order) or 'own' (each client "
    "its own weights over the uploaded heads: the paper's).",
    choices=HEAD_ASSIGNMENTS,
  )


@struct.dataclass
class FedPACState:
  """FedPAC's state.

  Attributes:
    body: the global body.
    protos: [K, *features] the global class prototypes.
    present: bool [K], the classes with a prototype (none before round 1).
    heads: every client's head (client rows, leading axis N).
  """

  body: PyTree
  protos: jax.Array
  present: jax.Array
  heads: PyTree


@struct.dataclass
class FedPACShared:
  """What every client receives: the global body and prototypes."""

  body: PyTree
  protos: jax.Array
  present: jax.Array


@struct.dataclass
class FedPACCarry:
  """A FedPAC client's work in progress.

  A client's work: its model, the optimizer's state, the head phase's
  steps, steps taken, statistics, its feature statistics (taken at the
  start) and the key of its prototypes' pass."""

  model: PyTree
  opt_state: Any
  head_steps: jax.Array
  count: jax.Array
  stats: LossStats
  v: jax.Array
  h: jax.Array
  key: jax.Array


@struct.dataclass
class FedPACOutput:
  """What one FedPAC client returns.

  Attributes:
    delta: the global body minus its trained body (its weighted share once
      summed).
    head: its trained head (stacked: the server combines them).
    protos: [K, *features] its class prototypes.
    present: bool [K] its classes.
    v: its variance term.
    h: [K, D] its p_k mu_k.
    num_examples: its training examples.
    stats: training statistics.
  """

  delta: PyTree
  head: PyTree
  protos: jax.Array
  present: jax.Array
  v: jax.Array
  h: jax.Array
  num_examples: HostOrDevice
  stats: LossStats


def features_of(model: Model, params, train: ClientData):
  """The client's training examples' features [n, D] (its padded rows
  zeros), evaluation mode."""
  z = features_of_real(model, params, train.x, train.num_examples)
  return z.reshape((z.shape[0], -1))


def class_means(z, y, used, num_classes):
  """Per class: the examples counted, the mean feature and the mean squared
  norm over the ``used`` examples (``pfeddyn.class_means``)."""
  n, mean = pfeddyn.class_means(z, y, used, num_classes)
  sq = pfeddyn.class_means(
    jnp.sum(z * z, axis=1, keepdims=True), y, used, num_classes
  )[1]
  return n, mean, sq[:, 0]


def feature_statistics(
  model: Model, params, train: ClientData, key, batch_size, drop_last, k
):
  """PFLlib's ``statistics_extraction`` (FedPAC's Eq. 8 terms): the features
  of one shuffled epoch give each class's mean mu_k and mean squared norm,
  another epoch's labels the shares p_k; v = sum over the classes of the
  first epoch of p_k E||z||^2 - p_k^2 ||mu_k||^2, divided by the client's
  examples, and h_k = p_k mu_k.

  Args:
    model: the model.
    params: the client's model (the global body under its head).
    train: its training split.
    key: draws the two epochs.
    batch_size: B.
    drop_last: whether the epochs drop their partial batch.
    k: the number of classes.

  Returns:
    ``(v scalar, h [K, D])``.
  """
  k_feat, k_count = jax.random.split(key)
  n_max = train.y.shape[0]
  y = jnp.asarray(train.y)
  z = features_of(model, params, train)
  used = epoch_examples(
    k_feat, train.num_examples, n_max, batch_size, drop_last
  )
  counted = epoch_examples(
    k_count, train.num_examples, n_max, batch_size, drop_last
  )
  n, mean, sq = class_means(z, y, used, k)
  labels = jnp.sum((y[:, None] == jnp.arange(k)) & counted[:, None], axis=0)
  p = labels / jnp.maximum(jnp.sum(labels), 1)
  has = n > 0
  v = jnp.sum(jnp.where(has, p * sq - p**2 * jnp.sum(mean**2, axis=1), 0))
  v = v / jnp.maximum(jnp.asarray(train.num_examples), 1)
  h = jnp.where(has[:, None], p[:, None] * mean, 0)
  return v, h


def simplex_qp(p_matrix, support, iterations: int = 3000):
  """argmin a^T P a over the probability simplex on ``support`` (a zero
  elsewhere), P positive semi-definite: accelerated projected gradient
  with restarts, then the KKT system P_SS a_S = c 1 on the support it
  found, kept when feasible and no worse.

  Args:
    p_matrix: [C, C].
    support: bool [C] (at least one true).
    iterations: gradient steps.

  Returns:
    float32 [C].
  """
  c = p_matrix.shape[0]
  outer = support[:, None] & support[None, :]
  p_s = jnp.where(outer, p_matrix, 0)
  lip = 2 * jnp.maximum(jnp.max(jnp.linalg.eigvalsh(p_s)), 1e-12)

  def project(y):
    u = jnp.sort(jnp.where(support, y, -jnp.inf))[::-1]
    real = jnp.isfinite(u)
    css = jnp.cumsum(jnp.where(real, u, 0))
    k = jnp.arange(1, c + 1)
    ok = real & (u - (css - 1) / k > 0)
    rho = jnp.max(jnp.where(ok, k, 1))
    theta = (css[rho - 1] - 1) / rho
    return jnp.where(support, jnp.maximum(y - theta, 0), 0)

  def objective(a):
    return a @ p_s @ a

  start = support / jnp.sum(support)

  def step(_, carry):
    a, y, t = carry
    a_new = project(y - 2 * (p_s @ y) / lip)
    t_new = (1 + jnp.sqrt(1 + 4 * t * t)) / 2
    y_new = a_new + (t - 1) / t_new * (a_new - a)
    worse = objective(a_new) > objective(a)  # restart the momentum
    return (
      a_new,
      jnp.where(worse, a_new, y_new),
      jnp.where(worse, 1.0, t_new),
    )

  a, _, _ = jax.lax.fori_loop(0, iterations, step, (start, start, 1.0))
  on = support & (a > 1e-7)
  system = jnp.where(on[:, None] & on[None, :], p_s, 0) + jnp.diag(~on * 1.0)
  x = jnp.linalg.solve(system, on.astype(p_s.dtype))
  polished = jnp.where(on, x, 0) / jnp.sum(jnp.where(on, x, 0))
  good = (
    jnp.all(jnp.isfinite(polished))
    & jnp.all(polished >= 0)
    & (objective(polished) <= objective(a) + 1e-12)
  )
  return jnp.where(good, polished, a)


def head_weights(v, h, active):
  """Each cohort slot's head weights alpha_i [C, C] (rows of inactive slots
  the identity): the simplex QP on diag(v) + D_i over the active slots,
  weights at most 1e-3 set to 0.

  Args:
    v: [C] the variance terms.
    h: [C, K, D] the p_k mu_k.
    active: bool [C].

  Returns:
    float32 [C, C].
  """
  c = v.shape[0]
  flat = h.reshape((c, -1))

  def solve(i):
    diff = flat[i][None, :] - flat  # [C, KD]: h_i - h_j
    p_matrix = jnp.diag(v) + diff @ diff.T
    alpha = simplex_qp(p_matrix, active)
    return alpha * (alpha > SMALL_WEIGHT)

  alphas = jax.lax.map(solve, jnp.arange(c))
  return jnp.where(active[:, None], alphas, jnp.eye(c))


def pfllib_assignment(alphas, active, order):
  """PFLlib's combination of the heads (``serverpac.py``'s
  ``aggregate_and_send_heads``): going through the uploads in ``order``, the
  i-th one's client receives the weights solved for the i-th active slot in
  cohort order, applied to the uploaded heads in ``order``; a head it
  replaces is replaced in place (its ``set_head`` writes into the module
  the upload list holds), so a later combination reads the heads already
  given out. With B[i, j] = alpha[act_i, act_j] and L its part below the
  diagonal, the heads in ``order`` become (I - L)^-1 (B - L) H.

  Args:
    alphas: [C, C] ``head_weights``.
    active: bool [C].
    order: int [C], the active slots in upload order, then the rest in
      slot order.

  Returns:
    float32 [C, C], the mixing of the cohort's heads by slot.
  """
  c = active.shape[0]
  act = upload_order(active)  # the active slots in cohort order
  b = alphas[act[:, None], act[None, :]]
  low = jnp.tril(b, -1)
  in_place = jax.scipy.linalg.solve_triangular(
    jnp.eye(c, dtype=b.dtype) - low, b - low, lower=True
  )
  return (
    jnp.zeros((c, c), alphas.dtype)
    .at[order[:, None], order[None, :]]
    .set(in_place)
  )


def upload_order(active, key=None):
  """The active slots in a uniformly random order drawn by ``key`` (PFLlib's
  ``random.sample`` of the selected clients), or in cohort order without a
  key; the inactive slots after them, in slot order.

  Args:
    active: bool [C].
    key: draws the order, or None.

  Returns:
    int [C], slots.
  """
  c = active.shape[0]
  slot = jnp.arange(c)
  rank = slot if key is None else jax.random.uniform(key, (c,))
  return jnp.argsort(jnp.where(active, rank, c + slot + 2.0))


def alignment_loss(features, labels, mask, protos, present):
  """lambda's term: PyTorch's ``MSELoss`` between the features and a copy
  of them whose rows are replaced by the global prototype of their label
  where it has one, over the batch's real examples (its B x D entries)."""
  z = features.reshape((features.shape[0], -1))
  target = protos.reshape((protos.shape[0], -1))[labels]
  on = mask & present[labels]
  sq = jnp.sum((z - jax.lax.stop_gradient(target)) ** 2, axis=1)
  count = jnp.maximum(jnp.sum(mask) * z.shape[1], 1)
  return jnp.sum(jnp.where(on, sq, 0)) / count


def fedpac(
  model: Model,
  num_clients: int,
  num_classes: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  lamda: float = 1.0,
  head_assignment: str = 'pfllib',
) -> FederatedAlgorithm:
  """Builds FedPAC.

  Args:
    model: the model (with a head).
    num_clients: N.
    num_classes: K.
    client_optimizer: the client optimizer (one for both phases, the frozen
      part's step discarded).
    batching: the body phase's batching (E epochs); the head phase takes
      one epoch of the same batches.
    lamda: the alignment's weight.
    head_assignment: 'pfllib' or 'own'.

  Returns:
    The ``FederatedAlgorithm``.
  """
  if head_assignment not in HEAD_ASSIGNMENTS:
    raise ValueError(
      f'head_assignment must be one of {HEAD_ASSIGNMENTS}: {head_assignment!r}'
    )
  if batching.num_epochs is None:
    raise ValueError('fedpac trains its head one epoch: give epochs, not steps')
  head = model.require_head('--algorithm=fedpac')
  batch_size = batching.batch_size or 1
  head_epoch = Batching(
    batching.batch_size, num_epochs=1, drop_last=batching.drop_last
  )
  total = combined_batching(batching, head_epoch)
  feature_shape = head.feature_shape
  dim = math.prod(feature_shape)
  server_optimizer = optax.sgd(1.0)

  def init(key: jax.Array) -> FedPACState:
    body, top = head.split(model.init(key))
    return FedPACState(
      body,
      jnp.zeros((num_classes,) + tuple(feature_shape), jnp.float32),
      jnp.zeros(num_classes, bool),
      tree_broadcast(top, num_clients),
    )

  def server_broadcast(state: FedPACState, cohort: Cohort, rc: RoundContext):
    shared = FedPACShared(state.body, state.protos, state.present)
    return shared, rows(state.heads, cohort.rows)

  def work_init(ctx: ClientContext, key: jax.Array) -> FedPACCarry:
    k_stats, k_protos = jax.random.split(jax.random.fold_in(key, 1))
    train = ctx.data.train
    params = head.merge(ctx.shared.body, ctx.state)
    v, h = feature_statistics(
      model,
      params,
      train,
      k_stats,
      batch_size,
      batching.drop_last,
      num_classes,
    )
    return FedPACCarry(
      model=params,
      opt_state=client_opt_init(ctx, client_optimizer.init, params),
      head_steps=traced_num_steps(
        head_epoch, train.num_examples, train.x.shape[0]
      ),
      count=jnp.zeros((), jnp.int32),
      stats=zero_stats(),
      v=v,
      h=h,
      key=k_protos,
    )

  def work_step(ctx: ClientContext, carry: FedPACCarry, batch: Batch, key):
    del key
    head_phase = carry.count < carry.head_steps
    shared = ctx.shared

    def head_loss(params):
      # the body frozen: the gradient stops at its features (no pass back
      # through it, as PyTorch's frozen body takes none)
      out = forward(model, params, batch, features=True)
      top = head.split(params).head
      z = jax.lax.stop_gradient(out.features)
      return logits_loss(model, head.logits(top, z), batch)

    def body_loss(params):
      out = forward(model, params, batch, features=True)
      ce, stats = logits_loss(model, out.logits, batch)
      align = alignment_loss(
        out.features, batch.y, batch.mask, shared.protos, shared.present
      )
      return ce + lamda * align, stats

    def loss(params):
      return jax.lax.cond(head_phase, head_loss, body_loss, params)

    (_, stats), grads = jax.value_and_grad(loss, has_aux=True)(carry.model)
    updates, opt_state = opt_update(
      client_optimizer, grads, carry.opt_state, carry.model, ctx
    )
    moved = optax.apply_updates(carry.model, updates)
    body, top = head.split(carry.model)
    new_body, new_top = head.split(moved)
    # the frozen part of each phase takes no step
    params = head.merge(
      tree_where(head_phase, body, new_body),
      tree_where(head_phase, new_top, top),
    )
    return dataclasses.replace(
      carry,
      model=params,
      opt_state=opt_state,
      count=carry.count + 1,
      stats=jax.tree.map(jnp.add, carry.stats, stats),
    )

  def work_final(ctx: ClientContext, carry: FedPACCarry) -> FedPACOutput:
    train = ctx.data.train
    n_max = train.y.shape[0]
    z = features_of(model, carry.model, train)
    used = epoch_examples(
      carry.key, train.num_examples, n_max, batch_size, batching.drop_last
    )
    n, mean, _ = class_means(z, jnp.asarray(train.y), used, num_classes)
    body, top = head.split(carry.model)
    return FedPACOutput(
      delta=otu.tree_sub(ctx.shared.body, body),
      head=top,
      protos=mean.reshape((num_classes,) + tuple(feature_shape)),
      present=n > 0,
      v=carry.v,
      h=carry.h,
      num_examples=train.num_examples,
      stats=carry.stats,
    )

  work = ClientWork(
    init=work_init,
    step=work_step,
    final=work_final,
    batching=total,
    init_opt_state=client_optimizer.init,
    opt_state=lambda carry: carry.opt_state,
  )

  def server_update(
    state: FedPACState, cohort: Cohort, out: FedPACOutput, rc: RoundContext
  ):
    active = cohort.mask
    holds = out.present & active[:, None]  # [C, K]
    count = jnp.sum(holds, axis=0)
    protos = jnp.einsum(
      'ck,ck...->k...', holds.astype(out.protos.dtype), out.protos
    ) / jnp.maximum(count, 1).reshape((-1,) + (1,) * len(feature_shape))
    body, _ = server_step(
      state.body, server_optimizer.init(state.body), out.delta, server_optimizer
    )
    alphas = head_weights(out.v, out.h, active)
    if head_assignment == 'own':
      mixing = alphas
    else:
      key = rc.key if head_assignment == 'pfllib' else None
      mixing = pfllib_assignment(alphas, active, upload_order(active, key))
    heads = jax.tree.map(
      lambda a: jnp.einsum('ij,j...->i...', mixing, a), out.head
    )
    return (
      dataclasses.replace(
        state,
        body=body,
        protos=protos,
        present=count > 0,
        # a slot that did not take part keeps its head
        heads=tree_scatter_where(state.heads, cohort.rows, heads, active),
      ),
      cohort_train_metrics(out.stats, cohort.mask),
    )

  def client_models(state: FedPACState) -> ClientModels:
    n = leading_size(state.heads)
    return ClientModels.personal(
      jax.vmap(head.merge)(tree_broadcast(state.body, n), state.heads),
      num_clients,
    )

  def communication(state: FedPACState) -> Communication:
    body = tree_bytes(state.body)
    top = tree_bytes(jax.tree.map(lambda a: a[0], state.heads))
    table = num_classes * dim * 4
    # up: body, head, prototypes and their classes, v and h; down: the body,
    # the prototypes and the client's own combination of heads
    up = body + top + table + num_classes + 4 + table
    return Communication(up, body + table + num_classes + top, num_clients)

  return FederatedAlgorithm(
    name='fedpac',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=summed_upload(work, 'num_examples'),
    server_update=server_update,
    client_models=client_models,
    communication=communication,
    client_rows=ClientRows.field('heads'),
  )


def build(
  training: TrainingConfig,
  config: FedPACConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedPAC, built as ``AlgorithmSpec.build`` says; its settings
  ``FedPACConfig``."""
  return fedpac(
    model,
    data.num_clients,
    data.num_classes,
    training.make_client_optimizer(),
    training.batching(),
    config.lamda,
    config.head_assignment,
  )


SPEC = AlgorithmSpec(
  'fedpac',
  FedPACConfig,
  build,
  # the head's epoch before the body's: epochs, not steps
  CLIENT_OPTIMIZER | (BATCHING - {'local_steps'}),
  summary='FedPAC (Xu et al. 2023): features aligned to global prototypes; '
  'heads combined per client by a quadratic program',
)
