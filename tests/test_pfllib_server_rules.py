"""Server rules of PFLlib's algorithms checked against plain loops and
solvers: FedPAC's quadratic program and its server's combination of heads
(in PFLlib's order, written in place), FedCAC's critical masks and
collaboration matrix, FedAMP's cloud models (its ``send_models`` loop),
FedMTL's regularizer (PFLlib's expression over the whole W), FedCross's
partners (its ``cross_aggregation`` loop, ties included), FedNTD's uniform
mean (its ``add_parameters``)."""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import optimize

from fedjax_personal import algorithms
from fedjax_personal.algorithms import (
  fedamp,
  fedcac,
  fedcross,
  fedkd,
  fedmtl,
  fedpac,
)


@pytest.mark.parametrize('seed', range(4))
def test_simplex_qp_equals_a_general_solver(seed):
  rng = np.random.default_rng(seed)
  c = 6
  r = rng.normal(size=(c, 3 * c)) * rng.uniform(0.1, 3)
  p = r @ r.T / (3 * c) + np.diag(rng.uniform(0.001, 0.5, c))
  support = np.ones(c, bool)
  support[rng.integers(c)] = False  # an inactive slot takes no weight
  got = np.asarray(fedpac.simplex_qp(jnp.asarray(p, jnp.float32), support))
  s = np.flatnonzero(support)
  res = optimize.minimize(
    lambda a: a @ p[np.ix_(s, s)] @ a,
    np.full(len(s), 1 / len(s)),
    jac=lambda a: 2 * p[np.ix_(s, s)] @ a,
    bounds=[(0, 1)] * len(s),
    constraints=[{'type': 'eq', 'fun': lambda a: a.sum() - 1}],
    method='SLSQP',
    options={'ftol': 1e-14, 'maxiter': 1000},
  )
  want = np.zeros(c)
  want[s] = res.x
  np.testing.assert_allclose(got, want, atol=2e-5)
  assert got[~support].sum() == 0 and abs(got.sum() - 1) < 1e-5


def _pfllib_heads(alphas, active, order, heads):
  """serverpac.py's aggregate_and_send_heads as its loop runs: the i-th
  upload's client gets the weights of the i-th selected client over the
  uploaded heads, whose modules it writes into as it goes."""
  live = [h.copy() for h in heads]
  selected = [i for i in range(len(active)) if active[i]]
  uploaded = [int(i) for i in order[: len(selected)]]
  for idx, cid in enumerate(uploaded):
    w = alphas[selected[idx]][selected]
    live[cid] = sum(w[j] * live[uploaded[j]] for j in range(len(selected)))
  return np.stack(live)


@pytest.mark.parametrize('shuffled', [False, True])
def test_pfllib_head_combination_equals_its_loop(shuffled):
  rng = np.random.default_rng(1)
  c = 5
  active = np.array([True, False, True, True, True])
  alphas = rng.uniform(size=(c, c)) * active[None, :]
  alphas /= alphas.sum(axis=1, keepdims=True)
  alphas[~active] = np.eye(c)[~active]
  heads = rng.normal(size=(c, 3))
  key = jax.random.key(3) if shuffled else None
  order = np.asarray(fedpac.upload_order(jnp.asarray(active), key))
  if shuffled:
    assert list(order[:4]) != [0, 2, 3, 4]  # a second order, not the first
  assert sorted(order[:4]) == [0, 2, 3, 4] and order[4] == 1
  mixing = fedpac.pfllib_assignment(
    jnp.asarray(alphas, jnp.float32), jnp.asarray(active), jnp.asarray(order)
  )
  got = np.asarray(mixing) @ heads
  want = _pfllib_heads(alphas, active, order, heads)
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_fedcac_kth_largest_is_the_sorts():
  """The radix select of a critical threshold equals the sort's entry: ties,
  zeros, tiny and huge values, NaN (last, as sorted)."""
  rng = np.random.default_rng(0)
  values = np.abs(rng.normal(size=1000)).astype(np.float32) ** 3
  values[:50] = 0.0
  values[50:100] = values[100]  # ties
  values[200] = np.float32(1e-30)
  values[201] = np.float32(3e38)
  values[202] = np.inf
  for case in (values, np.where(np.arange(1000) == 7, np.nan, values)):
    ordered = np.sort(case)
    for k in (1, 2, 3, 10, 500, 899, 950, 951, 999, 1000):
      got = float(fedcac.kth_largest(jnp.asarray(case), k))
      want = float(ordered[case.size - k])
      assert got == want or (np.isnan(got) and np.isnan(want)), (k, got, want)


