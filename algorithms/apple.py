"""APPLE (Luo and Wu, "Adapt to Adaptation: Learning Personalization for
Cross-Silo Federated Learning", IJCAI 2022, arXiv 2110.08394), as PFLlib's
``clientapple.py`` / ``serverapple.py`` run it.

Each client i keeps a core model c_i and a directed relationship vector
p_i over every client's core (its ``ps``, starting at 1 / N). Before every
batch its personalized model is the mixture

  w_i = sum_j p_ij c_j,

the batch's gradient g at w_i moves its own core, c_i <- c_i - N lr p_ii g
(PFLlib scales the rate by the number of clients), and every entry of its
vector,

  p_ij <- p_ij - eta_2 (dp_ij + lamda_R mu (p_ij - p0_j)),
  dp_ij = mean over the model's tensors of mean(g * c_j),

the proximal term pulling p_i toward the clients' shares of the training
examples p0, weighted by lamda_R = (cos((R - 1) pi / L) + 1) / 2 in round R
(1 in rounds 0 and 1, 0 from round L + 1 on; L = int(``decay_share`` H), H
PFLlib's ``-gr``: ``--apple_horizon``, which the command sets to ``--rounds
- 1``). The models are not trained otherwise (PFLlib never calls its
optimizer's ``step``).

PFLlib trains a round's clients one after another in the list of core models
they all hold, a client's steps moving its own core in place: a client reads
the cores of the clients before it in the round as they trained them, and
the others' as the last round left them. Here the round's cohort runs in
that order (``algorithm.CohortChain``: the engine's scan over the cohort,
each client its own steps), the chain carrying the cores. After the round a
client's core is its last mixture w_i (PFLlib's ``model_c``, copied from
its model after training), which is also its model (evaluated as PFLlib
evaluates ``client.model``). PFLlib trains every client every round (its join
ratio is not read); here the round's cohort trains, in its slots' order
(every client in id order with ``--clients_per_round`` at the population).

Defaults PFLlib's: ``-dlr 0`` and ``-mu 0`` leave every p_i at 1 / N (the
mixture is the mean of the cores), ``-L 1``. With eta_2 = 0 the vectors do
not move, so their gradient is not computed and the other clients' part of
a client's mixture is summed once for its work instead of every step (the
same numbers up to float rounding: each is a pass over the N cores, most of
a step's time at PFLlib's scenario). The vectors are client rows
(N floats each), the cores are read across the population every step (they
stay on the device, N models): APPLE is the cross-silo method its title
says.
"""

