"""FedCAC (Wu et al., "Bold but Cautious: Unlocking the Potential of
Personalized Federated Learning through Cautiously Aggressive
Collaboration", ICCV 2023, arXiv 2309.11103): each client keeps the
parameters critical to it, taken from a customized global model averaged
over the clients whose critical parameters overlap its own; the rest come
from the global model.

A round on client i, as PFLlib's ``clientcac.py``: start from
w = m_i * u_i + (1 - m_i) * g (its critical mask m_i, its customized model
u_i, the global model g; g alone before it first trained), train, and
select the new critical parameters: per parameter tensor, those whose
|(w' - w) * w'| is among the top ``tau`` share of the tensor's entries
(Eq. 1-2; ties at the threshold included; a threshold at 0 moved to the
smallest nonzero value, as its code does).

The server (``servercac.py``): g = the examples-weighted mean of the
cohort's trained models; the overlap of clients i, j is
1 - |m_i - m_j|_1 / (2 |m_i|_1) (Eq. 3); the threshold is
avg + (t + 1) / beta * (max - avg) over the cohort's pairs (t the round);
u_i = the plain mean of the trained models of i and every j whose overlap
with i reaches it (Eq. 4-5): a [C, C] mixing matrix applied to the
stacked models. As PFLlib's code runs, the first round customizes nothing:
after it u_i is the initial model, so a client's critical parameters after
round 0 are the initial model's.

Defaults: PFLlib's ``-bt`` is 0, which fails its own ``assert beta >= 1``,
and its ``-tau`` 1.0 marks every parameter critical (nothing is
collaborated); chosen here, stated: ``tau`` 0.5 (half of each tensor
critical) and ``beta`` 100 (the threshold reaches the largest overlap after
100 rounds).
"""

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import struct

from fedjax_personal.algorithms.fedavg import (
  FEDAVG_SETTINGS,
  check_weighting,
  client_weight,
  server_apply,
  train_tokens,
)
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
  Communication,
  FederatedAlgorithm,
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.losses import LossStats, plain_objective
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import ClientContext, sgd_client_work
from fedjax_personal.core.tree_util import (
  PyTree,
  rows,
  tree_broadcast,
  tree_bytes,
  tree_scatter_where,
  tree_where,
)
from fedjax_personal.models import Model

__all__ = [
  'build',
  'critical_mask',
  'kth_largest',
  'customized_mixing',
  'fedcac',
  'FedCACConfig',
  'SPEC',
]


@dataclasses.dataclass(frozen=True)
class FedCACConfig(Declared):
  """FedCAC's own settings: the ``--fedcac_*`` flags."""

  prefix: ClassVar[str] = 'fedcac'
  tau: float = hparam(
    0.5,
    'Share of each parameter tensor selected as critical (PFLlib -tau; its '
    'default 1.0 selects everything).',
    minimum=0,
    maximum=1,
    sweep=True,
  )
  beta: int = hparam(
    100,
    'Rounds over which the collaboration threshold rises from the mean '
    'overlap to the largest (PFLlib -bt, read as an int; its default 0 '
    'fails its own check).',
    minimum=1,
    sweep=True,
  )


@struct.dataclass
class FedCACState:
  """FedCAC's state: the global model and each client's critical part.

  Attributes:
    params: the global model g.
    opt_state: the server optimizer's state.
    rows: client rows ``{'kept': m_i * u_i, 'mask': m_i}`` (leading axis N;
      the mask bool, all false before the client first trained).
  """

  params: optax.Params
  opt_state: optax.OptState
  rows: PyTree


@struct.dataclass
class FedCACOutput:
  """What one FedCAC client returns.

  Attributes:
    model: its trained model (stacked over the cohort: the server mixes it).
    mask: its new critical mask (bool, the model's tree).
    weight: its weight in the global mean.
    num_examples: its training examples.
    stats: training statistics.
    num_steps: local steps taken.
  """

  model: PyTree
  mask: PyTree
  weight: jax.Array
  num_examples: HostOrDevice
  stats: LossStats
  num_steps: Any = None


