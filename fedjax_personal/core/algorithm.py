"""The contract of a federated algorithm.

Following fedjax's ``FederatedAlgorithm`` (``init`` / ``apply``), but split so
that the engine owns execution: an algorithm is three pure functions around
the client update, and the engine composes them into one round

    if pre_round and pre_round.due(rc.round):                  # algorithm's schedule
      state = pre_round.update(state, [pre_round.client(...)    # engine: every client
                                       for every client], rc)
    cohort = sampler(key)                                      # engine
    shared, per_client = server_broadcast(state, cohort, rc)   # algorithm, server
    outputs = executor.run_work(client_work, ...)              # engine: vmap/blocks/loop
    state, metrics = server_update(state, cohort, outputs, rc)  # algorithm, server

With a fused executor the whole round is one jit-compiled function, the
pre-round phase included (under ``lax.cond``). Per-client
state lives in stacked arrays inside ``state`` (leading axis N); the
broadcast gathers the cohort's rows, the server update scatters them back.
"""

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
from flax import struct

from fedjax_personal import numerics
from fedjax_personal.core import tree_util
from fedjax_personal.core.aggregation import Sum, WeightedShare
from fedjax_personal.core.data import LocalData
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import ClientWork, LossStats
from fedjax_personal.core.tree_util import PyTree
from fedjax_personal.models import Model

__all__ = [
  'ChainedOutputs',
  'ClientModels',
  'ClientRows',
  'CohortChain',
  'cohort_train_metrics',
  'CohortPhase',
  'Communication',
  'NOT_UPLOADED',
  'upload_communication',
  'FederatedAlgorithm',
  'PhasedOutputs',
  'PhaseResult',
  'PreRound',
  'PyTree',
  'RoundContext',
]


@struct.dataclass
class ClientModels:
  """The model each client uses: client i uses ``params[index[i]]``.

  A global model is M = 1 with index 0 everywhere; fully personal models are
  M = N with index = arange(N); streams are M = k with the client-to-stream
  index.

  Attributes:
    params: stacked parameters, leading axis M.
    index: int32 [N].
  """

  params: PyTree
  index: jax.Array

  @staticmethod
  def global_model(params, num_clients: int) -> 'ClientModels':
    return ClientModels(
      jax.tree.map(lambda a: a[None], params), jnp.zeros(num_clients, jnp.int32)
    )

  @staticmethod
  def personal(stacked, num_clients: int) -> 'ClientModels':
    return ClientModels(stacked, jnp.arange(num_clients, dtype=jnp.int32))

  @property
  def num_models(self) -> int:
    return jax.tree.leaves(self.params)[0].shape[0]

  def for_client(self, i):
    if self.num_models == 1:  # static: no per-client copy of a global model
      return jax.tree.map(lambda a: a[0], self.params)
    return jax.tree.map(lambda a: a[self.index[i]], self.params)


#: Fields of a client's output that are not its upload: what the server knows
#: (its example count) and what it reports about its training (its statistics,
#: its step count).
NOT_UPLOADED = ('num_examples', 'stats', 'num_steps')


def upload_communication(outputs, shared, cohort_size: int) -> 'Communication':
  """A round's sizes counted from what it moves: the bytes one client
  uploads (every field of the cohort's ``outputs`` but ``NOT_UPLOADED`` and
  the rows the engine keeps, set None; a weighted mean's share as its
  upload; a field stacked [C, ...] as one row) and one broadcast ``shared``
  down (``FederatedAlgorithm.communication`` None).

  Args:
    outputs: the cohort's client outputs (summed or stacked [C]).
    shared: what the server broadcast.
    cohort_size: C, the outputs' client axis.

  Returns:
    The ``Communication``.
  """
  fields = (
    [(f.name, getattr(outputs, f.name)) for f in dataclasses.fields(outputs)]
    if dataclasses.is_dataclass(outputs)
    else [('', outputs)]
  )
  up = 0
  for name, value in fields:
    if value is None or name in NOT_UPLOADED:
      continue
    for leaf in jax.tree.leaves(value, is_leaf=lambda x: isinstance(x, Sum)):
      if isinstance(leaf, Sum):
        weighted = isinstance(leaf.value, WeightedShare)
        up += tree_util.tree_bytes(leaf.value.total if weighted else leaf.value)
      else:
        up += tree_util.tree_bytes(leaf) // max(cohort_size, 1)
  return Communication(up, tree_util.tree_bytes(shared), 1)


