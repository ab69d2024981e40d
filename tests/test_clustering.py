"""Server-side clustering in JAX against scikit-learn (the oracle): k-means
inertia, silhouette, the silhouette's choice of k, complete-linkage
bipartition, ARI; user-centric's W from a shift scenario; CFL's split
decisions against the host version they replaced."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sklearn.cluster import AgglomerativeClustering, KMeans
from sklearn.metrics import adjusted_rand_score, silhouette_score

import fedjax_personal as fp
from fedjax_personal.algorithms import cfl as cfl_lib
from fedjax_personal.algorithms import usercentric as uc
from fedjax_personal.core import clustering as cl
from fedjax_personal.core.algorithm import RoundContext
from fedjax_personal.core.data import to_device
from fedjax_personal.core.engine import pre_round_functions
from fedjax_personal.datasets import DataConfig, load_federated


def blobs(seed, groups=3, per=8, dim=6, spread=0.2):
  rng = np.random.default_rng(seed)
  centres = rng.normal(size=(groups, dim)) * 3
  x = np.concatenate(
    [c + spread * rng.normal(size=(per, dim)) for c in centres]
  )
  return x.astype(np.float32), np.repeat(np.arange(groups), per)


@pytest.fixture(scope='module')
def shift_w():
  """W (eq. 6) of a label-permutation scenario: 12 clients in 3 groups,
  computed by the collaboration round at a model trained 3 rounds."""
  data = to_device(
    load_federated(
      DataConfig(
        dataset='digits',
        partition='label_permutation',
        num_groups=3,
        num_clients=12,
        max_examples=1200,
      )
    )
  )
  model = fp.models.from_flax(
    'logreg', fp.models.LogisticRegression(10), data.train.x[0, :1]
  )
  alg = uc.usercentric(
    model,
    12,
    data.train.num_examples,
    optax.sgd(0.1),
    fp.Batching(16, 1),
    num_streams=12,
    sigma_batch_size=16,
  )
  runner = fp.RoundRunner(
    alg, data, fp.CohortSampler(12, cohort_size=12), fp.executors.VmapExecutor()
  )
  state = runner.init(jax.random.key(0))
  # FedAvg-free warm-up: local rounds from the initial mixing
  for t in range(1, 4):
    state, _ = runner.round(state, jax.random.key(t), t)
  state, _ = jax.jit(pre_round_functions(alg, fp.executors.VmapExecutor())[2])(
    state,
    RoundContext(jnp.asarray(0, jnp.int32), jax.random.key(9)),
    data.train,
    data.val,
  )
  return np.asarray(state.stream_matrix), np.asarray(data.groups)


@pytest.mark.parametrize('k', [2, 3, 4])
@pytest.mark.ci_variants('3')
def test_kmeans_inertia_no_worse_than_sklearn_on_w(shift_w, k):
  w, _ = shift_w
  ours = float(cl.kmeans(jax.random.key(0), w, k, k, restarts=10).inertia)
  theirs = (
    KMeans(k, n_init=10, random_state=0).fit(w.astype(np.float64)).inertia_
  )
  assert ours <= theirs * (1 + 1e-4), (ours, theirs)


@pytest.mark.slow
def test_kmeans_on_blobs_and_padding():
  x, g = blobs(0)
  r = cl.kmeans(jax.random.key(1), x, 3, 6, restarts=5)
  assert adjusted_rand_score(g, np.asarray(r.labels)) == 1.0
  assert np.asarray(r.labels).max() < 3  # centroids >= k unused
  theirs = KMeans(3, n_init=5, random_state=0).fit(x).inertia_
  np.testing.assert_allclose(float(r.inertia), theirs, rtol=1e-4)


def test_silhouette_equals_sklearn():
  rng = np.random.default_rng(0)
  x = rng.random((15, 4)).astype(np.float32)
  d = cl.distances(jnp.asarray(x))
  for labels in (
    rng.integers(0, 3, 15),
    np.r_[0, rng.integers(1, 4, 14)],
    np.repeat([0, 1], [1, 14]),
  ):
    np.testing.assert_allclose(
      float(cl.silhouette_score(d, jnp.asarray(labels), 5)),
      silhouette_score(x, labels),
      rtol=1e-4,
      atol=1e-6,
    )
  assert float(cl.silhouette_score(d, jnp.zeros(15, jnp.int32), 5)) == -np.inf


@pytest.mark.slow
def test_silhouette_choice_matches_sklearn_loop():
  """On well-separated groups the search over 2..N-1 picks the k that
  scikit-learn's KMeans + silhouette_score loop picks (the true one)."""
  for groups in (3, 5):  # 15 points either way: one compiled search
    x, g = blobs(groups, groups=groups, per=15 // groups)
    n = len(x)
    scores = {
      k: silhouette_score(
        x, KMeans(k, n_init=10, random_state=0).fit_predict(x)
      )
      for k in range(2, n)
    }
    r = cl.silhouette_kmeans(jax.random.key(0), x, n - 1)
    assert int(r.k) == max(scores, key=scores.get) == groups
    assert adjusted_rand_score(g, np.asarray(r.labels)) == 1.0


@pytest.mark.slow
def test_streams_on_w_agree_with_sklearn(shift_w):
  """The silhouette streams of the scenario's W against scikit-learn's loop
  on the same W: the same k; the ARI of both against the true groups is
  reported (printed) and the two labelings agree."""
  w, groups = shift_w
  _, labels, k = uc.streams(jax.random.key(0), w, None, 11)
  scores = {}
  for kk in range(2, 12):
    lab = KMeans(kk, n_init=10, random_state=0).fit_predict(
      w.astype(np.float64)
    )
    scores[kk] = (silhouette_score(w, lab), lab)
  best = max(scores, key=lambda kk: scores[kk][0])
  ari_ours = adjusted_rand_score(groups, np.asarray(labels))
  ari_sk = adjusted_rand_score(groups, scores[best][1])
  print(
    f'label permutation, 12 clients: k = {int(k)} (sklearn {best}); ARI vs '
    f'groups '
    f'{ari_ours:.3f} (sklearn {ari_sk:.3f})'
  )
  assert int(k) == best
  assert adjusted_rand_score(scores[best][1], np.asarray(labels)) == 1.0


def test_bipartition_equals_complete_linkage():
  rng = np.random.default_rng(0)
  for trial in range(4):
    x = rng.normal(size=(14, 5)).astype(np.float32)
    d = np.asarray(cl.distances(jnp.asarray(x)))
    member = rng.random(14) < 0.7
    member[:2] = True
    second = np.asarray(cl.bipartition(jnp.asarray(d), jnp.asarray(member)))
    assert not second[~member].any() and not second[np.argmax(member)]
    theirs = AgglomerativeClustering(
      2, metric='precomputed', linkage='complete'
    ).fit_predict(d[member][:, member].astype(np.float64))
    assert adjusted_rand_score(theirs, second[member]) == 1.0, trial


def test_adjusted_rand_index_equals_sklearn():
  rng = np.random.default_rng(0)
  for _ in range(5):
    a, b = rng.integers(0, 4, 20), rng.integers(0, 6, 20)
    np.testing.assert_allclose(
      float(cl.adjusted_rand_index(jnp.asarray(a), jnp.asarray(b), 4, 6)),
      adjusted_rand_score(a, b),
      rtol=1e-5,
    )
  np.testing.assert_allclose(
    float(
      cl.adjusted_rand_index(
        jnp.zeros(6, jnp.int32), jnp.zeros(6, jnp.int32), 1, 1
      )
    ),
    1.0,
  )


def host_split_decisions(updates, cluster, weights, eps1, eps2, ratio=0.0):
  """The host version CFL used before (numpy + scikit-learn), kept as oracle."""
  cluster = cluster.copy()
  nxt = int(cluster.max()) + 1
  for c in np.unique(cluster):
    members = np.nonzero(cluster == c)[0]
    if len(members) < 2:
      continue
    u = updates[members]
    w = weights[members] / max(weights[members].sum(), 1e-12)
    mean_norm = float(np.linalg.norm(w @ u))
    max_norm = float(np.linalg.norm(u, axis=1).max())
    stationary = mean_norm < ratio * max_norm if ratio > 0 else mean_norm < eps1
    if stationary and max_norm > eps2:
      un = u / np.maximum(np.linalg.norm(u, axis=1, keepdims=True), 1e-12)
      dist = np.clip(1.0 - un @ un.T, 0.0, 2.0)
      labels = AgglomerativeClustering(
        n_clusters=2, metric='precomputed', linkage='complete'
      ).fit_predict(dist)
      cluster[members[labels == 1]] = nxt
      nxt += 1
  return cluster


def test_cfl_split_decisions_equal_the_host_version():
  """Random updates of 3 directions in 2 existing clusters: the same
  partition as the scikit-learn host version (ids may differ)."""
  rng = np.random.default_rng(0)
  for trial in range(4):
    dirs = rng.normal(size=(3, 10))
    which = rng.integers(0, 3, 12)
    u = (dirs[which] + 0.3 * rng.normal(size=(12, 10))).astype(np.float32)
    cluster = (np.arange(12) >= 7).astype(np.int32)
    w = rng.integers(5, 20, 12).astype(np.float32)
    want = host_split_decisions(u, cluster, w, eps1=100.0, eps2=0.5)
    got, k, _ = cfl_lib.split_decisions(
      jnp.asarray(u), jnp.asarray(cluster), jnp.asarray(w), 2, 100.0, 0.5
    )
    assert adjusted_rand_score(want, np.asarray(got)) == 1.0, trial
    assert int(k) == len(set(want.tolist()))
