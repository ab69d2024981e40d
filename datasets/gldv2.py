"""Google Landmarks v2 (GLDv2) as the partial-personalization seed
(Pillutla et al., arXiv 2204.03809) runs it: TFF's federated split
(``federated_train.csv``: user_id, image_id, class) over GLDv2's JPEGs, the
users with at least 50 images (the seed's 823), each user's images shuffled
and split half for training, half for test, at most 1,000 each; images
resized to ``image_size`` (the seed's 224) and kept as uint8 RGB; 2,028
classes.
"""

import collections
import csv
import dataclasses
import os
import zlib
from typing import Dict, List, Optional, Tuple

import numpy as np
from PIL import Image, UnidentifiedImageError

from fedjax_personal.datasets import local_files, sources, store_federated_data
from fedjax_personal.datasets.natural_data import NaturalData, take
from fedjax_personal.datasets.options import DataOptions
from fedjax_personal.errors import DataError
from fedjax_personal.hparams import hparam

__all__ = [
  'gldv2_halves',
  'GLDV2_MAX_PER_SPLIT',
  'Gldv2Options',
  'load_data',
  'read_clients',
]


@dataclasses.dataclass(frozen=True)
class Gldv2Options(DataOptions):
  """GLDv2's options."""

  image_size: Optional[int] = hparam(
    None,
    'gldv2: the side of the square images, in pixels '
    '(resized once, into the population store). Default: 224, '
    'as the partial-personalization seed.',
    minimum=8,
  )


GLDV2_CLASSES = 2028
#: The seed's clients: TFF's train users with at least this many images.
GLDV2_MIN_EXAMPLES = 50
#: The seed's ``max_num_elements_per_client``: the cap of each split.
GLDV2_MAX_PER_SPLIT = 1000
GLDV2_IMAGE_SIZE = 224
GLDV2_SPLIT_NAMES = (
  'gldv2/federated_train.csv',
  'landmarks-user-160k/federated_train.csv',
  'federated_train.csv',
)
GLDV2_IMAGE_DIRS = ('gldv2/images', 'landmarks-user-160k/images')


def read_gldv2_split(path) -> Dict[str, List[Tuple[str, int]]]:
  """{user_id: [(image_id, class), ...]} of TFF's ``federated_train.csv``."""
  users = collections.defaultdict(list)
  try:
    with open(path, newline='', encoding='utf-8') as f:
      reader = csv.DictReader(f)
      missing = {'user_id', 'image_id', 'class'} - set(reader.fieldnames or ())
      if missing:
        raise ValueError(
          f'no column {sorted(missing)[0]!r} (it has {reader.fieldnames})'
        )
      for row in reader:
        label = int(row['class'])
        if not 0 <= label < GLDV2_CLASSES:
          raise ValueError(f'class {label} outside [0, {GLDV2_CLASSES})')
        users[row['user_id']].append((row['image_id'], label))
  except (OSError, ValueError, UnicodeDecodeError, csv.Error) as e:
    raise DataError(
      f"{path}: not GLDv2's federated split ({type(e).__name__}: {e})"
    ) from None
  return dict(users)


def gldv2_clients(split: Dict[str, List[Tuple[str, int]]]) -> List[str]:
  """The seed's users (at least GLDV2_MIN_EXAMPLES images), by number."""
  users = [u for u, rows in split.items() if len(rows) >= GLDV2_MIN_EXAMPLES]
  return sorted(
    users, key=lambda u: (0, int(u), u) if u.isdigit() else (1, 0, u)
  )


def gldv2_halves(user: str, n: int) -> Tuple[np.ndarray, np.ndarray]:
  """A user's train and test rows: its images shuffled by a generator seeded
  with the user (the seed shuffles with the client id), the first half
  (rounded up) for training, the rest for test, each capped at
  GLDV2_MAX_PER_SPLIT. Fixed per user: the split is part of the data.

  Args:
    user: the user's id (seeds the shuffle).
    n: the user's images.

  Returns:
    ``(train, test)`` row indices.
  """
  order = np.random.default_rng(zlib.crc32(user.encode())).permutation(n)
  half = (n + 1) // 2
  return order[:half][:GLDV2_MAX_PER_SPLIT], order[half:][:GLDV2_MAX_PER_SPLIT]


def read_image(path, size: int) -> np.ndarray:
  """A JPEG as uint8 RGB [size, size, 3], resized bilinearly (the seed's
  ``tf.image.resize`` to a square, aspect ratio not kept)."""
  try:
    with Image.open(path) as im:
      return np.asarray(
        im.convert('RGB').resize((size, size), Image.Resampling.BILINEAR),
        np.uint8,
      )
  except (OSError, UnidentifiedImageError, ValueError) as e:
    raise DataError(
      f'{path}: not a readable image ({type(e).__name__}: {e}); delete it and '
      f'get '
      'it again'
    ) from None


