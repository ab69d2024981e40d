"""DP-SGD accounting with dp-accounting (RDP): a published setting,
monotonicity, and FedFomo's DP runs recording epsilon per round."""

import json
import math

import numpy as np
import pytest
from helpers import parse_flags

from fedjax_personal.core.privacy import Privacy, dp_sgd_epsilon, worst_epsilon
from fedjax_personal.run import experiment_entry


def test_published_setting_of_abadi_et_al():
  """Abadi et al. (CCS 2016), Sec. 3.1: q = 0.01, sigma = 4, delta = 1e-5,
  T = 10,000 steps gives epsilon ~ 1.26 with the moments accountant; the RDP
  accountant with its tighter conversion gives 1.035 (dp-accounting 0.6)."""
  eps = dp_sgd_epsilon(0.01, 4.0, 10000, 1e-5)
  assert 0.9 < eps <= 1.26
  assert eps == pytest.approx(1.0355, rel=2e-3)


def test_epsilon_grows_with_steps_and_shrinks_with_noise():
  steps = [dp_sgd_epsilon(0.05, 1.0, t) for t in (10, 100, 1000)]
  assert steps[0] < steps[1] < steps[2]
  noise = [dp_sgd_epsilon(0.05, s, 100) for s in (0.8, 1.5, 3.0)]
  assert noise[0] > noise[1] > noise[2]
  assert dp_sgd_epsilon(0.05, 1.0, 0) == 0 and math.isinf(
    dp_sgd_epsilon(0.05, 0.0, 1)
  )
  p = Privacy(1.0, np.array([0.5, 0.1]), steps=None)
  # the larger q
  assert worst_epsilon(p, [10, 10]) == dp_sgd_epsilon(0.5, 1.0, 10)


@pytest.mark.slow
def test_fedfomo_dp_records_epsilon_every_round(tmp_path):
  parse_flags(
    '--algorithm=fedfomo',
    '--dataset=digits',
    '--model=logreg',
    '--num_clients=4',
    '--rounds=3',
    '--eval_every=3',
    '--val_fraction=0.2',
    '--fedfomo_candidates=2',
    '--fedfomo_dp_clip_norm=1',
    '--fedfomo_dp_noise_multiplier=1.1',
    '--batch_size=8',
    '--progress=false',
    '--max_examples=200',
    f'--output_dir={tmp_path}',
  )
  s = experiment_entry.main_job()['fedfomo']
  assert s['dp_delta'] == 1e-5 and 0 < s['dp_epsilon'] < math.inf
  lines = [json.loads(l) for l in open(tmp_path / 'fedfomo' / 'metrics.jsonl')]
  assert lines[-1]['dp_epsilon'] == s['dp_epsilon']
  # By hand: every client trains every round, ceil(n_i / 8) steps of q_i = 8 /
  # n_i.
  from fedjax_personal.datasets import load_federated

  n = np.asarray(
    load_federated(experiment_entry.read_flags().data).train.num_examples
  )
  want = max(
    dp_sgd_epsilon(round(min(8 / k, 1.0), 12), 1.1, 3 * math.ceil(k / 8))
    for k in n
  )
  assert s['dp_epsilon'] == pytest.approx(want, rel=1e-9)
  # --dp_delta without any DP algorithm does nothing: refused.
  parse_flags(
    '--algorithm=fedavg',
    '--dataset=digits',
    '--model=logreg',
    '--num_clients=4',
    '--dp_delta=1e-6',
    '--progress=false',
    f'--output_dir={tmp_path}/x',
  )
  with pytest.raises(experiment_entry.ConfigError, match='dp_delta'):
    experiment_entry.main_job()


@pytest.mark.slow
def test_fedavg_dp_records_epsilon_and_refuses_noise_without_clip(tmp_path):
  # FedAvg's DP-SGD rows of FedFomo's DP table: the same accounting as FedFomo.
  parse_flags(
    '--algorithm=fedavg',
    '--dataset=digits',
    '--model=logreg',
    '--num_clients=4',
    '--rounds=3',
    '--eval_every=3',
    '--fedavg_dp_clip_norm=1',
    '--fedavg_dp_noise_multiplier=1.1',
    '--batch_size=8',
    '--progress=false',
    '--max_examples=200',
    f'--output_dir={tmp_path}',
  )
  s = experiment_entry.main_job()['fedavg']
  from fedjax_personal.datasets import load_federated

  n = np.asarray(
    load_federated(experiment_entry.read_flags().data).train.num_examples
  )
  want = max(
    dp_sgd_epsilon(round(min(8 / k, 1.0), 12), 1.1, 3 * math.ceil(k / 8))
    for k in n
  )
  assert s['dp_epsilon'] == pytest.approx(want, rel=1e-9)
  parse_flags(
    '--algorithm=fedavg',
    '--dataset=digits',
    '--model=logreg',
    '--num_clients=4',
    '--fedavg_dp_noise_multiplier=1',
    '--progress=false',
    f'--output_dir={tmp_path}/y',
  )
  with pytest.raises(
    experiment_entry.ConfigError, match='fedavg_dp_noise_multiplier'
  ):
    experiment_entry.main_job()


@pytest.mark.slow
def test_fedavg_dp_without_noise_and_a_loose_clip_is_fedavg():
  # Clipping that never binds and sigma = 0: DP-SGD's mean of per-example
  # gradients is the batch gradient, so the round is plain FedAvg's.
  import jax
  import optax
  from helpers import digits_data

  import fedjax_personal as fp
  from fedjax_personal.algorithms.fedavg import fedavg
  from fedjax_personal.core.engine import RoundRunner

  data = digits_data(num_clients=4)
  model = fp.models.from_flax(
    'mlp', fp.models.MLP(data.num_classes, hidden=(8,)), data.train.x[0, :1]
  )
  out = {}
  for dp in (None, (1e6, 0.0)):
    alg = fedavg(model, 4, optax.sgd(0.1), fp.Batching(16, 1), dp=dp)
    # nothing to account: the DP table's sigma = 0 rows read epsilon inf
    if dp is None:
      assert alg.privacy is None
    runner = RoundRunner(
      alg, data, fp.CohortSampler(4, cohort_size=3), fp.executors.VmapExecutor()
    )
    state, _ = runner.round(runner.init(jax.random.key(0)), jax.random.key(1))
    out[dp] = state
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6),
    out[None].params,
    out[(1e6, 0.0)].params,
  )
  steps = np.asarray(out[(1e6, 0.0)].dp_steps)
  assert (steps > 0).sum() == 3 and out[None].dp_steps is None
