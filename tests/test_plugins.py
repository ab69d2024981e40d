"""Extensions in the user's own files: the docs' two examples (a data set
from a file of arrays, docs/add_a_data_set.md; FedAvg weighted by gradient norm,
docs/add_an_algorithm.md) saved outside the package and run as printed
through ``--import`` with ``--sweep``; the algorithm's round against one
round by hand; a changed data file never served stale; ``--import``'s
faults one line each; a resume with a changed plugin refused."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import (
  least_squares_data,
  linear_model,
  main_in_one_process,
  max_diff,
  reference_sgd,
  run_rounds,
)
from test_docs import fenced

from fedjax_personal import algorithms
from fedjax_personal.core import batching as batching_lib
from fedjax_personal.run import plugins

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'scripts', 'run_experiment.py')


def _write_docs_files(folder):
  """The two examples, saved as a user saves them."""
  data_module = fenced('docs/add_a_data_set.md', 'python')[0]
  alg_module = fenced('docs/add_an_algorithm.md', 'python')[0]
  (folder / 'my_clients.py').write_text(data_module)
  (folder / 'fedavg_gradnorm.py').write_text(alg_module)
  assert len(alg_module.strip().splitlines()) <= 40
  assert 'register_arrays' in data_module and 'fedavg.variant' in alg_module


def _write_clients(path, seed):
  """my_clients.npz: four clients of 10-feature inputs, labels x[:, 0] > 0."""
  rng = np.random.default_rng(seed)
  out = {}
  for i, n in enumerate((30, 18, 44, 25)):
    x = rng.normal(size=(n, 10)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    cut = int(0.75 * n)
    c = f'client{i}'
    out.update(
      {
        f'x/{c}': x[:cut],
        f'y/{c}': y[:cut],
        f'test_x/{c}': x[cut:],
        f'test_y/{c}': y[cut:],
      }
    )
  np.savez(path, **out)


def _run(folder, *args):
  return subprocess.run(
    [sys.executable, SCRIPT, *args],
    capture_output=True,
    text=True,
    timeout=600,
    cwd=folder,
    env={
      **os.environ,
      'JAX_PLATFORMS': 'cpu',
      'FEDJAX_PERSONAL_CACHE': str(folder / 'cache'),
    },
  )


@pytest.mark.slow
def test_the_docs_extensions_run_from_the_users_files_and_data_is_never_stale(
  tmp_path,
):
  """Both files through --import, swept; then the arrays file changed in
  place: a new store, a new default output folder and new numbers; then a
  resume of the first run with the plugin changed is refused, naming it
  (the commands in one process, as a user's shell runs them one by one)."""
  _write_docs_files(tmp_path)
  _write_clients(tmp_path / 'my_clients.npz', seed=0)
  args = [
    '--import=my_clients.py',
    '--import=fedavg_gradnorm.py',
    '--dataset=my_clients',
    '--algorithm=fedavg,fedavg_gn',
    '--model=logreg',
    '--rounds=2',
    '--cohort_size=3',
    '--sweep=gn_power:0,2',
    '--progress=false',
    '--compilation_cache=off',
  ]
  change_data = (
    f'import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); '
    f'import test_plugins; '
    f'test_plugins._write_clients(__import__("pathlib").Path('
    f'{str(tmp_path / "my_clients.npz")!r}), seed=1)'
  )
  change_plugin = (
    f'open({str(tmp_path / "fedavg_gradnorm.py")!r}, "a").write("# changed\\n")'
  )
  first = tmp_path / 'first'
  got = main_in_one_process(
    [
      [*args, f'--output_dir={first}'],
      change_data,
      args,
      change_plugin,
      [*args, f'--output_dir={first}', '--resume_if_found'],
    ],
    cwd=tmp_path,
    env={'FEDJAX_PERSONAL_CACHE': str(tmp_path / 'cache')},
  )
  assert [code for code, _ in got] == [0, 0, 2], got
  sweep = json.load(open(first / 'sweep.json'))
  gn0, gn2 = (sweep[f'fedavg_gn seed=0 gn_power={p}'] for p in (0, 2))
  # a power FedAvg does not read: one row, not three copies
  fedavg = sweep['fedavg seed=0']
  assert not any(k.startswith('fedavg seed=0 gn_power') for k in sweep), sorted(
    sweep
  )
  numbers = lambda r: (r['train_loss'], r['loss_weighted'], r['accuracy_mean'])
  # 0: FedAvg
  assert numbers(gn0) == numbers(fedavg) and numbers(gn2) != numbers(fedavg)
  ident = json.load(open(first / 'fedavg_gn' / 'identity.json'))
  assert [spec for spec, _ in ident['imports']] == [
    'my_clients.py',
    'fedavg_gradnorm.py',
  ]
  # the changed file: a new store, and the default folder of the second run
  # another one's
  assert len(os.listdir(tmp_path / 'cache' / 'stores')) == 2
  (second,) = (tmp_path / 'runs').iterdir()
  assert (
    json.load(open(second / 'fedavg_gn' / 'identity.json'))['data_fingerprint']
    != ident['data_fingerprint']
  )
  again = json.load(open(second / 'sweep.json'))
  assert numbers(again['fedavg seed=0']) != numbers(fedavg)
  err = got[2][1]
  assert (
    'imports' in err
    and 'Traceback' not in err
    and len(err.strip().splitlines()) == 1
  ), err


@pytest.fixture()
def gradnorm(tmp_path, monkeypatch, algorithm_registry):
  """The docs' algorithm file, imported as --import imports it."""
  _write_docs_files(tmp_path)
  monkeypatch.delitem(sys.modules, 'fedavg_gradnorm', raising=False)
  plugins.load(str(tmp_path / 'fedavg_gradnorm.py'))
  yield
  sys.modules.pop('fedavg_gradnorm', None)


@pytest.mark.parametrize('power', [0.0, 2.0])
def test_fedavg_weighted_by_gradient_norm_by_hand(gradnorm, power):
  """One round: each client's SGD redone by a plain loop on the engine's
  batches, then theta - sum_i w_i delta_i / sum_i w_i with
  w_i = n_i ||delta_i||^power; bytes up are the deltas'."""
  sizes, lr, batch = (5, 9, 3, 7), 0.05, 2
  data, _, _ = least_squares_data(num_clients=len(sizes), sizes=sizes)
  model = linear_model(3)
  alg = algorithms.build(
    'fedavg_gn', model, data, client_lr=lr, batch_size=batch, gn_power=power
  )
  theta = alg.init(jax.random.key(0)).params
  runner, state = run_rounds(alg, data, rounds=1)
  _, k_clients = jax.random.split(jax.random.key(0))
  deltas, weights = [], []
  for i, n in enumerate(sizes):
    p = reference_sgd(
      model,
      theta,
      data.train.x[i],
      data.train.y[i],
      n,
      jax.random.fold_in(k_clients, i),
      batching_lib.Batching(batch, num_epochs=1),
      lr,
    )
    d = jax.tree.map(lambda a, b: np.float64(a) - np.float64(b), theta, p)
    norm = np.sqrt(sum(float(np.sum(np.square(v))) for v in jax.tree.leaves(d)))
    deltas.append(d)
    weights.append(n * norm**power)
  w = np.array(weights) / np.sum(weights)
  want = jax.tree.map(
    lambda t, *ds: t - sum(wi * di for wi, di in zip(w, ds)), theta, *deltas
  )
  assert max_diff(state.params, want) < 1e-6
  _, metrics = runner.round(state, jax.random.key(1), 1)
  param_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(theta))
  assert float(metrics['bytes_up']) == len(sizes) * param_bytes


