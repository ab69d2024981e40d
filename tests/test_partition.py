import numpy as np
import pytest

from fedjax_personal.datasets import DataConfig, load_federated, partition


def labels(n=2000, c=10, seed=0):
  return np.random.default_rng(seed).integers(0, c, n)


def assert_disjoint_cover(p, n, exact=True):
  allidx = np.concatenate(p.client_indices)
  assert len(np.unique(allidx)) == len(allidx)  # nothing assigned twice
  if exact:
    assert sorted(allidx) == list(range(n))  # every example assigned once


@pytest.mark.parametrize('alpha', [0.01, 0.4, 100.0])
def test_dirichlet_assigns_every_example_once_and_skews_labels(alpha):
  y = labels()
  p = partition.dirichlet(y, 20, alpha, np.random.default_rng(0))
  assert_disjoint_cover(p, len(y))
  assert p.sizes().min() >= 1  # empty clients topped up
  # Label skew grows as alpha shrinks: mean max-class share per client.
  share = np.mean(
    [np.bincount(y[i], minlength=10).max() / len(i) for i in p.client_indices]
  )
  if alpha == 0.01:
    assert share > 0.8
  if alpha == 100.0:
    assert share < 0.3


def test_dirichlet_is_deterministic_for_a_seed():
  y = labels()
  a = partition.dirichlet(y, 10, 0.3, np.random.default_rng(5))
  b = partition.dirichlet(y, 10, 0.3, np.random.default_rng(5))
  c = partition.dirichlet(y, 10, 0.3, np.random.default_rng(6))
  assert all(
    np.array_equal(x, z) for x, z in zip(a.client_indices, b.client_indices)
  )
  assert not all(
    np.array_equal(x, z) for x, z in zip(a.client_indices, c.client_indices)
  )


@pytest.mark.slow
def test_dirichlet_10000_clients_tiny_alpha_draws_once_per_class():
  """No resampling loop (which can loop for ever at tiny alpha): one
  Dirichlet draw per class, however many clients come out empty. A
  structural check, not a timed one (about 1 s here)."""

  class CountingRng:
    def __init__(self, rng):
      self.rng, self.dirichlet_calls = rng, 0

    def dirichlet(self, *a, **k):
      self.dirichlet_calls += 1
      return self.rng.dirichlet(*a, **k)

    def __getattr__(self, name):
      return getattr(self.rng, name)

  y = labels(60000)
  rng = CountingRng(np.random.default_rng(0))
  p = partition.dirichlet(y, 10000, 0.01, rng)
  assert rng.dirichlet_calls == len(np.unique(y))
  assert_disjoint_cover(p, len(y))
  assert p.sizes().min() >= 1


def test_impossible_sizes_are_rejected():
  with pytest.raises(ValueError, match='num_clients'):
    partition.dirichlet(labels(50), 100, 0.5, np.random.default_rng(0))
  with pytest.raises(ValueError, match='alpha'):
    partition.dirichlet(labels(), 10, 0.0, np.random.default_rng(0))
  with pytest.raises(ValueError, match='alpha'):
    partition.dirichlet(labels(), 10, -1.0, np.random.default_rng(0))


def test_pathological_gives_k_classes():
  y = np.repeat(np.arange(10), 100)
  p = partition.pathological(y, 20, 2, np.random.default_rng(0))
  assert_disjoint_cover(p, len(y))
  assert max(len(np.unique(y[i])) for i in p.client_indices) <= 2


def test_quantity_skew_sizes_vary():
  y = labels(5000)
  p = partition.quantity_skew(y, 20, 0.5, np.random.default_rng(0))
  assert_disjoint_cover(p, len(y))
  assert p.sizes().max() > 3 * p.sizes().min()


def test_rotation_groups_rotate_images():
  x = np.random.default_rng(0).random((400, 6, 6, 1)).astype(np.float32)
  y = labels(400)
  p = partition.rotation_groups(y, 8, np.random.default_rng(0), num_groups=4)
  assert list(p.groups) == [0, 0, 1, 1, 2, 2, 3, 3]
  for i in range(8):
    idx = p.client_indices[i]
    xr, yr = p.client_transform(i, x[idx], y[idx])
    np.testing.assert_array_equal(
      xr, np.rot90(x[idx], k=p.groups[i], axes=(1, 2))
    )
    np.testing.assert_array_equal(yr, y[idx])
  with pytest.raises(ValueError, match='num_groups'):
    partition.rotation_groups(y, 8, np.random.default_rng(0), num_groups=3)


def test_label_permutation_groups():
  y = labels(400)
  p = partition.label_permutation_groups(
    y, 8, 10, np.random.default_rng(0), num_groups=2
  )
  maps = {}
  for i in range(8):
    idx = p.client_indices[i]
    _, yp = p.client_transform(i, None, y[idx])
    for a, b in zip(y[idx], yp):
      # one permutation per group
      assert maps.setdefault((p.groups[i], a), b) == b
  assert all(maps[(0, c)] == c for c in range(10))  # group 0 keeps the labels
  assert any(maps[(1, c)] != c for c in range(10))


