"""The client-work contract (init / step / final), its step loop and local
SGD; the losses it trains on are ``losses``' (re-exported here)."""

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct

from fedjax_personal.core import batching as batching_lib
from fedjax_personal.core import system
from fedjax_personal.core.clipping import dp_gradient
from fedjax_personal.core.data import ClientData, LocalData
from fedjax_personal.core.losses import (
  Batch,
  LossStats,
  StatsAndState,
  batch_loss,
  evaluate_params,
  get_batch,
  keep_model_state,
  part,
  per_example_stats,
  plain_objective,
  zero_stats,
)
from fedjax_personal.core.tree_util import PyTree, tree_where
from fedjax_personal.models import Model

__all__ = [
  'Batch',
  'batch_loss',
  'client_opt_init',
  'ClientContext',
  'ClientWork',
  'dp_gradient',
  'evaluate_params',
  'get_batch',
  'keep_model_state',
  'local_sgd',
  'LossStats',
  'opt_update',
  'part',
  'per_example_stats',
  'plain_objective',
  'PyTree',
  'run_work',
  'sgd_client_work',
  'sgd_finetune',
  'extended_sgd_work',
  'SGDCarry',
  'StatsAndState',
  'unroll_steps',
  'work_batch_indices',
  'work_init',
  'work_num_steps',
  'work_step',
  'zero_stats',
]


# Whether step loops traced now are unrolled. Executors set it while they trace
# client work, so an algorithm never decides how its steps execute.
_UNROLL_STEPS = contextvars.ContextVar('unroll_steps', default=False)


@contextlib.contextmanager
def unroll_steps(enabled: bool):
  """Within the context, client work unrolls its local steps (a Python loop,
  not a scan), e.g. for a per-step trace.

  Args:
    enabled: unroll (True) or scan (False).

  Yields:
    Nothing; the setting holds inside the ``with`` block.
  """
  token = _UNROLL_STEPS.set(enabled)
  try:
    yield
  finally:
    _UNROLL_STEPS.reset(token)


def scan_steps(f, init, xs):
  """``lax.scan``, or, when the executor being traced asks for unrolled steps,
  a traced Python loop with static step indices (XLA:CPU runs convolutions
  inside loops slowly; even ``lax.scan(unroll=True)`` kept a 1-step scan over a
  LeNet-5 gradient 7x slower than the plain step)."""
  if not _UNROLL_STEPS.get():
    return jax.lax.scan(f, init, xs)
  n = jax.tree.leaves(xs)[0].shape[0]
  carry, ys = init, []
  for i in range(n):
    carry, y = f(carry, jax.tree.map(lambda a: a[i], xs))
    ys.append(y)
  if not ys or all(y is None for y in ys):
    return carry, None
  return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)


# -- client work --------------------------------------------------------------


class WorkLimit(NamedTuple):
  """The work a client's device does this round (``system.RoundSystem``).

  Attributes:
    work: int32, the epochs (or steps) it may do: a straggler's share, 0 for a
      dropout.
    step_cap: int32, the steps its deadline allows, or None: no deadline.
  """

  work: Any
  step_cap: Any = None


@struct.dataclass
class ClientContext:
  """What a client's work may read, fixed for the whole round.

  Attributes:
    shared: what the server broadcast to every client of the round.
    state: this client's row of the algorithm's per-client state.
    data: this client's LocalData (train and validation splits).
    round: int32 scalar, rounds done before this one (per-round learning
      rate decay reads it through the optimizer's ``round_num`` argument).
    opt_state: this client's kept optimizer state with
      ``--client_opt_state=persistent`` (``client_state.py``), else None:
      the work initializes a fresh one (``client_opt_init``).
    row_group_start: the input id that starts a group of rows shuffled as
      one (``batching.row_groups``: TFF's Shakespeare snippets), or None
      (static).
    work_limit: the ``WorkLimit`` the client's device does this round, or
      None: all of its work. Steps past it are masked as padding
      (``work_step``).
    chain: what the clients before this one wrote in a round whose clients
      run in order (``algorithm.CohortChain``), or None.
  """

  shared: Any
  state: Any
  data: LocalData
  round: Any = 0
  opt_state: Any = None
  work_limit: Optional[WorkLimit] = None
  chain: Any = None
  row_group_start: Optional[int] = struct.field(pytree_node=False, default=None)


