"""The field's natural federated data sets, read from their published files.

One client per writer (EMNIST), speaking role (Shakespeare), user (Stack
Overflow, LEAF) or Pachinko-allocation client (CIFAR-100, Reddi et al.,
"Adaptive Federated Optimization", arXiv 2003.00295), with the files' own
train/test split. Preprocessing follows FedJAX (``fedjax/datasets/*.py``):

- ``emnist`` / ``emnist_digits``: x = 1 - pixels, [28, 28, 1] float32 (ink 1),
  62 / 10 classes.
- ``shakespeare``: a client's snippets joined with BOS/EOS into one character
  sequence cut into x/y pairs of ``seq_len`` (FedJAX's 86-character table;
  PAD 0, BOS 1, EOS 2, OOV 89; 90 classes).
- ``stackoverflow``: each sentence ``[BOS] words [EOS]`` as ids of the
  ``vocab_size`` most frequent words (``stackoverflow.word_count``), one OOV
  id, x/y truncated or padded to ``seq_len`` (vocab_size + 4 classes).
- ``cifar100``: TFF's file (500 train clients of 100 images, 100 test
  clients of 100 images). ``cifar100_test='tff_clients'`` (Reddi et al.'s
  protocol): the train clients train on all their images and TFF's test
  clients are held-out clients, evaluated and never trained (the store's
  ``eval_only``, ids ``test/<id>``); ``'split'``: each train client's images
  are split with --test_fraction like a pooled data set's.
- ``leaf:<name>``: LEAF's JSON (``users``, ``num_samples``, ``user_data``),
  ``train/`` and ``test/`` folders.
- ``gldv2``: Google Landmarks v2 as the partial-personalization seed
  (Pillutla et al., arXiv 2204.03809) runs it: TFF's federated split
  (``federated_train.csv``: user_id, image_id, class) over GLDv2's JPEGs, the
  users with at least 50 images (the seed's 823), each user's images
  shuffled and split half for training, half for test, at most 1,000 each;
  images resized to ``image_size`` (the seed's 224) and kept as uint8 RGB;
  2,028 classes.

Padded target positions of sequences are -1: left out of the loss and the
accuracy (``core.training.per_example_stats``). Clients without test
examples are trained and left out of the test statistics (counted).
"""

import collections
import csv
import dataclasses
import glob
import json
import os
import re
import zlib
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from fedjax_personal.datasets import files, sources, sqlite_formats
from fedjax_personal.errors import ConfigError, DataError

#: Natural data sets read from published files.
FILE_DATASETS = ('emnist', 'emnist_digits', 'shakespeare', 'stackoverflow', 'cifar100',
                 'gldv2')
IGNORE = -1  # a padded target position


@dataclasses.dataclass
class NaturalData:
  """Per-client examples as the files split them, read client by client.

  Attributes:
    stream: ``stream()`` yields ``(client_id, (x, y) train, (x, y) test)``
      per client in the file's order, reading as it goes (a population
      larger than memory is written to the population store this way).
    num_clients: clients it yields.
    num_classes: output classes.
    total_clients: clients in the file (before --num_clients).
    files: the files read (their contents' SHA-256 are the store's identity).
    split_by_fraction: True when the file's test split holds other clients,
      so the train clients' examples are split with --test_fraction.
    eval_only: how many clients at the end of ``stream`` have only test
      examples (held-out clients, evaluated and never trained).
  """
  stream: Callable[[], Iterator[tuple]]
  num_clients: int
  num_classes: int
  total_clients: int
  files: List[str] = dataclasses.field(default_factory=list)
  split_by_fraction: bool = False
  eval_only: int = 0

  def _all(self):
    if not hasattr(self, '_cache'):
      self._cache = list(self.stream())
    return self._cache

  @property
  def train(self) -> List[tuple]:
    return [tr for _, tr, _ in self._all()]

  @property
  def test(self) -> List[tuple]:
    return [te for _, _, te in self._all()]

  @property
  def client_ids(self) -> List[str]:
    return [client_id(c) for c, _, _ in self._all()]


