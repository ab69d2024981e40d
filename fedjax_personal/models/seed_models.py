"""The partial-personalization seed's models, and Reddi et al.'s ResNet-18.

"Federated Learning with Partial Model Personalization" (Pillutla et al.,
arXiv 2204.03809) trains a word-level transformer on Stack Overflow and a
ResNet-18 with GroupNorm on EMNIST (and GLDv2); its code
(facebookresearch/FL_partial_personalization, ``pfl/models``) adds residual
adapters to either for the 'adapter' personal part. These modules follow that
code layer by layer, with its initialisation, so that its PyTorch weights
(converted, ``--init_weights``) give the same outputs (tested):

* ``TransformerLM`` (``wordlm_transformer.py``): word and learned positional
  embeddings (the word embedding scaled by sqrt(d), ``relu(word + position)``),
  post-norm blocks (bias-free Q/K/V/output projections, causal softmax
  attention scaled by 1/sqrt(head dim), LayerNorm(x + attention), a ReLU MLP,
  LayerNorm(u + MLP(u))), then the decoder and a separate output bias.
  Everything drawn from N(0, 0.02), biases 0. The code ties the decoder to
  the word embedding and unties it (a copy) when the input or output layer is
  personal; ``transformer_lm`` is untied, ``transformer_lm_tied`` tied. Sizes
  are the code's ``--arch_size``: ``mini`` (the paper's: 4 layers, 4 heads of
  64, d = 256, MLP 1,024: 8,292,116 parameters untied on 10,004 ids,
  5,731,092 tied, the paper's "about 6M") and
  ``tiny`` (2, 2, 128, 512).
* ``ResNetGN`` (``resnet_utils.py``): ResNet-18 (2, 2, 2, 2 basic blocks of
  64, 128, 256, 512 channels) with GroupNorm in place of BatchNorm (the code's
  table: 8 channels per group up to 64 channels, 16 above) and, for 28x28 /
  32x32 inputs, a 3x3 stride-1 stem without max pooling; convolutions
  bias-free from Kaiming-normal (fan out), norms 1 / 0, the classifier
  PyTorch's default. Reddi et al.'s CIFAR-100 ResNet-18 ("Adaptive Federated
  Optimization", arXiv 2003.00295) is the ImageNet stem (7x7 stride 2, 3x3
  max pool) with GroupNorm of 2 groups (``reddi_resnet18_gn``); the seed's
  GLDv2 model (``gldv2_resnet.py``, ``original_size``) is that stem with the
  code's GroupNorm table (``gldv2_resnet18_gn``).

Adapters as the seed's code places them (and with its quirks, which the
tests hold): in a transformer block, one after the attention's output
projection and one on the MLP's skip branch (the code applies the second to
``u``, the block's post-attention state, not to the MLP's output), each
``x + W2 relu(W1 x)`` from N(0, 0.01); in a residual block, ``out + A(out)``
after each convolution with ``A(x) = x + conv1x1(GroupNorm(x))`` (so the
identity counts twice; the GroupNorm that follows undoes the scale) from
N(0, 1e-4).

Module names make the personal parts (``core.personalization``) those of the
seed: 'input' is ``embed`` (word and positions) / ``stem`` (first conv and
its norm); 'output' is ``output``; 'adapter' is every adapter and every
``norm*`` layer (the seed's adapters + LayerNorms / bn1, bn2, stem norm; a
shortcut's norm is ``down_norm``, not personal); ``block:<i>`` is
``block_<i>`` (transformer blocks from 0, ResNet stages 1-4, as the code
numbers them).
"""

import math
from typing import Any, Dict, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_personal.models.layers import Conv, Dense, as_float, max_pool

__all__ = [
  'ConvAdapter',
  'LMEmbedding',
  'LMOutput',
  'ResidualUnit',
  'ResNetGN',
  'Stage',
  'Stem',
  'TRANSFORMER_SIZES',
  'TransformerAdapter',
  'TransformerBlock',
  'TransformerLM',
]


_N002 = jax.nn.initializers.normal(0.02)

#: The seed code's transformer sizes (``pfl/utils.py``, ``--arch_size``):
#: (layers, heads, d, head dim, MLP width).
TRANSFORMER_SIZES = {
  'tiny': (2, 2, 128, 64, 512),
  'mini': (4, 4, 256, 64, 1024),
  'half': (6, 6, 384, 64, 1536),
  'medium': (8, 8, 512, 64, 2048),
  'base': (12, 12, 768, 64, 1536),
}


