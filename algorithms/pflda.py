"""PFL-DA (Zhang et al., "Personalized Federated Learning via Domain
Adaptation with an Application to Distributed 3D Printing", Technometrics
2023): each client keeps its own model (body and personal head); only a
global head is shared, aggregated FedAvg's way.

A round on a client, as PFLlib's ``clientda.py``: E epochs training its
personal head alone (its body frozen) on the cross-entropy plus lambda
||g - p|| (g the global head, p the personal one), then E epochs training
its body and its copy of the global head on the cross-entropy of g(body(x))
(its personal head frozen). The server averages the clients' global heads
(``serverda.py``: the global model is the head alone). A client is evaluated
with its body and its personal head.

PFLlib's distance is computed on ``.data`` (detached), so it adds a
constant to the loss and nothing to the gradient: the default here, as the
code runs (``--pflda_distance_gradient=false``); ``true`` lets the
distance pull the personal head toward the global one (the paper's
reading). The frozen parts take no step (PyTorch's ``requires_grad =
False``; with a stateful client optimizer their state sees zero gradients).
"""

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import struct
from optax import tree_utils as otu

from fedjax_personal.algorithms.fedavg import server_step, summed_upload
from fedjax_personal.algorithms.partial import combined_batching
from fedjax_personal.config import (
  BATCHING,
  CLIENT_OPTIMIZER,
  SERVER_OPTIMIZER,
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
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching, traced_num_steps
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.losses import (
  Batch,
  LossStats,
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
  rows,
  tree_broadcast,
  tree_where,
)
from fedjax_personal.models import HeadSplit, Model

__all__ = ['build', 'pflda', 'PFLDAConfig', 'SPEC']


@dataclasses.dataclass(frozen=True)
class PFLDAConfig(Declared):
  """PFL-DA's own settings: the ``--pflda_*`` flags (PFLlib's defaults)."""

  prefix: ClassVar[str] = 'pflda'
  lamda: float = hparam(
    1.0,
    'Weight lambda of the distance ||g - p|| in the personal phase (PFLlib '
    '-lam).',
    minimum=0,
    sweep=True,
  )
  distance_gradient: bool = hparam(
    False,
    "Whether the distance has a gradient: false as PFLlib's code (computed "
    "on .data), true the paper's reading.",
  )


@struct.dataclass
class PFLDAState:
  """PFL-DA's state: the global head and the clients' own models.

  Attributes:
    head: the global head.
    opt_state: the server optimizer's state.
    models: every client's own model, body and personal head (client rows).
  """

  head: PyTree
  opt_state: optax.OptState
  models: PyTree


@struct.dataclass
class PFLDACarry:
  """A PFL-DA client's work in progress.

  A client's work: its model, its copy of the global head, the
  optimizer's state, the personal phase's steps, steps taken, statistics."""

  model: PyTree
  head: PyTree
  opt_state: Any
  personal_steps: jax.Array
  count: jax.Array
  stats: LossStats


@struct.dataclass
class PFLDAOutput:
  """What one PFL-DA client returns.

  Attributes:
    delta: the global head's delta (its weighted share once summed).
    model: the client's new model (written by the engine).
    num_examples: its training examples.
    stats: training statistics.
  """

  delta: PyTree
  model: PyTree
  num_examples: HostOrDevice
  stats: LossStats


def phase_loss(
  model: Model,
  head: HeadSplit,
  both,
  batch: Batch,
  personal_phase,
  lamda,
  distance_gradient: bool,
):
  """The step's loss: in the personal phase, CE(p(z)) with z fixed plus
  lambda ||g - p|| (fixed unless ``distance_gradient``); else CE(g(z)).

  The phases are the branches of a ``lax.cond``, so a client's step (run
  alone, as the CPU's executors run one) computes one of them: the personal
  phase's gradient stops at the features (no pass back through the body,
  as PyTorch's frozen body takes none)."""

  def personal(both):
    out = forward(model, both['model'], batch, features=True)
    p = head.split(both['model']).head
    ce, stats = logits_loss(
      model, head.logits(p, jax.lax.stop_gradient(out.features)), batch
    )
    g = jax.lax.stop_gradient(both['head'])
    if not distance_gradient:
      p = jax.lax.stop_gradient(p)
    return ce + lamda * otu.tree_norm(otu.tree_sub(g, p)), stats

  def global_(both):
    out = forward(model, both['model'], batch, features=True)
    return logits_loss(model, head.logits(both['head'], out.features), batch)

  return jax.lax.cond(personal_phase, personal, global_, both)


def pflda(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  lamda: float = 1.0,
  distance_gradient: bool = False,
  server_optimizer=None,
  weighting: str = 'num_examples',
) -> FederatedAlgorithm:
  """Builds PFL-DA.

  Args:
    model: the model (with a head).
    num_clients: N.
    client_optimizer: the client optimizer (PFLlib's: SGD).
    batching: one phase's batching (E epochs or K steps).
    lamda: the distance's weight.
    distance_gradient: whether the distance has a gradient.
    server_optimizer: on the mean head delta (default ``optax.sgd(1.0)``).
    weighting: the mean's weighting (``fedavg.WEIGHTINGS``).

  Returns:
    The ``FederatedAlgorithm``.
  """
  head = model.require_head('--algorithm=pflda')
  server_optimizer = server_optimizer or optax.sgd(1.0)
  total = combined_batching(batching, batching)

  def init(key: jax.Array) -> PFLDAState:
    params = model.init(key)
    top = head.split(params).head
    return PFLDAState(
      top, server_optimizer.init(top), tree_broadcast(params, num_clients)
    )

  def server_broadcast(state: PFLDAState, cohort: Cohort, rc: RoundContext):
    return state.head, rows(state.models, cohort.rows)

  def work_init(ctx: ClientContext, key: jax.Array) -> PFLDACarry:
    del key
    train = ctx.data.train
    both = {'model': ctx.state, 'head': ctx.shared}
    return PFLDACarry(
      model=ctx.state,
      head=ctx.shared,
      opt_state=client_opt_init(ctx, client_optimizer.init, both),
      personal_steps=traced_num_steps(
        batching, train.num_examples, train.x.shape[0]
      ),
      count=jnp.zeros((), jnp.int32),
      stats=zero_stats(),
    )

  def work_step(ctx: ClientContext, carry: PFLDACarry, batch: Batch, key):
    del key
    personal_phase = carry.count < carry.personal_steps
    both = {'model': carry.model, 'head': carry.head}
    (_, stats), grads = jax.value_and_grad(
      lambda b: phase_loss(
        model, head, b, batch, personal_phase, lamda, distance_gradient
      ),
      has_aux=True,
    )(both)
    updates, opt_state = opt_update(
      client_optimizer, grads, carry.opt_state, both, ctx
    )
    moved = optax.apply_updates(both, updates)
    body, _ = head.split(both['model'])
    new_body, new_p = head.split(moved['model'])
    _, old_p = head.split(both['model'])
    # the frozen part of each phase takes no step
    body = tree_where(personal_phase, body, new_body)
    p = tree_where(personal_phase, new_p, old_p)
    g = tree_where(personal_phase, both['head'], moved['head'])
    return dataclasses.replace(
      carry,
      model=head.merge(body, p),
      head=g,
      opt_state=opt_state,
      count=carry.count + 1,
      stats=jax.tree.map(jnp.add, carry.stats, stats),
    )

  def work_final(ctx: ClientContext, carry: PFLDACarry) -> PFLDAOutput:
    return PFLDAOutput(
      delta=otu.tree_sub(ctx.shared, carry.head),
      model=carry.model,
      num_examples=ctx.data.train.num_examples,
      stats=carry.stats,
    )

  work = ClientWork(
    init=work_init,
    step=work_step,
    final=work_final,
    batching=total,
    init_opt_state=lambda params: client_optimizer.init(
      {'model': params, 'head': head.split(params).head}
    ),
    opt_state=lambda carry: carry.opt_state,
  )

  def server_update(
    state: PFLDAState, cohort: Cohort, out: PFLDAOutput, rc: RoundContext
  ):
    top, opt_state = server_step(
      state.head, state.opt_state, out.delta, server_optimizer
    )
    return (
      dataclasses.replace(state, head=top, opt_state=opt_state),
      cohort_train_metrics(out.stats, cohort.mask),
    )

  return FederatedAlgorithm(
    name='pflda',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=summed_upload(work, weighting),
    server_update=server_update,
    client_models=lambda s: ClientModels.personal(s.models, num_clients),
    client_rows=ClientRows.field('models', output='model'),
  )


def build(
  training: TrainingConfig,
  config: PFLDAConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """PFL-DA, built as ``AlgorithmSpec.build`` says; its settings
  ``PFLDAConfig``."""
  return pflda(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    config.lamda,
    config.distance_gradient,
    training.make_server_optimizer(),
    training.filled_weighting(),
  )


SPEC = AlgorithmSpec(
  'pflda',
  PFLDAConfig,
  build,
  CLIENT_OPTIMIZER | BATCHING | WEIGHTING | SERVER_OPTIMIZER,
  summary='PFL-DA (Zhang et al. 2023): personal models, a shared head '
  'trained on their features',
)