def kth_largest(values: jax.Array, k: int) -> jax.Array:
  """The k-th largest of non-negative float32 ``values`` (1-based), exactly
  ``jnp.sort(values)[values.size - k]``, by a radix select on their bit
  patterns (ordered as the values are, for values >= 0): 31 counting passes
  instead of a sort (a FedCAC client's critical parameters, 582K of them in
  PFLlib's CNN: 250 ms sorted on a CPU).

  Args:
    values: float32 [n], every entry >= 0 (or NaN, ordered last as by a sort).
    k: which, in 1..n.

  Returns:
    float32 scalar.
  """
  bits = jax.lax.bitcast_convert_type(values.astype(jnp.float32), jnp.int32)

  def bit(b, found):
    candidate = found | jnp.left_shift(jnp.int32(1), 30 - b)
    return jnp.where(jnp.sum(bits >= candidate) >= k, candidate, found)

  found = jax.lax.fori_loop(0, 31, bit, jnp.int32(0))
  return jax.lax.bitcast_convert_type(found, jnp.float32)


def critical_mask(before, after, tau: float):
  """The critical parameters of a client's training (Eq. 1-2, PFLlib's
  ``evaluate_critical_parameter``): per tensor, c = |(after - before) *
  after|, critical where c reaches the ``int(tau * size)``-th largest
  entry (none when that is 0); a threshold at most 1e-10 is moved to the
  smallest entry above 1e-20 (kept when there is none).

  Args:
    before: the parameters the client started from.
    after: its trained parameters.
    tau: the critical share.

  Returns:
    A bool tree shaped like the parameters.
  """

  def leaf(w0, w):
    c = jnp.abs((w - w0) * w)
    flat = c.reshape(-1)
    nz = int(tau * flat.size)
    if nz == 0:
      return jnp.zeros(c.shape, bool)
    thresh = kth_largest(flat, nz)
    nonzero = flat > 1e-20
    smallest = jnp.min(jnp.where(nonzero, flat, jnp.inf))
    thresh = jnp.where((thresh <= 1e-10) & jnp.any(nonzero), smallest, thresh)
    return c >= thresh

  return jax.tree.map(leaf, before, after)


def customized_mixing(masks, active, round_num, beta: int):
  """FedCAC's collaboration as a [C, C] mixing matrix (Eq. 3-5, PFLlib's
  ``get_customized_global_models``): row i averages client i and every
  active j != i whose overlap 1 - |m_i - m_j|_1 / (2 |m_i|_1) reaches the
  threshold avg + (t + 1) / beta * (max - avg) over the active pairs.

  Args:
    masks: bool tree, leading axis C.
    active: bool [C], the cohort's real clients.
    round_num: t, rounds done before this one.
    beta: the threshold's horizon.

  Returns:
    float32 [C, C], rows of the active clients summing to 1.
  """
  flat = jnp.concatenate(
    [m.reshape((m.shape[0], -1)) for m in jax.tree.leaves(masks)], axis=1
  ).astype(jnp.int32)
  count = jnp.sum(flat, axis=1)
  inter = jax.lax.dot(flat, flat.T, preferred_element_type=jnp.int32)
  diff = count[:, None] + count[None, :] - 2 * inter
  overlap = 1 - diff.astype(jnp.float32) / (2 * count[:, None]).astype(
    jnp.float32
  )
  c = active.shape[0]
  pair = active[:, None] & active[None, :] & ~jnp.eye(c, dtype=bool)
  num_pairs = jnp.maximum(jnp.sum(pair), 1)
  avg = jnp.sum(jnp.where(pair, overlap, 0)) / num_pairs
  top = jnp.max(jnp.where(pair, overlap, -jnp.inf))
  thresh = avg + (round_num + 1) / beta * (top - avg)
  collab = (pair & (overlap >= thresh)) | (jnp.eye(c, dtype=bool) & active)
  return collab / jnp.maximum(jnp.sum(collab, axis=1, keepdims=True), 1)


def start_params(params, row):
  """A client's model: its kept critical part, the global model elsewhere."""
  return jax.tree.map(
    lambda g, k, m: jnp.where(m, k, g), params, row['kept'], row['mask']
  )


