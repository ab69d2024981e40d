"""Oracle clusters: one FedAvg per known group of clients.

The upper reference of the user-centric paper's tables (Mestoukirdi et al.):
the true groups (rotation, label permutation, latent cluster) are given, and
each group trains its own FedAvg model. The G group models are one stacked
pytree; each client uploads its weighted delta into its group's row of a
[G, ...] sum (``fedavg.summed_upload`` with groups), and the server optimizer
is vmapped over groups.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from fedjax_personal.algorithms.fedavg import (
  FEDAVG_SETTINGS,
  make_client_work,
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
from fedjax_personal.core.algorithm import (
  ClientModels,
  Communication,
  FederatedAlgorithm,
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.tree_util import rows, tree_broadcast
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import Model

__all__ = ['build', 'oracle', 'OracleState', 'SPEC']


@struct.dataclass
class OracleState:
  """The oracle's state: one model per known group.

  Attributes:
    group_params: stacked [G, ...] models, one per group.
    opt_state: server optimizer state per group (leading axis G).
  """

  group_params: optax.Params
  opt_state: optax.OptState


def oracle(
  model: Model,
  groups,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  server_optimizer=None,
  weighting: str = 'num_examples',
  finetune=None,
) -> FederatedAlgorithm:
  """Builds oracle clustered FedAvg.

  Args:
    groups: int [N] known group of each client (0..G-1), e.g. ``data.groups``.

  Returns:
    The ``FederatedAlgorithm``.
  """
  groups_np = np.asarray(groups)
  if groups_np.size == 0 or groups_np.min() < 0:
    raise ConfigError(
      'algorithm',
      'oracle needs a known group for every client; this partition has none '
      '(use --partition=rotation, label_permutation, latent_clusters or '
      'sparse_classes)',
    )
  num_groups = int(groups_np.max()) + 1
  groups = jnp.asarray(groups_np, jnp.int32)
  server_optimizer = server_optimizer or optax.sgd(1.0)

  def init(key: jax.Array) -> OracleState:
    params = tree_broadcast(model.init(key), num_groups)
    return OracleState(params, jax.vmap(server_optimizer.init)(params))

  def server_broadcast(state: OracleState, cohort: Cohort, rc: RoundContext):
    g = groups.at[cohort.idx].get(mode='clip')
    return None, (rows(state.group_params, g), g)

  def server_update(state: OracleState, cohort: Cohort, out, rc: RoundContext):
    params, opt_state = jax.vmap(server_step, in_axes=(0, 0, 0, None))(
      state.group_params, state.opt_state, out.delta, server_optimizer
    )
    return OracleState(params, opt_state), cohort_train_metrics(
      out.stats, cohort.mask
    )

  def communication(state: OracleState):
    return Communication.one_of(state.group_params, num_groups)

  return FederatedAlgorithm(
    name='oracle',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=summed_upload(
      make_client_work(
        model, client_optimizer, batching, start_fn=lambda ctx: ctx.state[0]
      ),
      weighting,
      group_fn=lambda ctx, out: (ctx.state[1], num_groups),
    ),
    server_update=server_update,
    client_models=lambda s: ClientModels(s.group_params, groups),
    communication=communication,
    finetune=finetune,
  )


def build(
  training: TrainingConfig,
  config: Declared,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """Oracle (FedAvg within each true group), built as ``AlgorithmSpec.build``
  says."""
  del config
  return oracle(
    model,
    data.groups,
    training.make_client_optimizer(),
    training.batching(),
    server_optimizer=training.make_server_optimizer(),
    weighting=training.filled_weighting(),
  )


SPEC = AlgorithmSpec(
  'oracle',
  NoConfig,
  build,
  FEDAVG_SETTINGS,
  model_state=True,
  summary='Oracle clusters: one FedAvg per known group',
)