def _listed(ids, train, test):
  """A ``stream`` over clients already in memory."""
  return lambda: iter(zip(ids, train, test or [None] * len(train)))


def _take(total: int, num_clients: Optional[int], dataset: str) -> int:
  if num_clients is None:
    return total
  if num_clients > total:
    raise ConfigError('num_clients', f'{dataset} has {total:,} clients; --num_clients='
                      f'{num_clients} is too many')
  return num_clients


def client_id(c) -> str:
  """A client id as text (SQLite files may hold bytes)."""
  return c.decode('utf-8', 'replace') if isinstance(c, bytes) else str(c)


def _fedjax_splits(dataset, train_path, test_path, num_clients, convert) -> NaturalData:
  """Train clients of a FedJAX file (first N) with their test examples,
  streamed: each train client's test record is looked up as it is read."""
  total = sqlite_formats.fedjax_num_clients(train_path)
  n = _take(total, num_clients, dataset)
  empty = lambda like: tuple(np.zeros((0,) + a.shape[1:], a.dtype) for a in like)

  def stream():
    wanted = collections.deque()

    def ids():
      while True:
        yield wanted.popleft()
    tests = sqlite_formats.read_fedjax(test_path, client_ids=ids())
    for cid, ex in sqlite_formats.read_fedjax(train_path, limit=n):
      train = _converted(convert, ex, train_path)
      wanted.append(cid)
      test_ex = next(tests)[1]
      yield cid, train, (_converted(convert, test_ex, test_path) if test_ex else empty(train))
  return NaturalData(stream, n, 0, total, [str(train_path), str(test_path)])


def _converted(convert, examples, path):
  try:
    return convert(examples)
  except (KeyError, ValueError, TypeError, IndexError) as e:
    raise DataError(f'{path}: a client record lacks the expected features ({type(e).__name__}: '
                    f'{e})') from None


def load_emnist(only_digits: bool, num_clients=None, data_dir=None, download=False) -> NaturalData:
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
  out = _fedjax_splits(name, paths[0], paths[1], num_clients, checked)
  out.num_classes = classes
  return out


# FedJAX's Shakespeare table (fedjax/datasets/shakespeare.py): byte vocab[i]
# has label 3 + i; 0 PAD, 1 BOS, 2 EOS, 89 OOV.
SHAKESPEARE_VOCAB = (b'dhlptx@DHLPTX $(,048cgkoswCGKOSW[_#\'/37;?bfjnrvzBFJNRVZ"&*.26:\naeimquyAEIMQUY]'
                     b'!%)-159\r')
PAD, BOS, EOS = 0, 1, 2
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


def load_shakespeare(num_clients=None, seq_len: int = 80, data_dir=None, download=False) -> NaturalData:
  """Federated Shakespeare (715 speaking roles), FedJAX's files."""
  paths = list(sources.fetch('shakespeare', data_dir, download).values())
  out = _fedjax_splits('shakespeare', paths[0], paths[1], num_clients,
                       lambda ex: shakespeare_sequences(ex['snippets'], seq_len))
  out.num_classes = SHAKESPEARE_CLASSES
  return out


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


def load_stackoverflow(num_clients=None, vocab_size: int = 10000, seq_len: int = 20, data_dir=None,
                       download=False) -> NaturalData:
  """Stack Overflow (342,477 train users), FedJAX's files; a user's test
  examples are their posts in the test file (users without any are left
  out of the test statistics). The held-out file holds other users and is
  not read."""
  paths = sources.fetch('stackoverflow', data_dir, download,
                        which=['stackoverflow_train.sqlite', 'stackoverflow_test.sqlite',
                               'stackoverflow.word_count'])
  words = read_word_count(paths['stackoverflow.word_count'], vocab_size)
  vocab = {w: i + 3 for i, w in enumerate(words)}
  out = _fedjax_splits('stackoverflow', paths['stackoverflow_train.sqlite'],
                       paths['stackoverflow_test.sqlite'], num_clients,
                       lambda ex: tokenize_sentences(ex['tokens'], vocab, seq_len))
  out.num_classes = vocab_size + 4
  out.files.append(str(paths['stackoverflow.word_count']))
  return out


