"""The partial-personalization seed's transformer and ResNet-18 GN (and Reddi
et al.'s ResNet-18): parameter counts, the seed's personal parts, and the
outputs of the seed's own PyTorch code (its classes as written, adapters and
their quirks included) on the same weights given through ``--init_weights``."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_personal import models
from fedjax_personal.core.personalization import make_split
from fedjax_personal.models import weights


def _params(name, classes, x, adapter_dim=0):
  model = models.create_model(name, classes, x, adapter_dim)
  return model, jax.eval_shape(model.init, jax.random.key(0))


@pytest.mark.parametrize(
  'name,shape,classes,count',
  [
    ('transformer_lm', (20,), 10004, 8_292_116),
    ('transformer_lm_tied', (20,), 10004, 5_731_092),
    ('resnet18_gn', (28, 28, 1), 62, 11_199_486),
    ('reddi_resnet18_gn', (32, 32, 3), 100, 11_227_812),
    # torchvision's resnet18 (11,689,512 with 1,000 classes) with a 2,028-way
    # head
    (
      'gldv2_resnet18_gn',
      (224, 224, 3),
      2028,
      11_689_512 - 513_000 + 513 * 2028,
    ),
  ],
)
def test_parameter_counts(name, shape, classes, count):
  x = jnp.zeros((1,) + shape, jnp.int32 if len(shape) == 1 else jnp.float32)
  assert models.num_params(_params(name, classes, x)[1]) == count


def _personal(spec, params, depth=3):
  return sorted(
    {
      '/'.join(p.split('/')[:depth])
      for p in make_split(spec, params).split(params)[1]
    }
  )


def test_personal_parts_are_the_seeds():
  """input / output / adapter / block:<i> name what the seed's
  ``split_server_and_client_params`` sends to the clients."""
  _, p = _params(
    'transformer_lm_tiny', 50, jnp.zeros((1, 8), jnp.int32), adapter_dim=4
  )
  assert _personal('input', p) == [
    'embed/position/embedding',
    'embed/word/embedding',
  ]
  assert _personal('output', p) == ['output/bias', 'output/decoder/kernel']
  assert _personal('adapter', p, 2) == [
    f'block_{i}/{m}'
    for i in range(2)
    for m in ('adapter1', 'adapter2', 'norm1', 'norm2')
  ]
  assert _personal('block:1', p, 2) == sorted(
    f'block_1/{m}'
    for m in (
      'adapter1',
      'adapter2',
      'norm1',
      'norm2',
      'w1',
      'w2',
      'wc',
      'wk',
      'wq',
      'wv',
    )
  )
  with pytest.raises(ValueError, match='no block_7'):
    make_split('block:7', p)
  _, p = _params('resnet18_gn', 62, jnp.zeros((1, 28, 28, 1)), adapter_dim=1)
  assert _personal('input', p) == [
    'stem/conv/kernel',
    'stem/norm/bias',
    'stem/norm/scale',
  ]
  adapter = make_split('adapter', p).split(p)[1]
  assert (
    'stem/norm/scale' in adapter and 'block_2/unit_0/norm1/scale' in adapter
  )
  assert 'block_2/unit_0/adapter2/conv/kernel' in adapter
  assert not any(
    'down_norm' in k or k.endswith('conv1/kernel') for k in adapter
  )
  _, plain = _params('transformer_lm_tiny', 50, jnp.zeros((1, 8), jnp.int32))
  with pytest.raises(ValueError, match='its adapter_dim is 0'):
    make_split('adapter', plain)


# -- The seed's PyTorch code (pfl/models/wordlm_transformer.py,
# resnet_utils.py),
# -- dropout left out (0 in its runs' evaluation).


def _seed_transformer(
  torch, vocab, seq_len, d, heads, k, fc, layers, adapter_dim, tied
):
  nn, relu, softmax = torch.nn, torch.relu, torch.softmax

  class AdapterBlock(nn.Module):
    def __init__(self, input_dim, hidden):
      super().__init__()
      self.linear1, self.linear2 = (
        nn.Linear(input_dim, hidden),
        nn.Linear(hidden, input_dim),
      )
      for m in (self.linear1, self.linear2):
        nn.init.normal_(m.weight, 0, 0.01)
        # nonzero here, so that the test sees the biases
        nn.init.normal_(m.bias, 0, 0.01)

    def forward(self, x):
      return x + self.linear2(relu(self.linear1(x)))

  class Block(nn.Module):
    def __init__(self):
      super().__init__()
      self.wq, self.wk, self.wv = (
        nn.Linear(d, heads * k, bias=False) for _ in range(3)
      )
      self.wc = nn.Linear(heads * k, d, bias=False)
      self.w1, self.w2 = nn.Linear(d, fc), nn.Linear(fc, d)
      self.layernorm1, self.layernorm2 = nn.LayerNorm(d), nn.LayerNorm(d)
      for m in (self.wq, self.wk, self.wv, self.wc, self.w1, self.w2):
        nn.init.normal_(m.weight, 0, 0.02)
      for m in (self.w1, self.w2, self.layernorm1, self.layernorm2):
        nn.init.normal_(m.bias, 0, 0.1)
      self.use_adapter = bool(adapter_dim)
      if adapter_dim:
        self.adapter1, self.adapter2 = (
          AdapterBlock(d, adapter_dim),
          AdapterBlock(d, adapter_dim),
        )

    def forward(self, x, mask):
      t, b, _ = x.shape
      q, kk, v = (
        w(x).contiguous().view(t, b * heads, k).transpose(0, 1)
        for w in (self.wq, self.wk, self.wv)
      )
      alpha = softmax(
        (torch.bmm(q, kk.transpose(1, 2)) + mask) / math.sqrt(k), dim=-1
      )
      u = torch.bmm(alpha, v).transpose(0, 1).contiguous().view(t, b, heads * k)
      u = self.wc(u)
      if self.use_adapter:
        u = self.adapter1(u)
      u = self.layernorm1(x + u)
      z = self.w2(relu(self.w1(u)))
      if self.use_adapter:
        u = self.adapter2(u)  # the seed's code: on u
      return self.layernorm2(u + z)

  class WordLMTransformer(nn.Module):
    def __init__(self):
      super().__init__()
      self.positional_embedding = nn.Embedding(seq_len, d)
      self.word_embedding = nn.Embedding(vocab, d)
      self.transformer = nn.ModuleList([Block() for _ in range(layers)])
      if not tied:
        self.decoder = nn.Linear(d, vocab, bias=False)
        nn.init.normal_(self.decoder.weight, 0, 0.02)
      self.bias = nn.Parameter(torch.randn(vocab) * 0.1)
      nn.init.normal_(self.positional_embedding.weight, 0, 0.02)
      nn.init.normal_(self.word_embedding.weight, 0, 0.02)

    def forward(self, x):  # x: (seq_len, batch)
      mask = torch.triu(torch.ones(len(x), len(x)))
      mask = (
        mask.masked_fill(mask == 0, float('-inf')).masked_fill(mask == 1, 0.0).T
      )
      z = relu(
        self.word_embedding(x) * math.sqrt(d)
        + self.positional_embedding(torch.arange(len(x)))[:, None, :]
      )
      for layer in self.transformer:
        z = layer(z, mask)
      out = z @ self.word_embedding.weight.t() if tied else self.decoder(z)
      return out + self.bias

  return WordLMTransformer()


_TRANSFORMER_NAMES = [
  (r'positional_embedding\.weight', 'embed/position/embedding'),
  (r'word_embedding\.weight', 'embed/word/embedding'),
  (r'transformer\.(\d+)\.(w[qkvc12])\.(weight|bias)', r'block_\1/\2/\3'),
  (r'transformer\.(\d+)\.layernorm(\d)\.(weight|bias)', r'block_\1/norm\2/\3'),
  (
    r'transformer\.(\d+)\.(adapter\d)\.linear1\.(weight|bias)',
    r'block_\1/\2/down/\3',
  ),
  (
    r'transformer\.(\d+)\.(adapter\d)\.linear2\.(weight|bias)',
    r'block_\1/\2/up/\3',
  ),
  (r'decoder\.weight', 'output/decoder/weight'),
  (r'bias', 'output/bias'),
]

_RESNET_NAMES = [
  (r'conv1\.weight', 'stem/conv/weight'),
  (r'bn1\.(weight|bias)', r'stem/norm/\1'),
  (r'layer(\d)\.(\d)\.conv(\d)\.weight', r'block_\1/unit_\2/conv\3/weight'),
  (r'layer(\d)\.(\d)\.bn(\d)\.(weight|bias)', r'block_\1/unit_\2/norm\3/\4'),
  (
    r'layer(\d)\.(\d)\.downsample\.0\.weight',
    r'block_\1/unit_\2/down_conv/weight',
  ),
  (
    r'layer(\d)\.(\d)\.downsample\.1\.(weight|bias)',
    r'block_\1/unit_\2/down_norm/\3',
  ),
  (
    r'layer(\d)\.(\d)\.(adapter\d)\.bn\.(weight|bias)',
    r'block_\1/unit_\2/\3/norm/\4',
  ),
  (
    r'layer(\d)\.(\d)\.(adapter\d)\.conv\.weight',
    r'block_\1/unit_\2/\3/conv/weight',
  ),
  (r'fc\.(weight|bias)', r'output/\1'),
]


def _as_flax(state_dict, rules, norms=('norm',)):
  """The seed's state dict as Flax parameter paths: Linear weights
  transposed, Conv2d OIHW -> HWIO, norm weights as scales."""
  out = {}
  for key, value in state_dict.items():
    a = value.detach().numpy()
    path = next(
      re.sub(f'^{pat}$', rep, key)
      for pat, rep in rules
      if re.fullmatch(pat, key)
    )
    layer, leaf = path.rsplit('/', 1)
    is_norm = any(layer.split('/')[-1].startswith(n) for n in norms)
    if leaf == 'weight' and is_norm:
      leaf = 'scale'
    elif leaf == 'weight' and a.ndim == 4:
      leaf, a = 'kernel', a.transpose(2, 3, 1, 0)
    elif (
      leaf == 'weight'
      and a.ndim == 2
      and not layer.endswith(('embedding', 'position', 'word'))
    ):
      leaf, a = 'kernel', a.T
    out[f'{layer}/{leaf}' if leaf != 'weight' else layer] = a
  return out


@pytest.mark.torch
@pytest.mark.parametrize('tied,adapter_dim', [(False, 3), (True, 0)])
@pytest.mark.slow_variants('False-3')
def test_transformer_equals_the_seeds_pytorch_code(tmp_path, tied, adapter_dim):
  torch = pytest.importorskip('torch')
  torch.manual_seed(0)
  vocab, seq = 40, 7
  net = _seed_transformer(
    torch, vocab, seq, 128, 2, 64, 512, 2, adapter_dim, tied
  )
  x = np.random.default_rng(0).integers(0, vocab, (3, seq)).astype(np.int32)
  name = 'transformer_lm_tied' if tied else 'transformer_lm'
  model = models.TransformerLM(
    vocab, 'tiny', adapter_dim=adapter_dim, tied=tied
  )
  model = models.from_flax(name, model, x)
  path = str(tmp_path / 'w.npz')
  np.savez(path, **_as_flax(net.state_dict(), _TRANSFORMER_NAMES))
  want = (
    net(torch.tensor(x.T, dtype=torch.long)).detach().numpy().transpose(1, 0, 2)
  )
  got = model.apply(weights.load(path, model, x), x)
  np.testing.assert_allclose(got, want, atol=1e-5)


def _seed_resnet(torch, classes, in_ch, adapters, groups, large):
  nn = torch.nn
  table = {64: 8, 128: 8, 256: 16, 512: 32}
  gn = lambda c: nn.GroupNorm(groups or table[c], c)

  def randomize(norm):  # the code starts norms at 1 / 0; the test moves them
    nn.init.normal_(norm.weight, 1, 0.1)
    nn.init.normal_(norm.bias, 0, 0.1)
    return norm

  class AdapterBlock(nn.Module):
    def __init__(self, planes):
      super().__init__()
      self.bn = randomize(gn(planes))
      self.conv = nn.Conv2d(planes, planes, 1, bias=False)
      nn.init.normal_(self.conv.weight, 0, 1e-2)

    def forward(self, x):
      return self.conv(self.bn(x)) + x

  class ResidualBlock(nn.Module):
    def __init__(self, inplanes, planes, stride, downsample):
      super().__init__()
      self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
      self.bn1 = randomize(gn(planes))
      self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
      self.bn2 = randomize(gn(planes))
      self.downsample = downsample
      if adapters:
        self.adapter1, self.adapter2 = (
          AdapterBlock(planes),
          AdapterBlock(planes),
        )

    def forward(self, x):
      out = self.conv1(x)
      if adapters:
        out = out + self.adapter1(out)
      out = torch.relu(self.bn1(out))
      out = self.conv2(out)
      if adapters:
        out = out + self.adapter2(out)
      out = self.bn2(out)
      identity = x if self.downsample is None else self.downsample(x)
      return torch.relu(out + identity)

  class ResNetGN(nn.Module):
    def __init__(self):
      super().__init__()
      self.inplanes = 64
      self.conv1 = (
        nn.Conv2d(in_ch, 64, 7, 2, 3, bias=False)
        if large
        else nn.Conv2d(in_ch, 64, 3, 1, 1, bias=False)
      )
      self.bn1 = randomize(gn(64))
      self.maxpool = nn.MaxPool2d(3, 2, 1) if large else nn.Identity()
      self.layer1 = self._make_layer(64, 2)
      self.layer2 = self._make_layer(128, 2, 2)
      self.layer3 = self._make_layer(256, 2, 2)
      self.layer4 = self._make_layer(512, 2, 2)
      self.fc = nn.Linear(512, classes)

    def _make_layer(self, planes, blocks, stride=1):
      down = None
      if stride != 1 or self.inplanes != planes:
        down = nn.Sequential(
          nn.Conv2d(self.inplanes, planes, 1, stride, bias=False),
          randomize(gn(planes)),
        )
      layers = [ResidualBlock(self.inplanes, planes, stride, down)]
      self.inplanes = planes
      layers += [
        ResidualBlock(planes, planes, 1, None) for _ in range(1, blocks)
      ]
      return nn.Sequential(*layers)

    def forward(self, x):
      x = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
      x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
      return self.fc(
        torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1)
      )

  return ResNetGN()


# the seed's 224 x 224: the same layers
@pytest.mark.parametrize(
  'name,shape,classes,adapters',
  [
    ('resnet18_gn', (28, 28, 1), 62, True),
    ('reddi_resnet18_gn', (32, 32, 3), 100, False),
    ('gldv2_resnet18_gn', (32, 32, 3), 2028, True),
  ],
)
@pytest.mark.torch
# slow: ResNet-18 compiled on both sides (25-33 s on CI's 2 cores)
@pytest.mark.slow
def test_resnet_equals_the_seeds_pytorch_code(
  tmp_path, name, shape, classes, adapters
):
  torch = pytest.importorskip('torch')
  torch.manual_seed(1)
  reddi = name == 'reddi_resnet18_gn'
  net = _seed_resnet(
    torch,
    classes,
    shape[-1],
    adapters,
    2 if reddi else 0,
    large=name != 'resnet18_gn',
  )
  x = np.random.default_rng(1).normal(size=(2,) + shape).astype(np.float32)
  model = models.create_model(
    name, classes, x, adapter_dim=1 if adapters else 0
  )
  path = str(tmp_path / 'w.npz')
  np.savez(
    path,
    **_as_flax(net.state_dict(), _RESNET_NAMES, norms=('norm', 'down_norm')),
  )
  want = net(torch.tensor(x).permute(0, 3, 1, 2)).detach().numpy()
  got = model.apply(weights.load(path, model, x), x)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_next_word_accuracy_scores_in_vocabulary_targets_only():
  """Loss over every non-pad target; accuracy over the targets that are not
  PAD, BOS, EOS or OOV (Reddi et al.'s and the seed's), by hand."""
  from fedjax_personal.core.engine import summarize
  from fedjax_personal.core.training import per_example_stats
  from fedjax_personal.datasets import stackoverflow

  v = 7  # PAD 0, BOS 1, EOS 2, words 3-5, OOV 6
  y = jnp.array([[3, 4, 2, -1], [6, 5, 5, 2]])
  pred = jnp.array([[3, 0, 2, 0], [6, 5, 4, 2]])  # right on 3, EOS, OOV, 5, EOS
  logits = jax.nn.one_hot(pred, v) * 5.0
  # second guesses: 4, then 5
  logits = logits.at[0, 1, 4].set(4.0).at[1, 2, 5].set(3.0)
  stats = per_example_stats(
    logits,
    y,
    jnp.array([True, True]),
    unscored=stackoverflow.stackoverflow_unscored(v),
    top_k=2,
  )
  # words 3, 4 / 5, 5
  assert float(stats.count) == 7 and float(stats.scored) == 4
  assert float(stats.correct) == 2  # 3 and the first 5
  assert float(stats.correct_top_k) == 4  # all four in the top 2
  plain = per_example_stats(logits, y, jnp.array([True, True]))
  assert float(plain.correct) == 5 and float(plain.scored) == 7
  np.testing.assert_allclose(float(stats.loss_sum), float(plain.loss_sum))
  per_client = jax.tree.map(lambda a: jnp.stack([a, a]), stats)
  summary = summarize(per_client)
  assert summary['accuracy_mean'] == pytest.approx(0.5)
  assert summary['accuracy_top_k_mean'] == pytest.approx(1.0)
  assert 'accuracy_top_k_mean' not in summarize(
    jax.tree.map(lambda a: jnp.stack([a, a]), plain)
  )
