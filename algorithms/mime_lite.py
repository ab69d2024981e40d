"""Mime Lite (Karimireddy et al., "Breaking the centralized barrier for
cross-device federated learning", arXiv:2008.03606), as FedJAX builds it
(``fedjax.algorithms.mime_lite``), compiled into one round.

The client optimizer is the *base* optimizer whose state only the server
updates. Each client steps from the server model x with that state held
fixed (the paper's eq. for y_i: the server's momentum, not the client's);
it uploads its delta x - y_i and its full-batch gradient at x, both in one
weighted mean (by examples, FedJAX's weights). The server moves x by its
optimizer on the mean delta (``optax.sgd(server_lr)``: FedJAX's
``x - server_learning_rate * delta``) and updates the base optimizer's
state with the mean full-batch gradient at the old x. With
``--mime_lite_delta_clip_norm`` each delta is first clipped to that l2 norm
(FedJAX's ``client_delta_clip_norm``).
"""

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct
from optax import tree_utils as otu

from fedjax_personal.algorithms.fedavg import (
  ClientOutput,
  server_apply,
  summed_upload,
)
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
from fedjax_personal.core import aggregation
from fedjax_personal.core.algorithm import (
  ClientModels,
  FederatedAlgorithm,
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.losses import mean_loss
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import (
  ClientContext,
  SGDCarry,
  plain_objective,
  sgd_client_work,
)
from fedjax_personal.core.tree_util import PyTree, tree_where
from fedjax_personal.models import Model

__all__ = [
  'build',
  'from_server_base_state',
  'full_batch_gradient',
  'held_state',
  'mime_lite',
  'MimeLiteConfig',
  'MimeLiteState',
  'server_step',
  'SPEC',
]


@dataclasses.dataclass(frozen=True)
class MimeLiteConfig(Declared):
  """Mime Lite's own settings: the ``--mime_lite_*`` flags."""

  prefix: ClassVar[str] = 'mime_lite'
  delta_clip_norm: Optional[float] = hparam(
    None,
    "Clip each client's delta to this l2 norm before the mean (FedJAX's "
    'client_delta_clip_norm; unset: no clipping).',
    minimum=0,
    open_min=True,
  )


@struct.dataclass
class MimeLiteState:
  """Mime Lite's server state.

  Attributes:
    params: the global model x.
    base_opt_state: the base (client) optimizer's state, which the clients
      use and only the server updates.
    opt_state: the server optimizer's state (on the mean delta).
  """

  params: optax.Params
  base_opt_state: optax.OptState
  opt_state: optax.OptState


@struct.dataclass
class Broadcast:
  """What every client of a round receives: x and the base state."""

  params: optax.Params
  base_opt_state: optax.OptState


def held_state(
  optimizer: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """``optimizer`` whose ``update`` returns its state unchanged: a client
  steps with the server's optimizer state held fixed.

  Args:
    optimizer: the base optimizer.

  Returns:
    The transformation (extra arguments such as ``round_num`` passed on).
  """
  inner = optax.with_extra_args_support(optimizer)

  def update(updates, state, params=None, **extra_args):
    return inner.update(updates, state, params, **extra_args)[0], state

  return optax.GradientTransformationExtraArgs(inner.init, update)


def from_server_base_state(work):
  """``work`` (local SGD) starting from the round's base optimizer state
  (``ctx.shared.base_opt_state``) instead of a fresh one.

  Args:
    work: an ``sgd_client_work``.

  Returns:
    The ``ClientWork``.
  """
  start = work.init
  return dataclasses.replace(
    work,
    init=lambda ctx, key: start(ctx, key).replace(
      opt_state=ctx.shared.base_opt_state
    ),
  )


def server_step(
  state,
  mean_delta: PyTree,
  weight,
  grad: PyTree,
  round_num,
  server_optimizer: optax.GradientTransformation,
  base: optax.GradientTransformationExtraArgs,
):
  """Both Mimes' server step: x moved by the server optimizer on the mean
  delta, the base optimizer's state updated with the mean full-batch
  gradient at the old x (kept when no client uploaded).

  Args:
    state: a state with ``params``, ``base_opt_state`` and ``opt_state``.
    mean_delta: the cohort's mean delta.
    weight: its total weight.
    grad: the mean full-batch gradient at x.
    round_num: the round (the base optimizer's schedules).
    server_optimizer: moves x.
    base: the base optimizer.

  Returns:
    The new state.
  """
  params, opt_state = server_apply(
    state.params, state.opt_state, mean_delta, weight, server_optimizer
  )
  _, base_opt_state = base.update(
    grad, state.base_opt_state, state.params, round_num=round_num
  )
  base_opt_state = tree_where(weight > 0, base_opt_state, state.base_opt_state)
  return dataclasses.replace(
    state, params=params, base_opt_state=base_opt_state, opt_state=opt_state
  )


def full_batch_gradient(model: Model, params, train) -> PyTree:
  """The gradient at ``params`` of the mean loss over all of a client's
  real training examples (FedJAX's padded batches weighted by their
  examples: the same mean).

  Args:
    model: the model.
    params: where the gradient is taken (the server model).
    train: the client's training split.

  Returns:
    The gradient, shaped as ``params``.
  """

  return jax.grad(lambda p: mean_loss(model, p, train))(params)


def mime_lite(
  model: Model,
  num_clients: int,
  base_optimizer: optax.GradientTransformation,
  batching: Batching,
  server_optimizer: Optional[optax.GradientTransformation] = None,
  weighting: str = 'num_examples',
  delta_clip_norm: Optional[float] = None,
) -> FederatedAlgorithm:
  """Builds Mime Lite.

  Args:
    model: the model.
    num_clients: N.
    base_optimizer: the client optimizer whose state the server keeps.
    batching: local epochs / steps and batch size.
    server_optimizer: on the mean delta; default ``optax.sgd(1.0)``.
    weighting: the mean's weights ('num_examples', 'tokens', 'uniform').
    delta_clip_norm: each delta's largest l2 norm, or None.

  Returns:
    The ``FederatedAlgorithm``.
  """
  server_optimizer = server_optimizer or optax.sgd(1.0)
  base = optax.with_extra_args_support(base_optimizer)
  plain = plain_objective(model)

  def init(key: jax.Array) -> MimeLiteState:
    params = model.init(key)
    return MimeLiteState(
      params, base.init(params), server_optimizer.init(params)
    )

  def final(ctx: ClientContext, carry: SGDCarry):
    delta = otu.tree_sub(ctx.shared.params, carry.params)
    if delta_clip_norm is not None:
      norm = otu.tree_norm(delta)
      delta = otu.tree_scale(
        jnp.minimum(1.0, delta_clip_norm / jnp.maximum(norm, 1e-30)), delta
      )
    grad = full_batch_gradient(model, ctx.shared.params, ctx.data.train)
    return ClientOutput(
      delta=(delta, grad),
      num_examples=ctx.data.train.num_examples,
      stats=carry.stats,
      num_steps=carry.num_steps,
    )

  work = sgd_client_work(
    lambda ctx: plain,
    held_state(base_optimizer),
    batching,
    final,
    start_fn=lambda ctx: ctx.shared.params,
  )
  # the server's base state, not a fresh one
  work = from_server_base_state(work)

  def server_broadcast(state: MimeLiteState, cohort: Cohort, rc: RoundContext):
    return Broadcast(state.params, state.base_opt_state), cohort.mask

  def server_update(
    state: MimeLiteState, cohort: Cohort, out: ClientOutput, rc: RoundContext
  ):
    (mean_delta, grad), weight = aggregation.upload_mean(out.delta)
    new = server_step(
      state, mean_delta, weight, grad, rc.round, server_optimizer, base
    )
    return new, cohort_train_metrics(out.stats, cohort.mask)

  return FederatedAlgorithm(
    name='mime_lite',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=summed_upload(work, weighting),
    server_update=server_update,
    client_models=lambda s: ClientModels.global_model(s.params, num_clients),
    # counted from what moves: x and the base state down, the delta and
    # the gradient up
    communication=None,
  )


def build(
  training: TrainingConfig,
  config: MimeLiteConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """Mime Lite, built as ``AlgorithmSpec.build`` says; the base optimizer
  is the client optimizer (``--client_*``)."""
  return mime_lite(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    server_optimizer=training.make_server_optimizer(),
    weighting=training.filled_weighting(),
    delta_clip_norm=config.delta_clip_norm,
  )


SPEC = AlgorithmSpec(
  'mime_lite',
  MimeLiteConfig,
  build,
  (CLIENT_OPTIMIZER - {'client_opt_state'})
  | BATCHING
  | WEIGHTING
  | SERVER_OPTIMIZER,
  summary='Mime Lite (Karimireddy et al. 2020): clients step with the '
  "server's optimizer state",
)
