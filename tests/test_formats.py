"""Every published format loads from a file written here in that format and
under its published name: the expected arrays, the natural partition, the
files' own train/test split."""

import dataclasses

import jax
import made_files
import numpy as np
import pytest

from fedjax_personal.datasets import (
  DataConfig,
  cifar,
  cifar100,
  in_memory,
  leaf,
  load_federated,
  load_store,
  natural_data,
  shakespeare,
  sqlite_formats,
  stackoverflow,
)
from fedjax_personal.datasets.cifar100 import Cifar100Options
from fedjax_personal.datasets.emnist import EmnistOptions
from fedjax_personal.datasets.shakespeare import ShakespeareOptions
from fedjax_personal.datasets.stackoverflow import StackOverflowOptions
from fedjax_personal.errors import ConfigError, DataError


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
  monkeypatch.setenv('FEDJAX_PERSONAL_CACHE', str(tmp_path / 'cache'))
  monkeypatch.delenv('FEDJAX_PERSONAL_DATA', raising=False)


def _rows(data, split, i):
  n = int(data.__getattribute__(split).num_examples[i])
  return data.__getattribute__(split).x[i, :n], data.__getattribute__(split).y[
    i, :n
  ]


def test_fedjax_emnist_natural_partition(tmp_path):
  rng = np.random.default_rng(0)
  train, test = made_files.write_emnist(tmp_path, rng, [5, 9, 3], [2, 4, 1])
  d = load_federated(
    DataConfig(
      dataset='emnist',
      partition='natural',
      num_clients=None,
      data_dir=str(tmp_path),
      val_fraction=0.0,
    )
  )
  assert (
    d.num_clients == 3 and d.num_classes == 62 and d.name == 'emnist/natural'
  )
  assert d.describe().startswith('emnist/natural: 3 clients')
  for i in range(3):
    x, y = _rows(d, 'train', i)
    # FedJAX: x = 1 - pixels
    np.testing.assert_array_equal(x[..., 0], 1.0 - train[i][1]['pixels'])
    np.testing.assert_array_equal(y, train[i][1]['label'])
    xt, yt = _rows(d, 'test', i)  # the file's own test split of the same writer
    np.testing.assert_array_equal(yt, test[i][1]['label'])
    assert x.shape[1:] == (28, 28, 1) and x.dtype == np.float32
  # TFF's convention (Reddi et al.'s code feeds TFF's pixels as they are): the
  # raw pixels.
  raw = load_federated(
    DataConfig(
      dataset='emnist',
      partition='natural',
      num_clients=None,
      data_dir=str(tmp_path),
      options=EmnistOptions(pixels='tff'),
    )
  )
  np.testing.assert_array_equal(
    _rows(raw, 'train', 1)[0][..., 0], train[1][1]['pixels']
  )
  first2 = load_federated(
    DataConfig(
      dataset='emnist',
      partition='natural',
      num_clients=2,
      data_dir=str(tmp_path),
    )
  )
  assert first2.num_clients == 2 and '(first 2 of 3 clients)' in first2.name
  with pytest.raises(ConfigError, match='has 3 clients'):
    load_federated(
      DataConfig(
        dataset='emnist',
        partition='natural',
        num_clients=4,
        data_dir=str(tmp_path),
      )
    )


def test_fedjax_emnist_validation_split_comes_from_train(tmp_path):
  rng = np.random.default_rng(1)
  made_files.write_emnist(tmp_path, rng, [10, 10], [3, 3], digits=True)
  d = load_federated(
    DataConfig(
      dataset='emnist_digits',
      partition='natural',
      num_clients=None,
      data_dir=str(tmp_path),
      val_fraction=0.2,
    )
  )
  assert d.num_classes == 10
  assert np.asarray(d.train.num_examples).tolist() == [8, 8]
  assert np.asarray(d.val.num_examples).tolist() == [2, 2]
  assert np.asarray(d.test.num_examples).tolist() == [3, 3]


def test_fedjax_client_missing_from_test_file_is_left_out_of_test(tmp_path):
  rng = np.random.default_rng(2)
  train = made_files.emnist_clients(rng, [4, 4, 4])
  made_files.write_fedjax_sqlite(
    tmp_path / 'federated_emnist_train.sqlite', train
  )
  made_files.write_fedjax_sqlite(
    tmp_path / 'federated_emnist_test.sqlite', [train[0], train[2]]
  )
  d = load_federated(
    DataConfig(
      dataset='emnist',
      partition='natural',
      num_clients=None,
      data_dir=str(tmp_path),
    )
  )
  assert np.asarray(d.test.num_examples).tolist() == [4, 0, 4]


