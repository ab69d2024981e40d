"""Initialisation conventions, the seeds' reference models, and initial
weights from files: the documented formulas of each framework's default
initialisers, PyTorch's own layers where torch is installed, and one FedAvg
round computed by this library and by a plain PyTorch loop from the same
weights and batches."""

import os

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import max_diff, run_rounds

from fedjax_personal import algorithms, models
from fedjax_personal.core import batching as batching_lib
from fedjax_personal.core.data import FederatedData, pad_clients, to_device
from fedjax_personal.datasets import in_memory
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import initializers, weights
from fedjax_personal.models.layers import Conv, Dense, LSTMCell

FAN_IN, FAN_OUT = 400, 300


def draw(module, x, key=0):
  return module.init(jax.random.key(key), x)['params']


def check_uniform(a, bound):
  a = np.asarray(a).ravel()
  assert np.abs(a).max() <= bound * (1 + 1e-6)
  assert np.abs(a).max() > 0.97 * bound  # the support is filled
  np.testing.assert_allclose(a.var(), bound**2 / 3, rtol=0.05)
  assert abs(a.mean()) < 0.05 * bound


@pytest.mark.parametrize('conv', [False, True])
def test_dense_and_conv_follow_each_framework_formula(conv):
  if conv:  # HWIO 5x5, Cin 16, Cout 12: fan_in 400, fan_out 300
    x, make = (
      jnp.zeros((1, 8, 8, 16)),
      lambda c: Conv(12, (5, 5), impl='xla', convention=c),
    )
  else:
    x, make = jnp.zeros((1, FAN_IN)), lambda c: Dense(FAN_OUT, convention=c)
  p = draw(make('pytorch'), x)
  check_uniform(p['kernel'], 1 / FAN_IN**0.5)  # kaiming_uniform_(a=sqrt(5))
  check_uniform(p['bias'], 1 / FAN_IN**0.5) if not conv else (
    np.abs(p['bias']).max() <= 1 / FAN_IN**0.5
  )
  p = draw(make('keras'), x)
  check_uniform(p['kernel'], (6 / (FAN_IN + FAN_OUT)) ** 0.5)  # glorot_uniform
  assert not np.asarray(p['bias']).any()
  p = draw(make('flax'), x)
  # LeCun
  np.testing.assert_allclose(
    np.asarray(p['kernel']).var(), 1 / FAN_IN, rtol=0.05
  )
  # truncated at 2 sigma
  assert np.abs(p['kernel']).max() <= 2 * 1.1379 / FAN_IN**0.5
  assert not np.asarray(p['bias']).any()
  p = draw(make('haiku'), x)  # TruncatedNormal(1 / sqrt(fan_in)), not rescaled
  check_haiku_truncated(p['kernel'], 1 / FAN_IN**0.5)
  assert not np.asarray(p['bias']).any()


def check_haiku_truncated(a, stddev):
  """``stddev`` x a standard normal truncated at +-2: variance 0.774
  stddev^2."""
  a = np.asarray(a).ravel()
  assert np.abs(a).max() <= 2 * stddev * (1 + 1e-6)
  assert np.abs(a).max() > 1.9 * stddev
  np.testing.assert_allclose(a.var(), 0.7737 * stddev**2, rtol=0.05)


def test_flax_convention_is_nn_dense_and_nn_conv_exactly():
  x = jax.random.normal(jax.random.key(1), (3, 9, 9, 4))
  for ours, theirs in [
    (Dense(7), nn.Dense(7)),
    (Conv(5, (3, 3), impl='xla'), nn.Conv(5, (3, 3))),
  ]:
    a, b = draw(ours, x, 3), draw(theirs, x, 3)
    assert all(
      bool((u == v).all())
      for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )
    np.testing.assert_array_equal(
      ours.apply({'params': a}, x), theirs.apply({'params': b}, x)
    )


