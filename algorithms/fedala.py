"""FedALA (Zhang et al., "FedALA: Adaptive Local Aggregation for
Personalized Federated Learning", AAAI 2023, arXiv 2212.01197): FedAvg whose
clients do not take the global model as it is but aggregate it with their
own model element-wise, by weights they learn on a random share of their
data (adaptive local aggregation, ALA).

A round on client i, as PFLlib's ``clientala.py`` and ``utils/ALA.py``: its
lower layers become the global model's; its upper layers (the head,
PFLlib's ``-p 2``: the last weight and bias; or every layer) become
w_i + (g - w_i) * W_i with W_i learned from 1, clipped to [0, 1], by
W_i <- clip(W_i - eta * grad * (g - w_i)) over batches of a contiguous
random ``rand_percent`` share of its training examples, in order, the
whole share once per pass. The first time (its start phase) the passes
repeat until the standard deviation of the last 10 passes' last losses falls
below 0.1 (at most ``--fedala_max_passes``; PFLlib has no bound); later, one
pass. It then trains as FedAvg's clients and uploads its
model; the server averages (examples-weighted). Nothing happens while its
model equals the global model's first tensor (PFLlib's check: the first
round). A client is evaluated with its model after an aggregation of the
current global model (PFLlib evaluates at the next round's start, after
the aggregation).

As PFLlib runs it: every client aggregates at every round's start, in the
round or not; here a client aggregates when it is in the round (the same
when every client joins, PFLlib's default); evaluation aggregates the
client's stored state with a share drawn by the evaluation's key (PFLlib's
next round draws its own).
"""

import dataclasses
import math
from typing import Any, Callable, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import struct
from optax import tree_utils as otu