class TransformerAdapter(nn.Module):
  """The seed's ``AdapterBlock``: x + W2 relu(W1 x), weights from N(0, 0.01)."""

  dim: int

  @nn.compact
  def __call__(self, x):
    init: Dict[str, Any] = dict(
      kernel_init=jax.nn.initializers.normal(0.01),
      bias_init=jax.nn.initializers.zeros,
    )
    z = nn.relu(nn.Dense(self.dim, name='down', **init)(x))
    return x + nn.Dense(x.shape[-1], name='up', **init)(z)


class TransformerBlock(nn.Module):
  """One post-norm block of the seed's ``TransformerBlock`` ([B, T, d])."""

  heads: int
  head_dim: int
  fc_dim: int
  adapter_dim: int = 0

  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    proj = lambda f, name: nn.Dense(
      f, use_bias=False, kernel_init=_N002, name=name
    )
    hk = self.heads * self.head_dim
    q, k, v = (
      proj(hk, n)(x).reshape(b, t, self.heads, self.head_dim)
      for n in ('wq', 'wk', 'wv')
    )
    scores = jnp.einsum('bqhk,bshk->bhqs', q, k) / math.sqrt(self.head_dim)
    causal = jnp.tril(jnp.ones((t, t), bool))
    alpha = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    u = proj(d, 'wc')(jnp.einsum('bhqs,bshk->bqhk', alpha, v).reshape(b, t, hk))
    if self.adapter_dim:
      u = TransformerAdapter(self.adapter_dim, name='adapter1')(u)
    norm = lambda name: nn.LayerNorm(epsilon=1e-5, name=name)
    u = norm('norm1')(x + u)
    dense = lambda f, name: nn.Dense(
      f, kernel_init=_N002, bias_init=jax.nn.initializers.zeros, name=name
    )
    z = dense(d, 'w2')(nn.relu(dense(self.fc_dim, 'w1')(u)))
    if self.adapter_dim:  # the seed's code: on u, the MLP's skip branch
      u = TransformerAdapter(self.adapter_dim, name='adapter2')(u)
    return norm('norm2')(u + z)


class LMEmbedding(nn.Module):
  """Word and position embeddings of the seed's language model.

  Word embedding (scaled by sqrt(d)) plus learned positions, through a
  ReLU (``word`` and ``position``: the seed's 'inp_layer')."""

  vocab: int
  dim: int

  @nn.compact
  def __call__(self, x):
    word = nn.Embed(self.vocab, self.dim, embedding_init=_N002, name='word')
    position = nn.Embed(
      x.shape[1], self.dim, embedding_init=_N002, name='position'
    )
    return nn.relu(
      word(x) * math.sqrt(self.dim) + position(jnp.arange(x.shape[1]))[None]
    )


class LMOutput(nn.Module):
  """The output layer of the seed's language model.

  The decoder (tied: the word embedding, given) and the seed's output
  bias, a parameter of its own (the seed's 'out_layer')."""

  vocab: int
  tied: bool

  @nn.compact
  def __call__(self, z, word_embedding):
    logits = (
      z @ word_embedding.T
      if self.tied
      else nn.Dense(
        self.vocab, use_bias=False, kernel_init=_N002, name='decoder'
      )(z)
    )
    return logits + self.param('bias', jax.nn.initializers.zeros, (self.vocab,))


class TransformerLM(nn.Module):
  """The seed's ``WordLMTransformer``: int tokens [B, T] -> logits [B, T, V].

  ``convention`` is accepted for the registry's sake: the seed's own
  initialisation (N(0, 0.02), LayerNorm 1 / 0) is used whatever it says.
  """

  num_classes: int  # the vocabulary with PAD, BOS, EOS and OOV ids
  size: str = 'mini'
  adapter_dim: int = 0
  tied: bool = False
  convention: str = 'pytorch'

  def setup(self):
    layers, heads, d, head_dim, fc = TRANSFORMER_SIZES[self.size]
    self.embed = LMEmbedding(self.num_classes, d)
    self.blocks = [
      TransformerBlock(heads, head_dim, fc, self.adapter_dim, name=f'block_{i}')
      for i in range(layers)
    ]
    self.output = LMOutput(self.num_classes, self.tied)

  def features(self, x):
    z = self.embed(x)
    for block in self.blocks:
      z = block(z)
    return z

  def __call__(self, x):
    z = self.features(x)
    word = (
      self.embed.variables['params']['word']['embedding'] if self.tied else None
    )
    return self.output(z, word)


GROUPS_PER_CHANNELS = {
  16: 2,
  32: 4,
  64: 8,
  128: 8,
  256: 16,
  512: 32,
  1024: 32,
  2048: 32,
}


def _group_norm(channels: int, groups: int, name: str):
  """The seed's ``create_group_norm`` (``groups`` 0: its table) with
  PyTorch's epsilon."""
  return nn.GroupNorm(
    num_groups=groups or GROUPS_PER_CHANNELS[channels], epsilon=1e-5, name=name
  )