def test_fedjax_shakespeare_preprocessing_as_fedjax():
  # FedJAX's docstring example, sequence_length=3: [b'ABCD', b'E'] becomes x
  # [[BOS, A, B], [C, D, EOS], [BOS, E, PAD]], y [[A, B, C], [D, EOS, BOS], [E,
  # EOS, PAD]].
  t = lambda c: 3 + shakespeare.SHAKESPEARE_VOCAB.index(c)
  x, y = shakespeare.shakespeare_sequences([b'ABCD', b'E'], 3)
  B, E, P, I = (
    natural_data.BOS,
    natural_data.EOS,
    natural_data.PAD,
    natural_data.IGNORE,
  )
  assert x.tolist() == [
    [B, t(b'A'), t(b'B')],
    [t(b'C'), t(b'D'), E],
    [B, t(b'E'), P],
  ]
  assert y.tolist() == [
    [t(b'A'), t(b'B'), t(b'C')],
    [t(b'D'), E, B],
    [t(b'E'), E, I],
  ]
  assert (
    shakespeare.SHAKESPEARE_CLASSES == 90 and shakespeare.SHAKESPEARE_OOV == 89
  )
  # OOV
  assert shakespeare.shakespeare_sequences([b'\x01'], 4)[0].tolist() == [
    [B, 89, 0, 0]
  ]


def _tff_shakespeare_reference(snippets, sequence_length=80):
  """google-research/federated utils/datasets/shakespeare_dataset.py, its
  TensorFlow ops written out in NumPy: CHAR_VOCAB, get_special_tokens
  (pad 0, oov len + 1, bos len + 2, eos len + 3), to_tokens_and_pad (a
  StaticVocabularyTable with one OOV bucket, ids + 1; [bos] + ids + [eos];
  pad_length = (-len) % split_length; reshape [-1, split_length]) and
  _split_target (x = row[:-1], y = row[1:])."""
  char_vocab = list(
    'dhlptx@DHLPTX '
    '$(,048cgkoswCGKOSW[_#\'/37;?bfjnrvzBFJNRVZ"&*.26:\naeimquyAEIMQUY]!%)-159\r'
  )
  pad, oov, bos, eos = (
    0,
    len(char_vocab) + 1,
    len(char_vocab) + 2,
    len(char_vocab) + 3,
  )
  split_length = sequence_length + 1
  lookup = {c.encode(): i for i, c in enumerate(char_vocab)}
  rows = []
  for snippet in snippets:
    # tf.strings.bytes_split
    chars = [snippet[i : i + 1] for i in range(len(snippet))]
    tokens = [lookup.get(c, len(char_vocab)) + 1 for c in chars]
    tokens = [bos] + tokens + [eos]
    tokens += [0] * ((-len(tokens)) % split_length)
    rows += [
      tokens[i : i + split_length] for i in range(0, len(tokens), split_length)
    ]
  rows = np.asarray(rows, np.int64).reshape(-1, split_length)
  return rows[:, :-1], rows[:, 1:], (pad, oov, bos, eos)


def test_tff_shakespeare_windows_as_tff_cuts_them(tmp_path):
  """--shakespeare_windows=tff equals TFF's own preprocessing on the same
  snippets, in TFF's own ids (PAD 0, char i -> i + 1, OOV 87, BOS 88, EOS
  89: a TFF/Keras model's weights apply as they are): BOS never a target,
  PAD targets kept."""
  snippets = [b'To be, or not', b'to be' + bytes([1]), b'x' * 200]
  got_x, got_y = shakespeare.tff_sequences(snippets, 80)
  ref_x, ref_y, (pad, oov, bos, eos) = _tff_shakespeare_reference(snippets)
  assert (
    (pad, oov, bos, eos)
    == (0, 87, 88, 89)
    == tuple(shakespeare.TFF_IDS.values())
  )
  np.testing.assert_array_equal(got_x, ref_x)
  np.testing.assert_array_equal(got_y, ref_y)
  # BOS never a target
  assert got_x.shape == (1 + 1 + 3, 80) and not (got_y == bos).any()
  assert (
    got_x == oov
  ).sum() == 1  # the byte 1 is no character of the vocabulary
  made_files.write_fedjax_sqlite(
    tmp_path / 'shakespeare_train.sqlite',
    [(b'ROLE', {'snippets': made_files.bytes_array(snippets)})],
  )
  made_files.write_fedjax_sqlite(
    tmp_path / 'shakespeare_test.sqlite',
    [(b'ROLE', {'snippets': made_files.bytes_array([b'ab'])})],
  )
  d = load_federated(
    DataConfig(
      dataset='shakespeare',
      partition='natural',
      num_clients=None,
      data_dir=str(tmp_path),
      options=ShakespeareOptions(windows='tff'),
    )
  )
  x, y = _rows(d, 'train', 0)
  np.testing.assert_array_equal(x, got_x)
  np.testing.assert_array_equal(y, got_y)


