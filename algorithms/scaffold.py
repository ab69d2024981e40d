"""SCAFFOLD (Karimireddy et al., ICML 2020), option II control variates.

Client i corrects every local gradient by c - c_i (the local loss gains
<theta, c - c_i>); after its K real local steps of SGD with learning rate lr,

    c_i+ = c_i - c + (theta_server - theta_i) / (K lr)            (option II)

For plain SGD, theta_server - theta_i = lr sum_k (g_k + c - c_i), so option II
is the mean of the client's raw local gradients, c_i+ = (1/K) sum_k g_k. That
form is what is computed here: it is the same number for SGD and stays
defined for any client optimizer (momentum, Adam, weight decay, clipping act
on the corrected gradient; the control variate estimates the client's
gradient either way).

The server averages the active models (a server optimizer on the mean delta;
``optax.sgd(1.0)`` is the plain mean) and updates

    c <- c + (1/N) sum_{i in P_t} (c_i+ - c_i).

Control variates of all N clients persist across rounds as one stacked pytree.
Uplink and downlink both carry a model and a control variate.
"""

from typing import Optional

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
  NoConfig,
  TrainingConfig,
)
from fedjax_personal.core.aggregation import Sum
from fedjax_personal.core.algorithm import (
  ClientModels,
  ClientRows,
  Communication,
  FederatedAlgorithm,
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import (
  ClientContext,
  LossStats,
  plain_objective,
  sgd_client_work,
)
from fedjax_personal.core.tree_util import (
  PyTree,
  rows,
  tree_broadcast,
  tree_bytes,
  tree_scatter,
)
from fedjax_personal.models import Model

__all__ = ['build', 'scaffold', 'ScaffoldOutput', 'ScaffoldState', 'SPEC']


@struct.dataclass
class ScaffoldState:
  """SCAFFOLD's state: the server model and the control variates.

  Attributes:
    params: server model theta.
    opt_state: server optimizer state.
    control: server control variate c.
    client_controls: stacked [N, ...] control variates c_i.
  """

  params: optax.Params
  opt_state: optax.OptState
  control: optax.Params
  client_controls: optax.Params


@struct.dataclass
class ScaffoldOutput:
  """What one SCAFFOLD client returns.

  Attributes:
    delta: theta_server - theta_i (a weighted ``Sum`` share after
      ``summed_upload``).
    control: c_i+ (kept by the client; its change is uploaded).
    control_delta: ``Sum(c_i+ - c_i)``, summed over the cohort by the engine.
    num_examples: n_i.
    stats: local training LossStats.
  """

  delta: optax.Params
  control: optax.Params
  control_delta: optax.Params
  num_examples: HostOrDevice
  stats: LossStats


def option_ii_control(client_control, grad_sum, num_steps):
  """c_i+ = (1/K) sum_k g_k over the K real steps (option II, see the module
  docstring); c_i when K = 0."""
  k = jnp.maximum(num_steps, 1).astype(jnp.float32)
  return jax.tree.map(
    lambda ci, g: jnp.where(num_steps > 0, g / k, ci), client_control, grad_sum
  )


def scaffold(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  server_optimizer: Optional[optax.GradientTransformation] = None,
  weighting: str = 'uniform',
  finetune=None,
) -> FederatedAlgorithm:
  """Builds SCAFFOLD.

  Args:
    client_optimizer: applied to the corrected gradients (the paper: SGD).
    weighting: aggregation of the models, 'uniform' (the paper's mean over
      the active clients) or 'num_examples'.

  Returns:
    The ``FederatedAlgorithm``.
  """
  server_optimizer = server_optimizer or optax.sgd(1.0)

  def init(key: jax.Array) -> ScaffoldState:
    params = model.init(key)
    return ScaffoldState(
      params,
      server_optimizer.init(params),
      otu.tree_zeros_like(params),
      tree_broadcast(otu.tree_zeros_like(params), num_clients),
    )

  def server_broadcast(state: ScaffoldState, cohort: Cohort, rc: RoundContext):
    return (state.params, state.control), rows(
      state.client_controls, cohort.rows
    )

  def corrected(grads: PyTree, params: PyTree, ctx: ClientContext):
    _, control = ctx.shared
    return jax.tree.map(lambda g, c, ci: g + c - ci, grads, control, ctx.state)

  def final(ctx: ClientContext, carry: PyTree):
    server_params, control = ctx.shared
    new_control = option_ii_control(ctx.state, carry.grad_sum, carry.num_steps)
    return ScaffoldOutput(
      delta=otu.tree_sub(server_params, carry.params),
      control=new_control,
      control_delta=Sum(otu.tree_sub(new_control, ctx.state)),
      num_examples=ctx.data.train.num_examples,
      stats=carry.stats,
    )

  plain = plain_objective(model)
  work = summed_upload(
    sgd_client_work(
      lambda ctx: plain,
      client_optimizer,
      batching,
      final,
      start_fn=lambda ctx: ctx.shared[0],
      grad_transform=corrected,
      sum_grads=True,
    ),
    weighting,
  )

  def server_update(
    state: ScaffoldState, cohort: Cohort, out: ScaffoldOutput, rc: RoundContext
  ):
    params, opt_state = server_step(
      state.params, state.opt_state, out.delta, server_optimizer
    )
    control = jax.tree.map(
      lambda c, d: c + d / num_clients, state.control, out.control_delta.value
    )
    client_controls = tree_scatter(
      state.client_controls, cohort.rows, out.control
    )
    return (
      ScaffoldState(params, opt_state, control, client_controls),
      cohort_train_metrics(out.stats, cohort.mask),
    )

  def communication(state: ScaffoldState):
    b = tree_bytes(state.params)
    return Communication(2 * b, 2 * b, 1)

  return FederatedAlgorithm(
    name='scaffold',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=work,
    server_update=server_update,
    client_models=lambda s: ClientModels.global_model(s.params, num_clients),
    communication=communication,
    finetune=finetune,
    client_rows=ClientRows.field('client_controls', models_from_rows=False),
  )


def build(
  training: TrainingConfig,
  config: Declared,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """SCAFFOLD, built as ``AlgorithmSpec.build`` says."""
  del config
  return scaffold(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    server_optimizer=training.make_server_optimizer(),
    weighting=training.filled_weighting(),
  )


SPEC = AlgorithmSpec(
  'scaffold',
  NoConfig,
  build,
  FEDAVG_SETTINGS,
  default_weighting='uniform',
  summary='SCAFFOLD (Karimireddy et al. 2020), option II control variates',
)