CIFAR100_FEATURES = {'image': (32, 32, 3), 'label': (), 'coarse_label': ()}


CIFAR100_TESTS = ('split', 'tff_clients')


def load_cifar100(num_clients=None, data_dir=None, download=False,
                  test: str = 'split') -> NaturalData:
  """Federated CIFAR-100 (TFF's ``cifar100.sqlite``: 500 train clients of 100
  images, Pachinko allocation over the coarse and fine labels; 100 test
  clients of 100 images).

  Args:
    num_clients: the first N train clients (None: all 500).
    test: ``'tff_clients'``: the train clients keep all their images and
      TFF's test clients follow them as held-out clients (``eval_only``,
      ids ``test/<id>``), as Reddi et al. (arXiv 2003.00295) evaluate;
      ``'split'``: train clients only, their images split with
      --test_fraction (``split_by_fraction``).
  """
  if test not in CIFAR100_TESTS:
    raise ConfigError('cifar100_test', f'unknown {test!r}; choose one of {list(CIFAR100_TESTS)}')
  path = sources.fetch('cifar100', data_dir, download)['cifar100.sqlite.lzma']
  total = sqlite_formats.tff_num_clients(path, 'train')
  n = _take(total, num_clients, 'cifar100')
  held_out = sqlite_formats.tff_num_clients(path, 'test') if test == 'tff_clients' else 0
  if test == 'tff_clients' and held_out == 0:
    raise DataError(f'{path}: no test client (--cifar100_test=tff_clients needs TFF\'s test '
                    'split); use --cifar100_test=split')

  def images(cid, ex):
    if ex['image'].size and (ex['image'].min() < 0 or ex['image'].max() > 255):
      raise DataError(f'{path}: client {cid}: pixel values outside [0, 255]')
    return ex['image'].astype(np.uint8), ex['label'].astype(np.int32)

  def stream():
    none = (np.zeros((0, 32, 32, 3), np.uint8), np.zeros((0,), np.int32))
    for cid, ex in sqlite_formats.read_tff(path, 'train', CIFAR100_FEATURES, limit=n):
      yield cid, images(cid, ex), none
    if held_out:
      for cid, ex in sqlite_formats.read_tff(path, 'test', CIFAR100_FEATURES):
        yield f'test/{client_id(cid)}', none, images(cid, ex)
  return NaturalData(stream, n + held_out, 100, total, [str(path)],
                     split_by_fraction=not held_out, eval_only=held_out)


# -- LEAF ---------------------------------------------------------------------

# LEAF's Shakespeare characters (leaf/models/utils/language_utils.py).
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
LEAF_SENT140_VOCAB = 10000
LEAF_SENT140_LEN = 25


def _leaf_dir(name: str, split: str, data_dir) -> str:
  for d in files.search_dirs(data_dir):
    for rel in (f'leaf/{name}/{split}', f'leaf/{name}/data/{split}', f'{name}/data/{split}'):
      if glob.glob(os.path.join(d, rel, '*.json')):
        return os.path.join(d, rel)
  raise files.not_found(f'leaf/{name}/{split}/*.json', data_dir,
                        sources.manual_instructions(f'leaf:{name}'))


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
          raise ValueError(f'user {u}: num_samples {n}, {len(d["x"])} x and {len(d["y"])} y')
        users[u] = d
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise DataError(f'{path}: not a LEAF JSON file ({type(e).__name__}: {e})') from None
  return users


def leaf_split_line(line: str) -> List[str]:
  """LEAF's ``split_line`` (leaf/models/utils/language_utils.py): words
  with apostrophes, and the punctuation . , ! ? ; as words of their own."""
  return re.findall(r"[\w']+|[.,!?;]", line)


