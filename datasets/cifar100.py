"""Federated CIFAR-100 (Reddi et al., "Adaptive Federated Optimization",
arXiv 2003.00295) from TFF's ``cifar100.sqlite.lzma``: 500 train clients of
100 images by Pachinko allocation over the coarse and fine labels, and 100
test clients, read as TFF writes them (``sqlite_formats.read_tff``).
"""

import dataclasses

import numpy as np

from fedjax_personal.datasets import federated, sources, sqlite_formats
from fedjax_personal.datasets.natural_data import NaturalData, client_id, take
from fedjax_personal.datasets.options import DataOptions
from fedjax_personal.errors import ConfigError, DataError
from fedjax_personal.hparams import hparam


__all__ = ['Cifar100Options', 'load_data', 'read_clients']


CIFAR100_FEATURES = {'image': (32, 32, 3), 'label': (), 'coarse_label': ()}


CIFAR100_TESTS = ('split', 'tff_clients')


@dataclasses.dataclass(frozen=True)
class Cifar100Options(DataOptions):
  """CIFAR-100's options: the natural partition's test clients and the
  images the model sees."""
  held_out_choice = ('cifar100_test', "split (each client's images split for test)")
  cifar100_test: str = hparam('split', "cifar100 (natural): the test clients. split: each train "
                              "client's images split with --test_fraction (personal models have "
                              "test data); tff_clients: TFF's 100 test clients, held out "
                              '(evaluated with the global model, never trained), as Reddi et al. '
                              '(arXiv 2003.00295) evaluate.', choices=CIFAR100_TESTS)
  cifar100_preprocess: str = hparam(
      'none', 'cifar100: the images the model sees. none: as the file holds them (scaled to '
      '[0, 1]); reddi: a random 24x24 crop and left-right flip of each training image (drawn '
      'from the run\'s key for each client, round and step), the central 24x24 of the others, '
      'each standardized, as Reddi et al.\'s task (google-research/federated) feeds them.',
      choices=('none', 'reddi'))

  def check_given(self, cfg, given):
    if 'cifar100_test' in given and cfg.partition != 'natural':
      raise ConfigError('cifar100_test', "chooses the natural CIFAR-100's test clients; "
                        f'--partition={cfg.partition} has none')

  def files_split_test(self):
    return self.cifar100_test == 'tff_clients'

  def input_transform(self):
    if self.cifar100_preprocess == 'none':
      return None
    from fedjax_personal.models import inputs  # noqa: PLC0415  (the model's input pipelines)
    return inputs.TRANSFORMS[self.cifar100_preprocess]()


def read_clients(num_clients=None, data_dir=None, download=False,
                 cifar100_test: str = 'split') -> NaturalData:
  """Federated CIFAR-100 (TFF's ``cifar100.sqlite``: 500 train clients of 100
  images, Pachinko allocation over the coarse and fine labels; 100 test
  clients of 100 images).

  Args:
    num_clients: the first N train clients (None: all 500).
    cifar100_test: ``'tff_clients'``: the train clients keep all their images and
      TFF's test clients follow them as held-out clients (``eval_only``,
      ids ``test/<id>``), as Reddi et al. (arXiv 2003.00295) evaluate;
      ``'split'``: train clients only, their images split with
      --test_fraction (``split_by_fraction``).

  Returns:
    The clients as a ``NaturalData`` (what the population store is written from).
  """
  if cifar100_test not in CIFAR100_TESTS:
    raise ConfigError('cifar100_test', f'unknown {cifar100_test!r}; choose one of {list(CIFAR100_TESTS)}')
  path = sources.fetch('cifar100', data_dir, download)['cifar100.sqlite.lzma']
  total = sqlite_formats.tff_num_clients(path, 'train')
  n = take(total, num_clients, 'cifar100')
  held_out = sqlite_formats.tff_num_clients(path, 'test') if cifar100_test == 'tff_clients' else 0
  if cifar100_test == 'tff_clients' and held_out == 0:
    raise DataError(f'{path}: no test client (--cifar100_test=tff_clients needs TFF\'s test '
                    'split); use --cifar100_test=split')

  def images(cid, ex):
    if ex['image'].size and (ex['image'].min() < 0 or ex['image'].max() > 255):
      raise DataError(f'{path}: client {cid}: pixel values outside [0, 255]')
    return ex['image'].astype(np.uint8), ex['label'].astype(np.int32)

  def stream():
    none = (np.zeros((0, 32, 32, 3), np.uint8), np.zeros((0,), np.int32))
    for cid, ex in sqlite_formats.read_tff(path, 'train', CIFAR100_FEATURES, limit=n):
      yield cid, images(cid, ex), none
    if held_out:
      for cid, ex in sqlite_formats.read_tff(path, 'test', CIFAR100_FEATURES):
        yield f'{federated.HELD_OUT_PREFIX}{client_id(cid)}', none, images(cid, ex)
  return NaturalData(stream, n + held_out, 100, total, [str(path)],
                     split_by_fraction=not held_out, eval_only=held_out)


def load_data(mode: str = 'sqlite', cache_dir=None, *, num_clients=None, download: bool = True,
              cifar100_test: str = 'tff_clients', data_dir=None):
  """FedJAX's ``cifar100.load_data``: ``(train, test)`` federated data of
  TFF's file, ``x`` [N, 32, 32, 3] uint8 images as the file holds them
  (FedJAX's, before its batch preprocessing), ``y`` [N] int32. By default
  the test split is TFF's 100 test clients, as FedJAX's and TFF's;
  ``cifar100_test='split'`` splits each train client's images instead.

  Args:
    mode: ``'sqlite'`` (TFF's file).
    cache_dir: where the file is (``data_dir`` is the same).
    num_clients: the first N train clients (None: all 500).
    download: fetch a missing file.
    cifar100_test: ``CIFAR100_TESTS``.
    data_dir: the same as ``cache_dir``.

  Returns:
    ``(train, test)`` ``federated.FederatedData``.
  """
  from fedjax_personal.datasets import federated
  return federated.load('cifar100', mode, cache_dir, num_clients, download, data_dir,
                        cifar100_test=cifar100_test)
