"""FedJAX's data objects (``datasets/client_datasets.py``, ``store_federated_data.py``,
``sqlite_federated_data.py``) against FedJAX 0.0.17 itself:
``tests/data/fedjax_api_reference.npz`` was written by FedJAX's own
``load_data`` of EMNIST, Shakespeare and Stack Overflow on the made files
this test makes again (``benchmarks/peers/fedjax_api_reference.py``, in
FedJAX's venv); every array must agree."""

import os

import helpers
import made_files
import numpy as np
import pytest

from fedjax_personal.datasets import (
  cifar100,
  client_datasets,
  emnist,
  shakespeare,
  stackoverflow,
  store_federated_data,
)

REFERENCE = os.path.join(
  os.path.dirname(__file__), 'data', 'fedjax_api_reference.npz'
)


@pytest.fixture(scope='module')
def emnist_made(tmp_path_factory):
  folder = tmp_path_factory.mktemp('emnist')
  made_files.write_emnist(
    folder, np.random.default_rng(0), [5, 9, 3, 7], [2, 1, 3, 2]
  )
  return folder


def _reference_module():
  """benchmarks/peers/fedjax_api_reference.py, whose ``record_all`` wrote the
  reference from FedJAX's objects and records this project's here."""
  return helpers.script_module('benchmarks', 'peers', 'fedjax_api_reference.py')


def test_load_data_equals_fedjax_on_the_same_files(tmp_path, made_not_released):
  """EMNIST, Shakespeare, Stack Overflow (tokenized by FedJAX's tokenizer
  at 4 and 30 tokens) and CIFAR-100 (FedJAX's files made of TFF's; its
  image preprocessing) as FedJAX 0.0.17 gives them, every array equal:
  each split's clients in its own file's order (a test-only client
  included), ids of the type FedJAX gives (CIFAR-100's str, TFF's), sizes,
  examples, batches, the federated batching functions,
  ``SubsetFederatedData``, ``slice``; and FedJAX's helpers accept this
  project's clients (one shared preprocessor) and give what this project's
  give."""
  ref = _reference_module()
  words = made_files.fedjax_reference_files(tmp_path)
  folder = str(tmp_path)
  ours = ref.record_all(
    emnist.load_data(only_digits=False, cache_dir=folder),
    shakespeare.load_data(sequence_length=5, cache_dir=folder),
    stackoverflow.load_data(cache_dir=folder),
    stackoverflow.StackoverflowTokenizer(vocab=words[: ref.SO_VOCAB]),
    cifar100.load_data(cache_dir=folder),
    cifar100,
    store_federated_data,
  )
  ours.update(
    ref.record_helpers(
      client_datasets,
      client_datasets.padded_batch_client_datasets,
      client_datasets.buffered_shuffle_batch_client_datasets,
    )
  )
  theirs = dict(np.load(REFERENCE))
  assert sorted(ours) == sorted(theirs)
  for k, want in theirs.items():
    got = np.asarray(ours[k])
    assert got.dtype == want.dtype, (k, got.dtype, want.dtype)
    assert got.shape == want.shape, (k, got.shape, want.shape)
    if got.dtype.kind == 'f':
      np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=k)
    else:
      np.testing.assert_array_equal(got, want, err_msg=k)
  # the test split: the test file's clients in its order, one found only there
  assert theirs['emnist/test/ids'].tolist() == [
    b'f0002_02',
    b'f0000_00',
    b'f0004_04',
    b'f0001_01',
  ]
  # load_split: one file, raw, as FedJAX's
  for module, split, features in (
    (emnist, 'test', ['label', 'pixels']),
    (shakespeare, 'train', ['snippets']),
    (
      stackoverflow,
      'held_out',
      ['creation_date', 'score', 'tags', 'title', 'tokens', 'type'],
    ),
    (cifar100, 'test', ['coarse_label', 'image', 'label']),
  ):
    fd = module.load_split(split, cache_dir=folder)
    prefix = {'stackoverflow': 'stackoverflow4'}.get(
      module.__name__.split('.')[-1], module.__name__.split('.')[-1]
    )
    key = f'{prefix}/{split}/ids'
    if key in theirs:
      assert np.array_equal(np.array(list(fd.client_ids())), theirs[key])
    assert sorted(next(fd.clients())[1].all_examples()) == features


