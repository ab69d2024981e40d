"""auto on an accelerator fits its blocks to the device's free memory (a
fake device memory here): the estimate of a round's bytes, the block size
it picks, and a clear stop when not even one client fits."""

import types

import jax
import numpy as np
import optax
import pytest
from helpers import digits_data, run_rounds

import fedjax_personal as fp
from fedjax_personal.algorithms.ditto import ditto
from fedjax_personal.algorithms.fedavg import fedavg
from fedjax_personal.core import executors, fitting, memory
from fedjax_personal.errors import SettingError

GB = 1 << 30


def stand_in_data(num_clients, max_examples=200, shape=(28, 28, 1)):
  """What the estimate reads of a data set (no 10,000 clients' arrays)."""
  train = types.SimpleNamespace(
    max_examples=max_examples, x=np.zeros((1, 1) + shape, np.uint8)
  )
  return types.SimpleNamespace(num_clients=num_clients, train=train)


def mlp():
  return fp.create_model('mlp', 10, np.zeros((1, 28, 28, 1), np.uint8))


def test_estimate_counts_state_rows_and_working_copies():
  model = mlp()
  model_bytes = 199_210 * 4
  n = 10_000
  alg = ditto(model, n, optax.sgd(0.1), fp.Batching(32, 1))
  need = memory.estimate(alg, stand_in_data(n), cohort_size=n)
  assert need.client_state_bytes == model_bytes  # one personal model per client
  # the global model (and its optimizer state)
  assert need.shared_bytes >= model_bytes
  assert need.working_bytes > memory.MODEL_COPIES * model_bytes
  # 10,000 personal models (8 GB) plus the cohort's new ones (8 GB) on one
  # device.
  np.testing.assert_allclose(
    need.resident(1) / GB, 2 * n * model_bytes / GB, rtol=0.01
  )
  np.testing.assert_allclose(
    need.resident(2), need.shared_bytes + n * model_bytes, rtol=1e-6
  )


def test_ditto_10k_on_16_and_80_gb():
  n, alg = 10_000, ditto(mlp(), 10_000, optax.sgd(0.1), fp.Batching(32, 1))
  full = memory.estimate(alg, stand_in_data(n), cohort_size=n)
  # 80 GB: the whole cohort at once.
  assert memory.block_size(full, 80 * GB) is None
  # 16 GB: 16 GB of rows do not fit one device; the message says what would.
  with pytest.raises(
    SettingError, match='shard over 2 devices or more, or a smaller cohort_size'
  ):
    memory.block_size(full, 16 * GB)
  # Two 16 GB devices: each holds half the rows, in blocks.
  b = memory.block_size(full, 16 * GB, num_devices=2)
  assert b and full.total(b, 2) <= memory.HEADROOM * 16 * GB
  # A 10% cohort on one 16 GB device: blocks that fit.
  tenth = memory.estimate(alg, stand_in_data(n), cohort_size=1_000)
  b = memory.block_size(tenth, 16 * GB)
  assert b is None or tenth.total(b) <= memory.HEADROOM * 16 * GB


@pytest.mark.slow
def test_auto_picks_blocks_from_the_free_memory(monkeypatch):
  data = digits_data(num_clients=6)
  model = fp.models.from_flax(
    'mlp', fp.models.MLP(10, hidden=(16,)), data.train.x[0, :1]
  )
  alg = fedavg(model, 6, optax.sgd(0.1), fp.Batching(16, 1))
  need = memory.estimate(alg, data, cohort_size=6)
  # Room for the state and 2 clients' work, not 6.
  free = int((need.resident() + 2.5 * need.working_bytes) / memory.HEADROOM)
  monkeypatch.setattr(memory, 'device_free_bytes', lambda device=None: free)
  auto = executors.VmapExecutor()
  auto.plan_memory = True
  runner = fp.RoundRunner(alg, data, fp.CohortSampler(6, cohort_size=6), auto)
  assert isinstance(runner.executor, executors.BlockedExecutor)
  assert runner.executor.block_size == 2
  # Same numbers as the vectorized round.
  _, blocked = run_rounds(alg, data, executor=runner.executor)
  _, whole = run_rounds(alg, data)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
    blocked.params,
    whole.params,
  )
  # Plenty of memory: the whole cohort at once; no statistics (CPU): unchanged.
  assert fitting.fit_memory(auto, need, 100 * GB) is auto
  assert fitting.fit_memory(auto, need, None) is auto


def test_heavy_tailed_cohorts_run_in_blocks_by_work_on_an_accelerator():
  """``auto`` on an accelerator: a cohort of equal clients stays one vmap; a
  heavy-tailed one (mean real steps under 80% of the largest) runs in blocks of
  100 by work (H200: 0.365 s vs 0.449 s at a cohort of 500,
  benchmarks/speed/README.md); blocks the memory needs smaller win."""
  vmap = executors.VmapExecutor()
  equal = np.full(3400, 9)
  tailed = np.minimum(
    13, np.random.default_rng(0).lognormal(2.0, 0.6, 3400).astype(int) + 1
  )
  assert tailed.mean() / tailed.max() < fitting.WORK_BLOCKS_BELOW
  assert fitting.fit_work(vmap, equal, 500) is vmap
  # too few clients for two blocks
  assert fitting.fit_work(vmap, tailed, 150) is vmap
  blocked = fitting.fit_work(vmap, tailed, 500)
  assert (
    isinstance(blocked, executors.BlockedExecutor) and blocked.block_size == 100
  )
  assert blocked.num_threads == 1 and 'heavy-tailed' in blocked.reason
  need = memory.Need(
    shared_bytes=0,
    client_state_bytes=0,
    num_clients=3400,
    cohort_size=500,
    working_bytes=1 << 20,
  )
  roomy, tight = 1 << 40, int(60.5 * (1 << 20) / memory.HEADROOM)
  assert fitting.fit_accelerator(vmap, equal, 500, need, roomy) is vmap
  assert (
    fitting.fit_accelerator(vmap, tailed, 500, need, roomy).block_size == 100
  )
  assert (
    fitting.fit_accelerator(vmap, tailed, 500, need, tight).block_size == 60
  )
  assert fitting.fit_accelerator(vmap, equal, 500, need, tight).block_size == 60
