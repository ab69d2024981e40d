"""FedJAX's training-side API (models, optimizers, metrics, tree_util,
serialization, for_each_client, FederatedAlgorithm, algorithms.fed_avg) on
FedJAX's own example code: run by FedJAX 0.0.17 in its venv to record what
each cell gives, and by ``tests/test_fedjax_training.py`` with ``fedjax``
replaced by ``fedjax_personal.fedjax`` (under each ``for_each_client``
backend) to compare.

  <FedJAX venv>/bin/python benchmarks/peers/fedjax_training_reference.py \\
      --out=tests/data/fedjax_training_reference.npz

``CELLS`` run in one namespace, in order: ``examples/fed_avg.py`` and its
test (``fed_avg_test.py``'s clients and values), ``stateful_fed_avg.py``'s
client counters, ``emnist_fed_avg.py``'s loop at a small size (in-memory
EMNIST-shaped clients instead of the download, 3 rounds, evaluation each
round; its unseeded shuffle seeded), FedJAX's optimizers, metrics, tree
utilities, stax and Haiku models (initialization, evaluation, gradients,
per-client evaluators), the Shakespeare, Stack Overflow and CIFAR-100 models
at small sizes, the aggregators (the mean and every compressed mean, with
their bits and keys), every algorithm (HypCluster with its trainers, k-means
initialization and evaluator as ``hyp_cluster_test.py`` runs them),
``training``'s experiment loop (checkpoints, resumption, evaluations) and
the msgpack serialization. FedJAX 0.0.17's language models read
``jnp.NINF``, gone from its own JAX: ``main`` restores it for FedJAX's run. Random draws are
JAX's from the same keys: with JAX >= 0.5 the caller runs the cells under
``jax.threefry_partitionable(False)`` (FedJAX 0.0.17's JAX drew that way).
"""

import argparse
import importlib

import numpy as np

