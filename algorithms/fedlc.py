"""FedLC (Zhang et al., "Federated Learning with Label Distribution Skew via
Logits Calibration", ICML 2022): FedAvg whose local loss is the cross-entropy
of calibrated logits,

  L = CE(f(x; theta) - tau * n^(-1/4), y),

n the per-class counts of training examples: every class's logit lowered by
tau / n_c^(1/4), less for the frequent classes. The global model is
evaluated on its plain logits.

Whose counts: PFLlib's ``serverlc.py`` (the default, ``--fedlc_counts=
global``) sums every client's counts once, before training, and gives all
clients the same calibration; the paper calibrates by the client's own
label distribution (``--fedlc_counts=local``). Here the global counts are
summed inside the first compiled round (a pre-round phase over every
client), a client's own ones inside its work. A class with no example has
its logit at -inf (PFLlib's n^(-1/4) is inf there too). PFLlib counts the
examples of its ``drop_last`` batches (a random subset of fewer than one
batch is left out each epoch); here all of a client's examples.
"""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from fedjax_personal.algorithms.fedavg import (
  FEDAVG_SETTINGS,
  ServerState,
  fedavg,
  global_model_communication,
)
from fedjax_personal.config import (
  AlgorithmSpec,
  BuildData,
  Declared,
  TrainingConfig,
  hparam,
)
from fedjax_personal.core.algorithm import (
  FederatedAlgorithm,
  PreRound,
  RoundContext,
)
from fedjax_personal.core.data import LocalData, label_counts
from fedjax_personal.core.losses import Batch, forward, logits_loss
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import ClientContext
from fedjax_personal.models import Model

__all__ = ['build', 'calibration', 'FedLCConfig', 'FedLCState', 'SPEC']

COUNTS = ('global', 'local')


@dataclasses.dataclass(frozen=True)
class FedLCConfig(Declared):
  """FedLC's own settings: the ``--fedlc_*`` flags."""

  prefix: ClassVar[str] = 'fedlc'
  tau: float = hparam(
    1.0, 'Calibration strength tau (PFLlib -tau).', minimum=0, sweep=True
  )
  counts: str = hparam(
    'global',
    "Whose label counts calibrate: 'global' (PFLlib's serverlc.py: every "
    "client's, summed before training) or 'local' (the paper's: the "
    "client's own).",
    choices=COUNTS,
  )


@struct.dataclass
class FedLCState:
  """FedAvg's server state and the population's label counts.

  Attributes:
    server: FedAvg's ``ServerState``.
    counts: float32 [C] training examples per class over every client
      (summed by the first round's pre-round phase; zeros before).
  """

  server: ServerState
  counts: jax.Array


def calibration(counts, tau):
  """tau * n_c^(-1/4) per class; +inf for a class with no example (its
  logit then never wins), 0 there when tau is 0.

  Args:
    counts: [C] examples per class.
    tau: the calibration strength.

  Returns:
    [C] what is subtracted from the logits.
  """
  safe = jnp.maximum(counts, 1.0)
  absent = jnp.where(tau > 0, jnp.inf, 0.0)
  return jnp.where(counts > 0, tau * safe**-0.25, absent)


def calibrated_objective(model: Model, tau, local: bool, num_classes: int):
  """``ctx -> objective``: the cross-entropy of the logits less the
  calibration, the global one (``ctx.state``) or the client's own."""

  def objective_fn(ctx: ClientContext):
    counts = label_counts(ctx.data.train, num_classes) if local else None
    shift = calibration(counts, tau) if local else ctx.state

    def objective(params, batch: Batch):
      out = forward(model, params, batch)
      return logits_loss(model, out.logits - shift, batch, out.state)

    return objective

  return objective_fn


def fedlc(
  model: Model,
  num_clients: int,
  num_classes: int,
  client_optimizer,
  batching,
  tau: float,
  counts: str = 'global',
  **kw,
):
  """Builds FedLC; ``kw`` as for ``fedavg`` (server optimizer, weighting).

  Args:
    model: the model.
    num_clients: N.
    num_classes: C, the model's classes.
    client_optimizer: the optax client optimizer.
    batching: local batching.
    tau: the calibration strength.
    counts: 'global' (PFLlib's) or 'local' (the paper's).
    kw: as for ``fedavg``.

  Returns:
    The ``FederatedAlgorithm``.
  """
  if counts not in COUNTS:
    raise ValueError(f'FedLC counts must be one of {COUNTS}, got {counts!r}')
  local = counts == 'local'
  base = fedavg(
    model,
    num_clients,
    client_optimizer,
    batching,
    objective_fn=calibrated_objective(model, tau, local, num_classes),
    name='fedlc',
    **kw,
  )

  def init(key):
    return FedLCState(base.init(key), jnp.zeros(num_classes, jnp.float32))

  def server_broadcast(state: FedLCState, cohort: Cohort, rc: RoundContext):
    shared, _ = base.server_broadcast(state.server, cohort, rc)
    shift = calibration(state.counts, tau)
    return shared, jnp.broadcast_to(shift, cohort.mask.shape + shift.shape)

  def server_update(state: FedLCState, cohort: Cohort, out, rc: RoundContext):
    server, metrics = base.server_update(state.server, cohort, out, rc)
    return dataclasses.replace(state, server=server), metrics

  def count_update(state: FedLCState, outputs, rc: RoundContext):
    del rc
    total = jnp.sum(outputs, axis=0)
    return dataclasses.replace(state, counts=total), {}

  def client_counts(shared, data: LocalData, key):
    del shared, key
    return label_counts(data.train, num_classes)

  return base.replace(
    init=init,
    server_broadcast=server_broadcast,
    server_update=server_update,
    client_models=lambda s: base.client_models(s.server),
    communication=lambda s: global_model_communication(s.server),
    pre_round=None
    if local
    else PreRound(
      due=lambda t: t == 0, update=count_update, client=client_counts
    ),
  )


def build(
  training: TrainingConfig,
  config: FedLCConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedLC, built as ``AlgorithmSpec.build`` says; its settings
  ``FedLCConfig``."""
  return fedlc(
    model,
    data.num_clients,
    data.num_classes,
    training.make_client_optimizer(),
    training.batching(),
    config.tau,
    config.counts,
    server_optimizer=training.make_server_optimizer(),
    weighting=training.filled_weighting(),
  )


SPEC = AlgorithmSpec(
  'fedlc',
  FedLCConfig,
  build,
  FEDAVG_SETTINGS,
  model_state=True,
  summary='FedLC (Zhang et al. 2022): FedAvg + logits calibrated by label counts',
)