def _leaf_convert(name: str, train: Dict[str, dict], test: Dict[str, dict]):
  """(convert(user data) -> (x, y), num_classes) for LEAF data set ``name``."""
  if name == 'shakespeare':
    # LEAF's letter_to_index is ALL_LETTERS.find(c): 80 classes, an unknown
    # character -1. As an input it reads the last embedding row (Python's
    # -1, the id of '}'); as a target -1 is a position without loss here,
    # as LEAF's one_hot(-1) (all zeros) gives no loss.
    table = {c: i for i, c in enumerate(LEAF_LETTERS)}
    last = len(LEAF_LETTERS) - 1
    ids = lambda s: [table.get(c, last) for c in s]
    return (lambda d: (np.asarray([ids(s) for s in d['x']], np.int32).reshape(len(d['x']), -1),
                       np.asarray([table.get(s[0], -1) for s in d['y']], np.int32))), \
        len(LEAF_LETTERS)
  if name == 'sent140':
    # LEAF's line_to_indices: words split by [\w']+|[.,!?;], the first 25,
    # unknown words and padding both len(word2id). word2id is LEAF's GloVe
    # vocabulary; here the 10,000 most frequent training words (ids 0..V-1).
    counts = {}
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
        t = [vocab.get(w, unk) for w in leaf_split_line(str(row[4]))[:LEAF_SENT140_LEN]]
        x[i, :len(t)] = t
      return x, np.asarray(d['y'], np.int32)
    return conv, 2
  labels = [int(v) for d in list(train.values()) + list(test.values()) for v in d['y']]
  num_classes = max(labels) + 1 if labels else 1
  if name == 'femnist':
    return (lambda d: (np.asarray(d['x'], np.float32).reshape(-1, 28, 28, 1),
                       np.asarray(d['y'], np.int32))), 62
  return (lambda d: (np.asarray(d['x'], np.float32), np.asarray(d['y'], np.int32))), num_classes


def load_leaf(name: str, num_clients=None, data_dir=None) -> NaturalData:
  """A LEAF data set from its JSON files (users in sorted order).

  x: femnist [28, 28, 1] float32 as LEAF writes it; shakespeare 80 character
  ids (LEAF's 80 letters, 80 classes) predicting the next one; sent140 the
  tweet's first 25 words (LEAF's split) as ids of the 10,000 most frequent
  training words, unknown words and padding 10,000 (LEAF's model uses GloVe
  vectors; here ids for a learned embedding);
  others (synthetic) the feature vector as it is.
  """
  tr_dir, te_dir = _leaf_dir(name, 'train', data_dir), _leaf_dir(name, 'test', data_dir)
  train, test = read_leaf(tr_dir), read_leaf(te_dir)
  users = sorted(train)
  n = _take(len(users), num_clients, f'leaf:{name}')
  conv, num_classes = _leaf_convert(name, train, test)
  try:
    tr = [conv(train[u]) for u in users[:n]]
    te = []
    for u, (x, y) in zip(users[:n], tr):
      te.append(conv(test[u]) if u in test and test[u]['y'] else
                (np.zeros((0,) + x.shape[1:], x.dtype), np.zeros((0,) + y.shape[1:], y.dtype)))
  except (ValueError, TypeError, IndexError) as e:
    raise DataError(f'{tr_dir}: LEAF {name} examples of an unexpected shape ({e})') from None
  for part in (tr, te):
    for _, y in part:
      lowest = -1 if name == 'shakespeare' else 0  # -1: LEAF's unknown character
      if y.size and (y.min() < lowest or y.max() >= num_classes):
        raise DataError(f'{tr_dir}: labels outside [0, {num_classes})')
  return NaturalData(_listed(users[:n], tr, te), n, num_classes, len(users),
                     sorted(glob.glob(os.path.join(tr_dir, '*.json'))
                            + glob.glob(os.path.join(te_dir, '*.json'))))


# -- Google Landmarks v2 (GLDv2) ----------------------------------------------

