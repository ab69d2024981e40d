"""Mime (Karimireddy et al., "Breaking the centralized barrier for
cross-device federated learning", arXiv:2008.03606), as FedJAX builds it
(``fedjax.algorithms.mime``), compiled into one round.

A round has two client passes. First the cohort's full-batch gradients at
the server model x (the engine's ``CohortPhase``): their mean over the
cohort's examples is the control variate c. Then each client steps from x
with the base optimizer's state held at the server's (the client optimizer,
``mime_lite.held_state``) on the corrected gradient ``g(y; b) - g(x; b) + c``
of each batch b (the paper's eq. 3, FedJAX's ``client_step``: both gradients
on the same batch and draws) and uploads its delta x - y, weighted by its
examples. The server moves x by its optimizer on the mean delta
(``optax.sgd(server_lr)``: FedJAX's ``x - server_learning_rate * delta``)
and updates the base optimizer's state with c at the old x.
"""

import dataclasses
from typing import ClassVar, Optional

import jax
import optax
from flax import struct
from optax import tree_utils as otu

from fedjax_personal.algorithms.fedavg import (
  ClientOutput,
  summed_upload,
)
from fedjax_personal.algorithms.mime_lite import (
  from_server_base_state,
  full_batch_gradient,
  held_state,
  server_step,
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
)
from fedjax_personal.core import aggregation
from fedjax_personal.core.algorithm import (
  ClientModels,
  CohortPhase,
  FederatedAlgorithm,
  PhasedOutputs,
  PhaseResult,
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.data import LocalData
from fedjax_personal.core.losses import Batch, batch_loss
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import (
  ClientContext,
  SGDCarry,
  sgd_client_work,
)
from fedjax_personal.core.tree_util import PyTree
from fedjax_personal.models import Model

__all__ = ['build', 'mime', 'MimeConfig', 'MimeState', 'SPEC']


@dataclasses.dataclass(frozen=True)
class MimeConfig(Declared):
  """Mime's settings: none of its own.

  The ``--client_*`` optimizer is the base optimizer, ``--server_*`` moves
  the model."""

  prefix: ClassVar[str] = 'mime'


@struct.dataclass
class MimeState:
  """Mime's state.

  Attributes:
    params: the server model x.
    base_opt_state: the base optimizer's state, updated by the server only.
    opt_state: the server optimizer's state.
  """

  params: PyTree
  base_opt_state: optax.OptState
  opt_state: optax.OptState


@struct.dataclass
class Broadcast:
  """What every client of a round trains with.

  Attributes:
    params: x.
    base_opt_state: the base state the clients step with.
    control: c, the cohort's mean full-batch gradient at x (zeros until the
      cohort phase folds it in).
  """

  params: PyTree
  base_opt_state: optax.OptState
  control: PyTree


def mime(
  model: Model,
  num_clients: int,
  base_optimizer: optax.GradientTransformation,
  batching: Batching,
  server_optimizer: Optional[optax.GradientTransformation] = None,
  weighting: str = 'num_examples',
) -> FederatedAlgorithm:
  """Builds Mime.

  Args:
    model: the model.
    num_clients: N.
    base_optimizer: the client optimizer whose state the server keeps.
    batching: local epochs / steps and batch size.
    server_optimizer: on the mean delta; default ``optax.sgd(1.0)``.
    weighting: the deltas' weights ('num_examples', 'tokens', 'uniform').

  Returns:
    The ``FederatedAlgorithm``.
  """
  server_optimizer = server_optimizer or optax.sgd(1.0)
  base = optax.with_extra_args_support(base_optimizer)

  def init(key: jax.Array) -> MimeState:
    params = model.init(key)
    return MimeState(params, base.init(params), server_optimizer.init(params))

  def server_broadcast(state: MimeState, cohort: Cohort, rc: RoundContext):
    zeros = otu.tree_zeros_like(state.params)
    return Broadcast(state.params, state.base_opt_state, zeros), cohort.mask

  def phase_client(shared: Broadcast, local: LocalData, key):
    """A client's full-batch gradient at x and its examples."""
    del key
    n = local.train.num_examples
    return full_batch_gradient(model, shared.params, local.train), n

  def fold(shared: Broadcast, cohort: Cohort, outputs, rc: RoundContext):
    """c: the cohort's full-batch gradients weighted by their examples
    (FedJAX's ``grads_sum_total / num_sum_total``)."""
    grads, n = outputs
    control = aggregation.weighted_mean(
      grads, jax.numpy.where(cohort.mask, n, 0)
    )
    return PhaseResult(
      dataclasses.replace(shared, control=control), server=control
    )

  def objective(ctx: ClientContext):
    shared: Broadcast = ctx.shared

    def loss(params, batch: Batch):
      value, stats = batch_loss(model, params, batch)
      # g(y; b) - g(x; b) + c through a linear term: its gradient is the
      # constant c - g(x; b), taken on the same batch and draws
      at_x = jax.grad(lambda p: batch_loss(model, p, batch)[0])(shared.params)
      shift = jax.lax.stop_gradient(otu.tree_sub(shared.control, at_x))
      return value + otu.tree_vdot(shift, params), stats

    return loss

  def final(ctx: ClientContext, carry: SGDCarry):
    return ClientOutput(
      delta=otu.tree_sub(ctx.shared.params, carry.params),
      num_examples=ctx.data.train.num_examples,
      stats=carry.stats,
      num_steps=carry.num_steps,
    )

  work = sgd_client_work(
    objective,
    held_state(base_optimizer),
    batching,
    final,
    start_fn=lambda ctx: ctx.shared.params,
  )
  # the server's base state, not a fresh one
  work = from_server_base_state(work)

  def server_update(
    state: MimeState, cohort: Cohort, out: PhasedOutputs, rc: RoundContext
  ):
    clients: ClientOutput = out.clients
    mean_delta, weight = aggregation.upload_mean(clients.delta)
    new = server_step(
      state, mean_delta, weight, out.phase, rc.round, server_optimizer, base
    )
    return new, cohort_train_metrics(clients.stats, cohort.mask)

  return FederatedAlgorithm(
    name='mime',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=summed_upload(work, weighting),
    server_update=server_update,
    client_models=lambda s: ClientModels.global_model(s.params, num_clients),
    cohort_phase=CohortPhase(phase_client, fold),
    # counted from what moves: x, the base state and c down, the delta up
    communication=None,
  )


def build(
  training: TrainingConfig,
  config: MimeConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """Mime, built as ``AlgorithmSpec.build`` says; the base optimizer is the
  client optimizer (``--client_*``)."""
  del config
  return mime(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    server_optimizer=training.make_server_optimizer(),
    weighting=training.filled_weighting(),
  )


SPEC = AlgorithmSpec(
  'mime',
  MimeConfig,
  build,
  (CLIENT_OPTIMIZER - {'client_opt_state'})
  | BATCHING
  | WEIGHTING
  | SERVER_OPTIMIZER,
  summary="Mime (Karimireddy et al. 2020): clients step with the server's "
  "optimizer state on gradients corrected by the cohort's full-batch "
  'gradient',
)
