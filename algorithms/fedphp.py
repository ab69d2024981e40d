"""FedPHP (Li, Zhan, Shao, Hu and Zhang, "FedPHP: Federated Personalization
with Inherited Private Models", ECML PKDD 2021), as PFLlib's
``clientphp.py`` / ``serverphp.py`` run it: FedAvg whose clients keep an
inherited private model v_i. In round R a client starts from the global
model and trains on

  (1 - lamda) CE(w) + lamda MMD(body_w(x), body_v(x)),

the maximum mean discrepancy (PFLlib's RBF kernel, bandwidths 10, 15, 20,
50) between its features and the private model's (held fixed); then it
inherits: v_i <- (1 - mu_R) w_i + mu_R v_i, mu_R = mu R / H. The server
averages the trained models (FedAvg); a client is evaluated on its trained
model (PFLlib's ``client.model`` after training).

H is PFLlib's ``-gr``, one less than the rounds its loop runs, so mu_R
reaches mu in the last round: ``--fedphp_horizon``, which the command sets to
``--rounds - 1`` (at least 1) when not given.

Defaults: PFLlib's ``-lam 1 -mu 0`` drop the cross-entropy (only the MMD
trains) and the inheritance (v_i is the last trained model); chosen here,
stated: lamda 0.1 and mu 0.9 (the range of the authors' FedRepo code). A
client outside the round keeps its rows; PFLlib sends every client the
global model each round, so there a client outside the round is evaluated
on it (the same when every client joins, PFLlib's default).
"""

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct
from optax import tree_utils as otu