def test_embedding_and_lstm_follow_each_framework_formula():
  vocab, emb, hidden = 500, 64, 128
  tokens = jnp.zeros((1, 5), jnp.int32)
  for conv, check in [
    ('pytorch', lambda e: np.testing.assert_allclose(e.std(), 1.0, rtol=0.03)),
    ('keras', lambda e: check_uniform(e, 0.05)),
    (
      'flax',
      lambda e: np.testing.assert_allclose(e.std(), emb**-0.5, rtol=0.03),
    ),
    ('haiku', lambda e: check_haiku_truncated(e, 1.0)),
  ]:
    e = draw(
      nn.Embed(vocab, emb, embedding_init=initializers.embedding_init(conv)),
      tokens,
    )
    check(np.asarray(e['embedding']))
  x = jnp.zeros((1, 3, 96))
  p = draw(nn.RNN(LSTMCell(hidden, convention='pytorch')), x)['cell']
  k = 1 / hidden**0.5
  check_uniform(np.concatenate([p[f'i{g}']['kernel'] for g in 'ifgo'], -1), k)
  check_uniform(np.concatenate([p[f'h{g}']['kernel'] for g in 'ifgo'], -1), k)
  b = np.concatenate([p[f'h{g}']['bias'] for g in 'ifgo'])
  assert np.abs(b).max() <= 2 * k  # b_ih + b_hh: a sum of two U(-k, k)
  np.testing.assert_allclose(b.var(), 2 * k**2 / 3, rtol=0.15)
  p = draw(nn.RNN(LSTMCell(hidden, convention='keras')), x)['cell']
  # Glorot over the whole [in, 4H] kernel
  check_uniform(
    np.concatenate([p[f'i{g}']['kernel'] for g in 'ifgo'], -1),
    (6 / (96 + 4 * hidden)) ** 0.5,
  )
  rec = np.concatenate([p[f'h{g}']['kernel'] for g in 'ifgo'], -1)  # [H, 4H]
  # orthonormal rows
  np.testing.assert_allclose(rec @ rec.T, np.eye(hidden), atol=1e-5)
  np.testing.assert_array_equal(p['hf']['bias'], 1.0)  # unit_forget_bias
  for g in 'igo':
    assert not np.asarray(p[f'h{g}']['bias']).any()
  p = draw(nn.RNN(LSTMCell(hidden, convention='haiku')), x)['cell']
  # hk.LSTM: one Linear over [x, h], TruncatedNormal(1 / sqrt(in + H));
  # sigmoid(f + 1).
  check_haiku_truncated(
    np.concatenate(
      [
        np.concatenate([p[f'i{g}']['kernel'], p[f'h{g}']['kernel']])
        for g in 'ifgo'
      ],
      -1,
    ),
    (96 + hidden) ** -0.5,
  )
  np.testing.assert_array_equal(p['hf']['bias'], 1.0)
  for g in 'igo':
    assert not np.asarray(p[f'h{g}']['bias']).any()


def test_unknown_convention_names_the_flag():
  with pytest.raises(ConfigError, match='--model_init'):
    models.create_model('mlp', 10, jnp.zeros((1, 4)), init='torch')


@pytest.mark.parametrize(
  'name,shape,count',
  [
    ('usercentric_lenet5', (28, 28, 1), 61_706),  # LeNet-5, average pooling
    ('lenet5', (28, 28, 1), 61_706),
    ('feddyn_cnn', (32, 32, 3), 797_962),  # FedDyn's utils_models.py, 'cifar10'
    # the TensorFlow tutorial CNN (FedFomo's default)
    (
      'fedfomo_cnn',
      (32, 32, 3),
      122_570,
    ),
    ('pfedme_cnn', (32, 32, 3), 62_006),  # the PyTorch tutorial CNN
    # TFF's EMNIST CNN, 62 classes
    (
      'reddi_emnist_cnn',
      (28, 28, 1),
      1_206_590,
    ),
    ('fedjax_emnist_cnn', (28, 28, 1), 1_206_590),  # FedJAX's, the same layers
    # torchvision's resnet18 (+ 9,600 statistics)
    (
      'resnet18_bn',
      (32, 32, 3),
      11_181_642,
    ),
  ],
)
def test_reference_models_have_their_documented_parameter_counts(
  name, shape, count
):
  model = models.create_model(
    name, 62 if 'emnist' in name else 10, jnp.zeros((1,) + shape)
  )
  params = jax.eval_shape(model.init, jax.random.key(0))
  assert (
    models.num_params(
      params.get('params', params) if model.collections else params
    )
    == count
  )
  assert f'{count:,}' in (model.module.__doc__ or '') or f'{count:,}' in (
    type(model.module).__doc__ or ''
  )


def test_average_pooling_averages_windows():
  x = jnp.arange(2 * 4 * 5 * 3, dtype=jnp.float32).reshape(2, 4, 5, 3)
  want = nn.avg_pool(x, (2, 2), (2, 2))
  for layout in ('NHWC', 'CNHW'):
    got = models.from_layout(
      models.avg_pool_2x2(models.to_layout(x, layout), layout), layout
    )
    np.testing.assert_allclose(got, want)


