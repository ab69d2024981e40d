"""Stochastic and stateful models: dropout keyed by the training step,
batch statistics over a batch's real examples carried with the parameters,
FedAvg averaging them as PyTorch averages a ``state_dict``, FedBN keeping
BatchNorm on each client (against a per-client loop), Ditto's personal
model keeping its own; a model's mistakes refused at registration."""

import dataclasses
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import SmallBN, max_diff, run_rounds, torch_local_steps

from fedjax_personal import algorithms, models
from fedjax_personal.core import batching as batching_lib
from fedjax_personal.core.data import FederatedData, pad_clients, to_device
from fedjax_personal.core.losses import Batch, StatsAndState, batch_loss
from fedjax_personal.core.personalization import make_split
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import resnet_bn, weights


def _clients(sizes, shape=(6,), classes=3, seed=0):
  rng = np.random.default_rng(seed)
  xs = [
    rng.normal(size=(n,) + shape).astype(np.float32) + i
    for i, n in enumerate(sizes)
  ]
  ys = [rng.integers(0, classes, n).astype(np.int32) for n in sizes]
  train = pad_clients(xs, ys, shape, np.float32, (), np.int32)
  empty = pad_clients(
    [a[:0] for a in xs], [b[:0] for b in ys], shape, np.float32, (), np.int32
  )
  data = to_device(
    FederatedData(
      train=train,
      val=empty,
      test=train,
      groups=-np.ones(len(sizes), np.int32),
      num_classes=classes,
      name='made',
    )
  )
  return data, xs, ys


@pytest.mark.slow
def test_batch_statistics_are_those_of_the_real_examples_and_evaluation_is_deterministic():
  x = np.random.default_rng(0).normal(size=(5, 6)).astype(np.float32)
  model = models.from_flax('small', SmallBN(3, dropout=0.5), x)
  assert model.collections == ('batch_stats',) and model.train_arg
  params = model.init(jax.random.key(0))
  assert set(params) == {'params', 'batch_stats'}
  y, key = jnp.array([0, 1, 2, 0, 1]), jax.random.key(1)
  mask = jnp.array([True, True, True, False, False])
  _, padded = batch_loss(model, params, Batch(x, y, mask, key))
  _, real = batch_loss(model, params, Batch(x[:3], y[:3], mask[:3], key))
  assert isinstance(padded, StatsAndState)
  chex.assert_trees_all_close(padded.state, real.state, atol=1e-6)
  # Evaluation: running statistics, no dropout, no key: the same twice.
  np.testing.assert_array_equal(model.apply(params, x), model.apply(params, x))
  # Training draws dropout from the step's key: two keys, two losses.
  losses = {
    float(batch_loss(model, params, Batch(x, y, mask, jax.random.key(k)))[0])
    for k in range(3)
  }
  assert len(losses) == 3


def _torch_resnet(torch, stages=(2, 2, 2, 2), num_classes=10):
  """torchvision's resnet18 (its BasicBlock, stem and state_dict order),
  written out so that only torch is needed."""
  nn_ = torch.nn

  class Block(nn_.Module):
    def __init__(self, cin, planes, stride):
      super().__init__()
      self.conv1 = nn_.Conv2d(cin, planes, 3, stride, 1, bias=False)
      self.bn1 = nn_.BatchNorm2d(planes)
      self.conv2 = nn_.Conv2d(planes, planes, 3, 1, 1, bias=False)
      self.bn2 = nn_.BatchNorm2d(planes)
      self.downsample = (
        nn_.Sequential(
          nn_.Conv2d(cin, planes, 1, stride, bias=False),
          nn_.BatchNorm2d(planes),
        )
        if stride != 1 or cin != planes
        else None
      )

    def forward(self, x):
      out = torch.relu(self.bn1(self.conv1(x)))
      out = self.bn2(self.conv2(out))
      return torch.relu(
        out + (x if self.downsample is None else self.downsample(x))
      )

  class Net(nn_.Module):
    def __init__(self):
      super().__init__()
      self.conv1 = nn_.Conv2d(3, 64, 7, 2, 3, bias=False)
      self.bn1 = nn_.BatchNorm2d(64)
      self.maxpool = nn_.MaxPool2d(3, 2, 1)
      cin, layers = 64, []
      for s, (n, planes) in enumerate(zip(stages, (64, 128, 256, 512))):
        blocks = []
        for b in range(n):
          blocks.append(Block(cin, planes, 2 if s and not b else 1))
          cin = planes
        layers.append(nn_.Sequential(*blocks))
      self.layers = nn_.ModuleList(layers)
      self.fc = nn_.Linear(cin, num_classes)

    def forward(self, x):
      x = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
      for layer in self.layers:
        x = layer(x)
      return self.fc(x.mean((2, 3)))

  return Net()