def test_an_extra_upload_is_averaged_with_the_weights_and_counted(gradnorm):
  """``variant(extra=...)``: a second per-client quantity reaches
  ``server`` as its weighted mean, and its bytes are counted up."""
  import optax

  from fedjax_personal.algorithms import fedavg
  from fedjax_personal.config import TrainingConfig

  sizes = (5, 9, 3, 7)
  data, _, _ = least_squares_data(num_clients=len(sizes), sizes=sizes)
  model = linear_model(3)
  seen = {}

  def server(mean_delta, mean_extra, state):
    jax.debug.callback(lambda v: seen.update(extra=float(v)), mean_extra['n2'])
    return jax.tree.map(lambda d: d * 0, mean_delta)  # the model stays put

  alg = fedavg.variant(
    model,
    data,
    TrainingConfig(client_lr=0.05, batch_size=2),
    extra=lambda ctx, out: {
      'n2': out.num_examples.astype(np.float32) ** 2,
      'norm': optax.global_norm(out.delta),
    },
    server=server,
  )
  theta = alg.init(jax.random.key(0)).params
  runner, state = run_rounds(alg, data, rounds=1)
  assert max_diff(state.params, theta) < 1e-6
  n = np.array(sizes, np.float64)
  assert seen['extra'] == pytest.approx(np.sum(n * n**2) / np.sum(n), rel=1e-6)
  _, metrics = runner.round(state, jax.random.key(1), 1)
  param_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(theta))
  assert float(metrics['bytes_up']) == len(sizes) * (param_bytes + 8)


