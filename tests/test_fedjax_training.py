"""FedJAX's training-side API with ``fedjax`` replaced by
``fedjax_personal.fedjax`` and nothing else: FedJAX's example code
(``fed_avg.py`` and its test, ``stateful_fed_avg.py``, ``emnist_fed_avg.py`` at
a small size), its optimizers, metrics, tree utilities, models (the whole
zoo), evaluators, ``for_each_client``, every algorithm, the aggregators,
``training``'s experiment loop and serialization give what
FedJAX 0.0.17 gave (``tests/data/fedjax_training_reference.npz``, recorded
in FedJAX's venv by ``benchmarks/peers/fedjax_training_reference.py``),
under each ``for_each_client`` backend: FedJAX's debug, jit and pmap
ones and this project's vmap and threads ones.

Tolerance: integers, shapes and bytes exact; floats to 2e-5 relative (FedJAX
ran on JAX 0.4.30's XLA, this on the installed one: the same operations,
rounded by another compiler; the vmap backend batches them)."""

import os

import helpers
import jax
import jax.numpy as jnp
import made_files
import numpy as np
import pytest

import fedjax_personal.fedjax as fedjax

REFERENCE = os.path.join(
  os.path.dirname(__file__), 'data', 'fedjax_training_reference.npz'
)


def _cells():
  return helpers.script_module(
    'benchmarks', 'peers', 'fedjax_training_reference.py'
  )


#: Cells that never reach ``for_each_client``: run under the default
#: backend only (another backend would compute the same thing again).
BACKEND_FREE = (
  'optimizers',
  'tree_util',
  'metrics',
  'model_zoo',
  'aggregators',
)


#: The slowest cells (EMNIST's example and the Haiku models it builds, Mime,
#: AFL, HypCluster, the language models: about two thirds of the time), left
#: out of the CI variant; in CI the native algorithms' tests compare three
#: of them with FedJAX's, and docs/from_fedjax.md's script runs.
HEAVY = (
  'emnist_fed_avg',
  'haiku_models',
  'mime',
  'agnostic_fed_avg',
  'hyp_cluster',
  'model_zoo',
)


@pytest.mark.parametrize(
  'backend,cells',
  [
    ('jit', 'light'),
    ('jit', 'all'),
    ('debug', 'all'),
    ('pmap', 'all'),
    ('vmap', 'all'),
    ('threads', 'all'),
  ],
)
@pytest.mark.ci_variants('jit-light')
def test_fedjax_code_gives_fedjaxs_values(backend, cells):
  left_out = (HEAVY if cells == 'light' else ()) + (
    BACKEND_FREE if backend != 'jit' else ()
  )
  module = _cells()
  module.CELLS = [c for c in module.CELLS if c[0] not in left_out]
  # FedJAX 0.0.17's JAX drew random bits the non-partitionable way
  with (
    jax.threefry_partitionable(False),
    fedjax.for_each_client_backend(backend),
  ):
    ours = module.run_cells(fedjax)
  theirs = {
    k: v
    for k, v in np.load(REFERENCE).items()
    if k.split('/')[0] not in left_out
  }
  assert not [k for k in ours if k.endswith('/error')], {
    k: str(v) for k, v in ours.items() if k.endswith('/error')
  }
  assert sorted(ours) == sorted(theirs), sorted(set(ours) ^ set(theirs))
  for k, want in theirs.items():
    got = np.asarray(ours[k])
    assert got.shape == want.shape, (k, got.shape, want.shape)
    if want.dtype.kind in 'fc':
      np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6, err_msg=k)
    else:
      np.testing.assert_array_equal(got, want, err_msg=k)


def test_fed_avg_test_values_as_fedjax_asserts_them():
  """``examples/fed_avg_test.py``'s, ``fed_prox_test.py``'s,
  ``mime_test.py``'s and ``agnostic_fed_avg_test.py``'s own expected
  values."""
  want = dict(np.load(REFERENCE))
  np.testing.assert_allclose(
    want['fed_avg_example/params'], [0.0, 1.4425802, 2.8851604], rtol=1e-6
  )
  np.testing.assert_allclose(want['fed_avg_example/cid0_norm'], 1.7553135)
  np.testing.assert_allclose(want['fed_avg_example/cid1_norm'], 0.48310122)
  # fedjax/algorithms/fed_prox_test.py's
  np.testing.assert_allclose(want['fed_prox/w'], -3.77, rtol=1e-6)
  np.testing.assert_allclose(want['fed_prox/cid0_norm'], 6.95, rtol=1e-6)
  np.testing.assert_allclose(want['fed_prox/cid1_norm'], 9.0, rtol=1e-6)
  # fedjax/algorithms/agnostic_fed_avg_test.py's
  np.testing.assert_allclose(want['agnostic_fed_avg/w'], 3.5555556, rtol=1e-6)
  np.testing.assert_allclose(
    want['agnostic_fed_avg/domain_weights'],
    [0.08702461, 0.18604803, 0.2663479, 0.46057943],
    rtol=1e-6,
  )
  np.testing.assert_allclose(
    want['agnostic_fed_avg/norms/0'], 2.8333335, rtol=1e-6
  )
  np.testing.assert_allclose(
    want['agnostic_fed_avg/norms/1'], 7.666667, rtol=1e-6
  )
  # fedjax/algorithms/mime_test.py's
  np.testing.assert_allclose(want['mime/mime/w'], 2.08, rtol=1e-6)
  np.testing.assert_allclose(
    want['mime/mime/diagnostics/0/delta_l2_norm'], 12.0, rtol=1e-6
  )
  np.testing.assert_allclose(
    want['mime/mime/diagnostics/1/delta_l2_norm'], 6.0, rtol=1e-6
  )