# -- initial weights from files
# -------------------------------------------------


@pytest.mark.slow
def test_npz_round_trip_and_mismatches(tmp_path):
  x = jnp.zeros((1, 28, 28, 1))
  model = models.create_model('lenet5', 10, x)
  params = model.init(jax.random.key(3))
  path = str(tmp_path / 'w.npz')
  weights.save_npz(path, params)
  assert max_diff(weights.load(path, model, x), params) == 0
  started = model.starting_from(weights.load(path, model, x))
  assert max_diff(started.init(jax.random.key(99)), params) == 0
  with pytest.raises(
    ConfigError, match=r'--init_weights: .*w.npz: layer conv_0/kernel is '
  ):
    weights.load(
      path,
      models.create_model('lenet5', 10, jnp.zeros((1, 28, 28, 3))),
      jnp.zeros((1, 28, 28, 3)),
    )
  with pytest.raises(
    ConfigError, match="no array for the model's layer hidden_0/kernel"
  ):
    weights.load(path, models.create_model('mlp', 10, x), x)
  (tmp_path / 'bad.npz').write_bytes(b'not a zip')
  with pytest.raises(ConfigError, match='not a readable .npz'):
    weights.load(str(tmp_path / 'bad.npz'), model, x)
  with pytest.raises(ConfigError, match='no such file'):
    weights.load(str(tmp_path / 'none.npz'), model, x)
  (tmp_path / 'w.h5').write_bytes(b'')
  with pytest.raises(ConfigError, match='unknown format'):
    weights.load(str(tmp_path / 'w.h5'), model, x)


def _torch_lenet5(torch, pool):
  class LeNet5(torch.nn.Module):  # PyTorch's layers, default initialisation
    def __init__(self):
      super().__init__()
      self.conv1 = torch.nn.Conv2d(1, 6, 5, padding=2)
      self.conv2 = torch.nn.Conv2d(6, 16, 5)
      self.fc1 = torch.nn.Linear(400, 120)
      self.fc2 = torch.nn.Linear(120, 84)
      self.fc3 = torch.nn.Linear(84, 10)
      self.pool = (
        torch.nn.MaxPool2d(2) if pool == 'max' else torch.nn.AvgPool2d(2)
      )

    def forward(self, x):  # x: NCHW
      r = torch.relu
      x = self.pool(r(self.conv2(self.pool(r(self.conv1(x))))))
      x = r(self.fc2(r(self.fc1(torch.flatten(x, 1)))))
      return self.fc3(x)

  return LeNet5()


@pytest.mark.torch
def test_pytorch_initialisers_match_torch_layers_statistics():
  torch = pytest.importorskip('torch')
  torch.manual_seed(0)
  lin, conv = torch.nn.Linear(FAN_IN, FAN_OUT), torch.nn.Conv2d(16, 12, 5)
  ours_lin = draw(Dense(FAN_OUT, convention='pytorch'), jnp.zeros((1, FAN_IN)))
  ours_conv = draw(
    Conv(12, (5, 5), impl='xla', convention='pytorch'), jnp.zeros((1, 8, 8, 16))
  )
  for t, o in [
    (lin.weight, ours_lin['kernel']),
    (lin.bias, ours_lin['bias']),
    (conv.weight, ours_conv['kernel']),
  ]:
    t, o = t.detach().numpy().ravel(), np.asarray(o).ravel()
    np.testing.assert_allclose(np.abs(o).max(), np.abs(t).max(), rtol=0.03)
    np.testing.assert_allclose(o.std(), t.std(), rtol=0.08)
  lstm = torch.nn.LSTM(96, 128)
  ours = draw(
    nn.RNN(LSTMCell(128, convention='pytorch')), jnp.zeros((1, 3, 96))
  )['cell']
  np.testing.assert_allclose(
    np.asarray(ours['ii']['kernel']).std(),
    lstm.weight_ih_l0.detach().numpy().std(),
    rtol=0.08,
  )
  both = (lstm.bias_ih_l0 + lstm.bias_hh_l0).detach().numpy()
  np.testing.assert_allclose(
    np.asarray(ours['hi']['bias']).std(), both.std(), rtol=0.25
  )


