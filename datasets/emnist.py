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

from fedjax_personal.datasets import federated, sources
from fedjax_personal.datasets.natural_data import NaturalData, fedjax_splits
from fedjax_personal.datasets.options import DataOptions
from fedjax_personal.errors import DataError
from fedjax_personal.hparams import hparam


__all__ = ['domain_id', 'EmnistOptions', 'load_data', 'PIXELS', 'read_clients']


PIXELS = {'fedjax': lambda p: 1.0 - p, 'tff': lambda p: p}


@dataclasses.dataclass(frozen=True)
class EmnistOptions(DataOptions):
  """EMNIST's options (``--dataset=emnist``, ``emnist_digits``)."""
  pixels: str = hparam('fedjax', "emnist: the pixel convention. fedjax: 1 - pixels, ink 1 "
                       "(FedJAX's load_data); tff: the files' raw pixels, ink 0, as TFF and Reddi "
                       "et al.'s code feed them.", choices=tuple(PIXELS), flag='emnist_pixels')

  def describe(self):
    return ['pixels: ' + ("fedjax (1 - x, ink 1: FedJAX's load_data)" if self.pixels == 'fedjax'
                          else "tff (the raw pixels, ink 0: TFF's, as Reddi et al. feed them)")]


def read_clients(num_clients=None, data_dir=None, download=False,
                 only_digits: bool = False, pixels: str = 'fedjax') -> NaturalData:
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
  conv = lambda ex: (convention(np.asarray(ex['pixels'], np.float32))[..., None],
                     np.asarray(ex['label'], np.int32))
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


def _with_domain(client_id, examples):
  return {**examples, 'domain_id': np.full_like(examples['y'], domain_id(client_id))}


def load_data(only_digits: bool = False, mode: str = 'sqlite', cache_dir=None, *,
              num_clients=None, download: bool = True, pixels: str = 'fedjax', data_dir=None):
  """FedJAX's ``emnist.load_data``: the train and test federated data of
  FedJAX's files, read from their population store.

  Features as FedJAX gives them: ``x`` [N, 28, 28, 1] float32 (``1 -
  pixels`` with ``pixels='fedjax'``; ``'tff'``: the raw pixels), ``y`` [N]
  int32, ``domain_id`` [N] int32 (``domain_id``).

  Args:
    only_digits: the 10-class digits files (3,383 writers).
    mode: ``'sqlite'`` (FedJAX's only mode).
    cache_dir: where the files are (``data_dir`` is the same).
    num_clients: the first N writers (None: all).
    download: fetch missing files (FedJAX always does).
    pixels: ``PIXELS``.
    data_dir: the same as ``cache_dir``.

  Returns:
    ``(train, test)`` ``federated.FederatedData``, clients by id.
  """
  train, test = federated.load('emnist_digits' if only_digits else 'emnist', mode, cache_dir,
                               num_clients, download, data_dir, emnist_pixels=pixels)
  return train.preprocess_client(_with_domain), test.preprocess_client(_with_domain)