def _conv(features, kernel, stride, name, impl, init=None):
  """The seed's bias-free convolution (PyTorch's padding of kernel // 2,
  Kaiming-normal fan-out weights unless ``init``), computed by ``impl``
  (``layers.Conv``: on a CPU a matmul over slices, which XLA:CPU runs
  10-25x faster than its own convolution inside a loop of local steps)."""
  pad = kernel // 2
  return Conv(
    features,
    (kernel, kernel),
    strides=(stride, stride),
    padding=((pad, pad), (pad, pad)),
    use_bias=False,
    name=name,
    impl=impl,
    layout='NHWC',
    kernel_init=init
    or jax.nn.initializers.variance_scaling(2.0, 'fan_out', 'normal'),
  )


class ConvAdapter(nn.Module):
  """The seed's residual convolutional adapter.

  The seed's residual-block ``AdapterBlock``: x + conv1x1(GroupNorm(x)),
  the convolution from N(0, 1e-4), bias-free."""

  groups: int = 0
  conv_impl: str = 'auto'

  @nn.compact
  def __call__(self, x):
    c = x.shape[-1]
    h = _group_norm(c, self.groups, 'norm')(x)
    return x + _conv(
      c, 1, 1, 'conv', self.conv_impl, jax.nn.initializers.normal(1e-4)
    )(h)


class ResidualUnit(nn.Module):
  """The seed's ``ResidualBlock`` (a basic block), adapters optional."""

  planes: int
  stride: int = 1
  groups: int = 0
  adapters: bool = False
  conv_impl: str = 'auto'

  @nn.compact
  def __call__(self, x):
    impl = self.conv_impl
    out = _conv(self.planes, 3, self.stride, 'conv1', impl)(x)
    if self.adapters:
      out = out + ConvAdapter(self.groups, impl, name='adapter1')(out)
    out = nn.relu(_group_norm(self.planes, self.groups, 'norm1')(out))
    out = _conv(self.planes, 3, 1, 'conv2', impl)(out)
    if self.adapters:
      out = out + ConvAdapter(self.groups, impl, name='adapter2')(out)
    out = _group_norm(self.planes, self.groups, 'norm2')(out)
    if self.stride != 1 or x.shape[-1] != self.planes:
      x = _group_norm(self.planes, self.groups, 'down_norm')(
        _conv(self.planes, 1, self.stride, 'down_conv', impl)(x)
      )
    return nn.relu(out + x)


class Stem(nn.Module):
  """The first convolution and its norm (the seed's 'inp_layer')."""

  large: bool
  groups: int
  conv_impl: str = 'auto'

  @nn.compact
  def __call__(self, x):
    x = _conv(
      64, 7 if self.large else 3, 2 if self.large else 1, 'conv', self.conv_impl
    )(x)
    x = nn.relu(_group_norm(64, self.groups, 'norm')(x))
    if self.large:
      x = max_pool(x, 3, 2, 1, self.conv_impl)
    return x


class Stage(nn.Module):
  """A ResNet stage (the seed's ``layer<i>``): ``blocks`` residual units."""

  planes: int
  blocks: int
  stride: int
  groups: int
  adapters: bool
  conv_impl: str = 'auto'

  @nn.compact
  def __call__(self, x):
    for b in range(self.blocks):
      x = ResidualUnit(
        self.planes,
        self.stride if b == 0 else 1,
        self.groups,
        self.adapters,
        self.conv_impl,
        name=f'unit_{b}',
      )(x)
    return x


class ResNetGN(nn.Module):
  """ResNet-18 with GroupNorm: images [B, H, W, C] -> logits."""

  num_classes: int
  stages: Sequence[int] = (2, 2, 2, 2)
  adapter_dim: int = 0  # > 0: the seed's adapters (their width is the block's)
  groups: int = 0  # 0: the seed's table; Reddi et al.: 2
  large_stem: bool = False
  convention: str = 'pytorch'
  conv_impl: str = 'auto'  # layers.CONV_IMPLS

  def setup(self):
    self.stem = Stem(self.large_stem, self.groups, self.conv_impl)
    self.stage_modules = [
      Stage(
        planes,
        n,
        2 if s else 1,
        self.groups,
        bool(self.adapter_dim),
        self.conv_impl,
        name=f'block_{s + 1}',
      )
      for s, (n, planes) in enumerate(zip(self.stages, (64, 128, 256, 512)))
    ]
    self.output = Dense(self.num_classes, convention=self.convention)

  def features(self, x):
    x = self.stem(as_float(x))
    for stage in self.stage_modules:
      x = stage(x)
    return x.mean(axis=(1, 2))

  def __call__(self, x):
    return self.output(self.features(x))