def opt_update(
  optimizer: optax.GradientTransformation,
  grads,
  opt_state,
  params,
  ctx: ClientContext,
):
  """``optimizer.update`` with the round number as the extra argument
  ``round_num`` (read by ``config.scale_by_round_decay``; ignored by plain
  optax transformations).

  Args:
    optimizer: an optax optimizer.
    grads: the gradients.
    opt_state: its state.
    params: the parameters.
    ctx: the client's ``ClientContext`` (its round).

  Returns:
    ``(updates, new optimizer state)``.
  """
  return optax.with_extra_args_support(optimizer).update(
    grads, opt_state, params, round_num=ctx.round
  )


def client_opt_init(ctx: ClientContext, init_fn: Callable, params):
  """The client's optimizer state at the start of its work: the kept one
  (persistent state) or ``init_fn(params)``.

  Args:
    ctx: the client's ``ClientContext``.
    init_fn: the optimizer's ``init``.
    params: the parameters it starts from.

  Returns:
    The optimizer state.
  """
  return init_fn(params) if ctx.opt_state is None else ctx.opt_state


@dataclasses.dataclass(frozen=True)
class ClientWork:
  """A client update split into init, step and final.

  As FedJAX's ``for_each_client`` splits it, so that the engine owns the
  step loop.

  The update is ``final(ctx, step(...step(init(ctx, key))...))`` over the
  client's own batches: a pure function of (broadcast model, client state,
  client batches, key). The engine draws the batches (``batching``), makes
  padded steps leave the carry unchanged, and chooses how steps execute: a
  scan inside one compiled round (vmap / blocked executors) or one dispatch
  per real step (sequential executor, the fastest for convolutions on CPU).

  Attributes:
    init: ``(ctx, key) -> carry``.
    step: ``(ctx, carry, batch, key) -> carry``; ``batch`` is a Batch with
      leading [B] (or [k, B] when ``batches_per_step`` = k > 1).
    final: ``(ctx, carry) -> output``.
    batching: how batches are drawn (each client's number of steps follows).
    batches_per_step: k independent batches per step (Per-FedAvg uses 3).
    init_opt_state: ``params -> optimizer state`` of one client (all of its
      optimizers), for ``--client_opt_state=persistent``; None when the
      work keeps no optimizer state.
    opt_state: ``carry -> optimizer state`` after the work (kept per client).
  """

  init: Callable[[ClientContext, jax.Array], PyTree]
  step: Callable[[ClientContext, PyTree, Batch, jax.Array], PyTree]
  final: Callable[[ClientContext, PyTree], PyTree]
  batching: batching_lib.Batching
  batches_per_step: int = 1
  init_opt_state: Optional[Callable[[PyTree], PyTree]] = None
  opt_state: Optional[Callable[[PyTree], PyTree]] = None


def work_batch_indices(
  work: ClientWork, key, num_examples, max_examples, groups=None
) -> batching_lib.StepBatches:
  """Batch indices [S, B] (or [S, k, B]) and masks of one client's work.

  Args:
    work: the ``ClientWork``.
    key: the client's key.
    num_examples: its examples (traced).
    max_examples: the padded length.
    groups: its examples' groups (``batching.row_groups``), or None.

  Returns:
    The ``batching.StepBatches``.
  """
  if work.batches_per_step == 1:
    return batching_lib.batch_indices(
      key, num_examples, max_examples, work.batching, groups
    )
  keys = jax.random.split(key, work.batches_per_step)
  idx, mask = jax.vmap(
    lambda k: batching_lib.batch_indices(
      k, num_examples, max_examples, work.batching, groups
    )
  )(keys)
  return batching_lib.StepBatches(
    jnp.swapaxes(idx, 0, 1), jnp.swapaxes(mask, 0, 1)
  )


