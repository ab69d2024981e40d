"""Local training: every client trains alone, nothing is communicated.

Personal models live in a stacked pytree [N, ...], all starting from the same
initialization; each round the cohort trains its own rows.
"""

import jax
import optax
from flax import struct

from fedjax_personal.config import (
  BATCHING,
  CLIENT_OPTIMIZER,
  FINETUNE,
  AlgorithmSpec,
  BuildData,
  Declared,
  NoConfig,
  TrainingConfig,
)
from fedjax_personal.core.algorithm import (
  ClientModels,
  ClientRows,
  Communication,
  FederatedAlgorithm,
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import (
  LossStats,
  plain_objective,
  sgd_client_work,
)
from fedjax_personal.core.tree_util import rows, tree_broadcast
from fedjax_personal.models import Model

__all__ = ['build', 'local', 'LocalOutput', 'LocalState', 'SPEC']


@struct.dataclass
class LocalState:
  """Local training's state: each client's own model.

  Attributes:
    personal_params: stacked [N, ...] models, one per client.
  """

  personal_params: optax.Params


@struct.dataclass
class LocalOutput:
  """A local-training client's output.

  A client's output. Attributes:
  params: its new personal model (written to its row by the engine:
    ``ClientRows.output``, so that the blocked loop writes it in place).
  stats: its training statistics.
  """

  params: optax.Params
  stats: LossStats


def local(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  finetune=None,
) -> FederatedAlgorithm:
  """Builds Local training.

  Args:
    model: the model (pure ``init`` / ``apply``).
    num_clients: N: per-client state has N rows.
    client_optimizer: the optax client optimizer.
    batching: local batching (epochs or steps, batch size).
    finetune: optional evaluation fine-tuning (``training.sgd_finetune``).

  Returns:
    The ``FederatedAlgorithm``.
  """
  objective = plain_objective(model)

  def init(key: jax.Array) -> LocalState:
    return LocalState(tree_broadcast(model.init(key), num_clients))

  def server_broadcast(state: LocalState, cohort: Cohort, rc: RoundContext):
    return None, rows(state.personal_params, cohort.rows)

  work = sgd_client_work(
    lambda ctx: objective,
    client_optimizer,
    batching,
    final=lambda ctx, carry: LocalOutput(carry.params, carry.stats),
    start_fn=lambda ctx: ctx.state,
  )

  def server_update(
    state: LocalState, cohort: Cohort, out: LocalOutput, rc: RoundContext
  ):
    # The engine wrote the new personal models (client_rows' output).
    return state, cohort_train_metrics(out.stats, cohort.mask)

  return FederatedAlgorithm(
    name='local',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=work,
    server_update=server_update,
    client_models=lambda s: ClientModels.personal(
      s.personal_params, num_clients
    ),
    communication=lambda s: Communication(0, 0, 0),
    finetune=finetune,
    client_rows=ClientRows.field('personal_params', output='params'),
  )


def build(
  training: TrainingConfig,
  config: Declared,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """Local (each client alone), built as ``AlgorithmSpec.build`` says."""
  del config
  return local(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
  )


SPEC = AlgorithmSpec(
  'local',
  NoConfig,
  build,
  CLIENT_OPTIMIZER | BATCHING | FINETUNE,
  model_state=True,
  summary='Local training: each client alone',
)
