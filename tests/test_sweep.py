"""A sweep (configurations vmapped or looped in one program) equals its
configurations' separate runs."""

import functools

import jax
import numpy as np
import pytest
from helpers import digits_data, max_diff

import fedjax_personal as fp
from fedjax_personal import algorithms
from fedjax_personal.core.data import to_device
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.datasets import DataConfig, load_federated
from fedjax_personal.run import sweep
from fedjax_personal.run.experiment import run


@pytest.mark.parametrize(
  'config_axis',
  [  # CPU runs host; vmap / loop are accelerators' forms
    pytest.param('vmap', marks=pytest.mark.slow),
    pytest.param('loop', marks=pytest.mark.slow),
    'host',
  ],
)
@pytest.mark.slow_variants('host')
def test_sweep_over_seeds_and_learning_rates_equals_separate_runs(config_axis):
  data = digits_data(num_clients=6)
  model = fp.models.from_flax(
    'mlp', fp.models.MLP(10, hidden=(8,)), data.train.x[0, :1]
  )
  build = lambda hv: algorithms.build(
    'fedprox', model, data, batch_size=16, mu=0.1, **hv
  )
  cfgs = sweep.configs([0, 1], {'client_lr': [0.05, 0.2]})
  sampler = fp.CohortSampler(6, cohort_size=4)
  runner = sweep.SweepRunner(
    build,
    cfgs,
    data,
    sampler,
    fp.executors.VmapExecutor(),
    config_axis=config_axis,
  )
  assert runner.config_axis == config_axis
  histories = runner.run(3, eval_every=3)
  for s, (seed, hv) in enumerate(cfgs):
    single = RoundRunner(build(hv), data, sampler, fp.executors.VmapExecutor())
    state, history = run(single, 3, seed=seed, eval_every=3)
    got = jax.tree.map(lambda a: a[s], runner.state)
    assert max_diff(got.params, state.params) < 1e-5, (seed, hv)
    np.testing.assert_allclose(
      histories[s][-1]['accuracy_mean'], history[-1]['accuracy_mean']
    )
    np.testing.assert_allclose(
      histories[s][-1]['train_loss'], history[-1]['train_loss'], rtol=1e-5
    )
  # Different configurations really differ.
  assert histories[0][-1]['train_loss'] != histories[1][-1]['train_loss']


def test_parse_sweep():
  names = ['client_lr', 'fedprox_mu']
  assert sweep.parse_sweep('client_lr:0.1,0.3;fedprox_mu:0', names) == {
    'client_lr': [0.1, 0.3],
    'fedprox_mu': [0.0],
  }
  with pytest.raises(ValueError, match='cannot be swept'):
    sweep.parse_sweep('batch_size:16,32', names)
  with pytest.raises(ValueError, match='numbers'):
    sweep.parse_sweep('client_lr:a,b', names)
  assert sweep.resolve_config_axis('auto') == (
    'host' if jax.default_backend() == 'cpu' else 'vmap'
  )
  with pytest.raises(ValueError, match='config_axis'):
    sweep.resolve_config_axis('scan')
  assert (
    len(sweep.configs([0, 1, 2], {'client_lr': [1, 2], 'prox_mu': [0, 1]}))
    == 12
  )


@functools.lru_cache(maxsize=None)
def _registry_problem():
  # Rotation groups (oracle), a validation split (FedFomo), 4 clients.
  data = to_device(
    load_federated(
      DataConfig(
        dataset='digits',
        partition='rotation',
        num_groups=2,
        group_base='dirichlet',
        alpha=0.5,
        num_clients=4,
        max_examples=160,
        val_fraction=0.2,
        seed=0,
      )
    )
  )
  model = fp.models.from_flax(
    'mlp', fp.models.MLP(10, hidden=(8,)), data.train.x[0, :1]
  )
  return data, model


# Settings that make each algorithm's pre-round phase run inside 2 rounds.
EXTRA = {
  'usercentric': {'recompute_every': 1, 'sigma_batch_size': 4},
  'cfl': {'warmup_rounds': 1, 'eps1': 10.0, 'eps2': 0.0},
  'fedphp': {'horizon': 1},  # the command fills it from --rounds
  'fedkd': {'horizon': 1},
  'apple': {'horizon': 1},
}


# CI runs FedFomo (per-client state and candidates); the pre-round
# algorithms are checked through the CLI in CI (test_experiment_entry.py), the rest of the
# registry (FedAlt's partial models included) with -m slow.
CI_SWEEP = ('fedfomo',)


@pytest.mark.parametrize(
  'name',
  [
    n if n in CI_SWEEP else pytest.param(n, marks=pytest.mark.slow)
    for n in algorithms.REGISTRY
  ],
)
@pytest.mark.slow_variants('fedfomo')
def test_sweep_equals_single_runs_for_every_algorithm(name):
  """The one loop: a sweep of 2 seeds through ``run_many`` gives each seed
  the records of its own single run (same loop, same keys), pre-round
  diagnostics included."""
  data, model = _registry_problem()
  shared = {
    k: v
    for k, v in {'batch_size': 8, 'local_steps': 2, 'client_lr': 0.05}.items()
    if k in algorithms.REGISTRY[name].uses
  }
  build = lambda hv: algorithms.build(
    name, model, data, **shared, **EXTRA.get(name, {})
  )
  sampler = fp.CohortSampler(4, cohort_size=3)
  ex = fp.executors.VmapExecutor()
  cfgs = sweep.configs([0, 1], {})
  histories = sweep.SweepRunner(build, cfgs, data, sampler, ex).run(
    2, eval_every=1
  )
  runner = RoundRunner(build({}), data, sampler, ex)
  for s, (seed, _) in enumerate(cfgs):
    _, history = run(runner, 2, seed=seed, eval_every=1)
    for got, want in zip(histories[s], history):
      assert got.pop('config') == {'seed': seed}
      assert set(got) == set(want), (name, set(got) ^ set(want))
      for k, v in want.items():
        if k != 'round_seconds':
          np.testing.assert_allclose(
            got[k], v, rtol=2e-5, atol=1e-6, err_msg=f'{name} {k}'
          )
  if name == 'usercentric':  # W recomputed in both rounds, recorded in both
    assert all(
      r.get('pre_round_ran') and 'w_effective_neighbours_mean' in r
      for r in history
    )
  if name == 'cfl':  # the split test from round 2 on; eps2 = 0 makes it split
    assert 'cfl_splits' not in history[0] and history[1]['cfl_splits'] >= 1
  # both seeds, both rounds: one compiled round
  assert runner.trace_counts['round'] == 1
