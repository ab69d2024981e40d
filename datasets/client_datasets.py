"""FedJAX's client datasets: one client's examples and their batching.

The objects and functions of ``fedjax/core/client_datasets.py`` (FedJAX
0.0.17), with its behaviour to the last detail, so that a FedJAX user's
code runs with only the import changed and gives FedJAX's arrays
(``tests/test_fedjax_api.py`` compares them with arrays recorded from
FedJAX itself):

- ``BatchPreprocessor``: a chain of ``examples -> examples`` functions,
  extended by ``append``; every client of a ``FederatedData`` holds the
  same object, which ``padded_batch_client_datasets`` and
  ``buffered_shuffle_batch_client_datasets`` require (a ValueError
  otherwise, as FedJAX's).
- ``ClientDataset``: ``batch``, ``padded_batch`` (an ``EXAMPLE_MASK_KEY``
  feature; the last batch padded to ``batch_size`` halved at most
  ``num_batch_size_buckets - 1`` times) and ``shuffle_repeat_batch``
  (``numpy.random.RandomState(seed)``'s order).
- Batches over many clients: ``padded_batch_client_datasets`` (evaluation
  over a whole federated data set) and ``buffered_shuffle_batch_client_datasets``.
"""

import collections
import dataclasses
import itertools
import numbers
from typing import Any, Callable, Dict, Iterable, Iterator, Mapping

import numpy as np

__all__ = [
  'assert_consistent_rows',
  'attach_mask',
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
  'slice_examples',
]

#: The bool feature ``padded_batch`` adds: True for an example, False for
#: padding.
EXAMPLE_MASK_KEY = '__mask__'

Examples = Mapping[str, np.ndarray]


def assert_consistent_rows(examples: Examples) -> None:
  """Checks that every feature has the same number of rows.

  Args:
    examples: ``{feature: array}``.

  Returns:
    None.

  Raises:
    ValueError: no feature, or two with different numbers of rows.
  """
  sizes = {k: np.shape(v)[0] for k, v in examples.items()}
  if not sizes:
    raise ValueError('No features in examples')
  (name, size), *rest = sizes.items()
  for k, v in rest:
    if v != size:
      raise ValueError(
        f'Feature {name} has {size} rows, but feature {k} has {v} rows'
      )


def num_examples(examples: Examples, validate: bool = True) -> int:
  """The number of rows of ``examples``.

  Args:
    examples: ``{feature: array}``.
    validate: check that every feature has as many (``assert_consistent_rows``).

  Returns:
    The rows of the first feature.
  """
  if validate:
    assert_consistent_rows(examples)
  return len(next(iter(examples.values())))


def slice_examples(examples: Examples, index) -> Dict[str, np.ndarray]:
  """Every feature's rows at ``index``.

  Args:
    examples: ``{feature: array}``.
    index: a slice, or the rows' indices.

  Returns:
    ``{feature: array[index]}``.
  """
  return {k: v[index] for k, v in examples.items()}


def concat_examples(many: Iterable[Examples]) -> Dict[str, np.ndarray]:
  """Examples stacked along their rows, feature by feature.

  Args:
    many: ``{feature: array}`` dicts with the same features.

  Returns:
    ``{feature: the arrays concatenated}``.
  """
  combined = collections.defaultdict(list)
  for examples in many:
    for k, v in examples.items():
      combined[k].append(v)
  return {k: np.concatenate(v, axis=0) for k, v in combined.items()}


def attach_mask(examples: Examples, mask: np.ndarray) -> Dict[str, np.ndarray]:
  """``examples`` with ``mask`` as ``EXAMPLE_MASK_KEY``.

  Args:
    examples: ``{feature: array}``.
    mask: bool [rows].

  Returns:
    A new dict with the mask.

  Raises:
    ValueError: the mask is there already.
  """
  if EXAMPLE_MASK_KEY in examples:
    raise ValueError(
      f'mask key {EXAMPLE_MASK_KEY!r} is already present in examples {examples}'
    )
  return {**examples, EXAMPLE_MASK_KEY: mask}