CELLS = [
  (
    'fed_avg_example',
    """
@fedjax.dataclass
class ServerState:
  params: fedjax.Params
  opt_state: fedjax.OptState

def federated_averaging(grad_fn, client_optimizer, server_optimizer,
                        client_batch_hparams):
  def init(params):
    return ServerState(params, server_optimizer.init(params))

  def apply(server_state, clients):
    client_diagnostics = {}
    client_delta_params_weights = []
    for client_id, client_dataset, client_rng in clients:
      delta_params = client_update(server_state.params, client_dataset,
                                   client_rng)
      client_delta_params_weights.append((delta_params, len(client_dataset)))
      client_diagnostics[client_id] = {
          'delta_l2_norm': fedjax.tree_util.tree_l2_norm(delta_params)
      }
    mean_delta_params = fedjax.tree_util.tree_mean(client_delta_params_weights)
    return server_update(server_state, mean_delta_params), client_diagnostics

  def client_update(server_params, client_dataset, client_rng):
    params = server_params
    opt_state = client_optimizer.init(params)
    for batch in client_dataset.shuffle_repeat_batch(client_batch_hparams):
      client_rng, use_rng = jax.random.split(client_rng)
      grads = grad_fn(params, batch, use_rng)
      opt_state, params = client_optimizer.apply(grads, opt_state, params)
    return jax.tree_util.tree_map(lambda a, b: a - b, server_params, params)

  def server_update(server_state, mean_delta_params):
    opt_state, params = server_optimizer.apply(
        mean_delta_params, server_state.opt_state, server_state.params)
    return ServerState(params, opt_state)

  return fedjax.FederatedAlgorithm(init, apply)

def test_grad_fn(params, batch, rng):
  del rng
  return jax.tree_util.tree_map(lambda l: l / jnp.sum(batch['x']), params)

algorithm = federated_averaging(
    test_grad_fn, fedjax.optimizers.sgd(learning_rate=1.0),
    fedjax.optimizers.sgd(learning_rate=1.0),
    fedjax.ShuffleRepeatBatchHParams(batch_size=2, num_epochs=2, seed=0))
state = algorithm.init({'w': jnp.array([0., 2., 4.])})
R['init_params'] = state.params['w']
R['init_opt_state_len'] = len(state.opt_state)
clients = [
    (b'cid0', fedjax.ClientDataset({'x': jnp.array([2., 4., 6.])}),
     jax.random.PRNGKey(0)),
    (b'cid1', fedjax.ClientDataset({'x': jnp.array([8., 10.])}),
     jax.random.PRNGKey(1)),
]
state, client_diagnostics = algorithm.apply(state, clients)
R['params'] = state.params['w']
R['cid0_norm'] = client_diagnostics[b'cid0']['delta_l2_norm']
R['cid1_norm'] = client_diagnostics[b'cid1']['delta_l2_norm']
""",
  ),
  (
    'stateful_fed_avg',
    """
@fedjax.dataclass
class ClientState:
  num_steps: int

def counting_for_each_client(grad_fn, client_optimizer):
  def client_init(server_params, client_input):
    return {'params': server_params,
            'opt_state': client_optimizer.init(server_params),
            'rng': client_input['rng'], 'state': client_input['state']}

  def client_step(s, batch):
    rng, use_rng = jax.random.split(s['rng'])
    grads = grad_fn(s['params'], batch, use_rng)
    opt_state, params = client_optimizer.apply(grads, s['opt_state'],
                                               s['params'])
    return {'params': params, 'opt_state': opt_state, 'rng': rng,
            'state': ClientState(num_steps=s['state'].num_steps + 1)}

  def client_final(server_params, s):
    return {'delta_params': jax.tree_util.tree_map(
                lambda a, b: a - b, server_params, s['params']),
            'state': s['state']}

  return fedjax.for_each_client(client_init, client_step, client_final)

train = counting_for_each_client(test_grad_fn, fedjax.optimizers.sgd(0.5))
hparams = fedjax.ShuffleRepeatBatchHParams(batch_size=2, num_epochs=1, seed=0)
counts = {b'cid0': ClientState(0), b'cid1': ClientState(0)}
params = {'w': jnp.array([0., 2., 4.])}
for _ in range(2):
  inputs = [(cid, cds.shuffle_repeat_batch(hparams),
             {'rng': rng, 'state': counts[cid]}) for cid, cds, rng in clients]
  for cid, out in train(params, inputs):
    counts[cid] = out['state']
    R['delta_' + cid.decode()] = out['delta_params']['w']
R['steps'] = [int(counts[b'cid0'].num_steps), int(counts[b'cid1'].num_steps)]
""",
  ),
  (
    'emnist_fed_avg',
    """
rng = np.random.RandomState(0)
def emnist_like(n):
  return {'x': rng.uniform(size=(n, 28, 28, 1)).astype(np.float32),
          'y': rng.randint(0, 10, size=n).astype(np.int32)}
train_fd = fedjax.InMemoryFederatedData(
    {b'%d' % i: emnist_like(n) for i, n in enumerate([7, 12, 3, 25, 9, 16])})
test_fd = fedjax.InMemoryFederatedData(
    {b'%d' % i: emnist_like(n) for i, n in enumerate([4, 5, 2, 6, 3, 5])})
model = fedjax.models.emnist.create_conv_model(only_digits=True)

def loss(params, batch, rng):
  preds = model.apply_for_train(params, batch, rng)
  return jnp.mean(model.train_loss(batch, preds))

grad_fn = jax.jit(jax.grad(loss))
client_optimizer = fedjax.optimizers.sgd(learning_rate=10**(-1.5))
server_optimizer = fedjax.optimizers.adam(
    learning_rate=10**(-2.5), b1=0.9, b2=0.999, eps=10**(-4))
client_batch_hparams = fedjax.ShuffleRepeatBatchHParams(batch_size=5, seed=0)
algorithm = federated_averaging(grad_fn, client_optimizer, server_optimizer,
                                client_batch_hparams)
init_params = model.init(jax.random.PRNGKey(17))
R['init_params'] = init_params
server_state = algorithm.init(init_params)
train_client_sampler = fedjax.client_samplers.UniformGetClientSampler(
    fd=train_fd, num_clients=3, seed=0)
R['train'], R['test'], R['ids'] = [], [], []
for round_num in range(1, 4):
  clients = train_client_sampler.sample()
  server_state, client_diagnostics = algorithm.apply(server_state, clients)
  client_ids = [cid for cid, _, _ in clients]
  R['ids'].append([int(c) for c in client_ids])
  train_eval_batches = fedjax.padded_batch_client_datasets(
      [cds for _, cds in train_fd.get_clients(client_ids)], batch_size=8)
  test_eval_batches = fedjax.padded_batch_client_datasets(
      [cds for _, cds in test_fd.get_clients(client_ids)], batch_size=8)
  m = fedjax.evaluate_model(model, server_state.params, train_eval_batches)
  R['train'].append([m['loss'], m['accuracy']])
  m = fedjax.evaluate_model(model, server_state.params, test_eval_batches)
  R['test'].append([m['loss'], m['accuracy']])
R['final_params'] = server_state.params
""",
  ),
  (
    'optimizers',
    """
opt_params = {'w': jnp.array([1.0, -2.0, 3.0]), 'b': jnp.array(0.5)}
opt_grads = [{'w': jnp.array([0.1 * k, -0.3, 0.2 + k]), 'b': jnp.array(0.1 * k - 0.2)}
             for k in range(3)]
for name, opt in [
    ('sgd', fedjax.optimizers.sgd(0.1)),
    ('momentum', fedjax.optimizers.sgd(0.1, momentum=0.9)),
    ('nesterov', fedjax.optimizers.sgd(0.1, momentum=0.9, nesterov=True)),
    ('adam', fedjax.optimizers.adam(0.01)),
    ('adagrad', fedjax.optimizers.adagrad(0.1)),
    ('rmsprop', fedjax.optimizers.rmsprop(0.01, momentum=0.5)),
    ('yogi', fedjax.optimizers.yogi(0.01)),
    ('adafactor', fedjax.optimizers.adafactor(0.01)),
    ('optax', fedjax.optimizers.create_optimizer_from_optax(
        optax.chain(optax.clip(0.15), optax.sgd(1.0)))),
]:
  p, s = opt_params, opt.init(opt_params)
  for g in opt_grads:
    s, p = opt.apply(g, s, p)
  R[name] = p
""",
  ),
  (
    'tree_util',
    """
a = {'x': jnp.array([1., 2.]), 'y': jnp.array([[3.]])}
b = {'x': jnp.array([-1., 4.]), 'y': jnp.array([[0.5]])}
R['mean'] = fedjax.tree_util.tree_mean([(a, 1.0), (b, 3.0)])
R['sum'] = fedjax.tree_util.tree_sum([a, b, a])
R['l2'] = fedjax.tree_util.tree_l2_norm(a)
R['l2_squared'] = fedjax.tree_util.tree_l2_squared(b)
R['size'] = fedjax.tree_util.tree_size(a)
R['clip'] = fedjax.tree_util.tree_clip_by_global_norm(a, 1.0)
R['inverse_zero'] = fedjax.tree_util.tree_inverse_weight(a, 0.0)
R['weight'] = fedjax.tree_util.tree_weight(b, 2.0)
R['zeros'] = fedjax.tree_util.tree_zeros_like(b)
R['add'] = fedjax.tree_util.tree_add(a, b)
R['l2_reg'] = fedjax.regularizers.l2_regularizer(0.5, center_params=b)(a)
R['l2_reg_weighted'] = fedjax.regularizers.l2_regularizer(
    0.5, params_weights=b)(a)
""",
  ),
  (
    'metrics',
    """
logits = jnp.array([[1., 2., 0.5], [3., -1., 0.], [0., 0., 0.1], [2., 2.5, 1.]])
cls_batch = {'y': jnp.array([1, 0, 2, 0]), 'domain_id': jnp.array([0, 1, 1, 0])}
mask = jnp.array([True, True, False, True])
for name, metric in [
    ('accuracy', fedjax.metrics.Accuracy()),
    ('loss', fedjax.metrics.CrossEntropyLoss()),
    ('top2', fedjax.metrics.TopKAccuracy(k=2)),
    ('confusion', fedjax.metrics.ConfusionMatrix(num_classes=3)),
    ('per_domain', fedjax.metrics.PerDomainMetric(
        fedjax.metrics.Accuracy(), num_domains=2)),
]:
  R[name] = fedjax.metrics.evaluate_batch(metric, cls_batch, logits).result()
  R[name + '_masked'] = fedjax.metrics.evaluate_batch(
      metric, cls_batch, logits, mask).result()
seq_logits = jnp.asarray(np.random.RandomState(1).normal(size=(3, 4, 5)), jnp.float32)
seq_batch = {'y': jnp.array([[1, 2, 4, 0], [3, 3, 0, 0], [0, 0, 0, 0]])}
for name, metric in [
    ('seq_token_loss', fedjax.metrics.SequenceTokenCrossEntropyLoss()),
    ('seq_loss', fedjax.metrics.SequenceCrossEntropyLoss()),
    ('seq_token_acc', fedjax.metrics.SequenceTokenAccuracy()),
    ('seq_token_acc_masked_logits', fedjax.metrics.SequenceTokenAccuracy(
        logits_mask=(0., -1e9, 0., 0., 0.))),
    ('seq_top2', fedjax.metrics.SequenceTokenTopKAccuracy(k=2)),
    ('seq_token_count', fedjax.metrics.SequenceTokenCount()),
    ('seq_count', fedjax.metrics.SequenceCount()),
    ('seq_truncation', fedjax.metrics.SequenceTruncationRate(eos_target_value=4)),
    ('seq_oov', fedjax.metrics.SequenceTokenOOVRate(oov_target_values=(3,))),
    ('seq_length', fedjax.metrics.SequenceLength()),
    ('seq_token_loss_per_position', fedjax.metrics.SequenceTokenCrossEntropyLoss(
        per_position=True)),
]:
  R[name] = fedjax.metrics.evaluate_batch(metric, seq_batch, seq_logits).result()
stat = fedjax.metrics.MeanStat.new(jnp.array([2., 3.]), jnp.array([1., 0.]))
R['mean_stat'] = [stat.accum, stat.weight, stat.reduce().result()]
R['merged'] = stat.merge(fedjax.metrics.MeanStat.new(1., 2.)).result()
R['sum_stat'] = fedjax.metrics.SumStat.new(jnp.array([1., 2.])).reduce().result()
R['unreduced_dense'] = fedjax.metrics.unreduced_cross_entropy_loss(
    jax.nn.softmax(logits), logits, is_sparse_targets=False)
""",
  ),
  (
    'stax_model',
    """
stax_model = fedjax.models.emnist.create_stax_dense_model(only_digits=True,
                                                          hidden_units=16)
stax_params = stax_model.init(jax.random.PRNGKey(3))
R['params'] = stax_params
eval_x = np.random.RandomState(2).uniform(size=(11, 28, 28, 1)).astype(np.float32)
eval_y = np.arange(11, dtype=np.int32) % 10
eval_ds = fedjax.ClientDataset({'x': eval_x, 'y': eval_y})
R['logits'] = stax_model.apply_for_eval(stax_params, {'x': eval_x[:3]})
R['evaluate'] = fedjax.evaluate_model(
    stax_model, stax_params, eval_ds.padded_batch(batch_size=4))
batch = next(iter(eval_ds.padded_batch(batch_size=8, num_batch_size_buckets=1)))
R['model_grad'] = fedjax.model_grad(stax_model)(stax_params, batch, None)
R['model_grad_reg'] = fedjax.model_grad(
    stax_model, fedjax.regularizers.l2_regularizer(0.1))(stax_params, batch, None)
per_example = fedjax.model_per_example_loss(stax_model)
R['per_example'] = per_example(stax_params, {'x': eval_x, 'y': eval_y}, None)
R['average_loss'] = fedjax.evaluate_average_loss(
    stax_params, eval_ds.padded_batch(batch_size=4), jax.random.PRNGKey(0),
    per_example)
eval_clients = [(b'a', eval_ds.padded_batch(batch_size=4)),
                (b'b', fedjax.ClientDataset({'x': eval_x[:5], 'y': eval_y[:5]}
                                            ).padded_batch(batch_size=3))]
R['evaluator'] = [m for _, m in fedjax.ModelEvaluator(
    stax_model).evaluate_global_params(stax_params, eval_clients)]
doubled = jax.tree_util.tree_map(lambda p: 2 * p, stax_params)
R['evaluator_per_client'] = [m for _, m in fedjax.ModelEvaluator(
    stax_model).evaluate_per_client_params(
        [(cid, b, p) for (cid, b), p in zip(eval_clients, [stax_params, doubled])])]
loss_evaluator = fedjax.AverageLossEvaluator(per_example)
R['loss_evaluator'] = [l for _, l in loss_evaluator.evaluate_global_params(
    stax_params, [(cid, b, jax.random.PRNGKey(i))
                  for i, (cid, b) in enumerate(eval_clients)])]
""",
  ),
  (
    'haiku_models',
    """
dense = fedjax.models.emnist.create_dense_model(only_digits=True, hidden_units=8)
R['dense_params'] = dense.init(jax.random.PRNGKey(5))
logistic = fedjax.models.emnist.create_logistic_model()
R['logistic_params'] = logistic.init(jax.random.PRNGKey(6))
conv_params = model.init(jax.random.PRNGKey(0))
R['conv_eval'] = model.apply_for_eval(conv_params, {'x': eval_x[:2]})
R['conv_train'] = model.apply_for_train(conv_params, {'x': eval_x[:2]},
                                        jax.random.PRNGKey(1))
toy = fedjax.models.toy_regression.create_regression_model()
toy_params = toy.init(jax.random.PRNGKey(2))
R['toy_params'] = toy_params
toy_batch = {'x': jnp.array([[1.], [2.], [4.]]), 'y': jnp.array([1., 3., 2.])}
R['toy_loss'] = toy.train_loss(toy_batch, toy.apply_for_train(toy_params, toy_batch, None))
R['toy_grad'] = fedjax.model_grad(toy)(toy_params, toy_batch, None)
""",
  ),
  (
    'fed_avg_algorithm',
    """
fed_avg = fedjax.algorithms.fed_avg.federated_averaging(
    fedjax.model_grad(stax_model), fedjax.optimizers.sgd(0.1),
    fedjax.optimizers.sgd(1.0, momentum=0.5),
    fedjax.ShuffleRepeatBatchHParams(batch_size=3, num_epochs=2, seed=1))
fa_state = fed_avg.init(stax_params)
fa_clients = [
    (b'%d' % i, fedjax.ClientDataset({'x': eval_x[s], 'y': eval_y[s]}),
     jax.random.PRNGKey(10 + i))
    for i, s in enumerate([slice(0, 5), slice(5, 7), slice(2, 11)])]
R['norms'] = []
for _ in range(2):
  fa_state, fa_diag = fed_avg.apply(fa_state, fa_clients)
  R['norms'].append([fa_diag[cid]['delta_l2_norm'] for cid, _, _ in fa_clients])
R['params'] = fa_state.params
""",
  ),
  (
    'fed_prox',
    """
def prox_example_loss(params, batch, rng):
  del rng
  return batch['x'] * params['w']

fed_prox = fedjax.algorithms.fed_prox.fed_prox(
    prox_example_loss, fedjax.optimizers.sgd(learning_rate=1.0),
    fedjax.optimizers.sgd(learning_rate=1.0),
    fedjax.ShuffleRepeatBatchHParams(batch_size=2, num_epochs=1, seed=0),
    proximal_weight=0.01)
fp_state = fed_prox.init({'w': jnp.array(4.)})
fp_state, fp_diag = fed_prox.apply(fp_state, [
    (b'cid0', fedjax.ClientDataset({'x': jnp.array([2., 4., 6.])}),
     jax.random.PRNGKey(0)),
    (b'cid1', fedjax.ClientDataset({'x': jnp.array([8., 10.])}),
     jax.random.PRNGKey(1)),
])
R['w'] = fp_state.params['w']
R['cid0_norm'] = fp_diag[b'cid0']['delta_l2_norm']
R['cid1_norm'] = fp_diag[b'cid1']['delta_l2_norm']
fp_state, _ = fedjax.algorithms.fed_prox.fed_prox(
    fedjax.model_per_example_loss(stax_model), fedjax.optimizers.sgd(0.1),
    fedjax.optimizers.sgd(1.0), fedjax.ShuffleRepeatBatchHParams(
        batch_size=3, num_epochs=2, seed=1), proximal_weight=0.5).apply(
            fed_avg.init(stax_params), fa_clients)
R['params'] = fp_state.params
""",
  ),
  (
    'mime',
    """
toy_clients = [
    (b'cid0', fedjax.ClientDataset({'x': jnp.array([2., 4., 6.])}),
     jax.random.PRNGKey(0)),
    (b'cid1', fedjax.ClientDataset({'x': jnp.array([8., 10.])}),
     jax.random.PRNGKey(1)),
]
for name, build, extra in [
    ('mime', fedjax.algorithms.mime.mime, {}),
    ('mime_lite', fedjax.algorithms.mime_lite.mime_lite, {}),
    ('mime_lite_clip', fedjax.algorithms.mime_lite.mime_lite,
     {'client_delta_clip_norm': 5.0}),
]:
  algorithm = build(
      prox_example_loss, fedjax.optimizers.sgd(learning_rate=1.0),
      fedjax.ShuffleRepeatBatchHParams(batch_size=2, num_epochs=1, seed=0),
      fedjax.PaddedBatchHParams(batch_size=2), 0.2, **extra)
  m_state, m_diag = algorithm.apply(algorithm.init({'w': jnp.array(4.)}),
                                    toy_clients)
  R[name + '/w'] = m_state.params['w']
  R[name + '/diagnostics'] = [m_diag[b'cid0'], m_diag[b'cid1']]
for name, build in [('mime', fedjax.algorithms.mime.mime),
                    ('mime_lite', fedjax.algorithms.mime_lite.mime_lite)]:
  algorithm = build(
      fedjax.model_per_example_loss(stax_model),
      fedjax.optimizers.sgd(0.1, momentum=0.9),
      fedjax.ShuffleRepeatBatchHParams(batch_size=3, num_epochs=2, seed=1),
      fedjax.PaddedBatchHParams(batch_size=4), 1.0,
      regularizer=fedjax.regularizers.l2_regularizer(0.01))
  m_state = algorithm.init(stax_params)
  for _ in range(2):
    m_state, _ = algorithm.apply(m_state, fa_clients)
  R[name + '/stax_params'] = m_state.params
  R[name + '/stax_opt_state'] = m_state.opt_state
""",
  ),
  (
    'agnostic_fed_avg',
    """
afa = fedjax.algorithms.agnostic_fed_avg.agnostic_federated_averaging(
    per_example_loss=prox_example_loss,
    client_optimizer=fedjax.optimizers.sgd(learning_rate=1.0),
    server_optimizer=fedjax.optimizers.sgd(learning_rate=0.1),
    client_batch_hparams=fedjax.ShuffleRepeatBatchHParams(
        batch_size=3, num_epochs=1, seed=0),
    domain_batch_hparams=fedjax.PaddedBatchHParams(batch_size=3),
    init_domain_weights=[0.1, 0.2, 0.3, 0.4], domain_learning_rate=0.01,
    domain_algorithm='eg', domain_window_size=2,
    init_domain_window=[1., 2., 3., 4.])
a_state, a_diag = afa.apply(afa.init({'w': jnp.array(4.)}), [
    (b'cid0', fedjax.ClientDataset({
        'x': jnp.array([1., 2., 4., 3., 6., 1.]),
        'domain_id': jnp.array([1, 0, 0, 0, 2, 2])}), jax.random.PRNGKey(0)),
    (b'cid1', fedjax.ClientDataset({
        'x': jnp.array([8., 10., 5.]), 'domain_id': jnp.array([1, 3, 1])}),
     jax.random.PRNGKey(1)),
])
R['w'] = a_state.params['w']
R['domain_weights'] = a_state.domain_weights
R['domain_window'] = a_state.domain_window
R['norms'] = [a_diag[b'cid0']['delta_l2_norm'], a_diag[b'cid1']['delta_l2_norm']]
afa = fedjax.algorithms.agnostic_fed_avg.agnostic_federated_averaging(
    fedjax.model_per_example_loss(stax_model), fedjax.optimizers.sgd(0.1),
    fedjax.optimizers.adam(0.01),
    fedjax.ShuffleRepeatBatchHParams(batch_size=3, num_epochs=2, seed=1),
    fedjax.PaddedBatchHParams(batch_size=4), [0.5, 0.3, 0.2], 0.5,
    domain_window_size=2, init_domain_window=[1., 1., 1.],
    regularizer=fedjax.regularizers.l2_regularizer(0.01))
a_state = afa.init(stax_params)
domain_clients = [
    (cid, fedjax.ClientDataset({**{k: v for k, v in cds.all_examples().items()},
                                'domain_id': np.arange(len(cds)) % 3}), rng)
    for cid, cds, rng in fa_clients]
for _ in range(2):
  a_state, _ = afa.apply(a_state, domain_clients)
R['stax_params'] = a_state.params
R['stax_domain_weights'] = a_state.domain_weights
""",
  ),
  (
    'apfl',
    """
apfl_module = importlib.import_module(fedjax.__name__ + '.algorithms.apfl')
apfl = apfl_module.adaptive_personalized_federated_learning(
    fedjax.model_grad(stax_model), fedjax.optimizers.sgd(0.1),
    fedjax.optimizers.sgd(1.0),
    fedjax.ShuffleRepeatBatchHParams(batch_size=3, num_epochs=1, seed=2), 0.5)
p_state = apfl.init(stax_params)
for clients_now in (fa_clients[:2], fa_clients[1:]):
  p_state, p_diag = apfl.apply(p_state, clients_now)
R['params'] = p_state.params
R['client0'] = p_state.client_states[b'0'].params
R['alpha2'] = p_state.client_states[b'2'].interpolation_coefficients
R['norms'] = [p_diag[b'1']['delta_l2_norm'], p_diag[b'2']['delta_l2_norm']]
evaluate = apfl_module.eval_adaptive_personalized_federated_learning(
    stax_model, fedjax.PaddedBatchHParams(batch_size=4))
R['eval'] = {cid.decode(): {k: v.result() for k, v in stats.items()}
             for cid, stats in evaluate(
    p_state, [(cid, cds) for cid, cds, _ in fa_clients] + [(b'new', eval_ds)])}
""",
  ),
  (
    'hyp_cluster',
    """
hc = importlib.import_module(fedjax.__name__ + '.algorithms.hyp_cluster')

def hc_grad(params, batch, rng):
  return 0.5 * params + jnp.mean(batch['x']) + jax.random.uniform(rng, [])

hc_batches = [
    (b'0000', [{'x': jnp.array([0.125])}, {'x': jnp.array([0.25, 0.75])}],
     jax.random.PRNGKey(0)),
    (b'1001', [{'x': jnp.array([0., 1., 2.])}], jax.random.PRNGKey(1))]
R['delta_global'] = dict(hc.ClientDeltaTrainer(
    hc_grad, fedjax.optimizers.sgd(1)).train_global_params(
        jnp.array(1.), hc_batches))
R['delta_per_client'] = dict(hc.ClientDeltaTrainer(
    hc_grad, fedjax.optimizers.sgd(1)).train_per_client_params(
        [(c, b, r, p) for (c, b, r), p in
         zip(hc_batches, [jnp.array(1.), jnp.array(0.5)])]))
R['random_init'] = hc.random_init(
    3, lambda k: jax.random.uniform(k, [2]), jax.random.PRNGKey(0))

def km_apply_for_train(params, batch, rng):
  return params - batch['x']

km_model = fedjax.Model(
    init=lambda k: jax.random.uniform(k), apply_for_train=km_apply_for_train,
    apply_for_eval=None,
    train_loss=lambda batch, out: jnp.square(out) + batch['bias'],
    eval_metrics={})
km_clients = [
    (b'%d' % i, fedjax.ClientDataset({'x': np.array([x]),
                                      'bias': np.array([b])}),
     jax.random.PRNGKey(k))
    for i, (x, b, k) in enumerate([(1.01, -2., 1), (3.02, -1., 2),
                                   (3.03, 1., 3), (1.04, 2., 3)])]
initializer = hc.ModelKMeansInitializer(km_model, fedjax.optimizers.sgd(0.5),
                                        lambda p: 0)
for seed in (0, 1):
  R['kmeans/%d' % seed] = initializer.cluster_params(
      num_clusters=3, rng=jax.random.PRNGKey(seed), clients=km_clients,
      train_batch_hparams=fedjax.ShuffleRepeatBatchHParams(
          batch_size=1, num_epochs=5),
      eval_batch_hparams=fedjax.PaddedBatchHParams(batch_size=2))

def l1_loss(params, batch, rng):
  sign = jax.random.bernoulli(rng) * 2 - 1
  return jnp.abs(params * sign - batch['x'])

mx_clients = [
    (b'near0', fedjax.ClientDataset({'x': np.array([0.1])}),
     jax.random.PRNGKey(0)),
    (b'near-1', fedjax.ClientDataset({'x': np.array([0.9, 1.1, 1.3])}),
     jax.random.PRNGKey(16)),
    (b'near2', fedjax.ClientDataset({'x': np.array([1.9, 2.1, -2.1])}),
     jax.random.PRNGKey(68)),
    (b'near1', fedjax.ClientDataset({'x': np.array([0.9, 1.1, 1.3])}),
     jax.random.PRNGKey(106))]
mx_evaluator = fedjax.AverageLossEvaluator(
    l1_loss, lambda p: 0.01 * jnp.sum(jnp.abs(p)))
mx_params = [jnp.array(0.), jnp.array(-1.), jnp.array(2.)]
R['maximization'] = hc.maximization_step(
    mx_evaluator, mx_params, mx_clients,
    fedjax.PaddedBatchHParams(batch_size=2))
algorithm = hc.hyp_cluster(
    l1_loss, fedjax.optimizers.sgd(0.5), fedjax.optimizers.sgd(1.0),
    fedjax.PaddedBatchHParams(batch_size=2),
    fedjax.ShuffleRepeatBatchHParams(batch_size=1, num_epochs=2, seed=0),
    regularizer=lambda p: 0.01 * jnp.sum(jnp.abs(p)))
h_state = algorithm.init(mx_params)
h_state, h_diag = algorithm.apply(h_state, mx_clients)
R['toy/params'] = h_state.cluster_params
R['toy/cluster_ids'] = {c.decode(): d['cluster_id'] for c, d in h_diag.items()}
algorithm = hc.hyp_cluster(
    fedjax.model_per_example_loss(stax_model), fedjax.optimizers.sgd(0.1),
    fedjax.optimizers.sgd(1.0, momentum=0.5),
    fedjax.PaddedBatchHParams(batch_size=4),
    fedjax.ShuffleRepeatBatchHParams(batch_size=3, num_epochs=2, seed=1))
h_state = algorithm.init(hc.random_init(2, stax_model.init,
                                        jax.random.PRNGKey(5)))
for _ in range(2):
  h_state, h_diag = algorithm.apply(h_state, fa_clients)
R['stax/params'] = h_state.cluster_params
R['stax/opt_states'] = h_state.opt_states
R['stax/cluster_ids'] = [h_diag[c]['cluster_id'] for c, _, _ in fa_clients]
R['eval'] = {c.decode(): m for c, m in hc.HypClusterEvaluator(
    stax_model).evaluate_clients(
        h_state.cluster_params, fa_clients,
        [(c, d) for c, d, _ in fa_clients],
        fedjax.PaddedBatchHParams(batch_size=4))}
""",
  ),
  (
    'model_zoo',
    """
zoo_tokens = np.array([[1, 5, 9, 3, 0], [7, 2, 4, 0, 0], [3, 3, 8, 6, 2]],
                      dtype=np.int32)
zoo_lm = {'x': zoo_tokens, 'y': np.roll(zoo_tokens, -1, axis=1)}
for name, model in [
    ('shakespeare', fedjax.models.shakespeare.create_lstm_model(
        vocab_size=6, embed_size=4, lstm_hidden_size=5, lstm_num_layers=2)),
    ('stackoverflow', fedjax.models.stackoverflow.create_lstm_model(
        vocab_size=7, embed_size=4, lstm_hidden_size=6, lstm_num_layers=2,
        expected_length=3.5)),
    ('stackoverflow_shared', fedjax.models.stackoverflow.create_lstm_model(
        vocab_size=7, embed_size=4, lstm_hidden_size=6,
        share_input_output_embeddings=True))]:
  z_params = model.init(jax.random.PRNGKey(3))
  R[name + '/params'] = z_params
  R[name + '/eval'] = fedjax.evaluate_model(model, z_params, [zoo_lm])
  R[name + '/grad'] = fedjax.model_grad(model)(z_params, zoo_lm,
                                               jax.random.PRNGKey(4))
  R[name + '/loss'] = fedjax.model_per_example_loss(model)(
      z_params, zoo_lm, jax.random.PRNGKey(4))
model = fedjax.models.cifar100.create_logistic_model()
z_params = model.init(jax.random.PRNGKey(3))
z_batch = {'x': np.linspace(-1, 1, 2 * 24 * 24 * 3, dtype=np.float32).reshape(
    2, 24, 24, 3), 'y': np.array([3, 97], dtype=np.int32)}
R['cifar100/params'] = z_params
R['cifar100/eval'] = fedjax.evaluate_model(model, z_params, [z_batch])
""",
  ),
  (
    'training',
    """
import os
import tempfile
tr_fd = fedjax.InMemoryFederatedData({
    cid: {k: np.asarray(v) for k, v in cds.all_examples().items()}
    for cid, cds, _ in fa_clients})
tr_dir = tempfile.mkdtemp()
tr_config = fedjax.training.FederatedExperimentConfig(
    root_dir=tr_dir, num_rounds=3, checkpoint_frequency=1,
    num_checkpoints_to_keep=2, eval_frequency=2)
tr_eval = fedjax.PaddedBatchHParams(batch_size=4)
tr_state = fedjax.training.run_federated_experiment(
    fed_avg, fed_avg.init(stax_params),
    fedjax.client_samplers.UniformGetClientSampler(tr_fd, 2, seed=0),
    tr_config,
    periodic_eval_fn_map={
        'train': fedjax.training.ModelTrainClientsEvaluationFn(
            stax_model, tr_eval),
        'sampled': fedjax.training.ModelSampleClientsEvaluationFn(
            fedjax.client_samplers.UniformGetClientSampler(tr_fd, 2, seed=1),
            stax_model, tr_eval)},
    final_eval_fn_map={'full': fedjax.training.ModelFullEvaluationFn(
        tr_fd, stax_model, tr_eval)})
R['params'] = tr_state.params
R['checkpoints'] = sorted(os.listdir(tr_dir)).count('checkpoint_00000003')
R['latest_round'] = fedjax.training.load_latest_checkpoint(tr_dir)[1]
with open(os.path.join(tr_dir, 'full.tsv')) as f:
  tr_head, tr_row = f.read().split('\\n')
R['full'] = dict(zip(tr_head.split('\\t'), map(float, tr_row.split('\\t'))))
tr_config = tr_config._replace(num_rounds=5)
tr_state = fedjax.training.run_federated_experiment(
    fed_avg, fed_avg.init(stax_params),
    fedjax.client_samplers.UniformGetClientSampler(tr_fd, 2, seed=0),
    tr_config)
R['resumed_params'] = tr_state.params
R['tasks'] = list(fedjax.training.ALL_TASKS)
""",
  ),
  (
    'aggregators',
    """
agg = fedjax.aggregators
agg_clients = [
    (b'a', {'w': jnp.arange(6.).reshape(2, 3) / 7, 'b': jnp.array([0.5, -1.])},
     2.),
    (b'b', {'w': jnp.cos(jnp.arange(6.)).reshape(2, 3),
            'b': jnp.array([2., 0.25])}, 1.),
    (b'c', {'w': -jnp.arange(6.).reshape(2, 3) / 3, 'b': jnp.array([0., 3.])},
     3.)]
mean = agg.mean_aggregator()
R['mean'] = mean.apply(agg_clients, mean.init())[0]
for name, aggregator in [
    ('uniform', agg.uniform_stochastic_quantizer(4, jax.random.PRNGKey(0))),
    ('arithmetic', agg.uniform_stochastic_quantizer(
        3, jax.random.PRNGKey(1), 'arithmetic')),
    ('rotated', agg.compression.rotated_uniform_stochastic_quantizer(
        4, jax.random.PRNGKey(2))),
    ('drive', agg.compression.structured_drive_quantizer(
        jax.random.PRNGKey(3))),
    ('terngrad', agg.compression.terngrad_quantizer(jax.random.PRNGKey(4)))]:
  agg_state = aggregator.init()
  for _ in range(2):
    agg_out, agg_state = aggregator.apply(agg_clients, agg_state)
  R[name + '/params'] = agg_out
  R[name + '/bits'] = agg_state.num_bits
  R[name + '/rng'] = agg_state.rng
# integers: every sum exact in float32, whatever the order
R['walsh_hadamard'] = agg.walsh_hadamard_transform(jnp.arange(256.))
R['binary'] = agg.binary_stochastic_quantize(
    jnp.linspace(-1., 1., 9), jax.random.PRNGKey(5))
R['uniform'] = agg.uniform_stochastic_quantize(
    jnp.linspace(-1., 1., 9), 5, jax.random.PRNGKey(6), -2., 2.)
R['arithmetic_bits'] = agg.compression.arithmetic_encoding_num_bits(
    jnp.array([0., 1., 1., 2., 2., 2.]))
""",
  ),
  (
    'for_each_client',
    """
def fec_init(shared, client_input):
  return {'total': shared['start'] + client_input, 'steps': 0}

def fec_step(state, batch):
  total = state['total'] + jnp.sum(batch['x'])
  return {'total': total, 'steps': state['steps'] + 1}, {'seen': total}

def fec_final(shared, state):
  return state['total'] * shared['scale']

each = fedjax.for_each_client(fec_init, fec_step, fec_final,
                              with_step_result=True)
fec_clients = [
    (b'p', [{'x': jnp.array([1., 2.])}, {'x': jnp.array([3., 4.])},
            {'x': jnp.array([5.])}], jnp.array(1.)),
    (b'q', [{'x': jnp.array([10., 20.])}], jnp.array(2.)),
    (b'r', [], jnp.array(3.)),
]
fec_out = {cid: (out, [r['seen'] for r in results]) for cid, out, results in
           each({'start': jnp.array(0.5), 'scale': jnp.array(2.)}, fec_clients)}
R['outputs'] = [fec_out[c][0] for c in (b'p', b'q', b'r')]
R['p_steps'] = fec_out[b'p'][1]
R['q_steps'] = fec_out[b'q'][1]
R['r_steps'] = len(fec_out[b'r'][1])
plain = fedjax.for_each_client(fec_init, lambda s, b: fec_step(s, b)[0])
R['plain'] = [s['total'] for _, s in plain(
    {'start': jnp.array(0.), 'scale': jnp.array(1.)}, fec_clients)]
""",
  ),
  (
    'serialization',
    """
tree = {'a': np.arange(6, dtype=np.float32).reshape(2, 3),
        'b': [np.int64(3), 1.5, 'text', np.array([b'x', b'yz'], dtype=object)],
        'c': {'d': np.array(True)}}
encoded = fedjax.serialization.msgpack_serialize(tree)
R['bytes'] = np.frombuffer(encoded, np.uint8)
back = fedjax.serialization.msgpack_deserialize(encoded)
R['a'] = back['a']
R['b0'] = back['b'][0]
R['b3'] = back['b'][3].astype(bytes)
""",
  ),
]


