"""Federated Shakespeare (Caldas et al., LEAF; 715 speaking roles) from
FedJAX's SQLite files (``shakespeare_{train,test}.sqlite``), preprocessed as
``fedjax/datasets/shakespeare.py``: a client's snippets joined with BOS/EOS
into one character sequence cut into x/y pairs of ``seq_len`` (FedJAX's
86-character table; PAD 0, BOS 1, EOS 2, OOV 89; 90 classes).
"""

import numpy as np

from fedjax_personal.datasets import sources
from fedjax_personal.datasets.natural_data import (BOS, EOS, IGNORE, PAD, NaturalData,
                                                   fedjax_splits)


# FedJAX's Shakespeare table (fedjax/datasets/shakespeare.py): byte vocab[i]
# has label 3 + i; 0 PAD, 1 BOS, 2 EOS, 89 OOV.
SHAKESPEARE_VOCAB = (b'dhlptx@DHLPTX $(,048cgkoswCGKOSW[_#\'/37;?bfjnrvzBFJNRVZ"&*.26:\naeimquyAEIMQUY]'
                     b'!%)-159\r')
SHAKESPEARE_OOV = 3 + len(SHAKESPEARE_VOCAB)
SHAKESPEARE_CLASSES = SHAKESPEARE_OOV + 1
_SHAKESPEARE_TABLE = np.full(256, SHAKESPEARE_OOV, np.int32)
for _i, _c in enumerate(SHAKESPEARE_VOCAB):
  _SHAKESPEARE_TABLE[_c] = 3 + _i


def shakespeare_sequences(snippets, seq_len: int):
  """FedJAX's preprocessing of one client: snippets joined as
  ``BOS s_1 EOS BOS s_2 EOS ...`` and cut into x/y rows of ``seq_len``
  (y = x shifted by one; padded target positions IGNORE)."""
  joined = []
  for s in snippets:
    joined += [BOS] + _SHAKESPEARE_TABLE[np.frombuffer(bytes(s), np.uint8)].tolist() + [EOS]
  joined = np.asarray(joined, np.int32)
  if len(joined) < 2:
    return np.zeros((0, seq_len), np.int32), np.zeros((0, seq_len), np.int32)
  rows = -(-(len(joined) - 1) // seq_len)
  x = np.full(rows * seq_len, PAD, np.int32)
  y = np.full(rows * seq_len, IGNORE, np.int32)
  x[:len(joined) - 1], y[:len(joined) - 1] = joined[:-1], joined[1:]
  return x.reshape(rows, seq_len), y.reshape(rows, seq_len)


def load_data(num_clients=None, data_dir=None, download=False, seq_len: int = 80) -> NaturalData:
  """Federated Shakespeare (715 speaking roles), FedJAX's files."""
  paths = list(sources.fetch('shakespeare', data_dir, download).values())
  out = fedjax_splits('shakespeare', paths[0], paths[1], num_clients,
                       lambda ex: shakespeare_sequences(ex['snippets'], seq_len))
  out.num_classes = SHAKESPEARE_CLASSES
  return out
