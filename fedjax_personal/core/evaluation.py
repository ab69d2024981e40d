"""Evaluation: every client's model on its own test split, apart from the round.

``eval_function`` evaluates a padded population (the device layout) in
groups of equal static test length (``eval_buckets``); ``host_evaluation``
evaluates a population store (the host layout) in blocks of clients gathered
from it. Both run client work through the round's executor and return
per-client ``LossStats``.
"""

import collections
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal.core import memory
from fedjax_personal.core.algorithm import FederatedAlgorithm
from fedjax_personal.core.data import LocalData, client_row
from fedjax_personal.core.executors import Executor
from fedjax_personal.core.population import placement, rows_in_memory
from fedjax_personal.core.sampling import client_keys
from fedjax_personal.core.training import (
  LossStats,
  evaluate_params,
  per_example_stats,
)

__all__ = [
  'eval_buckets',
  'eval_client_function',
  'eval_function',
  'host_evaluation',
  'pooled_evaluation',
  'pooled_padded_evaluation',
  'pooled_where_one_model',
  'POOLED_CHUNK_BYTES',
]


def eval_buckets(
  test_counts,
  max_examples: int,
  smallest: int = 32,
  block: Optional[int] = None,
):
  """Groups clients by a static test length: ``[(length, client indices)]``.

  Each client's test split is evaluated on its leading ``length`` rows, the
  next power of two >= its example count (at least ``smallest``, at most
  ``max_examples``), instead of the padded maximum: with unequal test splits
  (CIFAR-10 Dirichlet devices: mean 100, max 323) the forward passes then do
  at most twice the real work, with one compiled shape per group. Padded rows
  are masked either way, so the statistics are those of the full padded split.

  With ``block`` (clients evaluated at once), a group joins the next longer
  one when that costs at most one block's rows at the longer length: a
  compiled shape costs more than the work it saves there (EMNIST's 3,400
  writers: 408 clients of length 64 join 31 of length 128, one program
  fewer, about 0.3 s of a 2.3 s evaluation).

  Args:
    test_counts: test examples per client.
    max_examples: the longest length (the padded split's).
    smallest: the shortest length.
    block: clients per evaluation block (None: groups are never joined).

  Returns:
    ``[(length, int32 client indices)]``, shortest first.
  """
  counts = np.asarray(test_counts)
  sizes = np.minimum(
    max_examples,
    np.maximum(
      smallest, 2 ** np.ceil(np.log2(np.maximum(counts, 1))).astype(np.int64)
    ),
  )
  groups = [
    (int(b), np.flatnonzero(sizes == b).astype(np.int32))
    for b in np.unique(sizes)
  ]
  if block:
    # longest first, so that joins chain
    for i in range(len(groups) - 2, -1, -1):
      (length, idx), (longer, more) = groups[i], groups[i + 1]
      if len(idx) * (longer - length) <= block * longer:
        groups[i + 1] = (longer, np.sort(np.concatenate([idx, more])))
        del groups[i]
  return groups


def eval_client_function(
  alg: FederatedAlgorithm, counts, finetune: bool, length: Optional[int]
):
  """``eval_client(shared, (i, row, key)) -> LossStats``: client i's model
  (optionally fine-tuned) on its test split, whose examples are row ``row``
  of the split arrays in ``shared = (models, train, val, test)`` (cut to
  its first ``length`` rows when given).

  Args:
    alg: the algorithm.
    counts: a Counter of traces.
    finetune: fine-tune before testing.
    length: test rows used (None: all).

  Returns:
    ``eval_client(shared, (i, row, key)) -> LossStats``.
  """

  def eval_client(shared, c):
    counts['eval_client'] += 1
    models, train, val, test = shared
    i, row, key = c
    params = models.for_client(i)
    local = LocalData(train=client_row(train, row), val=client_row(val, row))
    test_i = client_row(test, row)
    if length is not None:
      test_i = test_i.replace(x=test_i.x[:length], y=test_i.y[:length])
    k_ft, k_eval = jax.random.split(key)
    if finetune and alg.finetune is not None:
      params = alg.finetune(params, local, k_ft)
    if alg.evaluate_client is not None:
      return alg.evaluate_client(params, local, test_i, k_eval)
    return evaluate_params(alg.model, params, test_i)

  return eval_client