@pytest.mark.parametrize(
  'name,pool', [('lenet5', 'max'), ('usercentric_lenet5', 'avg')]
)
@pytest.mark.torch
def test_pytorch_state_dict_gives_torch_outputs(tmp_path, name, pool):
  torch = pytest.importorskip('torch')
  torch.manual_seed(0)
  net = _torch_lenet5(torch, pool)
  path = str(tmp_path / 'lenet5.pt')
  torch.save(net.state_dict(), path)
  x = np.random.default_rng(0).uniform(size=(5, 28, 28, 1)).astype(np.float32)
  model = models.create_model(name, 10, x)
  params = weights.load(path, model, x)
  want = net(torch.tensor(x).permute(0, 3, 1, 2)).detach().numpy()
  np.testing.assert_allclose(model.apply(params, x), want, atol=1e-5)
  with pytest.raises(ConfigError, match=r'layer 1 differs: conv1 .* hidden_0'):
    weights.load(path, models.create_model('mlp', 10, x), x)
  (tmp_path / 'bad.pt').write_bytes(b'garbage')
  with pytest.raises(ConfigError, match='not a readable PyTorch state dict'):
    weights.load(str(tmp_path / 'bad.pt'), model, x)


def _mnist_clients(sizes, seed=0):
  x, y, _ = in_memory.load_mnist()
  order = np.random.default_rng(seed).permutation(len(y))
  xs, ys, start = [], [], 0
  for n in sizes:
    xs.append(x[order[start : start + n]])
    ys.append(y[order[start : start + n]].astype(np.int32))
    start += n
  train = pad_clients(xs, ys, x.shape[1:], x.dtype, (), np.int32)
  empty = pad_clients(
    [a[:0] for a in xs], [b[:0] for b in ys], x.shape[1:], x.dtype, (), np.int32
  )
  return (
    to_device(
      FederatedData(
        train=train,
        val=empty,
        test=train,
        groups=-np.ones(len(sizes), np.int32),
        num_classes=10,
        name='mnist_clients',
      )
    ),
    xs,
    ys,
  )


@pytest.mark.torch
@pytest.mark.parametrize('momentum', [0.0, 0.9])
# slow: 21 s on CI's 2 cores; CI keeps tests/test_engine.py's per-client
# loop against every executor
@pytest.mark.slow
def test_fedavg_round_equals_a_pytorch_loop_from_the_same_weights(
  tmp_path, momentum
):
  """One (plain SGD) or two (momentum kept per client across rounds) FedAvg
  rounds of LeNet-5: this library, started from a PyTorch state dict, and a
  plain PyTorch loop over the same batches end at the same parameters."""
  torch = pytest.importorskip('torch')
  torch.manual_seed(1)
  net = _torch_lenet5(torch, 'max')
  path = str(tmp_path / 'init.pt')
  torch.save(net.state_dict(), path)
  sizes, lr, bs = (40, 56, 23), 0.1, 16
  rounds = 1 if momentum == 0 else 2
  data, xs, ys = _mnist_clients(sizes)
  sample = data.train.x[0, :1]
  model = models.create_model('lenet5', 10, sample)
  model = model.starting_from(weights.load(path, model, sample))
  extra = (
    dict(client_momentum=momentum, client_opt_state='persistent')
    if momentum
    else {}
  )
  alg = algorithms.build(
    'fedavg', model, data, client_lr=lr, batch_size=bs, **extra
  )
  _, state = run_rounds(alg, data, rounds=rounds)
  got = state.inner.params if momentum else state.params

  # The same rounds in PyTorch: each client from the global weights, its own
  # SGD optimizer (its momentum buffers kept across rounds), the engine's
  # batches; then the n_i-weighted mean.
  batching = batching_lib.Batching(batch_size=bs, num_epochs=1)
  opts = {}
  glob = {k: v.clone() for k, v in net.state_dict().items()}
  for t in range(rounds):
    _, k_clients = jax.random.split(jax.random.key(t))
    outs = []
    for i, n in enumerate(sizes):
      _, k_batch, _ = jax.random.split(jax.random.fold_in(k_clients, i), 3)
      idx, mask = batching_lib.batch_indices(
        k_batch, jnp.int32(n), max(sizes), batching
      )
      client = _torch_lenet5(torch, 'max')
      client.load_state_dict(glob)
      opt = torch.optim.SGD(client.parameters(), lr=lr, momentum=momentum)
      if i in opts:
        opt.load_state_dict(opts[i])
      xi = torch.tensor(xs[i].astype(np.float32) / 255.0).permute(0, 3, 1, 2)
      helpers.torch_local_steps(
        torch, client, opt, xi, torch.tensor(ys[i]).long(), idx, mask
      )
      opts[i] = opt.state_dict()
      outs.append(
        {k: v.detach().clone() for k, v in client.state_dict().items()}
      )
    w = np.array(sizes, np.float64) / sum(sizes)
    glob = {k: sum(float(wi) * o[k] for wi, o in zip(w, outs)) for k in glob}
  ref = _torch_lenet5(torch, 'max')
  ref.load_state_dict(glob)
  torch.save(ref.state_dict(), str(tmp_path / 'after.pt'))
  want = weights.load(str(tmp_path / 'after.pt'), model, sample)
  moved = max_diff(want, weights.load(path, model, sample))
  assert moved > 1e-3  # training moved the weights
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(
      a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max())
    )


