"""FedJAX's ``fedjax.metrics``: a ``Metric`` evaluates one example into a
``Stat``; ``evaluate_batch`` maps it over a batch (masked examples give the
metric's zero) and reduces. The same metrics, statistics and edge cases as
FedJAX 0.0.17 (a mean over zero weight is 0).
"""

import abc
import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from fedjax_personal.fedjax.core.dataclasses import dataclass
from fedjax_personal.fedjax.core.typing import (
  BatchExample,
  BatchPrediction,
  SingleExample,
  SinglePrediction,
)

__all__ = [
  'Accuracy',
  'apply_mask',
  'ConfusionMatrix',
  'CrossEntropyLoss',
  'evaluate_batch',
  'MeanStat',
  'Metric',
  'PerDomainMetric',
  'SequenceCount',
  'SequenceCrossEntropyLoss',
  'SequenceLength',
  'SequenceTokenAccuracy',
  'SequenceTokenCount',
  'SequenceTokenCrossEntropyLoss',
  'SequenceTokenOOVRate',
  'SequenceTokenTopKAccuracy',
  'SequenceTruncationRate',
  'Stat',
  'SumStat',
  'TopKAccuracy',
  'unreduced_cross_entropy_loss',
]


def safe_div(a, b):
  """a / b, or 0 where b is 0 (with a gradient that stays finite)."""
  safe = b != 0
  return jnp.where(safe, a / jnp.where(safe, b, 1), 0)


class Stat(metaclass=abc.ABCMeta):
  """A statistic: its result, the merge of two, the reduction along an axis."""

  @abc.abstractmethod
  def result(self) -> jax.Array:
    """The metric's value."""

  @abc.abstractmethod
  def merge(self, other: 'Stat') -> 'Stat':
    """This statistic and ``other`` together."""

  @abc.abstractmethod
  def reduce(self, axis: Optional[int] = 0) -> 'Stat':
    """The statistic merged along ``axis``."""

  def __str__(self) -> str:
    return f'{self!r} => {self.result()}'


@dataclass
class MeanStat(Stat):
  """A weighted mean: ``accum / weight`` (0 when the weight is 0).

  Attributes:
    accum: the weighted sum.
    weight: the total weight (never negative; where 0, ``accum`` is 0).
  """

  accum: jax.Array
  weight: jax.Array

  @classmethod
  def new(cls, accum, weight) -> 'MeanStat':
    """A MeanStat with the weight clipped at 0 and the sum 0 where it is."""
    weight = jnp.maximum(0, jnp.asarray(weight))
    return cls(jnp.where(weight == 0, 0, jnp.asarray(accum)), weight)

  def result(self) -> jax.Array:
    return safe_div(self.accum, self.weight)

  def merge(self, other: 'MeanStat') -> 'MeanStat':  # type: ignore[override]
    return MeanStat.new(self.accum + other.accum, self.weight + other.weight)

  def reduce(self, axis: Optional[int] = 0) -> 'MeanStat':
    return MeanStat.new(
      jnp.sum(self.accum, axis=axis), jnp.sum(self.weight, axis=axis)
    )


@dataclass
class SumStat(Stat):
  """A sum.

  Attributes:
    accum: the sum.
  """

  accum: jax.Array

  @classmethod
  def new(cls, accum) -> 'SumStat':
    """A SumStat of ``accum``."""
    return cls(jnp.asarray(accum))

  def result(self) -> jax.Array:
    return self.accum

  def merge(self, other: 'SumStat') -> 'SumStat':  # type: ignore[override]
    return SumStat.new(self.accum + other.accum)

  def reduce(self, axis: Optional[int] = 0) -> 'SumStat':
    return SumStat.new(jnp.sum(self.accum, axis=axis))


class Metric(metaclass=abc.ABCMeta):
  """A metric: the zero of its statistic and one example's statistic."""

  @abc.abstractmethod
  def zero(self) -> Stat:
    """The statistic merging with which changes nothing."""

  @abc.abstractmethod
  def evaluate_example(
    self, example: SingleExample, prediction: SinglePrediction
  ) -> Stat:
    """One example's statistic."""