@pytest.mark.parametrize('permute', [False, True])
def test_sparse_classes(permute):
  y = np.repeat(np.arange(10), 100)
  p = partition.sparse_classes(
    y,
    10,
    10,
    5,
    np.random.default_rng(0),
    examples_per_client=100,
    permute=permute,
  )
  assert_disjoint_cover(p, len(y), exact=False)
  for i, idx in enumerate(p.client_indices):
    assert set(y[idx]) == {(i + j) % 10 for j in range(5)}
    assert len(idx) == 100 and np.all(
      np.bincount(y[idx], minlength=10)[y[idx]] == 20
    )
    if permute:
      _, yp = p.client_transform(i, None, y[idx])
      assert set(yp) == set(range(5))
  if permute:
    assert p.num_classes == 5
    # Different devices map the same class to different indices.
    maps = [
      dict(
        zip(
          y[p.client_indices[i]],
          p.client_transform(i, None, y[p.client_indices[i]])[1],
        )
      )
      for i in range(10)
    ]
    assert len({m[4] for m in maps if 4 in m}) > 1


def test_latent_clusters_follow_kmeans():
  rng = np.random.default_rng(0)
  centers = np.array([[0, 0], [10, 10], [-10, 10]], np.float32)
  x = np.concatenate([c + rng.normal(size=(60, 2)) for c in centers]).astype(
    np.float32
  )
  p = partition.latent_clusters(x, 6, 3, np.random.default_rng(0))
  assert_disjoint_cover(p, len(x))
  for g in range(3):
    members = np.nonzero(p.groups == g)[0]
    pts = np.concatenate([x[p.client_indices[m]] for m in members])
    # one tight cluster
    assert np.linalg.norm(pts - pts.mean(0), axis=1).max() < 6


def test_federated_splits_come_from_the_client_distribution():
  d = load_federated(
    DataConfig(dataset='mnist', num_clients=10, alpha=0.1, seed=0)
  )
  for i in range(10):
    ntr, nte = int(d.train.num_examples[i]), int(d.test.num_examples[i])
    assert nte >= 1 and abs(nte - 0.2 * (ntr + nte)) <= 1
    tr = set(d.train.y[i, :ntr].tolist())
    te = set(d.test.y[i, :nte].tolist())
    assert te <= tr | te and len(te - tr) <= 1  # same label skew
  assert int(d.train.num_examples.sum() + d.test.num_examples.sum()) == 10000
  again = load_federated(
    DataConfig(dataset='mnist', num_clients=10, alpha=0.1, seed=0)
  )
  np.testing.assert_array_equal(d.train.y, again.train.y)


def test_label_skew_by_hand():
  """Zhao et al.'s label skew sum_c |p_i(c) - p(c)|, averaged over clients."""
  from fedjax_personal.core.data import FederatedData, pad_clients

  ys = [np.array([0, 0, 0, 1]), np.array([1, 1, 2, 2])]  # pooled: 3/8, 3/8, 2/8
  split = pad_clients([np.zeros((4, 2))] * 2, ys, (2,), np.float32)
  data = FederatedData(
    train=split, val=split, test=split, groups=np.full(2, -1), num_classes=3
  )
  # client 0: (3/4, 1/4, 0) -> 3/8 + 1/8 + 2/8; client 1: (0, 1/2, 1/2) -> 3/8 +
  # 1/8 + 2/8
  np.testing.assert_allclose(data.label_skew(), 0.75)


@pytest.mark.slow
def test_semantic_features_cluster_by_class_better_than_pixels():
  """FedFomo's latent distributions cluster a trained classifier's features:
  on the digits their k-means clusters match the classes far better than the
  pixels' (adjusted Rand index), and the features follow the seed."""
  from sklearn.cluster import KMeans
  from sklearn.metrics import adjusted_rand_score

  from fedjax_personal.datasets import embedding, in_memory

  x, y, c = in_memory.load_digits()
  f = embedding.semantic_features(x, y, c, seed=0)
  np.testing.assert_array_equal(f, embedding.semantic_features(x, y, c, seed=0))
  ari = {
    name: adjusted_rand_score(
      y, KMeans(10, n_init=3, random_state=0).fit_predict(v)
    )
    for name, v in (('pixels', x.reshape(len(x), -1)), ('embedding', f))
  }
  # measured 0.87 against 0.57
  assert ari['embedding'] > ari['pixels'] + 0.15, ari


def test_latent_features_only_for_latent_clusters():
  from fedjax_personal.errors import ConfigError

  with pytest.raises(ConfigError, match='latent_features'):
    load_federated(
      DataConfig(dataset='digits', partition='iid', latent_features='embedding')
    )
  with pytest.raises(ConfigError, match='latent_features'):
    load_federated(
      DataConfig(
        dataset='digits', partition='latent_clusters', latent_features='vgg'
      )
    )
  skew = {
    f: load_federated(
      DataConfig(
        dataset='digits',
        partition='latent_clusters',
        num_clients=10,
        num_groups=5,
        latent_features=f,
      )
    ).label_skew()
    for f in ('pixels', 'embedding')
  }
  assert skew['embedding'] > skew['pixels'], skew
