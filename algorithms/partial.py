"""Partial model personalization: FedAlt and FedSim (Pillutla et al., ICML 2022).

Model on client i = (u, v_i): u shared, v_i personal (``personalization.ParamSplit``).
Each round the active clients receive u and run local SGD:

  FedAlt (alternating):  v_i+ = v_i - gamma_v grad_v F_i(u, v_i)     (personal phase)
                         u_i+ = u - gamma_u grad_u F_i(u, v_i+)      (shared phase)
  FedSim (simultaneous): (u_i+, v_i+) = (u, v_i) - gamma grad F_i(u, v_i)

(each line is a phase of local SGD steps on the client's own batches). The
client uploads only u_i+ (its delta); v_i+ stays in the client's row of the
stacked personal state and is never uploaded. The server averages the shared
deltas weighted by client size (a server optimizer is allowed).

Related presets (``algorithms/__init__``): FedRep (Collins et al. 2021) =
FedAlt with the output layer personal and a longer head phase; FedPer
(Arivazhagan et al. 2019) = FedSim with the output layer personal;
LG-FedAvg (Liang et al. 2020) = FedSim with everything but the head personal.
"""

import dataclasses
from typing import Any, ClassVar, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct
from optax import tree_utils as otu

from fedjax_personal.algorithms.fedavg import (
  FEDAVG_SETTINGS,
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
  ClientRows,
  Communication,
  FederatedAlgorithm,
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching, traced_num_steps
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.losses import Batch
from fedjax_personal.core.personalization import ParamSplit, make_split
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import (
  ClientContext,
  ClientWork,
  LossStats,
  StatsAndState,
  client_opt_init,
  keep_model_state,
  local_sgd,
  opt_update,
  plain_objective,
  zero_stats,
)
from fedjax_personal.core.tree_util import (
  PyTree,
  leading_size,
  rows,
  tree_broadcast,
  tree_bytes,
  tree_scatter,
)
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import Model

__all__ = [
  'FEDALT_SPEC',
  'FEDBN_SPEC',
  'FEDPER_SPEC',
  'FEDREP_SPEC',
  'FEDSIM_SPEC',
  'LG_FEDAVG_SPEC',
  'partial_personalization',
  'parts_with_state',
  'PartialCarry',
  'PartialConfig',
  'PartialOutput',
  'PartialState',
]


MODES = ('alt', 'sim')


@dataclasses.dataclass(frozen=True)
class PartialConfig(Declared):
  """Partial personalization's settings: the ``--partial_*`` flags.

  Partial personalization (FedAlt, FedSim, FedRep, FedPer, LG-FedAvg)'s own
  settings, declared once: the ``--partial_*`` flags (``hparam``: default, help,
  range, sweepable)."""

  prefix: ClassVar[str] = 'partial'
  personal_part: str = hparam(
    'output',
    'fedalt/fedsim: personal parameters: input, output, '
    'adapter, norm, all_but_output, all, block:<i>, or split:<regex>,...',
  )
  personal_lr: Optional[float] = hparam(
    None,
    'Learning rate of the personal parameters (default: --client_lr).',
    minimum=0,
    open_min=True,
    sweep=True,
  )
  personal_epochs: Optional[int] = hparam(
    None,
    'FedAlt/FedRep personal phase: epochs (steps '
    "with --local_steps); default: the shared phase's "
    '(FedRep: 5x).',
    minimum=1,
  )


@struct.dataclass
class PartialState:
  """Partial personalization's state: the shared part and the personal rows.

  Attributes:
    shared: u, a flat dict {path: array} of the shared leaves.
    opt_state: server optimizer state of u.
    personal: v, a flat dict {path: [N, ...]} of every client's personal leaves.
  """

  shared: dict
  opt_state: optax.OptState
  personal: dict


@struct.dataclass
class PartialCarry:
  """A client's local state: its shared and its personal parameters."""

  shared: dict
  personal: dict
  opt_state: tuple  # (optimizer state of u, of v)
  personal_steps: jax.Array  # FedAlt: the personal phase's real steps
  count: jax.Array
  stats: LossStats


@struct.dataclass
class PartialOutput:
  """What one client of partial personalization returns.

  Attributes:
    shared_delta: u - u_i+ (the only thing uploaded).
    personal: v_i+ (stays on the client).
    num_examples: n_i.
    stats: local training LossStats.
  """

  shared_delta: (
    Any  # a client's delta; the cohort's Sum where the server reads it
  )
  personal: Any
  num_examples: HostOrDevice
  stats: LossStats


def combined_batching(shared: Batching, personal: Batching) -> Batching:
  """One batch stream for the personal phase followed by the shared phase."""
  if shared.batch_size != personal.batch_size:
    raise ValueError(
      'FedAlt: personal and shared phases need the same batch size'
    )
  if (shared.num_epochs is None) != (personal.num_epochs is None):
    raise ValueError(
      'FedAlt: personal and shared phases must both use epochs or both steps'
    )
  if shared.num_epochs is not None:
    return Batching(
      shared.batch_size,
      num_epochs=shared.epochs + personal.epochs,
      drop_last=shared.drop_last,
    )
  return Batching(
    shared.batch_size, num_epochs=None, num_steps=shared.steps + personal.steps
  )


def parts_with_state(split: ParamSplit, shared: dict, personal: dict, aux):
  """The two parts after a step, each with the batch statistics its
  forward pass computed (a model with ``collections``: FedBN's personal
  BatchNorm, FedAvg's shared one), and the step's ``LossStats``.

  Args:
    split: the ``ParamSplit``.
    shared: u after the step.
    personal: v after the step.
    aux: the objective's ``LossStats`` or ``StatsAndState``.

  Returns:
    ``(shared, personal, LossStats)``.
  """
  if not isinstance(aux, StatsAndState):
    return shared, personal, aux
  full, stats = keep_model_state(split.merge(shared, personal), aux)
  shared, personal = split.split(full)
  return shared, personal, stats


def personal_finetune(
  model: Model, split: ParamSplit, learning_rate: float, batching: Batching
):
  """Evaluation fine-tuning of the personal leaves only (shared leaves frozen),
  on the client's training split, by plain SGD."""
  objective = plain_objective(model)

  def finetune(params, local, key):
    shared, personal = split.split(params)

    def personal_objective(v, batch):
      loss, aux = objective(split.merge(shared, v), batch)
      if isinstance(aux, StatsAndState):  # the personal part's new statistics
        _, v_new, stats = parts_with_state(split, shared, v, aux)
        aux = StatsAndState(stats, v_new)
      return loss, aux

    personal, _ = local_sgd(
      personal,
      personal_objective,
      optax.sgd(learning_rate),
      local.train,
      key,
      batching,
    )
    return split.merge(shared, personal)

  return finetune


def partial_personalization(
  model: Model,
  num_clients: int,
  split: ParamSplit,
  mode: str,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  personal_batching: Optional[Batching] = None,
  personal_optimizer: Optional[optax.GradientTransformation] = None,
  server_optimizer: Optional[optax.GradientTransformation] = None,
  weighting: str = 'num_examples',
  finetune=None,
  name: Optional[str] = None,
) -> FederatedAlgorithm:
  """Builds FedAlt (mode 'alt') or FedSim (mode 'sim').

  Args:
    split: which leaves are personal.
    mode: 'alt' or 'sim'.
    client_optimizer: the optimizer of u (``optax.sgd(gamma_u)`` is the
      paper's).
    batching: FedSim's local steps; FedAlt's shared phase.
    personal_batching: FedAlt's personal phase (default: same as ``batching``).
    personal_optimizer: the optimizer of v_i (default: client_optimizer).
    server_optimizer: on the mean shared delta (default plain mean).
    weighting: 'num_examples', 'tokens' (``fedavg.train_tokens``) or 'uniform'.
    finetune: optional evaluation fine-tuning (see ``personal_finetune``).

  Returns:
    The ``FederatedAlgorithm``.
  """
  if mode not in MODES:
    raise ConfigError('algorithm', f'mode must be one of {MODES}, got {mode!r}')
  server_optimizer = server_optimizer or optax.sgd(1.0)
  personal_optimizer = personal_optimizer or client_optimizer
  personal_batching = personal_batching or batching
  total = (
    combined_batching(batching, personal_batching)
    if mode == 'alt'
    else batching
  )
  objective = plain_objective(model)

  def init(key: jax.Array) -> PartialState:
    shared, personal = split.split(model.init(key))
    return PartialState(
      shared,
      server_optimizer.init(shared),
      tree_broadcast(personal, num_clients),
    )

  def server_broadcast(state: PartialState, cohort: Cohort, rc: RoundContext):
    return state.shared, rows(state.personal, cohort.rows)

  def init_parts(u, v):
    return client_optimizer.init(u), personal_optimizer.init(v)

  def init_opt_state(params):
    return init_parts(*split.split(params))

  def work_init(ctx: ClientContext, key: jax.Array):
    del key
    train = ctx.data.train
    p_steps = (
      traced_num_steps(personal_batching, train.num_examples, train.x.shape[0])
      if mode == 'alt'
      else jnp.zeros((), jnp.int32)
    )
    opt_state = client_opt_init(
      ctx, lambda uv: init_parts(*uv), (ctx.shared, ctx.state)
    )
    return PartialCarry(
      ctx.shared,
      ctx.state,
      opt_state,
      p_steps,
      jnp.zeros((), jnp.int32),
      zero_stats(),
    )

  def work_step(
    ctx: ClientContext, carry: PyTree, batch: Batch, key: jax.Array
  ):
    del key
    opt_u, opt_v = carry.opt_state

    def loss(s, p):
      return objective(split.merge(s, p), batch)

    def move(optimizer, grads, opt, params):
      upd, new_opt = opt_update(optimizer, grads, opt, params, ctx)
      return optax.apply_updates(params, upd), new_opt

    def shared_step(_):
      (_, stats), g = jax.value_and_grad(loss, has_aux=True)(
        carry.shared, carry.personal
      )
      moved = move(client_optimizer, g, opt_u, carry.shared)
      return moved, (carry.personal, opt_v), stats

    def personal_step(_):
      (_, stats), g = jax.value_and_grad(loss, argnums=1, has_aux=True)(
        carry.shared, carry.personal
      )
      moved = move(personal_optimizer, g, opt_v, carry.personal)
      return (carry.shared, opt_u), moved, stats

    if mode == 'alt':
      # personal phase: only v moves; shared phase: only u. A branch each,
      # so a step computes its own part's gradient alone (a personal head's
      # phase passes back through the head only)
      personal_phase = carry.count < carry.personal_steps
      (u, new_opt_u), (v, new_opt_v), stats = jax.lax.cond(
        personal_phase, personal_step, shared_step, None
      )
    else:
      grad_fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
      (_, stats), (g_shared, g_personal) = grad_fn(carry.shared, carry.personal)
      u, new_opt_u = move(client_optimizer, g_shared, opt_u, carry.shared)
      v, new_opt_v = move(personal_optimizer, g_personal, opt_v, carry.personal)
    # batch statistics of this forward pass
    u, v, stats = parts_with_state(split, u, v, stats)
    return carry.replace(
      shared=u,
      personal=v,
      opt_state=(new_opt_u, new_opt_v),
      count=carry.count + 1,
      stats=jax.tree.map(jnp.add, carry.stats, stats),
    )

  def work_final(ctx: ClientContext, carry: PyTree):
    return PartialOutput(
      shared_delta=otu.tree_sub(ctx.shared, carry.shared),
      personal=carry.personal,
      num_examples=ctx.data.train.num_examples,
      stats=carry.stats,
    )

  work = summed_upload(
    ClientWork(
      init=work_init,
      step=work_step,
      final=work_final,
      batching=total,
      init_opt_state=init_opt_state,
      opt_state=lambda carry: carry.opt_state,
    ),
    weighting,
    field='shared_delta',
  )

  def server_update(
    state: PartialState, cohort: Cohort, out: PartialOutput, rc: RoundContext
  ):
    shared, opt_state = server_step(
      state.shared, state.opt_state, out.shared_delta, server_optimizer
    )
    return (
      PartialState(
        shared,
        opt_state,
        tree_scatter(state.personal, cohort.rows, out.personal),
      ),
      cohort_train_metrics(out.stats, cohort.mask),
    )

  def client_models(state: PartialState):
    shared = tree_broadcast(state.shared, leading_size(state.personal))
    return ClientModels.personal(
      jax.vmap(split.merge)(shared, state.personal), num_clients
    )

  def communication(state: PartialState):
    b = tree_bytes(state.shared)
    return Communication(b, b, 1)

  return FederatedAlgorithm(
    name=name or f'fed{mode}',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=work,
    server_update=server_update,
    client_models=client_models,
    communication=communication,
    finetune=finetune,
    client_rows=ClientRows.field('personal'),
  )


def _build(mode, personal_part=None, head_ratio=1, name=None):
  def build(
    training: TrainingConfig,
    config: PartialConfig,
    model: Model,
    data: BuildData,
  ) -> FederatedAlgorithm:
    try:
      split = make_split(
        personal_part or config.personal_part,
        jax.eval_shape(model.init, jax.random.key(0)),
      )
    except ValueError as e:
      raise ConfigError('partial_personal_part', str(e)) from None
    b = training.batching()
    personal_b = None
    if mode == 'alt':
      if b.num_epochs is not None:
        personal_b = Batching(
          b.batch_size,
          num_epochs=config.personal_epochs or head_ratio * b.num_epochs,
          drop_last=b.drop_last,
        )
      else:
        personal_b = Batching(
          b.batch_size,
          num_epochs=None,
          num_steps=config.personal_epochs or head_ratio * b.num_steps,
        )
    personal_lr = (
      training.client_lr if config.personal_lr is None else config.personal_lr
    )
    ft = None
    if training.finetune_steps:
      ft = personal_finetune(
        model,
        split,
        personal_lr if training.finetune_lr is None else training.finetune_lr,
        training.finetune_batching(),
      )
    return partial_personalization(
      model,
      data.num_clients,
      split,
      mode,
      training.make_client_optimizer(),
      b,
      personal_batching=personal_b,
      personal_optimizer=training.make_client_optimizer(
        learning_rate=personal_lr
      ),
      server_optimizer=training.make_server_optimizer(),
      weighting=training.filled_weighting(),
      finetune=ft,
      name=name,
    )

  return build


_PART = frozenset({'personal_part'})
_EPOCHS = frozenset({'personal_epochs'})
FEDALT_SPEC = AlgorithmSpec(
  'fedalt',
  PartialConfig,
  _build('alt'),
  FEDAVG_SETTINGS,
  model_state=True,
  summary='FedAlt (Pillutla et al. 2022): alternating partial personalization',
)
FEDSIM_SPEC = AlgorithmSpec(
  'fedsim',
  PartialConfig,
  _build('sim'),
  FEDAVG_SETTINGS,
  model_state=True,
  ignores=_EPOCHS,
  summary='FedSim: simultaneous partial personalization',
)
FEDREP_SPEC = AlgorithmSpec(
  'fedrep',
  PartialConfig,
  _build('alt', 'output', head_ratio=5, name='fedrep'),
  FEDAVG_SETTINGS,
  ignores=_PART,
  model_state=True,
  summary='FedRep (Collins et al. 2021): FedAlt, personal head, 5x head phase',
)
FEDPER_SPEC = AlgorithmSpec(
  'fedper',
  PartialConfig,
  _build('sim', 'output', name='fedper'),
  FEDAVG_SETTINGS,
  ignores=_PART | _EPOCHS,
  model_state=True,
  summary='FedPer (Arivazhagan et al. 2019): FedSim, personal head',
)
FEDBN_SPEC = AlgorithmSpec(
  'fedbn',
  PartialConfig,
  _build('sim', 'norm', name='fedbn'),
  FEDAVG_SETTINGS,
  ignores=_PART | _EPOCHS,
  model_state=True,
  summary='FedBN (Li et al. 2021): FedAvg with every BatchNorm layer '
  '(scale, bias, running statistics) kept on its client',
)
LG_FEDAVG_SPEC = AlgorithmSpec(
  'lg_fedavg',
  PartialConfig,
  _build('sim', 'all_but_output', name='lg_fedavg'),
  FEDAVG_SETTINGS,
  ignores=_PART | _EPOCHS,
  model_state=True,
  summary='LG-FedAvg (Liang et al. 2020): FedSim, personal body',
)
