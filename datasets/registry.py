"""The data sets: the registry of their readers and of their own options.

Natural data sets keep one client per writer (``emnist``), speaking role
(``shakespeare``), user (``stackoverflow``, ``leaf:<name>``, ``gldv2``) or
Pachinko-allocation client (``cifar100``), with the files' own train/test
split. Each is a module with a reader ``read_clients(num_clients=None,
data_dir=None, download=False, **its options)`` returning a
``natural_data.NaturalData`` (what the population store is written from)
and FedJAX's ``load_data`` (``(train, test)`` federated data over that
store, ``federated``). ``LOADERS`` maps the ``--dataset`` names to the
readers; ``OPTIONS`` maps a data set to its options class (``options``:
declared in its module, its flags generated from it); ``register`` adds a
data set of your own files with its options (docs/add_a_data_set.md).
"""

import dataclasses
import hashlib
import inspect
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Protocol, Type

import numpy as np

from fedjax_personal import user_reads
from fedjax_personal.datasets import sources, tfds_loader
from fedjax_personal.datasets.natural_data import (
  MAX_CLASSES,
  NaturalData,
  checked,
  listed,
  take,
)
from fedjax_personal.datasets.options import DataOptions, NoOptions
from fedjax_personal.errors import ConfigError, caller_file
from fedjax_personal.hparams import check_name, claim_flags

__all__ = [
  'DATASETS',
  'HELD_OUT_ONLY',
  'is_file_dataset',
  'is_known',
  'LEAF_PREFIX',
  'LEAF_READER',
  'load',
  'loader_code',
  'LOADERS',
  'names',
  'option_classes',
  'options_class',
  'OPTIONS',
  'OWNERS',
  'READER_ARGUMENTS',
  'ReadClients',
  'RESERVED_PREFIXES',
  'reader_options',
  'register',
  'register_arrays',
  'register_builtin',
  'register_pool',
  'Pool',
  'POOL_ARGUMENTS',
  'pool_of',
  'POOLS',
  'TFDS_POOL',
  'SplitByFraction',
]


#: The built-in --dataset names; ``leaf:<name>`` is accepted too
#: (``LEAF_PREFIX``), and every name ``register`` adds.
DATASETS = (
  'mnist',
  'digits',
  'cifar10',
  'cifar100',
  'emnist',
  'emnist_digits',
  'shakespeare',
  'stackoverflow',
  'gldv2',
  'tinyshakespeare',
  'synthetic',
  'tfds:mnist',
  'tfds:emnist',
  'tfds:cifar10',
  'tfds:cifar100',
  'tfds:tiny_shakespeare',
)
#: Data sets of held-out clients only (read by FedJAX's ``load_data``), none
#: to train: why the command refuses them.
HELD_OUT_ONLY = {
  'stackoverflow_held_out': (
    'stackoverflow_held_out holds held-out users only, none to train (the '
    'held_out value of '
    'datasets.stackoverflow.load_data); train on --dataset=stackoverflow'
  )
}


#: --dataset name -> its reader (``read_clients``); the built-in data sets'
#: are entered by the package (``datasets/builtin.py``: ``register_builtin``),
#: yours by ``register``.
LOADERS: Dict[str, Callable[..., NaturalData]] = {}
#: --dataset name -> its options class (``options.DataOptions``); a data set
#: not listed has none (``NoOptions``).
OPTIONS: Dict[str, Type[DataOptions]] = {}
#: LEAF's reader, ``(name, num_clients, data_dir) -> NaturalData`` of
#: ``leaf:<name>`` (entered by the package as the built-in readers are).
LEAF_READER: List[Callable[..., NaturalData]] = []
LEAF_PREFIX = 'leaf:'
#: Names the loaders route by their prefix: never a registered data set's.
RESERVED_PREFIXES = (LEAF_PREFIX, 'tfds:')
#: Who registered each data set added by ``register`` (its file).
OWNERS: Dict[str, str] = {}


class ReadClients(Protocol):
  """What ``register`` takes: a data set's reader.

  It is given ``num_clients`` (the first N clients; None: all), ``data_dir``
  (where its files are; None: the lookup of ``local_files``), ``download``
  (fetch missing files), and each of ``seed`` and its options class's
  fields that its signature names (``READER_ARGUMENTS``); it returns a
  ``natural_data.NaturalData``. A parameter it would never be given (a
  misspelled option) is refused at registration.
  """

  def __call__(self, *args: Any, **options: Any) -> NaturalData:
    """``(num_clients=None, data_dir=None, download=False, [seed], [its
    options' fields]) -> NaturalData`` (a reader names the options it reads)."""
    ...


