"""Federated CIFAR-100 (Reddi et al., "Adaptive Federated Optimization",
arXiv 2003.00295) from TFF's ``cifar100.sqlite.lzma``: 500 train clients of
100 images by Pachinko allocation over the coarse and fine labels, and 100
test clients, read as TFF writes them (``sqlite_formats.read_tff``).
"""

import dataclasses

import numpy as np

from fedjax_personal.datasets import (
  federated_data,
  local_files,
  sources,
  sqlite_federated_data,
  sqlite_formats,
  store_federated_data,
)
from fedjax_personal.datasets.natural_data import NaturalData, client_id, take
from fedjax_personal.datasets.options import DataOptions
from fedjax_personal.errors import ConfigError, DataError
from fedjax_personal.hparams import hparam
from fedjax_personal.models import inputs

__all__ = [
  'CIFAR100_PIXELS_INVERSE_STDDEV',
  'CIFAR100_PIXELS_MEAN',
  'Cifar100Options',
  'fedjax_files',
  'load_data',
  'load_split',
  'preprocess_batch',
  'preprocess_batch_tff',
  'preprocess_client',
  'preprocess_image',
  'preprocess_image_tff',
  'read_clients',
  'SPLITS',
]


CIFAR100_FEATURES = {'image': (32, 32, 3), 'label': (), 'coarse_label': ()}


CIFAR100_TESTS = ('split', 'tff_clients')


@dataclasses.dataclass(frozen=True)
class Cifar100Options(DataOptions):
  """CIFAR-100's options.

  The natural partition's test clients and the images the model sees."""

  held_out_choice = (
    'cifar100_test',
    "split (each client's images split for test)",
  )
  cifar100_test: str = hparam(
    'split',
    'cifar100 (natural): the test clients. split: each train '
    "client's images split with --test_fraction (personal models have "
    "test data); tff_clients: TFF's 100 test clients, held out "
    '(evaluated with the global model, never trained), as Reddi et al. '
    '(arXiv 2003.00295) evaluate.',
    choices=CIFAR100_TESTS,
  )
  cifar100_preprocess: str = hparam(
    'none',
    'cifar100: the images the model sees. none: as the file holds them (scaled '
    'to '
    '[0, 1]); reddi: a random 24x24 crop of each training batch and a '
    'left-right flip of '
    "each image (drawn from the run's key for each client, round and step), "
    'the central '
    '24x24 of the others, '
    "each standardized, as Reddi et al.'s task (google-research/federated) "
    'feeds them.',
    choices=('none', 'reddi'),
  )

  def check_given(self, cfg, given):
    if 'cifar100_test' in given and cfg.partition != 'natural':
      raise ConfigError(
        'cifar100_test',
        "chooses the natural CIFAR-100's test clients; "
        f'--partition={cfg.partition} has none',
      )

  def files_split_test(self):
    return self.cifar100_test == 'tff_clients'

  def input_transform(self):
    if self.cifar100_preprocess == 'none':
      return None
    return inputs.TRANSFORMS[self.cifar100_preprocess]()


def read_clients(
  num_clients=None, data_dir=None, download=False, cifar100_test: str = 'split'
) -> NaturalData:
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
    raise ConfigError(
      'cifar100_test',
      f'unknown {cifar100_test!r}; choose one of {list(CIFAR100_TESTS)}',
    )
  path = sources.fetch('cifar100', data_dir, download)['cifar100.sqlite.lzma']
  total = sqlite_formats.tff_num_clients(path, 'train')
  n = take(total, num_clients, 'cifar100')
  held_out = (
    sqlite_formats.tff_num_clients(path, 'test')
    if cifar100_test == 'tff_clients'
    else 0
  )
  if cifar100_test == 'tff_clients' and held_out == 0:
    raise DataError(
      f"{path}: no test client (--cifar100_test=tff_clients needs TFF's test "
      'split); use --cifar100_test=split'
    )

  def images(cid, ex):
    if ex['image'].size and (ex['image'].min() < 0 or ex['image'].max() > 255):
      raise DataError(f'{path}: client {cid}: pixel values outside [0, 255]')
    return ex['image'].astype(np.uint8), ex['label'].astype(np.int32)

  def stream():
    none = (np.zeros((0, 32, 32, 3), np.uint8), np.zeros((0,), np.int32))
    for cid, ex in sqlite_formats.read_tff(
      path, 'train', CIFAR100_FEATURES, limit=n
    ):
      yield cid, images(cid, ex), none
    if held_out:
      for cid, ex in sqlite_formats.read_tff(path, 'test', CIFAR100_FEATURES):
        yield (
          f'{store_federated_data.HELD_OUT_PREFIX}{client_id(cid)}',
          none,
          images(cid, ex),
        )

  return NaturalData(
    stream,
    n + held_out,
    100,
    total,
    [str(path)],
    split_by_fraction=not held_out,
    eval_only=held_out,
  )


