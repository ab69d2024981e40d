"""A vmapped sweep equals its configurations' separate runs."""

import jax
import numpy as np
import pytest

import fedjax_personal as fp
from fedjax_personal import algorithms, sweep
from fedjax_personal.engine import RoundRunner
from fedjax_personal.experiment import run
from helpers import digits_data, max_diff


def test_sweep_over_seeds_and_learning_rates_equals_separate_runs():
  data = digits_data(num_clients=6)
  model = fp.models.from_flax('mlp', fp.models.MLP(10, hidden=(8,)), data.train.x[0, :1])
  build = lambda hv: algorithms.build('fedprox', model, data, batch_size=16, mu=0.1, **hv)
  cfgs = sweep.configs([0, 1], {'client_lr': [0.05, 0.2]})
  sampler = fp.CohortSampler(6, cohort_size=4)
  runner = sweep.SweepRunner(build, cfgs, data, sampler, fp.executors.VmapExecutor())
  histories = runner.run(3, eval_every=3)
  for s, (seed, hv) in enumerate(cfgs):
    single = RoundRunner(build(hv), data, sampler, fp.executors.VmapExecutor())
    state, history = run(single, 3, seed=seed, eval_every=3)
    got = jax.tree.map(lambda a: a[s], runner.state)
    assert max_diff(got.params, state.params) < 1e-5, (seed, hv)
    np.testing.assert_allclose(histories[s][-1]['accuracy_mean'], history[-1]['accuracy_mean'])
    np.testing.assert_allclose(histories[s][-1]['train_loss'], history[-1]['train_loss'], rtol=1e-5)
  # Different configurations really differ.
  assert histories[0][-1]['train_loss'] != histories[1][-1]['train_loss']


def test_parse_sweep():
  names = ['client_lr', 'fedprox_mu']
  assert sweep.parse_sweep('client_lr:0.1,0.3;fedprox_mu:0', names) == {
      'client_lr': [0.1, 0.3], 'fedprox_mu': [0.0]}
  with pytest.raises(ValueError, match='cannot be swept'):
    sweep.parse_sweep('batch_size:16,32', names)
  with pytest.raises(ValueError, match='numbers'):
    sweep.parse_sweep('client_lr:a,b', names)
  assert len(sweep.configs([0, 1, 2], {'client_lr': [1, 2], 'prox_mu': [0, 1]})) == 12
