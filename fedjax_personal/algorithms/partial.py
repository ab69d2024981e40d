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

from typing import Optional

from flax import struct
import jax
import jax.numpy as jnp
import optax

from fedjax_personal.algorithm import (ClientModels, Communication, FederatedAlgorithm,
                                       cohort_train_metrics)
from fedjax_personal.algorithms.fedavg import server_step, summed_upload
from fedjax_personal.batching import Batching, traced_num_steps
from fedjax_personal.models import Model
from fedjax_personal.personalization import ParamSplit
from fedjax_personal.training import (ClientWork, LossStats, local_sgd, plain_objective,
                                      zero_stats)
from fedjax_personal.tree_util import rows, tree_broadcast, tree_bytes, tree_scatter, tree_sub

MODES = ('alt', 'sim')


@struct.dataclass
class PartialState:
  """Attributes:
    shared: u, a flat dict {path: array} of the shared leaves.
    opt_state: server optimizer state of u.
    personal: v, a flat dict {path: [N, ...]} of every client's personal leaves.
  """
  shared: dict
  opt_state: optax.OptState
  personal: dict


@struct.dataclass
class PartialCarry:
  shared: dict
  personal: dict
  personal_steps: jax.Array  # FedAlt: the personal phase's real steps
  count: jax.Array
  stats: LossStats


@struct.dataclass
class PartialOutput:
  """Attributes:
    shared_delta: u - u_i+ (the only thing uploaded).
    personal: v_i+ (stays on the client).
    num_examples: n_i.
    stats: local training LossStats.
  """
  shared_delta: dict
  personal: dict
  num_examples: jax.Array
  stats: LossStats


def combined_batching(shared: Batching, personal: Batching) -> Batching:
  """One batch stream for the personal phase followed by the shared phase."""
  if shared.batch_size != personal.batch_size:
    raise ValueError('FedAlt: personal and shared phases need the same batch size')
  if (shared.num_epochs is None) != (personal.num_epochs is None):
    raise ValueError('FedAlt: personal and shared phases must both use epochs or both steps')
  if shared.num_epochs is not None:
    return Batching(shared.batch_size, num_epochs=shared.num_epochs + personal.num_epochs)
  return Batching(shared.batch_size, num_epochs=None,
                  num_steps=shared.num_steps + personal.num_steps)


def personal_finetune(model: Model, split: ParamSplit, learning_rate: float, batching: Batching):
  """Evaluation fine-tuning of the personal leaves only (shared leaves frozen),
  on the client's training split."""
  objective = plain_objective(model)

  def finetune(params, local, key):
    shared, personal = split.split(params)
    personal, _ = local_sgd(personal, lambda v, batch: objective(split.merge(shared, v), batch),
                            optax.sgd(learning_rate), local.train, key, batching)
    return split.merge(shared, personal)
  return finetune


def partial_personalization(model: Model, num_clients: int, split: ParamSplit, mode: str,
                            learning_rate: float, batching: Batching,
                            personal_batching: Optional[Batching] = None,
                            personal_lr: Optional[float] = None,
                            server_optimizer: Optional[optax.GradientTransformation] = None,
                            weighting: str = 'num_examples', finetune=None,
                            name: Optional[str] = None) -> FederatedAlgorithm:
  """Builds FedAlt (mode 'alt') or FedSim (mode 'sim').

  Args:
    split: which leaves are personal.
    mode: 'alt' or 'sim'.
    learning_rate: gamma_u (and gamma for FedSim's shared leaves).
    batching: FedSim's local steps; FedAlt's shared phase.
    personal_batching: FedAlt's personal phase (default: same as ``batching``).
    personal_lr: gamma_v (default: learning_rate).
    server_optimizer: on the mean shared delta (default plain mean).
    weighting: 'num_examples' or 'uniform'.
    finetune: optional evaluation fine-tuning (see ``personal_finetune``).
  """
  if mode not in MODES:
    raise ValueError(f'mode must be one of {MODES}, got {mode!r}')
  server_optimizer = server_optimizer or optax.sgd(1.0)
  personal_lr = learning_rate if personal_lr is None else personal_lr
  personal_batching = personal_batching or batching
  total = combined_batching(batching, personal_batching) if mode == 'alt' else batching
  objective = plain_objective(model)

  def init(key):
    shared, personal = split.split(model.init(key))
    return PartialState(shared, server_optimizer.init(shared), tree_broadcast(personal, num_clients))

  def server_broadcast(state, cohort):
    return state.shared, rows(state.personal, cohort.idx)

  def work_init(ctx, key):
    del key
    train = ctx.data.train
    p_steps = (traced_num_steps(personal_batching, train.num_examples, train.x.shape[0])
               if mode == 'alt' else jnp.zeros((), jnp.int32))
    return PartialCarry(ctx.shared, ctx.state, p_steps, jnp.zeros((), jnp.int32), zero_stats())

  def work_step(ctx, carry, batch, key):
    del key
    grad_fn = jax.value_and_grad(lambda s, p: objective(split.merge(s, p), batch), argnums=(0, 1),
                                 has_aux=True)
    (_, stats), (g_shared, g_personal) = grad_fn(carry.shared, carry.personal)
    if mode == 'alt':
      personal_phase = carry.count < carry.personal_steps
      lr_u = jnp.where(personal_phase, 0.0, learning_rate)
      lr_v = jnp.where(personal_phase, personal_lr, 0.0)
    else:
      lr_u, lr_v = learning_rate, personal_lr
    return carry.replace(
        shared=jax.tree.map(lambda a, g: a - lr_u * g, carry.shared, g_shared),
        personal=jax.tree.map(lambda a, g: a - lr_v * g, carry.personal, g_personal),
        count=carry.count + 1, stats=jax.tree.map(jnp.add, carry.stats, stats))

  def work_final(ctx, carry):
    return PartialOutput(shared_delta=tree_sub(ctx.shared, carry.shared), personal=carry.personal,
                         num_examples=ctx.data.train.num_examples, stats=carry.stats)

  work = summed_upload(ClientWork(init=work_init, step=work_step, final=work_final,
                                  batching=total), weighting, field='shared_delta')

  def server_update(state, cohort, out: PartialOutput):
    shared, opt_state = server_step(state.shared, state.opt_state, out.shared_delta,
                                    server_optimizer)
    return (PartialState(shared, opt_state, tree_scatter(state.personal, cohort.idx, out.personal)),
            cohort_train_metrics(out.stats, cohort.mask))

  def client_models(state):
    shared = tree_broadcast(state.shared, num_clients)
    return ClientModels.personal(jax.vmap(split.merge)(shared, state.personal), num_clients)

  def communication(state):
    b = tree_bytes(state.shared)
    return Communication(b, b, 1)

  return FederatedAlgorithm(
      name=name or f'fed{mode}', model=model, init=init, server_broadcast=server_broadcast,
      client_work=work, server_update=server_update, client_models=client_models,
      communication=communication, finetune=finetune)