def _claimed(name: str, options: Optional[Type[DataOptions]]) -> str:
  """The file registering ``name`` (``caller_file``), once the name is free
  to it (no built-in or held-out name, no loaders' prefix, no data set
  another file registered) and ``options`` is a ``DataOptions`` class."""
  owner = caller_file()
  if name in DATASETS or name in HELD_OUT_ONLY:
    raise ValueError(
      f'{name!r} is a built-in data set; register yours under another name'
    )
  if name.startswith(RESERVED_PREFIXES):
    raise ValueError(
      f'{name!r}: names starting {" or ".join(RESERVED_PREFIXES)} are the '
      "loaders' own (LEAF's JSON, TFDS); register yours under another name"
    )
  check_name('data set', name)
  if (name in LOADERS or name in POOLS) and OWNERS.get(name, owner) != owner:
    raise ValueError(
      f'a data set named {name!r} is registered already, by {OWNERS[name]}'
    )
  if options is not None and not (
    isinstance(options, type) and issubclass(options, DataOptions)
  ):
    raise TypeError(
      f'the options of {name!r} must be a DataOptions dataclass, got '
      f'{options!r}'
    )
  claim_flags(options, f'an option of --dataset={name}')
  return owner


def register(
  name: str,
  read_clients: ReadClients,
  options: Optional[Type[DataOptions]] = None,
) -> None:
  """Adds a natural data set read from files: ``--dataset=<name>`` then
  reads it through ``read_clients(num_clients=None, data_dir=None,
  download=False, ...)`` into the population store, passing the options its
  signature names: ``options``' fields (a ``DataOptions`` dataclass of
  ``hparam`` fields, whose flags the command generates) and ``seed``.

  Args:
    name: the ``--dataset`` name.
    read_clients: the reader.
    options: the data set's options class (None: none).

  Returns:
    None.
  """
  owner = _claimed(name, options)
  _check_reader(name, read_clients, options or NoOptions)
  LOADERS[name] = read_clients
  OPTIONS[name] = options or NoOptions
  OWNERS[name] = owner


def register_builtin(
  name: str,
  read_clients: Optional[Callable[..., NaturalData]] = None,
  options: Optional[Type[DataOptions]] = None,
  pool: Optional['Pool'] = None,
) -> None:
  """A built-in data set's entry (``DATASETS``, ``HELD_OUT_ONLY``), made
  by the package as it is imported: its reader of clients from its files,
  its ``Pool`` (read whole in memory), or both (CIFAR-100: its clients under
  ``--partition=natural``, else its pool), and its options class.

  Args:
    name: a built-in ``--dataset`` name.
    read_clients: its reader of clients, or None.
    options: its options class, or None.
    pool: its ``Pool``, or None.

  Returns:
    None.
  """
  if name not in DATASETS and name not in HELD_OUT_ONLY:
    raise ValueError(
      f'{name!r} is not a built-in data set; add yours with register'
    )
  if read_clients is not None:
    LOADERS[name] = read_clients
  if options is not None:
    claim_flags(options, f'an option of --dataset={name}')
    OPTIONS[name] = options
  if pool is not None:
    POOLS[name] = pool


@dataclasses.dataclass(frozen=True)
class Pool:
  """A registered data set read whole in memory.

  A data set read whole in memory: a pool of examples partitioned into
  clients by ``--partition`` (``kind='pool'``: ``read(...) -> (x, y,
  num_classes)``), or clients its reader makes itself, each client's
  examples then split with ``--test_fraction`` (``kind='clients'``:
  ``read(...) -> ([x_i], [y_i], num_classes)``: Synthetic, Tiny
  Shakespeare). ``read`` is given what its signature names of
  ``POOL_ARGUMENTS``; ``--data_dir`` and ``--download`` apply when it takes
  them.

  Attributes:
    read: the reader.
    kind: ``'pool'`` or ``'clients'``.
  """

  read: Callable[..., Any]
  kind: str = 'pool'

  def takes(self, name: str) -> bool:
    """Whether ``read`` takes ``name`` (e.g. ``data_dir``, ``download``).

    Args:
      name: one of ``POOL_ARGUMENTS``.

    Returns:
      True when its signature names it.
    """
    return name in inspect.signature(self.read).parameters

  def __call__(self, **given) -> Any:
    """``read`` given what its signature names of ``given``.

    Args:
      **given: ``POOL_ARGUMENTS`` by name.

    Returns:
      What ``read`` returns.
    """
    return self.read(**_taken_by(self.read, given))