def test_clients_by_id_and_the_store_behind_them(emnist_made):
  train, test = emnist.load_data(cache_dir=str(emnist_made))
  assert train.num_clients() == 4 and train.client_size(b'f0001_01') == 9
  assert len(train.get_client('f0001_01')) == 9  # str ids are accepted too
  with pytest.raises(KeyError):
    train.get_client(b'nobody')
  picked = [c for c, _ in train.get_clients([b'f0003_03', b'f0000_00'])]
  assert picked == [b'f0003_03', b'f0000_00']
  # FedJAX's SubsetFederatedData: each id once, sorted; sizes in the base's
  # order; get_clients in the order given; an unknown id a ValueError.
  sub = train.subset([b'f0003_03', b'f0001_01', b'f0003_03', 'f0000_00'])
  assert sub.num_clients() == 3
  assert (
    list(sub.client_ids())
    == [c for c, _ in sub.clients()]
    == [b'f0000_00', b'f0001_01', b'f0003_03']
  )
  assert [c for c, _ in sub.client_sizes()] == [
    c
    for c in train.client_ids()
    if c in {b'f0000_00', b'f0001_01', b'f0003_03'}
  ]
  assert [c for c, _ in sub.get_clients([b'f0003_03', b'f0000_00'])] == [
    b'f0003_03',
    b'f0000_00',
  ]
  with pytest.raises(KeyError):
    sub.get_client(b'f0002_02')
  with pytest.raises(ValueError, match='not in the base FederatedData'):
    train.subset([b'f0001_01', b'nobody'])
  assert list(sub.slice(b'f0001').client_ids()) == [b'f0001_01', b'f0003_03']
  store = train.slice(b'f0001', b'f0003').store
  assert store.client_ids == ['f0001_01', 'f0002_02'] and store.num_clients == 2
  x, y = store.client('f0001_01')['train']
  np.testing.assert_array_equal(
    train.get_client(b'f0001_01').all_examples()['y'], y
  )
  # batches of the project's view and the raw file agree: x = 1 - pixels
  pixels = made_files.emnist_clients(np.random.default_rng(0), [5, 9, 3, 7])[1][
    1
  ]['pixels']
  np.testing.assert_allclose(x[..., 0], 1 - pixels, rtol=1e-6)
  # preprocessing chains as FedJAX's does
  doubled = train.preprocess_batch(lambda e: {**e, 'y': e['y'] * 2})
  first = next(iter(doubled.get_client(b'f0000_00').batch(batch_size=2)))
  assert np.array_equal(
    first['y'], 2 * train.get_client(b'f0000_00').raw_examples['label'][:2]
  )


def test_batching_by_hand():
  c = store_federated_data.ClientDataset(
    {'x': np.arange(11), 'y': np.arange(11) * 10}
  )
  sizes = [
    len(b['x']) for b in c.padded_batch(batch_size=8, num_batch_size_buckets=3)
  ]
  assert sizes == [8, 4]  # 3 left: 8 -> 4 (holds 3), not 2
  last = list(c.padded_batch(batch_size=8, num_batch_size_buckets=3))[-1]
  assert last['__mask__'].tolist() == [True, True, True, False]
  assert last['x'].tolist() == [8, 9, 10, 0]
  assert [len(b['x']) for b in c.batch(batch_size=4)] == [4, 4, 3]
  epoch = np.concatenate(
    [b['x'] for b in c.shuffle_repeat_batch(batch_size=11, seed=5)]
  )
  assert sorted(epoch.tolist()) == list(range(11))  # one pass: a permutation
  order = np.arange(11, dtype=np.int32)
  np.random.RandomState(5).shuffle(order)
  assert epoch.tolist() == order.tolist()
  # ceil(22 / 4)
  assert len(list(c.shuffle_repeat_batch(batch_size=4, num_epochs=2))) == 6
  assert (
    len(
      list(c.shuffle_repeat_batch(batch_size=4, num_epochs=None, num_steps=9))
    )
    == 9
  )
  with pytest.raises(TypeError, match='batch_sz'):
    c.batch(batch_sz=3)
  for wrong in (2.5, '8', True, 0):  # never silently another size
    with pytest.raises(ValueError, match='batch_size must be an integer >= 1'):
      c.padded_batch(batch_size=wrong)


