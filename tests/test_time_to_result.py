"""What an experiment costs besides its rounds: the persistent compilation
cache (the same numbers with it, without it, from damaged entries and with an
unusable folder, each fault one line), the
host layout's shape plan (never more compiles than it planned), the time
figures of summary.json."""

import json
import os

import jax
import numpy as np
import pytest
from helpers import main_in_one_process

import fedjax_personal as fp
from fedjax_personal import algorithms, compilation
from fedjax_personal.config import TrainingConfig
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.core.population.placement import HostData, ShapePlan
from fedjax_personal.core.population.store import StoreWriter
from fedjax_personal.core.sampling import CohortSampler
from fedjax_personal.core.training import LossStats


def _metrics(folder):
  with open(os.path.join(folder, 'fedavg', 'metrics.jsonl')) as f:
    return [
      {k: v for k, v in json.loads(line).items() if 'seconds' not in k}
      for line in f
    ]


@pytest.mark.slow
def test_cache_gives_the_same_numbers_and_damaged_entries_are_compiled_again(
  tmp_path,
):
  cache = tmp_path / 'xla'
  common = [
    '--algorithm=fedavg',
    '--model=logreg',
    '--num_clients=6',
    '--rounds=2',
    '--eval_every=1',
    '--noprogress',
  ]
  got = main_in_one_process(
    [
      common + ['--compilation_cache=off', f'--output_dir={tmp_path}/off'],
      common
      + [f'--compilation_cache={cache}', f'--output_dir={tmp_path}/cold'],
      common
      + [f'--compilation_cache={cache}', f'--output_dir={tmp_path}/warm'],
    ]
  )
  assert [code for code, _ in got] == [0, 0, 0], got
  entries = [e for e in os.listdir(cache) if not e.endswith('-atime')]
  assert entries
  for name in entries:  # every entry damaged in its middle
    path = cache / name
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 32] = bytes(
      b ^ 0xFF for b in data[middle : middle + 32]
    )
    path.write_bytes(bytes(data))
  (tmp_path / 'a_file').write_text('')
  got = main_in_one_process(
    [
      common
      + [f'--compilation_cache={cache}', f'--output_dir={tmp_path}/damaged'],
      common
      + [
        f'--compilation_cache={tmp_path}/a_file/xla',
        f'--output_dir={tmp_path}/unusable',
      ],
    ]
  )
  assert [code for code, _ in got] == [0, 0], got
  # JAX's warning per damaged entry: one line instead
  (said,) = [l for l in got[0][1].splitlines() if l.strip()]
  assert said.startswith(
    f'compilation cache: {cache}: entries cannot be read'
  ), said
  (said,) = [l for l in got[1][1].splitlines() if l.strip()]
  assert said.startswith(
    f'compilation cache: {tmp_path}/a_file/xla cannot be written'
  ), said
  off = _metrics(tmp_path / 'off')
  for run in ('cold', 'warm', 'damaged', 'unusable'):
    assert _metrics(tmp_path / run) == off, run
  summary = json.load(open(tmp_path / 'warm' / 'fedavg' / 'summary.json'))
  for key in (
    'first_round_seconds',
    'compile_seconds',
    'wall_seconds',
    'process_seconds',
  ):
    assert summary[key] >= 0, key
  assert summary['compiled_shapes'] == 1  # the device layout: one round program
  assert summary['process_seconds'] >= summary['wall_seconds']


def test_the_cache_is_trimmed_to_its_bound_least_recently_used_first(tmp_path):
  for i in range(10):
    path = tmp_path / f'entry{i}-cache'
    path.write_bytes(b'x' * 1000)
    os.utime(path, (1_000_000 + i, 1_000_000 + i))  # entry0 used longest ago
  assert compilation.trim(str(tmp_path), max_bytes=20_000) == 0
  # down to 6,000
  assert compilation.trim(str(tmp_path), max_bytes=8_000) == 4_000
  assert sorted(os.listdir(tmp_path)) == [
    f'entry{i}-cache' for i in range(4, 10)
  ]


def _heavy_tailed_store(folder, n=40, seed=0):
  """Writers with 1-300 examples, log-normally (EMNIST's long tail)."""
  rng = np.random.default_rng(seed)
  sizes = np.clip(rng.lognormal(3.5, 1.0, n).astype(int), 1, 300)
  writer = StoreWriter(
    str(folder), {'made': 'heavy-tailed', 'n': n, 'seed': seed}
  )
  for k in sizes:
    x = rng.random((int(k), 4, 4, 1), dtype=np.float32)
    y = rng.integers(0, 5, int(k)).astype(np.int16)
    writer.add((x, y), None, (x[:1], y[:1]))
  return writer.close('heavy-tailed', 5), sizes


