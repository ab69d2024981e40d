"""Each algorithm shared with PFLlib against what PFLlib's own code computes
(``tests/data/pfllib_reference.npz``, recorded by
``benchmarks/peers/pfllib_reference.py`` from PFLlib at the commit it names,
PyTorch 2.13 on a CPU): the same made federation, initial weights and
batches, ``ROUNDS`` rounds of every client. Compared: the global model, the
personal part a client keeps, and each client's correct test predictions
after its last step. Parameters are compared by their projections on fixed
random unit directions (the record's ``project``). Tolerance: float
rounding (PyTorch's and XLA's sums in another order over 2 rounds of 2
full-batch steps): 1e-4 absolute."""

import dataclasses
import os

import helpers
import jax
import numpy as np
import pytest
from flax import traverse_util

from fedjax_personal import algorithms, models
from fedjax_personal.config import TrainingConfig
from fedjax_personal.core.data import (
  FederatedData,
  LocalData,
  pad_clients,
  to_device,
)
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.core.executors import VmapExecutor
from fedjax_personal.core.losses import evaluate_params
from fedjax_personal.core.sampling import CohortSampler
from fedjax_personal.models import weights

PATH = os.path.join(os.path.dirname(__file__), 'data', 'pfllib_reference.npz')
PEER = helpers.script_module('benchmarks', 'peers', 'pfllib_reference.py')
ATOL = 1e-4


@pytest.fixture(scope='module')
def reference():
  with np.load(PATH) as f:
    return {k: f[k] for k in f.files}


def _nested(ref, prefix):
  flat = {
    tuple(k[len(prefix) :].split('/')): v
    for k, v in ref.items()
    if k.startswith(prefix)
  }
  return traverse_util.unflatten_dict(flat)


def _data(ref, num_classes=None):
  n = PEER.NUM_CLIENTS
  x0 = ref['train_x_0']
  split = lambda s: pad_clients(
    [ref[f'{s}_x_{i}'] for i in range(n)],
    [ref[f'{s}_y_{i}'] for i in range(n)],
    x0.shape[1:],
    x0.dtype,
  )
  return to_device(
    FederatedData(
      train=split('train'),
      val=split('test'),
      test=split('test'),
      groups=np.full(n, -1, np.int32),
      num_classes=num_classes or PEER.NUM_CLASSES,
    )
  )


def _model(ref):
  model = models.create_model(
    'pfllib_cnn', PEER.NUM_CLASSES, ref['train_x_0'][:1], init='pytorch'
  )
  return model.starting_from(_nested(ref, 'init/'))


def _rounds(alg, data, reference, name):
  """``PEER.ROUNDS`` rounds of every client (keys 0, 1, ...) from init key
  0; FedGC's classifiers start as PFLlib drew them (its clients' own
  PyTorch draws)."""
  runner = RoundRunner(
    alg,
    data,
    CohortSampler(data.num_clients, cohort_size=data.num_clients),
    VmapExecutor(),
  )
  state = runner.init(jax.random.key(0))
  if name == 'fedgc':
    drawn = np.stack(
      [reference[f'{name}/init_head_{i}'] for i in range(PEER.NUM_CLIENTS)]
    )
    state = dataclasses.replace(state, heads=jax.numpy.asarray(drawn))
  if name == 'fedkd':  # each client's feature map as PyTorch drew it
    drawn = np.stack(
      [reference[f'{name}/init_w_h_{i}'] for i in range(PEER.NUM_CLIENTS)]
    )
    state = dataclasses.replace(
      state, rows={**state.rows, 'w_h': jax.numpy.asarray(drawn)}
    )
  if name == 'fedcp':  # the policy and context as both sides start them
    policy, context = PEER.fedcp_start()
    n = PEER.NUM_CLIENTS
    rows = dict(state.rows)
    rows['policy'] = jax.tree.map(lambda a: np.stack([a] * n), policy)
    rows['context'] = np.stack([context] * n)
    state = dataclasses.replace(state, rows=rows)
  if name == 'gpfl':  # the embeddings and valve as both sides start them
    gce, valve = PEER.gpfl_start()
    state = dataclasses.replace(
      state,
      gce=jax.numpy.asarray(gce),
      prev_gce=jax.numpy.asarray(gce),
      valve=jax.tree.map(jax.numpy.asarray, valve),
    )
  if name == 'fedgen':  # the generator as PyTorch drew it
    drawn = _nested(reference, f'{name}/generator_init/')
    state = dataclasses.replace(
      state,
      generator={**state.generator, 'params': jax.tree.map(np.asarray, drawn)},
    )
  for t in range(PEER.ROUNDS):
    state, _ = runner.round(state, jax.random.key(t), t)
  return state


