"""FedJAX's federated data API (``datasets/federated.py``) against FedJAX
0.0.17 itself: ``tests/data/fedjax_api_reference.npz`` was written by
FedJAX's own ``emnist.load_data`` on the made files this test makes again
(``benchmarks/peers/fedjax_api_reference.py``, in FedJAX's venv). Ids,
sizes, every batch of ``batch`` / ``padded_batch`` / ``shuffle_repeat_batch``
under several settings, ``shuffled_clients`` and ``slice`` must agree."""

import os

import numpy as np
import pytest

import made_files
from fedjax_personal.datasets import emnist, federated

REFERENCE = os.path.join(os.path.dirname(__file__), 'data', 'fedjax_api_reference.npz')


@pytest.fixture(scope='module')
def emnist_made(tmp_path_factory):
  folder = tmp_path_factory.mktemp('emnist')
  made_files.write_emnist(folder, np.random.default_rng(0), [5, 9, 3, 7], [2, 1, 3, 2])
  return folder


def _reference_module():
  """benchmarks/peers/fedjax_api_reference.py, whose ``record`` wrote the
  reference from FedJAX's objects and records this project's here."""
  import importlib.util
  path = os.path.join(os.path.dirname(__file__), '..', 'benchmarks', 'peers',
                      'fedjax_api_reference.py')
  spec = importlib.util.spec_from_file_location('fedjax_api_reference', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_emnist_load_data_equals_fedjax_on_the_same_files(emnist_made):
  train, test = emnist.load_data(only_digits=False, cache_dir=str(emnist_made))
  ours = _reference_module().record(train, test)
  theirs = dict(np.load(REFERENCE))
  assert sorted(ours) == sorted(theirs)
  for k, want in theirs.items():
    got = ours[k]
    assert got.dtype == want.dtype, k
    assert got.shape == want.shape, k
    if got.dtype.kind == 'f':
      np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=k)
    else:
      np.testing.assert_array_equal(got, want, err_msg=k)


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
  assert list(sub.client_ids()) == [c for c, _ in sub.clients()] == [
      b'f0000_00', b'f0001_01', b'f0003_03']
  assert [c for c, _ in sub.client_sizes()] == [c for c in train.client_ids() if c in
                                                 {b'f0000_00', b'f0001_01', b'f0003_03'}]
  assert [c for c, _ in sub.get_clients([b'f0003_03', b'f0000_00'])] == [b'f0003_03', b'f0000_00']
  with pytest.raises(KeyError):
    sub.get_client(b'f0002_02')
  with pytest.raises(ValueError, match='not in the base FederatedData'):
    train.subset([b'f0001_01', b'nobody'])
  assert list(sub.slice(b'f0001').client_ids()) == [b'f0001_01', b'f0003_03']
  store = train.slice(b'f0001', b'f0003').store
  assert store.client_ids == ['f0001_01', 'f0002_02'] and store.num_clients == 2
  x, y = store.client('f0001_01')['train']
  np.testing.assert_array_equal(train.get_client(b'f0001_01').all_examples()['y'], y)
  # batches of the project's view and the raw file agree: x = 1 - pixels
  pixels = made_files.emnist_clients(np.random.default_rng(0), [5, 9, 3, 7])[1][1]['pixels']
  np.testing.assert_allclose(x[..., 0], 1 - pixels, rtol=1e-6)
  # preprocessing chains as FedJAX's does
  doubled = train.preprocess_batch(lambda e: {**e, 'y': e['y'] * 2})
  first = next(iter(doubled.get_client(b'f0000_00').batch(batch_size=2)))
  assert np.array_equal(first['y'], 2 * train.get_client(b'f0000_00').raw_examples['y'][:2])


def test_batching_by_hand():
  c = federated.ClientDataset({'x': np.arange(11), 'y': np.arange(11) * 10})
  sizes = [len(b['x']) for b in c.padded_batch(batch_size=8, num_batch_size_buckets=3)]
  assert sizes == [8, 4]  # 3 left: 8 -> 4 (holds 3), not 2
  last = list(c.padded_batch(batch_size=8, num_batch_size_buckets=3))[-1]
  assert last['__mask__'].tolist() == [True, True, True, False]
  assert last['x'].tolist() == [8, 9, 10, 0]
  assert [len(b['x']) for b in c.batch(batch_size=4)] == [4, 4, 3]
  epoch = np.concatenate([b['x'] for b in c.shuffle_repeat_batch(batch_size=11, seed=5)])
  assert sorted(epoch.tolist()) == list(range(11))  # one pass: a permutation
  order = np.arange(11, dtype=np.int32)
  np.random.RandomState(5).shuffle(order)
  assert epoch.tolist() == order.tolist()
  assert len(list(c.shuffle_repeat_batch(batch_size=4, num_epochs=2))) == 6  # ceil(22 / 4)
  assert len(list(c.shuffle_repeat_batch(batch_size=4, num_epochs=None, num_steps=9))) == 9
  with pytest.raises(TypeError, match='batch_sz'):
    c.batch(batch_sz=3)


def test_stackoverflow_load_data_gives_train_held_out_and_test_as_fedjax(tmp_path):
  """FedJAX's ``stackoverflow.load_data`` returns (train, held_out, test): the
  held-out file's users, each with all their posts, tokenized with the train
  users' vocabulary."""
  from fedjax_personal.datasets import stackoverflow
  words = ['the', 'is', 'code'] + [f'w{i}' for i in range(9997)]
  (tmp_path / 'stackoverflow.word_count').write_text(
      ''.join(f'{w} {10**5 - i}\n' for i, w in enumerate(words)))
  tok = lambda items: {'tokens': made_files.bytes_array(items)}
  made_files.write_fedjax_sqlite(tmp_path / 'stackoverflow_train.sqlite', [
      (b'00001', tok([b'the code', b'is'])), (b'00002', tok([b'code is the']))])
  made_files.write_fedjax_sqlite(tmp_path / 'stackoverflow_test.sqlite', [
      (b'00002', tok([b'is the']))])
  made_files.write_fedjax_sqlite(tmp_path / 'stackoverflow_held_out.sqlite', [
      (b'50000', tok([b'the is', b'nope code'])), (b'60000', tok([b'code']))])
  train, held_out, test = stackoverflow.load_data(cache_dir=str(tmp_path), sequence_length=4)
  assert list(train.client_ids()) == [b'00001', b'00002'] and list(test.client_ids()) == [b'00002']
  assert list(held_out.client_ids()) == [b'50000', b'60000'] and held_out.num_clients() == 2
  # ids: PAD 0, BOS 1, EOS 2, the 3, is 4, code 5, ..., OOV 10003
  ex = held_out.get_client(b'50000').all_examples()
  assert ex['x'].tolist() == [[1, 3, 4, 0], [1, 10003, 5, 0]]
  assert ex['y'].tolist() == [[3, 4, 2, 0], [10003, 5, 2, 0]]
  assert held_out.get_client(b'60000').all_examples()['x'].tolist() == [[1, 5, 0, 0]]
  assert train.get_client(b'00002').all_examples()['x'].tolist() == [[1, 5, 4, 3]]