#: What a pool's reader may be given (``Pool``): the data set's name and
#: options, where its files are, whether to download them, the examples to
#: keep (a TFDS pool reads no more), and for ``kind='clients'`` the clients
#: and the generator that draws them.
POOL_ARGUMENTS = (
  'name',
  'options',
  'data_dir',
  'download',
  'max_examples',
  'num_clients',
  'rng',
)
#: --dataset name -> its ``Pool`` (the built-in ones entered by the package,
#: yours by ``register_pool``); ``tfds:<name>`` reads TFDS's ``TFDS_POOL``.
POOLS: Dict[str, Pool] = {}
#: The pool of every ``tfds:<name>`` not in ``POOLS`` (entered by the package).
TFDS_POOL: List[Pool] = []


def pool_of(dataset: str) -> Optional[Pool]:
  """The ``Pool`` of ``dataset``, or None (a data set read client by client).

  Args:
    dataset: a ``--dataset`` name.

  Returns:
    The ``Pool``, or None.
  """
  if dataset in POOLS:
    return POOLS[dataset]
  if dataset.startswith('tfds:') and TFDS_POOL:
    return TFDS_POOL[0]
  return None


def register_pool(
  name: str,
  read: Callable[..., Any],
  kind: str = 'pool',
  options: Optional[Type[DataOptions]] = None,
) -> None:
  """Adds a data set read whole in memory: ``--dataset=<name>`` then reads
  it through ``read`` (``Pool``) and partitions it with ``--partition``
  (``kind='pool'``), or splits the clients ``read`` makes
  (``kind='clients'``).

  Args:
    name: the ``--dataset`` name.
    read: its reader, given what its signature names of ``POOL_ARGUMENTS``.
    kind: ``'pool'`` or ``'clients'``.
    options: its options class (None: none).

  Returns:
    None.
  """
  if kind not in ('pool', 'clients'):
    raise ValueError(
      f"pool {name!r}: kind must be 'pool' or 'clients', got {kind!r}"
    )
  owner = _claimed(name, options)
  try:
    params = inspect.signature(read).parameters
  except (TypeError, ValueError):
    raise TypeError(
      f'pool {name!r}: read must be a function, got {read!r}'
    ) from None
  for pname, p in params.items():
    if p.kind is not p.VAR_KEYWORD and pname not in POOL_ARGUMENTS:
      raise TypeError(
        f'pool {name!r}: read takes {pname!r}, which it is never given; it is '
        f'given {", ".join(POOL_ARGUMENTS)}'
      )
  POOLS[name] = Pool(read, kind)
  OPTIONS[name] = options or NoOptions
  OWNERS[name] = owner


#: What every reader may be given besides its options' fields (``load``).
READER_ARGUMENTS = ('num_clients', 'data_dir', 'download', 'seed')


def _check_reader(
  name: str, read_clients: Callable, options: Type[DataOptions]
) -> None:
  """Refuses a reader whose signature names something it is never given (a
  misspelled option would silently keep its default)."""
  try:
    params = inspect.signature(read_clients).parameters
  except (TypeError, ValueError):
    raise TypeError(
      f'data set {name!r}: read_clients must be a function, got '
      f'{read_clients!r}'
    ) from None
  if any(p.kind is p.VAR_KEYWORD for p in params.values()):
    return
  given = list(READER_ARGUMENTS) + [f.name for f in dataclasses.fields(options)]
  for pname, p in params.items():
    if p.kind is not p.VAR_POSITIONAL and pname not in given:
      raise TypeError(
        f'data set {name!r}: read_clients takes {pname!r}, which it is never '
        f'given; it is given {", ".join(given)}'
        + (
          ' (an option of its own: a field of its DataOptions class, '
          'register(name, read_clients, options=MyOptions))'
          if options is NoOptions
          else ''
        )
      )


@dataclasses.dataclass(frozen=True)
class SplitByFraction(NoOptions):
  """A registered data set of arrays split per client by fraction.

  A data set of arrays without a test split of its own: each client's
  examples are split with ``--test_fraction`` (and kept in memory: never a
  stored copy that could go stale)."""

  def files_split_test(self) -> bool:
    return False