def test_fedjax_shakespeare_file(tmp_path):
  snippets = [
    made_files.bytes_array([b'To be, or not', b'to be']),
    made_files.bytes_array([b'All the world']),
    made_files.bytes_array([b'x' * 200]),
  ]
  made_files.write_fedjax_sqlite(
    tmp_path / 'shakespeare_train.sqlite',
    [(b'ROLE_%d' % i, {'snippets': s}) for i, s in enumerate(snippets)],
  )
  made_files.write_fedjax_sqlite(
    tmp_path / 'shakespeare_test.sqlite',
    [
      (b'ROLE_%d' % i, {'snippets': made_files.bytes_array([b'ab'])})
      for i in range(3)
    ],
  )
  d = load_federated(
    DataConfig(
      dataset='shakespeare',
      partition='natural',
      num_clients=None,
      data_dir=str(tmp_path),
    )
  )
  assert d.num_clients == 3 and d.num_classes == 90 and d.train.x.shape[2] == 80
  # 202 targets in 80s
  assert np.asarray(d.train.num_examples).tolist() == [
    1,
    1,
    3,
  ]
  x, y = _rows(d, 'train', 0)
  want_x, want_y = shakespeare.shakespeare_sequences(list(snippets[0]), 80)
  np.testing.assert_array_equal(x, want_x)
  np.testing.assert_array_equal(y, want_y)
  assert (y == -1).sum() == 80 - (len(b'To be, or not') + len(b'to be') + 3)


def test_fedjax_stackoverflow_tokens_and_vocabulary(tmp_path):
  (tmp_path / 'stackoverflow.word_count').write_text(
    'the 100\nis 50\ncode 20\nrare 1\n'
  )
  tok = lambda items: {
    'tokens': made_files.bytes_array(items),
    'type': made_files.bytes_array([b'question'] * len(items)),
  }
  made_files.write_fedjax_sqlite(
    tmp_path / 'stackoverflow_train.sqlite',
    [
      (b'00001', tok([b'the code is', b'what is this'])),
      (b'00002', tok([b'code ' * 30])),
      (b'00003', tok([b'the  is'])),
    ],
  )
  made_files.write_fedjax_sqlite(
    tmp_path / 'stackoverflow_test.sqlite',
    [(b'00002', tok([b'is the code'])), (b'99999', tok([b'other user']))],
  )
  nat = stackoverflow.read_clients(
    vocab_size=3, seq_len=5, data_dir=str(tmp_path)
  )
  assert nat.num_classes == 3 + 4 and nat.client_ids == [
    '00001',
    '00002',
    '00003',
  ]
  # ids: PAD 0, BOS 1, EOS 2, the 3, is 4, code 5, OOV 6 (one bucket)
  x, y = nat.train[0]
  assert x.tolist() == [[1, 3, 5, 4, 0], [1, 6, 4, 6, 0]]
  assert y.tolist() == [[3, 5, 4, 2, -1], [6, 4, 6, 2, -1]]
  x, y = nat.train[1]  # truncated to seq_len
  assert x.tolist() == [[1, 5, 5, 5, 5]] and y.tolist() == [[5, 5, 5, 5, 5]]
  # two spaces delimit an empty token: OOV, as FedJAX's tf.strings.split
  x, y = nat.train[2]
  assert x.tolist() == [[1, 3, 6, 4, 0]] and y.tolist() == [[3, 6, 4, 2, -1]]
  # only user 00002 posted in the test file
  assert [len(t[1]) for t in nat.test] == [
    0,
    1,
    0,
  ]
  assert nat.test[1][1].tolist() == [[4, 3, 5, 2, -1]]
  with pytest.raises(DataError, match='4 words, the vocabulary needs 10'):
    stackoverflow.read_clients(vocab_size=10, data_dir=str(tmp_path))
  (tmp_path / 'stackoverflow.word_count').write_text(
    ''.join(f'w{i} {10**5 - i}\n' for i in range(10**4))
  )
  d = load_federated(
    DataConfig(
      dataset='stackoverflow',
      partition='natural',
      num_clients=2,
      data_dir=str(tmp_path),
    )
  )
  # Reddi et al.'s 10K + 4
  assert d.train.x.shape[2] == 20 and d.num_classes == 10004


