"""FedCross (Hu, Chen, Ye, Wang, Wu and Ling, "FedCross: Towards Accurate
Federated Learning via Multi-Model Cross-Aggregation", ICDE 2024, arXiv
2210.08285), as PFLlib's ``servercross.py`` runs it: the server keeps M
middleware models, one per client of a round. The i-th client of the round
trains the i-th middleware model, the round's clients in an order drawn
every round (PFLlib's ``select_clients``, a draw without replacement also
when every client joins), so a client trains a middleware model drawn
anew each round (``--fedcross_shuffle``; false: the cohort's slot order,
each client the same model every round with a full cohort); the global
model is the examples-weighted mean of the trained models; then each
middleware model j is crossed with a partner p(j) chosen by similarity:

  v_j <- alpha v_j + (1 - alpha) v_p(j)   (a [M, M] mixing matrix),

the similarity of two models being the sum over consecutive pairs of
parameter tensors (a layer's weight and bias) of their cosine, plus the
last pair's once more (PFLlib's loop). Partners (PFLlib's
``-cmss``): ``least_similar`` (1, its default: the lowest similarity),
``most_similar`` (2: the highest, the model itself counted at 0),
``in_turn`` (0: j + 1, see below). A client is evaluated on its model after
its last training (PFLlib's ``client.model``), not the global model.

As PFLlib's code runs: its loop's round variable is overwritten by the
clients' enumeration, so ``in_turn``'s offset is 1 every round (j + 1) and
its first stage (``-fsb``: middleware models reset to the global model
while the bound is not reached) compares the bound with M - 1, not the
round; here ``--fedcross_first_stage_bound`` is the rounds (its default 0
is PFLlib's: cross from the first round). The similarity pairs the
parameter tensors layer by layer (weight and bias), which is PFLlib's
pairing for models whose layers each hold a weight and a bias (its
FedAvgCNN and MLPs); the last pair is the head (``model.head``).

M is the cohort size (``--fedcross_num_models``; the command sets
``--cohort_size``, or every client without it; refused with
``--participation``: slots would go untrained at random).
"""

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct, traverse_util
from optax import tree_utils as otu