def _perturbed_state(torch, net, seed):
  """Random running statistics (a trained model's, not the init's 0 and 1)."""
  g = torch.Generator().manual_seed(seed)
  for m in net.modules():
    if isinstance(m, torch.nn.BatchNorm2d):
      m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
      m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
      m.weight.data.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
  return net


@pytest.mark.torch
@pytest.mark.slow
def test_resnet18_bn_gives_pytorch_logits_on_a_pytorch_state_dict(tmp_path):
  """torchvision's ResNet-18, running statistics included, loads with
  --init_weights; evaluation (running statistics) equals PyTorch's eval()."""
  torch = pytest.importorskip('torch')
  torch.manual_seed(0)
  net = _perturbed_state(torch, _torch_resnet(torch), 1).eval()
  path = str(tmp_path / 'resnet.pt')
  torch.save(net.state_dict(), path)
  x = np.random.default_rng(0).random((2, 32, 32, 3)).astype(np.float32)
  model = models.build_model(
    models.ModelConfig(model='resnet18_bn', init_weights=path, conv_impl='xla'),
    10,
    x,
  )
  want = net(torch.tensor(x).permute(0, 3, 1, 2)).detach().numpy()
  np.testing.assert_allclose(
    model.apply(model.init(jax.random.key(0)), x), want, rtol=1e-4, atol=1e-4
  )


@pytest.mark.torch
@pytest.mark.slow
def test_fedavg_of_a_batch_norm_resnet_equals_pytorch_training_and_state_dict_averaging(
  tmp_path,
):
  """Run at XLA's default optimization, in a child process: at the suite's
  -O0 (conftest.py) XLA:CPU's compiled ResNet step drifts from its own op by
  op result by 3e-4 in one step and 8% of a client's update in two (the
  losses differ in their 4th digit), while at the default both equal
  PyTorch's to 1e-6. The check itself: ``_fedavg_resnet_check``."""
  pytest.importorskip('torch')
  here = os.path.dirname(os.path.abspath(__file__))
  r = subprocess.run(
    [
      sys.executable,
      '-c',
      'import pathlib, sys, test_model_state as t; '
      f't._fedavg_resnet_check(pathlib.Path({str(tmp_path)!r}))',
    ],
    cwd=here,
    capture_output=True,
    text=True,
    timeout=600,
    env={**os.environ, 'XLA_FLAGS': '', 'JAX_PLATFORMS': 'cpu'},
  )
  assert r.returncode == 0, r.stderr[-3000:]