class Communication(NamedTuple):
  """Static sizes for communication accounting.

  Attributes:
    uplink_bytes_per_client: bytes an active client uploads in a round.
    downlink_bytes_per_model: bytes of one downlink model.
    num_downlink_models: distinct models sent down per round (1 for a global
      broadcast, m_t for streams, the cohort size for unicast personal models,
      0 when nothing is sent).
  """

  uplink_bytes_per_client: int
  downlink_bytes_per_model: int
  num_downlink_models: Union[int, jax.Array]

  @staticmethod
  def one_of(
    stacked: PyTree, num_downlink_models: Union[int, jax.Array]
  ) -> 'Communication':
    """One model of ``stacked`` (models [M, ...]) up from each active client
    and down to it, ``num_downlink_models`` distinct ones sent down.

    Args:
      stacked: the stacked models.
      num_downlink_models: as the field.

    Returns:
      The ``Communication``.
    """
    b = tree_util.tree_bytes(jax.tree.map(lambda a: a[0], stacked))
    return Communication(b, b, num_downlink_models)


@struct.dataclass
class RoundContext:
  """What the server side of a round may read besides the state.

  Attributes:
    round: int32 scalar, rounds done before this one.
    key: this round's server-side PRNG key (derived from the round key, so
      from the experiment's seed): every server-side draw uses it.
  """

  round: jax.Array
  key: jax.Array


FineTune = Callable[[PyTree, LocalData, jax.Array], PyTree]


@dataclasses.dataclass(frozen=True)
class PreRound:
  """Server work that precedes some rounds' training.

  User-centric's collaboration round computing W and the streams, clustered
  FL's split test: traced into the same compiled round and run when ``due``
  says so.

  The engine computes ``client`` on every client (not only the round's
  cohort), through the executor, and hands the stacked outputs to
  ``update``. The algorithm never sees the executor or the data set.

  Attributes:
    due: ``round -> bool`` (traced int32 round: rounds done before this one).
    broadcast: ``(state, rc) -> shared``, what every client receives.
    client: optional pure ``(shared, LocalData, key) -> output`` (None: the
      phase needs nothing from the clients).
    update: ``(state, outputs [N, ...] or None, rc) -> (state, diagnostics)``,
      diagnostics a dict of scalars recorded in the round's record when the
      phase ran.
  """

  due: Callable[[jax.Array], jax.Array]
  update: Callable[[PyTree, Any, RoundContext], tuple]
  broadcast: Callable[[PyTree, RoundContext], Any] = lambda state, rc: None
  client: Optional[Callable[[Any, LocalData, jax.Array], Any]] = None


class PhaseResult(NamedTuple):
  """What the server makes of a cohort phase's outputs (``CohortPhase``).

  Attributes:
    broadcast: the round's broadcast the cohort then trains with.
    server: what the round's ``server_update`` reads of the phase (it gets
      ``PhasedOutputs``), or None.
  """

  broadcast: PyTree
  server: PyTree = None


class PhasedOutputs(NamedTuple):
  """``server_update``'s outputs for an algorithm with a cohort phase.

  Attributes:
    phase: ``PhaseResult.server`` of the round's cohort phase.
    clients: the cohort's outputs of its training (``client_work``).
  """

  phase: PyTree
  clients: PyTree


@dataclasses.dataclass(frozen=True)
class CohortPhase:
  """Client work on the round's cohort before it trains.

  Mime's full-batch gradients at the server model, whose mean is the
  control variate the cohort trains with: the engine computes ``client``
  on each client of the cohort (through the executor, in the same compiled
  round), hands the stacked outputs to ``fold``, and the cohort then trains
  with the broadcast ``fold`` returns.

  Attributes:
    client: pure ``(broadcast, LocalData, key) -> output``.
    fold: ``(broadcast, cohort, outputs [C, ...], rc) -> PhaseResult``;
      outputs of inactive slots are to be masked (``cohort.mask``).
  """

  client: Callable[[Any, LocalData, jax.Array], Any]
  fold: Callable[[Any, Cohort, Any, RoundContext], PhaseResult]


@dataclasses.dataclass(frozen=True)
class CohortChain:
  """A round's clients run one after another, each reading the chain.

  What the clients before a client wrote: APPLE's core models: PFLlib trains a round's clients in order, each
  client's steps moving its own core model in the list every later client
  of the round reads. The engine runs such a cohort in its slots' order (a
  scan over the clients, each running its own steps), the ``carry``
  threaded through: a client reads it as ``ClientContext.chain`` (fixed
  for its whole work) and ``write`` makes the next client's from its
  output. A slot that is padding or whose upload is lost writes nothing.

  Attributes:
    start: ``(state, cohort, rc) -> carry``, the chain before the round's
      first client.
    write: ``(carry, client_id, output) -> carry``: the carry after client
      ``client_id`` (int32 scalar, its id in the population) returned
      ``output`` (its ``client_work``'s).
  """

  start: Callable[[PyTree, Cohort, 'RoundContext'], PyTree]
  write: Callable[[PyTree, jax.Array, PyTree], PyTree]