def test_stackoverflow_tff_users_pooled_less_validation_as_the_task_takes_them(
  tmp_path, monkeypatch
):
  """--stackoverflow_test=tff_users against a reference written from
  google-research/federated's get_centralized_datasets: every test user's
  posts pooled (users in a shuffled order, a user's posts in order),
  take(V) validation, skip(V) test; train users keep all their posts."""
  (tmp_path / 'stackoverflow.word_count').write_text(
    'the 100\nis 50\ncode 20\n'
  )
  tok = lambda items: {'tokens': made_files.bytes_array(items)}
  made_files.write_fedjax_sqlite(
    tmp_path / 'stackoverflow_train.sqlite',
    [(b'00001', tok([b'the code', b'is'])), (b'00002', tok([b'code is the']))],
  )
  posts = {
    b'00002': [b'is', b'the is', b'code'],
    b'70000': [b'the'],
    b'80000': [b'code code', b'is is'],
    b'90000': [b'the code is'],
  }
  made_files.write_fedjax_sqlite(
    tmp_path / 'stackoverflow_test.sqlite',
    [(u, tok(p)) for u, p in posts.items()],
  )
  monkeypatch.setattr(stackoverflow, 'VALIDATION_EXAMPLES', 4)
  nat = stackoverflow.read_clients(
    vocab_size=3,
    seq_len=4,
    data_dir=str(tmp_path),
    stackoverflow_test='tff_users',
    seed=3,
  )
  items = list(nat.stream())
  assert nat.eval_only == 4 and nat.num_clients == 6
  assert [i[0] for i in items] == [
    b'00001',
    b'00002',
    'test/00002',
    'test/70000',
    'test/80000',
    'test/90000',
  ]
  # train users: every post trains
  assert [len(i[1][0]) for i in items] == [
    2,
    1,
    0,
    0,
    0,
    0,
  ]
  assert [len(i[2][0]) for i in items[:2]] == [0, 0]
  # the reference: pooled in the shuffled user order, the first 4 posts
  # validation
  users = list(posts)
  pooled = [
    (u, k)
    for j in np.random.default_rng(3).permutation(len(users))
    for u in [users[j]]
    for k in range(len(posts[u]))
  ]
  want_val = {u: sum(1 for v, _ in pooled[:4] if v == u) for u in users}
  want_test = {u: sum(1 for v, _ in pooled[4:] if v == u) for u in users}
  got = {i[0][len('test/') :].encode(): i for i in items[2:]}
  vocab = {'the': 3, 'is': 4, 'code': 5}
  for u in users:
    cid, _, (xt, _), (xv, _) = got[u]
    assert (len(xv), len(xt)) == (want_val[u], want_test[u]), u
    firsts = [
      [1] + [vocab[w] for w in p.decode().split(' ')][:3] for p in posts[u]
    ]
    assert xv[:, :4].tolist() + xt[:, :4].tolist() == [
      f + [0] * (4 - len(f)) for f in firsts
    ]
  # the store: held-out clients evaluated on the rest, their validation kept
  # apart
  store = load_store(
    DataConfig(
      dataset='stackoverflow',
      partition='natural',
      num_clients=None,
      data_dir=str(tmp_path),
      seed=3,
      options=StackOverflowOptions(
        vocab_size=3, seq_len=4, stackoverflow_test='tff_users'
      ),
    )
  )
  assert store.eval_only == 4 and int(store.counts['test'].sum()) == 7 - 4
  assert (
    int(store.counts['val'].sum()) == 4
    and int(store.counts['train'].sum()) == 3
  )


