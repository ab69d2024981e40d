"""Client rows that an algorithm declares as its clients' output
(``ClientRows.output``: Ditto's, pFedMe's, APFL's and Local's personal models)
are written by the engine; the fused blocked loop reads and writes them in one
buffer. Its rounds equal the same loop writing them after it and the vmap
executor's, every row included, and its compiled round holds no buffer of the
cohort's new rows. Rows gathered from the host come in buffers of their own,
which a round's donation writes in place."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import digits_data, max_diff

import fedjax_personal as fp
from fedjax_personal.algorithms.apfl import apfl
from fedjax_personal.algorithms.ditto import ditto
from fedjax_personal.algorithms.local import local
from fedjax_personal.algorithms.pfedme import pfedme
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.core.executors import BlockedExecutor, VmapExecutor
from fedjax_personal.core.population import rows_in_files, rows_in_memory
from fedjax_personal.core.sampling import CohortSampler

N = 8


@pytest.fixture(scope='module')
def digits():
  return digits_data(num_clients=N, max_examples=200)


def mlp(data, hidden=(8,)):
  return fp.models.from_flax(
    'mlp', fp.models.MLP(data.num_classes, hidden=hidden), data.train.x[0, :1]
  )


BUILDERS = {
  'ditto': lambda m: ditto(m, N, optax.sgd(0.1), fp.Batching(16, 1), lam=0.5),
  'pfedme': lambda m: pfedme(
    m, N, optax.sgd(0.1), fp.Batching(16, 1), inner_steps=2
  ),
  'apfl': lambda m: apfl(m, N, optax.sgd(0.1), fp.Batching(16, 1), alpha=0.3),
  'local': lambda m: local(m, N, optax.sgd(0.1), fp.Batching(16, 1)),
}


def stacked_writer(block_size):
  """The fused blocked loop, new rows stacked and written after it."""
  ex = BlockedExecutor(block_size=block_size)
  ex.writes_rows = False
  return ex


def rounds(alg, data, executor, num_rounds=3, cohort=5):
  runner = RoundRunner(
    alg, data, CohortSampler(N, cohort_size=cohort), executor
  )
  state = runner.init(jax.random.key(0))
  for t in range(num_rounds):
    state, _ = runner.round(state, jax.random.key(t), t, donate=True)
  return state


@pytest.mark.parametrize('name', sorted(BUILDERS))
@pytest.mark.ci_variants('ditto')
def test_rows_in_place_equal_rows_written_after(digits, name):
  alg = BUILDERS[name](mlp(digits))
  assert alg.client_rows.output is not None
  in_place = rounds(alg, digits, BlockedExecutor(block_size=2))
  after = rounds(alg, digits, stacked_writer(2))
  vmapped = rounds(alg, digits, VmapExecutor())
  # Blocks of 2 over cohorts of 5 of clients with uneven work: a padded slot
  # writes nothing, each client reads its own row before its block writes it.
  assert max_diff(in_place, after) == 0.0
  assert max_diff(in_place, vmapped) < 1e-6
  # Three cohorts of 5 of 8 clients leave some client never sampled: its
  # personal model is still the first global model.
  start = alg.client_rows.get(alg.init(jax.random.key(0)))
  untouched = [
    i
    for i in range(N)
    if max_diff(
      jax.tree.map(lambda a: a[i], alg.client_rows.get(in_place)),
      jax.tree.map(lambda a: a[i], start),
    )
    == 0.0
  ]
  trained = [i for i in range(N) if i not in untouched]
  assert trained and len(trained) >= 5


@pytest.mark.slow
def test_fused_round_holds_no_buffer_of_the_cohorts_new_rows(digits):
  model = mlp(digits, hidden=(256, 256))
  alg = BUILDERS['ditto'](model)
  cohort = 8
  sampler = CohortSampler(N, cohort_size=cohort)
  temp = {}
  for name, ex in (
    ('in_place', BlockedExecutor(block_size=1)),
    ('after', stacked_writer(1)),
  ):
    runner = RoundRunner(alg, digits, sampler, ex)
    state = runner.init(jax.random.key(0))
    temp[name] = (
      runner.compiled(state, jax.random.key(0))
      .memory_analysis()
      .temp_size_in_bytes
    )
  row_bytes = sum(
    a.nbytes for a in jax.tree.leaves(model.init(jax.random.key(0)))
  )
  # The stacked form holds the cohort's new personal models once more.
  assert temp['after'] - temp['in_place'] >= 0.9 * cohort * row_bytes, (
    temp,
    row_bytes,
  )


@pytest.mark.slow
def test_broadcast_of_other_rows_is_not_written_in_place(digits):
  """Rows the broadcast transforms are no buffer to read in place: the
  engine falls back to writing the outputs after the loop."""
  model = mlp(digits)
  alg = BUILDERS['ditto'](model)
  from fedjax_personal.core import tree_util

  def broadcast(s, c, rc):  # each client starts from half its personal model
    return s.params, tree_util.rows(
      jax.tree.map(lambda a: a * 0.5, s.personal), c.rows
    )

  halved = alg.replace(server_broadcast=broadcast)
  in_place = rounds(halved, digits, BlockedExecutor(block_size=2), num_rounds=2)
  vmapped = rounds(halved, digits, VmapExecutor(), num_rounds=2)
  assert max_diff(in_place, vmapped) < 1e-6
  assert (
    max_diff(in_place, rounds(alg, digits, VmapExecutor(), num_rounds=2)) > 1e-3
  )
  np.testing.assert_equal(
    jax.tree.structure(in_place), jax.tree.structure(vmapped)
  )


# slow: 17 s on CI's 2 cores; CI keeps tests/test_config.py's
# test_persistent_optimizer_state_is_kept_per_client
@pytest.mark.slow
def test_persistent_client_optimizer_writes_the_inner_rows(digits):
  """Wrapped with persistent client optimizer states (rows of their own),
  Ditto's personal models are written by the wrapper's server update: they
  train, the same under blocks and vmap."""
  from fedjax_personal.core.client_state import persistent_client_optimizer

  model = mlp(digits)
  alg = persistent_client_optimizer(
    ditto(model, N, optax.sgd(0.1, momentum=0.9), fp.Batching(16, 1)), N
  )
  blocked = rounds(alg, digits, BlockedExecutor(block_size=2), num_rounds=2)
  vmapped = rounds(alg, digits, VmapExecutor(), num_rounds=2)
  assert max_diff(blocked, vmapped) < 1e-6
  start = alg.init(jax.random.key(0))
  assert max_diff(blocked.inner.personal, start.inner.personal) > 1e-3
  assert max_diff(blocked.opt_state, start.opt_state) > 1e-3


@pytest.mark.parametrize(
  'where', ['memory, mapped gather', 'memory, small', 'files']
)
def test_gathered_rows_are_donated_in_place(tmp_path, where):
  """``gather_rows`` gives the rows' values in device buffers that share no
  host memory: a donated round writes its output into them (an array that
  shared a host buffer made the round allocate another)."""
  width = (
    rows_in_memory.MAPPED_GATHER_BYTES // (4 * 8) + 16
    if 'mapped' in where
    else 24
  )
  values = np.arange(40 * width, dtype=np.float32).reshape(40, width)
  idx = np.array([7, 39, 50, 0, 7, 3, 12, 8])  # 50: a padded slot, clipped
  if where == 'files':
    # the state is the rows
    whole = types.SimpleNamespace(get=lambda state: state)
    maker = rows_in_files.RowMaker(
      lambda k: {'w': jnp.asarray(values)}, whole, jax.random.PRNGKey(0)
    )
    leaf = rows_in_files.DiskRows(
      tmp_path / 'w.rows', values.shape, values.dtype, maker, 0
    )
    leaf[np.array([3, 7])] = values[[3, 7]] + 1  # written rows beside made ones
    expected = (
      values[np.minimum(idx, 39)]
      + np.isin(np.minimum(idx, 39), [3, 7])[:, None]
    )
  else:
    leaf, expected = values, values[np.minimum(idx, 39)]
  gathered = rows_in_memory.gather_rows({'w': leaf, 'n': np.arange(40)}, idx)
  np.testing.assert_array_equal(np.asarray(gathered['w']), expected)
  np.testing.assert_array_equal(np.asarray(gathered['n']), np.minimum(idx, 39))
  where_in = gathered['w'].unsafe_buffer_pointer()
  out = jax.jit(lambda r: r * 2, donate_argnums=0)(gathered['w'])
  assert out.unsafe_buffer_pointer() == where_in
  np.testing.assert_array_equal(np.asarray(out), 2 * expected)
