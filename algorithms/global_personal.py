"""Shared shape of the regularized personal baselines (pFedMe, Ditto, APFL):
a global model trained FedAvg-style plus a personal model per client.

The global model is aggregated by ``fedavg.server_step`` on the mean delta
(summed by the engine as clients finish); the personal models are a stacked
[N, ...] pytree whose cohort rows are gathered where each client runs and
written back by the engine (``ClientRows.output``). Only the global model's
delta is uploaded.
"""

from typing import Callable, Optional

import jax
import optax
from flax import struct
from optax import tree_utils as otu

from fedjax_personal.algorithms.fedavg import (
  global_model_communication,
  server_step,
  summed_upload,
)
from fedjax_personal.core.algorithm import (
  ClientModels,
  ClientRows,
  FederatedAlgorithm,
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.losses import Batch
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import (
  ClientContext,
  ClientWork,
  LossStats,
  client_opt_init,
  keep_model_state,
  opt_update,
  zero_stats,
)
from fedjax_personal.core.tree_util import (
  PyTree,
  rows,
  tree_broadcast,
)
from fedjax_personal.models import Model

__all__ = [
  'global_personal_algorithm',
  'GlobalPersonalOutput',
  'GlobalPersonalState',
  'two_model_work',
]


@struct.dataclass
class GlobalPersonalState:
  """The state of an algorithm with a global and a personal model.

  Attributes:
    params: the global model.
    opt_state: server optimizer state.
    personal: stacked [N, ...] personal models.
  """

  params: optax.Params
  opt_state: optax.OptState
  personal: optax.Params


@struct.dataclass
class GlobalPersonalOutput:
  """What one client of a global-and-personal algorithm returns.

  Attributes:
    delta: global model minus the client's local global model (uploaded).
    personal: the client's new personal model (kept).
    num_examples: n_i.
    stats: local training LossStats.
  """

  delta: optax.Params
  personal: optax.Params
  num_examples: HostOrDevice
  stats: LossStats


def global_personal_algorithm(
  name: str,
  model: Model,
  num_clients: int,
  work: ClientWork,
  server_optimizer: Optional[optax.GradientTransformation] = None,
  weighting: str = 'num_examples',
  eval_models: Optional[Callable] = None,
  finetune=None,
) -> FederatedAlgorithm:
  """Wraps a client work whose ``final`` returns a GlobalPersonalOutput.

  In the work, ``ctx.shared`` is the global model and ``ctx.state`` the
  client's personal model. ``eval_models(state) -> ClientModels`` defaults to
  each client's personal model.

  Args:
    name: the registry name.
    model: the model (pure ``init`` / ``apply``).
    num_clients: N: per-client state has N rows.
    work: the client work updating both models.
    server_optimizer: applied to the mean update; default ``optax.sgd(1.0)``.
    weighting: ``'num_examples'`` (n_i-weighted mean), ``'tokens'``
      (``fedavg.train_tokens``) or ``'uniform'``.
    eval_models: which model each client is evaluated with.
    finetune: optional evaluation fine-tuning (``training.sgd_finetune``).

  Returns:
    The ``FederatedAlgorithm``.
  """
  server_optimizer = server_optimizer or optax.sgd(1.0)

  def init(key: jax.Array) -> GlobalPersonalState:
    params = model.init(key)
    return GlobalPersonalState(
      params, server_optimizer.init(params), tree_broadcast(params, num_clients)
    )

  def server_update(
    state: GlobalPersonalState,
    cohort: Cohort,
    out: GlobalPersonalOutput,
    rc: RoundContext,
  ):
    # The engine wrote the new personal models (client_rows' output).
    params, opt_state = server_step(
      state.params, state.opt_state, out.delta, server_optimizer
    )
    return (
      GlobalPersonalState(params, opt_state, state.personal),
      cohort_train_metrics(out.stats, cohort.mask),
    )

  return FederatedAlgorithm(
    name=name,
    model=model,
    init=init,
    server_broadcast=lambda s, c, rc: (s.params, rows(s.personal, c.rows)),
    client_work=summed_upload(work, weighting),
    server_update=server_update,
    client_models=eval_models
    or (lambda s: ClientModels.personal(s.personal, num_clients)),
    communication=global_model_communication,
    finetune=finetune,
    client_rows=ClientRows.field('personal', output='personal'),
  )


def two_model_work(
  step_fn: Callable,
  batching,
  opt_w: optax.GradientTransformation,
  opt_v: optax.GradientTransformation,
  personal_start: Optional[Callable] = None,
) -> ClientWork:
  """ClientWork training the local global model w (from the broadcast) and
  the personal model v (from the client's row, or ``personal_start(ctx)``),
  each with its optimizer.

  ``step_fn(ctx, w, v, batch) -> (grad_w, grad_v, LossStats)``: the
  gradients the two optimizers apply this step; with a model that keeps
  batch statistics, ``(grad_w, grad_v, aux_v, aux_w)``: what the objective
  returned beside the loss for each model (``training.StatsAndState``), each
  model then keeping its own forward pass's statistics
  (``training.keep_model_state``).

  Args:
    step_fn: one local step of both models.
    batching: local batching.
    opt_w: the global model's optimizer.
    opt_v: the personal model's optimizer.
    personal_start: where the personal model starts.

  Returns:
    The ``ClientWork``.
  """
  personal_start = personal_start or (lambda ctx: ctx.state)

  def init_opt_state(params):
    return opt_w.init(params), opt_v.init(params)

  def init(ctx: ClientContext, key: jax.Array):
    del key
    return (
      ctx.shared,
      personal_start(ctx),
      client_opt_init(ctx, init_opt_state, ctx.shared),
      zero_stats(),
    )

  def step(ctx: ClientContext, carry: PyTree, batch: Batch, key: jax.Array):
    del key
    w, v, (sw, sv), stats = carry
    gw, gv, s, *aux_w = step_fn(ctx, w, v, batch)
    uw, sw = opt_update(opt_w, gw, sw, w, ctx)
    uv, sv = opt_update(opt_v, gv, sv, v, ctx)
    w, v = optax.apply_updates(w, uw), optax.apply_updates(v, uv)
    v, s = keep_model_state(v, s)
    if aux_w:
      w, _ = keep_model_state(w, aux_w[0])
    return w, v, (sw, sv), jax.tree.map(lambda a, b: a + b, stats, s)

  def final(ctx: ClientContext, carry: PyTree):
    w, v, _, stats = carry
    return GlobalPersonalOutput(
      delta=otu.tree_sub(ctx.shared, w),
      personal=v,
      num_examples=ctx.data.train.num_examples,
      stats=stats,
    )

  return ClientWork(
    init,
    step,
    final,
    batching,
    init_opt_state=init_opt_state,
    opt_state=lambda carry: carry[2],
  )
