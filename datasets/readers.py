"""The field's natural federated data sets: the registry of their readers.

One client per writer (``emnist``), speaking role (``shakespeare``), user
(``stackoverflow``, ``leaf:<name>``, ``gldv2``) or Pachinko-allocation client
(``cifar100``), with the files' own train/test split. Each data set is a
module with a reader ``read_clients(num_clients=None, data_dir=None,
download=False, **its options)`` returning a ``natural_data.NaturalData``
(what the population store is written from) and FedJAX's ``load_data``
(``(train, test)`` federated data over that store, ``federated``);
``LOADERS`` maps the ``--dataset`` names to the readers, and ``register``
adds one (a data set of your own files, BUILD.md "Add a data set").
"""

import functools
import inspect
from typing import Callable, Dict

from fedjax_personal.datasets import cifar100, emnist, gldv2, leaf, shakespeare, stackoverflow
from fedjax_personal.datasets.natural_data import NaturalData
from fedjax_personal.errors import ConfigError

__all__ = ['is_file_dataset', 'LEAF_PREFIX', 'load', 'loader_code', 'LOADERS', 'reader_options',
           'register']


#: --dataset name -> its reader (``read_clients``).
LOADERS: Dict[str, Callable[..., NaturalData]] = {
    'emnist': emnist.read_clients,
    'emnist_digits': functools.partial(emnist.read_clients, only_digits=True),
    'shakespeare': shakespeare.read_clients,
    'stackoverflow': stackoverflow.read_clients,
    'stackoverflow_held_out': stackoverflow.read_held_out,
    'cifar100': cifar100.read_clients,
    'gldv2': gldv2.read_clients,
}
LEAF_PREFIX = 'leaf:'


def register(name: str, read_clients: Callable[..., NaturalData]) -> None:
  """Adds a natural data set read from files: ``--dataset=<name>`` then
  reads it through ``read_clients(num_clients=None, data_dir=None,
  download=False, ...)`` into the population store (its options, such as
  ``seq_len``, are passed when its signature names them).

  Args:
    name: the ``--dataset`` name.
    read_clients: the reader.

  Returns:
    None.
  """
  if name in LOADERS and LOADERS[name] is not read_clients and (
      getattr(LOADERS[name], '__module__', None) != getattr(read_clients, '__module__', None)):
    raise ValueError(f'a data set named {name!r} is registered already')
  LOADERS[name] = read_clients


def is_file_dataset(dataset: str) -> bool:
  """Whether ``dataset`` is a natural data set read from its files.

  Args:
    dataset: a ``--dataset`` name.

  Returns:
    True for a registered reader's name or ``leaf:<name>``.
  """
  return dataset in LOADERS or (dataset.startswith(LEAF_PREFIX) and len(dataset) > len(LEAF_PREFIX))


#: The modules every natural data set is read through: a change in one
#: changes every store's ``loader_code``.
_SHARED_READERS = ('readers', 'natural_data', 'sqlite_formats', 'tf_example', 'local_files')


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
  import hashlib
  import sys
  if dataset.startswith(LEAF_PREFIX):
    modules = [leaf]
  else:
    fn = LOADERS.get(dataset)
    fn = getattr(fn, 'func', fn)  # a functools.partial's function
    modules = [sys.modules.get(getattr(fn, '__module__', ''), None)]
  modules += [sys.modules.get(f'{__package__}.{m}') for m in _SHARED_READERS]
  h = hashlib.sha256()
  for module in modules:
    try:
      h.update(inspect.getsource(module).encode())
    except (TypeError, OSError):  # no module or no source (a frozen build): its name
      h.update(repr(getattr(module, '__name__', module)).encode())
  return h.hexdigest()[:16]


def load(dataset: str, num_clients=None, data_dir=None, download=False,
         **options) -> NaturalData:
  """A natural data set by its --dataset name. ``options`` (``seq_len``,
  ``vocab_size``, ``image_size``, ``cifar100_test``) go to the data set
  whose reader names them; None leaves its default.

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
      from fedjax_personal.datasets import sources
      raise ConfigError('download', sources.manual_instructions(dataset))
    return leaf.read_clients(dataset[len(LEAF_PREFIX):], num_clients, data_dir)
  if dataset not in LOADERS:
    raise ConfigError('dataset', f'{dataset!r} is not a natural data set read from files')
  return LOADERS[dataset](num_clients=num_clients, data_dir=data_dir, download=download,
                          **reader_options(dataset, options))


def reader_options(dataset: str, options) -> dict:
  """The ``options`` the reader of ``dataset`` names in its signature (None
  values left out: the reader's default).

  Args:
    dataset: a registered ``--dataset`` name (not ``leaf:<name>``).
    options: candidate options by name (``DataConfig``'s fields).

  Returns:
    ``{name: value}`` of those its reader takes.
  """
  fn = LOADERS.get(dataset)
  if fn is None:
    return {}
  params = inspect.signature(fn).parameters
  return {k: v for k, v in options.items() if v is not None and k in params}