def test_a_haiku_model_without_haiku_names_the_extra(monkeypatch):
  import importlib  # noqa: PLC0415

  real = importlib.import_module

  def no_haiku(name, *args):
    if name == 'haiku':
      raise ModuleNotFoundError("No module named 'haiku'")
    return real(name, *args)

  monkeypatch.setattr(importlib, 'import_module', no_haiku)
  with pytest.raises(ImportError) as e:
    fedjax.models.emnist.create_conv_model()
  message = str(e.value)
  assert '\n' not in message and 'fedjax_personal[fedjax]' in message
  # stax models need no Haiku
  assert fedjax.models.emnist.create_stax_dense_model().init is not None


def test_for_each_client_backends_by_name_and_a_misspelled_one():
  with fedjax.for_each_client_backend('vmap'):
    assert isinstance(
      fedjax.get_for_each_client_backend(),
      fedjax.core.for_each_client.ForEachClientVmapBackend,
    )
  assert isinstance(
    fedjax.get_for_each_client_backend(),
    fedjax.core.for_each_client.ForEachClientJitBackend,
  )
  with pytest.raises(
    ValueError, match="'vmapp'.*known: debug, jit, pmap, threads, vmap"
  ):
    fedjax.set_for_each_client_backend('vmapp')


def test_threads_backend_gives_the_jit_backends_values_in_order():
  """Clients of 0 to 5 batches (a smaller last one), run on 2 threads: the
  jit backend's outputs and step results bit for bit, in the clients'
  order, under the reading thread's JAX settings; a round read only in
  part leaves no client running."""

  def init(shared, client_input):
    return {'w': shared['w'] * client_input['scale'], 'n': 0.0}

  def step(state, batch):
    g = batch['x'].T @ (batch['x'] @ state['w'] - batch['y'])
    new = {'w': state['w'] - 0.1 * g / batch['y'].shape[0], 'n': state['n']}
    new['n'] = new['n'] + batch['y'].shape[0]
    return new, {'loss': jnp.mean(batch['y'] ** 2)}

  def final(shared, state):
    return jax.tree.map(lambda a, b: a - b, shared, {'w': state['w']})

  rng = np.random.RandomState(0)
  clients = []
  for i, n in enumerate([13, 0, 4, 40, 7, 25, 1, 18]):
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = rng.normal(size=n).astype(np.float32)
    batches = [{'x': x[s : s + 8], 'y': y[s : s + 8]} for s in range(0, n, 8)]
    clients.append((f'c{i}', batches, {'scale': np.float32(1 + i / 10)}))
  shared = {'w': np.ones(3, np.float32)}
  runs = {}
  for name in ('jit', 'threads'):
    with fedjax.for_each_client_backend(
      fedjax.core.for_each_client.ForEachClientThreadsBackend(threads=2)
      if name == 'threads'
      else name
    ):
      func = fedjax.for_each_client(init, step, final, with_step_result=True)
      runs[name] = jax.device_get(list(func(shared, clients)))
  assert [r[0] for r in runs['threads']] == [c[0] for c in clients]
  for a, b in zip(runs['jit'], runs['threads']):
    for x, y in zip(jax.tree.leaves(a[1:]), jax.tree.leaves(b[1:])):
      np.testing.assert_array_equal(x, y)
  with fedjax.for_each_client_backend('threads'):
    func = fedjax.for_each_client(init, step, final, with_step_result=True)
    partial = func(shared, clients)
    first = next(partial)
    partial.close()
  assert first[0] == 'c0'
  # the reading thread's JAX settings hold in the clients' threads (read
  # while tracing: the setting becomes the step result)
  setting = lambda s, b: (s, jnp.asarray(jax.threefry_partitionable.value))
  for value in (False, True):
    with (
      jax.threefry_partitionable(value),
      fedjax.for_each_client_backend('threads'),
    ):
      func = fedjax.for_each_client(init, setting, final, True)
      seen = [r for _, _, rs in func(shared, clients) for r in rs]
    assert seen and all(bool(r) == value for r in seen)


