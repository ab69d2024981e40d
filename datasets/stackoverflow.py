"""Stack Overflow (342,477 train users) from FedJAX's SQLite files
(``stackoverflow_{train,held_out,test}.sqlite``, ``stackoverflow.word_count``),
preprocessed as ``fedjax/datasets/stackoverflow.py``: each sentence
``[BOS] words [EOS]`` as ids of the ``vocab_size`` most frequent words, one
OOV id, x/y truncated or padded to ``seq_len`` (vocab_size + 4 classes); its
next-word accuracy under each published definition. ``load_data`` gives
FedJAX's objects (the raw ``tokens`` and ``domain_id``) and
``StackoverflowTokenizer`` FedJAX's tokenizer, in NumPy.
"""

import dataclasses
from typing import Optional

import numpy as np

from fedjax_personal.datasets import (
  sources,
  sqlite_federated_data,
  sqlite_formats,
  store_federated_data,
)
from fedjax_personal.datasets.natural_data import (
  BOS,
  EOS,
  PAD,
  NaturalData,
  client_id,
  converted,
  fedjax_splits,
  take,
)
from fedjax_personal.datasets.options import TextOptions
from fedjax_personal.datasets.stackoverflow_words import (
  STACKOVERFLOW_ROWS,
  DefaultWordTokenizer,
  StackoverflowTokenizer,
  default_vocab,
  read_word_count,
  tokenize_sentences,
  word_ids,
)
from fedjax_personal.errors import ConfigError
from fedjax_personal.hparams import hparam

__all__ = [
  'default_vocab',
  'DefaultWordTokenizer',
  'load_data',
  'load_split',
  'preprocess_client',
  'read_clients',
  'read_held_out',
  'SPLITS',
  'STACKOVERFLOW_ACCURACIES',
  'stackoverflow_accuracy',
  'STACKOVERFLOW_ROWS',
  'stackoverflow_unscored',
  'StackOverflowOptions',
  'StackoverflowTokenizer',
  'tokenize_sentences',
  'VALIDATION_EXAMPLES',
  'word_ids',
]


def stackoverflow_unscored(num_classes: int):
  """The ids next-word accuracy leaves out (PAD, BOS, EOS, the OOV bucket):
  Reddi et al.'s and the partial-personalization seed's accuracy counts only
  in-vocabulary targets (the loss counts every non-pad one).

  Args:
    num_classes: the vocabulary + 4 (the OOV id is the last).

  Returns:
    The four ids, as a tuple.
  """
  return (PAD, BOS, EOS, num_classes - 1)


#: Stack Overflow next-word accuracies as published: name -> (what it
#: counts, in words; targets not scored; classes never predicted), the ids
#: given by ``stackoverflow_accuracy``.
STACKOVERFLOW_ACCURACIES = {
  'in_vocab': 'in-vocabulary next word: targets PAD, BOS, EOS and OOV not scored (Reddi et '
  'al.; the partial-personalization seed)',
  'fedjax_in_vocab': "FedJAX's accuracy_in_vocab: targets PAD and EOS not scored; PAD, BOS, "
  'EOS and OOV never predicted, so an OOV target is a miss',
}


def stackoverflow_accuracy(name: str, num_classes: int):
  """(unscored targets, unpredicted classes, definition) of a published
  Stack Overflow accuracy (``STACKOVERFLOW_ACCURACIES``).

  Args:
    name: a ``STACKOVERFLOW_ACCURACIES`` key.
    num_classes: the vocabulary + 4.

  Returns:
    ``(unscored targets, unpredicted classes, definition)``.
  """
  oov = num_classes - 1
  if name == 'fedjax_in_vocab':  # fedjax/models/stackoverflow.py's eval_metrics
    return (PAD, EOS), (PAD, BOS, EOS, oov), STACKOVERFLOW_ACCURACIES[name]
  if name == 'in_vocab':
    return (
      stackoverflow_unscored(num_classes),
      (),
      STACKOVERFLOW_ACCURACIES[name],
    )
  raise ValueError(
    f'unknown Stack Overflow accuracy {name!r}; choose from '
    f'{sorted(STACKOVERFLOW_ACCURACIES)}'
  )


#: The test sets of Stack Overflow (``--stackoverflow_test``).
STACKOVERFLOW_TESTS = ('train_users', 'tff_users', 'tff_test_file')
#: Examples of the pooled test users TFF's task takes for validation.
VALIDATION_EXAMPLES = 10000


