"""Kill-and-resume reaches exactly the numbers of an uninterrupted run."""

import json

import jax
import numpy as np
import optax
import pytest
from helpers import parse_flags

import fedjax_personal as fp
from fedjax_personal.algorithms.fedfomo import fedfomo
from fedjax_personal.core.data import to_device
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.datasets import DataConfig, load_federated
from fedjax_personal.run import checkpointing, experiment_entry
from fedjax_personal.run.experiment import run


def strip(history):
  return [{k: v for k, v in r.items() if k != 'round_seconds'} for r in history]


@pytest.mark.slow
def test_resume_equals_uninterrupted(tmp_path):
  data = to_device(
    load_federated(
      DataConfig(
        dataset='digits', num_clients=5, val_fraction=0.2, max_examples=400
      )
    )
  )
  model = fp.models.from_flax(
    'mlp', fp.models.MLP(10, hidden=(8,)), data.train.x[0, :1]
  )
  # FedFomo's state holds a typed PRNG key and per-client models: all must
  # survive.
  alg = fedfomo(model, 5, optax.sgd(0.1), fp.Batching(16, 1), num_candidates=2)
  make = lambda: RoundRunner(
    alg, data, fp.CohortSampler(5, cohort_size=3), fp.executors.VmapExecutor()
  )
  full_state, full_history = run(make(), 5, seed=3, eval_every=2)
  # A run killed after round 3, whose last checkpoint is round 2.
  ckpt = str(tmp_path / 'ckpt')
  run(
    make(),
    3,
    seed=3,
    eval_every=2,
    callbacks=[checkpointing.Checkpointer(ckpt, every=2)],
  )
  mngr = checkpointing.manager(ckpt)
  for step in list(mngr.all_steps()):
    if step > 2:
      mngr.delete(step)  # the kill happened before round 3's end-of-run save
  runner = make()
  state, start, histories = checkpointing.restore_latest(
    ckpt, runner.init(jax.random.key(0))
  )
  (history,) = histories  # one configuration
  assert start == 2 and len(history) == 2
  state, history = run(
    runner,
    5,
    seed=3,
    eval_every=2,
    state=state,
    start_round=start,
    history=history,
  )
  jax.tree.map(
    lambda a, b: np.testing.assert_array_equal(
      jax.random.key_data(a)
      if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
      else a,
      jax.random.key_data(b)
      if jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key)
      else b,
    ),
    state,
    full_state,
  )
  assert strip(history) == strip(full_history)


@pytest.mark.slow
def test_cli_resume(tmp_path):
  def job(*args):
    parse_flags(
      '--algorithm=fedavg',
      '--dataset=digits',
      '--model=logreg',
      '--num_clients=4',
      '--cohort_size=2',
      '--progress=false',
      '--max_examples=300',
      '--eval_every=1',
      *args,
    )
    return experiment_entry.main_job()

  full = job('--rounds=4', f'--output_dir={tmp_path}/full')
  job('--rounds=2', '--checkpoint_every=1', f'--output_dir={tmp_path}/cut')
  resumed = job('--rounds=4', '--resume', f'--output_dir={tmp_path}/cut')
  assert (
    resumed['fedavg']['per_client_accuracy']
    == full['fedavg']['per_client_accuracy']
  )
  lines = (
    (tmp_path / 'cut' / 'fedavg' / 'metrics.jsonl').read_text().splitlines()
  )
  assert [json.loads(l)['round'] for l in lines] == [1, 2, 3, 4]
