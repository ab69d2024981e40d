"""The native ``--algorithm=mime``, ``mime_lite``, ``hyp_cluster`` and
``agnostic_fedavg``
(each compiled into one round) give what FedJAX's own algorithms give
(``fedjax_personal.fedjax.algorithms``, equal to FedJAX 0.0.17 on its own code:
``tests/test_fedjax_training.py``) on the same clients, model and starting
point: least squares on four clients, every client in every round, one
full-batch local step per round, 3 rounds. The clients are of one size: FedJAX's
``shuffle_repeat_batch`` fills every batch to ``batch_size`` with examples drawn
again, so a client smaller than the batch trains on repeated examples there, on
its own examples here; one full batch of every client is the same step on both.
Tolerance: float rounding (rtol 1e-5)."""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_personal as fp
import fedjax_personal.fedjax as fedjax
from fedjax_personal.algorithms.agnostic_fedavg import agnostic_fedavg
from fedjax_personal.algorithms.hyp_cluster import hyp_cluster
from fedjax_personal.algorithms.mime import mime
from fedjax_personal.algorithms.mime_lite import mime_lite
from fedjax_personal.core.data import FederatedData, pad_clients, to_device
from fedjax_personal.core.engine import RoundRunner

SIZES = (8, 8, 8, 8)
ROUNDS = 3


def _setup():
  data, xs, ys = helpers.least_squares_data(num_clients=4, sizes=SIZES)
  clients = [
    (b'%d' % i, fedjax.ClientDataset({'x': x, 'y': y}), jax.random.PRNGKey(i))
    for i, (x, y) in enumerate(zip(xs, ys))
  ]
  return to_device(data), clients


def per_example_loss(params, batch, rng):
  """``helpers.linear_model``'s squared loss, as FedJAX takes it."""
  del rng
  pred = batch['x'] @ params['w'][:, 0] + params['b'][0]
  return 0.5 * jnp.square(pred - batch['y'])


def _runner(alg, data):
  sampler = fp.CohortSampler(data.num_clients, cohort_size=data.num_clients)
  runner = RoundRunner(alg, data, sampler, fp.executors.VmapExecutor())
  return runner, runner.init(jax.random.key(0))


def _close(a, b):
  np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


FULL_BATCH = fedjax.ShuffleRepeatBatchHParams(
  batch_size=max(SIZES), num_epochs=1, seed=0
)


@pytest.mark.parametrize('clip', [None, 2.0])
@pytest.mark.ci_variants('2.0')
def test_mime_lite_equals_fedjaxs(clip):
  data, clients = _setup()
  model = helpers.linear_model(3)
  lr, momentum, server_lr = 0.05, 0.9, 0.7
  alg = mime_lite(
    model,
    data.num_clients,
    optax.sgd(lr, momentum=momentum),
    fp.Batching(batch_size=max(SIZES), num_epochs=1),
    server_optimizer=optax.sgd(server_lr),
    delta_clip_norm=clip,
  )
  runner, state = _runner(alg, data)
  theirs = fedjax.algorithms.mime_lite.mime_lite(
    per_example_loss,
    fedjax.optimizers.sgd(lr, momentum=momentum),
    FULL_BATCH,
    fedjax.PaddedBatchHParams(batch_size=4),
    server_lr,
    client_delta_clip_norm=clip,
  )
  their_state = theirs.init(state.params)
  for t in range(ROUNDS):
    state, _ = runner.round(state, jax.random.key(t))
    their_state, _ = theirs.apply(their_state, clients)
    jax.tree.map(_close, state.params, their_state.params)
    jax.tree.map(_close, state.base_opt_state, their_state.opt_state)


def test_mime_equals_fedjaxs():
  """Two full-batch steps a round (the second one's corrected gradient
  g(y) - g(x) + c differs from c), a momentum base optimizer."""
  data, clients = _setup()
  model = helpers.linear_model(3)
  lr, momentum, server_lr = 0.05, 0.9, 0.7
  alg = mime(
    model,
    data.num_clients,
    optax.sgd(lr, momentum=momentum),
    fp.Batching(batch_size=max(SIZES), num_epochs=2),
    server_optimizer=optax.sgd(server_lr),
  )
  runner, state = _runner(alg, data)
  theirs = fedjax.algorithms.mime.mime(
    per_example_loss,
    fedjax.optimizers.sgd(lr, momentum=momentum),
    fedjax.ShuffleRepeatBatchHParams(
      batch_size=max(SIZES), num_epochs=2, seed=0
    ),
    fedjax.PaddedBatchHParams(batch_size=4),
    server_lr,
  )
  their_state = theirs.init(state.params)
  for t in range(ROUNDS):
    state, _ = runner.round(state, jax.random.key(t))
    their_state, _ = theirs.apply(their_state, clients)
    jax.tree.map(_close, state.params, their_state.params)
    jax.tree.map(_close, state.base_opt_state, their_state.opt_state)


