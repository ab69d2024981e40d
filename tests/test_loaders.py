import hashlib

import numpy as np
import pytest

from fedjax_personal.datasets import (
  DataConfig,
  TextOptions,
  check_given,
  in_memory,
  load_federated,
  local_files,
)
from fedjax_personal.errors import ConfigError


def test_mnist_embedded_idx():
  x, y, c = in_memory.load_mnist()
  assert x.shape == (10000, 28, 28, 1) and x.dtype == np.uint8 and c == 10
  assert np.bincount(y).min() > 800
  path = local_files.find_file('mnist_t10k/t10k-images-idx3-ubyte.gz')
  assert (
    hashlib.md5(path.read_bytes()).hexdigest()
    == '9fb629c4189551a2d022fa330f9573f3'
  )
  # shipped inside the package
  assert str(local_files.PACKAGE_DATA) in str(path)


def test_read_idx_rejects_garbage(tmp_path):
  f = tmp_path / 'bad'
  f.write_bytes(b'\x01\x02\x03')
  with pytest.raises(ValueError, match='IDX'):
    in_memory.read_idx(f)


def test_digits():
  x, y, c = in_memory.load_digits()
  assert x.shape == (1797, 8, 8, 1) and 0 <= x.min() and x.max() <= 1


def test_missing_file_names_file_and_places(tmp_path):
  with pytest.raises(
    FileNotFoundError, match='nope.npz: not found in ' + str(tmp_path)
  ):
    local_files.find_file('nope.npz', str(tmp_path))


@pytest.mark.needs_data('cifar10_jpeg.npz')
def test_cifar10_jpeg_archive(tmp_path, monkeypatch):
  from fedjax_personal.datasets import cifar

  monkeypatch.setenv('FEDJAX_PERSONAL_CACHE', str(tmp_path))
  x, y, c = cifar.load('cifar10', split='test')
  assert x.shape == (10000, 32, 32, 3) and x.dtype == np.uint8 and c == 10
  assert np.bincount(y).tolist() == [1000] * 10
  assert list(tmp_path.iterdir())  # decoded once, cached
  xa, ya, _ = cifar.load('cifar10', split='all')
  assert len(ya) == 60000 and np.array_equal(xa[50000:], x)


@pytest.mark.needs_data(('input.txt', 'tinyshakespeare.txt'))
def test_tinyshakespeare_by_role():
  xs, ys, vocab = in_memory.load_tinyshakespeare(num_clients=10, seq_len=20)
  assert len(xs) == 10
  for x, y in zip(xs, ys):
    # next character
    assert x.shape[1] == 20 and np.array_equal(x[:, 1:], y[:, :-1])
    assert x.shape[0] >= 1000 // 21
  d = load_federated(
    DataConfig(
      dataset='tinyshakespeare',
      partition='natural',
      num_clients=5,
      options=TextOptions(seq_len=20),
    )
  )
  assert d.num_classes == len(vocab) and d.train.y.shape[2] == 20


def test_shakespeare_role_parsing():
  text = 'First Citizen:\nBefore we proceed:\nhear me.\n\nAll:\nSpeak.\n\nFirst Citizen:\nYou are.\n'
  roles = in_memory.parse_shakespeare_roles(text)
  assert roles == {
    'First Citizen': 'Before we proceed:\nhear me.\nYou are.',
    'All': 'Speak.',
  }
  with pytest.raises(ValueError, match='num_clients'):
    in_memory.load_tinyshakespeare(num_clients=3, min_chars=1, text=text)


def test_synthetic_alpha_beta():
  rng = np.random.default_rng(0)
  xs, ys = in_memory.synthetic(30, 1.0, 1.0, rng)
  assert len(xs) == 30 and all(x.shape[1] == 60 for x in xs)
  assert all(len(x) >= 50 for x in xs)
  # Heterogeneity: label distributions differ across clients.
  dists = np.array([np.bincount(y, minlength=10) / len(y) for y in ys])
  assert dists.std(axis=0).mean() > 0.05
  d = load_federated(
    DataConfig(dataset='synthetic', partition='natural', num_clients=8)
  )
  assert d.num_clients == 8 and d.train.x.shape[2] == 60


def test_synthetic_sizes_are_fedprox_lognormal_capped_or_not():
  """Sizes lognormal(4, 2) + 50, as FedProx's generator draws them: capped at
  1,000 by default, not at all with max_examples=0; the clients drawn
  before the first capped one are the same either way."""
  sizes = np.random.default_rng(5).lognormal(4, 2, 40).astype(int) + 50
  assert sizes.max() > 1000  # the cap matters for this draw
  capped, _ = in_memory.synthetic(40, 1.0, 1.0, np.random.default_rng(5))
  uncapped, _ = in_memory.synthetic(
    40, 1.0, 1.0, np.random.default_rng(5), max_examples=0
  )
  np.testing.assert_array_equal(
    [len(x) for x in capped], np.minimum(sizes, 1000)
  )
  np.testing.assert_array_equal([len(x) for x in uncapped], sizes)
  first = int(np.argmax(sizes > 1000))
  assert first > 0
  for k in range(first):
    np.testing.assert_array_equal(capped[k], uncapped[k])