def fixed_fedgen_draws(monkeypatch):
  """FedGen's draws as the record fixed them (``PEER.fedgen_labels`` and
  ``fedgen_noise``): the labels spread over the sorted multiset of the
  population's labels, computed here from the label counts."""
  from fedjax_personal.algorithms import fedgen

  def labels(key, counts, n):
    del key
    cum = jax.numpy.cumsum(counts.astype(jax.numpy.int32))
    at = (jax.numpy.arange(n) * cum[-1]) // n
    return jax.numpy.searchsorted(cum, at, side='right').astype(jax.numpy.int32)

  monkeypatch.setattr(fedgen, 'draw_labels', labels)
  monkeypatch.setattr(
    fedgen,
    'draw_noise',
    lambda key, n, dim: jax.numpy.asarray(PEER.fedgen_noise(n, dim)),
  )


@pytest.mark.parametrize('name', sorted(PEER.ALGORITHMS))
# CI: one that splits a body from a head and exchanges prototypes (the rest,
# 35 records, with -m slow)
@pytest.mark.ci_variants('fedproto')
def test_equal_to_pfllib(reference, name, monkeypatch):
  data, model = _data(reference), _model(reference)
  if name == 'fedgen':
    fixed_fedgen_draws(monkeypatch)
  if name == 'fedpcl':  # its labels renumbered; its passes in the data's order
    from fedjax_personal.algorithms import fedpcl

    labels = {
      k[len('fedpcl/') :]: v
      for k, v in reference.items()
      if k.startswith('fedpcl/') and '_y_' in k
    }
    data = _data({**reference, **labels}, int(reference['fedpcl/num_classes']))
    monkeypatch.setattr(
      fedpcl, 'collect_order', lambda key, n, m: jax.numpy.arange(m)
    )
  own = {**PEER.ALGORITHMS[name], **PEER.OURS.get(name, {})}
  training = TrainingConfig(
    client_lr=PEER.LR, batch_size=PEER.TRAIN, local_epochs=PEER.LOCAL_EPOCHS
  )
  algo = PEER.RECORDED_AS.get(name, name)
  flags = PEER.our_flags(algo, own)
  alg = algorithms.build(algo, model, data, training, **flags)
  state = _rounds(alg, data, reference, name)
  cm = alg.client_models(state)
  if name == 'fedgc':  # each client's classifier over its classes
    for i in range(PEER.NUM_CLIENTS):
      have = np.asarray(state.present[i])
      np.testing.assert_allclose(
        np.asarray(state.heads[i])[:, have],
        reference[f'{name}/head_{i}'][:, have],
        atol=ATOL,
      )
  if name in ('fedgh', 'pflda'):  # the global head
    head = _nested(reference, f'{name}/head/')
    assert helpers.max_diff(state.head, head) < ATOL
  elif f'{name}/global/conv_0/kernel' in reference:  # a global model
    params = getattr(state, 'params', None)
    if name in ('fedcp', 'gpfl'):  # the global body under a zero head
      zero = jax.tree.map(lambda a: np.zeros_like(a[0]), state.rows['head'])
      params = model.head.merge(state.body, zero)
    elif params is None:
      params = state.server.params
    got = PEER.project(weights.flat_params(jax.device_get(params)))
    for k, v in got.items():
      want = reference[f'{name}/global/{k}']
      np.testing.assert_allclose(v, want, atol=ATOL)
  if name in ('fedproto', 'fd'):  # the global table of class means
    have = reference[f'{name}/present']
    np.testing.assert_array_equal(np.asarray(state.present), have)
    np.testing.assert_allclose(
      np.asarray(state.protos)[have],
      reference[f'{name}/table'][have],
      atol=ATOL,
    )
  if name == 'fedpcl':  # the global prototypes in their keys' order; each
    # client's own, padded
    glob = reference[f'{name}/global']
    k = len(reference[f'{name}/global_labels'])
    np.testing.assert_allclose(state.global_protos[:k], glob, atol=ATOL)
    for i in range(PEER.NUM_CLIENTS):
      p = cm.for_client(i)
      have = reference[f'{name}/present_{i}']
      np.testing.assert_array_equal(np.asarray(p['valid']), have)
      np.testing.assert_allclose(
        np.asarray(p['table'])[have],
        reference[f'{name}/protos_{i}'][have],
        atol=ATOL,
      )
  if name in PEER.OWN_MODELS:  # each client's own model
    for i in range(PEER.NUM_CLIENTS):
      mine = cm.for_client(i)
      if name in ('fedproto', 'fd', 'fedala', 'fedpcl'):
        mine = mine['model']
      if name in PEER.IDENTITY_HEAD:  # its body, under a zero head
        body, top = model.head.split(mine)
        mine = model.head.merge(body, jax.tree.map(np.zeros_like, top))
      got = PEER.project(weights.flat_params(jax.device_get(mine)))
      for k, v in got.items():
        want = reference[f'{name}/client_{i}/{k}']
        np.testing.assert_allclose(v, want, atol=ATOL)
  if algo == 'fedcross':  # the middleware models
    for m in range(PEER.NUM_CLIENTS):
      mw = jax.tree.map(lambda a: a[m], state.middleware)
      got = PEER.project(weights.flat_params(jax.device_get(mw)))
      for k, v in got.items():
        want = reference[f'{name}/middleware_{m}/{k}']
        np.testing.assert_allclose(v, want, atol=ATOL)
  if name == 'fedphp':  # each client's inherited private model
    for i in range(PEER.NUM_CLIENTS):
      private = jax.tree.map(lambda a: a[i], state.rows['private'])
      got = PEER.project(weights.flat_params(jax.device_get(private)))
      for k, v in got.items():
        want = reference[f'{name}/private_{i}/{k}']
        np.testing.assert_allclose(v, want, atol=ATOL)
  if name == 'fedcp':  # each client's heads, policy and context
    for i in range(PEER.NUM_CLIENTS):
      row = jax.tree.map(lambda a: a[i], state.rows)
      for part in ('head', 'head_g'):
        want = _nested(reference, f'{name}/{part}_{i}/')
        assert helpers.max_diff(row[part], want) < ATOL
      for k, v in PEER.project(row['policy']).items():
        want = reference[f'{name}/policy_{i}/{k}']
        np.testing.assert_allclose(v, want, atol=ATOL)
      np.testing.assert_allclose(
        row['context'], reference[f'{name}/context_{i}'], atol=ATOL
      )
  if name == 'gpfl':  # the embeddings, the valve; heads and inputs
    np.testing.assert_allclose(
      PEER.project({'gce': state.gce})['gce'],
      reference[f'{name}/gce'],
      atol=ATOL,
    )
    flat = {
      f'{part}/{k}': v
      for part, layer in state.valve.items()
      for k, v in layer.items()
    }
    for k, v in PEER.project(flat).items():
      np.testing.assert_allclose(v, reference[f'{name}/valve/{k}'], atol=ATOL)
    for i in range(PEER.NUM_CLIENTS):
      row = jax.tree.map(lambda a: a[i], state.rows)
      want = _nested(reference, f'{name}/head_{i}/')
      assert helpers.max_diff(row['head'], want) < ATOL
      for part in ('personal', 'generic'):
        np.testing.assert_allclose(
          row[part], reference[f'{name}/{part}_{i}'], atol=ATOL
        )
  if name == 'fedrod':
    heads = _nested(reference, f'{name}/head_')
    for i in range(PEER.NUM_CLIENTS):
      got = jax.tree.map(lambda a: a[i], state.heads)
      assert helpers.max_diff(got, heads[str(i)]) < ATOL
  if name == 'fedgen':  # the generator the server trained
    want = _nested(reference, f'{name}/generator/')
    got = jax.device_get(state.generator['params'])
    # but the bias before its batch norm: the norm subtracts it again, so
    # its gradient is rounding (1e-7) that Adam scales to +-lr steps on
    # either side; it changes no output
    for part in (want, got):
      part['Dense_0'] = {'kernel': part['Dense_0']['kernel']}
    assert helpers.max_diff(got, want) < ATOL
  if name == 'apple':  # each client's directed relationship vector
    for i in range(PEER.NUM_CLIENTS):
      np.testing.assert_allclose(
        state.ps[i], reference[f'{name}/ps_{i}'], atol=1e-6
      )
  if name == 'feddbe':
    for i in range(PEER.NUM_CLIENTS):
      np.testing.assert_allclose(
        state.biases[i], reference[f'{name}/bias_{i}'], atol=1e-6
      )
  if name in PEER.GLOBAL_ONLY:  # (its docstring: what PFLlib tests)
    return
  correct = []
  for i in range(PEER.NUM_CLIENTS):
    p = cm.for_client(i)
    local = jax.tree.map(lambda a: a[i], data.train)
    if alg.finetune is not None:
      p = alg.finetune(p, LocalData(local, local), jax.random.key(i))
    test = jax.tree.map(lambda a: a[i], data.test)
    if alg.evaluate_client is not None:
      stats = alg.evaluate_client(
        p, LocalData(local, local), test, jax.random.key(i)
      )
    else:
      stats = evaluate_params(model, p, test)
    correct.append(int(round(float(stats.correct))))
  np.testing.assert_array_equal(correct, reference[f'{name}/test_correct'])