def eval_function(
  alg: FederatedAlgorithm, ex: Executor, counts=None, test_counts=None
):
  """``eval_all(client_models, data, key, finetune) -> LossStats [N]``: every
  client's model (optionally fine-tuned on its training split) on its test
  split.

  With ``test_counts`` (host array of test examples per client, fixed for
  the experiment) clients are evaluated in groups of equal static test length
  (``eval_buckets``); without it on the whole padded split.

  Args:
    alg: the algorithm.
    ex: the executor.
    counts: a Counter of traces (None: a new one).
    test_counts: test examples per client (None: one padded group).

  Returns:
    ``eval_all(client_models, data, key, finetune) -> LossStats [N]``.
  """
  counts = collections.Counter() if counts is None else counts
  eval_clients = {}

  def eval_all(models, data, key, finetune):
    n = data.num_clients
    keys = client_keys(key, jnp.arange(n))
    shared = (models, data.train, data.val, data.test)
    groups = (
      None
      if test_counts is None
      else eval_buckets(test_counts, data.test.max_examples)
    )
    if (
      groups is None
      or len(groups) == 1
      and groups[0][0] == data.test.max_examples
    ):
      groups = [(None, np.arange(n, dtype=np.int32))]
    out = None
    for length, idx in groups:
      if (finetune, length) not in eval_clients:
        eval_clients[(finetune, length)] = eval_client_function(
          alg, counts, finetune, length
        )
      idx_j = jnp.asarray(idx)
      if len(idx) == n:
        return ex.map(
          eval_clients[(finetune, length)], shared, (idx_j, idx_j, keys)
        )
      part = ex.map(
        eval_clients[(finetune, length)], shared, (idx_j, idx_j, keys[idx])
      )
      if out is None:
        out = jax.tree.map(
          lambda a: jnp.zeros((n,) + a.shape[1:], a.dtype), part
        )
      out = jax.tree.map(lambda o, a: o.at[idx].set(a), out, part)
    return out

  return eval_all


def host_evaluation(
  alg: FederatedAlgorithm, ex: Executor, host, hosted_rows: bool, counts
):
  """``evaluate(state, key, finetune) -> LossStats [N]`` over the store:
  clients grouped by static test length (``eval_buckets``), each group in
  blocks of ``host.block`` clients gathered from the store. With hosted
  client rows, a block's models come from a state holding the block's
  rows (``ClientRows``' contract), client j of the block using model j,
  and a block holds ``rows_in_memory.ROW_BLOCK_BYTES`` of rows at most.

  Args:
    alg: the algorithm.
    ex: the executor.
    host: the ``HostData``.
    hosted_rows: client rows live on the host.
    counts: a Counter of traces.

  Returns:
    ``evaluate(state, key, finetune) -> LossStats [N]``.
  """
  test_counts = host.counts('test')
  groups = eval_buckets(
    test_counts, int(test_counts.max(initial=0)), block=host.block
  )
  models_j = ex.jit(alg.client_models)
  fns = {}

  def block_fn(finetune, length):
    if (finetune, length) not in fns:
      eval_client = eval_client_function(alg, counts, finetune, length)

      def run(state_or_models, train, val, test, ids, rows, keys, valid):
        models = (
          alg.client_models(state_or_models) if ex.fused else state_or_models
        )
        return ex.host_readable(
          ex.map(
            eval_client,
            (models, train, val, test),
            (ids, rows, keys),
            active=valid,
          )
        )

      fns[(finetune, length)] = ex.jit(run) if ex.fused else run
    return fns[(finetune, length)]

  # made at the first evaluation without fine-tuning (a structural choice)
  pooled = {}

  def pooled_for(state):
    """``pooled_evaluation``'s function when every client of ``state`` uses
    one model (its structure says so), else None."""
    if 'fn' not in pooled:
      shared = jax.eval_shape(alg.client_models, state).num_models == 1
      pooled['fn'] = pooled_evaluation(alg, host.store) if shared else None
    return pooled['fn']

  def evaluate(state, key, finetune):
    # The training and validation splits are read only to fine-tune or
    # for an algorithm's own evaluation; otherwise they are empty rows.
    local_length = None if finetune or alg.evaluate_client is not None else 0
    client_rows = alg.client_rows
    by_rows = (
      hosted_rows and client_rows is not None and client_rows.models_from_rows
    )
    block = host.block
    if by_rows:
      rows = state.rows
      # the gathered rows bounded
      block = rows_in_memory.rows_per_block(rows, host.block)
    else:  # the models do not read hosted rows: the state without them serves
      state = state.inner if hosted_rows else state
      if (
        not finetune
        and alg.evaluate_client is None
        and pooled_for(state) is not None
      ):
        # one model for every client: its test examples pooled
        params = jax.tree.map(lambda a: a[0], models_j(state).params)
        return pooled_for(state)(params)
      models = state if ex.fused else models_j(state)
    out = [np.zeros(host.num_clients, np.float32) for _ in LossStats._fields]
    for length, ids in groups:
      for b_ids, valid in placement.blocks(ids, block):
        ids_j = jnp.asarray(b_ids, jnp.int32)
        positions = jnp.arange(len(b_ids), dtype=jnp.int32)
        model_of = ids_j
        if by_rows:
          assert client_rows is not None  # by_rows
          block_state = client_rows.put(
            state.inner, rows_in_memory.gather_rows(rows, b_ids)
          )
          models = block_state if ex.fused else models_j(block_state)
          model_of = positions
        stats = block_fn(finetune, length)(
          models,
          host.gather('train', b_ids, local_length),
          host.gather('val', b_ids, local_length),
          host.gather('test', b_ids, length),
          model_of,
          positions,
          client_keys(key, ids_j),
          valid,
        )
        for o, a in zip(out, jax.device_get(stats)):
          o[b_ids[valid]] = np.asarray(a)[valid]
    return LossStats(*out)

  return evaluate