from fedjax_personal.algorithms.fedavg import (
  FEDAVG_SETTINGS,
  global_model_communication,
  global_server_update,
  summed_upload,
)
from fedjax_personal.config import (
  FINETUNE,
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
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.data import ClientData, LocalData
from fedjax_personal.core.losses import (
  LossStats,
  batch_loss,
  evaluate_params,
  get_batch,
  plain_objective,
)
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import (
  ClientContext,
  SGDCarry,
  extended_sgd_work,
  sgd_client_work,
)
from fedjax_personal.core.tree_util import PyTree, rows, tree_broadcast
from fedjax_personal.models import BodyAndHead, HeadSplit, Model

__all__ = [
  'adaptive_aggregation',
  'Aggregated',
  'build',
  'fedala',
  'FedALAConfig',
  'LayerCut',
  'SPEC',
]

LAYERS = ('head', 'all')
#: PFLlib's ``ALA`` defaults: losses kept, their standard deviation's bound.
NUM_PRE_LOSS, THRESHOLD = 10, 0.1


@dataclasses.dataclass(frozen=True)
class FedALAConfig(Declared):
  """FedALA's own settings: the ``--fedala_*`` flags (PFLlib's defaults)."""

  prefix: ClassVar[str] = 'fedala'
  eta: float = hparam(
    1.0,
    'Learning rate eta of the aggregation weights (PFLlib -et).',
    minimum=0,
    sweep=True,
  )
  rand_percent: int = hparam(
    80,
    'Share of the training examples (percent) the weights learn on '
    '(PFLlib -s).',
    minimum=1,
    maximum=100,
  )
  layers: str = hparam(
    'head',
    "What is aggregated adaptively: 'head' (PFLlib's -p 2 on its models: "
    "the last weight and bias) or 'all' (-p 0).",
    choices=LAYERS,
  )
  max_passes: int = hparam(
    1000,
    'Most passes of the first aggregation (PFLlib repeats until the '
    'losses settle, unbounded).',
    minimum=1,
  )


@struct.dataclass
class FedALAState:
  """FedALA's state.

  Attributes:
    params: the global model.
    opt_state: the server optimizer's state.
    rows: client rows ``{'model', 'weights' (the upper part's W_i),
      'started' (its start phase done)}``.
    rounds: rounds done.
  """

  params: optax.Params
  opt_state: optax.OptState
  rows: PyTree
  rounds: jax.Array


@struct.dataclass
class FedALAOutput:
  """What one FedALA client returns.

  Attributes:
    delta: the global model minus its trained model (its weighted share).
    row: its new row (trained model, weights, start phase done).
    num_examples: its training examples.
    stats: training statistics.
    num_steps: local steps taken.
  """

  delta: PyTree
  row: PyTree
  num_examples: HostOrDevice
  stats: LossStats
  num_steps: Any = None


def _share(key, train: ClientData, percent: int, batch_size: int):
  """PFLlib's contiguous random share: its first index, its size, and the
  batch indices [S, B] and masks over it, in order."""
  n = jnp.asarray(train.num_examples)
  size = (n * percent) // 100
  start = jax.random.randint(key, (), 0, jnp.maximum(n - size, 0) + 1)
  n_max = train.y.shape[0]
  steps = max(math.ceil(n_max * percent / 100 / batch_size), 1)
  pos = jnp.arange(steps * batch_size).reshape((steps, batch_size))
  mask = pos < size
  idx = jnp.minimum(start + pos, n_max - 1)
  return idx, mask


class LayerCut(NamedTuple):
  """The layers ALA aggregates into, and how to put them back.

  ``split(params) -> BodyAndHead`` (the lower layers, kept, and the upper
  ones, aggregated) and ``merge(lower, upper) -> params``."""

  split: Callable[[PyTree], BodyAndHead]
  merge: Callable[[PyTree, PyTree], PyTree]


class Aggregated(NamedTuple):
  """ALA's result on a client (``adaptive_aggregation``).

  Attributes:
    model: the client's model after aggregating the global model into it.
    weights: its new weights W_i.
    started: whether its start phase is done.
  """

  model: PyTree
  weights: PyTree
  started: jax.Array


def adaptive_aggregation(
  model: Model,
  split: LayerCut,
  local,
  global_params,
  weights,
  started,
  train: ClientData,
  key,
  eta: float,
  percent: int,
  batch_size: int,
  max_passes: int,
):
  """ALA (PFLlib's ``adaptive_local_aggregation``): the client's model
  after aggregating the global model into it, its new weights and whether
  its start phase is done.

  Args:
    model: the model.
    split: the ``LayerCut``.
    local: the client's model.
    global_params: the global model.
    weights: W_i, the upper part's shape.
    started: whether its start phase is done.
    train: its training split.
    key: draws the share.
    eta: the weights' rate.
    percent: the share.
    batch_size: B.
    max_passes: the start phase's bound.

  Returns:
    The ``Aggregated`` model, weights and start flag.
  """
  cut, join = split.split, split.merge
  first = jax.tree.leaves(global_params)[0]
  same = jnp.sum(first - jax.tree.leaves(local)[0]) == 0
  _, upper_l = cut(local)
  lower_g, upper_g = cut(global_params)
  idx, mask = _share(key, train, percent, batch_size)

  def mixed(w):
    return jax.tree.map(lambda p, g, a: p + (g - p) * a, upper_l, upper_g, w)

  def one_pass(w):
    def step(carry, s):
      w, _ = carry
      batch = get_batch(train, idx[s], mask[s])
      loss, grads = jax.value_and_grad(
        lambda u: batch_loss(model, join(lower_g, u), batch)[0]
      )(mixed(w))
      moved = jax.tree.map(
        lambda a, gr, p, g: jnp.clip(a - eta * gr * (g - p), 0, 1),
        w,
        grads,
        upper_l,
        upper_g,
      )
      real = jnp.any(mask[s])
      w = jax.tree.map(lambda a, b: jnp.where(real, a, b), moved, w)
      return (w, jnp.where(real, loss, carry[1])), None

    (w, last), _ = jax.lax.scan(
      step, (w, jnp.zeros(())), jnp.arange(idx.shape[0])
    )
    return w, last

  def cond(c):
    count, _, losses = c
    recent = losses[-NUM_PRE_LOSS:]
    settled = (count > NUM_PRE_LOSS) & (jnp.std(recent) < THRESHOLD)
    return (count < jnp.where(started, 1, max_passes)) & ~settled

  def body(c):
    count, w, losses = c
    w, last = one_pass(w)
    return count + 1, w, jnp.roll(losses, -1).at[-1].set(last)

  # the last NUM_PRE_LOSS + 1 losses (a pass compares the last 10)
  losses = jnp.full(NUM_PRE_LOSS + 1, jnp.nan)
  _, new_w, _ = jax.lax.while_loop(
    cond, body, (jnp.zeros((), jnp.int32), weights, losses)
  )
  aggregated = join(lower_g, mixed(new_w))
  out = jax.tree.map(lambda a, b: jnp.where(same, a, b), local, aggregated)
  w = jax.tree.map(lambda a, b: jnp.where(same, a, b), weights, new_w)
  return Aggregated(out, w, started | ~same)


def fedala(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  eta: float = 1.0,
  rand_percent: int = 80,
  layers: str = 'head',
  max_passes: int = 1000,
  server_optimizer=None,
  weighting: str = 'num_examples',
) -> FederatedAlgorithm:
  """Builds FedALA.

  Args:
    model: the model (with a head for ``layers='head'``).
    num_clients: N.
    client_optimizer: the client optimizer.
    batching: local batching (its batch size is ALA's too).
    eta: the aggregation weights' rate.
    rand_percent: the share of examples they learn on.
    layers: 'head' or 'all'.
    max_passes: the start phase's bound.
    server_optimizer: on the mean delta (default ``optax.sgd(1.0)``).
    weighting: the mean's weighting (``fedavg.WEIGHTINGS``).

  Returns:
    The ``FederatedAlgorithm``.
  """
  if layers not in LAYERS:
    raise ValueError(f'layers must be one of {LAYERS}: {layers!r}')
  server_optimizer = server_optimizer or optax.sgd(1.0)
  split: LayerCut
  if layers == 'head':
    head: HeadSplit = model.require_head('--fedala_layers=head')
    split = LayerCut(head.split, head.merge)
  else:
    split = LayerCut(lambda p: BodyAndHead({}, p), lambda lower, upper: upper)
  batch_size = batching.batch_size or 1

  def aggregate(row, global_params, train, key):
    return adaptive_aggregation(
      model,
      split,
      row['model'],
      global_params,
      row['weights'],
      row['started'],
      train,
      key,
      eta,
      rand_percent,
      batch_size,
      max_passes,
    )

  def init(key: jax.Array) -> FedALAState:
    params = model.init(key)
    upper: PyTree = split.split(params).head
    row = {
      'model': params,
      'weights': jax.tree.map(jnp.ones_like, upper),
      'started': jnp.asarray(False),
    }
    return FedALAState(
      params,
      server_optimizer.init(params),
      tree_broadcast(row, num_clients),
      jnp.zeros((), jnp.int32),
    )

  def server_broadcast(state: FedALAState, cohort: Cohort, rc: RoundContext):
    return state.params, rows(state.rows, cohort.rows)

  base = sgd_client_work(
    lambda ctx: plain_objective(model),
    client_optimizer,
    batching,
    final=lambda ctx, carry: carry,
    start_fn=lambda ctx: ctx.state['model'],
  )

  @struct.dataclass
  class Carry:
    """A client's work in FedALA: its model trained from the aggregated one."""

    sgd: SGDCarry
    weights: PyTree
    started: jax.Array

  def work_init(ctx: ClientContext, key: jax.Array):
    k_share = jax.random.fold_in(key, 2)
    start, w, started = aggregate(
      ctx.state, ctx.shared, ctx.data.train, k_share
    )
    begun = dataclasses.replace(ctx, state={'model': start})
    return Carry(base.init(begun, key), w, started)

  def work_final(ctx: ClientContext, carry) -> FedALAOutput:
    params = carry.sgd.params
    return FedALAOutput(
      delta=otu.tree_sub(ctx.shared, params),
      row={'model': params, 'weights': carry.weights, 'started': carry.started},
      num_examples=ctx.data.train.num_examples,
      stats=carry.sgd.stats,
      num_steps=carry.sgd.num_steps,
    )

  work = extended_sgd_work(base, work_init, work_final)

  def client_models(state: FedALAState) -> ClientModels:
    n = jax.tree.leaves(state.rows)[0].shape[0]
    return ClientModels.personal(
      {**state.rows, 'global': tree_broadcast(state.params, n)}, num_clients
    )

  def evaluate_client(parts, local: LocalData, test, key) -> LossStats:
    params, _, _ = aggregate(parts, parts['global'], local.train, key)
    return evaluate_params(model, params, test)

  update = global_server_update(server_optimizer)

  def server_update(state: FedALAState, cohort, out, rc: RoundContext):
    state, metrics = update(state, cohort, out, rc)
    return dataclasses.replace(state, rounds=rc.round + 1), metrics

  return FederatedAlgorithm(
    name='fedala',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=summed_upload(work, weighting),
    server_update=server_update,
    client_models=client_models,
    evaluate_client=evaluate_client,
    communication=global_model_communication,
    client_rows=ClientRows.field('rows', output='row'),
  )


def build(
  training: TrainingConfig,
  config: FedALAConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedALA, built as ``AlgorithmSpec.build`` says; its settings
  ``FedALAConfig``."""
  return fedala(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    config.eta,
    config.rand_percent,
    config.layers,
    config.max_passes,
    training.make_server_optimizer(),
    training.filled_weighting(),
  )


SPEC = AlgorithmSpec(
  'fedala',
  FedALAConfig,
  build,
  FEDAVG_SETTINGS - FINETUNE,
  summary='FedALA (Zhang et al. 2023): the global model aggregated into '
  'each client by learned element-wise weights',
)