def test_tff_cifar100_sqlite_lzma(tmp_path, made_not_released):
  rng = np.random.default_rng(3)
  made_files.write_tff_cifar100(tmp_path / 'raw.sqlite', rng, [6, 5], [4])
  made_files.lzma_file(
    tmp_path / 'raw.sqlite', tmp_path / 'cifar100.sqlite.lzma'
  )
  truth = made_files.write_tff_cifar100(
    tmp_path / 'again.sqlite', np.random.default_rng(3), [6, 5], [4]
  )
  nat = cifar100.read_clients(data_dir=str(tmp_path))
  assert (
    nat.client_ids == ['0', '1']
    and nat.total_clients == 2
    and nat.split_by_fraction
  )
  for (x, y), (_, images, labels) in zip(nat.train, truth['train']):
    np.testing.assert_array_equal(x, images)
    np.testing.assert_array_equal(y, labels)
  d = load_federated(
    DataConfig(
      dataset='cifar100',
      partition='natural',
      num_clients=None,
      data_dir=str(tmp_path),
      test_fraction=0.2,
    )
  )
  assert d.num_classes == 100 and d.train.x.dtype == np.uint8
  assert (
    np.asarray(d.train.num_examples) + np.asarray(d.test.num_examples)
  ).tolist() == [6, 5]
  # decompressed once, into the cache, in a folder named by the .lzma's content:
  # another cifar100.sqlite.lzma (other clients) gets its own copy, never this
  # one
  (copy,) = (tmp_path / 'cache' / 'decompressed').glob('*/cifar100.sqlite')
  other = tmp_path / 'other'
  other.mkdir()
  made_files.write_tff_cifar100(
    other / 'raw.sqlite', np.random.default_rng(4), [3, 2, 4], [1]
  )
  made_files.lzma_file(other / 'raw.sqlite', other / 'cifar100.sqlite.lzma')
  assert cifar100.read_clients(data_dir=str(other)).total_clients == 3
  assert cifar100.read_clients(data_dir=str(tmp_path)).total_clients == 2
  assert (
    len(list((tmp_path / 'cache' / 'decompressed').glob('*/cifar100.sqlite')))
    == 2
  )


@pytest.mark.parametrize('hundred', [False, True])
def test_cifar_python_archives(tmp_path, hundred, made_not_released):
  rng = np.random.default_rng(4)
  name = 'cifar-100-python.tar.gz' if hundred else 'cifar-10-python.tar.gz'
  truth = made_files.write_cifar_archive(tmp_path / name, rng, 50, 10, hundred)
  which = 'cifar100_python' if hundred else 'cifar10'
  x, y, c = cifar.load(which, str(tmp_path), split='train')
  np.testing.assert_array_equal(x, truth['train'][0])
  np.testing.assert_array_equal(y, truth['train'][1])
  assert c == (100 if hundred else 10)
  xa, ya, _ = cifar.load(which, str(tmp_path))
  assert len(ya) == 60 and np.array_equal(xa[50:], truth['test'][0])
  d = load_federated(
    DataConfig(
      dataset='cifar100' if hundred else 'cifar10',
      partition='dirichlet',
      num_clients=3,
      data_dir=str(tmp_path),
    )
  )
  assert d.num_clients == 3 and d.train.x.shape[2:] == (32, 32, 3)


def test_cifar_release_checksum_is_checked(tmp_path):
  made_files.write_cifar_archive(
    tmp_path / 'cifar-10-python.tar.gz', np.random.default_rng(5), 10, 5
  )
  with pytest.raises(
    DataError,
    match="md5 .* differs from the release's c58f30108f718f92721af3b95e74349a",
  ):
    cifar.load('cifar10', str(tmp_path))


def test_tinyshakespeare_input_txt_is_found_and_checked(tmp_path):
  (tmp_path / 'input.txt').write_text('First Citizen:\nBefore we proceed.\n')
  with pytest.raises(DataError, match=r'input.txt: md5 .* differs'):
    in_memory.load_tinyshakespeare(num_clients=1, data_dir=str(tmp_path))


