"""FedDyn (Acar et al., ICLR 2021, "Federated learning based on dynamic
regularization"; the seed slides call it DyDFL).

Each client keeps a state g_i (its "local state (gradient)", zero at start) and
minimizes the dynamically regularized objective

    L_i(theta) - <g_i, theta> + alpha_i / 2 ||theta - theta_server||^2,

then updates g_i <- g_i - alpha_i (theta_i - theta_server). The server keeps h
(zero at start):

    h <- h - (alpha / N) sum_{i in P_t} (theta_i - theta_server)
    theta_server <- mean_{i in P_t} theta_i - h / alpha.

Options of the authors' code: alpha_i = alpha mean(n) / n_i
(``adaptive_alpha``), gradient clipping of the data term (``max_grad_norm``, 10
in their code); their per-round learning-rate decay and weight decay (1e-3) are
the shared client optimizer's ``--client_lr_decay`` and
``--client_weight_decay``. The model evaluated is a choice (``eval_model``): the
server model, the mean of the last round's active models, or the mean of all
clients' latest models.

The data term L_i is pluggable (``data_objective``), which is how personalized
FedDyn (``pfeddyn.py``) swaps in MAML and prototype objectives.
"""

import dataclasses
from typing import Callable, ClassVar, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from optax import tree_utils as otu