SPLITS = ('train', 'test')


def fedjax_files(cache_dir=None, download: bool = True):
  """FedJAX's ``federated_cifar100_{train,test}.sqlite``, written once from
  TFF's file (into the cache, beside its decompressed copy) as FedJAX's
  ``cifar100.load_split`` writes them: each split's clients in TFF's
  client-id order (ids as TFF keeps them, str), ``image`` [N, 32, 32, 3]
  uint8, ``label`` and ``coarse_label`` [N] int64.

  Args:
    cache_dir: where TFF's ``cifar100.sqlite.lzma`` is.
    download: fetch it when found nowhere.

  Returns:
    ``{split: path}``.
  """
  tff = sources.fetch('cifar100', cache_dir, download)['cifar100.sqlite.lzma']
  folder = local_files.derived_dir('fedjax_cifar100', tff)
  out = {}
  for split in SPLITS:
    path = folder / f'federated_cifar100_{split}.sqlite'
    if not path.is_file():
      clients = (
        (
          cid,
          {
            'coarse_label': ex['coarse_label'].astype(np.int64),
            'image': ex['image'].astype(np.uint8),
            'label': ex['label'].astype(np.int64),
          },
        )
        for cid, ex in sqlite_formats.read_tff(tff, split, CIFAR100_FEATURES)
      )
      local_files.write_atomically(
        path, lambda tmp: sqlite_formats.write_fedjax(tmp, clients)
      )
    out[split] = path
  return out


def preprocess_client(client_id, examples):
  """FedJAX's: ``x`` the images (uint8), ``y`` the fine label (int32).

  Args:
    client_id: not used.
    examples: ``{'image', 'label', 'coarse_label'}``.

  Returns:
    ``{'x', 'y'}``.
  """
  del client_id
  return {'x': examples['image'], 'y': examples['label'].astype(np.int32)}


#: FedJAX's per-channel mean and inverse standard deviation of pixels in [0, 1].
CIFAR100_PIXELS_MEAN = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32)
CIFAR100_PIXELS_INVERSE_STDDEV = 1 / np.array(
  [0.2023, 0.1994, 0.2010], dtype=np.float32
)


def preprocess_image(image: np.ndarray, is_train: bool) -> np.ndarray:
  """FedJAX's ``preprocess_image``: in training a 4-pixel zero pad, one
  random 32x32 crop and a random left-right flip for the whole batch
  (NumPy's global ``np.random``, as FedJAX draws them); then centred and
  scaled per channel.

  Args:
    image: [N, 32, 32, 3] uint8.
    is_train: crop and flip.

  Returns:
    [N, 32, 32, 3] float32.
  """
  if is_train:
    image = np.pad(image, [(0, 0), (4, 4), (4, 4), (0, 0)], mode='constant')
    i, j = np.random.randint(8, size=[2])
    image = image[:, i : i + 32, j : j + 32, :]
    if np.random.randint(2):
      image = np.flip(image, axis=-2)
  return (
    image.astype(np.float32) / 255 - CIFAR100_PIXELS_MEAN
  ) * CIFAR100_PIXELS_INVERSE_STDDEV


def preprocess_batch(examples, is_train: bool):
  """FedJAX's ``preprocess_batch``: ``preprocess_image`` of ``x``.

  Args:
    examples: ``{'x', 'y'}``.
    is_train: crop and flip.

  Returns:
    ``{'x', 'y'}``.
  """
  return {'x': preprocess_image(examples['x'], is_train), 'y': examples['y']}


def preprocess_image_tff(
  image: np.ndarray, crop_height: int, crop_width: int, distort: bool
) -> np.ndarray:
  """FedJAX's ``preprocess_image_tff`` (TFF's task): a random crop and
  flip (``distort``; NumPy's global ``np.random``) or the central crop,
  then each image standardized (``tf.image.per_image_standardization``).

  Args:
    image: [N, 32, 32, 3] uint8.
    crop_height: 1..32.
    crop_width: 1..32.
    distort: random crop and flip instead of the central crop.

  Returns:
    [N, crop_height, crop_width, 3] float32.

  Raises:
    ValueError: a crop outside 1..32.
  """
  if crop_height < 1 or crop_width < 1 or crop_height > 32 or crop_width > 32:
    raise ValueError('The crop_height and crop_width must be between 1 and 32.')
  if distort:
    crop_shape = np.array((crop_height, crop_width, 3)).astype(np.int32)
    shape = np.array(image.shape).astype(np.int32)[1:]
    limit = shape - crop_shape + 1
    offset = (
      np.random.uniform(
        high=np.iinfo(limit.dtype).max, size=shape.shape
      ).astype(limit.dtype)
      % limit
    )
    (bi, bj, _), (ei, ej, _) = offset, offset + crop_shape
    image = image[:, bi:ei, bj:ej, :]
    if np.random.randint(2):
      image = np.flip(image, axis=-2)
  else:
    hi, wi = (32 - crop_height) // 2, (32 - crop_width) // 2
    image = image[:, hi : hi + crop_height, wi : wi + crop_width, :]
  image = image.astype(np.float32)
  num_pixels = np.prod(image.shape[-3:], dtype=np.float32)
  mean = np.mean(image, axis=(-1, -2, -3), keepdims=True)
  std = np.maximum(
    np.std(image, axis=(-1, -2, -3), keepdims=True), np.sqrt(num_pixels)
  )
  return (image - mean) / std


