"""TFDS data sets for users who are online (or have prepared data locally).

Reads through ``tfds.data_source`` (no TensorFlow needed at read time; data
prepared with ``file_format='array_record'``). Preparing the data
(``download_and_prepare``) needs the optional ``tfds`` extra (tensorflow-cpu).
Tests use ``tfds.testing.mock_data``; nothing here downloads unless the user
asks for it with ``download=True``.
"""

from typing import Optional

import numpy as np

from fedjax_personal.datasets import in_memory
from fedjax_personal.errors import ConfigError

__all__ = ['is_known', 'load_tfds']


# TFDS name (as TFDS names it; a builder config may follow: ``emnist/digits``)
# -> (image key or text key, label key). ``emnist`` is TFDS's default config,
# ``emnist/byclass`` (62 classes), as in TFDS.
TFDS_DATASETS = {
  'mnist': ('image', 'label'),
  'emnist': ('image', 'label'),
  'cifar10': ('image', 'label'),
  'cifar100': ('image', 'label'),
  'tiny_shakespeare': ('text', None),
}


def is_known(name: str) -> bool:
  """Whether ``name`` (``<TFDS name>[/<config>]``) is a data set read here.

  Args:
    name: the name after ``tfds:``.

  Returns:
    True when read here.
  """
  base, _, config = name.partition('/')
  return base in TFDS_DATASETS and (
    config == '' or config.replace('_', '').isalnum()
  )


def load_tfds(
  name: str,
  split: str = 'train',
  data_dir: Optional[str] = None,
  download: bool = False,
  max_examples: Optional[int] = None,
):
  """Loads a TFDS data set into numpy arrays.

  Args:
    name: the TFDS name (``emnist``, ``emnist/digits``, ...).
    split: the split.
    data_dir: TFDS's data folder.
    download: let TFDS download it.
    max_examples: read at most this many examples.

  Returns:
    (x, y, num_classes) for image sets (x uint8 [N, H, W, C]); for
    'tiny_shakespeare', the text of the split as a str.
  """
  import tensorflow_datasets as tfds

  if not is_known(name):
    raise ConfigError(
      'dataset',
      f'unknown tfds data set {name!r}; choose one of '
      f'{sorted(TFDS_DATASETS)} (a builder config may follow: emnist/digits)',
    )
  tfds_name = name
  x_key, y_key = TFDS_DATASETS[name.partition('/')[0]]
  if download:
    tfds.builder(tfds_name, data_dir=data_dir).download_and_prepare(
      file_format='array_record'
    )
  try:
    source = tfds.data_source(tfds_name, split=split, data_dir=data_dir)
  except Exception as e:  # TFDS raises several types for missing data
    raise FileNotFoundError(
      f'TFDS data set {tfds_name!r} is not prepared in '
      f'data_dir={data_dir or "~/tensorflow_datasets"} '
      f'({type(e).__name__}); prepare it once online with '
      f'load_tfds({name!r}, download=True) (needs the [tfds] extra)'
    ) from None
  n = len(source) if max_examples is None else min(len(source), max_examples)
  if y_key is None:
    parts = [source[i][x_key] for i in range(n)]
    return ''.join(
      p.decode('utf-8') if isinstance(p, bytes) else str(p) for p in parts
    )
  xs = np.stack([np.asarray(source[i][x_key]) for i in range(n)])
  ys = np.array([int(source[i][y_key]) for i in range(n)], np.int32)
  info = tfds.builder(tfds_name, data_dir=data_dir).info
  num_classes = info.features[y_key].num_classes
  if xs.ndim == 3:
    xs = xs[..., None]
  return xs.astype(np.uint8), ys, num_classes


def tfds_pool(
  name: str, data_dir: Optional[str] = None, max_examples: Optional[int] = None
):
  """The pool of ``--dataset=tfds:<name>`` (``load_tfds``'s train split):
  the ``Pool`` reader of every TFDS name.

  Args:
    name: ``tfds:<TFDS name>[/<config>]``.
    data_dir: TFDS's data folder.
    max_examples: read at most this many.

  Returns:
    ``(x, y, num_classes)``.
  """
  return load_tfds(
    name[len('tfds:') :], data_dir=data_dir, max_examples=max_examples
  )


def tiny_shakespeare_clients(
  num_clients: int, options, data_dir: Optional[str] = None
):
  """Tiny Shakespeare's roles as clients from TFDS's text: the ``Pool``
  reader of ``--dataset=tfds:tiny_shakespeare``.

  Args:
    num_clients: the clients.
    options: its ``TextOptions``.
    data_dir: TFDS's data folder.

  Returns:
    ``([x_i], [y_i], the vocabulary's size)``.
  """
  text = load_tfds('tiny_shakespeare', data_dir=data_dir)
  return in_memory.tinyshakespeare_clients(
    num_clients, options, data_dir=data_dir, text=text
  )