@pytest.mark.slow
def test_import_faults_are_one_line(tmp_path):
  (tmp_path / 'broken.py').write_text('import numpy\n\nx = 1 / 0\n')
  for spec, says in (
    ('missing.py', '--import: missing.py: no such file'),
    ('no_such_module', '--import: no_such_module: no such module here'),
    ('broken.py', 'broken.py failed at '),
  ):
    r = _run(tmp_path, f'--import={spec}', '--dry_run')
    assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr[-2000:]
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith('error: ') and says in line, line
  assert 'broken.py:3: ZeroDivisionError' in line


def test_a_plugin_named_as_another_module_never_replaces_it(tmp_path):
  (tmp_path / 'json.py').write_text('VALUE = 7\n')
  module = plugins.load(str(tmp_path / 'json.py'))
  assert (
    module.VALUE == 7 and json.dumps({}) == '{}' and sys.modules['json'] is json
  )
  assert plugins.load(str(tmp_path / 'json.py')) is module  # imported once


def test_imports_are_found_in_flagfiles_too(tmp_path, monkeypatch):
  (tmp_path / 'a.flags').write_text(
    '# mine\n--import=one.py\n--flagfile=b.flags\n'
  )
  (tmp_path / 'b.flags').write_text('--import=two\n')
  monkeypatch.chdir(tmp_path)
  assert plugins.imports_in(
    ['x', '--flagfile=a.flags', '--import=three.py', '--import', 'one.py']
  ) == ['one.py', 'two', 'three.py']


def test_arrays_in_one_call_and_fedjaxs_in_memory_object(monkeypatch):
  """register_arrays without test: each client's examples split with
  --test_fraction in memory (nothing stored); InMemoryFederatedData is
  FedJAX's object over the same dict (ids sorted, sizes, subset, .store)."""
  from fedjax_personal.datasets import (
    DataConfig,
    federated_data,
    load_federated,
    registry,
  )

  monkeypatch.setattr(registry, 'LOADERS', dict(registry.LOADERS))
  monkeypatch.setattr(registry, 'OPTIONS', dict(registry.OPTIONS))
  rng = np.random.default_rng(0)
  clients = {
    c: {
      'x': rng.normal(size=(n, 4)).astype(np.float32),
      'y': rng.integers(0, 3, n).astype(np.int32),
    }
    for c, n in (('bob', 10), ('alice', 20), ('carol', 8))
  }
  registry.register_arrays('three_clients', clients)
  data = load_federated(
    DataConfig(
      dataset='three_clients',
      partition='natural',
      num_clients=None,
      test_fraction=0.25,
    )
  )
  assert data.num_clients == 3 and data.num_classes == 3
  got = sorted(
    int(a) + int(b)
    for a, b in zip(data.train.num_examples, data.test.num_examples)
  )
  assert got == [8, 10, 20] and int(np.sum(data.test.num_examples)) > 0
  fd = federated_data.InMemoryFederatedData(clients)
  assert list(fd.client_ids()) == ['alice', 'bob', 'carol']
  assert list(fd.client_sizes()) == [('alice', 20), ('bob', 10), ('carol', 8)]
  assert list(fd.subset(['carol', 'alice']).client_ids()) == ['alice', 'carol']
  store = fd.subset(['carol', 'bob']).store
  assert store.client_ids == ['bob', 'carol'] and store.num_classes == 3
  np.testing.assert_array_equal(
    store.client('carol')['train'][0], clients['carol']['x']
  )
  with pytest.raises(Exception, match='broken: its clients must be'):
    registry.register_arrays('broken', {'a': {'x': np.zeros(3)}})
    load_federated(
      DataConfig(dataset='broken', partition='natural', num_clients=None)
    )
