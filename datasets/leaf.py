"""LEAF's data sets (Caldas et al., arXiv 1812.01097) from their JSON files
(``users``, ``num_samples``, ``user_data``; ``train/`` and ``test/``
folders), read as LEAF's own code reads them (``leaf/models/utils``).
"""

import glob
import json
import os
import re
from typing import Dict, List

import numpy as np

from fedjax_personal.datasets import local_files, sources, store_federated_data
from fedjax_personal.datasets.natural_data import NaturalData, listed, take
from fedjax_personal.errors import DataError

__all__ = ['LEAF_LETTERS', 'leaf_split_line', 'load_data', 'read_clients']


# LEAF's Shakespeare characters (leaf/models/utils/language_utils.py).
LEAF_LETTERS = '\n !"&\'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}'
LEAF_SENT140_VOCAB = 10000
LEAF_SENT140_LEN = 25


def _leaf_dir(name: str, split: str, data_dir) -> str:
  for d in local_files.search_dirs(data_dir):
    for rel in (
      f'leaf/{name}/{split}',
      f'leaf/{name}/data/{split}',
      f'{name}/data/{split}',
    ):
      if glob.glob(os.path.join(d, rel, '*.json')):
        return os.path.join(d, rel)
  raise local_files.not_found(
    f'leaf/{name}/{split}/*.json',
    data_dir,
    sources.manual_instructions(f'leaf:{name}'),
  )


def read_leaf(folder: str) -> Dict[str, dict]:
  """{user: {'x': [...], 'y': [...]}} of every JSON file in a LEAF folder."""
  users = {}
  for path in sorted(glob.glob(os.path.join(folder, '*.json'))):
    try:
      with open(path, encoding='utf-8') as f:
        doc = json.load(f)
      for u, n in zip(doc['users'], doc['num_samples']):
        d = doc['user_data'][u]
        if len(d['x']) != n or len(d['y']) != n:
          raise ValueError(
            f'user {u}: num_samples {n}, {len(d["x"])} x and {len(d["y"])} y'
          )
        users[u] = d
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise DataError(
        f'{path}: not a LEAF JSON file ({type(e).__name__}: {e})'
      ) from None
  return users


def leaf_split_line(line: str) -> List[str]:
  """LEAF's ``split_line`` (leaf/models/utils/language_utils.py): words
  with apostrophes, and the punctuation . , ! ? ; as words of their own.

  Args:
    line: a line of text.

  Returns:
    Its words and punctuation marks, in order.
  """
  return re.findall(r"[\w']+|[.,!?;]", line)


def _leaf_convert(name: str, train: Dict[str, dict], test: Dict[str, dict]):
  """(convert(user data) -> (x, y), num_classes) for LEAF data set ``name``."""
  if name == 'shakespeare':
    # LEAF's letter_to_index is ALL_LETTERS.find(c): 80 classes, an unknown
    # character -1. As an input it reads the last embedding row (Python's
    # -1, the id of '}'). As a target LEAF's _one_hot(-1, 80) sets
    # vec[-1] = 1 (leaf/models/utils/language_utils.py): class 79, '}',
    # trained on and scored like any other character; so here.
    table = {c: i for i, c in enumerate(LEAF_LETTERS)}
    last = len(LEAF_LETTERS) - 1
    ids = lambda s: [table.get(c, last) for c in s]
    return (
      lambda d: (
        np.asarray([ids(s) for s in d['x']], np.int32).reshape(len(d['x']), -1),
        np.asarray([table.get(s[0], last) for s in d['y']], np.int32),
      )
    ), len(LEAF_LETTERS)
  if name == 'sent140':
    # LEAF's line_to_indices: words split by [\w']+|[.,!?;], the first 25,
    # unknown words and padding both len(word2id). word2id is LEAF's GloVe
    # vocabulary; here the 10,000 most frequent training words (ids 0..V-1).
    counts: Dict[str, int] = {}
    for d in train.values():
      for row in d['x']:
        for w in leaf_split_line(str(row[4])):
          counts[w] = counts.get(w, 0) + 1
    words = sorted(counts, key=lambda w: (-counts[w], w))[:LEAF_SENT140_VOCAB]
    vocab = {w: i for i, w in enumerate(words)}
    unk = len(vocab)

    def conv(d):
      x = np.full((len(d['x']), LEAF_SENT140_LEN), unk, np.int32)
      for i, row in enumerate(d['x']):
        t = [
          vocab.get(w, unk)
          for w in leaf_split_line(str(row[4]))[:LEAF_SENT140_LEN]
        ]
        x[i, : len(t)] = t
      return x, np.asarray(d['y'], np.int32)

    return conv, 2
  labels = [
    int(v) for d in list(train.values()) + list(test.values()) for v in d['y']
  ]
  num_classes = max(labels) + 1 if labels else 1
  if name == 'femnist':
    return (
      lambda d: (
        np.asarray(d['x'], np.float32).reshape(-1, 28, 28, 1),
        np.asarray(d['y'], np.int32),
      )
    ), 62
  return (
    lambda d: (np.asarray(d['x'], np.float32), np.asarray(d['y'], np.int32))
  ), num_classes