def _gldv2_split_file(data_dir, download) -> str:
  """The split CSV: the user's own copy, else the one inside TFF's bundle
  (extracted once into the cache, ``local_files.derived_dir``)."""
  path = local_files.locate(GLDV2_SPLIT_NAMES, data_dir, cache=False)
  if path is not None:
    return str(path)
  if (
    not download and local_files.locate(sources.GLDV2_BUNDLE, data_dir) is None
  ):
    raise local_files.not_found(
      f"{GLDV2_SPLIT_NAMES[0]} (or TFF's {sources.GLDV2_BUNDLE} that holds it)",
      data_dir,
      sources.how_to_get('gldv2'),
    )
  bundle = sources.fetch('gldv2', data_dir, download)[sources.GLDV2_BUNDLE]
  return str(
    sources.extract_member(
      bundle,
      'federated_train.csv',
      local_files.derived_dir('extracted', bundle) / GLDV2_SPLIT_NAMES[0],
    )
  )


def _gldv2_image_dir(data_dir, wanted: List[str], download, every_image) -> str:
  """The folder holding the ``wanted`` images; ``--download`` fetches
  ``every_image`` of the seed's users (the same set whatever --num_clients,
  so a continued download's finished shards stay finished)."""
  for d in local_files.search_dirs(data_dir):
    for rel in GLDV2_IMAGE_DIRS:
      if (d / rel).is_dir():
        folder = d / rel
        missing = [i for i in wanted if not (folder / f'{i}.jpg').is_file()]
        if not missing:
          return str(folder)
        if not download:
          raise local_files.MissingDataError(
            f'{folder / (missing[0] + ".jpg")}: not found ({len(missing):,} of '
            f'the '
            f'{len(wanted):,} images of the chosen users are missing); '
            + sources.manual_instructions('gldv2')
          )
  if not download:
    raise local_files.not_found(
      f'{GLDV2_IMAGE_DIRS[0]}/', data_dir, sources.manual_instructions('gldv2')
    )
  folder = local_files.cache_dir() / GLDV2_IMAGE_DIRS[0]
  sources.fetch_gldv2_images(set(every_image), folder)
  return str(folder)


def read_clients(
  num_clients=None,
  data_dir=None,
  download=False,
  image_size: int = GLDV2_IMAGE_SIZE,
) -> NaturalData:
  """GLDv2's federated split as the partial-personalization seed uses it
  (``pfl/data/gldv2.py``): its users with at least 50 images, each user's
  images split half and half into train and test.

  Args:
    num_clients: the first N users (None: all 823).
    data_dir: where the split file and ``gldv2/images`` are.
    download: fetch missing files.
    image_size: each image resized to this square size.

  Returns:
    The users as a ``NaturalData``.

  Raises:
    MissingDataError: the split file or images not found (``--download``
      fetches TFF's split bundle and GLDv2's image shards).
    DataError: a malformed split file or an unreadable image.
  """
  split_path = _gldv2_split_file(data_dir, download)
  split = read_gldv2_split(split_path)
  every = gldv2_clients(split)
  n = take(len(every), num_clients, 'gldv2')
  users = every[:n]
  halves = {u: gldv2_halves(u, len(split[u])) for u in users}
  wanted = [split[u][i][0] for u in users for part in halves[u] for i in part]
  image_dir = _gldv2_image_dir(
    data_dir, wanted, download, [i for u in every for i, _ in split[u]]
  )

  def part(u, rows):
    x = (
      np.stack(
        [
          read_image(
            os.path.join(image_dir, f'{split[u][i][0]}.jpg'), image_size
          )
          for i in rows
        ]
      )
      if len(rows)
      else np.zeros((0, image_size, image_size, 3), np.uint8)
    )
    return x, np.asarray([split[u][i][1] for i in rows], np.int32)

  def stream():
    for u in users:
      tr, te = halves[u]
      yield u, part(u, tr), part(u, te)

  # The image folder's own time stamp changes when images are added or removed.
  return NaturalData(
    stream, n, GLDV2_CLASSES, len(every), [split_path, image_dir]
  )


def load_data(
  mode: str = 'sqlite',
  cache_dir=None,
  *,
  num_clients=None,
  download: bool = True,
  image_size=None,
  data_dir=None,
):
  """``(train, test)`` federated data of the seed's GLDv2 users (FedJAX's
  ``load_data`` names, ``federated``): ``x`` [N, image_size, image_size, 3]
  images, ``y`` [N] int32 landmark ids.

  Args:
    mode: ``'sqlite'`` (the published split file and images).
    cache_dir: where the files are (``data_dir`` is the same).
    num_clients: the first N users (None: all).
    download: fetch a missing split file.
    image_size: the square side (None: the seed's 224).
    data_dir: the same as ``cache_dir``.

  Returns:
    ``(train, test)`` ``store_federated_data.FederatedData``.
  """
  return store_federated_data.load(
    'gldv2',
    mode,
    cache_dir,
    num_clients,
    download,
    data_dir,
    image_size=image_size,
  )