def _flatten(key, value, out):
  """``R``'s values as arrays: dicts and lists one key per item."""
  if isinstance(value, dict) or hasattr(value, 'items'):
    for k in sorted(value):
      _flatten(f'{key}/{k}', value[k], out)
  elif isinstance(value, (list, tuple)):
    out[f'{key}/len'] = np.array(len(value))
    for i, v in enumerate(value):
      _flatten(f'{key}/{i}', v, out)
  else:
    out[key] = np.asarray(value)


def run_cells(fedjax) -> dict:
  """Runs ``CELLS`` in one namespace with ``fedjax`` as given; returns
  ``{key: array}`` of what they recorded, each raising cell's error type
  under ``<cell>/error``."""
  import jax  # noqa: PLC0415  (either venv's)
  import jax.numpy as jnp  # noqa: PLC0415
  import optax  # noqa: PLC0415

  space = {
    '__name__': 'fedjax_cells',
    'importlib': importlib,
    'fedjax': fedjax,
    'jax': jax,
    'jnp': jnp,
    'np': np,
    'optax': optax,
  }
  out = {}
  for name, code in CELLS:
    space['R'] = {}
    try:
      exec(code, space)  # noqa: S102  (FedJAX's example code)
    except Exception as e:  # noqa: BLE001  (a cell's error is what it shows)
      out[f'{name}/error'] = np.array(f'{type(e).__name__}: {e}')
    for k in sorted(space['R']):
      _flatten(f'{name}/{k}', space['R'][k], out)
  return out


def main():
  import fedjax  # noqa: PLC0415  (FedJAX's venv only)
  import jax.numpy as jnp  # noqa: PLC0415

  # FedJAX 0.0.17's language models read ``jnp.NINF``, which its own JAX
  # (0.4.30) no longer has: restored so that FedJAX's code runs at all
  if not hasattr(jnp, 'NINF'):
    jnp.NINF = -jnp.inf

  p = argparse.ArgumentParser()
  p.add_argument('--out', required=True)
  a = p.parse_args()
  out = run_cells(fedjax)
  np.savez_compressed(a.out, **out)
  print(
    f'wrote {len(out)} arrays to {a.out}: errors in',
    {k: str(v) for k, v in out.items() if k.endswith('/error')},
  )


if __name__ == '__main__':
  main()