def read_clients(name: str, num_clients=None, data_dir=None) -> NaturalData:
  """A LEAF data set from its JSON files (users in sorted order).

  x: femnist [28, 28, 1] float32 as LEAF writes it; shakespeare 80 character
  ids (LEAF's 80 letters, 80 classes) predicting the next one; sent140 the
  tweet's first 25 words (LEAF's split) as ids of the 10,000 most frequent
  training words, unknown words and padding 10,000 (LEAF's model uses GloVe
  vectors; here ids for a learned embedding);
  others (synthetic) the feature vector as it is.

  Args:
    name: LEAF's data set name (``femnist``, ``shakespeare``, ``sent140``,
      ``synthetic``).
    num_clients: the first N users (None: all).
    data_dir: the folder holding ``leaf/<name>/{train,test}``.

  Returns:
    The users as a ``NaturalData``.
  """
  tr_dir, te_dir = (
    _leaf_dir(name, 'train', data_dir),
    _leaf_dir(name, 'test', data_dir),
  )
  train, test = read_leaf(tr_dir), read_leaf(te_dir)
  users = sorted(train)
  n = take(len(users), num_clients, f'leaf:{name}')
  conv, num_classes = _leaf_convert(name, train, test)
  try:
    tr = [conv(train[u]) for u in users[:n]]
    te = []
    for u, (x, y) in zip(users[:n], tr):
      te.append(
        conv(test[u])
        if u in test and test[u]['y']
        else (
          np.zeros((0,) + x.shape[1:], x.dtype),
          np.zeros((0,) + y.shape[1:], y.dtype),
        )
      )
  except (ValueError, TypeError, IndexError) as e:
    raise DataError(
      f'{tr_dir}: LEAF {name} examples of an unexpected shape ({e})'
    ) from None
  for part in (tr, te):
    for _, y in part:
      if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise DataError(f'{tr_dir}: labels outside [0, {num_classes})')
  return NaturalData(
    listed(users[:n], tr, te),
    n,
    num_classes,
    len(users),
    sorted(
      glob.glob(os.path.join(tr_dir, '*.json'))
      + glob.glob(os.path.join(te_dir, '*.json'))
    ),
  )


def load_data(name: str, cache_dir=None, *, num_clients=None, data_dir=None):
  """``(train, test)`` federated data of LEAF's ``name`` (FedJAX's
  ``load_data`` names, ``federated``), read as LEAF's code reads them.

  Args:
    name: ``femnist``, ``shakespeare``, ``sent140`` or ``synthetic``.
    cache_dir: the folder holding ``leaf/<name>/`` (``data_dir`` is the
      same); LEAF's files are built with LEAF's scripts, never downloaded.
    num_clients: the first N users (None: all).
    data_dir: the same as ``cache_dir``.

  Returns:
    ``(train, test)`` ``store_federated_data.FederatedData``.
  """
  return store_federated_data.load(
    f'leaf:{name}', 'sqlite', cache_dir, num_clients, False, data_dir
  )
