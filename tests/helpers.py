"""Shared test fixtures: tiny federated problems and a plain reference loop."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from fedjax_personal.core import batching as batching_lib
from fedjax_personal.core.data import FederatedData, pad_clients, to_device
from fedjax_personal.datasets import DataConfig, load_federated
from fedjax_personal.models import Model


class SmallBN(nn.Module):
  """A user's module as Flax writes it: BatchNorm and dropout by ``train``."""

  num_classes: int
  dropout: float = 0.0

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(8)(x.reshape(x.shape[0], -1))
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    x = nn.Dropout(self.dropout, deterministic=not train)(x)
    return nn.Dense(self.num_classes)(x)


def digits_data(num_clients=6, alpha=0.5, seed=0, max_examples=600):
  """Real 8x8 digits (scikit-learn, offline), Dirichlet label skew."""
  return to_device(
    load_federated(
      DataConfig(
        dataset='digits',
        num_clients=num_clients,
        alpha=alpha,
        seed=seed,
        max_examples=max_examples,
      )
    )
  )


def linear_model(dim, loss='squared', out=1):
  """theta = {'w': [dim, out], 'b': [out]}, prediction x @ w + b."""

  def init(key):
    return {'w': 0.1 * jax.random.normal(key, (dim, out)), 'b': jnp.zeros(out)}

  def apply(params, x):
    y = x.reshape(x.shape[0], -1) @ params['w'] + params['b']
    return y[:, 0] if loss == 'squared' and out == 1 else y

  return Model(name='linear', init=init, apply=apply, loss=loss)


def least_squares_data(
  num_clients=4, dim=3, sizes=(5, 9, 13, 7), seed=0, shift=1.0
):
  """Heterogeneous least squares: client i has y = x @ w_i + noise."""
  rng = np.random.default_rng(seed)
  xs, ys = [], []
  for i in range(num_clients):
    n = sizes[i % len(sizes)]
    x = rng.normal(size=(n, dim)).astype(np.float32) + shift * i
    w = rng.normal(size=dim) * (1 + i)
    xs.append(x)
    ys.append((x @ w + 0.1 * rng.normal(size=n)).astype(np.float32))
  train = pad_clients(xs, ys, (dim,), np.float32, (), np.float32)
  empty = pad_clients(
    [x[:0] for x in xs], [y[:0] for y in ys], (dim,), np.float32, (), np.float32
  )
  return (
    FederatedData(
      train=train,
      val=empty,
      test=train,
      groups=-np.ones(num_clients, np.int32),
      num_classes=1,
      name='least_squares',
    ),
    xs,
    ys,
  )


_GRADS = {}


def _loss_grad(model):
  """jit(grad) of the plain mean loss (+ FedProx term), cached per model."""
  if model not in _GRADS:

    def loss_fn(p, start, xb, yb, prox_mu):
      out = model.apply(p, xb)
      if model.loss == 'squared':
        l = 0.5 * jnp.square(out - yb)
      else:
        l = optax.softmax_cross_entropy_with_integer_labels(out, yb)
      prox = sum(
        jnp.sum(jnp.square(a - b))
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(start))
      )
      return jnp.mean(l) + 0.5 * prox_mu * prox

    _GRADS[model] = jax.jit(jax.grad(loss_fn))
  return _GRADS[model]


def reference_sgd(
  model,
  params,
  x,
  y,
  n,
  key,
  batching,
  lr,
  prox_mu=0.0,
  momentum=None,
  max_steps=None,
  groups=None,
):
  """Plain local SGD on one client's data with the engine's batches.

  Uses only the batch indices of the library; the training loop, the loss
  and the optimizer step are redone here with explicit Python loops. With
  ``max_steps``, only the first that many steps run (a straggler's); with
  ``groups``, the examples are shuffled in groups (``batching.row_groups``).
  """
  k_init, k_batch, k_steps = jax.random.split(key, 3)
  idx, mask = batching_lib.batch_indices(
    k_batch, jnp.int32(n), x.shape[0], batching, groups
  )
  idx, mask = np.asarray(idx), np.asarray(mask)
  x, y = np.asarray(x), np.asarray(y)
  start = params
  opt = optax.sgd(lr, momentum=momentum)
  opt_state = opt.init(params)
  grad = _loss_grad(model)
  for s in range(
    idx.shape[0] if max_steps is None else min(max_steps, idx.shape[0])
  ):
    real = idx[s][mask[s]]
    if real.size == 0:
      continue
    g = grad(params, start, x[real], y[real], prox_mu)
    upd, opt_state = opt.update(g, opt_state, params)
    params = optax.apply_updates(params, upd)
  return params


def reference_fedavg(
  model,
  params,
  data,
  clients,
  k_clients,
  batching,
  lr,
  prox_mu=0.0,
  steps=None,
  groups=None,
):
  """FedAvg (FedProx with ``prox_mu``) by a plain loop: each of ``clients``
  (indices) alone (``reference_sgd`` on the engine's batches, its key
  ``fold_in(k_clients, i)``; ``steps``: client -> the steps it may run;
  ``groups``: client -> its rows' groups), then the n_i-weighted mean."""
  outs, weights = [], []
  for i in clients:
    n = int(data.train.num_examples[i])
    outs.append(
      reference_sgd(
        model,
        params,
        data.train.x[i],
        data.train.y[i],
        n,
        jax.random.fold_in(k_clients, int(i)),
        batching,
        lr,
        prox_mu=prox_mu,
        max_steps=(steps or {}).get(i),
        groups=(groups or {}).get(i),
      )
    )
    weights.append(n)
  w = np.array(weights, np.float64) / np.sum(weights)
  return jax.tree.map(lambda *ps: sum(wi * pi for wi, pi in zip(w, ps)), *outs)


