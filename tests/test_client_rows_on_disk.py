"""Client rows on disk (``core/population/rows_in_files.py``): the same numbers
as rows in host memory for every kind of client row, each row written only when
its client first trains, never-met clients costing no disk, evaluation of a
client never trained using the value its row would have."""

import jax
import made_files
import numpy as np
import pytest
from helpers import host_runner

from fedjax_personal.config import TrainingConfig
from fedjax_personal.core.population import rows_in_files
from fedjax_personal.core.sampling import CohortSampler
from fedjax_personal.datasets import DataConfig, load_store
from fedjax_personal.run.experiment import run


@pytest.fixture(scope='module')
def store(tmp_path_factory):
  folder = made_files.random_writers(
    tmp_path_factory.mktemp('emnist'), 5, 24, 30, 8
  )
  return load_store(
    DataConfig(
      dataset='emnist',
      partition='natural',
      num_clients=None,
      data_dir=str(folder),
    )
  )


def _run(store, alg_name, training, sampler, rows_folder):
  # FedAlt whose personal part is the adapters
  adapters = alg_name == 'fedalt_adapters'
  runner = host_runner(
    store,
    'fedalt' if adapters else alg_name,
    training,
    sampler,
    rows_folder,
    **({'adapter_dim': 4, 'personal_part': 'adapter'} if adapters else {}),
  )
  state, history = run(runner, 4, seed=3, eval_every=2)
  return runner, state, history


@pytest.mark.parametrize(
  'alg_name,participation,persistent',
  [
    ('ditto', None, False),  # personal models
    ('scaffold', 0.2, False),  # control variates
    ('feddyn', 0.2, False),  # FedDyn's gradients
    ('fedalt', None, False),  # personal parts (the output layer)
    ('fedalt_adapters', None, False),  # personal parts (residual adapters)
    ('local', None, True),  # persistent client momentum
  ],
)
@pytest.mark.ci_variants('ditto-None-False')
def test_rows_on_disk_equal_rows_in_memory(
  store, tmp_path, alg_name, participation, persistent
):
  n = store.num_clients
  sampler = (
    CohortSampler(n, participation=participation)
    if participation
    else CohortSampler(n, cohort_size=4)
  )
  training = TrainingConfig(
    client_lr=0.1,
    batch_size=8,
    **(
      {'client_opt_state': 'persistent', 'client_momentum': 0.5}
      if persistent
      else {}
    ),
  )
  _, s_mem, h_mem = _run(store, alg_name, training, sampler, None)
  runner, s_disk, h_disk = _run(
    store, alg_name, training, sampler, str(tmp_path / 'rows')
  )
  for a, b in zip(h_disk, h_mem):
    assert a.keys() == b.keys()
    for k in a:
      if k != 'round_seconds':
        np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-6, err_msg=k)
  every = np.arange(n)
  disk_leaves = jax.tree.leaves(s_disk.rows)
  assert all(isinstance(a, rows_in_files.DiskRows) for a in disk_leaves)
  for d, m in zip(disk_leaves, jax.tree.leaves(s_mem.rows)):
    # never-met rows: their init
    np.testing.assert_allclose(d[every], m, rtol=1e-6, atol=1e-6)
  # Written only for the clients that trained: those whose rows moved from
  # their initial value (the rows' maker gives it, from the run's own key).
  trained = np.zeros(n, bool)
  for d, m in zip(disk_leaves, jax.tree.leaves(s_mem.rows)):
    initial = d.maker(every, d.leaf)
    trained |= np.any((m != initial).reshape(n, -1), axis=1)
  made = disk_leaves[0].made
  assert all((d.made == made).all() for d in disk_leaves)
  np.testing.assert_array_equal(made, trained)
  assert 0 < made.sum() < n
  row_bytes = sum(a.row_bytes for a in disk_leaves)
  assert rows_in_files.disk_bytes(s_disk.rows) <= made.sum() * (
    row_bytes + 4096 * len(disk_leaves)
  )


def test_a_client_never_trained_is_evaluated_with_its_initial_row_and_costs_no_disk(
  store, tmp_path
):
  n = store.num_clients
  sampler = CohortSampler(n, cohort_size=2)
  runner, state, history = _run(
    store,
    'ditto',
    TrainingConfig(client_lr=0.1, batch_size=8),
    sampler,
    str(tmp_path / 'rows'),
  )
  leaves = jax.tree.leaves(state.rows)
  before = leaves[0].made.copy()
  # every client's personal model evaluated
  runner.evaluate(state, jax.random.key(0))
  assert (leaves[0].made == before).all() and before.sum() <= 8 < n
  never = np.flatnonzero(~before)
  disk_before = rows_in_files.disk_bytes(state.rows)
  for d in leaves:
    # a never-met client's row: its initial value, nothing written
    np.testing.assert_array_equal(d[never], d.maker(never, d.leaf))
  assert rows_in_files.disk_bytes(state.rows) == disk_before
  with pytest.raises(TypeError, match='read by index'):
    np.asarray(leaves[0])


@pytest.mark.slow
def test_cli_client_state_disk_equals_memory_and_auto_moves_rows_to_files(
  store, tmp_path, capsys, monkeypatch
):
  """--client_state=disk: the same summary as memory, rows in the output
  folder; auto picks files when the rows take more than half the available
  memory (the header says so); the device layout refused."""
  from helpers import parse_flags

  from fedjax_personal.core.population import placement
  from fedjax_personal.errors import ConfigError
  from fedjax_personal.run import experiment_entry

  data_dir = made_files.random_writers(tmp_path / 'data', 2, 10, 20, 6)
  common = (
    '--algorithm=ditto',
    '--dataset=emnist',
    f'--data_dir={data_dir}',
    '--model=logreg',
    '--cohort_size=3',
    '--rounds=2',
    '--eval_every=1',
    '--progress=false',
    '--layout=host',
  )
  summaries = {}
  for state in ('memory', 'disk'):
    parse_flags(
      *common, f'--client_state={state}', f'--output_dir={tmp_path}/{state}'
    )
    summaries[state] = experiment_entry.main_job()['ditto']
  out = capsys.readouterr().out
  assert (
    'in files, each written when its client first trains (asked for)' in out
  )
  strip = lambda s: {k: v for k, v in s.items() if 'seconds' not in k}
  assert strip(summaries['disk']) == strip(summaries['memory'])
  assert any((tmp_path / 'disk' / 'client_rows').iterdir())
  assert not (tmp_path / 'memory' / 'client_rows').exists()
  monkeypatch.setattr(placement, 'host_available_bytes', lambda: 1000)
  parse_flags(*common, f'--output_dir={tmp_path}/auto')
  assert strip(experiment_entry.main_job()['ditto']) == strip(
    summaries['memory']
  )
  assert 'more than half of the 0.0 GB available' in capsys.readouterr().out
  monkeypatch.undo()
  parse_flags(
    *common,
    '--client_state=disk',
    '--layout=device',
    f'--output_dir={tmp_path}/bad',
  )
  with pytest.raises(ConfigError, match='client_state'):
    experiment_entry.main_job()
