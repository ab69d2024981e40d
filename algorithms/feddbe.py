"""FedDBE (Zhang et al., "Eliminating Domain Bias for Federated Learning in
Representation Space", NeurIPS 2023, arXiv 2311.14975): FedAvg with a
personalized representation bias and a mean regularization.

Each client keeps a personal vector c_i added to its features before the
head, logits = h(z + c_i) (the personalized representation bias, PRBM),
trained with the model; and a running mean of its features over the round's
steps, r <- (1 - m) r + m mean_batch(z) (reset at each round), pulled toward
the population's mean g by kappa * mean(0.5 (r - g)^2) (the mean
regularization, MR). g is the examples-weighted mean of every client's r
after one local training from the initial model, before the first round.

As PFLlib's ``clientdbe.py`` / ``serverdbe.py``: g is computed once, by a
local training of every client without the bias or the regularization
(here: a pre-round phase inside the first compiled round); the running
mean's past is held fixed (``detach_running``), so the regularization's
gradient reaches the current batch's features only; c_i steps with the
client optimizer (PFLlib: an SGD of its own at the same rate). Defaults are
PFLlib's: ``-mo`` 0.1 and ``-klw`` 0 (the regularization off; the paper
tunes kappa per data set). Evaluation is h(z + c_i): a dense head with its
bias moved by c_i W (the same map up to float rounding).
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
  hparam,
)
from fedjax_personal.core.algorithm import (
  ClientModels,
  ClientRows,
  FederatedAlgorithm,
  PreRound,
  RoundContext,
)
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.data import LocalData
from fedjax_personal.core.losses import (
  Batch,
  LossStats,
  StatsAndState,
  forward,
  logits_loss,
)
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import (
  ClientContext,
  local_sgd,
  sgd_client_work,
)
from fedjax_personal.core.tree_util import (
  PyTree,
  leading_size,
  rows,
  tree_broadcast,
)
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import Dense, HeadSplit, Model

__all__ = ['build', 'feddbe', 'FedDBEConfig', 'FedDBEState', 'SPEC']


@dataclasses.dataclass(frozen=True)
class FedDBEConfig(Declared):
  """FedDBE's own settings: the ``--feddbe_*`` flags (PFLlib's defaults)."""

  prefix: ClassVar[str] = 'feddbe'
  momentum: float = hparam(
    0.1,
    'Momentum m of the running feature mean (PFLlib -mo).',
    minimum=0,
    maximum=1,
  )
  kl_weight: float = hparam(
    0.0,
    'Weight kappa of the mean regularization (PFLlib -klw).',
    minimum=0,
    sweep=True,
  )


@struct.dataclass
class FedDBEState:
  """FedDBE's state: the global model and the clients' representation biases.

  Attributes:
    params: the global model.
    opt_state: the server optimizer's state.
    biases: every client's representation bias c_i, [N, *features] (rows).
    global_mean: g, the population's feature mean [*features].
  """

  params: optax.Params
  opt_state: optax.OptState
  biases: jax.Array
  global_mean: jax.Array


@struct.dataclass
class FedDBEShared:
  """What every client receives: the global model and g."""

  params: optax.Params
  global_mean: jax.Array


@struct.dataclass
class FedDBEOutput:
  """What one FedDBE client returns.

  Attributes:
    delta: the global model's delta (its weighted share once summed).
    bias: the client's new c_i (written by the engine).
    num_examples: the client's training examples.
    stats: training statistics.
    num_steps: local steps taken.
  """

  delta: PyTree
  bias: jax.Array
  num_examples: HostOrDevice
  stats: LossStats
  num_steps: Any = None


def masked_mean(z, mask):
  """The mean of z [B, ...] over the batch's real examples."""
  w = mask.astype(z.dtype).reshape((-1,) + (1,) * (z.ndim - 1))
  return jnp.sum(z * w, axis=0) / jnp.maximum(jnp.sum(w), 1.0)


def dbe_objective(
  model: Model, head: HeadSplit, momentum, kl_weight, global_mean=None
):
  """``(parts, batch) -> (loss, StatsAndState)`` over ``parts = {'model',
  'bias', 'running'}``: the running mean updated with this batch's features
  (its past fixed) and returned as state; with ``global_mean`` (None: the
  initial phase, plain cross-entropy of h(z)), the cross-entropy of
  h(z + c) plus kappa mean(0.5 (r - g)^2)."""

  def objective(parts, batch: Batch):
    out = forward(model, parts['model'], batch, features=True)
    z = out.features
    running = (1 - momentum) * jax.lax.stop_gradient(
      parts['running']
    ) + momentum * masked_mean(z, batch.mask)
    if global_mean is None:
      loss, stats = logits_loss(model, out.logits, batch)
      return loss, StatsAndState(stats, {'running': running})
    top = head.split(parts['model']).head
    loss, stats = logits_loss(model, head.logits(top, z + parts['bias']), batch)
    reg = jnp.mean(0.5 * (running - global_mean) ** 2)
    return loss + kl_weight * reg, StatsAndState(stats, {'running': running})

  return objective