def preprocess_batch_tff(
  examples, crop_height: int = 24, crop_width: int = 24, distort: bool = False
):
  """FedJAX's ``preprocess_batch_tff``: ``preprocess_image_tff`` of ``x``.

  Args:
    examples: ``{'x', 'y'}``.
    crop_height: 1..32 (TFF's 24).
    crop_width: 1..32 (TFF's 24).
    distort: random crop and flip.

  Returns:
    ``{'x', 'y'}``.
  """
  return {
    'x': preprocess_image_tff(examples['x'], crop_height, crop_width, distort),
    'y': examples['y'],
  }


def _store_of(cfg, split: str):
  """``.store`` of a split: test clients are held out in the store
  (``test/<id>``)."""
  return store_federated_data.store_of(
    cfg, store_federated_data.HELD_OUT_PREFIX if split == 'test' else ''
  )


def load_split(
  split: str,
  mode: str = 'sqlite',
  cache_dir=None,
  *,
  num_clients=None,
  download: bool = True,
  data_dir=None,
):
  """FedJAX's ``cifar100.load_split``: one split's clients, raw
  (``image``, ``label``, ``coarse_label``), from FedJAX's files made of
  TFF's (``fedjax_files``).

  Args:
    split: ``'train'`` or ``'test'``.
    mode, cache_dir, num_clients, download, data_dir: as ``load_data``
      (``num_clients``: the file's first N clients).

  Returns:
    A ``sqlite_federated_data.SQLiteFederatedData``.
  """
  if split not in SPLITS:
    raise ValueError(f'Invalid split={split!r}')
  cfg = store_federated_data.data_config(
    'cifar100',
    mode,
    cache_dir,
    num_clients,
    download,
    data_dir,
    cifar100_test='tff_clients',
  )
  return sqlite_federated_data.SQLiteFederatedData(
    fedjax_files(cfg.data_dir, download)[split],
    limit=num_clients,
    store_of=_store_of(cfg, split),
  )


def load_data(
  mode: str = 'sqlite',
  cache_dir=None,
  *,
  num_clients=None,
  download: bool = True,
  cifar100_test: str = 'tff_clients',
  data_dir=None,
):
  """FedJAX's ``cifar100.load_data``: ``(train, test)``, TFF's 500 train and
  100 test clients (ids as TFF's, str) from FedJAX's files made of TFF's
  (``fedjax_files``), ``x`` [N, 32, 32, 3] uint8 and ``y`` [N] int32
  (``preprocess_client``); FedJAX's ``preprocess_batch`` and
  ``preprocess_batch_tff`` prepare batches. ``cifar100_test='split'``
  instead gives the command line's ``--cifar100_test=split``: the train
  clients' images split, over the population store.

  Args:
    mode: ``'sqlite'``.
    cache_dir: where TFF's file is (``data_dir`` is the same).
    num_clients: the first N clients of each split (None: all).
    download: fetch a missing file.
    cifar100_test: ``CIFAR100_TESTS`` (TFF's test clients by default, as
      FedJAX).
    data_dir: the same as ``cache_dir``.

  Returns:
    ``(train, test)``: ``sqlite_federated_data.SQLiteFederatedData``
    (``tff_clients``) or ``store_federated_data.FederatedData`` (``split``).
  """
  if cifar100_test == 'split':
    return store_federated_data.load(
      'cifar100',
      mode,
      cache_dir,
      num_clients,
      download,
      data_dir,
      cifar100_test='split',
    )
  if cifar100_test not in CIFAR100_TESTS:
    raise ValueError(
      f'cifar100_test must be one of {list(CIFAR100_TESTS)}, got '
      f'{cifar100_test!r}'
    )
  cfg = store_federated_data.data_config(
    'cifar100',
    mode,
    cache_dir,
    num_clients,
    download,
    data_dir,
    cifar100_test='tff_clients',
  )
  files = fedjax_files(cfg.data_dir, download)
  return tuple(
    sqlite_federated_data.SQLiteFederatedData(
      files[split],
      limit=num_clients,
      store_of=_store_of(cfg, split),
      preprocess_client=federated_data.ClientPreprocessor([preprocess_client]),
    )
    for split in SPLITS
  )