def _torch_reference_cnn(torch, name):
  """The seeds' own PyTorch CIFAR models, as their code defines them."""
  nn = torch.nn

  class Net(nn.Module):
    def __init__(self):
      super().__init__()
      if name == 'feddyn_cnn':  # FedDyn utils_models.py, 'cifar10'
        self.convs = nn.ModuleList([nn.Conv2d(3, 64, 5), nn.Conv2d(64, 64, 5)])
        self.fcs = nn.ModuleList(
          [nn.Linear(1600, 384), nn.Linear(384, 192), nn.Linear(192, 10)]
        )
        self.pooled = (True, True)
      elif name == 'fedfomo_cnn':  # FedFomo network.py TFConvNet
        self.convs = nn.ModuleList(
          [nn.Conv2d(3, 32, 3), nn.Conv2d(32, 64, 3), nn.Conv2d(64, 64, 3)]
        )
        self.fcs = nn.ModuleList([nn.Linear(1024, 64), nn.Linear(64, 10)])
        self.pooled = (True, True, False)
      # Reddi et al. / TFF EMNIST CNN (dropout is identity at eval)
      elif name == 'reddi_emnist_cnn':
        self.convs = nn.ModuleList([nn.Conv2d(1, 32, 3), nn.Conv2d(32, 64, 3)])
        self.fcs = nn.ModuleList([nn.Linear(9216, 128), nn.Linear(128, 62)])
        self.pooled = (False, True)
      else:  # pFedMe CifarNet
        self.convs = nn.ModuleList([nn.Conv2d(3, 6, 5), nn.Conv2d(6, 16, 5)])
        self.fcs = nn.ModuleList(
          [nn.Linear(400, 120), nn.Linear(120, 84), nn.Linear(84, 10)]
        )
        self.pooled = (True, True)

    def forward(self, x):
      for conv, pool in zip(self.convs, self.pooled):
        x = torch.relu(conv(x))
        x = torch.nn.functional.max_pool2d(x, 2) if pool else x
      x = torch.flatten(x, 1)
      for fc in self.fcs[:-1]:
        x = torch.relu(fc(x))
      return self.fcs[-1](x)

  return Net()


@pytest.mark.parametrize(
  'name', ['feddyn_cnn', 'fedfomo_cnn', 'pfedme_cnn', 'reddi_emnist_cnn']
)
@pytest.mark.torch
@pytest.mark.ci_variants('feddyn_cnn', 'reddi_emnist_cnn')
def test_reference_cnns_equal_their_pytorch_code(tmp_path, name):
  torch = pytest.importorskip('torch')
  torch.manual_seed(2)
  net = _torch_reference_cnn(torch, name)
  path = str(tmp_path / f'{name}.pt')
  torch.save(net.state_dict(), path)
  emnist = name == 'reddi_emnist_cnn'
  x = np.random.default_rng(1).uniform(
    size=(3,) + ((28, 28, 1) if emnist else (32, 32, 3))
  )
  x = x.astype(np.float32)
  model = models.create_model(name, 62 if emnist else 10, x)
  want = net(torch.tensor(x).permute(0, 3, 1, 2)).detach().numpy()
  np.testing.assert_allclose(
    model.apply(weights.load(path, model, x), x), want, atol=1e-5
  )