def step_is_real(mask_s):
  """A step is real when its (first) batch has a real example."""
  return jnp.any(mask_s.reshape(-1, mask_s.shape[-1])[0])


#: ``fold_in`` tag of a step's key for its batch's input draws (``Batch.key``).
INPUT_DRAWS = 0x1B7


class WorkStart(NamedTuple):
  """A client's work before its first step (``work_init``).

  Attributes:
    carry: the algorithm's carry (``ClientWork.init``'s).
    idx: int32 [S, ...], each step's example indices.
    mask: bool [S, ...], each step's real examples.
    step_keys: the key the steps' keys are folded from.
  """

  carry: Any
  idx: jax.Array
  mask: jax.Array
  step_keys: jax.Array


class ClientCall(NamedTuple):
  """What one client's work is called with: its context and its key."""

  ctx: ClientContext
  key: jax.Array


def work_init(work: ClientWork, ctx: ClientContext, key) -> WorkStart:
  """Engine side of init: the algorithm's carry plus the client's batches.

  Args:
    work: the ``ClientWork``.
    ctx: the client's ``ClientContext``.
    key: the client's key.

  Returns:
    The ``WorkStart``.
  """
  k_init, k_batch, k_steps = jax.random.split(key, 3)
  train = ctx.data.train
  groups = (
    None
    if ctx.row_group_start is None
    else batching_lib.row_groups(train.x, ctx.row_group_start)
  )
  idx, mask = work_batch_indices(
    work, k_batch, train.num_examples, train.x.shape[0], groups
  )
  return WorkStart(work.init(ctx, k_init), idx, mask, k_steps)


def work_step(
  work: ClientWork, ctx: ClientContext, carry, idx, mask, k_steps, s
):
  """Engine side of step ``s``: gather its batch, step, and keep the carry
  unchanged when the step is padding.

  Args:
    work: the ``ClientWork``.
    ctx: the client's ``ClientContext``.
    carry: the work's carry.
    idx: all steps' batch indices.
    mask: all steps' masks.
    k_steps: the steps' keys.
    s: the step (traced int).

  Returns:
    The new carry.
  """
  k_step = jax.random.fold_in(k_steps, s)
  batch = get_batch(ctx.data.train, idx[s], mask[s])._replace(
    key=jax.random.fold_in(k_step, INPUT_DRAWS)
  )
  new = work.step(ctx, carry, batch, k_step)
  real = step_is_real(mask[s])
  if ctx.work_limit is not None:
    real &= s < limited_steps(work, ctx)
  return tree_where(real, new, carry)


def limited_steps(work: ClientWork, ctx: ClientContext):
  """The steps the client's device may run: ``ctx.work_limit``'s epochs (or
  steps) and its deadline's step cap."""
  train = ctx.data.train
  limit = ctx.work_limit
  assert limit is not None
  steps = system.step_limit(
    work.batching, limit.work, train.num_examples, train.x.shape[0]
  )
  return steps if limit.step_cap is None else jnp.minimum(steps, limit.step_cap)


def work_num_steps(work: ClientWork, ctx: ClientContext, key):
  """The client's real step count (int32 scalar), read off its own batches:
  the steps whose batch holds a real example (they come first).

  Args:
    work: the ``ClientWork``.
    ctx: the client's ``ClientContext``.
    key: the client's key.

  Returns:
    The step count.
  """
  _, mask = work_batch_indices(
    work,
    jax.random.split(key, 3)[1],
    ctx.data.train.num_examples,
    ctx.data.train.x.shape[0],
  )
  if not mask.shape[0]:
    return jnp.zeros((), jnp.int32)
  steps = jnp.sum(jax.vmap(step_is_real)(mask)).astype(jnp.int32)
  return (
    steps
    if ctx.work_limit is None
    else jnp.minimum(steps, limited_steps(work, ctx))
  )