#: Bytes of a pooled evaluation chunk's inputs, outputs and intermediate
#: values (``pooled_evaluation``).
POOLED_CHUNK_BYTES = 256 * 2**20


def pooled_evaluation(alg: FederatedAlgorithm, store):
  """``evaluate(params) -> LossStats [N]`` of one model on every client's
  test examples, pooled: the store's test split read in chunks of rows back
  to back (no client padded to its group's length), one compiled program
  for every chunk, each row's statistics summed into its client's
  (``segment_sum``). The statistics are ``evaluate_params``' of each client,
  summed in another order (equal to float rounding). Where a global model is
  evaluated (FedAvg, FedProx, SCAFFOLD, ...) this is the evaluation's work
  alone: EMNIST's writers hold 66,158 test images, padded per client to
  134,701 rows.

  Args:
    alg: the algorithm (its ``model``).
    store: the ``PopulationStore``.

  Returns:
    The function, or None where the store's clients are not back to back
    (a subset of another store's clients) or hold no test example.
  """
  counts = np.asarray(store.counts['test'], np.int64)
  starts = np.asarray(store.offsets['test'], np.int64)[: len(counts)]
  if counts.sum() == 0 or not np.array_equal(
    starts, np.concatenate([[0], np.cumsum(counts)[:-1]])
  ):
    return None
  x_all, y_all, _ = store.arrays['test']
  ydtype = np.int32 if np.issubdtype(y_all.dtype, np.integer) else y_all.dtype

  def read(r0, r1, rows):
    x = np.zeros((rows,) + x_all.shape[1:], x_all.dtype)
    y = np.zeros((rows,) + y_all.shape[1:], ydtype)
    x[: r1 - r0], y[: r1 - r0] = x_all[r0:r1], y_all[r0:r1]
    return x, y

  return _pooled(alg, counts, x_all.shape[1:], x_all.dtype, read)


def pooled_padded_evaluation(alg: FederatedAlgorithm, test, counts=None):
  """``pooled_evaluation`` of the device layout: one model on every client's
  real test rows of the padded split ``test`` (``ClientData`` [N, M, ...]),
  gathered in chunks back to back from the device arrays, so that a
  client's padding costs nothing (Stack Overflow's 3,000 users hold 17,442
  test posts; padded to the evaluation groups' lengths, 96,000).

  Args:
    alg: the algorithm (its ``model``).
    test: the padded test split.
    counts: a Counter of traces (``eval_pooled`` counts the chunk's).

  Returns:
    ``evaluate(params) -> LossStats [N]``, or None where no client holds a
    test example.
  """
  examples = np.asarray(test.num_examples, np.int64)
  if examples.sum() == 0:
    return None
  client = np.repeat(np.arange(len(examples), dtype=np.int32), examples)
  row = (
    np.arange(len(client)) - np.repeat(np.cumsum(examples) - examples, examples)
  ).astype(np.int32)
  gather = jax.jit(lambda x, y, c, r: (x[c, r], y[c, r]))

  def read(r0, r1, rows):
    c, r = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    c[: r1 - r0], r[: r1 - r0] = client[r0:r1], row[r0:r1]
    return gather(test.x, test.y, c, r)

  return _pooled(alg, examples, test.x.shape[2:], test.x.dtype, read, counts)


