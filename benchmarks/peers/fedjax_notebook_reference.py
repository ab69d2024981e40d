"""FedJAX's model and algorithms tutorials (``docs/notebooks/
model_tutorial.ipynb``, ``algorithms_tutorial.ipynb``), cell by cell, on
made files: run by FedJAX 0.0.17 in its venv to record what each cell
shows, and by ``tests/test_fedjax_notebooks.py`` with ``fedjax`` replaced
by ``fedjax_personal.fedjax`` to compare.

  <FedJAX venv>/bin/python benchmarks/peers/fedjax_notebook_reference.py \\
      --out=tests/data/fedjax_notebook_reference.npz

Each cell is the notebook's, changed only where it must be: ``load_data``
reads the made files (``cache_dir=CACHE``: ``tests/made_files.
fedjax_reference_files``, 4 EMNIST writers); the training loops run 10
steps instead of 5000 and 1000, and the evaluations 2 batches instead of
16 (a CPU-sized reduction); unseeded draws are seeded (``np.random.seed``,
``shuffled_clients(seed=0)``, the clients' batches ``seed=0``); ``jax.tree_util.tree_multimap``, gone from
JAX since 0.3.16 (FedJAX's own notebook fails there under its JAX 0.4.30),
is ``jax.tree_util.tree_map``; ``fedjax.training.set_tf_cpu_only()`` is
kept. What a cell prints is recorded in ``R``. Random draws are JAX's from
the same keys: with JAX >= 0.5 the caller runs the cells under
``jax.threefry_partitionable(False)``.
"""

import argparse
import itertools
import os
import pathlib
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