def register_arrays(
  name: str, clients, test=None, *, num_classes: Optional[int] = None
) -> None:
  """A data set of arrays you have, in one call: ``--dataset=<name>`` then
  trains on them (``--import`` of the file that calls this, or a script
  that imports it before ``experiment_entry.run()``).

  The clients are FedJAX's ``InMemoryFederatedData`` shape,
  ``{client_id: {'x': array, 'y': array}}``, each client's rows its
  examples, or a function returning that (called each time the data set is
  loaded: arrays read from a file are read again, and a changed file is a
  new data set). With ``test`` (the same shape: each client's test
  examples) the clients are written once into a population store keyed by
  their contents (``loading.content_digest``); without, each client's
  examples are split with ``--test_fraction`` in memory every run.

  Args:
    name: the ``--dataset`` name.
    clients: ``{client_id: {'x', 'y'}}``, or a function returning it.
    test: the test examples in the same shape, or a function returning it
      (None: split with ``--test_fraction``).
    num_classes: the classes (None: the largest label + 1).

  Returns:
    None.
  """
  if num_classes is not None and (
    isinstance(num_classes, bool)
    or not isinstance(num_classes, (int, np.integer))
    or not 1 <= num_classes <= MAX_CLASSES
  ):
    raise ValueError(
      f'register_arrays({name!r}): num_classes must be an integer in [1, '
      f'{MAX_CLASSES:,}] or None, got {num_classes!r}'
    )

  def as_pairs(got, what):
    got = got() if callable(got) else got
    try:
      return {
        str(c.decode() if isinstance(c, bytes) else c): (
          np.asarray(ex['x']),
          np.asarray(ex['y']),
        )
        for c, ex in got.items()
      }
    except (AttributeError, KeyError, TypeError) as e:
      raise ConfigError(
        'dataset',
        f'{name}: its {what} must be {{client_id: {{"x": array, '
        f'"y": array}}}} ({type(e).__name__}: {e})',
      ) from None

  def read_clients(num_clients=None, data_dir=None, download=False):
    del data_dir, download
    train = as_pairs(clients, 'clients')
    tested = as_pairs(test, 'test clients') if test is not None else None
    ids = list(train)
    n = take(len(ids), num_clients, name)
    ids = ids[:n]
    if tested is not None and set(tested) - set(train):
      extra = sorted(set(tested) - set(train))[:3]
      raise ConfigError(
        'dataset', f'{name}: test clients {extra} have no training examples'
      )
    empty = lambda c: (train[c][0][:0], train[c][1][:0])
    test_pairs = (
      [tested.get(c, empty(c)) for c in ids] if tested is not None else None
    )
    classes = num_classes
    # the largest label + 1, its client named if it is absurd
    if classes is None:
      owners = [
        (c, y)
        for c in ids
        for y in (
          train[c][1],
          *([tested[c][1]] if tested and c in tested else []),
        )
      ]
      top = max(
        (
          (float(np.max(y)), c)
          for c, y in owners
          if y.size and y.dtype.kind in 'biuf' and np.isfinite(y).all()
        ),
        default=(0.0, None),
      )
      if top[0] + 1 > MAX_CLASSES:
        raise ConfigError(
          'dataset',
          f'{name}: client {top[1]!r} has label {top[0]:g}: '
          f'{top[0] + 1:,.0f} classes, more than {MAX_CLASSES:,} (labels are '
          'class indices 0, 1, ...)',
        )
      classes = int(top[0]) + 1
    return NaturalData(
      listed(ids, [train[c] for c in ids], test_pairs),
      n,
      classes,
      len(train),
      split_by_fraction=tested is None,
    )

  read_clients.__module__ = getattr(clients, '__module__', None) or __name__
  register(
    name, read_clients, options=None if test is not None else SplitByFraction
  )


def names() -> List[str]:
  """Every --dataset name: the built-in ones and those registered.

  Returns:
    The names.
  """
  registered = list(LOADERS) + [n for n in POOLS if n not in LOADERS]
  return list(DATASETS) + [
    n for n in registered if n not in DATASETS and n not in HELD_OUT_ONLY
  ]


def is_known(dataset: str) -> bool:
  """Whether ``dataset`` names a data set (a built-in or registered name,
  ``leaf:<name>`` or a TFDS name after ``tfds:``).

  Args:
    dataset: a ``--dataset`` name.

  Returns:
    True when it names one.
  """
  # TFDS's own names: tfds:emnist is its byclass (62 classes)
  if dataset.startswith('tfds:'):
    return tfds_loader.is_known(dataset[len('tfds:') :])
  return dataset in DATASETS or dataset in POOLS or is_file_dataset(dataset)