def _fedavg_resnet_check(tmp_path):
  """One FedAvg round of a batch-norm ResNet (torchvision's stem and blocks, one
  a stage, three stages: a norm over the 2 or 4 values a channel of a fourth
  stage's 1x1 is so ill-conditioned that summation order alone moves the
  gradients by 1e-3) from a PyTorch state dict: each client trains in PyTorch on
  the engine's batches (train mode: batch statistics, running ones updated with
  the unbiased variance), the state dicts are averaged by n_i, buffers included;
  the round's global parameters and statistics equal it."""
  import torch  # noqa: PLC0415  (the child process of the test above)

  torch.manual_seed(2)
  stages = (1, 1, 1)
  net = _perturbed_state(torch, _torch_resnet(torch, stages, num_classes=3), 3)
  path = str(tmp_path / 'init.pt')
  torch.save(net.state_dict(), path)
  # batches of 4 and 2 (PyTorch refuses 1 in training)
  sizes, lr, bs = (
    (8, 6),
    0.05,
    4,
  )
  data, xs, ys = _clients(sizes, shape=(64, 64, 3), classes=3)
  sample = data.train.x[0, :1]
  model = models.from_flax(
    'resnet_bn', resnet_bn.ResNetBN(3, stages=stages, conv_impl='xla'), sample
  )
  model = model.starting_from(weights.load(path, model, sample))
  alg = algorithms.build('fedavg', model, data, client_lr=lr, batch_size=bs)
  _, state = run_rounds(alg, data, rounds=1)

  batching = batching_lib.Batching(batch_size=bs, num_epochs=1)
  _, k_clients = jax.random.split(jax.random.key(0))
  outs = []
  for i, n in enumerate(sizes):
    _, k_batch, _ = jax.random.split(jax.random.fold_in(k_clients, i), 3)
    idx, mask = batching_lib.batch_indices(
      k_batch, jnp.int32(n), max(sizes), batching
    )
    client = _torch_resnet(torch, stages, num_classes=3)
    client.load_state_dict(net.state_dict())
    client.train()
    opt = torch.optim.SGD(client.parameters(), lr=lr)
    torch_local_steps(
      torch,
      client,
      opt,
      torch.tensor(xs[i]).permute(0, 3, 1, 2),
      torch.tensor(ys[i]).long(),
      idx,
      mask,
    )
    outs.append({k: v.detach().clone() for k, v in client.state_dict().items()})
  w = np.array(sizes, np.float64) / sum(sizes)
  avg = {
    k: (sum(float(wi) * o[k].double() for wi, o in zip(w, outs))).to(
      outs[0][k].dtype
    )
    if outs[0][k].is_floating_point()
    else outs[0][k]
    for k in outs[0]
  }
  ref = _torch_resnet(torch, stages, num_classes=3)
  ref.load_state_dict(avg)
  torch.save(ref.state_dict(), str(tmp_path / 'after.pt'))
  want = weights.load(str(tmp_path / 'after.pt'), model, sample)
  start = weights.load(path, model, sample)
  assert max_diff(want['batch_stats'], start['batch_stats']) > 1e-3
  # Each leaf's update (what the round changed) equal to 0.1% of its size: float
  # rounding through a batch norm's 1/sqrt(var) is all that separates them.
  flat = [
    jax.tree_util.tree_flatten_with_path(t)[0]
    for t in (state.params, want, start)
  ]
  for (path, a), (_, b), (_, s0) in zip(*flat):
    moved = float(np.abs(np.asarray(b) - np.asarray(s0)).max())
    err = float(np.abs(np.asarray(a) - np.asarray(b)).max())
    assert err <= 1e-3 * moved + 1e-7, (jax.tree_util.keystr(path), err, moved)