from fedjax_personal.algorithms.fedavg import (
  FEDAVG_SETTINGS,
  global_model_communication,
  global_server_update,
  summed_upload,
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
  FederatedAlgorithm,
  RoundContext,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.losses import LossStats, plain_objective
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import ClientContext, sgd_client_work
from fedjax_personal.core.tree_util import (
  PyTree,
  tree_broadcast,
  tree_scatter_where,
)
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import Model

__all__ = [
  'build',
  'cross_mixing',
  'fedcross',
  'FedCrossConfig',
  'middleware_order',
  'model_similarity',
  'PARTNERS',
  'SPEC',
]

#: Partner choices, PFLlib's ``-cmss`` 1, 2, 0.
PARTNERS = ('least_similar', 'most_similar', 'in_turn')


def _cohort_of(run) -> Optional[int]:
  """The run's cohort size (None: every client), refused with
  ``--participation``."""
  if run.participation is not None:
    raise ConfigError(
      'participation',
      'FedCross hands the i-th client of a round the i-th middleware '
      'model: give --cohort_size',
    )
  return run.cohort_size


@dataclasses.dataclass(frozen=True)
class FedCrossConfig(Declared):
  """FedCross's own settings: the ``--fedcross_*`` flags."""

  prefix: ClassVar[str] = 'fedcross'
  alpha: float = hparam(
    0.99,
    "A middleware model's own weight when crossed (PFLlib -ca).",
    minimum=0,
    maximum=1,
    sweep=True,
  )
  partner: str = hparam(
    'least_similar',
    "Each middleware model's partner (PFLlib -cmss 1, 2, 0).",
    choices=PARTNERS,
  )
  first_stage_bound: int = hparam(
    0,
    'Rounds whose middleware models are reset to the global model before '
    'crossing starts (PFLlib -fsb).',
    minimum=0,
  )
  num_models: Optional[int] = hparam(
    None,
    'M, the middleware models: the cohort size (the command: --cohort_size; '
    'every client without it).',
    minimum=1,
    of_run=_cohort_of,
  )
  shuffle: bool = hparam(
    True,
    "Whether the cohort's clients take the middleware models in an order "
    "drawn every round (PFLlib's select_clients); false: slot i trains "
    'model i.',
  )


@struct.dataclass
class FedCrossState:
  """FedCross's state.

  Attributes:
    params: the global model.
    opt_state: the server optimizer's state.
    middleware: the M middleware models [M, ...].
    trained: each client's model after its last training (client rows).
  """

  params: optax.Params
  opt_state: optax.OptState
  middleware: PyTree
  trained: PyTree


@struct.dataclass
class FedCrossOutput:
  """What one FedCross client returns.

  Attributes:
    delta: the global model minus its trained model (its weighted share).
    model: its trained model.
    num_examples: its training examples.
    stats: training statistics.
    num_steps: local steps taken.
  """

  delta: PyTree
  model: PyTree
  num_examples: HostOrDevice
  stats: LossStats
  num_steps: jax.Array


def _layers(model: Model, stacked: PyTree):
  """[M, P_l] of each layer (its parameter tensors joined), the head's
  last."""
  body, head = model.require_head('--algorithm=fedcross').split(stacked)

  def of(tree):
    flat = traverse_util.flatten_dict(tree)
    groups: dict = {}
    for key, leaf in flat.items():
      groups.setdefault(key[:-1], []).append(leaf.reshape((leaf.shape[0], -1)))
    return [jnp.concatenate(g, axis=1) for g in groups.values()]

  return of(body), of(head)


def model_similarity(model: Model, stacked: PyTree) -> jax.Array:
  """PFLlib's ``calculate_similarity``: for each pair of the M models, the
  sum over layers of the cosine of their parameters, plus the head's once
  more; 0 on the diagonal.

  Args:
    model: the model (with a head).
    stacked: the M models [M, ...].

  Returns:
    [M, M] float32.
  """

  def cosines(a):
    n = jnp.linalg.norm(a, axis=1)
    return (a @ a.T) / jnp.maximum(n[:, None] * n[None, :], 1e-8)

  body, head = _layers(model, stacked)
  sim = sum(cosines(a) for a in body + head + head[-1:])
  return jnp.where(jnp.eye(sim.shape[0], dtype=bool), 0.0, sim)


def cross_mixing(sim: jax.Array, alpha: float, partner: str) -> jax.Array:
  """The [M, M] crossing alpha I + (1 - alpha) P, P each row's partner as
  PFLlib's ``cross_aggregation`` picks it (ties to its loop's choice).

  Args:
    sim: ``model_similarity``.
    alpha: a model's own weight.
    partner: one of ``PARTNERS``.

  Returns:
    [M, M] float32.
  """
  m = sim.shape[0]
  j = jnp.arange(m)
  start = (j + 1) % m
  if partner == 'in_turn':
    chosen = start
  elif partner == 'most_similar':
    chosen = jnp.argmax(sim, axis=1)  # the diagonal's 0 counts, first max
  else:
    others = jnp.where(jnp.eye(m, dtype=bool), jnp.inf, sim)
    low = jnp.min(others, axis=1)
    first = jnp.argmin(others, axis=1)
    # its loop replaces the start only by a strictly lower value
    chosen = jnp.where(sim[j, start] == low, start, first)
  return alpha * jnp.eye(m) + (1 - alpha) * jax.nn.one_hot(chosen, m)


def middleware_order(key: jax.Array, num_models: int, shuffle: bool):
  """Which middleware model each slot of the round trains.

  PFLlib's ``select_clients`` draws the round's clients without
  replacement, and its i-th drawn client trains middleware model i: each
  client's model is a uniform draw, one-to-one, every round.

  Args:
    key: the round's server key (the same in the broadcast and the update).
    num_models: M.
    shuffle: False: the identity (slot i trains model i).

  Returns:
    int32 [M], a permutation.
  """
  if not shuffle:
    return jnp.arange(num_models, dtype=jnp.int32)
  key = jax.random.fold_in(key, 0x6372)  # its own stream of the server key
  return jax.random.permutation(key, num_models).astype(jnp.int32)


def fedcross(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  num_models: int,
  alpha: float = 0.99,
  partner: str = 'least_similar',
  first_stage_bound: int = 0,
  server_optimizer=None,
  weighting: str = 'num_examples',
  shuffle: bool = True,
) -> FederatedAlgorithm:
  """Builds FedCross.

  Args:
    model: the model (with a head).
    num_clients: N.
    client_optimizer: the client optimizer.
    batching: local batching.
    num_models: M, the cohort size.
    alpha: a middleware model's own weight when crossed.
    partner: one of ``PARTNERS``.
    first_stage_bound: rounds whose middleware models are reset to the
      global model.
    server_optimizer: applied to the mean delta (default ``optax.sgd(1.0)``).
    weighting: the mean's weighting (``fedavg.WEIGHTINGS``).
    shuffle: whether slot i trains middleware model ``order[i]``, a
      permutation drawn from the round's key (``middleware_order``), or
      model i.

  Returns:
    The ``FederatedAlgorithm``.
  """
  model.require_head('--algorithm=fedcross')
  if partner not in PARTNERS:
    raise ConfigError('fedcross_partner', f'one of {PARTNERS}: {partner!r}')
  server_optimizer = server_optimizer or optax.sgd(1.0)

  def init(key: jax.Array) -> FedCrossState:
    params = model.init(key)
    return FedCrossState(
      params,
      server_optimizer.init(params),
      tree_broadcast(params, num_models),
      tree_broadcast(params, num_clients),
    )

  def server_broadcast(state: FedCrossState, cohort: Cohort, rc: RoundContext):
    if cohort.mask.shape[0] != num_models:
      raise ConfigError(
        'fedcross_num_models',
        f'{num_models} middleware models for cohorts of '
        f'{cohort.mask.shape[0]}: give --fedcross_num_models='
        f'{cohort.mask.shape[0]}',
      )
    order = middleware_order(rc.key, num_models, shuffle)
    return state.params, jax.tree.map(lambda a: a[order], state.middleware)

  def final(ctx: ClientContext, carry) -> FedCrossOutput:
    return FedCrossOutput(
      delta=otu.tree_sub(ctx.shared, carry.params),
      model=carry.params,
      num_examples=ctx.data.train.num_examples,
      stats=carry.stats,
      num_steps=carry.num_steps,
    )

  work = sgd_client_work(
    lambda ctx: plain_objective(model),
    client_optimizer,
    batching,
    final,
    start_fn=lambda ctx: ctx.state,
  )
  update = global_server_update(server_optimizer)

  def server_update(
    state: FedCrossState, cohort: Cohort, out: FedCrossOutput, rc: RoundContext
  ):
    state, metrics = update(state, cohort, out, rc)
    active = cohort.mask
    trained = tree_scatter_where(state.trained, cohort.rows, out.model, active)
    order = middleware_order(rc.key, num_models, shuffle)
    kept = jax.tree.map(
      lambda new, old: old.at[order].set(
        jnp.where(
          active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old[order]
        )
      ),
      out.model,
      state.middleware,
    )
    mixing = cross_mixing(model_similarity(model, kept), alpha, partner)
    crossed = jax.tree.map(
      lambda a: jnp.einsum('ij,j...->i...', mixing, a), kept
    )
    middleware = jax.tree.map(
      lambda c, g: jnp.where(rc.round >= first_stage_bound, c, g[None]),
      crossed,
      state.params,
    )
    return (
      dataclasses.replace(state, middleware=middleware, trained=trained),
      metrics,
    )

  return FederatedAlgorithm(
    name='fedcross',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=summed_upload(work, weighting),
    server_update=server_update,
    client_models=lambda s: ClientModels.personal(s.trained, num_clients),
    communication=global_model_communication,
    client_rows=ClientRows.field('trained'),
  )


def build(
  training: TrainingConfig,
  config: FedCrossConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedCross, built as ``AlgorithmSpec.build`` says; its settings
  ``FedCrossConfig`` (M every client unless given)."""
  return fedcross(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    config.num_models or data.num_clients,
    config.alpha,
    config.partner,
    config.first_stage_bound,
    training.make_server_optimizer(),
    training.filled_weighting(),
    config.shuffle,
  )


SPEC = AlgorithmSpec(
  'fedcross',
  FedCrossConfig,
  build,
  FEDAVG_SETTINGS - FINETUNE,
  summary='FedCross (Hu et al. 2024): middleware models crossed by similarity',
)