GLDV2_CLASSES = 2028
#: The seed's clients: TFF's train users with at least this many images.
GLDV2_MIN_EXAMPLES = 50
#: The seed's ``max_num_elements_per_client``: the cap of each split.
GLDV2_MAX_PER_SPLIT = 1000
GLDV2_IMAGE_SIZE = 224
GLDV2_SPLIT_NAMES = ('gldv2/federated_train.csv', 'landmarks-user-160k/federated_train.csv',
                     'federated_train.csv')
GLDV2_IMAGE_DIRS = ('gldv2/images', 'landmarks-user-160k/images')


def read_gldv2_split(path) -> Dict[str, List[Tuple[str, int]]]:
  """{user_id: [(image_id, class), ...]} of TFF's ``federated_train.csv``."""
  users = collections.defaultdict(list)
  try:
    with open(path, newline='', encoding='utf-8') as f:
      reader = csv.DictReader(f)
      missing = {'user_id', 'image_id', 'class'} - set(reader.fieldnames or ())
      if missing:
        raise ValueError(f'no column {sorted(missing)[0]!r} (it has {reader.fieldnames})')
      for row in reader:
        label = int(row['class'])
        if not 0 <= label < GLDV2_CLASSES:
          raise ValueError(f'class {label} outside [0, {GLDV2_CLASSES})')
        users[row['user_id']].append((row['image_id'], label))
  except (OSError, ValueError, UnicodeDecodeError, csv.Error) as e:
    raise DataError(f'{path}: not GLDv2\'s federated split ({type(e).__name__}: {e})') from None
  return dict(users)


def gldv2_clients(split: Dict[str, List[Tuple[str, int]]]) -> List[str]:
  """The seed's users (at least GLDV2_MIN_EXAMPLES images), by number."""
  users = [u for u, rows in split.items() if len(rows) >= GLDV2_MIN_EXAMPLES]
  return sorted(users, key=lambda u: (0, int(u), u) if u.isdigit() else (1, 0, u))


def gldv2_halves(user: str, n: int) -> Tuple[np.ndarray, np.ndarray]:
  """A user's train and test rows: its images shuffled by a generator seeded
  with the user (the seed shuffles with the client id), the first half
  (rounded up) for training, the rest for test, each capped at
  GLDV2_MAX_PER_SPLIT. Fixed per user: the split is part of the data."""
  order = np.random.default_rng(zlib.crc32(user.encode())).permutation(n)
  half = (n + 1) // 2
  return order[:half][:GLDV2_MAX_PER_SPLIT], order[half:][:GLDV2_MAX_PER_SPLIT]


def read_image(path, size: int) -> np.ndarray:
  """A JPEG as uint8 RGB [size, size, 3], resized bilinearly (the seed's
  ``tf.image.resize`` to a square, aspect ratio not kept)."""
  from PIL import Image, UnidentifiedImageError
  try:
    with Image.open(path) as im:
      return np.asarray(im.convert('RGB').resize((size, size), Image.BILINEAR), np.uint8)
  except (OSError, UnidentifiedImageError, ValueError) as e:
    raise DataError(f'{path}: not a readable image ({type(e).__name__}: {e}); delete it and get '
                    'it again') from None


def _gldv2_split_file(data_dir, download) -> str:
  path = files.locate(GLDV2_SPLIT_NAMES, data_dir)
  if path is not None:
    return str(path)
  if not download and files.locate(sources.GLDV2_BUNDLE, data_dir) is None:
    raise files.not_found(
        f'{GLDV2_SPLIT_NAMES[0]} (or TFF\'s {sources.GLDV2_BUNDLE} that holds it)', data_dir,
        sources.how_to_get('gldv2'))
  bundle = sources.fetch('gldv2', data_dir, download)[sources.GLDV2_BUNDLE]
  return str(sources.extract_member(bundle, 'federated_train.csv',
                                    files.cache_dir() / GLDV2_SPLIT_NAMES[0]))