def test_leaf_json(tmp_path):
  rng = np.random.default_rng(6)
  femnist = {
    f'f{i:04d}': {
      'x': rng.uniform(0, 1, (n, 784)).tolist(),
      'y': rng.integers(0, 62, n).tolist(),
    }
    for i, n in enumerate([3, 5, 2])
  }
  femnist_test = {
    u: {'x': d['x'][:1], 'y': d['y'][:1]} for u, d in femnist.items()
  }
  made_files.write_leaf(tmp_path, 'femnist', femnist, femnist_test)
  d = load_federated(
    DataConfig(
      dataset='leaf:femnist',
      partition='natural',
      num_clients=None,
      data_dir=str(tmp_path),
    )
  )
  assert (
    d.num_clients == 3
    and d.num_classes == 62
    and d.train.x.shape[2:] == (28, 28, 1)
  )
  x, y = _rows(d, 'train', 1)
  np.testing.assert_allclose(
    x.reshape(5, 784), np.asarray(femnist['f0001']['x'], np.float32)
  )
  assert y.tolist() == femnist['f0001']['y']
  shakes = {'ROMEO': {'x': ['abc', 'bcd'], 'y': ['d', 'e']}}
  made_files.write_leaf(tmp_path, 'shakespeare', shakes, shakes)
  nat = leaf.read_clients('shakespeare', data_dir=str(tmp_path))
  L = leaf.LEAF_LETTERS
  assert nat.train[0][0].tolist() == [
    [L.index(c) for c in 'abc'],
    [L.index(c) for c in 'bcd'],
  ]
  assert (
    nat.train[0][1].tolist() == [L.index('d'), L.index('e')]
    and nat.num_classes == 80
  )

  # LEAF's letter_to_index: an unknown character is -1: the last row as an
  # input; as a target, LEAF's own code (written out here) makes it class 79.
  def leaf_one_hot(index, size):  # leaf/models/utils/language_utils.py
    vec = [0 for _ in range(size)]
    vec[int(index)] = 1
    return vec

  def leaf_letter_to_vec(letter):
    return leaf_one_hot(L.find(letter), len(L))

  made_files.write_leaf(
    tmp_path,
    'shakespeare',
    {'R': {'x': ['a\u00e9c'], 'y': ['\u00e9']}},
    {'R': {'x': ['abc'], 'y': ['d']}},
  )
  nat = leaf.read_clients('shakespeare', data_dir=str(tmp_path))
  assert nat.train[0][0].tolist() == [[L.index('a'), 79, L.index('c')]]
  assert (
    nat.train[0][1].tolist()
    == [int(np.argmax(leaf_letter_to_vec('\u00e9')))]
    == [79]
  )
  # LEAF's line_to_indices: [\w']+|[.,!?;] words, unknown and padding
  # len(vocab).
  sent = {
    'u1': {
      'x': [
        ['1', 'd', 'q', 'u1', "good day, good don't"],
        ['2', 'd', 'q', 'u1', 'bad!'],
      ],
      'y': [1, 0],
    }
  }
  made_files.write_leaf(
    tmp_path,
    'sent140',
    sent,
    {'u1': {'x': [['3', 'd', 'q', 'u1', 'so good']], 'y': [1]}},
  )
  assert leaf.leaf_split_line("good day, good don't") == [
    'good',
    'day',
    ',',
    'good',
    "don't",
  ]
  nat = leaf.read_clients('sent140', data_dir=str(tmp_path))
  # good (2x) 0, then by word: ! 1, , 2, bad 3, day 4, don't 5; 6 unknown and
  # padding
  assert nat.train[0][0][0, :7].tolist() == [0, 4, 2, 0, 5, 6, 6]
  assert nat.train[0][0][1, :3].tolist() == [3, 1, 6]
  assert nat.test[0][0][0, :3].tolist() == [6, 0, 6]
  assert nat.train[0][1].tolist() == [1, 0] and nat.num_classes == 2


def test_leaf_bad_json_is_one_line(tmp_path):
  (tmp_path / 'leaf' / 'femnist' / 'train').mkdir(parents=True)
  (tmp_path / 'leaf' / 'femnist' / 'test').mkdir(parents=True)
  (tmp_path / 'leaf' / 'femnist' / 'train' / 'a.json').write_text(
    '{"users": ["u"]}'
  )
  (tmp_path / 'leaf' / 'femnist' / 'test' / 'a.json').write_text('{}')
  with pytest.raises(DataError, match=r'a.json: not a LEAF JSON file'):
    leaf.read_clients('femnist', data_dir=str(tmp_path))


@pytest.mark.parametrize(
  'content,needle',
  [
    (b'not a database at all, just some bytes' * 40, 'not an SQLite database'),
    (None, 'no federated_data table'),
  ],
)
def test_corrupt_fedjax_file_is_one_line(tmp_path, content, needle):
  path = tmp_path / 'federated_emnist_train.sqlite'
  if content is None:
    import sqlite3

    sqlite3.connect(path).execute('CREATE TABLE other (a)').connection.commit()
  else:
    path.write_bytes(content)
  (tmp_path / 'federated_emnist_test.sqlite').write_bytes(path.read_bytes())
  with pytest.raises(DataError, match=needle):
    load_federated(
      DataConfig(
        dataset='emnist',
        partition='natural',
        num_clients=None,
        data_dir=str(tmp_path),
      )
    )


def test_corrupt_client_record_is_one_line(tmp_path):
  import sqlite3

  made_files.write_emnist(tmp_path, np.random.default_rng(7), [2], [1])
  conn = sqlite3.connect(tmp_path / 'federated_emnist_train.sqlite')
  conn.execute("UPDATE federated_data SET data = x'00112233'")
  conn.commit()
  conn.close()
  with pytest.raises(DataError, match='a client record is unreadable'):
    list(sqlite_formats.read_fedjax(tmp_path / 'federated_emnist_train.sqlite'))


