"""FedJAX's federated data API over the population store.

FedJAX 0.0.17's ``<dataset>.load_data`` returns ``(train, test)``
``FederatedData``: clients kept by id (bytes), each a ``ClientDataset`` of
numpy examples (``{'x': ..., 'y': ...}``) batched by ``batch``,
``padded_batch`` (a ``'__mask__'`` feature, the final batch padded to one
of ``num_batch_size_buckets`` sizes) and ``shuffle_repeat_batch``. The data
set modules' ``load_data`` (``emnist``, ``shakespeare``, ``cifar100``)
return the same objects here, read from the population store the CLI
trains on (written once from the publisher's files, ``load_store``), so a
FedJAX user's cell runs with only the import changed, and ``.store`` hands
the same clients to this project's rounds.

The batching follows FedJAX's documented behaviour
(``fedjax/core/client_datasets.py``): the same batches, masks and final
batch sizes, and for a given ``seed`` the same shuffled order
(``numpy.random.RandomState``), so numbers computed either way agree.
"""

import dataclasses
import itertools
from typing import Callable, Dict, Iterable, Iterator, Optional, Sequence, Tuple

import numpy as np

__all__ = ['ClientDataset', 'EXAMPLE_MASK_KEY', 'FederatedData', 'fedjax_targets',
           'HELD_OUT_PREFIX', 'load', 'splits', 'xy']

#: The bool feature ``padded_batch`` adds: True for an example, False for padding.
EXAMPLE_MASK_KEY = '__mask__'

Examples = Dict[str, np.ndarray]


def _settings(hparams, kwargs: dict, defaults: dict) -> dict:
  """FedJAX's two calling forms: an hparams object (any object with the
  fields, e.g. ``fedjax.PaddedBatchHParams``), overridden by keywords."""
  got = dict(defaults)
  if hparams is not None:
    fields = (dataclasses.asdict(hparams) if dataclasses.is_dataclass(hparams)
              else dict(vars(hparams)))
    got.update({k: v for k, v in fields.items() if k in defaults})
  unknown = set(kwargs) - set(defaults)
  if unknown:
    raise TypeError(f'unexpected batching arguments {sorted(unknown)}; expected {sorted(defaults)}')
  got.update(kwargs)
  if got.get('batch_size') is None or int(got['batch_size']) < 1:
    raise ValueError(f'batch_size must be a positive integer, got {got.get("batch_size")!r}')
  return got


def _size(examples: Examples) -> int:
  sizes = {len(v) for v in examples.values()}
  if len(sizes) > 1:
    raise ValueError(f'examples with different numbers of rows: '
                     f'{ {k: len(v) for k, v in examples.items()} }')
  return sizes.pop() if sizes else 0


def _rows(examples: Examples, index) -> Examples:
  return {k: v[index] for k, v in examples.items()}


