"""FedFomo and clustered FL."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_personal as fp
from fedjax_personal.algorithms import cfl as cfl_lib
from fedjax_personal.algorithms import fedfomo as fomo
from fedjax_personal.core.data import permute_eval_targets, to_device
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.core.training import Batch, dp_gradient
from fedjax_personal.datasets import DataConfig, load_federated
from fedjax_personal.run.experiment import run


def test_fomo_weights_and_update_by_hand():
  base = {'w': jnp.array([0.0, 0.0])}
  # distances 5, 1, 1
  cands = {'w': jnp.array([[3.0, 4.0], [0.0, 1.0], [1.0, 0.0]])}
  losses = jnp.array([1.0, 2.5, 1.5])
  w = fomo.fomo_weights(None, base, cands, 2.0, losses)
  np.testing.assert_allclose(w, [(2 - 1) / 5, (2 - 2.5) / 1, (2 - 1.5) / 1])
  new = fomo.fomo_update(base, cands, w)
  pos = np.array([0.2, 0.0, 0.5]) / 0.7
  np.testing.assert_allclose(new['w'], pos @ np.asarray(cands['w']), rtol=1e-6)
  # No positive weight: keep the base model.
  kept = fomo.fomo_update(base, cands, jnp.array([-1.0, -0.1, 0.0]))
  np.testing.assert_allclose(kept['w'], base['w'])


def test_eps_greedy_choice_frequencies():
  n, m = 8, 2
  # client 7 best, then 6
  aff = jnp.tile(jnp.arange(n, dtype=jnp.float32)[None], (1, 1))
  clients = jnp.array([0])
  choose = jax.jit(
    lambda k, e: fomo.choose_candidates(k, aff, clients, m, e, n)
  )
  greedy = sorted(np.asarray(choose(jax.random.key(0), 0.0))[0].tolist())
  assert greedy == [6, 7]
  draws = np.stack(
    [np.asarray(choose(jax.random.key(t), 0.3))[0] for t in range(600)]
  )
  not_greedy = np.mean([sorted(d.tolist()) != [6, 7] for d in draws])
  # Random M-subsets of the 7 others coincide with {6, 7} with prob. 1/21.
  assert abs(not_greedy - 0.3 * (1 - 1 / 21)) < 0.06
  assert not np.any(draws == 0)  # never itself


def test_candidate_choice_follows_the_round_key():
  """FedFomo's exploration draws from the server key of the round (derived
  from the experiment's seed): same key, same candidates; other keys, others."""
  model = fp.models.from_flax(
    'logreg', fp.models.LogisticRegression(3), np.zeros((1, 4))
  )
  alg = fomo.fedfomo(
    model, 12, optax.sgd(0.1), fp.Batching(4, 1), num_candidates=3, eps0=1.0
  )
  state = alg.init(jax.random.key(0))
  cohort = fp.CohortSampler(12, cohort_size=12)(jax.random.key(0))

  def candidates(seed):
    rc = fp.RoundContext(round=jnp.int32(0), key=jax.random.key(seed))
    return np.asarray(alg.server_broadcast(state, cohort, rc)[1][1])

  np.testing.assert_array_equal(candidates(1), candidates(1))
  assert not np.array_equal(candidates(1), candidates(2))


@pytest.mark.slow
def test_fedfomo_in_group_share_of_positive_weight():
  """With known groups (e.g. latent distributions), the round reports the
  share of the positive weight that goes to downloads from the client's own
  group, and the group-blind chance level."""
  data = to_device(
    load_federated(
      DataConfig(
        dataset='digits',
        partition='iid',
        num_clients=6,
        val_fraction=0.3,
        max_examples=600,
      )
    )
  )
  model = fp.models.from_flax(
    'mlp', fp.models.MLP(10, hidden=(8,)), data.train.x[0, :1]
  )
  groups = np.array([0, 0, 1, 1, 1, 1])
  alg = fomo.fedfomo(
    model,
    6,
    optax.sgd(0.1),
    fp.Batching(16, 1),
    num_candidates=3,
    eps0=0.0,
    groups=groups,
  )
  runner = RoundRunner(
    alg, data, fp.CohortSampler(6, cohort_size=6), fp.executors.VmapExecutor()
  )
  prev = runner.init(jax.random.key(0))
  same = groups[:, None] == groups[None, :]
  for r in range(6):
    new, m = runner.round(prev, jax.random.key(r), r)
    pos = np.maximum(np.asarray(new.affinity) - np.asarray(prev.affinity), 0)
    want = pos[same].sum() / pos.sum() if pos.sum() > 0 else 0.0
    assert np.isclose(float(m['fomo_in_group_share']), want, atol=1e-5), r
    assert float(m['fomo_in_group_chance']) == pytest.approx(
      (2 * 1 / 5 + 4 * 3 / 5) / 6
    )
    if pos.sum() > 0 and 0 < want < 1:
      break
    prev = new
  # a round with weight inside and outside groups
  assert pos.sum() > 0 and 0 < want < 1