CELLS = [
  (
    'model_load',
    """
train, test = fedjax.datasets.emnist.load_data(cache_dir=CACHE)
model = fedjax.models.emnist.create_logistic_model()
params_rng = jax.random.PRNGKey(0)
params = model.init(params_rng)
R['params'] = params
""",
  ),
  (
    'model_evaluate',
    """
batched_test_data = list(itertools.islice(
    fedjax.padded_batch_federated_data(test, batch_size=128), 2))
batched_train_data = list(itertools.islice(
    fedjax.padded_batch_federated_data(train, batch_size=128), 2))
R['eval_test'] = fedjax.evaluate_model(model, params, batched_test_data)
R['eval_train'] = fedjax.evaluate_model(model, params, batched_train_data)
R['eval_metrics'] = sorted(model.eval_metrics)
R['per_client'] = [
    (client_id, fedjax.evaluate_model(model, params,
                                      dataset.padded_batch(batch_size=128)))
    for client_id, dataset in itertools.islice(test.clients(), 4)]
""",
  ),
  (
    'model_train',
    """
def train_batches():
  return fedjax.shuffle_repeat_batch_federated_data(
      train, batch_size=8, client_buffer_size=16, example_buffer_size=1024,
      seed=0)

example = next(train_batches())
output = model.apply_for_train(params, example, None)
per_example_loss = model.train_loss(example, output)
R['output_shape'] = output.shape
R['per_example_loss'] = per_example_loss
per_example_loss_fn = fedjax.model_per_example_loss(model)
R['per_example_loss_fn'] = per_example_loss_fn(params, example, None)

def train_objective(params, example):
  return jnp.mean(per_example_loss_fn(params, example, None))

R['objective'] = train_objective(params, example)
optimizer = fedjax.optimizers.adam(1e-3)
opt_state = optimizer.init(params)
grads = jax.grad(train_objective)(params, example)
opt_state, params = optimizer.apply(grads, opt_state, params)
R['objective_after_step'] = train_objective(params, example)
model_grads = fedjax.model_grad(model)(params, example, None)
opt_state, params = optimizer.apply(grads, opt_state, params)
R['objective_after_two'] = train_objective(params, example)

@jax.jit
def train_step(example, opt_state, params):
  grads = jax.grad(train_objective)(params, example)
  return optimizer.apply(grads, opt_state, params)

for example in itertools.islice(train_batches(), 10):
  opt_state, params = train_step(example, opt_state, params)
R['trained_eval_test'] = fedjax.evaluate_model(model, params,
                                               batched_test_data)
R['trained_eval_train'] = fedjax.evaluate_model(model, params,
                                                batched_train_data)
""",
  ),
  (
    'model_variants',
    """
def hinge_loss(example, output):
  label = example['y']
  num_classes = output.shape[-1]
  mask = jax.nn.one_hot(label, num_classes)
  label_score = jnp.sum(output * mask, axis=-1)
  best_score = jnp.max(output + 1 - mask, axis=-1)
  return best_score - label_score

hinge_model = model.replace(train_loss=hinge_loss)
R['hinge'] = fedjax.model_per_example_loss(hinge_model)(params, example, None)
only_accuracy = model.replace(
    eval_metrics={'accuracy': fedjax.metrics.Accuracy()})
R['only_accuracy'] = fedjax.evaluate_model(only_accuracy, params,
                                           batched_test_data)
R['train_equals_eval'] = jnp.all(
    model.apply_for_train(params, example, None) == model.apply_for_eval(
        params, example))
""",
  ),
  (
    'model_mlp',
    """
def cross_entropy_loss(example, output):
  label = example['y']
  num_classes = output.shape[-1]
  mask = jax.nn.one_hot(label, num_classes)
  return -jnp.sum(jax.nn.log_softmax(output) * mask, axis=-1)

def mlp_model(num_input_units, num_units, num_classes):

  def mlp_init(rng):
    w0_rng, w1_rng = jax.random.split(rng)
    w0 = jax.random.uniform(w0_rng, [num_input_units, num_units])
    b0 = jnp.zeros([num_units])
    w1 = jax.random.uniform(w1_rng, [num_units, num_classes])
    b1 = jnp.zeros([num_classes])
    return w0, b0, w1, b1

  def mlp_apply(params, batch, rng=None):
    w0, b0, w1, b1 = params
    x = batch['x']
    batch_size = x.shape[0]
    h = jax.nn.relu(x.reshape([batch_size, -1]) @ w0 + b0)
    return h @ w1 + b1

  return fedjax.Model(
      init=mlp_init,
      apply_for_train=mlp_apply,
      apply_for_eval=mlp_apply,
      train_loss=cross_entropy_loss,
      eval_metrics={'accuracy': fedjax.metrics.Accuracy()})

mlp = mlp_model(28 * 28, 128, 62)

@jax.jit
def mlp_train_step(example, opt_state, params):

  @jax.grad
  def grad_fn(params, example):
    return jnp.mean(fedjax.model_per_example_loss(mlp)(params, example, None))

  grads = grad_fn(params, example)
  return optimizer.apply(grads, opt_state, params)

params = mlp.init(jax.random.PRNGKey(0))
opt_state = optimizer.init(params)
R['before'] = fedjax.evaluate_model(mlp, params, batched_test_data)
for example in itertools.islice(train_batches(), 10):
  opt_state, params = mlp_train_step(example, opt_state, params)
R['after'] = fedjax.evaluate_model(mlp, params, batched_test_data)
""",
  ),
  (
    'model_stax_cnn',
    """
def stax_cnn_model(input_shape, num_classes):
  stax_init, stax_apply = stax.serial(
      stax.Conv(
          out_chan=64, filter_shape=(3, 3), strides=(1, 1), padding='SAME'),
      stax.Relu,
      stax.Flatten,
      stax.Dense(256),
      stax.Relu,
      stax.Dense(num_classes),
  )
  return fedjax.create_model_from_stax(
      stax_init=stax_init,
      stax_apply=stax_apply,
      sample_shape=input_shape,
      train_loss=cross_entropy_loss,
      eval_metrics={'accuracy': fedjax.metrics.Accuracy()})

stax_cnn = stax_cnn_model([-1, 28, 28, 1], 62)

@jax.jit
def stax_cnn_train_step(example, opt_state, params):

  @jax.grad
  def grad_fn(params, example):
    return jnp.mean(
        fedjax.model_per_example_loss(stax_cnn)(params, example, None))

  grads = grad_fn(params, example)
  return optimizer.apply(grads, opt_state, params)

params = stax_cnn.init(jax.random.PRNGKey(0))
opt_state = optimizer.init(params)
R['before'] = fedjax.evaluate_model(stax_cnn, params, batched_test_data)
for example in itertools.islice(train_batches(), 5):
  opt_state, params = stax_cnn_train_step(example, opt_state, params)
R['after'] = fedjax.evaluate_model(stax_cnn, params, batched_test_data)
""",
  ),
  (
    'algorithms_setup',
    """
fedjax.training.set_tf_cpu_only()
train, test = fedjax.datasets.emnist.load_data(only_digits=False,
                                               cache_dir=CACHE)
model = fedjax.models.emnist.create_conv_model(only_digits=False)
rng = jax.random.PRNGKey(0)
init_params = model.init(rng)
grad_fn = fedjax.model_grad(model)
client_optimizer = fedjax.optimizers.sgd(0.1)
server_optimizer = fedjax.optimizers.sgd(1.0)
batch_hparams = fedjax.ShuffleRepeatBatchHParams(batch_size=10, seed=0)
fed_alg = fedjax.algorithms.fed_avg.federated_averaging(grad_fn,
                                                        client_optimizer,
                                                        server_optimizer,
                                                        batch_hparams)
init_server_state = fed_alg.init(init_params)
client_ids = list(train.client_ids())[:5]
clients_ids_and_data = list(train.get_clients(client_ids))
client_inputs = []
for i in range(len(clients_ids_and_data)):
  rng, use_rng = jax.random.split(rng)
  client_id, client_data = clients_ids_and_data[i]
  client_inputs.append((client_id, client_data, use_rng))
updated_server_state, client_diagnostics = fed_alg.apply(init_server_state,
                                                         client_inputs)
R['diagnostics'] = {k.decode(): v for k, v in client_diagnostics.items()}
R['params'] = updated_server_state.params
""",
  ),
  (
    'algorithms_sampling',
    """
all_client_ids = list(train.client_ids())
R['num_ids'] = len(all_client_ids)
np.random.seed(0)
R['sampled'] = np.random.choice(all_client_ids, size=2, replace=False)
efficient_sampler = fedjax.client_samplers.UniformShuffledClientSampler(
    train.shuffled_clients(buffer_size=100, seed=0), num_clients=2)
R['efficient'] = [
    [(client_id, client_rng) for client_id, _, client_rng in
     efficient_sampler.sample()] for _ in range(3)]
perfect_uniform_sampler = fedjax.client_samplers.UniformGetClientSampler(
    train, num_clients=2, seed=1)
R['perfect'] = [
    [(client_id, client_rng) for client_id, _, client_rng in
     perfect_uniform_sampler.sample()] for _ in range(3)]
""",
  ),
  (
    'algorithms_client_update',
    """
def client_update(init_params, client_dataset, client_rng, grad_fn):
  opt_state = client_optimizer.init(init_params)
  params = init_params
  for batch in client_dataset.shuffle_repeat_batch(batch_size=10, seed=0):
    client_rng, use_rng = jax.random.split(client_rng)
    grads = grad_fn(params, batch, use_rng)
    opt_state, params = client_optimizer.apply(grads, opt_state, params)
  delta_params = jax.tree_util.tree_map(lambda a, b: a - b,
                                        init_params, params)
  return delta_params, len(client_dataset)

client_sampler = fedjax.client_samplers.UniformGetClientSampler(
    train, num_clients=2, seed=1)
sampled_clients_with_data = client_sampler.sample()
R['updates'] = []
for client_id, client_data, client_rng in sampled_clients_with_data:
  delta_params, num_samples = client_update(init_params, client_data,
                                            client_rng, grad_fn)
  R['updates'].append((client_id, num_samples, delta_params))
sampled_clients_with_data = client_sampler.sample()
client_updates = []
for client_id, client_data, client_rng in sampled_clients_with_data:
  delta_params, num_samples = client_update(init_params, client_data,
                                            client_rng, grad_fn)
  client_updates.append((delta_params, num_samples))
R['mean'] = fedjax.tree_util.tree_mean(client_updates)
""",
  ),
  (
    'algorithms_for_each_client',
    """
def client_init(server_params, client_rng):
  opt_state = client_optimizer.init(server_params)
  return {'params': server_params, 'opt_state': opt_state, 'rng': client_rng}

def client_step(client_step_state, batch):
  rng, use_rng = jax.random.split(client_step_state['rng'])
  grads = grad_fn(client_step_state['params'], batch, use_rng)
  opt_state, params = client_optimizer.apply(grads,
                                             client_step_state['opt_state'],
                                             client_step_state['params'])
  return {'params': params, 'opt_state': opt_state, 'rng': rng}

def client_final(server_params, client_step_state):
  return jax.tree_util.tree_map(lambda a, b: a - b, server_params,
                                client_step_state['params'])

for_each_client_update = fedjax.for_each_client(client_init, client_step,
                                                client_final)
client_sampler = fedjax.client_samplers.UniformGetClientSampler(
    train, num_clients=2, seed=1)
sampled_clients_with_data = client_sampler.sample()
batched_clients_data = [
    (cid, cds.shuffle_repeat_batch(batch_size=10, seed=0), crng)
    for cid, cds, crng in sampled_clients_with_data]
R['deltas'] = {cid.decode(): delta for cid, delta in for_each_client_update(
    init_params, batched_clients_data)}

def client_step_with_log(client_step_state, batch):
  rng, use_rng = jax.random.split(client_step_state['rng'])
  grads = grad_fn(client_step_state['params'], batch, use_rng)
  opt_state, params = client_optimizer.apply(grads,
                                             client_step_state['opt_state'],
                                             client_step_state['params'])
  next_client_step_state = {'params': params, 'opt_state': opt_state,
                            'rng': rng}
  grad_norm = fedjax.tree_util.tree_l2_norm(grads)
  return next_client_step_state, grad_norm

for_each_client_update = fedjax.for_each_client(
    client_init, client_step_with_log, client_final, with_step_result=True)
R['logged'] = {
    cid.decode(): (delta, np.array(grad_norms))
    for cid, delta, grad_norms in for_each_client_update(
        init_params, batched_clients_data)}
""",
  ),
]


