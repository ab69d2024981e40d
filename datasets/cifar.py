"""CIFAR-10 and CIFAR-100 pools from their published archives.

The python archives of the CIFAR page (``cifar-10-python.tar.gz``:
``cifar-10-batches-py/data_batch_1..5`` and ``test_batch``;
``cifar-100-python.tar.gz``: ``cifar-100-python/train`` and ``test``, with
fine and coarse labels) hold pickled dicts with ``data`` uint8 [N, 3072]
(channel-major 32x32 planes) and the labels. A JPEG re-encoding packed as an
``.npz`` (``cifar10_jpeg.npz``: ``{train,test}_jpeg`` concatenated JPEG
files, ``{train,test}_offsets``, ``{train,test}_labels``) is accepted too for
CIFAR-10 when no python archive is found. Either is decoded once into the
cache, keyed by the archive's SHA-256.
"""

import io
import pickle
import tarfile
import zlib

import numpy as np
from PIL import Image

from fedjax_personal.datasets import local_files, sources
from fedjax_personal.errors import DataError

__all__ = ['load']


JPEG_NPZ = 'cifar10_jpeg.npz'
_MEMBERS = {
  'cifar10': {
    'train': [f'cifar-10-batches-py/data_batch_{i}' for i in range(1, 6)],
    'test': ['cifar-10-batches-py/test_batch'],
  },
  'cifar100_python': {
    'train': ['cifar-100-python/train'],
    'test': ['cifar-100-python/test'],
  },
}
_LABEL_KEY = {'cifar10': b'labels', 'cifar100_python': b'fine_labels'}
_NUM_CLASSES = {'cifar10': 10, 'cifar100_python': 100}


def _unpickle(raw: bytes) -> dict:
  return pickle.loads(raw, encoding='bytes')


def decode_python_archive(path, which: str) -> dict:
  """{train,test}_{x,y} (and coarse labels for CIFAR-100) of a python archive.

  Raises:
    DataError naming the file: not a tar.gz, truncated, missing batches.
  """
  out = {}
  try:
    with tarfile.open(path, 'r:gz') as tar:
      for part, members in _MEMBERS[which].items():
        xs, ys, coarse = [], [], []
        for m in members:
          f = tar.extractfile(m)
          if f is None:
            raise KeyError(m)
          d = _unpickle(f.read())
          xs.append(
            np.asarray(d[b'data'], np.uint8)
            .reshape(-1, 3, 32, 32)
            .transpose(0, 2, 3, 1)
          )
          ys.append(np.asarray(d[_LABEL_KEY[which]], np.int32))
          if which == 'cifar100_python':
            coarse.append(np.asarray(d[b'coarse_labels'], np.int32))
        out[f'{part}_x'], out[f'{part}_y'] = (
          np.concatenate(xs),
          np.concatenate(ys),
        )
        if coarse:
          out[f'{part}_coarse'] = np.concatenate(coarse)
        if len(out[f'{part}_x']) != len(out[f'{part}_y']):
          raise ValueError(
            f'{part}: {len(out[f"{part}_x"])} images, {len(out[f"{part}_y"])} '
            f'labels'
          )
  except (
    tarfile.TarError,
    OSError,
    EOFError,
    zlib.error,
    KeyError,
    ValueError,
    pickle.UnpicklingError,
  ) as e:
    raise DataError(
      f'{path}: not a complete CIFAR python archive ({type(e).__name__}: {e}); '
      'delete it and download it again (--download)'
    ) from None
  return out


def decode_jpeg_npz(src) -> dict:
  """Decodes the JPEG ``.npz``; DataError naming it when it is not one."""
  try:
    arc = np.load(src)
    out = {}
    for part in ('train', 'test'):
      jpeg, offs = arc[f'{part}_jpeg'], arc[f'{part}_offsets']
      imgs = np.empty((len(offs) - 1, 32, 32, 3), np.uint8)
      for i in range(len(offs) - 1):
        imgs[i] = np.asarray(
          Image.open(io.BytesIO(jpeg[offs[i] : offs[i + 1]].tobytes())).convert(
            'RGB'
          )
        )
      out[f'{part}_x'], out[f'{part}_y'] = (
        imgs,
        arc[f'{part}_labels'].astype(np.int32),
      )
  except Exception as e:
    raise DataError(
      f'{src}: not a valid CIFAR-10 JPEG archive ({type(e).__name__}: {e})'
    ) from None
  return out


def _cache_matches(cache, digest: str) -> bool:
  try:
    with np.load(cache) as arc:
      return str(arc['source_sha256']) == digest
  except Exception:  # missing, truncated or from an older version: rebuild
    return False


def _decoded(src, decode, tag: str):
  """The decoded arrays of archive ``src``, from the cache when it holds
  them."""
  digest = local_files.sha256_file(src)
  # Keyed by the archive's content: another archive (even of the same size)
  # never reads this cache, and the cache names the archive it came from.
  cache = local_files.cache_dir() / f'{tag}_decoded_{digest[:16]}.npz'
  if not _cache_matches(cache, digest):
    out = decode(src)
    out['source_sha256'] = np.array(digest)

    def write(tmp):
      with open(tmp, 'wb') as f:
        np.savez(f, **out)

    local_files.write_atomically(cache, write)
  return np.load(cache)


def _check(src, arc, num_classes):
  for part in ('train', 'test'):
    y = arc[f'{part}_y']
    if len(y) != len(arc[f'{part}_x']) or (
      y.size and (y.min() < 0 or y.max() >= num_classes)
    ):
      raise DataError(
        f'{src}: {part}: {len(arc[f"{part}_x"])} images, {len(y)} labels in '
        f'[{y.min(initial=0)}, {y.max(initial=0)}], expected [0, {num_classes})'
      )


def load(
  which: str = 'cifar10',
  data_dir=None,
  split: str = 'all',
  download: bool = False,
):
  """A CIFAR pool: uint8 [N, 32, 32, 3], int32 labels, number of classes.

  Args:
    which: 'cifar10' or 'cifar100_python' (CIFAR-100's fine labels).
    split: 'train', 'test' or 'all' (train first).
    download: fetch the python archive when no copy is found.

  Returns:
    ``(x, y, num_classes)``.
  """
  if split not in ('train', 'test', 'all'):
    raise ValueError(
      f"cifar split must be 'train', 'test' or 'all', got {split!r}"
    )
  name = sources.FILES[which][0].name
  src = local_files.locate(name, data_dir)
  if src is None and which == 'cifar10':
    src = local_files.locate(JPEG_NPZ, data_dir)
  if src is not None and src.name == JPEG_NPZ:
    arc = _decoded(src, decode_jpeg_npz, 'cifar10_jpeg')
  else:
    src = sources.fetch(which, data_dir, download)[name]
    arc = _decoded(src, lambda p: decode_python_archive(p, which), which)
  _check(src, arc, _NUM_CLASSES[which])
  if split == 'all':
    return (
      np.concatenate([arc['train_x'], arc['test_x']]),
      np.concatenate([arc['train_y'], arc['test_y']]),
      _NUM_CLASSES[which],
    )
  return arc[f'{split}_x'], arc[f'{split}_y'], _NUM_CLASSES[which]