@dataclasses.dataclass(frozen=True)
class StackOverflowOptions(TextOptions):
  """Stack Overflow's options: its vocabulary, rows, test set and accuracy."""

  DEFAULT_SEQ_LEN = 20
  held_out_choice = (
    'stackoverflow_test',
    "train_users (the train users' own test posts)",
  )
  vocab_size: Optional[int] = hparam(
    None,
    'stackoverflow: the vocabulary, its most frequent '
    'words (plus PAD, BOS, EOS and one OOV id). Default: 10000, '
    'as Reddi et al. and the partial-personalization seed.',
    minimum=1,
  )
  stackoverflow_test: str = hparam(
    'train_users',
    'stackoverflow: the test set. train_users: the '
    "train users' own posts in the test file; tff_users: every "
    'user of the test file (204,088) held out, their pooled posts '
    'the test set after 10,000 are taken out for validation, as '
    "Reddi et al.'s task (google-research/federated) evaluates "
    'every round; tff_test_file: every post of the test file, '
    'the set its final test_fn reports (validation + test).',
    choices=STACKOVERFLOW_TESTS,
  )
  stackoverflow_rows: str = hparam(
    'fedjax',
    'stackoverflow: how posts become rows. fedjax: '
    "FedJAX's tokenizer (after the last word PAD, targets past EOS "
    "not in the loss); tff: google-research/federated's (after the "
    'last word EOS, every target past it PAD and in the loss, as '
    "its Keras model's unmasked loss counts them).",
    choices=STACKOVERFLOW_ROWS,
  )
  stackoverflow_accuracy: str = hparam(
    'in_vocab',
    'stackoverflow: the next-word accuracy reported. in_vocab: targets PAD, '
    'BOS, '
    'EOS and OOV not scored (Reddi et al., the partial-personalization seed); '
    "fedjax_in_vocab: FedJAX's accuracy_in_vocab (PAD and EOS not scored, OOV "
    'a miss).',
    choices=('in_vocab', 'fedjax_in_vocab'),
  )

  def store_key(self, passed):
    # The seed draws tff_users' validation posts; the others read none.
    return {
      k: v
      for k, v in passed.items()
      if k != 'seed' or self.stackoverflow_test == 'tff_users'
    }

  def describe(self):
    test = {
      'train_users': "the train users' own test posts (train_users)",
      'tff_users': 'every test user, held out, pooled, less 10,000 posts for validation '
      "(tff_users: Reddi et al.'s task)",
      'tff_test_file': 'every post of the test file, its users held out (tff_test_file: '
      "Reddi et al.'s final test)",
    }[self.stackoverflow_test]
    rows = (
      []
      if self.stackoverflow_rows == 'fedjax'
      else [
        "rows: google-research/federated's (EOS after the last word, PAD "
        'targets past it in '
        'the loss)'
      ]
    )
    return ['test set: ' + test] + rows

  def scored(self, model, num_classes):
    unscored, unpredicted, definition = stackoverflow_accuracy(
      self.stackoverflow_accuracy, num_classes
    )
    model = model.scoring_only_words(
      unscored, unpredicted=unpredicted, definition=definition
    )
    return model, f'accuracy: {self.stackoverflow_accuracy}, {definition}'


def validation_counts(
  sizes, seed: int, total: int = VALIDATION_EXAMPLES
) -> np.ndarray:
  """How many of each test user's first examples go to validation:
  google-research/federated's ``stackoverflow_word_prediction.
  get_centralized_datasets`` takes the first ``total`` examples of
  ``create_tf_dataset_from_all_clients()`` (the test users in a shuffled
  order, each user's examples in order) and tests on the rest. TFF draws that
  order unseeded; here it is ``numpy.random.default_rng(seed)``'s
  permutation, so a run is reproducible."""
  sizes = np.asarray(sizes, np.int64)
  out = np.zeros_like(sizes)
  left = total
  for u in np.random.default_rng(seed).permutation(len(sizes)):
    if left <= 0:
      break
    out[u] = min(left, sizes[u])
    left -= out[u]
  return out


def _record_tokenizer(
  word_count_path, vocab_size: int, seq_len: int, rows: str = 'fedjax'
):
  """A FedJAX record's posts as token rows, in the vocabulary of the
  ``vocab_size`` most frequent words of ``stackoverflow.word_count``.

  Args:
    word_count_path: the ``stackoverflow.word_count`` file.
    vocab_size: the words kept.
    seq_len: tokens per row.
    rows: ``STACKOVERFLOW_ROWS``.

  Returns:
    ``record -> (x, y)`` (``tokenize_sentences`` of its ``tokens``).
  """
  vocab = word_ids(read_word_count(word_count_path, vocab_size))
  return lambda ex: tokenize_sentences(ex['tokens'], vocab, seq_len, rows=rows)


