"""What every natural data set's reader returns, and the pieces they share.

A natural data set is read client by client from its published files
(one module each: ``emnist``, ``shakespeare``, ``stackoverflow``,
``cifar100``, ``leaf``, ``gldv2``; the registry is ``registry``). Each
module's ``read_clients`` returns a ``NaturalData``: the clients' ids and
``(x, y)`` train and test examples as the files split them, streamed.

Padded target positions of sequences are ``IGNORE`` (-1): left out of the
loss and the accuracy (``core.training.per_example_stats``). Clients without
test examples are trained and left out of the test statistics (counted).
"""

import collections
import dataclasses
from typing import Callable, Iterator, List, Optional

import numpy as np

from fedjax_personal.datasets import sqlite_formats
from fedjax_personal.errors import (
  ConfigError,
  DataError,
  SettingError,
  user_frame,
)

__all__ = [
  'check_pair',
  'checked',
  'client_id',
  'converted',
  'fedjax_splits',
  'IGNORE',
  'listed',
  'MAX_CLASSES',
  'NaturalData',
  'take',
]


IGNORE = -1  # a padded target position
PAD, BOS, EOS = 0, 1, 2  # token ids of the sequence data sets (FedJAX's)


@dataclasses.dataclass
class NaturalData:
  """Per-client examples as the files split them, read client by client.

  Attributes:
    stream: ``stream()`` yields ``(client_id, (x, y) train, (x, y) test)``
      (and a fourth, ``(x, y)`` validation, where the publisher takes one
      out of the test set) per client in the file's order, reading as it goes (a
      population larger than memory is written to the population store this
      way).
    num_clients: clients it yields.
    num_classes: output classes.
    total_clients: clients in the file (before --num_clients).
    files: the files read (their contents' SHA-256 are the store's identity).
    split_by_fraction: True when the file's test split holds other clients,
      so the train clients' examples are split with --test_fraction.
    eval_only: how many clients at the end of ``stream`` have only test
      examples (held-out clients, evaluated and never trained).
  """

  stream: Callable[[], Iterator[tuple]]
  num_clients: int
  num_classes: int
  total_clients: int
  files: List[str] = dataclasses.field(default_factory=list)
  split_by_fraction: bool = False
  eval_only: int = 0

  def _all(self):
    if not hasattr(self, '_cache'):
      self._cache = list(self.stream())
    return self._cache

  @property
  def train(self) -> List[tuple]:
    return [item[1] for item in self._all()]

  @property
  def test(self) -> List[tuple]:
    return [item[2] for item in self._all()]

  @property
  def client_ids(self) -> List[str]:
    return [client_id(item[0]) for item in self._all()]


def listed(ids, train, test):
  """A ``stream`` over clients already in memory.

  Args:
    ids: client ids.
    train: each client's ``(x, y)``.
    test: each client's test ``(x, y)``.

  Returns:
    ``stream()``, as ``NaturalData.stream``.
  """
  return lambda: iter(zip(ids, train, test or [None] * len(train)))


def take(total: int, num_clients: Optional[int], dataset: str) -> int:
  """How many of ``total`` clients to read (``--num_clients``; None: all).

  Args:
    total: the clients in the file.
    num_clients: ``--num_clients`` (None: all).
    dataset: the data set (in messages).

  Returns:
    The count.
  """
  if num_clients is None:
    return total
  if num_clients > total:
    raise ConfigError(
      'num_clients',
      f'{dataset} has {total:,} clients; --num_clients='
      f'{num_clients} is too many',
    )
  return num_clients


def client_id(c) -> str:
  """A client id as text (SQLite files may hold bytes).

  Args:
    c: an id (str or bytes).

  Returns:
    The id as str (bytes decoded as UTF-8).
  """
  return c.decode('utf-8', 'replace') if isinstance(c, bytes) else str(c)


def fedjax_splits(
  dataset, train_path, test_path, num_clients, convert
) -> NaturalData:
  """Train clients of a FedJAX file (first N) with their test examples,
  streamed: each train client's test record is looked up as it is read.

  Args:
    dataset: the data set's name (in messages).
    train_path: the train file.
    test_path: the test file.
    num_clients: the first N clients (None: all).
    convert: ``examples -> (x, y)``.

  Returns:
    The clients as a ``NaturalData``.
  """
  total = sqlite_formats.fedjax_num_clients(train_path)
  n = take(total, num_clients, dataset)
  empty = lambda like: tuple(
    np.zeros((0,) + a.shape[1:], a.dtype) for a in like
  )

  def stream():
    wanted: collections.deque = collections.deque()

    def ids():
      while True:
        yield wanted.popleft()

    tests = sqlite_formats.read_fedjax(test_path, client_ids=ids())
    for cid, ex in sqlite_formats.read_fedjax(train_path, limit=n):
      train = converted(convert, ex, train_path)
      wanted.append(cid)
      test_ex = next(tests)[1]
      yield (
        cid,
        train,
        (converted(convert, test_ex, test_path) if test_ex else empty(train)),
      )

  return NaturalData(stream, n, 0, total, [str(train_path), str(test_path)])


def converted(convert, examples, path):
  """``convert(examples)``, a malformed record a DataError naming ``path``.

  Args:
    convert: ``examples -> (x, y)``.
    examples: a client's decoded record.
    path: the file it came from.

  Returns:
    ``convert(examples)``.
  """
  try:
    return convert(examples)
  except (KeyError, ValueError, TypeError, IndexError) as e:
    raise DataError(
      f'{path}: a client record lacks the expected features '
      f'({type(e).__name__}: '
      f'{e})'
    ) from None


