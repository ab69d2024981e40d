"""Federated EMNIST (Cohen et al. 2017; 3,400 writers, 62 classes; digits
only 3,383 writers, 10 classes) from FedJAX's SQLite files
(``federated_emnist[_digitsonly]_{train,test}.sqlite``), preprocessed as
``fedjax/datasets/emnist.py``: x = 1 - pixels, [28, 28, 1] float32 (ink 1).
"""

import numpy as np

from fedjax_personal.datasets import sources
from fedjax_personal.datasets.natural_data import NaturalData, fedjax_splits
from fedjax_personal.errors import DataError


def load_data(num_clients=None, data_dir=None, download=False,
              only_digits: bool = False) -> NaturalData:
  """Federated EMNIST (3,400 writers; digits only 3,383), FedJAX's files."""
  name = 'emnist_digits' if only_digits else 'emnist'
  paths = list(sources.fetch(name, data_dir, download).values())
  conv = lambda ex: ((1.0 - np.asarray(ex['pixels'], np.float32))[..., None],
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