def _training_reference():
  """``fedjax_training_reference.py`` beside this file (its ``_flatten``),
  loaded by path."""
  import importlib.util  # noqa: PLC0415

  path = os.path.join(HERE, 'fedjax_training_reference.py')
  spec = importlib.util.spec_from_file_location(
    'fedjax_training_reference', path
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def run_cells(fedjax, cache: str) -> dict:
  """Runs ``CELLS`` in one namespace with ``fedjax`` as given and the made
  files in ``cache``; returns ``{key: array}``, each raising cell's error
  under ``<cell>/error``."""
  import jax  # noqa: PLC0415  (either venv's)
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.example_libraries import stax  # noqa: PLC0415

  space = {
    '__name__': 'fedjax_notebooks',
    'fedjax': fedjax,
    'jax': jax,
    'jnp': jnp,
    'np': np,
    'stax': stax,
    'itertools': itertools,
    'CACHE': cache,
  }
  flatten = _training_reference()._flatten
  out = {}
  for name, code in CELLS:
    space['R'] = {}
    try:
      exec(code, space)  # noqa: S102  (the notebooks' cells)
    except Exception as e:  # noqa: BLE001  (a cell's error is what it shows)
      out[f'{name}/error'] = np.array(f'{type(e).__name__}: {e}')
    for k in sorted(space['R']):
      flatten(f'{name}/{k}', space['R'][k], out)
  return out


def main():
  import fedjax  # noqa: PLC0415  (FedJAX's venv only)
  from fedjax.datasets import downloads  # noqa: PLC0415

  # made files, not the releases
  downloads.validate_file = lambda *args, **kwargs: None
  sys.path.insert(0, os.path.join(HERE, '..', '..', 'tests'))
  import made_files  # noqa: PLC0415

  p = argparse.ArgumentParser()
  p.add_argument('--out', required=True)
  a = p.parse_args()
  with tempfile.TemporaryDirectory() as folder:
    made_files.fedjax_reference_files(pathlib.Path(folder))
    out = run_cells(fedjax, folder)
  np.savez_compressed(a.out, **out)
  print(
    f'wrote {len(out)} arrays to {a.out}: errors in',
    {k: str(v) for k, v in out.items() if k.endswith('/error')},
  )


if __name__ == '__main__':
  main()