from fedjax_personal.algorithms.fedavg import (
  FEDAVG_SETTINGS,
  global_model_communication,
  global_server_update,
  summed_upload,
)
from fedjax_personal.algorithms.fedcp import mmd_rbf
from fedjax_personal.config import (
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
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.losses import Batch, LossStats, forward, logits_loss
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import ClientContext, sgd_client_work
from fedjax_personal.core.tree_util import PyTree, rows, tree_broadcast
from fedjax_personal.hparams import require_filled
from fedjax_personal.models import Model

__all__ = ['build', 'fedphp', 'FedPHPConfig', 'inherit', 'SPEC']


@dataclasses.dataclass(frozen=True)
class FedPHPConfig(Declared):
  """FedPHP's own settings: the ``--fedphp_*`` flags."""

  prefix: ClassVar[str] = 'fedphp'
  lamda: float = hparam(
    0.1,
    'Weight lamda of the MMD term; the cross-entropy weighs 1 - lamda '
    '(PFLlib -lam: 1).',
    minimum=0,
    maximum=1,
    sweep=True,
  )
  mu: float = hparam(
    0.9,
    "The inheritance's last weight mu of the private model (PFLlib -mu: 0).",
    minimum=0,
    maximum=1,
    sweep=True,
  )
  horizon: Optional[int] = hparam(
    None,
    'H: mu_R = mu R / H (PFLlib -gr; the command: --rounds - 1, at least 1).',
    minimum=1,
    of_run=lambda run: max(run.rounds - 1, 1),
  )


@struct.dataclass
class FedPHPState:
  """FedPHP's state.

  Attributes:
    params: the global model.
    opt_state: the server optimizer's state.
    rows: client rows: ``private`` (the inherited model v_i) and ``trained``
      (the client's model after its last training).
  """

  params: optax.Params
  opt_state: optax.OptState
  rows: PyTree


@struct.dataclass
class FedPHPOutput:
  """What one FedPHP client returns.

  Attributes:
    delta: the global model minus its trained model (its weighted share).
    row: its new rows (written by the engine).
    num_examples: its training examples.
    stats: training statistics.
    num_steps: local steps taken.
  """

  delta: PyTree
  row: PyTree
  num_examples: HostOrDevice
  stats: LossStats
  num_steps: jax.Array


def inherit(trained: PyTree, private: PyTree, mu_round) -> PyTree:
  """v <- (1 - mu_R) w + mu_R v (PFLlib's ``clientphp.train``'s end).

  Args:
    trained: w, the trained model.
    private: v, the private model.
    mu_round: mu_R.

  Returns:
    The new private model.
  """
  return jax.tree.map(
    lambda w, v: w * (1 - mu_round) + v * mu_round, trained, private
  )


def fedphp(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  lamda: float = 0.1,
  mu: float = 0.9,
  horizon: int = 1,
  server_optimizer=None,
  weighting: str = 'num_examples',
) -> FederatedAlgorithm:
  """Builds FedPHP.

  Args:
    model: the model (with a head: the MMD is on the body's features).
    num_clients: N.
    client_optimizer: the client optimizer.
    batching: local batching.
    lamda: the MMD term's weight.
    mu: the inheritance weight reached at round ``horizon``.
    horizon: H.
    server_optimizer: applied to the mean delta (default ``optax.sgd(1.0)``).
    weighting: the mean's weighting (``fedavg.WEIGHTINGS``).

  Returns:
    The ``FederatedAlgorithm``.
  """
  model.require_head('--algorithm=fedphp')
  server_optimizer = server_optimizer or optax.sgd(1.0)

  def init(key: jax.Array) -> FedPHPState:
    params = model.init(key)
    row = {'private': params, 'trained': params}
    return FedPHPState(
      params, server_optimizer.init(params), tree_broadcast(row, num_clients)
    )

  def server_broadcast(state: FedPHPState, cohort: Cohort, rc: RoundContext):
    mu_round = mu * rc.round.astype(jnp.float32) / horizon
    return {'params': state.params, 'mu': mu_round}, rows(
      state.rows, cohort.rows
    )

  def flat(z):
    return z.reshape((z.shape[0], -1))

  def objective(ctx: ClientContext):
    private = ctx.state['private']

    def loss(params, batch: Batch):
      out = forward(model, params, batch, features=True)
      ce, stats = logits_loss(model, out.logits, batch, out.state)
      zp = forward(model, private, batch, features=True).features
      gap = mmd_rbf(
        flat(out.features), jax.lax.stop_gradient(flat(zp)), batch.mask
      )
      return (1 - lamda) * ce + lamda * gap, stats

    return loss

  def final(ctx: ClientContext, carry) -> FedPHPOutput:
    trained = carry.params
    private = inherit(trained, ctx.state['private'], ctx.shared['mu'])
    return FedPHPOutput(
      delta=otu.tree_sub(ctx.shared['params'], trained),
      row={'private': private, 'trained': trained},
      num_examples=ctx.data.train.num_examples,
      stats=carry.stats,
      num_steps=carry.num_steps,
    )

  work = sgd_client_work(
    objective,
    client_optimizer,
    batching,
    final,
    start_fn=lambda ctx: ctx.shared['params'],
  )
  update = global_server_update(server_optimizer)

  return FederatedAlgorithm(
    name='fedphp',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=summed_upload(work, weighting),
    server_update=update,
    client_models=lambda s: ClientModels.personal(
      s.rows['trained'], num_clients
    ),
    communication=global_model_communication,
    client_rows=ClientRows.field('rows', output='row'),
  )


def build(
  training: TrainingConfig,
  config: FedPHPConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedPHP, built as ``AlgorithmSpec.build`` says; its settings
  ``FedPHPConfig`` (its ``horizon`` given: the command fills it)."""
  return fedphp(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    config.lamda,
    config.mu,
    require_filled(config, 'horizon'),
    training.make_server_optimizer(),
    training.filled_weighting(),
  )


SPEC = AlgorithmSpec(
  'fedphp',
  FedPHPConfig,
  build,
  FEDAVG_SETTINGS - FINETUNE,
  summary='FedPHP (Li et al. 2021): FedAvg + an inherited private model '
  '(MMD of features)',
)