@pytest.mark.slow
def test_the_shape_plan_compiles_no_more_than_its_count(tmp_path):
  """30 rounds of cohorts of 4 drawn from a heavy tail: the round is
  compiled at most the plan's count of times (once per planned shape met),
  where cohorts packed in their own shapes compiled it a shape at a time as
  larger cohorts came."""
  store, sizes = _heavy_tailed_store(tmp_path / 'store')
  population = store.population()
  model = fp.models.from_flax(
    'mlp', fp.models.MLP(5, hidden=(8,)), population.sample_x
  )
  alg = algorithms.build(
    'fedavg', model, population, training=TrainingConfig(batch_size=8)
  )
  host = HostData(store, smallest=4)
  plan = ShapePlan.for_cohorts(host, 4)
  assert plan.windows['train'] == sizes.max() and plan.count <= 2
  top = int(np.sort(sizes)[::-1][:4].sum()) + int(sizes.max())
  assert plan.rows['train'][-1] >= top  # any cohort fits the largest bucket
  runner = RoundRunner(
    alg,
    host,
    CohortSampler(len(sizes), cohort_size=4),
    fp.executors.VmapExecutor(),
  )
  assert runner.feed.plan == plan
  state = runner.init(jax.random.key(0))
  for t in range(30):
    state, _ = runner.round(state, jax.random.key(t), t, donate=True)
  assert runner.trace_counts['round'] == len(runner.feed.shapes) <= plan.count
  assert {s[1] for s in runner.feed.shapes} == {plan.windows['train']}


def _history(accs):
  return [
    {
      'round': r + 1,
      'accuracy_mean': a,
      'accuracy_worst': a / 2,
      'per_client_accuracy': [a, None, a / 2],
    }
    for r, a in enumerate(accs)
  ]


def test_plots_drawn_in_the_background_equal_those_drawn_in_process(tmp_path):
  """--plots=background: a child process, started with the histories on its
  stdin, draws the same files after the run has gone on (or exited)."""
  from fedjax_personal.run import plots

  hists = {'fedavg': _history([0.1, 0.5]), 'local': _history([0.2, 0.3])}
  assert plots.draw('runs', hists, str(tmp_path / 'here'), 'wait') is None
  child = plots.draw('runs', hists, str(tmp_path / 'there'), 'background')
  assert child.wait(timeout=120) == 0
  for name in ('accuracy.png', 'client_accuracy_hist.png'):
    assert (tmp_path / 'there' / name).read_bytes() == (
      tmp_path / 'here' / name
    ).read_bytes()
  assert plots.draw('runs', hists, str(tmp_path / 'none'), 'off') is None
  assert not (tmp_path / 'none').exists()