def _gldv2_image_dir(data_dir, wanted: List[str], download, every_image) -> str:
  """The folder holding the ``wanted`` images; ``--download`` fetches
  ``every_image`` of the seed's users (the same set whatever --num_clients,
  so a continued download's finished shards stay finished)."""
  for d in files.search_dirs(data_dir):
    for rel in GLDV2_IMAGE_DIRS:
      if (d / rel).is_dir():
        folder = d / rel
        missing = [i for i in wanted if not (folder / f'{i}.jpg').is_file()]
        if not missing:
          return str(folder)
        if not download:
          raise files.MissingDataError(
              f'{folder / (missing[0] + ".jpg")}: not found ({len(missing):,} of the '
              f'{len(wanted):,} images of the chosen users are missing); '
              + sources.manual_instructions('gldv2'))
  if not download:
    raise files.not_found(f'{GLDV2_IMAGE_DIRS[0]}/', data_dir, sources.manual_instructions('gldv2'))
  folder = files.cache_dir() / GLDV2_IMAGE_DIRS[0]
  sources.fetch_gldv2_images(set(every_image), folder)
  return str(folder)


def load_gldv2(num_clients=None, image_size: int = GLDV2_IMAGE_SIZE, data_dir=None,
               download=False) -> NaturalData:
  """GLDv2's federated split as the partial-personalization seed uses it
  (``pfl/data/gldv2.py``): its users with at least 50 images, each user's
  images split half and half into train and test.

  Raises:
    MissingDataError: the split file or images not found (``--download``
      fetches TFF's split bundle and GLDv2's image shards).
    DataError: a malformed split file or an unreadable image.
  """
  split_path = _gldv2_split_file(data_dir, download)
  split = read_gldv2_split(split_path)
  every = gldv2_clients(split)
  n = _take(len(every), num_clients, 'gldv2')
  users = every[:n]
  halves = {u: gldv2_halves(u, len(split[u])) for u in users}
  wanted = [split[u][i][0] for u in users for part in halves[u] for i in part]
  image_dir = _gldv2_image_dir(data_dir, wanted, download,
                               [i for u in every for i, _ in split[u]])

  def part(u, rows):
    x = np.stack([read_image(os.path.join(image_dir, f'{split[u][i][0]}.jpg'), image_size)
                  for i in rows]) if len(rows) else np.zeros((0, image_size, image_size, 3),
                                                             np.uint8)
    return x, np.asarray([split[u][i][1] for i in rows], np.int32)

  def stream():
    for u in users:
      tr, te = halves[u]
      yield u, part(u, tr), part(u, te)
  # The image folder's own time stamp changes when images are added or removed.
  return NaturalData(stream, n, GLDV2_CLASSES, len(every), [split_path, image_dir])


def load(dataset: str, num_clients=None, seq_len: int = 80, data_dir=None,
         download=False, vocab_size=None, image_size=None,
         cifar100_test: str = 'split') -> NaturalData:
  """A natural data set by its --dataset name (``vocab_size``: Stack
  Overflow's, default 10,000; ``image_size``: GLDv2's, default 224;
  ``cifar100_test``: see ``load_cifar100``)."""
  if dataset == 'gldv2':
    return load_gldv2(num_clients, image_size or GLDV2_IMAGE_SIZE, data_dir, download)
  if dataset in ('emnist', 'emnist_digits'):
    return load_emnist(dataset == 'emnist_digits', num_clients, data_dir, download)
  if dataset == 'shakespeare':
    return load_shakespeare(num_clients, seq_len, data_dir, download)
  if dataset == 'stackoverflow':
    return load_stackoverflow(num_clients, vocab_size=vocab_size or 10000, seq_len=seq_len,
                              data_dir=data_dir, download=download)
  if dataset == 'cifar100':
    return load_cifar100(num_clients, data_dir, download, cifar100_test)
  if dataset.startswith('leaf:'):
    if download:
      raise ConfigError('download', sources.manual_instructions(dataset))
    return load_leaf(dataset[5:], num_clients, data_dir)
  raise ConfigError('dataset', f'{dataset!r} is not a natural data set read from files')