@pytest.mark.torch
def test_lstm_lm_is_reddi_et_al_stackoverflow_model(tmp_path):
  """Reddi et al.'s next-word LSTM: 4,050,748 parameters on 10,004 ids, and
  the outputs of the same network in PyTorch on the same weights (rows
  without PAD: a PAD input repeats the last real output, as Keras's
  ``mask_zero``, tests/test_publisher_reference.py)."""
  model = models.create_model('lstm_lm', 10004, jnp.zeros((1, 20), jnp.int32))
  assert (
    models.num_params(jax.eval_shape(model.init, jax.random.key(0)))
    == 4_050_748
  )
  assert '4,050,748' in type(model.module).__doc__
  torch = pytest.importorskip('torch')
  torch.manual_seed(3)
  vocab = 50

  class Net(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.embedding = torch.nn.Embedding(vocab, 96)
      self.lstm = torch.nn.LSTM(96, 670, batch_first=True)
      self.project = torch.nn.Linear(670, 96)
      self.output = torch.nn.Linear(96, vocab)

    def forward(self, x):
      return self.output(self.project(self.lstm(self.embedding(x))[0]))

  net = Net()
  path = str(tmp_path / 'lstm_lm.pt')
  torch.save(net.state_dict(), path)
  x = np.random.default_rng(0).integers(1, vocab, (2, 7)).astype(np.int32)
  model = models.create_model('lstm_lm', vocab, x)
  want = net(torch.tensor(x, dtype=torch.long)).detach().numpy()
  np.testing.assert_allclose(
    model.apply(weights.load(path, model, x), x), want, atol=1e-5
  )


def _keras_char_lstm_logits(w, x):
  """Reddi et al.'s Shakespeare network (google-research/federated
  ``shakespeare_models.create_recurrent_model``: Embedding(8), two
  LSTM(256, return_sequences=True), Dense(vocab)) in NumPy, from Keras's
  ``get_weights()`` list and Keras's LSTM equations (gates i, f, c, o;
  sigmoid and tanh), the weights as Keras holds them."""
  sigmoid = lambda z: 1 / (1 + np.exp(-z))
  h = w[0][x]  # embedding
  for kernel, recurrent, bias in (w[1:4], w[4:7]):
    units = recurrent.shape[0]
    hs, c, ht = [], np.zeros((x.shape[0], units)), np.zeros((x.shape[0], units))
    for t in range(x.shape[1]):
      z = h[:, t] @ kernel + ht @ recurrent + bias
      i, f, g, o = (z[:, k * units : (k + 1) * units] for k in range(4))
      c = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
      ht = sigmoid(o) * np.tanh(c)
      hs.append(ht)
    h = np.stack(hs, 1)
  return h @ w[7] + w[8]


def _keras_reference():
  """benchmarks/peers/keras_reference.py: the weights and inputs Keras's
  logits were recorded for (``tests/data/keras_char_lstm_logits.npz``)."""
  return helpers.script_module('benchmarks', 'peers', 'keras_reference.py')


def _keras_weights(tmp_path):
  ref = _keras_reference()
  w, x = ref.weights(), ref.inputs()
  path = tmp_path / 'keras.npz'
  np.savez(path, *w)
  model = models.create_model('reddi_char_lstm', ref.VOCAB, x, init='keras')
  return (
    w,
    x,
    model,
    np.asarray(model.apply(weights.load(str(path), model, x), x)),
  )


def test_keras_weights_give_keras_outputs(tmp_path):
  """A TFF/Keras character model's weights (``np.savez(path,
  *keras_model.get_weights())``, Keras's order and shapes) load onto
  ``reddi_char_lstm``: its logits equal the Keras network's, written out in
  NumPy; weights of another model name the first layer that differs."""
  w, x, model, got = _keras_weights(tmp_path)
  np.testing.assert_allclose(
    got, _keras_char_lstm_logits(w, x), rtol=1e-4, atol=1e-5
  )
  np.savez(tmp_path / 'short.npz', *w[:-2])
  with pytest.raises(
    ConfigError, match='Keras weights: the model.s layer 4, output'
  ):
    weights.load(str(tmp_path / 'short.npz'), model, x)


def test_keras_weights_give_keras_own_outputs(tmp_path):
  """The same against Keras itself: its logits recorded by Keras 3 /
  TensorFlow 2.16 (``benchmarks/peers/keras_reference.py``) for the same
  weights and inputs."""
  w, x, _, got = _keras_weights(tmp_path)
  recorded = np.load(
    os.path.join(
      os.path.dirname(__file__), 'data', 'keras_char_lstm_logits.npz'
    )
  )
  # NumPy drew the same weights
  np.testing.assert_allclose(
    [v.astype(np.float64).sum() for v in w], recorded['weight_sums'], rtol=1e-12
  )
  np.testing.assert_array_equal(x, recorded['x'])
  np.testing.assert_allclose(got, recorded['logits'], rtol=1e-4, atol=1e-5)