def test_hyp_cluster_equals_fedjaxs():
  data, clients = _setup()
  model = helpers.linear_model(3)
  alg = hyp_cluster(
    model,
    data.num_clients,
    3,
    optax.sgd(0.05),
    fp.Batching(batch_size=max(SIZES), num_epochs=1),
    server_optimizer=optax.sgd(1.0, momentum=0.5),
  )
  runner, state = _runner(alg, data)
  start = [jax.tree.map(lambda a: a[k], state.cluster_params) for k in range(3)]
  theirs = fedjax.algorithms.hyp_cluster.hyp_cluster(
    per_example_loss,
    fedjax.optimizers.sgd(0.05),
    fedjax.optimizers.sgd(1.0, momentum=0.5),
    fedjax.PaddedBatchHParams(batch_size=4),
    FULL_BATCH,
  )
  their_state = theirs.init(start)
  chosen = set()
  for t in range(ROUNDS):
    state, _ = runner.round(state, jax.random.key(t))
    their_state, diagnostics = theirs.apply(their_state, clients)
    chosen |= {int(d['cluster_id']) for d in diagnostics.values()}
    for k in range(3):
      mine = jax.tree.map(lambda a: a[k], state.cluster_params)
      jax.tree.map(_close, mine, their_state.cluster_params[k])
  # more than one cluster trained, and at least one kept its model
  assert len(chosen) > 1


@pytest.mark.slow
def test_hyp_cluster_evaluates_each_client_with_the_cluster_it_chooses():
  """The cluster FedJAX's maximization step chooses on the client's
  training data (``HypClusterEvaluator``'s choice) is the one its test
  loss is computed with."""
  data, clients = _setup()
  model = helpers.linear_model(3)
  alg = hyp_cluster(
    model,
    data.num_clients,
    3,
    optax.sgd(0.05),
    fp.Batching(batch_size=max(SIZES), num_epochs=1),
  )
  runner, state = _runner(alg, data)
  state, _ = runner.round(state, jax.random.key(0))
  models = alg.client_models(state)
  cluster = [
    jax.tree.map(lambda a: a[k], state.cluster_params) for k in range(3)
  ]
  chosen = fedjax.algorithms.hyp_cluster.maximization_step(
    fedjax.AverageLossEvaluator(per_example_loss),
    cluster,
    clients,
    fedjax.PaddedBatchHParams(batch_size=4),
  )
  for i, (cid, dataset, _) in enumerate(clients):
    stats = alg.evaluate_client(
      models.for_client(i),
      fp.core.data.LocalData(
        train=fp.core.data.client_row(data.train, i),
        val=fp.core.data.client_row(data.val, i),
      ),
      fp.core.data.client_row(data.test, i),
      jax.random.key(0),
    )
    want = per_example_loss(
      cluster[int(chosen[cid])], dataset.all_examples(), None
    )
    _close(stats.loss_sum, jnp.sum(want))


def _classification(groups):
  """Four clients of 8 examples, 3 classes, each client in ``groups``."""
  rng = np.random.default_rng(1)
  xs = [rng.normal(size=(8, 3)).astype(np.float32) + 0.5 * i for i in range(4)]
  ys = [rng.integers(0, 3, size=8).astype(np.int32) for _ in range(4)]
  train = pad_clients(xs, ys, (3,), np.float32)
  data = FederatedData(
    train=train,
    val=pad_clients([x[:0] for x in xs], [y[:0] for y in ys], (3,), np.float32),
    test=train,
    groups=np.asarray(groups, np.int32),
    num_classes=3,
    name='classification',
  )
  return to_device(data), xs, ys


def ce_per_example_loss(params, batch, rng):
  del rng
  logits = batch['x'] @ params['w'] + params['b']
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch['y'])


@pytest.mark.parametrize('domains', ['label', 'group'])
@pytest.mark.ci_variants('label')
def test_agnostic_fedavg_equals_fedjaxs(domains):
  groups = [0, 1, 1, 0]
  data, xs, ys = _classification(groups)
  model = helpers.linear_model(3, loss='cross_entropy', out=3)
  num_domains = 3 if domains == 'label' else 2
  alg = agnostic_fedavg(
    model,
    4,
    num_domains,
    None if domains == 'label' else groups,
    optax.sgd(0.1),
    fp.Batching(batch_size=8, num_epochs=1),
    server_optimizer=optax.sgd(1.0, momentum=0.5),
    domain_lr=0.3,
    window_size=2,
  )
  runner, state = _runner(alg, data)
  clients = [
    (
      b'%d' % i,
      fedjax.ClientDataset(
        {
          'x': x,
          'y': y,
          'domain_id': y if domains == 'label' else np.full(8, groups[i]),
        }
      ),
      jax.random.PRNGKey(i),
    )
    for i, (x, y) in enumerate(zip(xs, ys))
  ]
  theirs = fedjax.algorithms.agnostic_fed_avg.agnostic_federated_averaging(
    ce_per_example_loss,
    fedjax.optimizers.sgd(0.1),
    fedjax.optimizers.sgd(1.0, momentum=0.5),
    fedjax.ShuffleRepeatBatchHParams(batch_size=8, num_epochs=1, seed=0),
    fedjax.PaddedBatchHParams(batch_size=4),
    [1.0 / num_domains] * num_domains,
    0.3,
    domain_window_size=2,
  )
  their_state = theirs.init(state.params)
  for t in range(ROUNDS):
    state, _ = runner.round(state, jax.random.key(t))
    their_state, _ = theirs.apply(their_state, clients)
    jax.tree.map(_close, state.params, their_state.params)
    _close(state.domain_weights, their_state.domain_weights)
    _close(state.domain_window, np.stack(their_state.domain_window))
  # the weights moved off uniform
  assert np.ptp(np.asarray(state.domain_weights)) > 1e-3
