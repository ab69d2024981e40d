"""Federated EMNIST (Cohen et al. 2017; 3,400 writers, 62 classes; digits
only 3,383 writers, 10 classes) from FedJAX's SQLite files
(``federated_emnist[_digitsonly]_{train,test}.sqlite``), [28, 28, 1] float32,
in either publisher's pixel convention (``PIXELS``): ``fedjax``, x = 1 -
pixels (ink 1), as ``fedjax/datasets/emnist.py``; ``tff``, the files' raw
pixels (ink 0, background 1), as TFF's ``emnist.load_data`` gives them and
Reddi et al.'s task code (google-research/federated) feeds them.
"""

import numpy as np

from fedjax_personal.datasets import sources
from fedjax_personal.datasets.natural_data import NaturalData, fedjax_splits
from fedjax_personal.errors import DataError


PIXELS = {'fedjax': lambda p: 1.0 - p, 'tff': lambda p: p}


def load_data(num_clients=None, data_dir=None, download=False,
              only_digits: bool = False, pixels: str = 'fedjax') -> NaturalData:
  """Federated EMNIST (3,400 writers; digits only 3,383), FedJAX's files,
  in the ``pixels`` convention (``PIXELS``)."""
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