@pytest.mark.slow
def test_fedbn_keeps_batch_norm_on_each_client_as_a_per_client_loop():
  """FedBN's round against a per-client loop: each client trains the model
  made of the global shared part and its own BatchNorm (scale, bias,
  statistics) on the engine's batches; the shared part is the n_i-weighted
  mean; each client keeps its BatchNorm; the shared part never holds one."""
  sizes, lr, bs = (9, 6, 11), 0.1, 4
  data, xs, ys = _clients(sizes)
  model = models.from_flax('small', SmallBN(3), data.train.x[0, :1])
  alg = algorithms.build('fedbn', model, data, client_lr=lr, batch_size=bs)
  split = make_split('norm', jax.eval_shape(model.init, jax.random.key(0)))
  params0 = model.init(jax.random.key(0))
  state0 = alg.init(jax.random.key(0))
  _, state = run_rounds(alg, data, rounds=1)
  assert not any('BatchNorm' in k for k in state.shared)
  assert set(state.personal) == {
    'params/BatchNorm_0/scale',
    'params/BatchNorm_0/bias',
    'batch_stats/BatchNorm_0/mean',
    'batch_stats/BatchNorm_0/var',
  }

  batching = batching_lib.Batching(batch_size=bs, num_epochs=1)
  _, k_clients = jax.random.split(jax.random.key(0))
  module = model.module

  def loss(p, x, y):
    logits, new = module.apply(p, x, train=True, mutable=['batch_stats'])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return ce, new

  grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
  shared_out, personal_out = [], []
  for i, n in enumerate(sizes):
    _, k_batch, _ = jax.random.split(jax.random.fold_in(k_clients, i), 3)
    idx, mask = batching_lib.batch_indices(
      k_batch, jnp.int32(n), max(sizes), batching
    )
    personal = jax.tree.map(lambda a: a[i], state0.personal)
    p = split.merge(state0.shared, personal)
    for s in range(idx.shape[0]):
      real = np.asarray(idx[s])[np.asarray(mask[s])]
      if real.size == 0:
        continue
      (_, new), g = grad(p, xs[i][real], ys[i][real])
      p = {
        'params': jax.tree.map(
          lambda a, b: a - lr * b, p['params'], g['params']
        ),
        'batch_stats': new['batch_stats'],
      }
    u, v = split.split(p)
    shared_out.append(u)
    personal_out.append(v)
  w = np.array(sizes, np.float64) / sum(sizes)
  want_shared = jax.tree.map(
    lambda *a: sum(wi * ai for wi, ai in zip(w, a)), *shared_out
  )
  chex.assert_trees_all_close(state.shared, want_shared, atol=1e-5)
  for i in range(len(sizes)):
    chex.assert_trees_all_close(
      jax.tree.map(lambda a: a[i], state.personal), personal_out[i], atol=1e-5
    )
  del params0


def test_ditto_keeps_each_clients_statistics_in_its_personal_model():
  data, _, _ = _clients((9, 6, 11))
  model = models.from_flax('small', SmallBN(3), data.train.x[0, :1])
  alg = algorithms.build('ditto', model, data, client_lr=0.1, batch_size=4)
  _, state = run_rounds(alg, data, rounds=1)
  means = state.personal['batch_stats']['BatchNorm_0']['mean']
  assert (
    means.shape[0] == 3 and float(jnp.abs(means[0] - means[1]).max()) > 1e-3
  )
  moved = state.params['batch_stats']['BatchNorm_0']['mean']
  # the global model's statistics were averaged
  assert float(jnp.abs(moved).max()) > 1e-3


def test_an_algorithm_that_does_not_carry_batch_statistics_refuses_the_model():
  data, _, _ = _clients((4, 5))
  model = models.from_flax('small', SmallBN(3), data.train.x[0, :1])
  with pytest.raises(ConfigError, match='scaffold does not carry'):
    algorithms.build('scaffold', model, data)
  plain = models.from_flax(
    'mlp', models.MLP(3, hidden=(4,)), data.train.x[0, :1]
  )
  with pytest.raises(ConfigError, match='batch normalization'):
    algorithms.build('fedbn', plain, data)


def test_a_model_builder_naming_what_it_is_never_given_is_refused():
  @dataclasses.dataclass(frozen=True)
  class Opts(models.ModelOptions):
    contrast: float = 1.0

  with pytest.raises(TypeError, match="'contrst'.*num_classes, contrast"):
    models.register(
      'typo_model',
      lambda num_classes, contrst=1.0: SmallBN(num_classes),
      options=Opts,
    )
  with pytest.raises(TypeError, match='must take num_classes'):
    models.register('no_classes', lambda classes: SmallBN(classes))
  with pytest.raises(ValueError, match='built-in model'):
    models.register('mlp', lambda num_classes: SmallBN(num_classes))
  assert 'typo_model' not in models.REGISTERED