import dataclasses
import math
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from fedjax_personal.config import (
  BATCHING,
  AlgorithmSpec,
  BuildData,
  Declared,
  TrainingConfig,
  hparam,
)
from fedjax_personal.core.algorithm import (
  ChainedOutputs,
  ClientModels,
  ClientRows,
  CohortChain,
  Communication,
  FederatedAlgorithm,
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.losses import (
  Batch,
  LossStats,
  batch_loss,
  zero_stats,
)
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import ClientContext, ClientWork
from fedjax_personal.core.tree_util import (
  PyTree,
  rows,
  tree_broadcast,
  tree_gather,
  tree_scatter_where,
)
from fedjax_personal.hparams import require_filled
from fedjax_personal.models import Model

__all__ = [
  'apple',
  'APPLEConfig',
  'build',
  'lamda_of_round',
  'mixture',
  'others_mixture',
  'relationship_gradient',
  'SPEC',
]


@dataclasses.dataclass(frozen=True)
class APPLEConfig(Declared):
  """APPLE's own settings: the ``--apple_*`` flags."""

  prefix: ClassVar[str] = 'apple'
  dr_lr: float = hparam(
    0.0,
    "eta_2: the directed relationship vectors' learning rate (PFLlib -dlr).",
    minimum=0,
    sweep=True,
  )
  mu: float = hparam(
    0.0,
    "mu: the proximal term's weight pulling p_i toward the clients' shares "
    'of the examples (PFLlib -mu).',
    minimum=0,
    sweep=True,
  )
  decay_share: float = hparam(
    1.0,
    "The proximal term's decay over L = int(decay_share H) rounds (PFLlib -L).",
    minimum=0,
    sweep=True,
  )
  horizon: Optional[int] = hparam(
    None,
    'H: L = int(decay_share H) (PFLlib -gr; the command: --rounds - 1, at '
    'least 1).',
    minimum=1,
    of_run=lambda run: max(run.rounds - 1, 1),
  )


@struct.dataclass
class APPLEState:
  """APPLE's state.

  Attributes:
    cores: every client's core model [N, ...] (its last mixture).
    ps: client rows: each client's directed relationship vector [N, N].
    p0: [N] the clients' shares of the training examples.
  """

  cores: PyTree
  ps: jax.Array
  p0: jax.Array


@struct.dataclass
class APPLECarry:
  """A client's work in progress.

  Attributes:
    core: its own core model, moved by its steps.
    ps: its relationship vector [N].
    model: its last mixture (its core before its first step).
    stats: training statistics.
    num_steps: local steps taken.
    rest: the others' part of its mixture, computed once when the vectors do
      not move (eta_2 = 0), else None.
  """

  core: PyTree
  ps: jax.Array
  model: PyTree
  stats: LossStats
  num_steps: jax.Array
  rest: Optional[PyTree] = None


@struct.dataclass
class APPLEOutput:
  """What one APPLE client returns.

  Attributes:
    core: its core model after its steps (what the later clients of the
      round read).
    model: its last mixture: its model and its core of the next round.
    ps: its new relationship vector.
    num_examples: its training examples.
    stats: training statistics.
    num_steps: local steps taken.
  """

  core: PyTree
  model: PyTree
  ps: jax.Array
  num_examples: HostOrDevice
  stats: LossStats
  num_steps: jax.Array


def lamda_of_round(round_num, decay_rounds: int) -> jax.Array:
  """lamda_R, the proximal term's weight in round R (PFLlib's client sets it
  after training round R - 1: (cos((R - 1) pi / L) + 1) / 2 while R - 1 <
  L, then 0; 1 before its first round).

  Args:
    round_num: R, rounds done before this one (traced int).
    decay_rounds: L.

  Returns:
    float32 scalar.
  """
  done = jnp.asarray(round_num, jnp.float32) - 1.0
  cosine = (jnp.cos(done * math.pi / max(decay_rounds, 1)) + 1.0) / 2.0
  decayed = jnp.where(done < decay_rounds, cosine, 0.0)
  return jnp.where(done < 0, 1.0, decayed)


def others_mixture(cores: PyTree, ps: jax.Array, i) -> PyTree:
  """sum_{j != i} p_ij c_j: the mixture's part from the other clients' cores.

  Args:
    cores: the cores the client reads [N, ...].
    ps: its vector [N].
    i: its id.

  Returns:
    One model's tree.
  """
  others = ps.at[i].set(0.0)
  return jax.tree.map(lambda c: jnp.tensordot(others, c, axes=1), cores)


def mixture(rest: PyTree, own: PyTree, ps: jax.Array, i) -> PyTree:
  """w_i = sum_j p_ij c_j: the others' part (``others_mixture``) plus the
  client's own core in its slot i.

  Args:
    rest: ``others_mixture(cores, ps, i)``.
    own: its own core.
    ps: its vector [N].
    i: its id.

  Returns:
    The mixture (one model).
  """
  return jax.tree.map(lambda r, o: r + ps[i] * o, rest, own)


def relationship_gradient(
  grads: PyTree, cores: PyTree, own: PyTree, i
) -> jax.Array:
  """dp_ij: the mean over the model's tensors of mean(g * c_j), the
  client's own (just moved) core in its slot i.

  Args:
    grads: the batch's gradient at the mixture.
    cores: the cores the client reads [N, ...].
    own: its own core after this step's move.
    i: its id.

  Returns:
    [N] float32.
  """
  per_tensor = []
  for g, c, o in zip(
    jax.tree.leaves(grads), jax.tree.leaves(cores), jax.tree.leaves(own)
  ):
    flat = c.reshape(c.shape[0], -1)
    dots = flat @ g.reshape(-1) / g.size
    per_tensor.append(dots.at[i].set(jnp.sum(g * o) / g.size))
  return sum(per_tensor) / len(per_tensor)


def apple(
  model: Model,
  num_clients: int,
  learning_rate: float,
  batching: Batching,
  example_shares: np.ndarray,
  dr_lr: float = 0.0,
  mu: float = 0.0,
  decay_rounds: int = 1,
) -> FederatedAlgorithm:
  """Builds APPLE.

  Args:
    model: the model.
    num_clients: N.
    learning_rate: the client rate (scaled by N, as PFLlib's).
    batching: local batching.
    example_shares: p0 [N], the clients' shares of the training examples.
    dr_lr: eta_2.
    mu: the proximal term's weight.
    decay_rounds: L.

  Returns:
    The ``FederatedAlgorithm``.
  """
  core_rate = learning_rate * num_clients
  # eta_2 = 0 (PFLlib's default): the vectors never move, so their gradient
  # is not computed and the others' part of the mixture is read once a
  # client, not every step (each is a pass over the N cores)
  fixed_vectors = dr_lr == 0.0

  def init(key: jax.Array) -> APPLEState:
    n = num_clients
    return APPLEState(
      tree_broadcast(model.init(key), n),
      jnp.full((n, n), 1.0 / n, jnp.float32),
      jnp.asarray(example_shares, jnp.float32),
    )

  def server_broadcast(state: APPLEState, cohort: Cohort, rc: RoundContext):
    shared = {'p0': state.p0, 'lamda': lamda_of_round(rc.round, decay_rounds)}
    return shared, {'ps': rows(state.ps, cohort.rows), 'id': cohort.idx}

  def work_init(ctx: ClientContext, key) -> APPLECarry:
    del key
    i, ps = ctx.state['id'], ctx.state['ps']
    own = tree_gather(ctx.chain, i)
    return APPLECarry(
      core=own,
      ps=ps,
      model=own,
      stats=zero_stats(),
      num_steps=jnp.zeros((), jnp.int32),
      rest=others_mixture(ctx.chain, ps, i) if fixed_vectors else None,
    )

  def step(ctx: ClientContext, carry: APPLECarry, batch: Batch, key):
    del key
    i, ps, cores = ctx.state['id'], carry.ps, ctx.chain
    rest = carry.rest if fixed_vectors else others_mixture(cores, ps, i)
    w = mixture(rest, carry.core, ps, i)
    (_, stats), grads = jax.value_and_grad(
      lambda p: batch_loss(model, p, batch), has_aux=True
    )(w)
    core = jax.tree.map(
      lambda c, g: c - core_rate * g * ps[i], carry.core, grads
    )
    if not fixed_vectors:
      dp = relationship_gradient(grads, cores, core, i)
      p0, lamda = ctx.shared['p0'], ctx.shared['lamda']
      ps = ps - dr_lr * (dp + lamda * mu * (ps - p0))
    return APPLECarry(
      core=core,
      ps=ps,
      model=w,
      stats=jax.tree.map(jnp.add, carry.stats, stats),
      num_steps=carry.num_steps + 1,
      rest=carry.rest,
    )

  def final(ctx: ClientContext, carry: APPLECarry) -> APPLEOutput:
    return APPLEOutput(
      core=carry.core,
      model=carry.model,
      ps=carry.ps,
      num_examples=ctx.data.train.num_examples,
      stats=carry.stats,
      num_steps=carry.num_steps,
    )

  work = ClientWork(init=work_init, step=step, final=final, batching=batching)

  def write(cores: PyTree, i, out: APPLEOutput) -> PyTree:
    return jax.tree.map(lambda c, o: c.at[i].set(o), cores, out.core)

  chain = CohortChain(start=lambda state, cohort, rc: state.cores, write=write)

  def server_update(
    state: APPLEState,
    cohort: Cohort,
    outputs: ChainedOutputs,
    rc: RoundContext,
  ):
    # the cores as trained in place are dropped: each client's next core is
    # its last mixture (PFLlib's new ``model_c``)
    out: APPLEOutput = outputs.clients
    active = cohort.mask
    cores = tree_scatter_where(state.cores, cohort.idx, out.model, active)
    ps = tree_scatter_where(state.ps, cohort.rows, out.ps, active)
    return (
      APPLEState(cores, ps, state.p0),
      cohort_train_metrics(out.stats, active),
    )

  def communication(state: APPLEState) -> Communication:
    # up: its core; down: every client's core
    return Communication.one_of(state.cores, num_clients)

  return FederatedAlgorithm(
    name='apple',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=work,
    server_update=server_update,
    client_models=lambda s: ClientModels.personal(s.cores, num_clients),
    communication=communication,
    cohort_chain=chain,
    client_rows=ClientRows.field('ps', models_from_rows=False),
  )


def build(
  training: TrainingConfig,
  config: APPLEConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """APPLE, built as ``AlgorithmSpec.build`` says; its settings
  ``APPLEConfig``."""
  counts = np.asarray(data.train.num_examples, np.float64)
  horizon = require_filled(config, 'horizon')
  return apple(
    model,
    data.num_clients,
    training.client_lr,
    training.batching(),
    counts / max(counts.sum(), 1.0),
    config.dr_lr,
    config.mu,
    int(config.decay_share * horizon),
  )


SPEC = AlgorithmSpec(
  'apple',
  APPLEConfig,
  build,
  frozenset({'client_lr'}) | BATCHING,
  summary='APPLE (Luo and Wu 2022): learned directed relationship vectors '
  'over core models, clients trained in order',
)