def run_work(work: ClientWork, ctx: ClientContext, key, limit=None):
  """The whole client update as one traced function.

  Without ``limit``: a scan over every padded step (padded steps leave the
  carry unchanged). With ``limit`` (a traced int32 scalar, at least the
  client's real step count, the same for every client vectorized with it):
  a ``while_loop`` over the first ``limit`` steps only, so a block of
  clients costs its longest client's steps, not the padded maximum. The
  numbers are the same either way: the steps run are the same, and the
  steps past the client's own are padding in both.

  Args:
    work: the algorithm's ``ClientWork``.
    ctx: the client's ``ClientContext``.
    key: the client's key.
    limit: steps to run (traced int32), or None: every padded step.

  Returns:
    The client's output (``ClientWork.final``'s).
  """
  carry, idx, mask, k_steps = work_init(work, ctx, key)

  if limit is not None:

    def cond(c):
      return c[0] < limit

    def loop(c):
      s, carry = c
      return s + 1, work_step(work, ctx, carry, idx, mask, k_steps, s)

    _, carry = jax.lax.while_loop(cond, loop, (jnp.zeros((), jnp.int32), carry))
    return work.final(ctx, carry)

  def body(c, s):
    return work_step(work, ctx, c, idx, mask, k_steps, s), None

  carry, _ = scan_steps(body, carry, jnp.arange(idx.shape[0]))
  return work.final(ctx, carry)


# -- local SGD
# ------------------------------------------------------------------


@struct.dataclass
class SGDCarry:
  """Carry of local SGD.

  Attributes:
    params: current parameters.
    opt_state: client optimizer state.
    stats: LossStats summed over real steps.
    num_steps: real local steps taken (padded steps do not count).
    grad_sum: sum of the raw objective gradients over real steps (when
      asked for, SCAFFOLD's control variate), else None.
  """

  params: Any
  opt_state: Any
  stats: LossStats
  num_steps: jax.Array
  grad_sum: Any = None


def sgd_client_work(
  objective_fn: Callable,
  optimizer: optax.GradientTransformation,
  batching: batching_lib.Batching,
  final: Callable,
  start_fn: Optional[Callable] = None,
  grad_transform: Optional[Callable] = None,
  dp: Optional[tuple] = None,
  sum_grads: bool = False,
  trained_like: Optional[Callable[[PyTree], PyTree]] = None,
) -> ClientWork:
  """ClientWork for local training with an optax optimizer on a local
  objective (FedAvg, FedProx, SCAFFOLD, FedDyn, Local, ...).

  Args:
    objective_fn: ``ctx -> objective``; objective is ``(params, batch) ->
      (loss, LossStats)`` and may use the broadcast (FedProx).
    optimizer: the client optimizer; its state starts fresh every round (the
      usual FL convention) unless the engine keeps it per client
      (``ctx.opt_state``). Its ``update`` receives ``round_num``.
    batching: local batching.
    final: ``(ctx, SGDCarry) -> output``.
    start_fn: ``ctx -> params`` to start from (default: ``ctx.shared``, the
      broadcast global model).
    grad_transform: optional ``(grads, params, ctx) -> grads`` before the
      optimizer (SCAFFOLD's correction, FedDyn's dynamic regularizer).
    dp: optional (clip_norm, noise_multiplier): DP-SGD local training.
    sum_grads: keep the sum of the raw objective gradients in the carry.
    trained_like: ``model params -> the tree start_fn returns`` (shapes
      only: the template of an optimizer state kept per client,
      ``--client_opt_state=persistent``), for a ``start_fn`` that trains
      more or other than one model (FedRoD's model and head); default: the
      model's parameters themselves.

  Returns:
    The ``ClientWork``.
  """
  start_fn = start_fn or (lambda ctx: ctx.shared)
  trained_like = trained_like or (lambda params: params)

  def init(ctx, key):
    del key
    p = start_fn(ctx)
    return SGDCarry(
      params=p,
      opt_state=client_opt_init(ctx, optimizer.init, p),
      stats=zero_stats(),
      num_steps=jnp.zeros((), jnp.int32),
      grad_sum=jax.tree.map(jnp.zeros_like, p) if sum_grads else None,
    )

  def step(ctx, carry, batch, key):
    if dp is not None:
      grads, stats = dp_gradient(
        objective_fn(ctx), carry.params, batch, key, *dp
      )
    else:
      (_, stats), grads = jax.value_and_grad(objective_fn(ctx), has_aux=True)(
        carry.params, batch
      )
    grad_sum = (
      jax.tree.map(jnp.add, carry.grad_sum, grads) if sum_grads else None
    )
    if grad_transform is not None:
      grads = grad_transform(grads, carry.params, ctx)
    updates, opt_state = opt_update(
      optimizer, grads, carry.opt_state, carry.params, ctx
    )
    # a model's batch statistics: those of its forward pass
    # (``keep_model_state``)
    params, stats = keep_model_state(
      optax.apply_updates(carry.params, updates), stats
    )
    return SGDCarry(
      params=params,
      opt_state=opt_state,
      stats=jax.tree.map(jnp.add, carry.stats, stats),
      num_steps=carry.num_steps + 1,
      grad_sum=grad_sum,
    )

  return ClientWork(
    init=init,
    step=step,
    final=final,
    batching=batching,
    init_opt_state=lambda params: optimizer.init(trained_like(params)),
    opt_state=lambda carry: carry.opt_state,
  )


