"""Stack Overflow (342,477 train users) from FedJAX's SQLite files
(``stackoverflow_{train,test}.sqlite``, ``stackoverflow.word_count``),
preprocessed as ``fedjax/datasets/stackoverflow.py``: each sentence
``[BOS] words [EOS]`` as ids of the ``vocab_size`` most frequent words, one
OOV id, x/y truncated or padded to ``seq_len`` (vocab_size + 4 classes); its
next-word accuracy under each published definition.
"""

from typing import Dict, List

import numpy as np

from fedjax_personal.datasets import sources
from fedjax_personal.datasets.natural_data import (BOS, EOS, IGNORE, PAD, NaturalData,
                                                   fedjax_splits)
from fedjax_personal.errors import DataError


def read_word_count(path, vocab_size: int) -> List[str]:
  """The ``vocab_size`` most frequent words of ``stackoverflow.word_count``
  (one ``word count`` per line, most frequent first)."""
  words = []
  try:
    with open(path, encoding='utf-8') as f:
      for line in f:
        if len(words) == vocab_size:
          break
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
          raise DataError(f'{path}: line {len(words) + 1} is not "word count": {line.strip()!r}')
        words.append(parts[0])
  except UnicodeDecodeError as e:
    raise DataError(f'{path}: not UTF-8 text ({e.reason})') from None
  if len(words) < vocab_size:
    raise DataError(f'{path}: {len(words)} words, the vocabulary needs {vocab_size}')
  return words


def stackoverflow_unscored(num_classes: int):
  """The ids next-word accuracy leaves out (PAD, BOS, EOS, the OOV bucket):
  Reddi et al.'s and the partial-personalization seed's accuracy counts only
  in-vocabulary targets (the loss counts every non-pad one)."""
  return (PAD, BOS, EOS, num_classes - 1)


#: Stack Overflow next-word accuracies as published: name -> (what it
#: counts, in words; targets not scored; classes never predicted), the ids
#: given by ``stackoverflow_accuracy``.
STACKOVERFLOW_ACCURACIES = {
    'in_vocab': "in-vocabulary next word: targets PAD, BOS, EOS and OOV not scored (Reddi et "
                "al.; the partial-personalization seed)",
    'fedjax_in_vocab': "FedJAX's accuracy_in_vocab: targets PAD and EOS not scored; PAD, BOS, "
                       "EOS and OOV never predicted, so an OOV target is a miss",
}


def stackoverflow_accuracy(name: str, num_classes: int):
  """(unscored targets, unpredicted classes, definition) of a published
  Stack Overflow accuracy (``STACKOVERFLOW_ACCURACIES``)."""
  oov = num_classes - 1
  if name == 'fedjax_in_vocab':  # fedjax/models/stackoverflow.py's eval_metrics
    return (PAD, EOS), (PAD, BOS, EOS, oov), STACKOVERFLOW_ACCURACIES[name]
  if name == 'in_vocab':
    return stackoverflow_unscored(num_classes), (), STACKOVERFLOW_ACCURACIES[name]
  raise ValueError(f'unknown Stack Overflow accuracy {name!r}; choose from '
                   f'{sorted(STACKOVERFLOW_ACCURACIES)}')


def tokenize_sentences(sentences, vocab: Dict[str, int], seq_len: int):
  """FedJAX's Stack Overflow tokenizer with one OOV bucket: ids 0 PAD, 1 BOS,
  2 EOS, 3.. the vocabulary, len(vocab) + 3 OOV; x = ids[:-1], y = ids[1:]
  of ``[BOS] words [EOS]``, truncated or padded to ``seq_len`` (padded
  targets IGNORE)."""
  oov = len(vocab) + 3
  x = np.full((len(sentences), seq_len), PAD, np.int32)
  y = np.full((len(sentences), seq_len), IGNORE, np.int32)
  for i, s in enumerate(sentences):
    text = s.decode('utf-8') if isinstance(s, bytes) else str(s)
    # FedJAX's tf.strings.split(sep=' '): two spaces delimit an empty token (OOV).
    ids = [BOS] + [vocab.get(w, oov) for w in text.split(' ')] + [EOS]
    n = min(len(ids) - 1, seq_len)
    x[i, :n], y[i, :n] = ids[:n], ids[1:n + 1]
  return x, y


def read_clients(num_clients=None, data_dir=None, download=False, vocab_size: int = 10000,
                 seq_len: int = 20) -> NaturalData:
  """Stack Overflow (342,477 train users), FedJAX's files; a user's test
  examples are their posts in the test file (users without any are left
  out of the test statistics). The held-out file holds other users and is
  not read."""
  paths = sources.fetch('stackoverflow', data_dir, download,
                        which=['stackoverflow_train.sqlite', 'stackoverflow_test.sqlite',
                               'stackoverflow.word_count'])
  words = read_word_count(paths['stackoverflow.word_count'], vocab_size)
  vocab = {w: i + 3 for i, w in enumerate(words)}
  out = fedjax_splits('stackoverflow', paths['stackoverflow_train.sqlite'],
                       paths['stackoverflow_test.sqlite'], num_clients,
                       lambda ex: tokenize_sentences(ex['tokens'], vocab, seq_len))
  out.num_classes = vocab_size + 4
  out.files.append(str(paths['stackoverflow.word_count']))
  return out


def load_data(mode: str = 'sqlite', cache_dir=None, *, num_clients=None, download: bool = True,
              vocab_size: int = 10000, sequence_length: int = 20, data_dir=None, seq_len=None):
  """FedJAX's ``stackoverflow.load_data`` names, over the population store:
  ``(train, test)`` of the train users, each post tokenized (FedJAX's ids:
  PAD 0, BOS 1, EOS 2, words 3.., OOV last; x = ids[:-1], y = ids[1:],
  padded targets PAD) into rows of ``sequence_length``. FedJAX returns the
  raw posts and a third, held-out split, and tokenizes them in its
  experiments; here the store holds them tokenized and the held-out users
  are not read.

  Args:
    mode: ``'sqlite'``.
    cache_dir: where the files are (``data_dir`` is the same).
    num_clients: the first N users (None: all 342,477).
    download: fetch missing files.
    vocab_size: the most frequent words kept.
    sequence_length: tokens per row (``seq_len`` is the same).
    data_dir: the same as ``cache_dir``.
    seq_len: the same as ``sequence_length``.

  Returns:
    ``(train, test)`` ``federated.FederatedData``.
  """
  from fedjax_personal.datasets import federated
  return federated.load('stackoverflow', mode, cache_dir, num_clients, download, data_dir,
                        federated.fedjax_targets, vocab_size=vocab_size,
                        seq_len=seq_len or sequence_length)