class ChainedOutputs(NamedTuple):
  """``server_update``'s outputs for an algorithm with a cohort chain.

  Attributes:
    chain: the chain's carry after the round's last client.
    clients: the cohort's outputs of its training (``client_work``).
  """

  chain: PyTree
  clients: PyTree


@dataclasses.dataclass(frozen=True)
class ClientRows:
  """The part of an algorithm's state made of client rows.

  Personal models, control variates, FedDyn's gradients: stacked leaves with
  the client axis first, which a round reads and writes only at the
  cohort's rows.

  Declaring it lets the host layout keep these rows with the population on
  the host and hand each round only the cohort's (``Cohort.rows`` then
  indexes them), as FedJAX keeps client state outside the device. The
  contract, which the layout equality tests check:
    * ``server_broadcast`` / ``server_update`` touch the rows only through
      ``cohort.rows`` (``rows(part, cohort.rows)``, ``tree_scatter(part,
      cohort.rows, new)``);
    * with ``models_from_rows``, ``client_models(state)`` of a state holding
      some clients' rows gives those clients' models, row by row; without
      it, ``client_models`` does not read the rows;
    * the pre-round phase neither reads nor writes them.
  State that a round reads across the population (FedFomo's candidate
  models, user-centric's mixing of all N models) is not client rows.

  With ``output`` (the rows a client reads are its own row and it returns
  the new one), the engine writes the rows and the algorithm does not:
    * ``server_broadcast``'s per-client part is ``rows(get(state),
      cohort.rows)`` itself;
    * the client output's field ``output`` holds the client's new row (the
      tree of one row of ``get(state)``);
    * the engine writes it at ``cohort.rows`` (``write``) before
      ``server_update``, which gets the state with the rows written and that
      field None. An executor that runs client blocks in a loop then writes
      each block's new rows into the state's rows where the block ends,
      reading each client's row from the same buffer: the round holds no
      [C, ...] buffer of new rows (a Ditto round at cohort 50 of Stack
      Overflow's LSTM: 126 MB less).

  Attributes:
    get: ``state -> rows`` (a pytree, every leaf [N or C, ...]).
    put: ``(state, rows) -> state`` with the rows replaced.
    models_from_rows: whether the clients' models are made from the rows
      (personal models) or not (SCAFFOLD's controls: a global model).
    output: the client output's field holding the client's new row, which
      the engine writes (None: ``server_update`` writes the rows).
  """

  get: Callable[[PyTree], PyTree]
  put: Callable[[PyTree, PyTree], PyTree]
  models_from_rows: bool = True
  output: Optional[str] = None

  @staticmethod
  def field(
    name: str, models_from_rows: bool = True, output: Optional[str] = None
  ) -> 'ClientRows':
    """The rows held in the state's dataclass field ``name``."""
    return ClientRows(
      get=lambda s: getattr(s, name),
      put=lambda s, r: s.replace(**{name: r}),
      models_from_rows=models_from_rows,
      output=output,
    )

  def write(self, state: PyTree, at, outputs) -> tuple:
    """``(state, outputs)`` with the cohort's new rows (the outputs' field
    ``output``) written at rows ``at`` (``cohort.rows``; N or more: none) and
    that field None; unchanged without ``output`` or when the rows were
    written already (the field is None).

    Args:
      state: the algorithm's state.
      at: [C] row of each cohort slot.
      outputs: the cohort's client outputs.

    Returns:
      ``(state, outputs)``.
    """
    field = self.output
    new = None if field is None else getattr(outputs, field)
    if field is None or new is None:
      return state, outputs
    state = self.put(state, tree_util.tree_scatter(self.get(state), at, new))
    return state, dataclasses.replace(outputs, **{field: None})