def test_fedcac_masks_and_collaboration_by_hand():
  before = {'w': jnp.zeros((2, 2)), 'b': jnp.ones(4)}
  after = {
    'w': jnp.array([[1.0, 2.0], [3.0, 4.0]]),
    'b': jnp.array([1.0, 1.0, 3.0, 0.5]),
  }
  masks = fedcac.critical_mask(before, after, 0.5)
  # |g * w|: w -> w^2 = 1, 4, 9, 16: the top 2 are 9 and 16
  np.testing.assert_array_equal(masks['w'], [[False, False], [True, True]])
  # b: |(b - 1) b| = 0, 0, 6, 0.25: top 2 are 6 and 0.25
  np.testing.assert_array_equal(masks['b'], [False, False, True, True])
  # masks of 4 entries: overlaps 1 - |mi - mj| / (2 |mi|)
  m = jnp.array([[1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 1, 1]], bool)
  active = jnp.ones(4, bool)
  # round 0, beta 1: the threshold is the largest overlap (1, clients 0, 1)
  mix = np.asarray(fedcac.customized_mixing({'m': m}, active, 0, 1))
  want = np.eye(4)
  want[0, :2] = want[1, :2] = 0.5
  np.testing.assert_allclose(mix, want)
  # beta large: the threshold near the mean overlap, 5/12 ((0,1) at 1;
  # (0,2), (1,2), (2,3) at 0.5; (0,3), (1,3) at 0)
  mix = np.asarray(fedcac.customized_mixing({'m': m}, active, 0, 10**6))
  collab = mix > 0
  np.testing.assert_array_equal(
    collab,
    [
      [True, True, True, False],
      [True, True, True, False],
      [True, True, True, True],
      [False, False, True, True],
    ],
  )


