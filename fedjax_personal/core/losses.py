"""Losses on a batch: ``Batch``, ``LossStats`` (masked sums), the model's
training loss (``batch_loss``: its training forward pass, dropout keyed by
the step, batch statistics returned as ``StatsAndState``) and evaluation of
one client (``evaluate_params``)."""

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from fedjax_personal.core.data import ClientData
from fedjax_personal.models import Model

__all__ = [
  'Batch',
  'batch_loss',
  'forward',
  'Forward',
  'logits_loss',
  'evaluate_params',
  'features_of_real',
  'mean_loss',
  'get_batch',
  'keep_model_state',
  'LossStats',
  'part',
  'per_example_stats',
  'plain_objective',
  'StatsAndState',
  'zero_stats',
]


class Batch(NamedTuple):
  """One local batch of examples.

  One local batch: x [B, ...], y [B, ...], mask bool [B]; ``key``: the
  draws of a model's random input transform (a local step's batch; None:
  the transform's evaluation half, ``Model.train_apply``)."""

  x: jax.Array
  y: jax.Array
  mask: jax.Array
  key: Optional[jax.Array] = None


class LossStats(NamedTuple):
  """Sums over a batch: loss, correct predictions and counts.

  The counts: counted targets (the loss's denominator), scored targets
  (accuracy's: the counted targets less the model's ``unscored_targets``;
  None: all of them) and scored targets among the model's ``top_k`` highest
  logits (NaN when ``top_k`` is 0: not computed)."""

  loss_sum: ArrayLike
  correct: ArrayLike
  count: ArrayLike  # type: ignore[assignment]  # the examples (shadows tuple.count)
  scored: Any = None
  correct_top_k: Any = None

  @property
  def accuracy_denominator(self):
    return self.count if self.scored is None else self.scored


def zero_stats() -> LossStats:
  """``LossStats`` of nothing: every sum 0.

  Returns:
    The zero ``LossStats``.
  """
  return LossStats(*(jnp.zeros(()) for _ in LossStats._fields))


def per_example_stats(
  logits,
  y,
  mask,
  loss: str = 'cross_entropy',
  unscored=(),
  top_k: int = 0,
  unpredicted=(),
) -> LossStats:
  """Summed loss and correctness with padding masked.

  For 'cross_entropy', ``logits`` is [B, ..., C] and ``y`` integer [B, ...]:
  sequence targets (next character) count every position whose target is
  >= 0 (-1 marks a padded position: no loss, not counted). For 'squared'
  (least squares), ``logits`` and ``y`` are [B, ...] and the loss of an
  example is 0.5 * (prediction - y)^2 summed over its outputs (correct = 0).
  ``mask`` [B] masks whole examples. Targets in ``unscored`` (next-word
  prediction's PAD, BOS, EOS and OOV ids) count in the loss but not in the
  accuracy, as Reddi et al. and the partial-personalization seed score it.
  With ``top_k``, ``correct_top_k`` counts the scored targets among the
  ``top_k`` highest logits. Classes in ``unpredicted`` are never predicted
  (their logits masked for the argmax and the top-k, as FedJAX's
  ``accuracy_in_vocab`` masks PAD, BOS, EOS and OOV).

  Args:
    logits: predictions.
    y: targets.
    mask: [B] real examples.
    loss: ``'cross_entropy'`` or ``'squared'``.
    unscored: target ids left out of the accuracy.
    top_k: count a prediction among the top k as correct (0: the top one).
    unpredicted: class ids never predicted.

  Returns:
    ``LossStats`` summed over the batch.
  """
  if loss == 'squared':
    err = 0.5 * jnp.square(logits - y).reshape(y.shape[0], -1).sum(-1)
    m = mask.astype(jnp.float32)
    return LossStats(
      jnp.sum(err * m),
      jnp.zeros(()),
      jnp.sum(m),
      jnp.sum(m),
      jnp.full((), jnp.nan),
    )
  ce = optax.softmax_cross_entropy_with_integer_labels(
    logits, jnp.maximum(y, 0)
  )
  if unpredicted:
    logits = logits.at[..., jnp.asarray(unpredicted)].set(-jnp.inf)
  correct = (jnp.argmax(logits, -1) == y).astype(jnp.float32)
  m = mask.reshape(mask.shape + (1,) * (y.ndim - mask.ndim)).astype(jnp.float32)
  m = jnp.broadcast_to(m, y.shape) * (y >= 0)  # -1: a padded target position
  s = m
  if unscored:
    s = m * ~jnp.isin(y, jnp.asarray(unscored, y.dtype))
  top = jnp.full((), jnp.nan)
  if top_k:
    _, best = jax.lax.top_k(logits, top_k)
    top = jnp.sum(jnp.any(best == y[..., None], -1).astype(jnp.float32) * s)
  return LossStats(
    jnp.sum(ce * m), jnp.sum(correct * s), jnp.sum(m), jnp.sum(s), top
  )


