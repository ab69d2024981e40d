"""FedAvg (McMahan et al., AISTATS 2017) with a server optimizer.

Clients run local SGD (E epochs or K steps) from the server model; the server
treats the weighted mean of the client deltas theta_server - theta_i as a
pseudo-gradient for an optax optimizer (Reddi et al., ICLR 2021). With
``optax.sgd(1.0)`` this is FedAvg's theta <- sum_i n_i theta_i / sum_i n_i;
with momentum it is FedAvgM.

With ``--fedavg_dp_clip_norm`` / ``--fedavg_dp_noise_multiplier`` the local
SGD is DP-SGD (Abadi et al. 2016: per-example clipping, Gaussian noise), the
FedAvg rows of FedFomo's DP table; the state then counts each client's DP-SGD
steps for the privacy accountant (``privacy.py``).
"""

import dataclasses
from typing import Any, Callable, ClassVar, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct
from optax import tree_utils as otu

from fedjax_personal.config import (
  BATCHING,
  CLIENT_OPTIMIZER,
  FINETUNE,
  SERVER_OPTIMIZER,
  WEIGHTING,
  WEIGHTINGS,
  AlgorithmSpec,
  BuildData,
  TrainingConfig,
)
from fedjax_personal.core import aggregation
from fedjax_personal.core.algorithm import (
  ClientModels,
  Communication,
  FederatedAlgorithm,
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.privacy import DPConfig, check_dp, dp_privacy
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import (
  ClientContext,
  ClientWork,
  LossStats,
  plain_objective,
  sgd_client_work,
)
from fedjax_personal.core.tree_util import PyTree, tree_bytes, tree_where
from fedjax_personal.models import Model

__all__ = [
  'build',
  'check',
  'client_weights',
  'ClientOutput',
  'fedavg',
  'FEDAVG_SETTINGS',
  'FedAvgConfig',
  'FT_SPEC',
  'global_model_communication',
  'global_server_update',
  'make_client_work',
  'server_apply',
  'server_step',
  'ServerState',
  'SPEC',
  'summed_upload',
  'train_tokens',
  'variant',
  'WEIGHTINGS',
]


#: The padding id of the sequence data sets (FedJAX's and TFF's vocabularies).
PAD_ID = 0


@struct.dataclass
class ServerState:
  """FedAvg's server state: the global model and the server optimizer's.

  Attributes:
    params: the global model.
    opt_state: server optimizer state.
    dp_steps: with DP-SGD, int32 [N] local steps each client has taken so
      far (for the privacy accountant); else None.
  """

  params: optax.Params
  opt_state: optax.OptState
  dp_steps: Any = None


@struct.dataclass
class ClientOutput:
  """What one FedAvg client returns.

  Attributes:
    delta: theta_server - theta_i after local training (the upload); after
      ``summed_upload``, its weighted share of the mean (an
      ``aggregation.Sum`` the engine reduces over the cohort).
    num_examples: n_i, the client's training examples.
    stats: local training LossStats.
    num_steps: local steps taken (None where an algorithm does not report it).
  """

  delta: optax.Params
  num_examples: HostOrDevice
  stats: LossStats
  num_steps: Any = None


def check_weighting(weighting: str):
  """Refuses an aggregation weighting not in ``WEIGHTINGS``.

  Raises:
    ValueError: an unknown weighting.
  """
  if weighting not in WEIGHTINGS:
    raise ValueError(
      f'weighting must be one of {WEIGHTINGS}, got {weighting!r}'
    )


def client_weight(num_examples, weighting: str):
  """One client's aggregation weight from its examples: n_i, or 1 for
  'uniform' ('tokens' reads the client's data: ``train_tokens``)."""
  check_weighting(weighting)
  if weighting == 'tokens':
    raise ValueError(
      "weighting='tokens' counts a client's tokens in its data: "
      'summed_upload computes it'
    )
  n = jnp.asarray(num_examples)
  return (
    n.astype(jnp.float32)
    if weighting == 'num_examples'
    else jnp.ones_like(n, jnp.float32)
  )


def train_tokens(train) -> jax.Array:
  """A client's training tokens, its weight under ``weighting='tokens'``:
  the targets of its training examples that are neither padded positions
  (-1) nor the padding id (``PAD_ID``), as google-research/federated's
  Shakespeare and Stack Overflow tasks weight clients
  (``client_weight_fn`` returning ``num_tokens``, counted by
  ``NumTokensCounter(masked_tokens=[pad])`` over a round's one epoch).
  For one label per example (images), the client's examples.

  Args:
    train: the client's training split (``core.data`` rows of one client:
      ``y`` [n, ...], ``num_examples``).

  Returns:
    float32 scalar.
  """
  y, n = jnp.asarray(train.y), jnp.asarray(train.num_examples)
  if y.ndim <= 1:
    return n.astype(jnp.float32)
  rows = (jnp.arange(y.shape[0]) < n).reshape((-1,) + (1,) * (y.ndim - 1))
  return jnp.sum(rows & (y >= 0) & (y != PAD_ID)).astype(jnp.float32)


def client_weights(cohort, num_examples, weighting: str):
  """Aggregation weights of a cohort: n_i (or 1) on active clients, 0 on padded
  slots.

  Args:
    cohort: the round's ``Cohort``.
    num_examples: training examples per client [N].
    weighting: ``'num_examples'`` or ``'uniform'`` (a server-side weight:
      ``'tokens'`` is counted by each client, ``summed_upload``).

  Returns:
    Weights [C].
  """
  return client_weight(num_examples, weighting) * cohort.mask


def summed_upload(
  work: ClientWork,
  weighting: str,
  field: str = 'delta',
  group_fn: Optional[Callable] = None,
  weight_fn: Optional[Callable] = None,
) -> ClientWork:
  """Makes ``work``'s upload a weighted-mean share the engine sums over the
  cohort as clients finish (``aggregation.weighted_upload``), so a round never
  stacks C uploads.

  ``work.final`` must return a dataclass with ``field`` (the delta) and
  ``num_examples``. With ``group_fn(ctx, out) -> (group, num_groups)`` the
  share is placed in its group's row of a [G, ...] sum (one FedAvg per
  group).

  Args:
    work: the client work.
    weighting: ``'num_examples'``, ``'tokens'`` (``train_tokens``) or
      ``'uniform'``.
    field: the output's field summed (the delta).
    group_fn: ``(ctx, out) -> (group, num_groups)`` for one mean per group,
      or None.
    weight_fn: ``(ctx, out) -> weight`` replacing ``weighting`` (a variant's
      own weight of a client, ``variant``).

  Returns:
    The ``ClientWork`` with a summed upload.
  """
  check_weighting(weighting)  # when the algorithm is built, not traced

  def final(ctx: ClientContext, carry: PyTree):
    out = work.final(ctx, carry)
    value = getattr(out, field)
    w = (
      weight_fn(ctx, out)
      if weight_fn is not None
      else train_tokens(ctx.data.train)
      if weighting == 'tokens'
      else client_weight(out.num_examples, weighting)
    )
    if group_fn is not None:
      g, num_groups = group_fn(ctx, out)
      one_hot = jnp.arange(num_groups) == g
      value = jax.tree.map(
        lambda a: jnp.where(one_hot.reshape((-1,) + (1,) * a.ndim), a, 0), value
      )
      w = one_hot * w
    return out.replace(**{field: aggregation.weighted_upload(value, w)})

  return dataclasses.replace(work, final=final)


def global_model_communication(state) -> Communication:
  """One global model ``state.params`` down to every active client and one
  of its size up from each (FedAvg and the algorithms shaped like it).

  Args:
    state: the algorithm's state (its ``params``).

  Returns:
    The round's ``Communication``.
  """
  b = tree_bytes(state.params)
  return Communication(b, b, 1)


def server_step(params, opt_state, upload: aggregation.Sum, server_optimizer):
  """Applies the server optimizer to the weighted mean delta, the cohort's
  summed ``summed_upload`` shares.

  Leaves params and optimizer state unchanged when no weight is positive.

  Args:
    params: the global model.
    opt_state: the server optimizer's state.
    upload: the cohort's summed ``weighted_upload`` of deltas.
    server_optimizer: the optax server optimizer.

  Returns:
    ``(params, opt_state)``.
  """
  pseudo_grad, weight = aggregation.upload_mean(upload)
  return server_apply(params, opt_state, pseudo_grad, weight, server_optimizer)


def global_server_update(server_optimizer):
  """The ``server_update`` of an algorithm whose state keeps FedAvg's global
  model (fields ``params`` and ``opt_state``) beside anything of its own
  (client rows the engine writes, say) and whose clients upload a summed
  ``delta`` (``summed_upload``): the server optimizer's step on the mean
  delta (``server_step``), the rest of the state as it is.

  Args:
    server_optimizer: the optax server optimizer.

  Returns:
    ``server_update(state, cohort, outputs, rc) -> (state, metrics)``.
  """

  def server_update(state, cohort: Cohort, out, rc: RoundContext):
    del rc
    params, opt_state = server_step(
      state.params, state.opt_state, out.delta, server_optimizer
    )
    return (
      dataclasses.replace(state, params=params, opt_state=opt_state),
      cohort_train_metrics(out.stats, cohort.mask),
    )

  return server_update


def server_apply(params, opt_state, pseudo_grad, weight, server_optimizer):
  """The server optimizer's step on a pseudo-gradient (``server_step``'s,
  given the mean itself), none when ``weight`` (the cohort's total) is 0.

  Args:
    params: the global model.
    opt_state: the server optimizer's state.
    pseudo_grad: what the optimizer treats as the gradient (the mean delta).
    weight: the cohort's total weight.
    server_optimizer: the optax server optimizer.

  Returns:
    ``(params, opt_state)``.
  """
  updates, new_opt_state = server_optimizer.update(
    pseudo_grad, opt_state, params
  )
  new_params = optax.apply_updates(params, updates)
  any_client = weight > 0
  return (
    tree_where(any_client, new_params, params),
    tree_where(any_client, new_opt_state, opt_state),
  )


def make_client_work(
  model: Model,
  client_optimizer,
  batching: Batching,
  objective_fn: Optional[Callable] = None,
  start_fn: Optional[Callable] = None,
  dp: Optional[tuple] = None,
) -> ClientWork:
  """FedAvg's client work: local SGD from the broadcast model, upload the delta.

  Args:
    objective_fn: ``ctx -> objective`` (default: the plain empirical risk).
      FedProx passes its proximal objective.
    start_fn: ``ctx -> params`` the client starts from (default: the broadcast
      ``ctx.shared``; oracle clusters start from the client's group model).
    dp: optional (clip_norm, noise_multiplier): DP-SGD local training.

  Returns:
    The ``ClientWork``.
  """
  start_fn = start_fn or (lambda ctx: ctx.shared)
  plain = plain_objective(model)
  objective_fn = objective_fn or (lambda ctx: plain)

  def final(ctx: ClientContext, carry: PyTree):
    return ClientOutput(
      delta=otu.tree_sub(start_fn(ctx), carry.params),
      num_examples=ctx.data.train.num_examples,
      stats=carry.stats,
      num_steps=carry.num_steps,
    )

  return sgd_client_work(
    objective_fn, client_optimizer, batching, final, start_fn, dp=dp
  )


def fedavg(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  server_optimizer: Optional[optax.GradientTransformation] = None,
  weighting: str = 'num_examples',
  objective_fn: Optional[Callable] = None,
  finetune=None,
  name: str = 'fedavg',
  dp: Optional[tuple] = None,
) -> FederatedAlgorithm:
  """Builds FedAvg.

  Args:
    model: the model.
    num_clients: N.
    client_optimizer: local optimizer (e.g. ``optax.sgd(lr)``).
    batching: local epochs/steps and batch size.
    server_optimizer: applied to the mean delta; default ``optax.sgd(1.0)``.
    weighting: 'num_examples' (n_i-weighted mean), 'tokens' (``train_tokens``)
      or 'uniform'.
    objective_fn: optional local objective builder (see make_client_work).
    finetune: optional evaluation fine-tuning (FedAvg + fine-tuning).
    name: registry name.
    dp: optional (clip_norm, noise_multiplier): DP-SGD local training; the
      state then counts every client's steps (``ServerState.dp_steps``).

  Returns:
    The ``FederatedAlgorithm``.
  """
  server_optimizer = server_optimizer or optax.sgd(1.0)

  def init(key: jax.Array) -> ServerState:
    params = model.init(key)
    return ServerState(
      params=params,
      opt_state=server_optimizer.init(params),
      dp_steps=None if dp is None else jnp.zeros(num_clients, jnp.int32),
    )

  def server_broadcast(state: ServerState, cohort: Cohort, rc: RoundContext):
    return state.params, cohort.mask

  def server_update(
    state: ServerState, cohort: Cohort, out: ClientOutput, rc: RoundContext
  ):
    params, opt_state = server_step(
      state.params, state.opt_state, out.delta, server_optimizer
    )
    dp_steps = state.dp_steps
    if dp is not None:
      dp_steps = dp_steps.at[cohort.idx].add(
        jnp.where(cohort.mask, out.num_steps, 0).astype(jnp.int32), mode='drop'
      )
    return (
      ServerState(params=params, opt_state=opt_state, dp_steps=dp_steps),
      cohort_train_metrics(out.stats, cohort.mask),
    )

  return FederatedAlgorithm(
    name=name,
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=summed_upload(
      make_client_work(model, client_optimizer, batching, objective_fn, dp=dp),
      weighting,
    ),
    server_update=server_update,
    client_models=lambda s: ClientModels.global_model(s.params, num_clients),
    communication=global_model_communication,
    finetune=finetune,
  )


def variant(
  model: Model,
  data,
  training,
  *,
  weight: Optional[Callable] = None,
  extra: Optional[Callable] = None,
  server: Optional[Callable] = None,
  name: str = 'fedavg_variant',
) -> FederatedAlgorithm:
  """FedAvg changed where its variants change it, the rest FedAvg's (init,
  broadcast, local SGD, client models, evaluation, communication): in the
  spirit of Flower's ``aggregate_fit``, a builder passes only what differs.

  Each client trains as FedAvg's and returns ``out`` (``ClientOutput``:
  ``delta`` = theta_server - theta_i, ``num_examples``, ``stats``). The
  server applies its optimizer to ``server(mean_delta, mean_extra, state)``
  where the means are weighted by ``weight(ctx, out)`` over the cohort's
  clients (summed as clients finish; never stacked). Bytes up per client
  are those of what a client uploads: its delta and its ``extra``.

  Args:
    model: the model.
    data: the federated data (its ``num_clients``).
    training: the shared settings (``TrainingConfig``: client and server
      optimizers, batching, ``--weighting``).
    weight: ``(ctx, out) -> scalar`` a client's weight in the means
      (default: ``training.weighting``'s); ``ctx`` is the client's
      ``ClientContext`` (``ctx.shared`` the broadcast model, ``ctx.data``
      its examples).
    extra: ``(ctx, out) -> pytree`` a second quantity each client uploads,
      averaged with the same weights (None: none).
    server: ``(mean_delta, mean_extra, state) -> pseudo-gradient`` for the
      server optimizer (default: ``mean_delta``).
    name: the algorithm's name.

  Returns:
    The ``FederatedAlgorithm``.
  """
  # a TrainingConfig not resolved by a spec
  weighting = training.weighting or 'num_examples'
  base = fedavg(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    training.make_server_optimizer(),
    weighting,
    name=name,
  )
  if weight is None and extra is None and server is None:
    return base
  server_optimizer = training.make_server_optimizer()
  work = make_client_work(
    model, training.make_client_optimizer(), training.batching()
  )

  def final(ctx: ClientContext, carry: PyTree):
    out = work.final(ctx, carry)
    upload = (out.delta, extra(ctx, out) if extra is not None else ())
    return out.replace(delta=upload)

  def server_update(
    state: ServerState, cohort: Cohort, out: ClientOutput, rc: RoundContext
  ):
    (mean_delta, mean_extra), total = aggregation.upload_mean(out.delta)
    grad = (
      mean_delta if server is None else server(mean_delta, mean_extra, state)
    )
    params, opt_state = server_apply(
      state.params, state.opt_state, grad, total, server_optimizer
    )
    return (
      ServerState(params=params, opt_state=opt_state),
      cohort_train_metrics(out.stats, cohort.mask),
    )

  # ``weight`` sees the client's output as its docstring says: ``out.delta`` the
  # delta (the upload pairs it with ``extra`` only after).
  weight_fn = (
    None
    if weight is None
    else (lambda ctx, out: weight(ctx, out.replace(delta=out.delta[0])))
  )
  return base.replace(
    client_work=summed_upload(
      dataclasses.replace(work, final=final), weighting, weight_fn=weight_fn
    ),
    server_update=server_update,
    # counted from what the round moves: the delta and the extra up
    # (``upload_communication``), the model down
    communication=None,
  )


@dataclasses.dataclass(frozen=True)
class FedAvgConfig(DPConfig):
  """FedAvg's own settings: DP-SGD local training (off by default)."""

  prefix: ClassVar[str] = 'fedavg'


def build(
  training: TrainingConfig,
  config: FedAvgConfig,
  model: Model,
  data: BuildData,
  name: str = 'fedavg',
) -> FederatedAlgorithm:
  """Registry builder."""
  batching = training.batching()
  alg = fedavg(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    batching,
    server_optimizer=training.make_server_optimizer(),
    weighting=training.filled_weighting(),
    name=name,
    dp=config.dp(),
  )
  if config.dp() is None:
    return alg
  return alg.replace(
    privacy=dp_privacy(config, data, batching, lambda state: state.dp_steps)
  )


def check(training, config: FedAvgConfig):
  """``AlgorithmSpec.check`` of FedAvg: its DP settings (a ConfigError if they
  cannot apply)."""
  del training
  check_dp(config)


#: Settings of an algorithm that trains a global model FedAvg-style.
FEDAVG_SETTINGS = (
  CLIENT_OPTIMIZER | BATCHING | WEIGHTING | SERVER_OPTIMIZER | FINETUNE
)

SPEC = AlgorithmSpec(
  'fedavg',
  FedAvgConfig,
  build,
  FEDAVG_SETTINGS,
  check=check,
  model_state=True,
  summary='FedAvg (McMahan et al. 2017), server optimizer optional',
)
FT_SPEC = AlgorithmSpec(
  'fedavg_ft',
  FedAvgConfig,
  lambda t, c, m, d: build(t, c, m, d, name='fedavg_ft'),
  FEDAVG_SETTINGS,
  default_finetune_steps=5,
  check=check,
  model_state=True,
  summary='FedAvg + local fine-tuning before evaluation (5 steps)',
)