def pad_examples(examples: Examples, size: int) -> Dict[str, np.ndarray]:
  """``examples`` padded with zero rows to ``size`` rows, with the mask.

  Args:
    examples: ``{feature: array}``.
    size: the rows wanted.

  Returns:
    The padded examples and ``EXAMPLE_MASK_KEY`` (True for the examples).

  Raises:
    ValueError: the mask is there already, or more than ``size`` rows.
  """
  if EXAMPLE_MASK_KEY in examples:
    raise ValueError(
      f'mask key {EXAMPLE_MASK_KEY!r} is already present in examples {examples}'
    )
  current = num_examples(examples)
  if current > size:
    raise ValueError(f'Cannot pad {current} examples to size {size}')
  result = {EXAMPLE_MASK_KEY: np.arange(size) < current}
  for k, v in examples.items():
    padded = np.zeros((size,) + v.shape[1:], v.dtype)
    padded[:current] = v
    result[k] = padded
  return result


class BatchPreprocessor:
  """A chain of functions on batched examples (FedJAX's ``BatchPreprocessor``).

  Args:
    fns: ``examples -> examples`` functions, applied in order to a copy of
      the examples (a function may change its input dict).
  """

  def __init__(self, fns: Iterable[Callable[[Examples], Examples]] = ()):
    self._fns = tuple(fns)

  def __call__(self, examples: Examples) -> Examples:
    if not self._fns:
      return examples
    out: Examples = dict(examples)
    for f in self._fns:
      out = f(out)
    assert_consistent_rows(out)
    return out

  def append(self, fn: Callable[[Examples], Examples]) -> 'BatchPreprocessor':
    """A new BatchPreprocessor with ``fn`` added to the end."""
    return BatchPreprocessor(self._fns + (fn,))

  def __str__(self) -> str:
    return f'BatchPreprocessor({self._fns})'

  __repr__ = __str__


#: The preprocessor that does nothing (every ``ClientDataset``'s default).
NoOpBatchPreprocessor = BatchPreprocessor()


def _hparams(hparams, kwargs: dict, defaults: dict) -> dict:
  """FedJAX's two calling forms: an hparams object (any object with the
  fields, e.g. ``fedjax.PaddedBatchHParams``), overridden by keywords."""
  got = dict(defaults)
  if hparams is not None:
    fields = (
      dataclasses.asdict(hparams)
      if dataclasses.is_dataclass(hparams) and not isinstance(hparams, type)
      else dict(vars(hparams))
    )
    got.update({k: v for k, v in fields.items() if k in defaults})
  unknown = set(kwargs) - set(defaults)
  if unknown:
    raise TypeError(
      f'unexpected batching arguments {sorted(unknown)}; expected '
      f'{sorted(defaults)}'
    )
  got.update(kwargs)
  # FedJAX: 0 epochs or steps give no batch
  for name, least in (
    ('batch_size', 1),
    ('num_batch_size_buckets', 1),
    ('num_epochs', 0),
    ('num_steps', 0),
  ):
    value = got.get(name)
    if (
      name in got
      and (value is not None or name == 'batch_size')
      and (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value < least
      )
    ):
      raise ValueError(f'{name} must be an integer >= {least}, got {value!r}')
  return got


PADDED_BATCH = {'batch_size': None, 'num_batch_size_buckets': 1}


def final_batch_size(size: int, batch_size: int, buckets: int) -> int:
  """The padded size of the last batch: ``batch_size`` halved at most
  ``buckets - 1`` times while the half still holds the remainder."""
  rest = size % batch_size
  if rest == 0:
    return batch_size
  chosen, halvings = batch_size, 1
  while chosen // 2 >= rest and halvings < buckets:
    chosen, halvings = chosen // 2, halvings + 1
  return chosen


class _View:
  """A re-iterable view: every ``iter`` starts the batches again."""

  def __init__(self, make: Callable[[], Iterator[Examples]]):
    self._make = make

  def __iter__(self) -> Iterator[Examples]:
    return self._make()