def options_class(dataset: str) -> Type[DataOptions]:
  """The options class of ``dataset`` (``NoOptions`` when it has none).

  Args:
    dataset: a ``--dataset`` name.

  Returns:
    The class.
  """
  return OPTIONS.get(dataset, NoOptions)


def option_classes() -> List[Type[DataOptions]]:
  """The distinct registered options classes, in registry order.

  Returns:
    The classes, each once.
  """
  out: List[Type[DataOptions]] = []
  for cls in OPTIONS.values():
    if cls not in out:
      out.append(cls)
  return out


def is_file_dataset(dataset: str) -> bool:
  """Whether ``dataset`` is a natural data set read from its files.

  Args:
    dataset: a ``--dataset`` name.

  Returns:
    True for a registered reader's name or ``leaf:<name>``.
  """
  return dataset in LOADERS or (
    dataset.startswith(LEAF_PREFIX) and len(dataset) > len(LEAF_PREFIX)
  )


#: The modules every natural data set is read through: a change in one
#: changes every store's ``loader_code``.
_SHARED_READERS = (
  'registry',
  'natural_data',
  'sqlite_formats',
  'tf_example',
  'local_files',
  'options',
)


def loader_code(dataset: str) -> str:
  """SHA-256 (16 hex digits) of the source of the code that turns
  ``dataset``'s files into clients: its reader's module and the
  shared readers. The population store records it and is rebuilt when it
  differs, so a store never outlives the code that made it (a changed split
  share, tokenizer or decoder reaches the next run).

  Args:
    dataset: a ``--dataset`` name.

  Returns:
    16 hex digits.
  """
  fn: Any = (
    LEAF_READER[0] if dataset.startswith(LEAF_PREFIX) else LOADERS.get(dataset)
  )
  fn = getattr(fn, 'func', fn)  # a functools.partial's function
  modules: List[Any] = [sys.modules.get(getattr(fn, '__module__', ''), None)]
  modules += [sys.modules.get(f'{__package__}.{m}') for m in _SHARED_READERS]
  h = hashlib.sha256()
  for module in modules:
    try:
      h.update(inspect.getsource(module).encode())
    # no module or no source (a frozen build): its name
    except (
      TypeError,
      OSError,
    ):
      h.update(repr(getattr(module, '__name__', module)).encode())
  source = getattr(modules[0], '__file__', None)
  imported = user_reads.AT_IMPORT.get(os.path.abspath(source or ''))
  if imported and any(imported.values()):  # what its module read when imported
    h.update(repr(imported).encode())
  return h.hexdigest()[:16]


def load(
  dataset: str, num_clients=None, data_dir=None, download=False, **options
) -> NaturalData:
  """A natural data set by its --dataset name. ``options`` (its options'
  fields, ``seed``) go to the reader when its signature names them; None
  leaves its default.

  Args:
    dataset: the ``--dataset`` name.
    num_clients: the first N clients (None: all).
    data_dir: where the files are.
    download: fetch missing files.
    options: reader options by name.

  Returns:
    The clients as a ``NaturalData``.
  """
  if dataset.startswith(LEAF_PREFIX):
    if download:
      raise ConfigError('download', sources.manual_instructions(dataset))
    return checked(
      dataset,
      LEAF_READER[0](dataset[len(LEAF_PREFIX) :], num_clients, data_dir),
    )
  if dataset not in LOADERS:
    raise ConfigError(
      'dataset', f'{dataset!r} is not a natural data set read from files'
    )
  nat = LOADERS[dataset](
    num_clients=num_clients,
    data_dir=data_dir,
    download=download,
    **reader_options(dataset, options),
  )
  if not isinstance(nat, NaturalData):
    raise ConfigError(
      'dataset',
      f'{dataset}: its reader returned {type(nat).__name__}, not a '
      'natural_data.NaturalData',
    )
  return checked(dataset, nat)


def reader_options(dataset: str, options) -> dict:
  """The ``options`` the reader of ``dataset`` names in its signature (None
  values left out: the reader's default).

  Args:
    dataset: a registered ``--dataset`` name (not ``leaf:<name>``).
    options: candidate options by name (the data set's options, ``seed``).

  Returns:
    ``{name: value}`` of those its reader takes.
  """
  fn = LOADERS.get(dataset)
  if fn is None:
    return {}
  return _taken_by(fn, {k: v for k, v in options.items() if v is not None})


def _taken_by(fn: Callable, given: Dict[str, Any]) -> Dict[str, Any]:
  """The entries of ``given`` that ``fn``'s signature names."""
  params = inspect.signature(fn).parameters
  return {k: v for k, v in given.items() if k in params}