def apply_mask(mask: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
  """``a`` where ``mask`` (on the leading axis), else ``b``.

  Args:
    mask: bool [B].
    a: [B, ...] values kept where true.
    b: values where false (broadcast).

  Returns:
    The masked array.
  """
  rank = max(len(a.shape), len(b.shape))
  return jnp.where(jnp.expand_dims(mask, tuple(range(1, rank))), a, b)


@functools.partial(jax.jit, static_argnums=0)
def evaluate_batch(
  metric: Metric,
  batch_example: BatchExample,
  batch_prediction: BatchPrediction,
  batch_mask: Optional[jax.Array] = None,
) -> Stat:
  """``metric`` over a batch: each example's statistic (the zero where
  ``batch_mask`` is false), reduced over the batch."""
  stat = jax.vmap(metric.evaluate_example)(batch_example, batch_prediction)
  if batch_mask is not None:
    stat = jax.tree.map(
      functools.partial(apply_mask, batch_mask), stat, metric.zero()
    )
  return stat.reduce()


def unreduced_cross_entropy_loss(
  targets: jax.Array, preds: jax.Array, is_sparse_targets: bool = True
) -> jax.Array:
  """Cross-entropy of logits ``preds`` over the last axis.

  Args:
    targets: class ids, or distributions when ``is_sparse_targets`` is
      false.
    preds: logits [..., classes].
    is_sparse_targets: whether ``targets`` are class ids.

  Returns:
    The loss per example [...].
  """
  log_preds = jax.nn.log_softmax(preds)
  if is_sparse_targets:
    targets = jax.nn.one_hot(targets, preds.shape[-1])
  return -jnp.sum(targets * log_preds, axis=-1)


def _pred(prediction, key):
  return prediction if key is None else prediction[key]


def get_target_weight(
  target: jax.Array, masked_target_values: Tuple[int, ...]
) -> jax.Array:
  """1.0 where ``target`` is none of ``masked_target_values``, else 0."""
  weight = jnp.ones_like(target, dtype=jnp.float32)
  for value in masked_target_values:
    weight *= target != value
  return weight


def _per_position(per_position, value, weight):
  if per_position:
    return MeanStat.new(value * weight, weight)
  return MeanStat.new(jnp.sum(value * weight), jnp.sum(weight))


@dataclass
class CrossEntropyLoss(Metric):
  """The mean cross-entropy of the logits against the class id."""

  target_key: str = 'y'
  pred_key: Optional[str] = None

  def zero(self) -> MeanStat:
    return MeanStat.new(0.0, 0.0)

  def evaluate_example(self, example, prediction) -> MeanStat:
    loss = unreduced_cross_entropy_loss(
      example[self.target_key], _pred(prediction, self.pred_key)
    )
    return MeanStat.new(loss, 1.0)


@dataclass
class Accuracy(Metric):
  """The share of examples whose arg-max logit is the class id."""

  target_key: str = 'y'
  pred_key: Optional[str] = None

  def zero(self) -> MeanStat:
    return MeanStat.new(0.0, 0.0)

  def evaluate_example(self, example, prediction) -> MeanStat:
    pred = _pred(prediction, self.pred_key)
    correct = example[self.target_key] == jnp.argmax(pred, axis=-1)
    return MeanStat.new(correct.astype(jnp.float32), 1.0)


@dataclass
class TopKAccuracy(Metric):
  """The share of examples whose class id is among the k largest logits."""

  k: int
  target_key: str = 'y'
  pred_key: Optional[str] = None

  def zero(self) -> Stat:
    return MeanStat.new(0.0, 0.0)

  def evaluate_example(self, example, prediction) -> Stat:
    top_k = jnp.argsort(-_pred(prediction, self.pred_key))[: self.k]
    correct = jnp.any(top_k == example[self.target_key])
    return MeanStat.new(correct.astype(jnp.float32), 1.0)


@dataclass
class SequenceTokenCrossEntropyLoss(Metric):
  """Cross-entropy per unmasked token of a sequence."""

  target_key: str = 'y'
  pred_key: Optional[str] = None
  masked_target_values: Tuple[int, ...] = (0,)
  per_position: bool = False

  def zero(self) -> MeanStat:
    return MeanStat.new(0.0, 0.0)

  def evaluate_example(self, example, prediction) -> MeanStat:
    target = example[self.target_key]
    weight = get_target_weight(target, self.masked_target_values)
    loss = unreduced_cross_entropy_loss(
      target, _pred(prediction, self.pred_key)
    )
    return _per_position(self.per_position, loss, weight)


@dataclass
class SequenceCrossEntropyLoss(Metric):
  """A sequence's total cross-entropy over its unmasked tokens.

  Per sequence with any."""

  target_key: str = 'y'
  pred_key: Optional[str] = None
  masked_target_values: Tuple[int, ...] = (0,)

  def zero(self) -> MeanStat:
    return MeanStat.new(0.0, 0.0)

  def evaluate_example(self, example, prediction) -> MeanStat:
    target = example[self.target_key]
    weight = get_target_weight(target, self.masked_target_values)
    loss = unreduced_cross_entropy_loss(
      target, _pred(prediction, self.pred_key)
    )
    return MeanStat.new(jnp.sum(loss * weight), jnp.any(weight))


def _masked_logits(pred, logits_mask):
  return pred if logits_mask is None else pred + jnp.array(logits_mask)


@dataclass
class SequenceTokenAccuracy(Metric):
  """The share of unmasked tokens predicted.

  Arg-max after adding ``logits_mask``."""

  target_key: str = 'y'
  pred_key: Optional[str] = None
  masked_target_values: Tuple[int, ...] = (0,)
  logits_mask: Optional[Tuple[float, ...]] = None
  per_position: bool = False

  def zero(self) -> MeanStat:
    return MeanStat.new(0.0, 0.0)

  def evaluate_example(self, example, prediction) -> MeanStat:
    target = example[self.target_key]
    pred = _masked_logits(_pred(prediction, self.pred_key), self.logits_mask)
    weight = get_target_weight(target, self.masked_target_values)
    correct = (target == jnp.argmax(pred, axis=-1)).astype(jnp.float32)
    return _per_position(self.per_position, correct, weight)


@dataclass
class SequenceTokenTopKAccuracy(Metric):
  """The share of unmasked tokens among the k largest logits."""

  k: int
  target_key: str = 'y'
  pred_key: Optional[str] = None
  masked_target_values: Tuple[int, ...] = (0,)
  logits_mask: Optional[Tuple[float, ...]] = None
  per_position: bool = False

  def zero(self) -> MeanStat:
    return MeanStat.new(0.0, 0.0)

  def evaluate_example(self, example, prediction) -> MeanStat:
    target = example[self.target_key]
    pred = _masked_logits(_pred(prediction, self.pred_key), self.logits_mask)
    weight = get_target_weight(target, self.masked_target_values)
    top_k = jnp.argsort(-pred, axis=1)[:, : self.k]
    correct = jnp.any(top_k.T == target, axis=0).astype(jnp.float32)
    return _per_position(self.per_position, correct, weight)


@dataclass
class SequenceTokenCount(Metric):
  """The number of unmasked tokens."""

  target_key: str = 'y'
  masked_target_values: Tuple[int, ...] = (0,)

  def zero(self) -> SumStat:
    return SumStat.new(0.0)

  def evaluate_example(self, example, prediction) -> SumStat:
    del prediction
    weight = get_target_weight(
      example[self.target_key], self.masked_target_values
    )
    return SumStat.new(jnp.sum(weight))


@dataclass
class SequenceCount(Metric):
  """The number of sequences with an unmasked token."""

  target_key: str = 'y'
  masked_target_values: Tuple[int, ...] = (0,)

  def zero(self) -> SumStat:
    return SumStat.new(0.0)

  def evaluate_example(self, example, prediction) -> SumStat:
    del prediction
    weight = get_target_weight(
      example[self.target_key], self.masked_target_values
    )
    return SumStat.new(jnp.any(weight).astype(jnp.float32))


@dataclass
class SequenceTruncationRate(Metric):
  """The share of non-empty sequences without ``eos_target_value``."""

  eos_target_value: int
  target_key: str = 'y'
  masked_target_values: Tuple[int, ...] = (0,)

  def zero(self) -> MeanStat:
    return MeanStat.new(0.0, 0.0)

  def evaluate_example(self, example, prediction) -> MeanStat:
    del prediction
    target = example[self.target_key]
    weight = get_target_weight(target, self.masked_target_values)
    not_empty = jnp.sum(jnp.any(weight))
    truncated = jnp.all(target != self.eos_target_value)
    return MeanStat.new(truncated * not_empty, not_empty)


@dataclass
class SequenceTokenOOVRate(Metric):
  """The share of unmasked tokens that are ``oov_target_values``."""

  oov_target_values: Tuple[int, ...]
  target_key: str = 'y'
  masked_target_values: Tuple[int, ...] = (0,)
  per_position: bool = False

  def zero(self) -> MeanStat:
    return MeanStat.new(0.0, 0.0)

  def evaluate_example(self, example, prediction) -> MeanStat:
    del prediction
    target = example[self.target_key]
    weight = get_target_weight(target, self.masked_target_values)
    # FedJAX's product over the values: OOV only when equal to all of them
    oov = jnp.ones_like(target, dtype=jnp.float32)
    for value in self.oov_target_values:
      oov *= target == value
    return _per_position(self.per_position, oov, weight)


@dataclass
class SequenceLength(Metric):
  """The mean number of unmasked tokens of the non-empty sequences."""

  target_key: str = 'y'
  masked_target_values: Tuple[int, ...] = (0,)

  def zero(self) -> MeanStat:
    return MeanStat.new(0.0, 0.0)

  def evaluate_example(self, example, prediction) -> MeanStat:
    del prediction
    weight = get_target_weight(
      example[self.target_key], self.masked_target_values
    )
    return MeanStat.new(jnp.sum(weight), jnp.sum(jnp.any(weight)))


@dataclass
class PerDomainMetric(Metric):
  """A metric kept per domain.

  ``base`` kept per domain (``example[domain_id_key]``): statistics with a
  leading [num_domains] axis."""

  base: Metric
  num_domains: int
  domain_id_key: str = 'domain_id'

  def zero(self) -> Stat:
    return jax.tree.map(
      lambda x: jnp.broadcast_to(x, (self.num_domains,) + x.shape),
      self.base.zero(),
    )

  def evaluate_example(self, example, prediction) -> Stat:
    domain = jax.nn.one_hot(
      example[self.domain_id_key], self.num_domains, dtype=jnp.bool_
    )
    return jax.tree.map(
      lambda a, b: apply_mask(
        domain, jnp.expand_dims(a, 0), jnp.expand_dims(b, 0)
      ),
      self.base.evaluate_example(example, prediction),
      self.base.zero(),
    )


@dataclass
class ConfusionMatrix(Metric):
  """Counts of (class id, arg-max logit) pairs, [num_classes, num_classes]."""

  num_classes: int
  target_key: str = 'y'
  pred_key: Optional[str] = None

  def zero(self) -> SumStat:
    return SumStat.new(jnp.zeros((self.num_classes, self.num_classes)))

  def evaluate_example(self, example, prediction) -> SumStat:
    pred = _pred(prediction, self.pred_key)
    if self.num_classes != len(pred):
      raise ValueError(
        'Make sure num_classes is equal to the number of output classes of '
        f'the model. num_classes: {self.num_classes} number of output '
        f'classes of the model: {len(pred)}'
      )
    cell = jnp.zeros((self.num_classes, self.num_classes))
    return SumStat.new(
      cell.at[example[self.target_key], jnp.argmax(pred, axis=-1)].set(1)
    )