@pytest.mark.slow
def test_fedfomo_round_updates_affinity_and_models():
  data = to_device(
    load_federated(
      DataConfig(
        dataset='digits', num_clients=5, val_fraction=0.2, max_examples=500
      )
    )
  )
  model = fp.models.from_flax(
    'mlp', fp.models.MLP(10, hidden=(8,)), data.train.x[0, :1]
  )
  alg = fomo.fedfomo(
    model, 5, optax.sgd(0.1), fp.Batching(16, 1), num_candidates=2, eps0=0.0
  )
  runner = RoundRunner(
    alg, data, fp.CohortSampler(5, cohort_size=5), fp.executors.VmapExecutor()
  )
  state = runner.init(jax.random.key(0))
  s1, m1 = runner.round(state, jax.random.key(0), 0)
  s2, m2 = runner.round(s1, jax.random.key(1), 1)
  aff = np.asarray(s2.affinity)
  # The diagnostic: share of the 5 x 2 candidates with a positive weight
  # (none in round 1, where all models are equal).
  assert float(m1['fomo_positive_share']) == 0.0
  d = np.asarray(s2.affinity) - np.asarray(s1.affinity)
  assert np.isclose(
    float(m2['fomo_positive_share']), np.count_nonzero(d > 0) / 10
  )
  assert np.all(np.diag(aff) == 0) and np.count_nonzero(aff) > 0
  # Round 1 starts from identical models (distance 0: weight 0); in round 2 each
  # client adds weights for exactly its 2 candidates.
  assert np.all(np.count_nonzero(aff - np.asarray(s1.affinity), axis=1) <= 2)
  acc = fp.summarize(runner.evaluate(s2, jax.random.key(0)))
  assert 0 <= acc['accuracy_mean'] <= 1


@pytest.mark.slow
def test_dp_gradient_clips_and_adds_noise():
  model = fp.models.from_flax(
    'logreg', fp.models.LogisticRegression(3), jnp.zeros((1, 4))
  )
  params = model.init(jax.random.key(0))
  obj = fp.training.plain_objective(model)
  b = Batch(
    jax.random.normal(jax.random.key(1), (6, 4)) * 100,
    jnp.array([0, 1, 2, 0, 1, 2]),
    jnp.array([True] * 5 + [False]),
  )
  g, _ = dp_gradient(
    obj, params, b, jax.random.key(2), clip_norm=0.5, noise_multiplier=0.0
  )
  norm = float(jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree.leaves(g))))
  assert norm <= 0.5 + 1e-5  # mean of clipped per-example gradients
  g1, _ = dp_gradient(obj, params, b, jax.random.key(2), 0.5, 1.0)
  g2, _ = dp_gradient(obj, params, b, jax.random.key(3), 0.5, 1.0)
  assert not np.allclose(g1['output']['kernel'], g2['output']['kernel'])


def test_permuted_eval_targets():
  data = load_federated(
    DataConfig(dataset='digits', num_clients=4, val_fraction=0.2)
  )
  p = permute_eval_targets(data, [1, 2, 3, 0])
  np.testing.assert_array_equal(p.test.y[0], data.test.y[1])
  np.testing.assert_array_equal(p.train.y[0], data.train.y[0])


def split(updates, eps1, eps2, ratio=0.0):
  """(cluster ids, ids of clusters that split) from one cluster of 8."""
  cluster, k, did = cfl_lib.split_decisions(
    jnp.asarray(updates, jnp.float32),
    jnp.zeros(8, jnp.int32),
    jnp.ones(8),
    1,
    eps1,
    eps2,
    ratio,
  )
  assert int(k) == 1 + int(np.sum(did))
  return np.asarray(cluster), np.nonzero(np.asarray(did))[0].tolist()


def test_cfl_split_rule():
  rng = np.random.default_rng(0)
  v = rng.normal(size=20)
  opposed = np.concatenate(
    [v + 0.1 * rng.normal(size=(4, 20)), -v + 0.1 * rng.normal(size=(4, 20))]
  )
  cluster, splits = split(opposed, eps1=1.0, eps2=2.0)
  assert (
    len(splits) == 1
    and len(set(cluster[:4])) == 1
    and len(set(cluster[4:])) == 1
  )
  assert cluster[0] != cluster[4]
  # one homogeneous group: mean update is large
  same = v + 0.1 * rng.normal(size=(8, 20))
  cluster, splits = split(same, eps1=1.0, eps2=2.0)
  assert not splits and set(cluster) == {0}
  # The scale-free test: same decisions whatever the scale of the updates.
  for scale in (1e-3, 1e3):
    c1, s1 = split(scale * opposed, 0, 0, ratio=0.5)
    c2, s2 = split(scale * same, 0, 0, ratio=0.5)
    assert len(s1) == 1 and not s2


@pytest.mark.parametrize('partition', ['label_permutation', 'iid'])
@pytest.mark.slow_variants('label_permutation')
def test_cfl_splits_opposed_groups_and_not_a_homogeneous_one(partition):
  data = to_device(
    load_federated(
      DataConfig(
        dataset='digits',
        partition=partition,
        num_groups=2,
        num_clients=6,
        max_examples=900,
      )
    )
  )
  model = fp.models.from_flax(
    'logreg', fp.models.LogisticRegression(10), data.train.x[0, :1]
  )
  # Measured here: after 5 rounds the mean update norm is ~0.39 of ~0.8 per
  # client under label permutation, and ~0.44-0.48 of ~0.55 when IID.
  alg = cfl_lib.cfl(
    model,
    6,
    data.train.num_examples,
    optax.sgd(0.5),
    fp.Batching(32, 1),
    eps1=0.45,
    eps2=0.7,
    warmup_rounds=5,
  )
  runner = RoundRunner(
    alg, data, fp.CohortSampler(6, cohort_size=6), fp.executors.VmapExecutor()
  )
  state, history = run(runner, 9, eval_every=9)
  cluster = np.asarray(state.cluster)
  if partition == 'iid':
    assert set(cluster) == {0}
  else:
    from sklearn.metrics import adjusted_rand_score

    assert adjusted_rand_score(np.asarray(data.groups), cluster) == 1.0, cluster
    assert any(r.get('cfl_splits') for r in history)