class ClientDataset:
  """One client's examples in memory (FedJAX's ``ClientDataset``).

  Args:
    raw_examples: ``{feature: array}``, the same number of rows each.
    preprocessor: the ``BatchPreprocessor`` every batch passes through.
  """

  def __init__(
    self,
    raw_examples: Examples,
    preprocessor: BatchPreprocessor = NoOpBatchPreprocessor,
  ):
    assert_consistent_rows(raw_examples)
    self.raw_examples = raw_examples
    self.preprocessor = preprocessor

  def __len__(self) -> int:
    return num_examples(self.raw_examples, validate=False)

  def __getitem__(self, index: slice) -> 'ClientDataset':
    """The examples of a slice of rows, as a ClientDataset."""
    if not isinstance(index, slice):
      raise ValueError(f'Only slicing is supported, got index {index!r}')
    return ClientDataset(
      slice_examples(self.raw_examples, index), self.preprocessor
    )

  def all_examples(self) -> Examples:
    """Every example, preprocessed."""
    return self.preprocessor(self.raw_examples)

  def batch(self, hparams=None, **kwargs) -> Iterable[Examples]:
    """Batches in order; the last may be smaller (or dropped with
    ``drop_remainder``).

    Args:
      hparams: an object with ``batch_size`` / ``drop_remainder``.
      **kwargs: the same fields, overriding ``hparams``.

    Returns:
      A re-iterable of preprocessed batches.
    """
    s = _hparams(hparams, kwargs, {'batch_size': None, 'drop_remainder': False})
    b, n = int(s['batch_size']), len(self)

    def batches():
      for start in range(0, n, b):
        if start + b <= n or not s['drop_remainder']:
          yield self.preprocessor(
            slice_examples(self.raw_examples, slice(start, start + b))
          )

    return _View(batches)

  def padded_batch(self, hparams=None, **kwargs) -> Iterable[Examples]:
    """Batches in order, each with ``EXAMPLE_MASK_KEY``; the last padded
    (zeros, mask False) to ``batch_size`` halved while the half still holds
    it, at most ``num_batch_size_buckets - 1`` times.

    Args:
      hparams: an object with ``batch_size`` / ``num_batch_size_buckets``.
      **kwargs: the same fields, overriding ``hparams``.

    Returns:
      A re-iterable of preprocessed, masked batches.
    """
    s = _hparams(hparams, kwargs, PADDED_BATCH)
    b, n = int(s['batch_size']), len(self)
    last = final_batch_size(n, b, int(s['num_batch_size_buckets']))

    def batches():
      for start in range(0, n, b):
        got = self.preprocessor(
          slice_examples(self.raw_examples, slice(start, start + b))
        )
        if start + b <= n:
          yield {**got, EXAMPLE_MASK_KEY: np.ones(b, np.bool_)}
        else:
          yield pad_examples(got, last)

    return _View(batches)

  def shuffle_repeat_batch(self, hparams=None, **kwargs) -> Iterable[Examples]:
    """Batches of exactly ``batch_size`` examples drawn by reshuffling the
    rows each pass (without replacement within a pass): ``num_epochs``
    passes (the last batch topped up from the next shuffle, or dropped
    with ``drop_remainder``), at most ``num_steps`` batches; both None:
    forever. ``seed`` fixes the order; ``skip_shuffle`` keeps the rows'.

    Args:
      hparams: an object with ``batch_size``, ``num_epochs``, ``num_steps``,
        ``drop_remainder``, ``seed``, ``skip_shuffle``.
      **kwargs: the same fields, overriding ``hparams``.

    Returns:
      A re-iterable of preprocessed batches.
    """
    s = _hparams(
      hparams,
      kwargs,
      {
        'batch_size': None,
        'num_epochs': 1,
        'num_steps': None,
        'drop_remainder': False,
        'seed': None,
        'skip_shuffle': False,
      },
    )
    b, n = int(s['batch_size']), len(self)
    steps = s['num_steps']
    if s['num_epochs'] is not None:
      total = n * int(s['num_epochs'])
      by_epochs = total // b if s['drop_remainder'] else -(-total // b)
      steps = by_epochs if steps is None else min(int(steps), by_epochs)

    def batches():
      rng = np.random.RandomState(s['seed'])
      order = np.arange(n, dtype=np.int32)
      used = n  # a shuffle before the first batch
      made = 0
      while steps is None or made < steps:
        picked = np.zeros(b, np.int32)
        filled = 0
        while filled < b:
          if used == n:
            if not s['skip_shuffle']:
              rng.shuffle(order)
            used = 0
          take = min(n - used, b - filled)
          picked[filled : filled + take] = order[used : used + take]
          used, filled = used + take, filled + take
        yield self.preprocessor(slice_examples(self.raw_examples, picked))
        made += 1

    if n == 0 and (steps is None or steps > 0):
      raise ValueError('shuffle_repeat_batch of a client with no examples')
    return _View(batches)


def _same_preprocessor_and_features(datasets: Iterable[ClientDataset]):
  """Yields the datasets, checking (as FedJAX) that they share one
  preprocessor object and one set of features."""
  preprocessor = features = None
  for dataset in datasets:
    if preprocessor is None:
      preprocessor = dataset.preprocessor
    elif dataset.preprocessor is not preprocessor:
      raise ValueError(
        'client_datasets should have the identical Preprocessor object, '
        f'got {preprocessor} vs {dataset.preprocessor}'
      )
    if features is None:
      features = set(dataset.raw_examples)
    elif features != set(dataset.raw_examples):
      raise ValueError(
        'client_datasets should have identical features, '
        f'got {features} vs {list(dataset.raw_examples)}'
      )
    yield dataset