def _final_batch_size(size: int, batch_size: int, buckets: int) -> int:
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
    preprocessor: applied to every batch (``FederatedData.preprocess_batch``).
  """

  def __init__(self, raw_examples: Examples,
               preprocessor: Callable[[Examples], Examples] = lambda e: e):
    _size(raw_examples)
    self.raw_examples = raw_examples
    self.preprocessor = preprocessor

  def __len__(self) -> int:
    return _size(self.raw_examples)

  def __getitem__(self, index: slice) -> 'ClientDataset':
    """The examples of a slice of rows, as a ClientDataset."""
    if not isinstance(index, slice):
      raise ValueError(f'Only slicing is supported, got index {index!r}')
    return ClientDataset(_rows(self.raw_examples, index), self.preprocessor)

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
    s = _settings(hparams, kwargs, {'batch_size': None, 'drop_remainder': False})
    b, n = int(s['batch_size']), len(self)

    def batches():
      for start in range(0, n, b):
        if start + b <= n or not s['drop_remainder']:
          yield self.preprocessor(_rows(self.raw_examples, slice(start, start + b)))
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
    s = _settings(hparams, kwargs, {'batch_size': None, 'num_batch_size_buckets': 1})
    b, n = int(s['batch_size']), len(self)
    last = _final_batch_size(n, b, int(s['num_batch_size_buckets']))

    def batches():
      for start in range(0, n, b):
        got = self.preprocessor(_rows(self.raw_examples, slice(start, start + b)))
        rows = min(b, n - start)
        size = b if start + b <= n else last
        padded = {k: np.concatenate([v, np.zeros((size - rows,) + v.shape[1:], v.dtype)])
                  if size > rows else v for k, v in got.items()}
        padded[EXAMPLE_MASK_KEY] = np.arange(size) < rows
        yield padded
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
    s = _settings(hparams, kwargs, {'batch_size': None, 'num_epochs': 1, 'num_steps': None,
                                    'drop_remainder': False, 'seed': None,
                                    'skip_shuffle': False})
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
          picked[filled:filled + take] = order[used:used + take]
          used, filled = used + take, filled + take
        yield self.preprocessor(_rows(self.raw_examples, picked))
        made += 1
    if n == 0 and (steps is None or steps > 0):
      raise ValueError('shuffle_repeat_batch of a client with no examples')
    return _View(batches)


def _buffered_shuffle(items: Iterator, buffer_size: int, rng: np.random.RandomState):
  """One pass over ``items`` shuffled through a buffer of ``buffer_size``
  (FedJAX's order for the same generator)."""
  buf = list(itertools.islice(items, buffer_size))
  rng.shuffle(buf)
  for item in items:
    out, buf[0] = buf[0], item
    j = rng.randint(buffer_size)
    if j < buffer_size - 1:
      buf[j], buf[0] = buf[0], buf[j]
    yield out
  yield from buf


def _as_bytes(client_id) -> bytes:
  return client_id if isinstance(client_id, bytes) else str(client_id).encode('utf-8')


class FederatedData:
  """One split of a population store's clients, by id (FedJAX's
  ``FederatedData``; ids are bytes as there, str accepted).

  Args:
    store: a ``core.population.store.PopulationStore``.
    split: ``train``, ``val`` or ``test``.
    rows: the store's rows in this view, in order.
    features: ``(x, y) -> {feature: array}`` of a client's examples.
    preprocess_client: ``(client_id, examples) -> examples`` functions.
    preprocess_batch: ``examples -> examples`` functions.
    size_rows: the rows ``client_sizes`` lists, in its order (None: ``rows``).
    held_out_prefix: the prefix the store gives held-out test clients' ids
      (``test/<id>``), left out of the ids this view shows: its publisher's.
  """

  def __init__(self, store, split: str, rows: Sequence[int],
               features: Callable[[np.ndarray, np.ndarray], Examples],
               preprocess_client: Tuple[Callable, ...] = (),
               preprocess_batch: Tuple[Callable, ...] = (),
               size_rows: Optional[Sequence[int]] = None, held_out_prefix: str = ''):
    self._store = store
    self._split = split
    self._rows = np.asarray(rows, np.int64)
    # client_sizes() in the base's order (FedJAX's SubsetFederatedData)
    self._size_rows = self._rows if size_rows is None else np.asarray(size_rows, np.int64)
    self._features = features
    self._client_fns = tuple(preprocess_client)
    self._batch_fns = tuple(preprocess_batch)
    self._prefix = held_out_prefix
    ids = store.client_ids
    self._ids = [self._shown(ids[i]) for i in self._rows]
    self._row_of = dict(zip(self._ids, self._rows.tolist()))

  def _shown(self, store_id) -> bytes:
    """A store id as this view shows it (a held-out client's publisher id)."""
    if self._prefix and str(store_id).startswith(self._prefix):
      store_id = str(store_id)[len(self._prefix):]
    return _as_bytes(store_id)

  def _with(self, **changes) -> 'FederatedData':
    args = dict(store=self._store, split=self._split, rows=self._rows, features=self._features,
                preprocess_client=self._client_fns, preprocess_batch=self._batch_fns,
                size_rows=self._size_rows, held_out_prefix=self._prefix)
    args.update(changes)
    return FederatedData(**args)

  @property
  def store(self):
    """The population store of these clients alone (``store.subset``):
    what this project's rounds train on (``store.padded()``,
    ``fedjax_personal.data.to_device``)."""
    return self._store.subset([self._store.client_ids[i] for i in self._rows], 'of a slice')

  def num_clients(self) -> int:
    """How many clients."""
    return len(self._ids)

  def client_ids(self) -> Iterator[bytes]:
    """The clients' ids (bytes), in the store's order."""
    return iter(self._ids)

  def client_sizes(self) -> Iterator[Tuple[bytes, int]]:
    """(id, number of examples) of every client (a subset's in its base's order, as FedJAX's)."""
    counts, ids = self._store.counts[self._split], self._store.client_ids
    return ((self._shown(ids[r]), int(counts[r])) for r in self._size_rows.tolist())

  def client_size(self, client_id) -> int:
    """A client's number of examples (KeyError if it is not here)."""
    return int(self._store.counts[self._split][self._row(client_id)])

  def _row(self, client_id) -> int:
    try:
      return self._row_of[_as_bytes(client_id)]
    except KeyError:
      raise KeyError(client_id) from None

  def _client(self, row: int, client_id: bytes) -> ClientDataset:
    lo = int(self._store.offsets[self._split][row])
    hi = lo + int(self._store.counts[self._split][row])
    x, y, _ = self._store.arrays[self._split]
    examples = self._features(np.asarray(x[lo:hi]), np.asarray(y[lo:hi]))
    for fn in self._client_fns:
      examples = fn(client_id, examples)
    batch_fns = self._batch_fns

    def preprocess(e):
      for fn in batch_fns:
        e = fn(e)
      return e
    return ClientDataset(examples, preprocess)

  def get_client(self, client_id) -> ClientDataset:
    """One client's examples (KeyError if it is not here)."""
    return self._client(self._row(client_id), _as_bytes(client_id))

  def get_clients(self, client_ids: Iterable) -> Iterator[Tuple[bytes, ClientDataset]]:
    """(id, ClientDataset) for each id, in the order given (ids as given)."""
    for c in client_ids:
      yield c, self.get_client(c)

  def clients(self) -> Iterator[Tuple[bytes, ClientDataset]]:
    """(id, ClientDataset) of every client, in the store's order."""
    for c, r in zip(self._ids, self._rows.tolist()):
      yield c, self._client(r, c)

  def shuffled_clients(self, buffer_size: int,
                       seed: Optional[int] = None) -> Iterator[Tuple[bytes, ClientDataset]]:
    """Every client, pass after pass forever, each pass shuffled through a
    buffer of ``buffer_size`` clients (``seed`` fixes the order)."""
    rng = np.random.RandomState(seed)
    while True:
      for c, r in _buffered_shuffle(zip(self._ids, self._rows.tolist()), buffer_size, rng):
        yield c, self._client(r, c)

  def slice(self, start=None, stop=None) -> 'FederatedData':
    """The clients whose ids are >= ``start`` and < ``stop`` (bytes order;
    None: unbounded)."""
    lo = None if start is None else _as_bytes(start)
    hi = None if stop is None else _as_bytes(stop)
    inside = lambda c: (lo is None or c >= lo) and (hi is None or c < hi)
    ids = self._store.client_ids
    return self._with(rows=[r for c, r in zip(self._ids, self._rows.tolist()) if inside(c)],
                      size_rows=[r for r in self._size_rows.tolist()
                                 if inside(self._shown(ids[r]))])

  def subset(self, client_ids: Iterable) -> 'FederatedData':
    """The clients named ``client_ids``, as FedJAX's ``SubsetFederatedData``
    makes them: each id once, iterated in sorted order (``client_ids``,
    ``clients``, ``shuffled_clients``), ``client_sizes`` in this view's
    order; an id not here is a ValueError naming up to 10.

    Args:
      client_ids: the ids (bytes, or str).

    Returns:
      The ``FederatedData`` of those clients.

    Raises:
      ValueError: ids not among this view's clients.
    """
    wanted = {_as_bytes(c) for c in client_ids}
    missing = wanted.difference(self._ids)
    if missing:
      raise ValueError('Some client ids are not in the base FederatedData, showing up to 10: '
                       f'{sorted(missing)[:10]}')
    return self._with(rows=[self._row_of[c] for c in sorted(wanted)],
                      size_rows=[r for c, r in zip(self._ids, self._rows.tolist())
                                 if c in wanted])

  def preprocess_client(self, fn: Callable[[bytes, Examples], Examples]) -> 'FederatedData':
    """A view whose clients' examples pass through ``fn(client_id, examples)``."""
    return self._with(preprocess_client=self._client_fns + (fn,))

  def preprocess_batch(self, fn: Callable[[Examples], Examples]) -> 'FederatedData':
    """A view whose batches pass through ``fn(examples)``."""
    return self._with(preprocess_batch=self._batch_fns + (fn,))


def xy(x: np.ndarray, y: np.ndarray) -> Examples:
  """A client's examples as ``{'x', 'y'}`` (FedJAX's feature names).

  Args:
    x: a client's inputs.
    y: its targets.

  Returns:
    ``{'x': x, 'y': y}``.
  """
  return {'x': x, 'y': y}


#: The prefix of a held-out test client's id in the population store
#: (``cifar100`` and ``stackoverflow`` readers: ``test/<its id>``).
HELD_OUT_PREFIX = 'test/'


def splits(store, features: Callable[[np.ndarray, np.ndarray], Examples] = xy
           ) -> Tuple[FederatedData, FederatedData]:
  """``(train, test)`` of a population store: the clients that train
  (every one but the held-out ``eval_only``), and the clients with test
  examples (as a publisher's test file lists them; held-out test clients
  by their publisher's ids, ``test/<id>`` in the store shown as ``<id>``:
  TFF's CIFAR-100 test clients ``0``..``99``).

  Args:
    store: a ``PopulationStore``.
    features: ``(x, y) -> examples`` of a client.

  Returns:
    ``(train, test)`` ``FederatedData``.
  """
  trained = np.arange(store.num_trained)
  tested = np.flatnonzero(np.asarray(store.counts['test']) > 0)
  return (FederatedData(store, 'train', trained, features),
          FederatedData(store, 'test', tested, features, held_out_prefix=HELD_OUT_PREFIX))


def fedjax_targets(x: np.ndarray, y: np.ndarray) -> Examples:
  """Sequence examples as FedJAX's ``{'x', 'y'}``: padded targets PAD (0)
  there, ``IGNORE`` (-1) in the store.

  Args:
    x: a client's token rows.
    y: its targets (``IGNORE`` where padded).

  Returns:
    ``{'x': x, 'y': y}`` with padded targets PAD.
  """
  from fedjax_personal.datasets.natural_data import IGNORE, PAD
  return {'x': x, 'y': np.where(y == IGNORE, PAD, y)}


def load(dataset: str, mode: str = 'sqlite', cache_dir=None, num_clients=None,
         download: bool = True, data_dir=None, features=xy, **options
         ) -> Tuple[FederatedData, FederatedData]:
  """``(train, test)`` of a natural data set, as its module's
  ``load_data`` returns them (``splits``), from its population store
  (``load_store``: written once from the files, then reused).

  Args:
    dataset: the ``--dataset`` name.
    mode: FedJAX's; only ``'sqlite'`` (the published files) is read.
    cache_dir: FedJAX's name for where its files are: looked up there
      first (``data_dir``, the older name, is the same).
    num_clients: the first N clients of the files (None: all).
    download: fetch missing files from their published URL (FedJAX always
      does; False: a missing file is one line naming it).
    data_dir: the same as ``cache_dir``.
    features: ``(x, y) -> examples`` of a client.
    **options: the data set's options by their flags' names (``seq_len``,
      ``emnist_pixels``, ...; ``registry.OPTIONS``).

  Returns:
    The train and test ``FederatedData``.
  """
  from fedjax_personal import datasets as datasets_lib
  cls = datasets_lib.registry.options_class(dataset)
  fields = datasets_lib.config.option_flags(cls)
  if mode != 'sqlite':
    raise ValueError(f'Unsupported mode={mode!r}: the published files are read (mode=\'sqlite\')')
  if cache_dir is not None and data_dir is not None and cache_dir != data_dir:
    raise ValueError('give cache_dir or data_dir (the same folder), not both')
  folder = cache_dir if cache_dir is not None else data_dir
  cfg = datasets_lib.DataConfig(dataset=dataset, partition='natural', num_clients=num_clients,
                                data_dir=folder, download=download,
                                options=cls(**{fields[k]: v for k, v in options.items()
                                               if v is not None}))
  return splits(datasets_lib.load_store(cfg), features)