def biased_head(head: HeadSplit, params, bias):
  """The model's parameters with its dense head's bias moved by c W, so
  that h'(z) = h(z + c)."""
  body, top = head.split(params)
  shift = jnp.tensordot(bias, top['kernel'], axes=bias.ndim)
  return head.merge(body, {**top, 'bias': top['bias'] + shift})


def feddbe(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batching,
  momentum: float = 0.1,
  kl_weight: float = 0.0,
  server_optimizer=None,
  weighting: str = 'num_examples',
) -> FederatedAlgorithm:
  """Builds FedDBE.

  Args:
    model: the model; its head a dense layer with a bias.
    num_clients: N.
    client_optimizer: the client optimizer (model and bias).
    batching: local batching.
    momentum: m of the running mean.
    kl_weight: kappa of the mean regularization.
    server_optimizer: applied to the mean delta (default ``optax.sgd(1.0)``).
    weighting: the mean's weighting (``fedavg.WEIGHTINGS``).

  Returns:
    The ``FederatedAlgorithm``.
  """
  head = model.require_head('--algorithm=feddbe')
  if not isinstance(head.module, (Dense, nn.Dense)):
    raise ConfigError(
      'model',
      '--algorithm=feddbe evaluates h(z + c) as a dense head with a moved '
      f'bias; model {model.name!r} ends in {type(head.module).__name__}',
    )
  server_optimizer = server_optimizer or optax.sgd(1.0)
  zeros = jnp.zeros(head.feature_shape, jnp.float32)

  def start(params, bias):
    return {'model': params, 'bias': bias, 'running': zeros}

  def init(key: jax.Array) -> FedDBEState:
    params = model.init(key)
    return FedDBEState(
      params,
      server_optimizer.init(params),
      tree_broadcast(zeros, num_clients),
      zeros,
    )

  def server_broadcast(state: FedDBEState, cohort: Cohort, rc: RoundContext):
    shared = FedDBEShared(state.params, state.global_mean)
    return shared, rows(state.biases, cohort.rows)

  def final(ctx: ClientContext, carry):
    return FedDBEOutput(
      delta=otu.tree_sub(ctx.shared.params, carry.params['model']),
      bias=carry.params['bias'],
      num_examples=ctx.data.train.num_examples,
      stats=carry.stats,
      num_steps=carry.num_steps,
    )

  work = sgd_client_work(
    lambda ctx: dbe_objective(
      model, head, momentum, kl_weight, ctx.shared.global_mean
    ),
    client_optimizer,
    batching,
    final,
    start_fn=lambda ctx: start(ctx.shared.params, ctx.state),
    trained_like=lambda p: start(p, zeros),
  )

  def initial_mean(params, data: LocalData, key):
    """A client's running mean after local training from the initial
    model, without bias or regularization, and its weight."""
    parts, _ = local_sgd(
      start(params, zeros),
      dbe_objective(model, head, momentum, kl_weight),
      client_optimizer,
      data.train,
      key,
      batching,
    )
    return parts['running'], data.train.num_examples

  def mean_update(state: FedDBEState, outputs, rc: RoundContext):
    del rc
    means, n = outputs
    w = n.astype(jnp.float32) / jnp.maximum(jnp.sum(n), 1)
    g = jnp.tensordot(w, means, axes=1)
    return dataclasses.replace(state, global_mean=g), {}

  def client_models(state: FedDBEState) -> ClientModels:
    n = leading_size(state.biases)
    stacked = tree_broadcast(state.params, n)
    return ClientModels.personal(
      jax.vmap(lambda p, c: biased_head(head, p, c))(stacked, state.biases),
      num_clients,
    )

  return FederatedAlgorithm(
    name='feddbe',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=summed_upload(work, weighting),
    server_update=global_server_update(server_optimizer),
    client_models=client_models,
    pre_round=PreRound(
      due=lambda t: t == 0,
      update=mean_update,
      broadcast=lambda state, rc: state.params,
      client=initial_mean,
    ),
    client_rows=ClientRows.field('biases', output='bias'),
  )


def build(
  training: TrainingConfig,
  config: FedDBEConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedDBE, built as ``AlgorithmSpec.build`` says; its settings
  ``FedDBEConfig``."""
  return feddbe(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    config.momentum,
    config.kl_weight,
    training.make_server_optimizer(),
    training.filled_weighting(),
  )


SPEC = AlgorithmSpec(
  'feddbe',
  FedDBEConfig,
  build,
  FEDAVG_SETTINGS - FINETUNE,
  summary='FedDBE (Zhang et al. 2023): personal representation bias + mean '
  'regularization',
)