from fedjax_personal.algorithms.fedavg import global_model_communication
from fedjax_personal.config import (
  BATCHING,
  CLIENT_OPTIMIZER,
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
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import (
  ClientContext,
  LossStats,
  plain_objective,
  sgd_client_work,
)
from fedjax_personal.core.tree_util import (
  PyTree,
  is_concrete,
  rows,
  tree_broadcast,
  tree_scatter,
)
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import Model

__all__ = [
  'build',
  'feddyn',
  'feddyn_options',
  'FEDDYN_SETTINGS',
  'FedDynConfig',
  'FedDynOutput',
  'FedDynState',
  'SPEC',
]


EVAL_MODELS = ('server', 'active_mean', 'all_clients_mean')


@struct.dataclass
class FedDynState:
  """FedDyn's state: the server model and the clients' gradient state.

  Attributes:
    params: the server model theta_server (what clients receive).
    h: the server state h.
    active_mean: mean of the last round's active client models.
    grad_state: stacked [N, ...] client states g_i.
    client_params: stacked [N, ...] latest model of every client (only kept
      when ``eval_model='all_clients_mean'``, else None).
  """

  params: optax.Params
  h: optax.Params
  active_mean: optax.Params
  grad_state: optax.Params
  client_params: Optional[optax.Params]


@dataclasses.dataclass(frozen=True)
class FedDynConfig(Declared):
  """FedDyn's settings: the ``--feddyn_*`` flags.

  Declared once (``hparam``: default, help, range, sweepable)."""

  prefix: ClassVar[str] = 'feddyn'
  alpha: float = hparam(
    1e-2,
    'Dynamic regularization coefficient alpha.',
    minimum=0,
    open_min=True,
    sweep=True,
  )
  adaptive_alpha: bool = hparam(
    False, "alpha_i = alpha * mean(n) / n_i (the authors' code)."
  )
  max_grad_norm: float = hparam(
    0.0,
    'Clip the data-term gradient to this norm (0: no '
    "clipping; the authors' code: 10).",
    minimum=0,
  )
  eval_model: str = hparam(
    'server',
    'Model evaluated: the server model, the mean of the '
    "last round's active models, or of all clients' latest models.",
    choices=('server', 'active_mean', 'all_clients_mean'),
  )


@struct.dataclass
class FedDynOutput:
  """What one FedDyn client returns.

  Attributes:
    params: theta_i after local training (the upload).
    grad_state: the client's new g_i.
    stats: local training LossStats.
  """

  params: optax.Params
  grad_state: optax.Params
  stats: LossStats


def dynamic_regularizer_grad(grads, params, server_params, grad_state, alpha_i):
  """Adds the gradient of -<g_i, theta> + alpha_i/2 ||theta -
  theta_server||^2."""
  return jax.tree.map(
    lambda g, p, s, gi: g - gi + alpha_i * (p - s),
    grads,
    params,
    server_params,
    grad_state,
  )


def server_update_h(params, h, client_params, mask, alpha, num_clients):
  """FedDyn's server step (the spec's equations).

  Returns (new server params, new h, mean of active models).
  """
  m = mask.astype(jnp.float32)
  count = jnp.maximum(jnp.sum(m), 1.0)
  diff_sum = jax.tree.map(
    lambda c, s: jnp.tensordot(m, c - s[None], axes=1), client_params, params
  )
  h = jax.tree.map(lambda hh, d: hh - alpha / num_clients * d, h, diff_sum)
  active_mean = jax.tree.map(lambda s, d: s + d / count, params, diff_sum)
  new_params = jax.tree.map(lambda a, hh: a - hh / alpha, active_mean, h)
  return new_params, h, active_mean


def feddyn(
  model: Model,
  num_clients: int,
  num_examples,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  alpha: float = 1e-2,
  adaptive_alpha: bool = False,
  max_grad_norm: Optional[float] = None,
  eval_model: str = 'server',
  data_objective: Optional[Callable] = None,
  batches_per_step: int = 1,
  finetune=None,
  evaluate_client=None,
  name: str = 'feddyn',
) -> FederatedAlgorithm:
  """Builds FedDyn.

  Args:
    model: the model.
    num_clients: N.
    num_examples: int [N] training examples per client (for adaptive alpha).
    client_optimizer: applied to the gradient of the regularized objective
      (the authors: SGD with weight decay 1e-3 and a per-round decay).
    batching: local batching (the authors: E = 5 epochs, B = 50).
    alpha: the regularization coefficient (1e-2 default).
    adaptive_alpha: alpha_i = alpha * mean(n) / n_i (authors' code).
    max_grad_norm: clip the data-term gradient to this norm (None: no clip).
    eval_model: 'server', 'active_mean' or 'all_clients_mean'.
    data_objective: ``(params, batch) -> (loss, stats)``, the data term L_i
      (default: the plain empirical risk on one batch).
    batches_per_step: batches per local step (2 for MAML / prototypes).
    finetune, evaluate_client: evaluation options (see FederatedAlgorithm).
    name: registry name.

  Returns:
    The ``FederatedAlgorithm``.
  """
  if is_concrete(alpha) and alpha <= 0:
    raise ConfigError('feddyn_alpha', f'must be > 0, got {alpha}')
  if eval_model not in EVAL_MODELS:
    raise ConfigError(
      'feddyn_eval_model',
      f'eval_model must be one of {EVAL_MODELS}, got {eval_model!r}',
    )
  n = np.asarray(num_examples, np.float64)
  alphas = alpha * jnp.asarray(
    n.mean() / np.maximum(n, 1) if adaptive_alpha else np.ones_like(n),
    jnp.float32,
  )
  data_objective = data_objective or plain_objective(model)
  keep_all = eval_model == 'all_clients_mean'

  def init(key: jax.Array) -> FedDynState:
    params = model.init(key)
    zeros = otu.tree_zeros_like(params)
    return FedDynState(
      params=params,
      h=zeros,
      active_mean=params,
      grad_state=tree_broadcast(zeros, num_clients),
      client_params=tree_broadcast(params, num_clients) if keep_all else None,
    )

  def server_broadcast(state: FedDynState, cohort: Cohort, rc: RoundContext):
    per_client = (
      rows(state.grad_state, cohort.rows),
      alphas.at[cohort.idx].get(mode='clip'),
    )
    return state.params, per_client

  clip = optax.clip_by_global_norm(max_grad_norm) if max_grad_norm else None

  def debiased(grads: PyTree, params: PyTree, ctx: ClientContext):
    grad_state, alpha_i = ctx.state
    if clip is not None:
      grads, _ = clip.update(grads, clip.init(grads))
    return dynamic_regularizer_grad(
      grads, params, ctx.shared, grad_state, alpha_i
    )

  def final(ctx: ClientContext, carry: PyTree):
    server_params = ctx.shared
    grad_state, alpha_i = ctx.state
    new_g = jax.tree.map(
      lambda g, p, s: g - alpha_i * (p - s),
      grad_state,
      carry.params,
      server_params,
    )
    return FedDynOutput(
      params=carry.params, grad_state=new_g, stats=carry.stats
    )

  work = dataclasses.replace(
    sgd_client_work(
      lambda ctx: data_objective,
      client_optimizer,
      batching,
      final,
      grad_transform=debiased,
    ),
    batches_per_step=batches_per_step,
  )

  def server_update(
    state: FedDynState, cohort: Cohort, out: FedDynOutput, rc: RoundContext
  ):
    params, h, active_mean = server_update_h(
      state.params, state.h, out.params, cohort.mask, alpha, num_clients
    )
    client_params = (
      tree_scatter(state.client_params, cohort.idx, out.params)
      if keep_all
      else None
    )
    new = FedDynState(
      params=params,
      h=h,
      active_mean=active_mean,
      grad_state=tree_scatter(state.grad_state, cohort.rows, out.grad_state),
      client_params=client_params,
    )
    return new, cohort_train_metrics(out.stats, cohort.mask)

  def client_models(state: FedDynState):
    if eval_model == 'server':
      p = state.params
    elif eval_model == 'active_mean':
      p = state.active_mean
    else:
      p = jax.tree.map(lambda a: a.mean(axis=0), state.client_params)
    return ClientModels.global_model(p, num_clients)

  return FederatedAlgorithm(
    name=name,
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=work,
    server_update=server_update,
    client_models=client_models,
    communication=global_model_communication,
    finetune=finetune,
    evaluate_client=evaluate_client,
    # client_params (eval_model='all_clients_mean') is averaged over every
    # client at once: it stays in the state, not client rows.
    client_rows=ClientRows.field('grad_state', models_from_rows=False),
  )


def feddyn_options(config: FedDynConfig) -> dict:
  """Builder arguments of FedDyn's own settings.

  Args:
    config: FedDyn's settings (``FedDynConfig``).

  Returns:
    Keyword arguments of ``feddyn``.
  """
  return dict(
    adaptive_alpha=config.adaptive_alpha,
    max_grad_norm=config.max_grad_norm or None,
    eval_model=config.eval_model,
  )


def build(
  training: TrainingConfig,
  config: FedDynConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedDyn, built as ``AlgorithmSpec.build`` says; its settings
  ``FedDynConfig``."""
  return feddyn(
    model,
    data.num_clients,
    data.train.num_examples,
    training.make_client_optimizer(),
    training.batching(),
    alpha=config.alpha,
    **feddyn_options(config),
  )


#: FedDyn aggregates by its own rule (uniform over active clients, no server
#: optimizer), so --weighting and the server optimizer do not apply.
FEDDYN_SETTINGS = CLIENT_OPTIMIZER | BATCHING | FINETUNE

SPEC = AlgorithmSpec(
  'feddyn',
  FedDynConfig,
  build,
  FEDDYN_SETTINGS,
  summary='FedDyn (Acar et al. 2021): dynamic regularization',
)
