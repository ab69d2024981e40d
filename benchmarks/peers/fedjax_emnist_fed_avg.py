"""FedJAX's ``examples/emnist_fed_avg.py`` round loop, timed: the same
script under FedJAX 0.0.17 (its venv) and under this project with the import
changed (``--fedjax=fedjax_personal.fedjax``), on the same made
EMNIST-shaped clients, one command per side.

  <FedJAX venv>/bin/python benchmarks/peers/fedjax_emnist_fed_avg.py --fedjax=fedjax
  python benchmarks/peers/fedjax_emnist_fed_avg.py \\
      --fedjax=fedjax_personal.fedjax --backend=vmap

The script's model (``models.emnist.create_conv_model``, 62 classes;
``--model=dense`` or ``logistic``: FedJAX's other EMNIST models), its
optimizers (client SGD 10^-1.5, server Adam 10^-2.5), batch 20, 10 clients
a round drawn by ``UniformGetClientSampler``; the algorithm is the
example's own loop (``--algorithm=example``: ``examples/fed_avg.py``, a
Python loop over clients and batches) or FedJAX's
``algorithms.fed_avg`` (``--algorithm=library``: ``for_each_client``, whose
backend ``--backend`` picks: FedJAX's ``jit`` or this project's ``threads``
or ``vmap``).
The clients: ``--clients`` writers with EMNIST-62's heavy-tailed sizes
(log-normal around 200 examples, clipped to its 24-1,067), 28x28 images
drawn from a seeded NumPy generator (the same on both sides; the download
is not needed). Prints one JSON line: seconds per round, the median of
``--rounds`` rounds after ``--warmup`` untimed ones (a new size of a client's
last, smaller batch compiles the step again on both sides: a long run has
compiled them all, so the steady state is the rounds after they are).
"""

import argparse
import importlib
import json
import statistics
import time

import numpy as np


def made_clients(num_clients: int, seed: int = 0):
  """{client id: {'x', 'y'}}: EMNIST-62-shaped writers."""
  rng = np.random.RandomState(seed)
  sizes = np.clip(rng.lognormal(np.log(200), 0.8, num_clients), 24, 1067)
  return {
    b'%04d' % i: {
      'x': rng.uniform(size=(int(n), 28, 28, 1)).astype(np.float32),
      'y': rng.randint(0, 62, size=int(n)).astype(np.int32),
    }
    for i, n in enumerate(sizes)
  }


def example_fed_avg(fedjax, jax, grad_fn, client_optimizer, server_optimizer,
                    hparams):  # fmt: skip
  """``examples/fed_avg.py``'s federated_averaging (its Python loops)."""

  @fedjax.dataclass
  class ServerState:
    params: fedjax.Params
    opt_state: fedjax.OptState

  def init(params):
    return ServerState(params, server_optimizer.init(params))

  def client_update(server_params, client_dataset, client_rng):
    params = server_params
    opt_state = client_optimizer.init(params)
    for batch in client_dataset.shuffle_repeat_batch(hparams):
      client_rng, use_rng = jax.random.split(client_rng)
      grads = grad_fn(params, batch, use_rng)
      opt_state, params = client_optimizer.apply(grads, opt_state, params)
    return jax.tree_util.tree_map(lambda a, b: a - b, server_params, params)

  def apply(server_state, clients):
    deltas = []
    for _, client_dataset, client_rng in clients:
      delta = client_update(server_state.params, client_dataset, client_rng)
      deltas.append((delta, len(client_dataset)))
    mean_delta = fedjax.tree_util.tree_mean(deltas)
    opt_state, params = server_optimizer.apply(
      mean_delta, server_state.opt_state, server_state.params
    )
    return ServerState(params, opt_state), {}

  return fedjax.FederatedAlgorithm(init, apply)


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--fedjax', default='fedjax_personal.fedjax')
  p.add_argument(
    '--algorithm', choices=('example', 'library'), default='library'
  )
  p.add_argument('--backend', default='jit')
  p.add_argument('--clients', type=int, default=100)
  p.add_argument('--cohort', type=int, default=10)
  p.add_argument('--rounds', type=int, default=5)
  # rounds before the timed ones: each new size of a client's last, smaller
  # batch compiles the step again (on both sides), so the first rounds
  # time compilations; a long run has compiled every size
  p.add_argument('--warmup', type=int, default=1)
  p.add_argument(
    '--model', choices=('conv', 'dense', 'logistic'), default='conv'
  )
  a = p.parse_args()
  fedjax = importlib.import_module(a.fedjax)
  import jax  # noqa: PLC0415  (after the side's import)
  import jax.numpy as jnp  # noqa: PLC0415

  train_fd = fedjax.InMemoryFederatedData(made_clients(a.clients))
  model = getattr(fedjax.models.emnist, f'create_{a.model}_model')(
    only_digits=False
  )

  def loss(params, batch, rng):
    preds = model.apply_for_train(params, batch, rng)
    return jnp.mean(model.train_loss(batch, preds))

  grad_fn = jax.jit(jax.grad(loss))
  client_optimizer = fedjax.optimizers.sgd(learning_rate=10 ** (-1.5))
  server_optimizer = fedjax.optimizers.adam(
    learning_rate=10 ** (-2.5), b1=0.9, b2=0.999, eps=10 ** (-4)
  )
  hparams = fedjax.ShuffleRepeatBatchHParams(batch_size=20, seed=0)
  # for_each_client takes the backend current when the algorithm is built
  fedjax.set_for_each_client_backend(a.backend)
  if a.algorithm == 'example':
    algorithm = example_fed_avg(
      fedjax, jax, grad_fn, client_optimizer, server_optimizer, hparams
    )
  else:
    algorithm = fedjax.algorithms.fed_avg.federated_averaging(
      grad_fn, client_optimizer, server_optimizer, hparams
    )
  state = algorithm.init(model.init(jax.random.PRNGKey(17)))
  sampler = fedjax.client_samplers.UniformGetClientSampler(
    fd=train_fd, num_clients=a.cohort, seed=0
  )
  times = []
  for _ in range(a.warmup + a.rounds):
    clients = sampler.sample()
    start = time.perf_counter()
    state, _ = algorithm.apply(state, clients)
    jax.block_until_ready(state.params)
    times.append(time.perf_counter() - start)
  print(
    json.dumps(
      {
        'side': a.fedjax,
        'algorithm': a.algorithm,
        'backend': a.backend,
        'model': a.model,
        'jax': jax.__version__,
        'seconds_per_round': statistics.median(times[a.warmup :]),
        'warmup_rounds': [round(t, 3) for t in times[: a.warmup]],
        'timed_rounds': [round(t, 3) for t in times[a.warmup :]],
      }
    )
  )


if __name__ == '__main__':
  main()