def run_rounds(alg, data, rounds=2, sampler=None, executor=None):
  """Runs ``rounds`` rounds (keys 0..rounds-1) from init key 0; all clients
  active unless a sampler is given. Returns (runner, state)."""
  from fedjax_personal.core.engine import RoundRunner
  from fedjax_personal.core.executors import VmapExecutor
  from fedjax_personal.core.sampling import CohortSampler

  sampler = sampler or CohortSampler(
    data.num_clients, cohort_size=data.num_clients
  )
  runner = RoundRunner(alg, data, sampler, executor or VmapExecutor())
  state = runner.init(jax.random.key(0))
  for t in range(rounds):
    state, _ = runner.round(state, jax.random.key(t), t)
  return runner, state


def max_diff(a, b):
  """Largest absolute difference between two pytrees."""
  return max(
    float(jnp.max(jnp.abs(x - y)))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


def parse_flags(*args):
  """Parses ``args`` as the run_experiment command line, from fresh flags
  (conftest.py resets them after every test)."""
  from absl import flags

  flags.FLAGS.unparse_flags()
  flags.FLAGS(['run_experiment'] + list(args))


#: Runs the main script's ``main`` on several command lines one after another
#: in one child process (flags reset between them): a Python start and a JAX
#: import once, not once per command. A string among them is Python run
#: between two commands (a file changed, say). Prints one JSON line of
#: [exit status, what went to stderr] per command.
_MAIN_DRIVER = r"""
import contextlib, io, json, sys
from absl import flags
from fedjax_personal.run import experiment_entry, faults, script_entry
out = []
for args in json.loads(sys.argv[1]):
  if isinstance(args, str):
    exec(args, {})
    continue
  flags.FLAGS.unparse_flags()
  faults._REPORTED['status'] = None  # each command line is a process of its own
  err = io.StringIO()
  code = 0
  with contextlib.redirect_stderr(err):
    try:
      experiment_entry.main(experiment_entry.parse_flags(['run_experiment.py', *args]))
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else 1
    except BaseException as e:
      import traceback
      code = 1
      traceback.print_exc()
  out.append([code, err.getvalue()[-3000:]])
print('MAIN RUNS ' + json.dumps(out))
"""


def main_in_one_process(command_lines, cwd=None, env=None):
  """[(exit status, stderr)] of ``scripts/run_experiment.py``'s ``main`` on
  each command line (a list of arguments; a string: Python run between
  two), run in one child process (``env``: variables added)."""
  import json
  import os
  import subprocess
  import sys

  r = subprocess.run(
    [sys.executable, '-c', _MAIN_DRIVER, json.dumps(command_lines)],
    cwd=cwd,
    capture_output=True,
    text=True,
    timeout=900,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu', **(env or {})},
  )
  line = [l for l in r.stdout.splitlines() if l.startswith('MAIN RUNS ')]
  assert line, r.stderr[-3000:]
  return [tuple(x) for x in json.loads(line[0][len('MAIN RUNS ') :])]


def host_runner(
  store,
  alg_name,
  training,
  sampler,
  rows_folder=None,
  adapter_dim=0,
  system=None,
  **settings,
):
  """A RoundRunner of ``alg_name`` (a small MLP, with residual adapters of
  ``adapter_dim``, vmapped; ``settings`` of the algorithm) on a population
  store in the host layout, clients in blocks of 5, client rows in memory or
  in files under ``rows_folder``."""
  import fedjax_personal as fp
  from fedjax_personal import algorithms
  from fedjax_personal.core.engine import RoundRunner
  from fedjax_personal.core.population.placement import HostData

  population = store.population()
  model = fp.models.from_flax(
    'mlp',
    fp.models.MLP(62, hidden=(8,), adapter_dim=adapter_dim),
    population.sample_x,
  )
  alg = algorithms.build(
    alg_name, model, population, training=training, **settings
  )
  executor = fp.create_executor('vmap', model, population.sample_x)
  return RoundRunner(
    alg,
    HostData(store, block=5, smallest=4, rows_folder=rows_folder),
    sampler,
    executor,
    system=system,
  )


def script_module(*relpath):
  """A script of this repository (e.g. ``benchmarks/peers/keras_reference.py``)
  loaded by path as a module: the tests use the functions a reference
  script recorded its arrays with."""
  import importlib.util
  import os

  path = os.path.join(os.path.dirname(__file__), '..', *relpath)
  spec = importlib.util.spec_from_file_location(
    os.path.basename(path)[:-3], path
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def torch_local_steps(torch, client, opt, x, y, idx, mask):
  """A PyTorch client's local SGD over the engine's batches (``idx``,
  ``mask``: ``batching.batch_indices``), each step on its real examples."""
  import numpy as np

  for s in range(idx.shape[0]):
    real = np.asarray(idx[s])[np.asarray(mask[s])]
    if real.size == 0:
      continue
    opt.zero_grad()
    torch.nn.functional.cross_entropy(client(x[real]), y[real]).backward()
    opt.step()
