"""Federated EMNIST (Cohen et al. 2017; 3,400 writers, 62 classes; digits
only 3,383 writers, 10 classes) from FedJAX's SQLite files
(``federated_emnist[_digitsonly]_{train,test}.sqlite``), [28, 28, 1] float32,
in either publisher's pixel convention (``PIXELS``): ``fedjax``, x = 1 -
pixels (ink 1), as ``fedjax/datasets/emnist.py``; ``tff``, the files' raw
pixels (ink 0, background 1), as TFF's ``emnist.load_data`` gives them and
Reddi et al.'s task code (google-research/federated) feeds them.
"""

import dataclasses

import numpy as np

from fedjax_personal.datasets import (
  sources,
  sqlite_federated_data,
  store_federated_data,
)
from fedjax_personal.datasets.natural_data import NaturalData, fedjax_splits
from fedjax_personal.datasets.options import DataOptions
from fedjax_personal.errors import DataError
from fedjax_personal.hparams import hparam

__all__ = [
  'domain_id',
  'EmnistOptions',
  'load_data',
  'load_split',
  'PIXELS',
  'preprocess_batch',
  'preprocess_batch_tff',
  'preprocess_client',
  'preprocess_split',
  'read_clients',
  'SPLITS',
]


PIXELS = {'fedjax': lambda p: 1.0 - p, 'tff': lambda p: p}


@dataclasses.dataclass(frozen=True)
class EmnistOptions(DataOptions):
  """EMNIST's options (``--dataset=emnist``, ``emnist_digits``)."""

  pixels: str = hparam(
    'fedjax',
    'emnist: the pixel convention. fedjax: 1 - pixels, ink 1 '
    "(FedJAX's load_data); tff: the files' raw pixels, ink 0, as TFF and Reddi "
    "et al.'s code feed them.",
    choices=tuple(PIXELS),
    flag='emnist_pixels',
  )

  def describe(self):
    return [
      'pixels: '
      + (
        "fedjax (1 - x, ink 1: FedJAX's load_data)"
        if self.pixels == 'fedjax'
        else "tff (the raw pixels, ink 0: TFF's, as Reddi et al. feed them)"
      )
    ]


def read_clients(
  num_clients=None,
  data_dir=None,
  download=False,
  only_digits: bool = False,
  pixels: str = 'fedjax',
) -> NaturalData:
  """Federated EMNIST (3,400 writers; digits only 3,383), FedJAX's files,
  in the ``pixels`` convention (``PIXELS``), client by client (what the
  population store is written from).

  Args:
    num_clients: the first N writers (None: all).
    data_dir: where the files are.
    download: fetch missing files.
    only_digits: the digits-only files (10 classes).
    pixels: ``'fedjax'`` (1 - x) or ``'tff'`` (raw).

  Returns:
    The writers as a ``NaturalData``.
  """
  if pixels not in PIXELS:
    raise ValueError(f'pixels must be one of {list(PIXELS)}, got {pixels!r}')
  name = 'emnist_digits' if only_digits else 'emnist'
  paths = list(sources.fetch(name, data_dir, download).values())
  convention = PIXELS[pixels]
  conv = lambda ex: (
    convention(np.asarray(ex['pixels'], np.float32))[..., None],
    np.asarray(ex['label'], np.int32),
  )
  classes = 10 if only_digits else 62

  def checked(ex):
    x, y = conv(ex)
    if y.size and (y.min() < 0 or y.max() >= classes):
      raise DataError(f'{paths[0]}: labels outside [0, {classes})')
    return x, y

  out = fedjax_splits(name, paths[0], paths[1], num_clients, checked)
  out.num_classes = classes
  return out


def domain_id(client_id) -> int:
  """The NIST source of a writer (FedJAX's ``emnist.domain_id``): 0 for
  the high-school writers ``f2100``-``f2599``, 1 for the Census Bureau's.
  Ids are ``f<4 digits>_<2 digits>``, optionally after a 16-byte hash and
  a colon.

  Args:
    client_id: a writer's id (str or bytes).

  Returns:
    0 or 1.
  """
  cid = client_id.decode() if isinstance(client_id, bytes) else str(client_id)
  if len(cid) == 25:
    number = int(cid[18:22])
  elif len(cid) == 8:
    number = int(cid[1:5])
  else:
    raise ValueError(f'Invalid client_id: {client_id!r}')
  return 0 if 2100 <= number <= 2599 else 1


def preprocess_client(client_id, examples):
  """FedJAX's: a ``domain_id`` feature (``domain_id`` of the writer) beside
  ``pixels`` and ``label``.

  Args:
    client_id: the writer's id.
    examples: ``{'pixels', 'label'}``.

  Returns:
    The examples with ``domain_id`` [N] (the label's dtype).
  """
  return {
    **examples,
    'domain_id': np.full_like(examples['label'], domain_id(client_id)),
  }


