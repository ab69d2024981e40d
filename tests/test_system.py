"""Clients as devices (``core/system.py``): FedProx's stragglers
(arXiv 1812.06127, litian96/FedProx's ``fedavg.py`` / ``fedprox.py``) against
a per-client loop written from its code, on every executor and both layouts;
lost uploads leave a client's personal state as it was; no system, no
change."""

import chex
import jax
import jax.numpy as jnp
import made_files
import numpy as np
import pytest
from helpers import (
  digits_data,
  least_squares_data,
  linear_model,
  parse_flags,
  reference_fedavg,
  reference_sgd,
)

import fedjax_personal as fp
from fedjax_personal import algorithms
from fedjax_personal.config import TrainingConfig
from fedjax_personal.core import system as system_lib
from fedjax_personal.core.data import to_device
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.core.population.placement import HostData
from fedjax_personal.core.sampling import CohortSampler
from fedjax_personal.datasets import DataConfig, load_store
from fedjax_personal.errors import ConfigError
from fedjax_personal.run import experiment_entry
from fedjax_personal.run.experiment import run

EXECUTORS = {
  'vmap': lambda: fp.executors.VmapExecutor(),
  'blocked': lambda: fp.executors.BlockedExecutor(block_size=3),
  'blocked_threads': lambda: fp.executors.BlockedExecutor(
    block_size=1, num_threads=2
  ),
  'sequential': lambda: fp.executors.SequentialExecutor(num_threads=2),
}
EPOCHS = 4


@pytest.fixture(scope='module')
def digits():
  return digits_data(num_clients=8, max_examples=300)


def _mlp(data):
  return fp.models.from_flax(
    'mlp', fp.models.MLP(data.num_classes, hidden=(16,)), data.train.x[0, :1]
  )


def _drawn(config, sampler, round_key, alg_name, epochs=EPOCHS):
  """The engine's draws of a round (``fold_in(k_cohort, SYSTEM_DRAWS)``)."""
  k_cohort, k_clients = jax.random.split(round_key)
  cohort = sampler(k_cohort)
  rule = algorithms.REGISTRY[alg_name].partial_work
  drawn = system_lib.draw(
    config,
    jax.random.fold_in(k_cohort, system_lib.SYSTEM_DRAWS),
    cohort.mask,
    fp.Batching(10, num_epochs=epochs),
    rule,
  )
  return cohort, k_clients, jax.device_get(drawn)


