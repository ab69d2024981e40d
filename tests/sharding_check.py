"""Run under XLA_FLAGS=--xla_force_host_platform_device_count=8
(tests/test_sharding.py).

With the argument ``full``: every model x algorithm x cohort size, a conv
model included, and sharded blocks; otherwise (CI) the MLP with a partial
cohort and per-client state (user-centric's streams).
"""

import sys

import jax
import numpy as np
import optax
from helpers import digits_data, max_diff

import fedjax_personal as fp
from fedjax_personal.algorithms.fedavg import fedavg
from fedjax_personal.algorithms.local import local
from fedjax_personal.core.engine import RoundRunner

assert jax.device_count() == 8, jax.devices()
data = digits_data(num_clients=10)
models = {
  'mlp': fp.models.from_flax(
    'mlp', fp.models.MLP(10, hidden=(8,)), data.train.x[0, :1]
  ),
  'cnn': fp.models.from_flax(
    'cnn',
    fp.models.CNN(10, conv_features=(4, 4), dense=(8,)),
    data.train.x[0, :1],
  ),
}
FULL = sys.argv[1:] == ['full']
for model_name, model in models.items():
  for alg in (
    fedavg(model, 10, optax.sgd(0.1), fp.Batching(16, 1)),
    local(model, 10, optax.sgd(0.1), fp.Batching(16, 1)),
  ):
    for cohort in (10, 5):
      if not FULL and (cohort, alg.name) != (5, 'fedavg'):
        continue
      # CI: the MLP (conv models: ``full``)
      if not FULL and model_name == 'cnn':
        continue
      results = {}
      executors = [
        ('vmap', fp.executors.VmapExecutor()),
        ('sharded', fp.executors.ShardedExecutor()),
      ]
      # sharded blocks: the full grid (the blocked executor's own tests in CI)
      if FULL:
        executors.append(
          ('sharded_blocks', fp.executors.ShardedExecutor(block_size=1))
        )
      for name, ex in executors:
        runner = RoundRunner(
          alg, data, fp.CohortSampler(10, cohort_size=cohort), ex
        )
        state = runner.init(jax.random.key(0))
        for t in range(2):
          state, _ = runner.round(state, jax.random.key(t), t)
        results[name] = (state, runner.evaluate(state, jax.random.key(1)))
      for name in [n for n, _ in executors if n != 'vmap']:
        d = max_diff(results[name][0], results['vmap'][0])
        assert d < 1e-5, (model_name, alg.name, cohort, name, d)
        np.testing.assert_array_equal(
          results[name][1].correct, results['vmap'][1].correct
        )
# User-centric with W recomputed every round (k-means and silhouette inside
# the round): one compiled round on the sharded executor, equal to vmap.
from fedjax_personal.algorithms.usercentric import usercentric

uc_alg = usercentric(
  models['mlp'],
  10,
  data.train.num_examples,
  optax.sgd(0.1),
  fp.Batching(16, 1),
  sigma_batch_size=8,
  recompute_every=1,
)
uc_states = {}
for name, ex in (
  ('vmap', fp.executors.VmapExecutor()),
  ('sharded', fp.executors.ShardedExecutor()),
):
  runner = RoundRunner(uc_alg, data, fp.CohortSampler(10, cohort_size=10), ex)
  state = runner.init(jax.random.key(0))
  for t in range(2):
    state, metrics = runner.round(state, jax.random.key(t), t)
    assert bool(metrics['pre_round_ran'])
  assert runner.trace_counts['round'] == 1, (name, runner.trace_counts)
  uc_states[name] = state
assert max_diff(uc_states['sharded'], uc_states['vmap']) < 1e-4
print('SHARDING OK', jax.device_count())