def test_fedamp_cloud_models_equal_pfllibs_loop():
  """u_i as ``serveramp.send_models`` builds it, client by client: the
  uploads of another round's clients (client 1 among them, client 3 not),
  a client's own upload weighing 0."""
  rng = np.random.default_rng(0)
  own = {'w': rng.normal(size=(3, 4, 2)), 'b': rng.normal(size=(3, 5))}
  own_ids = np.array([1, 3, 4])
  uploads = {'w': rng.normal(size=(3, 4, 2)), 'b': rng.normal(size=(3, 5))}
  uploads = jax.tree.map(lambda u, o: o[[0, 0, 1]] + 0.3 * u, uploads, own)
  upload_ids = np.array([1, 0, 2])
  valid = np.array([True, True, False])  # the third slot empty
  alpha_k, sigma = 0.3, 2.0
  xi = fedamp.attention_coefficients(
    own, own_ids, uploads, upload_ids, valid, alpha_k, sigma
  )
  got = fedamp.cloud_models(own, uploads, xi)
  flat = lambda t, i: np.concatenate([t['b'][i].ravel(), t['w'][i].ravel()])
  for i in range(3):
    coef = np.zeros(3)
    for j in range(3):
      if valid[j] and upload_ids[j] != own_ids[i]:
        sub = flat(own, i) - flat(uploads, j)
        coef[j] = alpha_k * np.exp(-(sub @ sub) / sigma) / sigma
    want = sum(coef[j] * flat(uploads, j) for j in range(3))
    want = want + (1 - coef.sum()) * flat(own, i)
    np.testing.assert_allclose(np.asarray(xi[i]), coef, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(flat(jax.device_get(got), i), want, rtol=1e-5)


def test_fedmtl_regularizer_gradient_is_pfllibs_expression():
  """The gradient of PFLlib's ``||W||^2 + sum(sum(W * omega, 1)^2)``, times
  10^-f, in the own column (live), the other columns fixed."""
  rng = np.random.default_rng(1)
  m, p, idx = 4, 7, 2
  w_all = jnp.asarray(rng.normal(size=(p, m)))
  omega = 1 - 1 / m  # sqrt of (I - 11^T / m)^2's [0, 0]
  scale = fedmtl.regularizer_scale(12345)
  assert scale == 1e-6  # f = int(log10(12345) + 1) + 1 = 6

  def pfllib(col):
    w = w_all.at[:, idx].set(col)
    reg = jnp.linalg.norm(w) ** 2 + jnp.sum(jnp.sum(w * omega, 1) ** 2)
    return reg * scale

  others = {'x': jnp.sum(w_all, 1) - w_all[:, idx]}
  mine = lambda col: fedmtl.relationship_penalty(
    {'x': col}, others, omega, scale
  )
  col = w_all[:, idx]
  np.testing.assert_allclose(
    jax.grad(mine)(col), jax.grad(pfllib)(col), rtol=1e-6
  )


def _pfllib_partners(sim, strategy):
  """``servercross.cross_aggregation``'s choice, as its loop runs."""
  m = len(sim)
  out = []
  for j in range(m):
    maxtag, submax, mintag = 0, 1, (j + 1) % m
    for p in range(m):
      if sim[j][p] > sim[j][maxtag]:
        submax, maxtag = maxtag, p
      elif sim[j][p] > sim[j][submax]:
        submax = p
      if sim[j][p] < sim[j][mintag] and p != j:
        mintag = p
    out.append({0: (j + 1) % m, 1: mintag, 2: maxtag}[strategy])
  return out


@pytest.mark.parametrize('seed', range(6))
def test_fedcross_partners_equal_pfllibs_loop(seed):
  rng = np.random.default_rng(seed)
  m = 5
  # few distinct values, so that ties happen; some negative
  sim = rng.integers(-2, 3, size=(m, m)).astype(np.float32)
  sim = np.triu(sim, 1) + np.triu(sim, 1).T  # symmetric, 0 diagonal
  for strategy, name in (
    (1, 'least_similar'),
    (2, 'most_similar'),
    (0, 'in_turn'),
  ):
    mix = np.asarray(fedcross.cross_mixing(jnp.asarray(sim), 0.7, name))
    want = np.full((m, m), 0.0)
    for j, p in enumerate(_pfllib_partners(sim.tolist(), strategy)):
      want[j, j] += 0.7
      want[j, p] += 0.3
    np.testing.assert_allclose(mix, want, atol=1e-6, err_msg=name)


def _pfllib_pcl_server(rounds, num_clients, num_classes):
  """PFLlib's ``serverpcl`` rounds on dicts, as its code runs them
  (``receive_protos``, ``proto_aggregation``, ``prototype_padding``): each
  round's uploads are ``[(client, {label: proto})]`` in upload order (the
  dicts' keys in first-seen order). Returns the global dict and every
  client's set (``client_protos_set``) and own dict (``client.protos``)."""
  from collections import defaultdict

  client_sets = [None] * num_clients
  own = [None] * num_clients
  glob = None
  for uploads in rounds:
    for cid, protos in uploads:
      d = defaultdict(list, protos)
      own[cid] = d
      client_sets[cid] = d
    agg = defaultdict(list)
    for _, protos in uploads:
      for label, p in own[_].items():
        agg[label].append(p)
    glob = defaultdict(
      list, {label: sum(ps) / len(ps) for label, ps in agg.items()}
    )
    for cid in range(num_clients):
      if client_sets[cid] is None:
        client_sets[cid] = glob
      else:
        for k in range(num_classes):
          if isinstance(client_sets[cid][k], list):
            client_sets[cid][k] = glob[k]
  return glob, client_sets, own


def test_fedpcl_server_equals_pfllibs_dicts():
  """Two rounds of partial cohorts: the global prototypes in their keys'
  first-seen order over the uploads, each uploader's set padded with the
  global prototypes of the classes it lacks (appended in ascending order),
  a client that never uploaded holding the global set of the round it was
  first padded in."""
  import dataclasses

  import optax

  from fedjax_personal import models
  from fedjax_personal.algorithms import fedpcl
  from fedjax_personal.core.algorithm import RoundContext
  from fedjax_personal.core.batching import Batching
  from fedjax_personal.core.losses import zero_stats
  from fedjax_personal.core.sampling import Cohort

  n, k = 5, 4
  rng = np.random.default_rng(0)
  model = models.create_model('mlp', k, np.zeros((1, 3), np.float32))
  alg = fedpcl.fedpcl(
    model, n, k, optax.sgd(0.1), Batching(2, num_epochs=1, num_steps=None)
  )
  dim = model.head.feature_shape[-1]
  state = alg.init(jax.random.key(0))
  # round 0: clients 3 and 1 upload (in that order); round 1: 1, 0, 4
  cohorts = [[3, 1], [1, 0, 4]]
  classes = {0: [2, 0], 1: [1, 3, 0], 3: [3, 2, 1], 4: [0, 2, 3, 1]}
  history = []
  for r, members in enumerate(cohorts):
    c = 4  # cohort slots, the last ones padded
    idx = np.full(c, n, np.int32)
    idx[: len(members)] = members
    protos = np.zeros((c, k, dim), np.float32)
    present = np.zeros((c, k), bool)
    order = np.tile(np.arange(k, dtype=np.int32), (c, 1))
    uploads = []
    for s, cid in enumerate(members):
      seen = classes[cid] if r == 0 else list(reversed(classes[cid]))
      d = {}
      for label in seen:
        v = rng.normal(size=dim).astype(np.float32)
        d[label] = v
        protos[s, label], present[s, label] = v, True
      lacking = [j for j in range(k) if j not in seen]
      order[s] = seen + lacking
      uploads.append((cid, d))
    history.append(uploads)
    out = fedpcl.FedPCLOutput(
      protos=jnp.asarray(protos),
      present=jnp.asarray(present),
      order=jnp.asarray(order),
      model=None,
      num_examples=jnp.ones(c, jnp.int32),
      stats=jax.tree.map(lambda a: jnp.zeros(c), zero_stats()),
    )
    cohort = Cohort(jnp.asarray(idx), jnp.asarray(idx < n))
    rc = RoundContext(round=jnp.asarray(r), key=jax.random.key(r))
    state, _ = alg.server_update(state, cohort, out, rc)
    glob, sets, own = _pfllib_pcl_server(history, n, k)
    want = np.stack(list(glob.values()))
    np.testing.assert_allclose(
      np.asarray(state.global_protos)[: len(want)], want, atol=1e-6
    )
    for cid in range(n):
      rows = np.stack(list(sets[cid].values()))
      np.testing.assert_array_equal(
        np.asarray(state.set_labels[cid]), list(sets[cid].keys())
      )
      np.testing.assert_allclose(np.asarray(state.sets[cid]), rows, atol=1e-6)
      assert bool(state.has_own[cid]) == (own[cid] is not None)
  del dataclasses


def test_fedntd_averages_uploads_uniformly_as_pfllibs_server():
  """PFLlib's ``serverntd.py`` adds each upload divided by the clients
  joined, whatever their example counts: with the distillation off, FedNTD's
  round is FedAvg's with ``weighting='uniform'`` on clients of unequal
  sizes, and not its example-weighted one."""
  data = helpers.digits_data(num_clients=4, max_examples=120)
  assert len(set(np.asarray(data.train.num_examples).tolist())) > 1
  model = helpers.linear_model(64, loss='cross_entropy', out=10)
  common = dict(client_lr=0.05, batch_size=16)

  def after_one_round(name, **own):
    alg = algorithms.build(name, model, data, **common, **own)
    return helpers.run_rounds(alg, data, rounds=1)[1].params

  ntd = after_one_round('fedntd', fedntd_beta=0.0)
  uniform = after_one_round('fedavg', weighting='uniform')
  weighted = after_one_round('fedavg')
  assert helpers.max_diff(ntd, uniform) < 1e-6
  assert helpers.max_diff(ntd, weighted) > 1e-4


def _fedcross_by_a_loop(model, data, batching, lr, alpha, rounds, shuffle):
  """FedCross as PFLlib's ``servercross.train`` runs it, client by client:
  the round's i-th client trains middleware model ``order[i]`` (PFLlib:
  the i-th of its drawn clients trains model i), its trained model goes
  back to that model's place, then the models are crossed (``cross_mixing``
  over ``model_similarity``, checked above against PFLlib's loops). Each
  client's SGD is ``helpers.reference_sgd`` on its key ``fold_in(k_clients,
  i)``; the order is drawn from the round's server key as the engine's
  (``fold_in(k_cohort, 1)``). Returns the middleware models, the clients'
  last trained models and each round's order."""
  m = data.num_clients
  init = model.init(jax.random.key(0))
  mw = [init] * m
  trained = [init] * m
  orders = []
  for t in range(rounds):
    k_cohort, k_clients = jax.random.split(jax.random.key(t))
    order = np.asarray(
      fedcross.middleware_order(jax.random.fold_in(k_cohort, 1), m, shuffle)
    )
    orders.append(order)
    new = list(mw)
    for s in range(m):
      trained[s] = helpers.reference_sgd(
        model,
        mw[order[s]],
        data.train.x[s],
        data.train.y[s],
        int(data.train.num_examples[s]),
        jax.random.fold_in(k_clients, s),
        batching,
        lr,
      )
      new[order[s]] = trained[s]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *new)
    mix = fedcross.cross_mixing(
      fedcross.model_similarity(model, stacked), alpha, 'least_similar'
    )
    crossed = jax.tree.map(
      lambda a: jnp.einsum('ij,j...->i...', mix, a), stacked
    )
    mw = [jax.tree.map(lambda a: a[j], crossed) for j in range(m)]
  return mw, trained, orders