def fedprox_code_round(
  model, params, data, cohort, k_clients, drawn, alg_name, lr, mu
):
  """One round as litian96/FedProx's trainers run it: FedAvg trains the
  active clients for E epochs and drops the stragglers; FedProx trains the
  stragglers for their drawn 1 .. E - 1 epochs and keeps them; the
  n_i-weighted mean of what arrives."""
  clients, steps = [], {}
  for slot, (i, m) in enumerate(
    zip(np.asarray(cohort.idx), np.asarray(cohort.mask))
  ):
    if not m or (drawn.straggler[slot] and alg_name == 'fedavg'):
      continue
    # randint(1, E)
    epochs = int(drawn.work_limit[slot]) if drawn.straggler[slot] else EPOCHS
    clients.append(i)
    steps[i] = epochs * -(-int(data.train.num_examples[i]) // 10)
  return reference_fedavg(
    model,
    params,
    data,
    clients,
    k_clients,
    fp.Batching(10, num_epochs=EPOCHS),
    lr,
    prox_mu=mu,
    steps=steps,
  )


@pytest.mark.parametrize('executor', sorted(EXECUTORS))
@pytest.mark.parametrize('alg_name', ['fedavg', 'fedprox'])
@pytest.mark.ci_variants('fedprox-blocked_threads')
def test_stragglers_follow_fedprox_code(digits, executor, alg_name):
  """Half the cohort are stragglers, the same ones for both algorithms:
  FedAvg drops them, FedProx (mu 1) keeps their partial epochs."""
  model, lr = _mlp(digits), 0.05
  mu = 1.0 if alg_name == 'fedprox' else 0.0
  training = TrainingConfig(client_lr=lr, batch_size=10, local_epochs=EPOCHS)
  alg = algorithms.build(
    alg_name,
    model,
    digits,
    training=training,
    **({'mu': mu} if alg_name == 'fedprox' else {}),
  )
  sampler = CohortSampler(8, cohort_size=6)
  config = system_lib.SystemConfig(stragglers=0.5)
  runner = RoundRunner(
    alg, digits, sampler, EXECUTORS[executor](), system=config
  )
  state = runner.init(jax.random.key(0))
  for t in range(2):
    key = jax.random.key(40 + t)
    cohort, k_clients, drawn = _drawn(config, sampler, key, alg_name)
    assert int(drawn.straggler.sum()) == 3
    # a dropped one does no work
    assert set(drawn.work_limit[drawn.straggler]) <= (
      set(range(1, EPOCHS)) if alg_name == 'fedprox' else {0}
    )
    want = fedprox_code_round(
      model, state.params, digits, cohort, k_clients, drawn, alg_name, lr, mu
    )
    state, metrics = runner.round(state, key, t)
    chex.assert_trees_all_close(state.params, want, atol=2e-5)
    assert int(metrics['stragglers']) == 3
    assert int(metrics['num_active']) == (6 if alg_name == 'fedprox' else 3)


@pytest.mark.slow
def test_no_stragglers_no_dropouts_change_nothing(digits):
  """A system of full, reliable devices is no system: the same state bit for
  bit."""
  model = _mlp(digits)
  training = TrainingConfig(client_lr=0.05, batch_size=10, local_epochs=2)
  sampler = CohortSampler(8, cohort_size=4)
  states = []
  for config in (None, system_lib.SystemConfig()):
    alg = algorithms.build('ditto', model, digits, training=training)
    state, _ = run(
      RoundRunner(
        alg, digits, sampler, fp.executors.VmapExecutor(), system=config
      ),
      2,
      seed=1,
      eval_every=2,
    )
    states.append(state)
  chex.assert_trees_all_equal(*states)


@pytest.mark.parametrize('alg_name', ['ditto', 'fedavg'])
def test_a_lost_upload_leaves_the_client_as_it_was(digits, alg_name):
  """Every upload lost: the global model and every personal model stay as
  they were; the round says so."""
  model = _mlp(digits)
  training = TrainingConfig(client_lr=0.05, batch_size=10)
  alg = algorithms.build(alg_name, model, digits, training=training)
  runner = RoundRunner(
    alg,
    digits,
    CohortSampler(8, cohort_size=4),
    fp.executors.VmapExecutor(),
    system=system_lib.SystemConfig(drop_after=0.999999),
  )
  state = runner.init(jax.random.key(0))
  after, metrics = runner.round(state, jax.random.key(5), 0)
  chex.assert_trees_all_close(after, state)
  assert int(metrics['uploads_lost']) == 4 and int(metrics['num_active']) == 0


def test_drops_are_drawn_per_client_and_kept_apart(digits):
  """Dropouts before training do no work; after, the work is done and
  lost; a straggler under 'drop' is lost and does no work either."""
  mask = jnp.ones(1000, bool)
  config = system_lib.SystemConfig(
    stragglers=0.3, drop_before=0.2, drop_after=0.1
  )
  d = jax.device_get(
    system_lib.draw(
      config, jax.random.key(1), mask, fp.Batching(10, num_epochs=5), 'keep'
    )
  )
  assert d.straggler.sum() == 300
  assert 0.25 < d.lost.mean() < 0.31  # 1 - 0.8 * 0.9
  assert set(d.work_limit[d.straggler & ~d.lost]) == {1, 2, 3, 4}
  d = jax.device_get(
    system_lib.draw(
      config, jax.random.key(1), mask, fp.Batching(10, num_epochs=5), 'drop'
    )
  )
  assert (d.work_limit[d.straggler] == 0).all() and d.lost[d.straggler].all()
  assert config.problems(fp.Batching(10, num_epochs=1))[0][0] == 'stragglers'
  assert not config.problems(fp.Batching(10, num_epochs=2))


def test_local_work_varies_as_fednova_draws_it():
  """local_work_min = 2 with E = 5: every client's epochs uniform in 2 .. 5,
  none lost, kept by every algorithm."""
  config = system_lib.SystemConfig(local_work_min=2)
  d = jax.device_get(
    system_lib.draw(
      config,
      jax.random.key(2),
      jnp.ones(4000, bool),
      fp.Batching(10, num_epochs=5),
      'drop',
    )
  )
  assert set(d.work_limit) == {2, 3, 4, 5} and not d.lost.any()
  assert abs(np.mean(d.work_limit) - 3.5) < 0.1
  assert (
    config.problems(fp.Batching(10, num_epochs=1))[0][0] == 'local_work_min'
  )


@pytest.fixture(scope='module')
def emnist_store(tmp_path_factory):
  folder = tmp_path_factory.mktemp('emnist')
  rng = np.random.default_rng(3)
  sizes = [int(v) for v in rng.integers(3, 40, 12)]
  made_files.write_emnist(
    folder, rng, sizes, [int(v) for v in rng.integers(1, 12, 12)]
  )
  return load_store(
    DataConfig(
      dataset='emnist',
      partition='natural',
      num_clients=None,
      data_dir=str(folder),
    )
  )


@pytest.mark.parametrize(
  'alg_name,executor',
  [
    ('fedprox', 'vmap'),
    ('ditto', 'vmap'),
    ('fedprox', 'sequential'),
    ('fedprox', 'blocked_threads'),
  ],
)
@pytest.mark.slow_variants(
  'ditto-vmap', 'fedprox-blocked_threads', 'fedprox-sequential', 'fedprox-vmap'
)
def test_host_layout_equals_device_layout_with_stragglers_and_dropouts(
  emnist_store, alg_name, executor
):
  """The same online clients, stragglers, deadline, partial work and lost
  uploads when the cohort's examples and rows are gathered from the host."""
  store = emnist_store
  population = store.population()
  model = fp.models.from_flax(
    'mlp', fp.models.MLP(62, hidden=(8,)), population.sample_x
  )
  training = TrainingConfig(client_lr=0.1, batch_size=8, local_epochs=3)
  config = system_lib.SystemConfig(
    stragglers=0.5, drop_after=0.2, availability=0.7, deadline=12.0
  )
  sampler = CohortSampler(12, cohort_size=6)
  out = []
  for data, pop in (
    (to_device(store.padded()), None),
    (HostData(store, block=4, smallest=4), population),
  ):
    alg = algorithms.build(alg_name, model, pop or data, training=training)
    runner = RoundRunner(
      alg, data, sampler, EXECUTORS[executor](), system=config
    )
    state, history = run(runner, 3, seed=2, eval_every=3)
    out.append(
      (runner.whole_state(state) if pop is not None else state, history)
    )
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
    out[1][0],
    out[0][0],
  )
  for a, b in zip(out[1][1], out[0][1]):
    for k in (
      'available',
      'stragglers',
      'uploads_lost',
      'num_active',
      'compute_time',
      'train_loss',
    ):
      if k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, err_msg=k)