@dataclasses.dataclass(frozen=True)
class FederatedAlgorithm:
  """A federated algorithm as pure functions (see module docstring).

  Attributes:
    name: registry name.
    model: the model whose parameters are trained.
    init: ``key -> state``; state holds server state and stacked per-client
      state.
    server_broadcast: ``(state, cohort, rc) -> (shared, per_client)`` with
      ``rc`` the RoundContext; ``shared`` is
      what every client of the round receives, ``per_client`` has leading axis C
      (the cohort's rows of per-client state).
    client_work: the client update as a ``training.ClientWork`` (init / step /
      final over the client's own batches); the engine runs it for the cohort.
    server_update: ``(state, cohort, outputs, rc) -> (state, metrics)``.
    client_models: ``state -> ClientModels`` used for evaluation.
    communication: ``state -> Communication`` (static sizes), or None:
      counted from what the round moves (``upload_communication``): up,
      every field of a client's output but ``NOT_UPLOADED`` (what the server
      knows or a client reports: its examples, statistics and steps) and
      the rows it keeps (``client_rows``' output), a weighted mean's share
      as its upload; down, the broadcast (``server_broadcast``'s
      ``shared``), one model.
    finetune: optional ``(params, local_data, key) -> params`` applied before
      evaluating a client (FedAvg + fine-tuning).
    evaluate_client: optional ``(params, local_data, test, key) -> LossStats``
      replacing the plain test of ``params`` (e.g. prototype classifiers built
      from the client's training data).
    pre_round: optional ``PreRound`` run at the start of the rounds it is
      due (phases that are not a training round), inside the compiled round.
    cohort_phase: optional ``CohortPhase``: client work on the cohort before
      it trains (``server_update`` then gets ``PhasedOutputs``).
    cohort_chain: optional ``CohortChain``: the cohort's clients run one
      after another, each reading the chain the ones before it wrote
      (``server_update`` then gets ``ChainedOutputs``).
    privacy: optional ``privacy.Privacy`` when clients run DP-SGD (noise,
      sampling rates, a step counter in the state) for epsilon accounting.
    client_rows: optional ``ClientRows``, the state's per-client rows that
      the host layout keeps on the host (None: all state on the device).
    partial_work: what the server does with a straggler's partial work
      (``system``): ``'drop'`` it (the default) or ``'keep'`` it
      (``AlgorithmSpec.partial_work``).
  """

  name: str
  model: Model
  init: Callable[[jax.Array], PyTree]
  server_broadcast: Callable[[PyTree, Cohort, RoundContext], tuple]
  client_work: ClientWork
  server_update: Callable[[PyTree, Cohort, PyTree, RoundContext], tuple]
  client_models: Callable[[PyTree], ClientModels]
  communication: Optional[Callable[[PyTree], Communication]] = None
  finetune: Optional[FineTune] = None
  evaluate_client: Optional[Callable] = None
  pre_round: Optional[PreRound] = None
  cohort_phase: Optional[CohortPhase] = None
  cohort_chain: Optional[CohortChain] = None
  privacy: Optional[Any] = None
  client_rows: Optional[ClientRows] = None
  partial_work: str = 'drop'

  def __post_init__(self):
    if self.cohort_phase is not None and self.cohort_chain is not None:
      raise ValueError(
        f'{self.name}: a cohort phase and a cohort chain cannot be combined'
      )

  def replace(self, **kw) -> 'FederatedAlgorithm':
    return dataclasses.replace(self, **kw)

  def at_matmul_precision(self, name: str) -> 'FederatedAlgorithm':
    """This algorithm with every function it computes with traced at matmul
    precision ``name`` (``numerics.scoped``: the server's steps, the client
    work, fine-tuning, evaluation, the pre-round phase, the model), so that a
    round compiled from it carries the precision whatever JAX's setting
    outside. The engine runs every algorithm through this
    (``RoundRunner(..., matmul_precision=)``).

    Args:
      name: one of ``numerics.MATMUL_PRECISIONS``.

    Returns:
      The ``FederatedAlgorithm``.
    """

    def at(fn):
      return None if fn is None else numerics.scoped(fn, name)

    work = self.client_work
    work = dataclasses.replace(
      work,
      init=at(work.init),
      step=at(work.step),
      final=at(work.final),
      init_opt_state=at(work.init_opt_state),
      opt_state=at(work.opt_state),
    )
    pre = self.pre_round
    if pre is not None:
      pre = dataclasses.replace(
        pre,
        due=at(pre.due),
        update=at(pre.update),
        broadcast=at(pre.broadcast),
        client=at(pre.client),
      )
    phase = self.cohort_phase
    if phase is not None:
      phase = CohortPhase(at(phase.client), at(phase.fold))
    chain = self.cohort_chain
    if chain is not None:
      chain = CohortChain(at(chain.start), at(chain.write))
    return self.replace(
      model=self.model.at_matmul_precision(name),
      cohort_phase=phase,
      cohort_chain=chain,
      init=at(self.init),
      server_broadcast=at(self.server_broadcast),
      client_work=work,
      server_update=at(self.server_update),
      client_models=at(self.client_models),
      finetune=at(self.finetune),
      evaluate_client=at(self.evaluate_client),
      pre_round=pre,
    )


def cohort_train_metrics(stats: LossStats, mask) -> dict:
  """Mean local training loss/accuracy over the real examples of active clients.

  Args:
    stats: the cohort's local-training ``LossStats`` [C].
    mask: [C] active clients.

  Returns:
    ``{'train_loss', 'train_accuracy'}``.
  """
  m = mask.astype(jnp.float32)
  loss = jnp.sum(stats.loss_sum * m)
  correct = jnp.sum(stats.correct * m)
  count = jnp.maximum(jnp.sum(stats.count * m), 1.0)
  scored = jnp.maximum(jnp.sum(stats.accuracy_denominator * m), 1.0)
  return {
    'train_loss': loss / count,
    'train_accuracy': correct / scored,
    'num_active': jnp.sum(mask.astype(jnp.int32)),
  }