def test_plots_that_fail_in_the_background_say_so_in_one_line(tmp_path):
  import subprocess
  import sys

  from fedjax_personal.run import plots

  (tmp_path / 'file').write_text('not a folder')
  payload = json.dumps(
    {
      'kind': 'runs',
      'histories': {'a': _history([0.1])},
      'directory': str(tmp_path / 'file'),
    }
  )
  r = subprocess.run(
    [sys.executable, plots.__file__],
    input=payload,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 1
  assert (
    r.stderr.count('\n') == 1
    and 'were not drawn' in r.stderr
    and 'Traceback' not in r.stderr
  )


def _pooled_store(tmp_path, tests, shape):
  """A store of len(tests) clients of 4 training images and ``tests[i]`` test
  images of ``shape`` (5 classes)."""
  rng = np.random.default_rng(1)
  writer = StoreWriter(
    str(tmp_path / 'store'), {'made': 'pooled', 'n': len(tests)}
  )
  for k in tests:
    x = rng.random((int(k) + 4,) + shape, dtype=np.float32)
    y = rng.integers(0, 5, int(k) + 4).astype(np.int16)
    writer.add((x[:4], y[:4]), None, (x[4:], y[4:]))
  return writer.close('pooled', 5)


def _assert_pooled_as_client_by_client(store, tests, model, got, params, rtol):
  from fedjax_personal.core.data import ClientData
  from fedjax_personal.core.training import evaluate_params

  x_all, y_all, _ = store.arrays['test']
  for i, (start, n) in enumerate(zip(store.offsets['test'], tests)):
    data = ClientData(
      x=np.asarray(x_all[start : start + n]),
      y=np.asarray(y_all[start : start + n]).astype(np.int32),
      num_examples=np.int32(n),
    )
    want = evaluate_params(model, params, data) if n else None
    for field, value in zip(LossStats._fields, got):
      if want is None or field == 'correct_top_k':
        assert value[i] == 0 or np.isnan(value[i]), (i, field)
      else:
        np.testing.assert_allclose(
          value[i], getattr(want, field), rtol=rtol, err_msg=field
        )


@pytest.mark.slow
def test_a_global_model_is_evaluated_on_the_pooled_test_examples_as_client_by_client(
  tmp_path, monkeypatch
):
  """The host layout evaluates one model for every client on the store's
  test rows pooled in chunks (clients straddling chunks, clients without a
  test example): each client's statistics equal ``evaluate_params`` on its
  own examples."""
  from fedjax_personal.core import evaluation

  tests = np.array([0, 3, 17, 1, 0, 9, 25, 2, 8, 5])
  store = _pooled_store(tmp_path, tests, (4, 4, 1))
  population = store.population()
  model = fp.models.from_flax(
    'mlp', fp.models.MLP(5, hidden=(8,)), population.sample_x
  )
  alg = algorithms.build(
    'fedavg', model, population, training=TrainingConfig(batch_size=4)
  )
  # chunks of 8 rows (156 bytes a row)
  monkeypatch.setattr(evaluation, 'POOLED_CHUNK_BYTES', 1300)
  params = jax.tree.map(
    lambda a: a[0], alg.client_models(alg.init(jax.random.key(0))).params
  )
  got = evaluation.pooled_evaluation(alg, store)(params)
  _assert_pooled_as_client_by_client(
    store, tests, model, got, params, rtol=1e-6
  )
  runner = RoundRunner(
    alg,
    HostData(store, smallest=4),
    CohortSampler(len(tests), cohort_size=4),
    fp.executors.VmapExecutor(),
  )
  state = runner.init(jax.random.key(0))
  np.testing.assert_allclose(
    runner.evaluate(state, jax.random.key(1)).correct, got.correct
  )
  assert (
    evaluation.pooled_evaluation(
      alg, store.subset(store.client_ids[::2], 'half')
    )
    is None
  )


@pytest.mark.slow
def test_a_convolutional_model_pooled_is_evaluated_as_client_by_client(
  tmp_path,
):
  """A convolutional model under ``auto``: the pooled chunks convolve with
  XLA's convolution on a CPU (``Model.forward_only``), each client's
  statistics those of ``evaluate_params`` with the training's convolution
  up to float rounding."""
  from fedjax_personal.core import evaluation

  tests = np.array([0, 3, 17, 1, 9])
  store = _pooled_store(tmp_path, tests, (8, 8, 1))
  population = store.population()
  model = fp.models.from_flax('cnn', fp.models.CNN(5), population.sample_x)
  alg = algorithms.build(
    'fedavg', model, population, training=TrainingConfig(batch_size=4)
  )
  params = jax.tree.map(
    lambda a: a[0], alg.client_models(alg.init(jax.random.key(0))).params
  )
  got = evaluation.pooled_evaluation(alg, store)(params)
  _assert_pooled_as_client_by_client(
    store, tests, model, got, params, rtol=1e-5
  )


def test_round_keys_drawn_in_chunks_are_fold_in_of_the_round():
  """``RoundKeys`` (64 rounds' keys a compiled call) gives round t the bits of
  ``fold_in(train_key, t)``, across chunk edges and out of order (a resume)."""
  from fedjax_personal.run.experiment import (
    ROUND_KEY_CHUNK,
    RoundKeys,
    seed_keys,
  )

  _, train_key, _ = seed_keys(7)
  keys = RoundKeys(train_key)
  for t in (
    0,
    1,
    ROUND_KEY_CHUNK - 1,
    ROUND_KEY_CHUNK,
    3 * ROUND_KEY_CHUNK + 5,
    2,
    100_000,
  ):
    np.testing.assert_array_equal(
      jax.random.key_data(keys(t)),
      jax.random.key_data(jax.random.fold_in(train_key, t)),
    )
