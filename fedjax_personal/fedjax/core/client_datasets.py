"""FedJAX's ``fedjax.core.client_datasets`` (0.0.17): the project's
``ClientDataset`` and batching (``fedjax_personal.datasets.client_datasets``)
with FedJAX's hyperparameter classes, which its batching methods take as
their first argument (``ds.padded_batch(PaddedBatchHParams(batch_size=8))``)."""

import dataclasses
from typing import Optional

from fedjax_personal.datasets.client_datasets import (  # noqa: F401  (FedJAX's names)
  EXAMPLE_MASK_KEY,
  BatchPreprocessor,
  ClientDataset,
  Examples,
  NoOpBatchPreprocessor,
  assert_consistent_rows,
  attach_mask,
  buffered_shuffle,
  buffered_shuffle_batch_client_datasets,
  concat_examples,
  num_examples,
  pad_examples,
  padded_batch_client_datasets,
  slice_examples,
)

__all__ = [
  'assert_consistent_rows',
  'attach_mask',
  'BatchHParams',
  'BatchPreprocessor',
  'buffered_shuffle',
  'buffered_shuffle_batch_client_datasets',
  'ClientDataset',
  'concat_examples',
  'EXAMPLE_MASK_KEY',
  'Examples',
  'NoOpBatchPreprocessor',
  'num_examples',
  'pad_examples',
  'padded_batch_client_datasets',
  'PaddedBatchHParams',
  'ShuffleRepeatBatchHParams',
  'slice_examples',
]


@dataclasses.dataclass
class PaddedBatchHParams:
  """``ClientDataset.padded_batch``'s settings (FedJAX's).

  Attributes:
    batch_size: examples a batch.
    num_batch_size_buckets: sizes the last batch may be padded to.
  """

  batch_size: int
  num_batch_size_buckets: int = 1


@dataclasses.dataclass
class ShuffleRepeatBatchHParams:
  """``ClientDataset.shuffle_repeat_batch``'s settings (FedJAX's).

  Attributes:
    batch_size: examples a batch.
    num_epochs: passes (None: no limit).
    num_steps: batches at most (None: no limit).
    drop_remainder: drop a last batch smaller than ``batch_size``.
    seed: the shuffle's seed (None: a fresh one).
    skip_shuffle: keep the rows' order.
  """

  batch_size: int
  num_epochs: Optional[int] = 1
  num_steps: Optional[int] = None
  drop_remainder: bool = False
  seed: Optional[int] = None
  skip_shuffle: bool = False


@dataclasses.dataclass
class BatchHParams:
  """``ClientDataset.batch``'s settings (FedJAX's).

  Attributes:
    batch_size: examples a batch.
    drop_remainder: drop a last batch smaller than ``batch_size``.
  """

  batch_size: int
  drop_remainder: bool = False