def test_flags_reach_the_run_and_its_identity():
  """--stragglers / --drop_before / --drop_after are settings of the run,
  in its identity when given, refused where they cannot apply (1 local
  epoch)."""
  parse_flags('--algorithm=fedprox', '--stragglers=0.5', '--local_epochs=3')
  s = experiment_entry.read_flags()
  assert s.system == system_lib.SystemConfig(stragglers=0.5)
  assert s.identity('x')['system']['stragglers'] == 0.5
  parse_flags('--algorithm=fedprox')
  assert 'system' not in experiment_entry.read_flags().identity('x')
  parse_flags('--algorithm=fedprox', '--stragglers=0.5')
  with pytest.raises(ConfigError, match='stragglers'):
    experiment_entry.read_flags()


@pytest.mark.slow
def test_fednova_normalizes_the_epochs_each_client_drew():
  """local_work_min: each client's drawn epochs are the steps FedNova
  normalizes by (tau_i = E_i ceil(n_i / B)), by hand as its eq. 6."""
  data, _, _ = least_squares_data(num_clients=4, sizes=(5, 9, 13, 7))
  model, lr, b = linear_model(3), 0.02, 2
  alg = algorithms.build(
    'fednova', model, data, client_lr=lr, batch_size=b, local_epochs=4
  )
  sampler = CohortSampler(4, cohort_size=4)
  config = system_lib.SystemConfig(local_work_min=1)
  runner = RoundRunner(
    alg, data, sampler, fp.executors.VmapExecutor(), system=config
  )
  state = runner.init(jax.random.key(0))
  key = jax.random.key(7)
  cohort, k_clients, drawn = _drawn(config, sampler, key, 'fednova', epochs=4)
  theta, clients = state.params, []
  for slot, i in enumerate(np.asarray(cohort.idx)):
    n = int(data.train.num_examples[i])
    tau = int(drawn.work_limit[slot]) * -(-n // b)
    p = reference_sgd(
      model,
      theta,
      data.train.x[i],
      data.train.y[i],
      n,
      jax.random.fold_in(k_clients, int(i)),
      fp.Batching(b, num_epochs=4),
      lr,
      max_steps=tau,
    )
    clients.append((n, tau, p))
  assert len({c[1] // -(-c[0] // b) for c in clients}) > 1  # the epochs differ
  w = np.array([c[0] for c in clients], np.float64)
  w /= w.sum()
  tau_eff = sum(wi * c[1] for wi, c in zip(w, clients))
  want = jax.tree.map(
    lambda t, *ps: (
      t
      - tau_eff * sum(wi * (t - pi) / c[1] for wi, pi, c in zip(w, ps, clients))
    ),
    theta,
    *[c[2] for c in clients],
  )
  state, _ = runner.round(state, key, 0)
  chex.assert_trees_all_close(state.params, want, atol=1e-5)


@pytest.mark.slow
def test_cohorts_are_drawn_from_the_online_clients(digits, tmp_path):
  """--availability: each round's cohort holds online clients only, as many
  as are online at most; --availability_trace: round t reads row t mod T.
  Reported per round (``available``)."""
  sampler = CohortSampler(8, cohort_size=4)
  for t in range(20):
    online = jax.random.uniform(jax.random.key(t), (8,)) < 0.4
    cohort = jax.device_get(sampler(jax.random.key(100 + t), available=online))
    real = cohort.idx[cohort.mask]
    assert online[real].all() and len(real) == min(4, int(online.sum()))
  part = CohortSampler(8, participation=0.5)
  none = jax.device_get(part(jax.random.key(1), available=jnp.zeros(8, bool)))
  # nobody online: an empty cohort, not an endless redraw
  assert not none.mask.any()
  rows = np.array([[1, 1, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 0]])
  np.savetxt(tmp_path / 'trace.txt', rows, fmt='%d')
  model = _mlp(digits)
  alg = algorithms.build('fedavg', model, digits, client_lr=0.05, batch_size=10)
  config = system_lib.SystemConfig(
    availability_trace=str(tmp_path / 'trace.txt')
  )
  runner = RoundRunner(
    alg, digits, sampler, fp.executors.VmapExecutor(), system=config
  )
  state = runner.init(jax.random.key(0))
  for t in range(4):
    state, m = runner.round(state, jax.random.key(t), t)
    assert int(m['available']) == rows[t % 2].sum() == int(m['num_active'])
  with pytest.raises(system_lib.SettingError) as e:
    system_lib.prepare(config, 9)
  assert e.value.setting == 'availability_trace'


@pytest.mark.slow
def test_a_deadline_makes_slow_clients_stragglers(digits, tmp_path):
  """--client_speeds and --deadline: client i runs floor(D speed_i) steps;
  FedProx keeps what the late ones did (a per-client loop with those steps),
  FedAvg drops them; compute_time is the longest (steps / speed) that
  arrived."""
  speeds = np.array([1.0, 0.5, 2.0, 0.25, 1.0, 1.0, 0.1, 3.0])
  np.savetxt(tmp_path / 'speeds.txt', speeds)
  model, lr, epochs = _mlp(digits), 0.05, 2
  sampler = CohortSampler(8, cohort_size=8)
  config = system_lib.SystemConfig(
    client_speeds=str(tmp_path / 'speeds.txt'), deadline=30.0
  )
  n = np.asarray(digits.train.num_examples)
  full = epochs * -(-n // 10)
  cap = np.floor(30.0 * speeds).astype(int)
  assert (full > cap).any() and (full <= cap).any()
  batching = fp.Batching(10, num_epochs=epochs)
  for alg_name, mu in (('fedprox', 1.0), ('fedavg', 0.0)):
    alg = algorithms.build(
      alg_name,
      model,
      digits,
      client_lr=lr,
      batch_size=10,
      local_epochs=epochs,
      **({'mu': mu} if mu else {}),
    )
    runner = RoundRunner(
      alg, digits, sampler, fp.executors.VmapExecutor(), system=config
    )
    state = runner.init(jax.random.key(0))
    key = jax.random.key(3)
    _, k_clients = jax.random.split(key)
    arrive = [
      i for i in range(8) if not (full[i] > cap[i] and alg_name == 'fedavg')
    ]
    steps = {i: int(min(full[i], cap[i])) for i in arrive}
    times = [steps[i] / speeds[i] for i in arrive]
    want = reference_fedavg(
      model,
      state.params,
      digits,
      arrive,
      k_clients,
      batching,
      lr,
      prox_mu=mu,
      steps=steps,
    )
    state, m = runner.round(state, key, 0)
    chex.assert_trees_all_close(state.params, want, atol=2e-5)
    assert int(m['stragglers']) == int((full > cap).sum())
    np.testing.assert_allclose(float(m['compute_time']), max(times), rtol=1e-6)
    ran = (
      np.minimum(full, cap)
      if alg_name == 'fedprox'
      else np.where(full > cap, 0, full)
    )
    # the work done: a dropped late one none
    assert int(m['local_steps']) == int(ran.sum())
  with pytest.raises(system_lib.SettingError) as e:
    system_lib.prepare(config, 7)
  assert e.value.setting == 'client_speeds'


@pytest.mark.slow
def test_the_run_reports_its_devices(tmp_path):
  """The command: the header's line, each round's counts in metrics.jsonl,
  devices.png beside accuracy.png."""
  import json
  import os
  import subprocess
  import sys

  out = tmp_path / 'out'
  r = subprocess.run(
    [
      sys.executable,
      os.path.join(
        os.path.dirname(__file__), '..', 'scripts', 'run_experiment.py'
      ),
      '--algorithm=fedprox',
      '--rounds=2',
      '--eval_every=1',
      '--num_clients=8',
      '--local_epochs=2',
      '--stragglers=0.5',
      '--availability=0.9',
      '--plots=wait',
      f'--output_dir={out}',
    ],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert 'clients as devices: 50% of each cohort stragglers' in r.stdout
  rows = [json.loads(l) for l in open(out / 'fedprox' / 'metrics.jsonl')]
  assert all(
    {'stragglers', 'uploads_lost', 'available', 'compute_time', 'local_steps'}
    <= set(x)
    for x in rows
  )
  assert (out / 'devices.png').stat().st_size > 1000


@pytest.mark.slow
def test_rows_shuffled_in_groups_reach_every_client():
  """``row_groups`` (TFF's Shakespeare snippets): each client's batches are
  its rows shuffled in groups, as a per-client loop with the same groups."""
  from fedjax_personal.core import batching as batching_lib
  from fedjax_personal.core.data import FederatedData, pad_clients

  rng = np.random.default_rng(0)
  start = 7
  xs = []
  for n in (9, 5, 12):
    x = rng.integers(1, 7, (n, 3)).astype(np.int32)
    x[rng.random(n) < 0.4, 0] = start
    x[0, 0] = start
    xs.append(x)
  ys = [rng.integers(0, 8, x.shape).astype(np.int32) for x in xs]
  train = pad_clients(xs, ys, (3,), np.int32, (3,), np.int32)
  empty = pad_clients(
    [x[:0] for x in xs], [y[:0] for y in ys], (3,), np.int32, (3,), np.int32
  )
  data = to_device(
    FederatedData(
      train=train,
      val=empty,
      test=train,
      groups=-np.ones(3, np.int32),
      num_classes=8,
      name='rows',
    )
  )
  model = fp.models.from_flax(
    'lstm',
    fp.models.CharLSTM(8, embed_dim=4, hidden=5, num_layers=1),
    data.train.x[0, :1],
  )
  batching = fp.Batching(2, num_epochs=2)
  alg = algorithms.build(
    'fedavg', model, data, client_lr=0.1, batch_size=2, local_epochs=2
  )
  runner = RoundRunner(
    alg,
    data,
    CohortSampler(3, cohort_size=3),
    fp.executors.VmapExecutor(),
    row_groups=start,
  )
  state = runner.init(jax.random.key(0))
  key = jax.random.key(4)
  _, k_clients = jax.random.split(key)
  groups = {
    i: batching_lib.row_groups(jnp.asarray(data.train.x[i]), start)
    for i in range(3)
  }
  want = reference_fedavg(
    model, state.params, data, range(3), k_clients, batching, 0.1, groups=groups
  )
  grouped, _ = runner.round(state, key, 0)
  chex.assert_trees_all_close(grouped.params, want, atol=2e-5)
  plain = RoundRunner(
    alg, data, CohortSampler(3, cohort_size=3), fp.executors.VmapExecutor()
  )
  ungrouped = plain.round(state, key, 0)[0].params
  assert (
    max(
      float(jnp.abs(a - b).max())
      for a, b in zip(
        jax.tree.leaves(ungrouped), jax.tree.leaves(grouped.params)
      )
    )
    > 1e-6
  )