def test_missing_file_names_file_and_download_command(tmp_path):
  with pytest.raises(FileNotFoundError) as e:
    load_federated(
      DataConfig(dataset='emnist', partition='natural', data_dir=str(tmp_path))
    )
  msg = str(e.value)
  assert msg.startswith(
    'federated_emnist_train.sqlite: not found in ' + str(tmp_path)
  )
  assert '--dataset=emnist --download' in msg and isinstance(e.value, DataError)
  with pytest.raises(DataError, match='LEAF publishes no ready files'):
    load_federated(
      DataConfig(
        dataset='leaf:femnist', partition='natural', data_dir=str(tmp_path)
      )
    )


def test_data_dir_must_exist():
  with pytest.raises(
    DataError, match='/nonexistent: --data_dir is not a folder'
  ):
    load_federated(
      DataConfig(dataset='mnist', num_clients=4, data_dir='/nonexistent')
    )


def test_environment_folder_then_package_then_fedjax_then_cache(
  tmp_path, monkeypatch
):
  from fedjax_personal.datasets import local_files

  env, cache = tmp_path / 'env', tmp_path / 'cache'
  fedjax = tmp_path / 'home' / '.cache' / 'fedjax'
  monkeypatch.setenv('HOME', str(tmp_path / 'home'))
  for d in (env, cache, fedjax):
    (d / 'mnist_t10k').mkdir(parents=True)
    (d / 'x.bin').write_bytes(d.name.encode())
  monkeypatch.setenv('FEDJAX_PERSONAL_DATA', str(env))
  assert local_files.search_dirs() == [
    env,
    local_files.PACKAGE_DATA,
    fedjax,
    cache,
  ]
  assert local_files.find_file('x.bin').read_bytes() == b'env'
  monkeypatch.delenv('FEDJAX_PERSONAL_DATA')
  # FedJAX's own downloads (a user's files) before this project's cache
  assert local_files.find_file('x.bin').read_bytes() == b'fedjax'
  (fedjax / 'x.bin').unlink()
  assert local_files.find_file('x.bin').read_bytes() == b'cache'
  # the embedded MNIST comes before the cache
  assert (
    local_files.find_file('mnist_t10k/t10k-labels-idx1-ubyte.gz').parent.parent
    == local_files.PACKAGE_DATA
  )


@pytest.mark.parametrize(
  'name,scored,correct', [('in_vocab', 1, 1), ('fedjax_in_vocab', 2, 1)]
)
def test_stackoverflow_accuracies_as_published(name, scored, correct):
  """ids PAD 0, BOS 1, EOS 2, words 3-5, OOV 6. Targets: a word (predicted
  right), OOV (the logits' argmax), EOS (predicted right), a padded position.
  in_vocab scores the word alone; FedJAX's accuracy_in_vocab scores the OOV
  target too, and never predicts OOV: a miss."""
  import jax.numpy as jnp

  from fedjax_personal.core.training import per_example_stats

  unscored, unpredicted, definition = stackoverflow.stackoverflow_accuracy(
    name, 7
  )
  assert definition == stackoverflow.STACKOVERFLOW_ACCURACIES[name]
  logits = jnp.full((1, 4, 7), -1.0)
  logits = (
    logits.at[0, 0, 3]
    .set(5)
    .at[0, 1, 6]
    .set(5)
    .at[0, 1, 4]
    .set(2)
    .at[0, 2, 2]
    .set(5)
  )
  y = jnp.asarray([[3, 6, 2, -1]])
  stats = per_example_stats(
    logits, y, jnp.ones(1, bool), 'cross_entropy', unscored, 0, unpredicted
  )
  assert (float(stats.scored), float(stats.correct), float(stats.count)) == (
    scored,
    correct,
    3,
  )