def padded_batch_client_datasets(
  datasets: Iterable[ClientDataset], hparams=None, **kwargs
) -> Iterator[Examples]:
  """Batches of the examples of many clients, joined (FedJAX's
  ``padded_batch_client_datasets``): full batches across clients' edges,
  the last padded as ``ClientDataset.padded_batch`` pads it.

  Args:
    datasets: ClientDatasets with the same preprocessor object and features.
    hparams: an object with ``batch_size`` / ``num_batch_size_buckets``.
    **kwargs: the same fields, overriding ``hparams``.

  Yields:
    Preprocessed batches, each with ``EXAMPLE_MASK_KEY``.

  Raises:
    ValueError: two datasets with another preprocessor or other features.
  """
  s = _hparams(hparams, kwargs, PADDED_BATCH)
  b = int(s['batch_size'])
  full = np.ones([b], np.bool_)
  preprocessor = None
  buf, buf_size = [], 0  # pieces of fewer than b examples in all
  for dataset in _same_preprocessor_and_features(datasets):
    preprocessor = dataset.preprocessor
    size, examples = len(dataset), dataset.raw_examples
    if buf_size + size < b:
      buf.append(examples)
      buf_size += size
      continue
    start = 0
    if buf:
      start = b - buf_size
      buf.append(slice_examples(examples, slice(start)))
      yield attach_mask(preprocessor(concat_examples(buf)), full)
      buf, buf_size = [], 0
    while start + b < size:
      yield attach_mask(
        preprocessor(slice_examples(examples, slice(start, start + b))), full
      )
      start += b
    if start < size:
      buf.append(slice_examples(examples, slice(start, size)))
      buf_size += size - start
  if buf:
    assert preprocessor is not None  # set by the dataset that filled buf
    yield pad_examples(
      preprocessor(concat_examples(buf)),
      final_batch_size(buf_size, b, int(s['num_batch_size_buckets'])),
    )


def buffered_shuffle(
  source: Iterable[Any], buffer_size: int, rng: np.random.RandomState
) -> Iterator[Any]:
  """One pass over ``source`` shuffled through a buffer of ``buffer_size``
  (FedJAX's order for the same ``rng``).

  Args:
    source: the items.
    buffer_size: items held in the buffer.
    rng: the source of the order.

  Yields:
    Every item once.
  """
  it = iter(source)
  buf = list(itertools.islice(it, buffer_size))
  rng.shuffle(buf)
  for item in it:
    out, buf[0] = buf[0], item
    j = rng.randint(buffer_size)
    if j < buffer_size - 1:
      buf[j], buf[0] = buf[0], buf[j]
    yield out
  yield from buf


def buffered_shuffle_batch_client_datasets(
  datasets: Iterable[ClientDataset],
  batch_size: int,
  buffer_size: int,
  rng: np.random.RandomState,
) -> Iterator[Examples]:
  """One pass over the examples of many clients, shuffled through a buffer
  of ``buffer_size`` examples, in batches of ``batch_size`` (the last may
  be smaller): FedJAX's ``buffered_shuffle_batch_client_datasets``.

  Args:
    datasets: ClientDatasets with the same preprocessor object and features.
    batch_size: examples per batch.
    buffer_size: examples in the shuffle buffer.
    rng: the source of the order.

  Yields:
    Preprocessed batches.

  Raises:
    ValueError: two datasets with another preprocessor or other features.
  """
  checked = iter(_same_preprocessor_and_features(datasets))
  first = next(checked, None)
  if first is None:
    return
  preprocessor = first.preprocessor

  def rows():
    for dataset in itertools.chain([first], checked):
      for i in range(len(dataset)):
        yield dataset.raw_examples, i

  buf = []
  for item in buffered_shuffle(rows(), buffer_size, rng):
    buf.append(item)
    if len(buf) == batch_size:
      yield preprocessor(
        concat_examples([slice_examples(e, slice(i, i + 1)) for e, i in buf])
      )
      buf = []
  if buf:
    yield preprocessor(
      concat_examples([slice_examples(e, slice(i, i + 1)) for e, i in buf])
    )