def pooled_where_one_model(
  alg: FederatedAlgorithm, test, models_j, per_client, counts=None
):
  """The device layout's ``evaluate(state, key, finetune)``: where every
  client uses one model (the state's structure says so; a structural
  choice, made at the first evaluation without fine-tuning) and the
  algorithm has no evaluation of its own, ``pooled_padded_evaluation`` of
  that model; otherwise ``per_client``.

  Args:
    alg: the algorithm.
    test: the padded test split.
    models_j: the compiled ``alg.client_models``.
    per_client: ``per_client(state, key, finetune) -> LossStats [N]``.
    counts: a Counter of traces.

  Returns:
    ``evaluate(state, key, finetune) -> LossStats [N]``.
  """
  pooled = {}

  def evaluate(state, key, finetune):
    if (
      not finetune and alg.evaluate_client is None and jax.process_count() == 1
    ):
      if 'fn' not in pooled:
        shared = jax.eval_shape(alg.client_models, state).num_models == 1
        pooled['fn'] = (
          pooled_padded_evaluation(alg, test, counts) if shared else None
        )
      if pooled['fn'] is not None:
        return pooled['fn'](
          jax.tree.map(lambda a: a[0], models_j(state).params)
        )
    return per_client(state, key, finetune)

  return evaluate


def _pooled(
  alg: FederatedAlgorithm, counts, x_shape, x_dtype, read, traces=None
):
  """The pooled evaluation of ``counts[j]`` test rows per client, back to
  back; ``read(r0, r1, rows)`` gives rows r0..r1 padded to ``rows``;
  ``traces`` (a Counter) counts the chunk program's traces."""
  total = int(counts.sum())
  # one pass a chunk, no loop: XLA's convolution on a CPU
  model = alg.model.forward_only()
  ends = np.cumsum(counts)
  # the client of row(s) r
  client_of = lambda r: np.searchsorted(ends, r, side='right')
  params = jax.eval_shape(model.init, jax.random.key(0))
  sample = np.zeros((1,) + tuple(x_shape), x_dtype)
  out = jax.eval_shape(
    model.apply, params, jax.ShapeDtypeStruct(sample.shape, sample.dtype)
  )
  per_row = (
    int(np.prod(x_shape)) * np.dtype(x_dtype).itemsize
    + int(np.prod(out.shape[1:])) * 4
    + memory.activation_bytes(model, sample, 1)
  )
  rows = int(
    min(4096, 2 ** int(np.log2(max(1, POOLED_CHUNK_BYTES // per_row))))
  )
  rows = min(rows, int(2 ** np.ceil(np.log2(total))))

  @jax.jit
  def chunk_stats(p, x, y, seg, valid):
    if traces is not None:
      traces['eval_pooled'] += 1
    logits = model.apply(p, x)
    one = lambda l, t, m: per_example_stats(
      l[None],
      t[None],
      m[None],
      model.loss,
      model.unscored_targets,
      model.top_k,
      model.unpredicted,
    )
    stats = jax.vmap(one)(logits, y, valid)
    return LossStats(
      *(jax.ops.segment_sum(v, seg, num_segments=rows) for v in stats)
    )

  def evaluate(p):
    out = [np.zeros(len(counts), np.float32) for _ in LossStats._fields]
    if not model.top_k:  # not computed: NaN, as evaluate_params gives it
      out[LossStats._fields.index('correct_top_k')][:] = np.nan
    for r0 in range(0, total, rows):
      r1 = min(r0 + rows, total)
      n = r1 - r0
      x, y = read(r0, r1, rows)
      # The chunk's clients (those without test rows between them skipped).
      clients, seg_n = np.unique(
        client_of(np.arange(r0, r1)), return_inverse=True
      )
      seg = np.zeros(rows, np.int32)
      seg[:n] = seg_n
      stats = jax.device_get(chunk_stats(p, x, y, seg, np.arange(rows) < n))
      for o, a in zip(out, stats):
        o[clients] += np.asarray(a)[: len(clients)]
    return LossStats(*out)

  return evaluate