def fedcac(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  tau: float = 0.5,
  beta: int = 100,
  server_optimizer=None,
  weighting: str = 'num_examples',
) -> FederatedAlgorithm:
  """Builds FedCAC.

  Args:
    model: the model.
    num_clients: N.
    client_optimizer: the client optimizer.
    batching: local batching.
    tau: the critical share of each tensor.
    beta: the collaboration threshold's horizon (rounds).
    server_optimizer: applied to g minus the cohort's mean (default
      ``optax.sgd(1.0)``: g becomes the mean, PFLlib's).
    weighting: the global mean's weighting (``fedavg.WEIGHTINGS``).

  Returns:
    The ``FederatedAlgorithm``.
  """
  server_optimizer = server_optimizer or optax.sgd(1.0)
  check_weighting(weighting)

  def init(key: jax.Array) -> FedCACState:
    params = model.init(key)
    row = {
      'kept': jax.tree.map(jnp.zeros_like, params),
      'mask': jax.tree.map(lambda a: jnp.zeros(a.shape, bool), params),
    }
    return FedCACState(
      params, server_optimizer.init(params), tree_broadcast(row, num_clients)
    )

  def server_broadcast(state: FedCACState, cohort: Cohort, rc: RoundContext):
    return state.params, rows(state.rows, cohort.rows)

  def final(ctx: ClientContext, carry) -> FedCACOutput:
    train = ctx.data.train
    return FedCACOutput(
      model=carry.params,
      mask=critical_mask(
        start_params(ctx.shared, ctx.state), carry.params, tau
      ),
      weight=train_tokens(train)
      if weighting == 'tokens'
      else client_weight(train.num_examples, weighting),
      num_examples=train.num_examples,
      stats=carry.stats,
      num_steps=carry.num_steps,
    )

  work = sgd_client_work(
    lambda ctx: plain_objective(model),
    client_optimizer,
    batching,
    final,
    start_fn=lambda ctx: start_params(ctx.shared, ctx.state),
  )

  def server_update(
    state: FedCACState, cohort: Cohort, out: FedCACOutput, rc: RoundContext
  ):
    w = out.weight * cohort.mask
    total = jnp.sum(w)
    mean = jax.tree.map(
      lambda a: jnp.tensordot(w / jnp.maximum(total, 1e-30), a, axes=1),
      out.model,
    )
    pseudo = jax.tree.map(jnp.subtract, state.params, mean)
    params, opt_state = server_apply(
      state.params, state.opt_state, pseudo, total, server_optimizer
    )
    mixing = customized_mixing(out.mask, cohort.mask, rc.round, beta)
    mixed = jax.tree.map(
      lambda a: jnp.einsum('ij,j...->i...', mixing, a), out.model
    )
    c = cohort.mask.shape[0]
    customized = tree_where(
      rc.round == 0, tree_broadcast(state.params, c), mixed
    )
    new = {
      'kept': jax.tree.map(
        lambda m, u: jnp.where(m, u, 0), out.mask, customized
      ),
      'mask': out.mask,
    }
    return (
      dataclasses.replace(
        state,
        params=params,
        opt_state=opt_state,
        rows=tree_scatter_where(state.rows, cohort.rows, new, cohort.mask),
      ),
      cohort_train_metrics(out.stats, cohort.mask),
    )

  def client_models(state: FedCACState) -> ClientModels:
    return ClientModels.personal(
      jax.vmap(lambda r: start_params(state.params, r))(state.rows),
      num_clients,
    )

  def communication(state: FedCACState) -> Communication:
    b = tree_bytes(state.params)
    bits = sum(math.prod(a.shape) for a in jax.tree.leaves(state.params))
    # up: the trained model and its critical mask (a bit a parameter); down:
    # the global model and the client's own customized one
    return Communication(b + -(-bits // 8), 2 * b, num_clients)

  return FederatedAlgorithm(
    name='fedcac',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=work,
    server_update=server_update,
    client_models=client_models,
    communication=communication,
    client_rows=ClientRows.field('rows'),
  )


def build(
  training: TrainingConfig,
  config: FedCACConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedCAC, built as ``AlgorithmSpec.build`` says; its settings
  ``FedCACConfig``."""
  return fedcac(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    config.tau,
    config.beta,
    training.make_server_optimizer(),
    training.filled_weighting(),
  )


SPEC = AlgorithmSpec(
  'fedcac',
  FedCACConfig,
  build,
  FEDAVG_SETTINGS - FINETUNE,
  summary='FedCAC (Wu et al. 2023): critical parameters from a customized '
  'global model over clients with overlapping critical sets',
)