def extended_sgd_work(base: ClientWork, init: Callable, final: Callable):
  """Local SGD whose carry holds more than SGD's (FedAS's key, FedALA's
  weights, FedPCL's pass key): ``init(ctx, key)`` returns a carry holding
  ``base``'s ``SGDCarry`` in its field ``sgd``, each step runs ``base``'s step
  on it and keeps the rest, ``final(ctx, carry)`` gives the output.

  Args:
    base: an ``sgd_client_work``.
    init: ``(ctx, key) -> carry``.
    final: ``(ctx, carry) -> output``.

  Returns:
    The ``ClientWork``.
  """

  def step(ctx: ClientContext, carry, batch, key):
    return dataclasses.replace(carry, sgd=base.step(ctx, carry.sgd, batch, key))

  return dataclasses.replace(
    base,
    init=init,
    step=step,
    final=final,
    opt_state=lambda carry: carry.sgd.opt_state,
  )


def local_sgd(
  params: PyTree,
  objective,
  optimizer: optax.GradientTransformation,
  data: ClientData,
  key: jax.Array,
  batching: batching_lib.Batching,
  own_steps: bool = False,
):
  """Local SGD from ``params`` on one client's data, as one traced function.

  Args:
    params: the start.
    objective: ``(params, batch) -> (loss, stats)``.
    optimizer: an optax optimizer.
    data: the client's ``ClientData``.
    key: draws the batches.
    batching: the local ``Batching``.
    own_steps: run the client's own steps only (a ``while_loop``: a client
      run alone costs its own work, not the padded maximum; not
      reverse-differentiable), else a scan over every padded step. The
      numbers are the same.

  Returns:
    (params, LossStats summed over the real steps).
  """
  work = sgd_client_work(
    lambda ctx: objective,
    optimizer,
    batching,
    final=lambda ctx, c: (c.params, c.stats),
  )
  limit = (
    batching_lib.traced_num_steps(batching, data.num_examples, data.y.shape[0])
    if own_steps
    else None
  )
  return run_work(
    work,
    ClientContext(params, None, LocalData(train=data, val=data)),
    key,
    limit,
  )


def sgd_finetune(
  model: Model, learning_rate: float, batching: batching_lib.Batching
):
  """Evaluation fine-tuning: local SGD on the client's *training* split
  (never its test split) from the model it would use.

  Returns ``(params, local_data, key) -> params``.

  Args:
    model: the model.
    learning_rate: the fine-tuning SGD step.
    batching: batch size and steps (``--finetune_*``).

  Returns:
    ``finetune(params, local_data, key) -> params``.
  """
  opt = optax.sgd(learning_rate)
  objective = plain_objective(model)
  return lambda params, local, key: local_sgd(
    params, objective, opt, local.train, key, batching
  )[0]