def test_the_leaderboard_gives_both_sides_the_same_settings():
  """``scripts/reproduce_pfllib.py`` hands an algorithm's ``LEADERBOARD``
  settings to both sides and leaves the rest at each side's defaults, so
  every setting of this project's that PFLlib's ``main.py`` also takes (its
  name, or ``FLAG_NAMES``'s) must default to PFLlib's value
  (``METHOD_DEFAULTS``), be given in ``LEADERBOARD``, or be set from the run
  (None). FedPHP's ``lamda`` was once 0.1 here and PFLlib's 1 there (its
  labels' weight 1 - lamda = 0 in PFLlib's run)."""
  board = helpers.script_module('scripts', 'reproduce_pfllib.py')
  checked = 0
  for name, given in board.LEADERBOARD.items():
    config = algorithms.spec(name).config
    ours = {f.name: f.default for f in dataclasses.fields(config)}
    # PFLlib's argument of each setting, one named after the algorithm first
    # (fedcross_alpha is FedCross's alpha; alpha FML's)
    keys = {}
    for key in sorted(
      PEER.METHOD_DEFAULTS, key=lambda k: k.startswith(name + '_')
    ):
      owner = key.split('_')[0]
      if owner not in board.LEADERBOARD or owner == name:
        keys[PEER.flag_name(name, key)] = key
    for field, key in keys.items():
      theirs = PEER.METHOD_DEFAULTS[key]
      if field not in ours or key in given or field in given:
        continue
      if ours[field] is None:  # set from the run (horizons, batch sizes)
        continue
      assert ours[field] == theirs, (name, field, ours[field], key, theirs)
      checked += 1
  assert checked >= 20
