"""What an evaluation reports: the summary of per-client test statistics
(mean, weighted, worst, quantiles, top-k) and each client's accuracy."""

import numpy as np

from fedjax_personal.core.training import LossStats

__all__ = ['evaluation_record', 'per_client_accuracy', 'summarize']


def summarize(stats: LossStats) -> dict:
  """Summary of per-client test metrics.

  Returns the unweighted mean accuracy over clients with test data, the mean
  weighted by test size, the worst and best client, quantiles
  10/25/50/75/90, and the weighted mean loss.

  Args:
    stats: per-client ``LossStats`` ([N] arrays of correct predictions, counts,
      summed losses).

  Returns:
    ``{'accuracy_mean', 'accuracy_weighted', 'accuracy_worst',
    'accuracy_best', 'accuracy_q10', ..., 'loss_weighted'}``: floats over
    the clients with test data.
  """
  correct = np.asarray(stats.correct, np.float64)
  count = np.asarray(stats.count, np.float64)
  scored = np.asarray(stats.accuracy_denominator, np.float64)
  loss = np.asarray(stats.loss_sum, np.float64)
  has = scored > 0
  acc = correct[has] / scored[has]
  if acc.size == 0:
    return {'accuracy_mean': float('nan')}
  q = np.quantile(acc, [0.1, 0.25, 0.5, 0.75, 0.9])
  return {
    'accuracy_mean': float(acc.mean()),
    'accuracy_weighted': float(correct.sum() / scored.sum()),
    'accuracy_worst': float(acc.min()),
    'accuracy_best': float(acc.max()),
    'accuracy_q10': float(q[0]),
    'accuracy_q25': float(q[1]),
    'accuracy_median': float(q[2]),
    'accuracy_q75': float(q[3]),
    'accuracy_q90': float(q[4]),
    'loss_weighted': float(loss.sum() / count.sum()),
    **_top_k_summary(stats, has, scored),
    'num_eval_clients': int(has.sum()),
    # Clients without test examples: excluded from every statistic above
    # (their per-client accuracy is written as null).
    'num_excluded_clients': int((~has).sum()),
  }


def _top_k_summary(stats: LossStats, has, scored) -> dict:
  """Mean and weighted top-k accuracy when the model reports it."""
  if stats.correct_top_k is None:
    return {}
  top = np.asarray(stats.correct_top_k, np.float64)
  if np.isnan(top).all():  # the model computes no top-k
    return {}
  return {
    'accuracy_top_k_mean': float((top[has] / scored[has]).mean()),
    'accuracy_top_k_weighted': float(top.sum() / scored.sum()),
  }


def evaluation_record(stats: LossStats) -> dict:
  """What an evaluated round adds to its record: the summary and the
  per-client accuracies.

  Args:
    stats: per-client ``LossStats`` [N].

  Returns:
    The record's entries.
  """
  return {
    **summarize(stats),
    'per_client_accuracy': per_client_accuracy(stats).tolist(),
  }


def per_client_accuracy(stats: LossStats) -> np.ndarray:
  """Accuracy of each client on its test split (NaN without test data).

  Args:
    stats: per-client ``LossStats`` [N].

  Returns:
    Accuracies [N].
  """
  scored = np.asarray(stats.accuracy_denominator, np.float64)
  return np.where(
    scored > 0, np.asarray(stats.correct) / np.maximum(scored, 1), np.nan
  )