def read_clients(
  num_clients=None,
  data_dir=None,
  download=False,
  vocab_size: int = 10000,
  seq_len: int = 20,
  stackoverflow_test: str = 'train_users',
  seed: int = 0,
  stackoverflow_rows: str = 'fedjax',
) -> NaturalData:
  """Stack Overflow (342,477 train users), FedJAX's files.

  Args:
    num_clients: the first N train users (None: all).
    vocab_size: the most frequent words kept.
    seq_len: tokens per row.
    stackoverflow_test: ``'train_users'``: a train user's test examples are
      their posts in the test file (users without any are left out of the
      test statistics; users only in the test file are not read);
      ``'tff_users'`` (Reddi et al.'s task, as google-research/federated
      builds it): the train users train on all their posts, and every user
      of the test file (204,088) follows them as a held-out client
      (``eval_only``, ids ``test/<id>``), their pooled posts the test set
      after ``VALIDATION_EXAMPLES`` of them are taken out for validation (the
      clients' ``val`` split; ``validation_counts``); ``'tff_test_file'``:
      the same users, every post of the test file their test examples (what
      its final ``test_fn`` reports: validation + test).
    seed: the order the validation examples are taken in (``tff_users``).
    stackoverflow_rows: ``STACKOVERFLOW_ROWS`` (``tokenize_sentences``).

  Returns:
    The users as a ``NaturalData``.
  """
  if stackoverflow_test not in STACKOVERFLOW_TESTS:
    raise ConfigError(
      'stackoverflow_test',
      f'unknown {stackoverflow_test!r}; choose one of '
      f'{list(STACKOVERFLOW_TESTS)}',
    )
  paths = sources.fetch(
    'stackoverflow',
    data_dir,
    download,
    which=[
      'stackoverflow_train.sqlite',
      'stackoverflow_test.sqlite',
      'stackoverflow.word_count',
    ],
  )
  tokens = _record_tokenizer(
    paths['stackoverflow.word_count'], vocab_size, seq_len, stackoverflow_rows
  )
  train_path, test_path = (
    paths['stackoverflow_train.sqlite'],
    paths['stackoverflow_test.sqlite'],
  )
  if stackoverflow_test == 'train_users':
    out = fedjax_splits(
      'stackoverflow', train_path, test_path, num_clients, tokens
    )
  else:
    total = sqlite_formats.fedjax_num_clients(train_path)
    n = take(total, num_clients, 'stackoverflow')
    sizes = sqlite_formats.fedjax_sizes(test_path)
    if stackoverflow_test == 'tff_test_file':
      val = np.zeros_like(sizes)
    elif int(sizes.sum()) <= VALIDATION_EXAMPLES:
      raise ConfigError(
        'stackoverflow_test',
        f'tff_users takes {VALIDATION_EXAMPLES:,} test posts '
        f'for validation and tests on the rest; {test_path} holds '
        f'{int(sizes.sum()):,}: give --stackoverflow_test=tff_test_file',
      )
    else:
      val = validation_counts(sizes, seed, VALIDATION_EXAMPLES)

    def stream():
      none = (
        np.zeros((0, seq_len), np.int32),
        np.zeros((0, seq_len), np.int32),
      )
      for cid, ex in sqlite_formats.read_fedjax(train_path, limit=n):
        yield cid, converted(tokens, ex, train_path), none
      for u, (cid, ex) in enumerate(sqlite_formats.read_fedjax(test_path)):
        x, y = converted(tokens, ex, test_path)
        k = int(val[u])
        yield f'test/{client_id(cid)}', none, (x[k:], y[k:]), (x[:k], y[:k])

    held_out = len(val)
    out = NaturalData(
      stream,
      n + held_out,
      0,
      total,
      [str(train_path), str(test_path)],
      eval_only=held_out,
    )
  out.num_classes = vocab_size + 4
  out.files.append(str(paths['stackoverflow.word_count']))
  return out