@pytest.mark.parametrize('shuffle', [True, False])
def test_fedcross_clients_take_middleware_models_in_a_drawn_order(shuffle):
  """PFLlib's ``select_clients`` draws the round's clients without
  replacement also when every client joins, and its i-th drawn client
  trains middleware model i: with ``shuffle`` each client trains a model
  drawn anew every round (a permutation), the trained model returning to
  that model's place; without, client i trains model i (the PFLlib
  record's fixed order). Three rounds against a plain loop; fails when the
  broadcast's gather and the update's scatter disagree or are dropped."""
  from fedjax_personal import models

  data = helpers.digits_data(num_clients=5, max_examples=60)
  model = models.create_model('mlp', 10, np.asarray(data.train.x[0][:1]))
  lr, alpha, rounds = 0.1, 0.8, 3
  alg = algorithms.build(
    'fedcross',
    model,
    data,
    client_lr=lr,
    batch_size=16,
    fedcross_alpha=alpha,
    fedcross_num_models=5,
    fedcross_shuffle=shuffle,
  )
  runner, state = helpers.run_rounds(alg, data, rounds=rounds)
  mw, trained, orders = _fedcross_by_a_loop(
    model, data, alg.client_work.batching, lr, alpha, rounds, shuffle
  )
  identity = [bool((o == np.arange(5)).all()) for o in orders]
  assert not any(identity) if shuffle else all(identity)
  for j in range(5):
    got = jax.tree.map(lambda a: a[j], state.middleware)
    assert helpers.max_diff(got, mw[j]) < 1e-5, j
    got = jax.tree.map(lambda a: a[j], state.trained)
    assert helpers.max_diff(got, trained[j]) < 1e-5, j