class Forward(NamedTuple):
  """One training forward pass of a batch (``forward``).

  Attributes:
    logits: [B, ..., C].
    features: the head's input in the same pass [B, ..., D] (the model's
      ``head``), or None when not asked for.
    state: the new batch statistics of a model with ``collections``, or
      None.
  """

  logits: jax.Array
  features: Any = None
  state: Any = None


def forward(
  model: Model, params, batch: Batch, features: bool = False
) -> Forward:
  """A batch's training forward pass: dropout keyed by ``batch.key``,
  batch statistics over its real examples; evaluation mode when the batch
  has no key. With ``features``, the representation the head reads, from
  the same pass (``Model.and_features``: body and head split as PFLlib's
  ``BaseHeadSplit``).

  Args:
    model: the model.
    params: its parameters.
    batch: a ``Batch``.
    features: whether to return the features too.

  Returns:
    The ``Forward``.
  """

  def run():
    if model.train_state is not None and batch.key is not None:
      return model.train_state(params, batch.x, batch.key, batch.mask)
    if model.train_apply is not None and batch.key is not None:
      return model.train_apply(params, batch.x, batch.key), None
    return model.apply(params, batch.x), None

  if not features:
    logits, state = run()
    return Forward(logits, None, state)
  (logits, state), feats = model.and_features(run)()
  return Forward(logits, feats, state)


def logits_loss(model: Model, logits, batch: Batch, state=None):
  """The masked training loss of given logits (``batch_loss`` past the
  forward pass: an algorithm that changes the logits, FedLC's calibration,
  FedRoD's balanced softmax, scores them here).

  Args:
    model: the model (its loss, unscored targets, loss denominator).
    logits: [B, ..., C].
    batch: the ``Batch`` (targets and mask).
    state: new batch statistics to carry (``Forward.state``), or None.

  Returns:
    ``(loss, LossStats)`` or ``(loss, StatsAndState)`` with ``state``.
  """
  # no top-k
  stats = per_example_stats(
    logits,
    batch.y,
    batch.mask,
    model.loss,
    model.unscored_targets,
    0,
    model.unpredicted,
  )
  loss = stats.loss_sum / model.loss_divisor(stats.count, batch.mask, batch.y)
  return loss, stats if state is None else StatsAndState(stats, state)


def batch_loss(model: Model, params, batch: Batch):
  """Masked cross-entropy over real examples, divided by the model's
  ``loss_denominator`` (the mean over counted targets unless it says
  otherwise), and its LossStats.

  Args:
    model: the model.
    params: its parameters.
    batch: a ``Batch`` (its mask marks real examples).

  Returns:
    ``(loss, LossStats)``.
  """
  out = forward(model, params, batch)
  return logits_loss(model, out.logits, batch, out.state)


class StatsAndState(NamedTuple):
  """A batch's statistics and a model's updated collections.

  What ``batch_loss`` returns beside the loss for a model with mutable
  collections (``Model.collections``): the batch's ``LossStats`` and the
  collections its training forward pass computed (the new batch statistics).
  A step puts them into its parameters with ``keep_model_state``.

  Attributes:
    stats: the batch's ``LossStats``.
    state: ``{collection: values}``.
  """

  stats: LossStats
  state: Any


def keep_model_state(params, aux):
  """The parameters after a step, with the model state its forward pass
  computed (the optimizer never moves a model's batch statistics: their
  gradient is 0 and whatever it did is replaced), and the step's
  ``LossStats``.

  Args:
    params: the parameters after the optimizer's update (a model with
      collections: its variables, ``Model.collections``).
    aux: what the objective returned beside the loss (``LossStats`` or
      ``StatsAndState``).

  Returns:
    ``(params, LossStats)``.
  """
  if isinstance(aux, StatsAndState):
    return {**params, **aux.state}, aux.stats
  return params, aux


