"""What FedJAX's two recurrent language models (``models.shakespeare``,
``models.stackoverflow``) share: the logits mask of the special tokens, the
masked per-token loss and the sequence metrics."""

from typing import Sequence

import jax.numpy as jnp
import numpy as np

from fedjax_personal.fedjax.core import metrics

__all__ = ['eval_metrics', 'logits_mask', 'per_token_loss', 'SAMPLE_BATCH']

SAMPLE_BATCH = {
  'x': np.zeros((1, 1), dtype=np.int32),
  'y': np.zeros((1, 1), dtype=np.int32),
}


def logits_mask(full_vocab_size: int, special: Sequence[int]) -> tuple:
  """0 for every token, -inf for ``special`` ones (never guessed).

  Args:
    full_vocab_size: the vocabulary with the special tokens.
    special: the special tokens' ids.

  Returns:
    The mask, one float per token.
  """
  mask = [0.0] * full_vocab_size
  for i in special:
    mask[i] = -jnp.inf
  return tuple(mask)


def per_token_loss(batch, preds, pad: int):
  """Cross-entropy per token, 0 on padding.

  Args:
    batch: ``{'y': [batch, time] int}``.
    preds: logits ``[batch, time, vocabulary]``.
    pad: the padding id.

  Returns:
    ``[batch, time]`` losses.
  """
  targets = batch['y']
  return metrics.unreduced_cross_entropy_loss(targets, preds) * (targets != pad)


def eval_metrics(
  pad: int, eos: int, oov: int, mask: tuple, truncation: bool
) -> dict:
  """FedJAX's sequence metrics of its language models.

  Args:
    pad: the padding id.
    eos: the end-of-sequence id.
    oov: the out-of-vocabulary id.
    mask: ``logits_mask``'s mask (``accuracy_in_vocab``).
    truncation: with Stack Overflow's truncation rate.

  Returns:
    ``{name: Metric}``.
  """
  out = {
    'accuracy_in_vocab': metrics.SequenceTokenAccuracy(
      masked_target_values=(pad, eos), logits_mask=mask
    ),
    'accuracy_no_eos': metrics.SequenceTokenAccuracy(
      masked_target_values=(pad, eos)
    ),
    'num_tokens': metrics.SequenceTokenCount(masked_target_values=(pad,)),
    'sequence_length': metrics.SequenceLength(masked_target_values=(pad,)),
    'sequence_loss': metrics.SequenceCrossEntropyLoss(
      masked_target_values=(pad,)
    ),
    'token_loss': metrics.SequenceTokenCrossEntropyLoss(
      masked_target_values=(pad,)
    ),
    'token_oov_rate': metrics.SequenceTokenOOVRate(
      oov_target_values=(oov,), masked_target_values=(pad,)
    ),
  }
  if truncation:
    out['truncation_rate'] = metrics.SequenceTruncationRate(
      eos_target_value=eos, masked_target_values=(pad,)
    )
  return out