def read_held_out(
  num_clients=None,
  data_dir=None,
  download=False,
  vocab_size: int = 10000,
  seq_len: int = 20,
  stackoverflow_rows: str = 'fedjax',
) -> NaturalData:
  """Stack Overflow's held-out users (``stackoverflow_held_out.sqlite``,
  38,758 users in TFF's and FedJAX's split), tokenized as ``read_clients``
  tokenizes the train users: every user a held-out client (``eval_only``)
  whose posts are its test examples, none trained. The second value of
  ``load_data``, as FedJAX's ``load_data`` returns it.

  Args:
    num_clients: the first N held-out users (None: all).
    data_dir: where the files are.
    download: fetch missing files.
    vocab_size: the most frequent words kept (of the train users'
      ``stackoverflow.word_count``, as FedJAX's vocabulary).
    seq_len: tokens per row.
    stackoverflow_rows: ``STACKOVERFLOW_ROWS``.

  Returns:
    The held-out users as a ``NaturalData`` of eval-only clients.
  """
  paths = sources.fetch(
    'stackoverflow',
    data_dir,
    download,
    which=['stackoverflow_held_out.sqlite', 'stackoverflow.word_count'],
  )
  tokens = _record_tokenizer(
    paths['stackoverflow.word_count'], vocab_size, seq_len, stackoverflow_rows
  )
  path = paths['stackoverflow_held_out.sqlite']
  total = sqlite_formats.fedjax_num_clients(path)
  n = take(total, num_clients, 'stackoverflow_held_out')

  def stream():
    none = (np.zeros((0, seq_len), np.int32), np.zeros((0, seq_len), np.int32))
    for cid, ex in sqlite_formats.read_fedjax(path, limit=n):
      yield cid, none, converted(tokens, ex, path)

  out = NaturalData(
    stream,
    n,
    vocab_size + 4,
    total,
    [str(path), str(paths['stackoverflow.word_count'])],
    eval_only=n,
  )
  return out


SPLITS = ('train', 'held_out', 'test')


def preprocess_client(client_id, examples):
  """FedJAX's: ``domain_id`` (0 a question, 1 an answer) and ``tokens``,
  the other features dropped.

  Args:
    client_id: not used.
    examples: a user's raw posts (``type``, ``tokens``, ...).

  Returns:
    ``{'domain_id': int32 [N], 'tokens': bytes [N]}``.
  """
  del client_id
  return {
    'domain_id': (examples['type'] == b'answer').astype(np.int32),
    'tokens': examples['tokens'],
  }


def load_split(
  split: str,
  mode: str = 'sqlite',
  cache_dir=None,
  *,
  num_clients=None,
  download: bool = True,
  data_dir=None,
):
  """FedJAX's ``stackoverflow.load_split``: one file's users, raw
  (``creation_date``, ``title``, ``score``, ``tags``, ``tokens``, ``type``),
  in the file's order.

  Args:
    split: one of ``SPLITS``.
    mode, cache_dir, num_clients, download, data_dir: as ``load_data``
      (``num_clients``: the file's first N clients).

  Returns:
    A ``sqlite_federated_data.SQLiteFederatedData``.
  """
  if split not in SPLITS:
    raise ValueError(f'Invalid split={split!r}')
  dataset = 'stackoverflow_held_out' if split == 'held_out' else 'stackoverflow'
  cfg = store_federated_data.data_config(
    dataset, mode, cache_dir, num_clients, download, data_dir
  )
  return sqlite_federated_data.open_split(
    cfg, f'stackoverflow_{split}.sqlite', source='stackoverflow'
  )


def load_data(
  mode: str = 'sqlite',
  cache_dir=None,
  *,
  num_clients=None,
  download: bool = True,
  data_dir=None,
):
  """FedJAX's ``stackoverflow.load_data``: ``(train, held_out, test)``, each
  file's users in its order, with ``domain_id`` and the raw ``tokens``
  (``preprocess_client``); tokenize them with ``StackoverflowTokenizer``
  at any length, as FedJAX's recipe::

    train, held_out, test = stackoverflow.load_data(cache_dir=DIR)
    tokenizer = stackoverflow.StackoverflowTokenizer(cache_dir=DIR)
    train_for_train = train.preprocess_batch(tokenizer.as_preprocess_batch(20))
    test = test.preprocess_batch(tokenizer.as_preprocess_batch(30))

  ``.store`` of a view is the population store the command line trains on
  (``--dataset=stackoverflow``, 10,000 words, 20 tokens), those users alone.

  Args:
    mode: ``'sqlite'``.
    cache_dir: where the files are (``data_dir`` is the same).
    num_clients: the first N users of each file (None: all 342,477 train,
      38,758 held-out and 204,088 test users).
    download: fetch missing files.
    data_dir: the same as ``cache_dir``.

  Returns:
    ``(train, held_out, test)`` ``sqlite_federated_data.SQLiteFederatedData``.
  """
  out = []
  for split in SPLITS:
    dataset = (
      'stackoverflow_held_out' if split == 'held_out' else 'stackoverflow'
    )
    cfg = store_federated_data.data_config(
      dataset, mode, cache_dir, num_clients, download, data_dir
    )
    out.append(
      sqlite_federated_data.open_split(
        cfg,
        f'stackoverflow_{split}.sqlite',
        [preprocess_client],
        source='stackoverflow',
      )
    )
  return tuple(out)