def plain_objective(model: Model):
  """The empirical risk on a batch: ``(params, batch) -> (loss, stats)``.

  Args:
    model: the model.

  Returns:
    ``objective(params, batch) -> (loss, LossStats)``.
  """
  return lambda params, batch: batch_loss(model, params, batch)


def part(batch: Batch, k: int) -> Batch:
  """Batch ``k`` of a step that draws several ([K, B, ...]), its input draws
  its own (``fold_in(key, k)``).

  Args:
    batch: a step's ``Batch`` of K draws [K, B, ...].
    k: which draw.

  Returns:
    Draw ``k`` as a ``Batch`` [B, ...].
  """
  key = None if batch.key is None else jax.random.fold_in(batch.key, k)
  return Batch(batch.x[k], batch.y[k], batch.mask[k], key)


def get_batch(data: ClientData, idx, mask) -> Batch:
  """The examples at ``idx`` of one client (from its packed cohort's rows
  when it has them: the same values, without making the client's window).

  Args:
    data: one client's ``ClientData``.
    idx: example indices [B].
    mask: [B] real examples.

  Returns:
    The ``Batch``.
  """
  if data.source is not None:
    x, y, start = data.source
    return Batch(x=x[start + idx], y=y[start + idx], mask=mask)
  return Batch(x=data.x[idx], y=data.y[idx], mask=mask)


def evaluate_params(model: Model, params, data: ClientData) -> LossStats:
  """LossStats of ``params`` on all real examples of one client.

  Args:
    model: the model.
    params: its parameters.
    data: one client's ``ClientData`` (a test split).

  Returns:
    The client's ``LossStats``.
  """
  mask = jnp.arange(data.x.shape[0]) < data.num_examples
  return per_example_stats(
    model.apply(params, data.x),
    data.y,
    mask,
    model.loss,
    model.unscored_targets,
    model.top_k,
    model.unpredicted,
  )


def mean_loss(model: Model, params, data: ClientData):
  """The mean loss of ``params`` over one client's real examples (its
  counted targets; 0 for a client without any): ``evaluate_params``'
  loss sum over its count.

  Args:
    model: the model.
    params: its parameters.
    data: one client's ``ClientData``.

  Returns:
    float32 scalar.
  """
  s = evaluate_params(model, params, data)
  return s.loss_sum / jnp.maximum(s.count, 1.0)


#: Rows a client's feature pass computes at once (``features_of_real``).
FEATURE_CHUNK = 64


def features_of_real(
  model: Model, params, x, num_examples, chunk: int = FEATURE_CHUNK
) -> jax.Array:
  """The features of a client's first ``num_examples`` rows of ``x``, in
  evaluation mode: [n, ...] for ``x`` [n, ...], zeros past its count. The
  pass runs in chunks of ``chunk`` rows while they hold the client's
  examples, so it costs the client's own examples, not the padded length
  (PFLlib's CNN over MNIST's writers: 771 rows padded, 48 real for the
  smallest). Each row's features are those of the whole pass (a model's
  evaluation is row by row).

  Args:
    model: the model (with a head).
    params: its parameters.
    x: the client's padded inputs [n, ...], its real rows first.
    num_examples: its real rows (traced int).
    chunk: rows a chunk.

  Returns:
    float [n, ...] (the features' own shape).
  """
  x = jnp.asarray(x)
  n = x.shape[0]
  chunks = max(-(-n // chunk), 1)
  padded = jnp.pad(x, [(0, chunks * chunk - n)] + [(0, 0)] * (x.ndim - 1))

  def of(rows):
    return model.and_features(model.apply)(params, rows)[1]

  shape = jax.eval_shape(of, padded[:chunk])

  def body(i, out):
    rows = jax.lax.dynamic_slice_in_dim(padded, i * chunk, chunk)
    return jax.lax.dynamic_update_slice_in_dim(out, of(rows), i * chunk, 0)

  todo = (jnp.asarray(num_examples, jnp.int32) + chunk - 1) // chunk
  out = jax.lax.fori_loop(
    0,
    jnp.minimum(todo, chunks),
    body,
    jnp.zeros((chunks * chunk,) + shape.shape[1:], shape.dtype),
  )
  real = jnp.arange(n) < num_examples
  return jnp.where(real.reshape((n,) + (1,) * (out.ndim - 1)), out[:n], 0)