def test_stackoverflow_as_fedjax_documents_it(tmp_path):
  """FedJAX's ``stackoverflow.load_data`` recipe, only the import changed:
  ``(train, held_out, test)`` with raw ``tokens`` and ``domain_id``,
  tokenized by ``StackoverflowTokenizer`` (the 10,000 most frequent words
  of ``stackoverflow.word_count``) at 20 tokens for training and 30 for
  evaluation; ``.store`` is the command line's store of those users."""
  words = ['the', 'is', 'code'] + [f'w{i}' for i in range(9997)]
  (tmp_path / 'stackoverflow.word_count').write_text(
    ''.join(f'{w} {10**5 - i}\n' for i, w in enumerate(words))
  )
  posts = lambda items, kind=b'question': {
    'tokens': made_files.bytes_array(items),
    'type': made_files.bytes_array([kind] * len(items)),
  }
  made_files.write_fedjax_sqlite(
    tmp_path / 'stackoverflow_train.sqlite',
    [
      (b'00001', posts([b'the code', b'is'])),
      (b'00002', posts([b'code is the'], b'answer')),
    ],
  )
  made_files.write_fedjax_sqlite(
    tmp_path / 'stackoverflow_test.sqlite', [(b'00002', posts([b'is the']))]
  )
  made_files.write_fedjax_sqlite(
    tmp_path / 'stackoverflow_held_out.sqlite',
    [
      (b'50000', posts([b'the is', b'nope  code'])),
      (b'60000', posts([b'code'])),
    ],
  )
  train, held_out, test = stackoverflow.load_data(cache_dir=str(tmp_path))
  assert list(train.client_ids()) == [b'00001', b'00002'] and list(
    test.client_ids()
  ) == [b'00002']
  assert (
    list(held_out.client_ids()) == [b'50000', b'60000']
    and held_out.num_clients() == 2
  )
  raw = train.get_client(b'00002').all_examples()
  assert sorted(raw) == ['domain_id', 'tokens'] and raw[
    'domain_id'
  ].tolist() == [1]
  tokenizer = stackoverflow.StackoverflowTokenizer(cache_dir=str(tmp_path))
  train_for_train = train.preprocess_batch(tokenizer.as_preprocess_batch(20))
  held_out = held_out.preprocess_batch(tokenizer.as_preprocess_batch(30))
  # ids: PAD 0, BOS 1, EOS 2, the 3, is 4, code 5, ..., OOV 10003 (also the
  # empty word)
  ex = held_out.get_client(b'50000').all_examples()
  assert ex['x'].shape == (2, 30) and ex['domain_id'].tolist() == [0, 0]
  assert ex['x'][:, :5].tolist() == [[1, 3, 4, 0, 0], [1, 10003, 10003, 5, 0]]
  assert ex['y'][:, :5].tolist() == [[3, 4, 2, 0, 0], [10003, 10003, 5, 2, 0]]
  assert train_for_train.get_client(b'00002').all_examples()['x'][
    0, :4
  ].tolist() == [1, 5, 4, 3]
  with pytest.raises(ValueError, match="cache_dir='.*missing' is not a folder"):
    stackoverflow.load_data(cache_dir=str(tmp_path / 'missing'), download=False)
  with pytest.raises(ValueError, match='num_oov_buckets must be >= 1'):
    stackoverflow.StackoverflowTokenizer(vocab=['a'], num_oov_buckets=0)
  assert stackoverflow.default_vocab(3, cache_dir=str(tmp_path)) == [
    'the',
    'is',
    'code',
  ]
  # .store: the population store the command line trains on, these users alone
  store = train.subset([b'00002']).store
  assert store.client_ids == ['00002'] and store.num_classes == 10004
  assert store.client('00002')['train'][0].tolist() == [[1, 5, 4, 3] + [0] * 16]