def test_synthetic_settings_move_the_data():
  """--synthetic_beta spreads the clients' feature means (v_k ~ N(B_k, 1),
  B_k ~ N(0, beta)). alpha shifts every entry of W_k and b_k by one u_k, every
  class's logit alike, so no label changes (FedProx's generator has it so;
  the command has no flag for it). A negative one is refused naming it."""

  def client_means(**kw):
    d = load_federated(
      DataConfig(
        dataset='synthetic',
        partition='natural',
        num_clients=16,
        seed=3,
        options=in_memory.SyntheticOptions(**kw),
      )
    )
    n = np.asarray(d.train.num_examples)
    return np.array([d.train.x[k, : n[k]].mean() for k in range(16)]), d.train.y

  flat, y0 = client_means(synthetic_beta=0.0)
  spread, _ = client_means(synthetic_beta=9.0)
  assert flat.std() < 0.5 < 1.5 < spread.std()  # about 1/sqrt(60) against 3
  _, y1 = client_means(synthetic_beta=0.0, synthetic_alpha=5.0)
  np.testing.assert_array_equal(y0, y1)
  with pytest.raises(ConfigError, match='--synthetic_beta: must be >= 0'):
    in_memory.synthetic(2, 1.0, -1.0, np.random.default_rng(0))


@pytest.mark.parametrize(
  'name,shape,classes',
  [
    ('mnist', (28, 28, 1), 10),
    ('cifar10', (32, 32, 3), 10),
    # TFDS's emnist is its byclass config, as --dataset=emnist
    (
      'emnist',
      (28, 28, 1),
      62,
    ),
    ('emnist/digits', (28, 28, 1), 10),
  ],
)
def test_tfds_loader_with_mock_data(name, shape, classes):
  """TFDS names mean what TFDS means (a builder config may follow)."""
  tfds = pytest.importorskip('tensorflow_datasets')
  from fedjax_personal.datasets.tfds_loader import load_tfds

  with tfds.testing.mock_data(num_examples=30):
    x, y, c = load_tfds(name)
    assert x.shape == (30,) + shape and c == classes and y.max() < classes
    d = load_federated(
      DataConfig(dataset=f'tfds:{name}', num_clients=3, alpha=1.0)
    )
    assert d.num_clients == 3


def test_tfds_missing_data_is_a_clear_error(tmp_path):
  pytest.importorskip('tensorflow_datasets')
  from fedjax_personal.datasets.tfds_loader import load_tfds

  with pytest.raises(FileNotFoundError, match='not prepared'):
    load_tfds('mnist', data_dir=str(tmp_path))


def test_tfds_tiny_shakespeare_text_with_mock_data():
  tfds = pytest.importorskip('tensorflow_datasets')
  from fedjax_personal.datasets.tfds_loader import load_tfds

  with tfds.testing.mock_data(num_examples=3):
    text = load_tfds('tiny_shakespeare')
  assert isinstance(text, str) and len(text) > 0


def test_a_pool_of_ones_own_is_a_registry_entry(tmp_path, monkeypatch):
  """register_pool: a reader of (x, y, num_classes) is partitioned by
  --partition as the built-in pools are; --data_dir applies only when the
  reader takes it; a reader naming what it is never given is refused."""
  from fedjax_personal.datasets import registry

  for table in ('POOLS', 'OPTIONS', 'OWNERS'):
    monkeypatch.setattr(registry, table, dict(getattr(registry, table)))
  x = np.random.default_rng(0).normal(size=(120, 3)).astype(np.float32)
  y = (np.arange(120) % 4).astype(np.int32)

  registry.register_pool('my_pool', lambda: (x, y, 4))
  data = load_federated(
    DataConfig(dataset='my_pool', partition='iid', num_clients=6)
  )
  assert data.num_clients == 6 and data.num_classes == 4
  total = sum(
    int(np.asarray(s.num_examples).sum())
    for s in (data.train, data.val, data.test)
  )
  assert total == 120  # every example once
  with pytest.raises(ConfigError, match='data_dir: does nothing'):
    check_given(
      DataConfig(dataset='my_pool', data_dir=str(tmp_path)), {'data_dir'}
    )
  registry.register_pool('my_files', lambda data_dir=None: (x, y, 4))
  check_given(
    DataConfig(dataset='my_files', data_dir=str(tmp_path)), {'data_dir'}
  )
  with pytest.raises(TypeError, match="takes 'path'"):
    registry.register_pool('my_typo', lambda path: (x, y, 4))
  with pytest.raises(ValueError, match='built-in'):
    registry.register_pool('mnist', lambda: (x, y, 4))
