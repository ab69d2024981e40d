"""Per-FedAvg (Fallah, Mokhtari and Ozdaglar, NeurIPS 2020).

Each of the tau local steps draws three independent batches D, D', D'':

    w_tmp = w - alpha grad f(w; D)
    FO:  w <- w - beta grad f(w_tmp; D')
    HF:  w <- w - beta (I - alpha H(w; D'')) grad f(w_tmp; D')

The Hessian-vector product is exact (forward-over-reverse autodiff, no Hessian
materialized; variant 'hf') or the finite-difference estimate
(grad f(w + delta v) - grad f(w - delta v)) / (2 delta) (variant 'hf_fd',
delta 1e-3, what other libraries ship). The outer step is the client
optimizer applied to the direction (plain SGD at beta = ``--client_lr`` is the
paper's). The server takes the plain mean of the returned models (Algorithm
1; ``--weighting=num_examples`` weighs by client size). Evaluation: each client takes one (or a few) alpha-steps on its
*training* data, then is tested (the authors' code stepped on test batches,
which leaks).
"""

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
import optax
from optax import tree_utils as otu

from fedjax_personal.algorithms.fedavg import (
  FEDAVG_SETTINGS,
  ClientOutput,
  ServerState,
  server_step,
  summed_upload,
)
from fedjax_personal.config import (
  AlgorithmSpec,
  BuildData,
  Declared,
  TrainingConfig,
  hparam,
)
from fedjax_personal.core.algorithm import (
  ClientModels,
  Communication,
  FederatedAlgorithm,
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import (
  Batch,
  ClientContext,
  ClientWork,
  batch_loss,
  client_opt_init,
  opt_update,
  part,
  sgd_finetune,
  zero_stats,
)
from fedjax_personal.core.tree_util import PyTree, tree_bytes
from fedjax_personal.errors import ConfigError
from fedjax_personal.hparams import require_filled
from fedjax_personal.models import Model

__all__ = [
  'check',
  'FO_SPEC',
  'HF_FD_SPEC',
  'HF_SPEC',
  'hvp_exact',
  'hvp_finite_difference',
  'perfedavg',
  'perfedavg_update',
  'PerFedAvgConfig',
  'VARIANTS',
]


VARIANTS = ('fo', 'hf', 'hf_fd')


@dataclasses.dataclass(frozen=True)
class PerFedAvgConfig(Declared):
  """Per-FedAvg's settings: the ``--perfedavg_*`` flags.

  Declared once (``hparam``: default, help, range, sweepable)."""

  prefix: ClassVar[str] = 'perfedavg'
  alpha: float = hparam(
    0.01,
    'Inner (personalization) step alpha; the outer step beta is --client_lr.',
    minimum=0,
    open_min=True,
    sweep=True,
  )
  hf_delta: float = hparam(
    1e-3, 'perfedavg_hf_fd: finite-difference delta.', minimum=0, open_min=True
  )


def hvp_exact(loss_fn, params, v):
  """H(params) v by forward-over-reverse differentiation (jvp of grad).

  Args:
    loss_fn: ``params -> loss``.
    params: the point.
    v: the vector.

  Returns:
    The Hessian-vector product.
  """
  return jax.jvp(jax.grad(loss_fn), (params,), (v,))[1]


def hvp_finite_difference(loss_fn, params, v, delta: float = 1e-3):
  """(grad(params + delta v) - grad(params - delta v)) / (2 delta).

  Args:
    loss_fn: ``params -> loss``.
    params: the point.
    v: the vector.
    delta: the finite-difference step.

  Returns:
    The approximate Hessian-vector product.
  """
  g = jax.grad(loss_fn)
  plus = g(jax.tree.map(lambda p, d: p + delta * d, params, v))
  minus = g(jax.tree.map(lambda p, d: p - delta * d, params, v))
  return jax.tree.map(lambda a, b: (a - b) / (2 * delta), plus, minus)


def perfedavg_direction(
  model: Model,
  params,
  batches: Batch,
  alpha: float,
  variant: str,
  delta: float = 1e-3,
):
  """The outer gradient of one Per-FedAvg local step on three batches
  ([3, B, ...]): grad f(w_tmp; D'), times (I - alpha H(w; D'')) for HF.

  Returns (direction, LossStats of the batch D).
  """
  d, d1, d2 = (part(batches, k) for k in range(3))
  (_, stats), g = jax.value_and_grad(
    lambda p: batch_loss(model, p, d), has_aux=True
  )(params)
  w_tmp = jax.tree.map(lambda p, gg: p - alpha * gg, params, g)
  g1 = jax.grad(lambda p: batch_loss(model, p, d1)[0])(w_tmp)
  if variant == 'fo':
    direction = g1
  else:
    loss2 = lambda p: batch_loss(model, p, d2)[0]
    hv = (
      hvp_exact(loss2, params, g1)
      if variant == 'hf'
      else hvp_finite_difference(loss2, params, g1, delta)
    )
    direction = jax.tree.map(lambda a, h: a - alpha * h, g1, hv)
  return direction, stats


def perfedavg_update(
  model: Model,
  params,
  batches: Batch,
  alpha: float,
  beta: float,
  variant: str,
  delta: float = 1e-3,
):
  """One Per-FedAvg local step with plain SGD: w - beta * direction.

  Returns (new params, LossStats of the batch D).

  Args:
    model: the model.
    params: the meta-model.
    batches: the step's three batches (D, D', D'').
    alpha: the inner step.
    beta: the outer step.
    variant: ``'fo'``, ``'hf'`` or ``'hf_fd'``.
    delta: the finite-difference step (``hf_fd``).

  Returns:
    The meta-model's update direction.
  """
  direction, stats = perfedavg_direction(
    model, params, batches, alpha, variant, delta
  )
  return jax.tree.map(lambda p, gg: p - beta * gg, params, direction), stats


def perfedavg(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  alpha: float,
  variant: str = 'fo',
  delta: float = 1e-3,
  server_optimizer: Optional[optax.GradientTransformation] = None,
  weighting: str = 'uniform',
  eval_steps: int = 1,
  eval_lr: Optional[float] = None,
) -> FederatedAlgorithm:
  """Builds Per-FedAvg.

  Args:
    client_optimizer: the outer step (``optax.sgd(beta)`` is the paper's).
    batching: local steps (each step draws 3 batches of this size).
    alpha: the inner (personalization) step size.
    variant: 'fo', 'hf' (exact Hessian-vector product) or 'hf_fd'.
    delta: finite-difference step of 'hf_fd'.
    server_optimizer: on the mean delta (default: the plain mean).
    weighting: 'uniform' (the paper's mean over the sampled clients) or
      'num_examples'.
    eval_steps: alpha-steps on the client's training data before testing.
    eval_lr: their step size (default alpha).

  Returns:
    The ``FederatedAlgorithm``.
  """
  if variant not in VARIANTS:
    raise ConfigError(
      'algorithm',
      f'Per-FedAvg variant must be one of {VARIANTS}, got {variant!r}',
    )
  server_optimizer = server_optimizer or optax.sgd(1.0)

  def init(key: jax.Array) -> ServerState:
    params = model.init(key)
    return ServerState(params, server_optimizer.init(params))

  def work_init(ctx: ClientContext, key: jax.Array):
    return (
      ctx.shared,
      client_opt_init(ctx, client_optimizer.init, ctx.shared),
      zero_stats(),
    )

  def step(ctx: ClientContext, carry: PyTree, batch: Batch, key: jax.Array):
    params, opt_state, stats = carry
    direction, s = perfedavg_direction(
      model, params, batch, alpha, variant, delta
    )
    updates, opt_state = opt_update(
      client_optimizer, direction, opt_state, params, ctx
    )
    return (
      optax.apply_updates(params, updates),
      opt_state,
      jax.tree.map(jnp.add, stats, s),
    )

  work = summed_upload(
    ClientWork(
      init=work_init,
      step=step,
      final=lambda ctx, carry: ClientOutput(
        delta=otu.tree_sub(ctx.shared, carry[0]),
        num_examples=ctx.data.train.num_examples,
        stats=carry[2],
      ),
      batching=batching,
      batches_per_step=3,
      init_opt_state=client_optimizer.init,
      opt_state=lambda carry: carry[1],
    ),
    weighting,
  )

  def server_update(state: ServerState, cohort: Cohort, out, rc: RoundContext):
    params, opt_state = server_step(
      state.params, state.opt_state, out.delta, server_optimizer
    )
    return ServerState(params, opt_state), cohort_train_metrics(
      out.stats, cohort.mask
    )

  eval_batching = Batching(
    batching.batch_size, num_epochs=None, num_steps=eval_steps
  )
  return FederatedAlgorithm(
    name=f'perfedavg_{variant}',
    model=model,
    init=init,
    server_broadcast=lambda s, c, rc: (s.params, c.mask),
    client_work=work,
    server_update=server_update,
    client_models=lambda s: ClientModels.global_model(s.params, num_clients),
    communication=lambda s: Communication(
      tree_bytes(s.params), tree_bytes(s.params), 1
    ),
    finetune=(
      sgd_finetune(model, alpha if eval_lr is None else eval_lr, eval_batching)
      if eval_steps > 0
      else None
    ),
  )


def _build(variant):
  def build(
    training: TrainingConfig,
    config: PerFedAvgConfig,
    model: Model,
    data: BuildData,
  ) -> FederatedAlgorithm:
    return perfedavg(
      model,
      data.num_clients,
      training.make_client_optimizer(),
      training.batching(),
      alpha=config.alpha,
      variant=variant,
      delta=config.hf_delta,
      server_optimizer=training.make_server_optimizer(),
      weighting=training.filled_weighting(),
      eval_steps=require_filled(training, 'finetune_steps'),
      eval_lr=training.finetune_lr,
    )

  return build


def check(training, config):
  """``AlgorithmSpec.check`` of Per-FedAvg, whose local steps draw three batches
  (a ConfigError for settings that cannot apply)."""
  del config
  if training.local_steps is None:
    raise ConfigError(
      'local_steps',
      'perfedavg takes local steps (each draws 3 batches), '
      'not epochs: set --local_steps',
    )


# Local steps, not epochs: every step draws three batches.
_SETTINGS = FEDAVG_SETTINGS - {'local_epochs', 'drop_last'}
FO_SPEC = AlgorithmSpec(
  'perfedavg_fo',
  PerFedAvgConfig,
  _build('fo'),
  _SETTINGS,
  ignores=frozenset({'hf_delta'}),
  default_weighting='uniform',
  default_finetune_steps=1,
  check=check,
  summary='Per-FedAvg, first-order (Fallah et al. 2020)',
)
HF_SPEC = AlgorithmSpec(
  'perfedavg_hf',
  PerFedAvgConfig,
  _build('hf'),
  _SETTINGS,
  ignores=frozenset({'hf_delta'}),
  default_weighting='uniform',
  default_finetune_steps=1,
  check=check,
  summary='Per-FedAvg, exact Hessian-vector products',
)
HF_FD_SPEC = AlgorithmSpec(
  'perfedavg_hf_fd',
  PerFedAvgConfig,
  _build('hf_fd'),
  _SETTINGS,
  default_weighting='uniform',
  default_finetune_steps=1,
  check=check,
  summary='Per-FedAvg, finite-difference Hessian-vector products',
)