def _pfllib_decomposition(param, energy):
  """clientkd.py's ``decomposition`` of one PyTorch-layout weight as its
  loop runs (NumPy's SVD, the rank from its loop over the whole tensor's
  singular values), reconstructed as its ``recover`` multiplies back."""
  u, sigma, v = np.linalg.svd(param, full_matrices=False)
  if np.sum(np.square(sigma)) == 0:
    return param
  if u.ndim == 4:
    u = np.transpose(u, (2, 3, 0, 1))
    sigma = np.transpose(sigma, (2, 0, 1))
    v = np.transpose(v, (2, 3, 0, 1))
  threshold = 0
  for n in range(len(sigma)):
    if np.sum(np.square(sigma[:n])) > energy * np.sum(np.square(sigma)):
      threshold = n
      break
  u, sigma, v = u[:, :threshold], sigma[:threshold], v[:threshold, :]
  if u.ndim == 4:
    u = np.transpose(u, (2, 3, 0, 1))
    sigma = np.transpose(sigma, (1, 2, 0))
    v = np.transpose(v, (2, 3, 0, 1))
  return np.einsum('...ik,...k,...kj->...ij', u, sigma, v)


@pytest.mark.parametrize('energy', [0.5, 0.95, 0.98, 1.0])
def test_fedkd_truncation_equals_pfllibs_svd_loop(energy):
  """FedKD's truncation (the Gram matrix's eigendecomposition in float64 on
  the host) against PFLlib's ``decomposition`` on NumPy's SVD: weights of
  FedAvgCNN's shapes in PyTorch's layout, tall and wide, a 4-d
  convolution, low-rank ones (a rank cut on its gap), a zero one; energy 1
  keeps no index (PFLlib's zero tensor). Under ``vmap`` each upload keeps
  its own rank."""
  rng = np.random.default_rng(0)
  low = rng.normal(size=(40, 3)) @ rng.normal(size=(3, 24))
  weights = {
    'fc1': rng.normal(size=(64, 256)) / 16,  # PyTorch [out, in]
    'fc': rng.normal(size=(10, 64)),
    'tall': rng.normal(size=(48, 20)),
    'low_rank': low + 1e-3 * rng.normal(size=low.shape),
    'conv': rng.normal(size=(16, 8, 5, 5)),  # [out, in, kh, kw]
    'zero': np.zeros((12, 7)),
  }
  for name, w in weights.items():
    w = w.astype(np.float32)
    want = _pfllib_decomposition(w, energy)
    flax = w.T if w.ndim == 2 else np.transpose(w, (2, 3, 1, 0))
    got = np.asarray(fedkd.truncated_svd(jnp.asarray(flax), energy))
    got = got.T if w.ndim == 2 else np.transpose(got, (3, 2, 0, 1))
    np.testing.assert_allclose(got, want, atol=2e-5, err_msg=name)
  # each upload its own rank: a stack of a low-rank and a full-rank weight
  stack = jnp.asarray(
    np.stack([weights['low_rank'], rng.normal(size=(40, 24))]).astype(
      np.float32
    )
  )
  got = jax.vmap(fedkd.truncated_svd, in_axes=(0, None))(stack, energy)
  for i in range(2):
    want = _pfllib_decomposition(np.asarray(stack[i]).T, energy).T
    np.testing.assert_allclose(np.asarray(got[i]), want, atol=2e-5)