#: The most classes a data set may have: its output layer and every score
#: over classes are [., num_classes] (GLDv2's 2,028 and Stack Overflow's
#: 10,004 are far below; a label of 10**9 read as a class is not a data set).
MAX_CLASSES = 1_000_000


def checked(dataset: str, nat: NaturalData) -> NaturalData:
  """``nat`` with its clients checked as they are read (``check_pair``): a
  data set that enters the run is what the engine assumes, or one line
  naming the data set, the client and the first bad value (exit 2), before
  anything is built or compiled.

  Args:
    dataset: its ``--dataset`` name.
    nat: what its reader returned.

  Returns:
    The ``NaturalData``, its ``stream`` checking each client.

  Raises:
    ConfigError: a number of classes that is not a positive integer of at
      most ``MAX_CLASSES``.
  """
  classes = nat.num_classes
  if isinstance(classes, (bool, np.bool_)) or not isinstance(
    classes, (int, np.integer)
  ):
    raise ConfigError(
      'dataset',
      f'{dataset}: its reader gave num_classes={classes!r}, not an integer',
    )
  if not 1 <= classes <= MAX_CLASSES:
    raise ConfigError(
      'dataset',
      f'{dataset}: {int(classes):,} classes, outside [1, {MAX_CLASSES:,}]',
    )
  inner = nat.stream

  def stream():
    spec: dict = {}
    for i, item in enumerate(_read(dataset, inner)):
      if not isinstance(item, tuple) or len(item) not in (3, 4):
        got = (
          f'a {len(item)}-tuple'
          if isinstance(item, tuple)
          else type(item).__name__
        )
        raise ConfigError(
          'dataset',
          f'{dataset}: its reader yielded {got} for its client #{i}, not '
          '(client_id, (x, y) train, (x, y) test[, (x, y) validation])',
        )
      cid, *parts = item
      for split, part in zip(('train', 'test', 'validation'), parts):
        if part is not None:
          check_pair(dataset, client_id(cid), split, part, int(classes), spec)
      yield item

  return dataclasses.replace(nat, stream=stream)


def _read(dataset: str, stream) -> Iterator:
  """``stream()``'s items; a failure of the reader's own code (a file it
  cannot read, its own bug) one line naming the data set and where."""
  it = iter(stream())
  while True:
    try:
      item = next(it)
    except StopIteration:
      return
    except (SettingError, KeyboardInterrupt, MemoryError):
      raise
    except Exception as e:  # noqa: BLE001 -- the reader's own failure
      where = user_frame(e)
      raise ConfigError(
        'dataset',
        f'{dataset}: its reader failed'
        + (f' at {where}' if where else '')
        + f': {type(e).__name__}: {e}',
      ) from None
    yield item


def check_pair(
  dataset: str, cid: str, split: str, part, num_classes: int, spec: dict
) -> None:
  """One client split ``(x, y)``: as many inputs as targets, numeric and
  finite inputs of the data set's one dtype and shape (``spec`` holds the
  first client's), integer targets in [0, num_classes) (-1 marks a padded
  position of a sequence target).

  Args:
    dataset: the data set's name (for the message).
    cid: the client's id.
    split: 'train', 'test' or 'validation'.
    part: ``(x, y)``.
    num_classes: the data set's classes.
    spec: the first client's dtypes and shapes (filled on the first call).

  Returns:
    None.

  Raises:
    ConfigError naming the data set, the client and the first bad value.
  """
  x, y = (np.asarray(a) for a in part)
  where = f'{dataset}: client {cid!r} ({split})'
  if x.ndim == 0 or y.ndim == 0 or len(x) != len(y):
    raise ConfigError(
      'dataset',
      f'{where}: {len(x) if x.ndim else "no"} inputs but '
      f'{len(y) if y.ndim else "no"} targets',
    )
  for what, a in (('inputs', x), ('targets', y)):
    if a.dtype.kind not in 'biuf':
      raise ConfigError(
        'dataset',
        f'{where}: its {what} are {a.dtype} ({a.ravel()[:1]!r}...), '
        'not numbers',
      )
  if x.dtype.kind == 'f' and x.size and not np.isfinite(x).all():
    at = np.unravel_index(np.argmin(np.isfinite(x)), x.shape)
    raise ConfigError(
      'dataset', f'{where}: input {at[0]} holds {x[at]} (inputs must be finite)'
    )
  if (
    y.size
    and y.dtype.kind == 'f'
    and not (np.isfinite(y).all() and np.all(y == np.round(y)))
  ):
    i = int(
      np.argmax(
        ~(np.isfinite(y) & (y == np.round(y))).reshape(len(y), -1).any(1)
      )
    )
    raise ConfigError(
      'dataset',
      f'{where}: target {i} is {y[i]}, not a class (targets must be integers)',
    )
  for what, a in (('inputs', x), ('targets', y)):
    key = (a.dtype.str, a.shape[1:])
    if spec.setdefault(what, key) != key:
      raise ConfigError(
        'dataset',
        f'{where}: {what} of dtype {a.dtype} and shape '
        f"{a.shape[1:]}; the first client's are {np.dtype(spec[what][0])} and "
        f'{spec[what][1]} (one dtype and shape a data set)',
      )
  if not y.size:
    return
  low = -1 if y.ndim > 1 else 0  # -1: a padded position of a sequence target
  bad = (y < low) | (y >= num_classes)
  if bad.any():
    i = int(np.argmax(bad.reshape(len(y), -1).any(1)))
    raise ConfigError(
      'dataset',
      f'{where}: target {i} is {y[i]}, outside [0, {num_classes}) '
      f"(the data set's {num_classes} classes)",
    )