def test_fedjax_names_not_provided_or_misspelled_are_one_line():
  for ask, says in [
    (lambda: fedjax.aggregatorz, 'fedjax.aggregatorz is not a FedJAX'),
    (lambda: fedjax.algorithms.hyp_clustr, 'hyp_clustr is not a FedJAX'),
    (lambda: fedjax.models.shakespear, 'shakespear is not a FedJAX'),
    (lambda: fedjax.Modle, 'fedjax.Modle is not a FedJAX 0.0.17 name'),
  ]:
    with pytest.raises(AttributeError) as e:
      ask()
    assert says in str(e.value) and '\n' not in str(e.value)


def test_load_data_finds_fedjaxs_own_cache_folder(tmp_path, monkeypatch):
  """Without ``cache_dir``, FedJAX's files where FedJAX keeps them
  (``~/.cache/fedjax``) are found before anything is downloaded."""
  import pathlib  # noqa: PLC0415

  home = tmp_path / 'home'
  folder = home / '.cache' / 'fedjax'
  folder.mkdir(parents=True)
  made_files.fedjax_reference_files(pathlib.Path(folder))
  monkeypatch.setenv('HOME', str(home))
  monkeypatch.delenv('FEDJAX_PERSONAL_DATA', raising=False)
  monkeypatch.setenv('FEDJAX_PERSONAL_CACHE', str(tmp_path / 'own_cache'))
  train, test = fedjax.datasets.emnist.load_data()
  assert train.num_clients() == 4 and test.num_clients() == 4


def test_agnostic_fed_avg_without_a_window_runs():
  """FedJAX 0.0.17 fails its own default (``init_domain_window=None``:
  ``jnp.ones_like`` of a list); here it is ones, as FedJAX means."""
  afa = fedjax.algorithms.agnostic_fed_avg.agnostic_federated_averaging(
    lambda p, b, r: b['x'] * p['w'],
    fedjax.optimizers.sgd(1.0),
    fedjax.optimizers.sgd(1.0),
    fedjax.ShuffleRepeatBatchHParams(batch_size=2, seed=0),
    fedjax.PaddedBatchHParams(batch_size=2),
    [0.5, 0.5],
    0.1,
  )
  state = afa.init({'w': jax.numpy.array(1.0)})
  np.testing.assert_array_equal(state.domain_window[0], [1.0, 1.0])


def test_structured_flags_build_fedjaxs_objects():
  """``training.structured_flags`` define FedJAX's flags under a prefix
  and build its objects from them."""
  from absl import flags  # noqa: PLC0415

  sf = fedjax.training.structured_flags
  opt = sf.OptimizerFlags('sfx_server', default_optimizer='adam')
  batch = sf.ShuffleRepeatBatchHParamsFlags('sfx_client', 5)
  config = sf.FederatedExperimentConfigFlags('sfx')
  flags.FLAGS(
    [
      'prog',
      '--sfx_server_learning_rate=0.25',
      '--sfx_client_num_epochs=3',
      '--sfx_root_dir=/tmp/x',
      '--sfx_num_rounds=7',
    ],
    known_only=True,
  )
  state = opt.get().init({'w': jax.numpy.zeros(2)})
  assert jax.tree.leaves(state)  # Adam's moments
  assert batch.get() == fedjax.ShuffleRepeatBatchHParams(
    batch_size=5, num_epochs=3
  )
  got = config.get()
  assert (got.root_dir, got.num_rounds, got.eval_frequency) == ('/tmp/x', 7, 0)
  assert 'for sfx_server' in flags.FLAGS['sfx_server_learning_rate'].help


def test_get_task_reads_the_files_and_builds_fedjaxs_model(tmp_path):
  import pathlib  # noqa: PLC0415

  made_files.fedjax_reference_files(pathlib.Path(tmp_path))
  train, test, model = fedjax.training.get_task(
    'EMNIST_LOGISTIC', cache_dir=str(tmp_path)
  )
  assert train.num_clients() == 4 and test.num_clients() == 4
  params = model.init(jax.random.PRNGKey(0))
  assert params['linear']['w'].shape == (784, 62)
  with pytest.raises(ValueError, match="Unsupported task: 'EMNIST'"):
    fedjax.training.get_task('EMNIST', cache_dir=str(tmp_path))


def test_logger_writes_each_value_under_its_writer(tmp_path):
  logger = fedjax.training.Logger(str(tmp_path))
  logger.log('train', 'loss', np.float32(0.5), 3)
  logger.log('train', 'per_class', np.array([1.0, 2.0]), 3)
  rows = (tmp_path / 'train' / 'metrics.tsv').read_text().splitlines()
  assert rows == ['3\tloss\t0.5', '3\tper_class\t[1.0, 2.0]']


def test_walsh_hadamard_transform_takes_its_block_size():
  """FedJAX 0.0.17 traces ``small_n`` and fails when it is given; here it
  is static, and every block size gives H x."""
  import scipy.linalg  # noqa: PLC0415

  x = jax.numpy.arange(64.0)
  want = scipy.linalg.hadamard(64) @ np.arange(64.0)
  for small_n in (2, 4, 128):
    got = fedjax.aggregators.walsh_hadamard_transform(x, small_n=small_n)
    np.testing.assert_allclose(got, want)