def preprocess_batch(examples):
  """FedJAX's batch: ``x`` = 1 - pixels [N, 28, 28, 1] (ink 1).

  Args:
    examples: ``{'pixels', 'label', 'domain_id'}``.

  Returns:
    ``{'x', 'y', 'domain_id'}``.
  """
  return {
    'x': 1 - examples['pixels'][..., np.newaxis],
    'y': examples['label'],
    'domain_id': examples['domain_id'],
  }


def preprocess_batch_tff(examples):
  """TFF's pixels: ``x`` = the file's pixels [N, 28, 28, 1] (ink 0), as
  TFF's ``emnist.load_data`` and Reddi et al.'s task code feed them.

  Args:
    examples: ``{'pixels', 'label', 'domain_id'}``.

  Returns:
    ``{'x', 'y', 'domain_id'}``.
  """
  return {
    'x': examples['pixels'][..., np.newaxis],
    'y': examples['label'],
    'domain_id': examples['domain_id'],
  }


BATCH_PREPROCESSING = {'fedjax': preprocess_batch, 'tff': preprocess_batch_tff}

SPLITS = ('train', 'test')


def preprocess_split(fd):
  """FedJAX's ``preprocess_split``: ``preprocess_client`` then
  ``preprocess_batch``.

  Args:
    fd: one split of raw writers (``load_split``).

  Returns:
    The split with FedJAX's features.
  """
  return fd.preprocess_client(preprocess_client).preprocess_batch(
    preprocess_batch
  )


def load_split(
  split: str,
  only_digits: bool = False,
  mode: str = 'sqlite',
  cache_dir=None,
  *,
  num_clients=None,
  download: bool = True,
  data_dir=None,
):
  """FedJAX's ``emnist.load_split``: one file's writers, raw (``pixels``
  [N, 28, 28] float32, ``label`` [N] int32), in the file's order.

  Args:
    split: ``'train'`` or ``'test'``.
    only_digits: the digits-only files.
    mode, cache_dir, num_clients, download, data_dir: as ``load_data``
      (``num_clients``: the file's first N clients).

  Returns:
    A ``sqlite_federated_data.SQLiteFederatedData``.
  """
  if split not in SPLITS:
    raise ValueError(f'Invalid split={split!r}')
  name = 'emnist_digits' if only_digits else 'emnist'
  cfg = store_federated_data.data_config(
    name, mode, cache_dir, num_clients, download, data_dir
  )
  return sqlite_federated_data.open_split(
    cfg,
    f'federated_emnist_{"digitsonly_" if only_digits else ""}{split}.sqlite',
  )


def load_data(
  only_digits: bool = False,
  mode: str = 'sqlite',
  cache_dir=None,
  *,
  num_clients=None,
  download: bool = True,
  pixels: str = 'fedjax',
  data_dir=None,
):
  """FedJAX's ``emnist.load_data``: the train and test files' writers, each
  in its file's order, with FedJAX's preprocessing.

  Features of a batch: ``x`` [N, 28, 28, 1] float32 (``1 - pixels`` with
  ``pixels='fedjax'``, FedJAX's; ``'tff'``: the raw pixels), ``y`` [N]
  int32, ``domain_id`` [N] int32 (``domain_id``); a client's
  ``raw_examples`` are the file's (``pixels``, ``label``) and ``domain_id``.
  ``.store`` of a view is the population store the command line trains on
  (``--dataset=emnist --emnist_pixels=PIXELS``), those writers alone.

  Args:
    only_digits: the 10-class digits files (3,383 writers).
    mode: ``'sqlite'`` (FedJAX's only mode).
    cache_dir: where the files are (``data_dir`` is the same).
    num_clients: the first N writers of each file (None: all).
    download: fetch missing files (FedJAX always does).
    pixels: ``PIXELS``.
    data_dir: the same as ``cache_dir``.

  Returns:
    ``(train, test)`` ``sqlite_federated_data.SQLiteFederatedData``, clients by id.
  """
  if pixels not in BATCH_PREPROCESSING:
    raise ValueError(
      f'pixels must be one of {list(BATCH_PREPROCESSING)}, got {pixels!r}'
    )
  name = 'emnist_digits' if only_digits else 'emnist'
  cfg = store_federated_data.data_config(
    name, mode, cache_dir, num_clients, download, data_dir, emnist_pixels=pixels
  )
  return tuple(
    sqlite_federated_data.open_split(
      cfg,
      f'federated_emnist_{"digitsonly_" if only_digits else ""}{split}.sqlite',
      [preprocess_client],
      [BATCH_PREPROCESSING[pixels]],
    )
    for split in SPLITS
  )