def test_tff_cifar100_test_clients_are_held_out(tmp_path, made_not_released):
  """Reddi et al.'s protocol: the train clients train on all their images,
  TFF's test clients follow them in the store as held-out clients (ids
  ``test/<id>``), evaluated and never drawn into a cohort."""
  from fedjax_personal.core.sampling import CohortSampler
  from fedjax_personal.datasets import load_store

  truth = made_files.write_tff_cifar100(
    tmp_path / 'raw.sqlite', np.random.default_rng(5), [6, 5, 4], [4, 3]
  )
  made_files.lzma_file(
    tmp_path / 'raw.sqlite', tmp_path / 'cifar100.sqlite.lzma'
  )
  cfg = DataConfig(
    dataset='cifar100',
    partition='natural',
    num_clients=None,
    data_dir=str(tmp_path),
    options=Cifar100Options(cifar100_test='tff_clients'),
  )
  store = load_store(cfg)
  assert store.num_clients == 5 and store.eval_only == 2
  assert store.client_ids == ['0', '1', '2', 'test/1000', 'test/1001']
  assert store.counts['train'].tolist() == [6, 5, 4, 0, 0]
  assert store.counts['test'].tolist() == [0, 0, 0, 4, 3]
  for split, prefix in (('train', ''), ('test', 'test/')):
    for cid, images, labels in truth[split]:
      x, y = store.client(prefix + cid)[split]
      np.testing.assert_array_equal(x, images)
      np.testing.assert_array_equal(y, labels)
  assert store.population().num_trained == 3 and store.padded().num_trained == 3
  with pytest.raises(DataError, match="no client has id '7'"):
    store.client_index('7')
  # Cohorts come from the 3 train clients only, by size and by participation.
  for sampler in (
    CohortSampler(5, cohort_size=2, eligible=3),
    CohortSampler(5, participation=0.9, eligible=3),
  ):
    for k in range(20):
      c = sampler(jax.random.key(k))
      drawn = np.asarray(c.idx)[np.asarray(c.mask)]
      assert (
        drawn.size
        and drawn.max() < 3
        and (np.asarray(c.idx)[~np.asarray(c.mask)] == 5).all()
      )
  assert CohortSampler(5, participation=0.5, eligible=3).capacity <= 3
  # 'split' (the default) keeps the train clients alone, their images split.
  d = load_federated(
    dataclasses.replace(cfg, options=Cifar100Options(), test_fraction=0.25)
  )
  assert d.num_clients == 3 and d.eval_only == 0
  # FedJAX's load_data: the test clients by TFF's own ids (str, as FedJAX keeps
  # them); .store of a view: the store's clients, the test ones held out.
  train, test = cifar100.load_data(cache_dir=str(tmp_path))
  assert list(train.client_ids()) == ['0', '1', '2']
  assert (
    list(test.client_ids()) == ['1000', '1001']
    and test.client_size('1001') == 3
  )
  np.testing.assert_array_equal(
    test.get_client('1000').all_examples()['x'], truth['test'][0][1]
  )
  assert test.subset(['1001']).store.client_ids == ['test/1001']
  assert train.store.client_ids == ['0', '1', '2']


def test_tf_example_reader_on_hand_written_protos():
  """The project's tf.train.Example reader (datasets/tf_example.py) on
  protobuf's wire format: bytes worked out by hand, packed and unpacked
  int64 lists, negative and multi-byte varints, floats, bytes, and damaged
  bytes refused."""
  from fedjax_personal.datasets import tf_example

  # Example{features{feature{key: 'a' value{int64_list{value: [1, 300]}}}}},
  # byte by byte.
  by_hand = bytes(
    [
      0x0A,
      0x0E,
      0x0A,
      0x0C,
      0x0A,
      0x01,
      0x61,
      0x12,
      0x07,
      0x1A,
      0x05,
      0x0A,
      0x03,
      0x01,
      0xAC,
      0x02,
    ]
  )
  assert tf_example.parse(by_hand)['a'].tolist() == [1, 300]
  assert made_files.tf_example({'a': [1, 300]}) == by_hand
  values = [0, 1, 127, 128, 255, 300, 2**40, -1, -(2**63), 2**63 - 1]
  for packed in (True, False):
    got = tf_example.parse(
      made_files.tf_example(
        {
          'i': values,
          'f': np.array([0.5, -2.25], np.float32),
          'b': [b'xy', b''],
          'img': np.arange(256).reshape(16, 16),
        },
        packed=packed,
      )
    )
    assert got['i'].dtype == np.int64 and got['i'].tolist() == values
    assert got['f'].dtype == np.float32 and got['f'].tolist() == [0.5, -2.25]
    assert got['b'] == [b'xy', b''] and got['img'].tolist() == list(range(256))
  assert sqlite_formats.parse_example(
    made_files.tf_example({'label': [7], 'image': np.ones(4)}),
    {'label': (), 'image': (2, 2)},
  )['image'].shape == (2, 2)
  for bad in (
    by_hand[:-1],
    by_hand[:5],
    b'\x0f\x01',
    bytes([0x0A, 0x02, 0x0A, 0x05]),
  ):
    with pytest.raises(ValueError):
      tf_example.parse(bad)
  with pytest.raises(ValueError, match="feature 'label' missing"):
    sqlite_formats.parse_example(by_hand, {'label': ()})
