"""FedMTL as PFLlib runs it (``servermtl.py`` / ``clientmtl.py``; after
Smith, Chiang, Sanjabi and Talwalkar, "Federated Multi-Task Learning",
NeurIPS 2017, arXiv 1705.10467, but not its MOCHA solver): every client
keeps its own model w_i and trains on its loss plus a task-relationship
regularizer over the round's models stacked as columns of W [P, M]:

  R(W) = 10^-f (||W||_F^2 + sum_p (omega sum_j W_pj)^2),

the other clients' columns as they were when the round began, its own
column live; omega = 1 - 1/M (PFLlib's ``sqrt(omega[0][0])`` of
Omega = (I - 11^T / M)^2, M its clients a round) and f the number of digits
of P plus 1 (PFLlib's ``int(log10(P) + 1) + 1``: the term's scale). Nothing
is aggregated; clients evaluate their own models.

A trap in PFLlib's code: its W is built from ``state_dict()`` values, which
are detached, so R has no gradient and PFLlib's FedMTL trains each client
alone (as Local). ``--fedmtl_detached`` runs that; the default is the
regularizer with its gradient, 10^-f (2 w_i + 2 omega^2 sum_j w_j). P here
counts the trained parameters (PFLlib's state dict also counts a batch
norm's statistics, which moves f only across a power of ten).
"""

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import struct
from optax import tree_utils as otu

from fedjax_personal.config import (
  BATCHING,
  CLIENT_OPTIMIZER,
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
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.losses import Batch, LossStats, plain_objective
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import ClientContext, sgd_client_work
from fedjax_personal.core.tree_util import (
  PyTree,
  rows,
  tree_broadcast,
  tree_gather,
)
from fedjax_personal.models import Model

__all__ = [
  'build',
  'fedmtl',
  'FedMTLConfig',
  'regularizer_scale',
  'relationship_penalty',
  'SPEC',
]


@dataclasses.dataclass(frozen=True)
class FedMTLConfig(Declared):
  """FedMTL's own settings: the ``--fedmtl_*`` flags."""

  prefix: ClassVar[str] = 'fedmtl'
  detached: bool = hparam(
    False,
    "PFLlib's regularizer: computed on the parameters' values, so without a "
    'gradient (each client trains alone).',
  )


@struct.dataclass
class FedMTLState:
  """FedMTL's state.

  Attributes:
    models: every client's own model [N, ...] (client rows).
  """

  models: PyTree


@struct.dataclass
class FedMTLOutput:
  """What one FedMTL client returns.

  Attributes:
    model: its trained model (its new row, written by the engine).
    stats: training statistics.
  """

  model: PyTree
  stats: LossStats


def regularizer_scale(num_params: int) -> float:
  """PFLlib's 10^-f, f = int(log10(P) + 1) + 1.

  Args:
    num_params: P, the model's parameter count.

  Returns:
    The scale.
  """
  return 10.0 ** -(int(math.log10(num_params) + 1) + 1)


def relationship_penalty(
  w: PyTree, others_sum: PyTree, omega: float, scale: float
) -> jax.Array:
  """The part of R(W) that depends on a client's own column w:
  scale (||w||^2 + omega^2 ||others_sum + w||^2).

  Args:
    w: the client's model.
    others_sum: the sum of the round's other models.
    omega: 1 - 1/M.
    scale: ``regularizer_scale``.

  Returns:
    A scalar.
  """
  own = otu.tree_l2_norm(w, squared=True)
  total = otu.tree_l2_norm(otu.tree_add(w, others_sum), squared=True)
  return scale * (own + omega**2 * total)


def fedmtl(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  detached: bool = False,
) -> FederatedAlgorithm:
  """Builds FedMTL (PFLlib's).

  Args:
    model: the model.
    num_clients: N.
    client_optimizer: the client optimizer.
    batching: local batching.
    detached: PFLlib's regularizer without a gradient.

  Returns:
    The ``FederatedAlgorithm``.
  """
  base = plain_objective(model)
  num_params = sum(
    math.prod(s.shape) for s in jax.tree.leaves(model.param_shapes())
  )
  scale = regularizer_scale(num_params)

  def init(key: jax.Array) -> FedMTLState:
    return FedMTLState(tree_broadcast(model.init(key), num_clients))

  def server_broadcast(state: FedMTLState, cohort: Cohort, rc: RoundContext):
    own = rows(state.models, cohort.rows)
    if detached:
      return None, own
    models = tree_gather(state.models, cohort.rows)
    active = cohort.mask.astype(jnp.float32)
    total = jax.tree.map(lambda a: jnp.tensordot(active, a, axes=1), models)
    return {'sum': total, 'omega': 1.0 - 1.0 / cohort.mask.shape[0]}, own

  def objective(ctx: ClientContext):
    if detached:
      return base
    others = jax.tree.map(jnp.subtract, ctx.shared['sum'], ctx.state)

    def loss(params, batch: Batch):
      value, stats = base(params, batch)
      penalty = relationship_penalty(params, others, ctx.shared['omega'], scale)
      return value + penalty, stats

    return loss

  work = sgd_client_work(
    objective,
    client_optimizer,
    batching,
    final=lambda ctx, carry: FedMTLOutput(carry.params, carry.stats),
    start_fn=lambda ctx: ctx.state,
  )

  def server_update(
    state: FedMTLState, cohort: Cohort, out: FedMTLOutput, rc: RoundContext
  ):
    # The engine wrote the new models (client_rows' output).
    return state, cohort_train_metrics(out.stats, cohort.mask)

  def communication(state: FedMTLState) -> Communication:
    # up: its model; down: the round's sum, the same for every client
    return Communication.one_of(state.models, 1)

  return FederatedAlgorithm(
    name='fedmtl',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=work,
    server_update=server_update,
    client_models=lambda s: ClientModels.personal(s.models, num_clients),
    communication=communication,
    client_rows=ClientRows.field('models', output='model'),
  )


def build(
  training: TrainingConfig,
  config: FedMTLConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedMTL, built as ``AlgorithmSpec.build`` says; its settings
  ``FedMTLConfig``."""
  return fedmtl(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    config.detached,
  )


SPEC = AlgorithmSpec(
  'fedmtl',
  FedMTLConfig,
  build,
  CLIENT_OPTIMIZER | BATCHING,
  summary="FedMTL as PFLlib's (not MOCHA): own models under a "
  'task-relationship regularizer',
)
