"""ResNet-18 with batch normalization, as torchvision builds it: the model
PyTorch personalized-FL libraries train by default (PFLlib's ``-m resnet``
is ``torchvision.models.resnet18(pretrained=False, num_classes=...)``, given
32x32 CIFAR images as they are), and the model FedBN keeps the batch
normalization of on each client (Li et al., "FedBN: Federated Learning on
Non-IID Features via Local Batch Normalization", ICLR 2021, arXiv
2102.07623).

``BatchNorm`` is PyTorch's ``BatchNorm2d`` (momentum 0.1, epsilon 1e-5, the
running variance updated with the batch's unbiased variance, normalization
by its biased one), its statistics over the batch's real examples only
(``mask``: the engine passes the batch's, ``models.model``). Its
parameters are ``scale`` and ``bias``, its running statistics ``mean`` and
``var`` in Flax's ``batch_stats`` collection: a PyTorch ``state_dict``
(``weight``, ``bias``, ``running_mean``, ``running_var``) loads with
``--init_weights`` (``models.weights``).
"""

from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_personal.models.layers import Conv, Dense, as_float, max_pool

__all__ = ['BatchNorm', 'BasicBlock', 'ResNetBN']


class BatchNorm(nn.Module):
  """PyTorch's ``BatchNorm2d`` over the last axis (module doc).

  Attributes:
    momentum: PyTorch's: running = (1 - momentum) running + momentum batch.
    epsilon: added to the variance.
  """

  momentum: float = 0.1
  epsilon: float = 1e-5
  #: The engine gives it the batch's real examples as ``mask``
  #: (``models.model``).
  masks_examples = True

  @nn.compact
  def __call__(
    self, x, use_running_average: bool, mask: Optional[jax.Array] = None
  ):
    c = x.shape[-1]
    scale = self.param('scale', nn.initializers.ones, (c,))
    bias = self.param('bias', nn.initializers.zeros, (c,))
    ra_mean = self.variable(
      'batch_stats', 'mean', lambda: jnp.zeros((c,), jnp.float32)
    )
    ra_var = self.variable(
      'batch_stats', 'var', lambda: jnp.ones((c,), jnp.float32)
    )
    if use_running_average:
      mean, var = ra_mean.value, ra_var.value
    else:
      axes = tuple(range(x.ndim - 1))
      w = (
        jnp.ones(x.shape[:-1] + (1,), x.dtype)
        if mask is None
        else jnp.broadcast_to(
          mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim)),
          x.shape[:-1] + (1,),
        ).astype(x.dtype)
      )
      n = jnp.sum(w)
      mean = jnp.sum(x * w, axes) / jnp.maximum(n, 1.0)
      var = jnp.sum(w * jnp.square(x - mean), axes) / jnp.maximum(n, 1.0)
      if not self.is_initializing():
        unbiased = var * n / jnp.maximum(n - 1.0, 1.0)
        ra_mean.value = (
          1 - self.momentum
        ) * ra_mean.value + self.momentum * mean
        ra_var.value = (
          1 - self.momentum
        ) * ra_var.value + self.momentum * unbiased
    return (x - mean) * jax.lax.rsqrt(var + self.epsilon) * scale + bias


def _conv(features: int, kernel: int, stride: int, name: str, impl: str):
  """torchvision's bias-free convolution: padding kernel // 2,
  Kaiming-normal fan-out weights (its ``ResNet.__init__``)."""
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
    kernel_init=jax.nn.initializers.variance_scaling(2.0, 'fan_out', 'normal'),
  )


class BasicBlock(nn.Module):
  """torchvision's ``BasicBlock``.

  Conv-bn-relu-conv-bn, plus the input (through a strided 1x1 convolution and
  its norm where the shape changes), then ReLU."""

  planes: int
  stride: int = 1
  conv_impl: str = 'auto'

  @nn.compact
  def __call__(self, x, train: bool = False):
    norm = lambda name: BatchNorm(name=name)
    out = _conv(self.planes, 3, self.stride, 'conv1', self.conv_impl)(x)
    out = nn.relu(norm('bn1')(out, not train))
    out = _conv(self.planes, 3, 1, 'conv2', self.conv_impl)(out)
    out = norm('bn2')(out, not train)
    if self.stride != 1 or x.shape[-1] != self.planes:
      x = norm('downsample_bn')(
        _conv(self.planes, 1, self.stride, 'downsample_conv', self.conv_impl)(
          x
        ),
        not train,
      )
    return nn.relu(out + x)


class ResNetBN(nn.Module):
  """torchvision's ``resnet18``.

  A 7x7 stride-2 stem, its norm, ReLU, a 3x3 stride-2 max pool, four stages of
  two ``BasicBlock`` s (64, 128, 256, 512 planes), global average pooling, the
  output layer (11,181,642 parameters and 9,600 running statistics at 10
  classes). Images [B, H, W, C] -> logits; ``train`` as Flax's convention (batch
  statistics and their update, ``models.from_flax``)."""

  num_classes: int
  stages: Sequence[int] = (2, 2, 2, 2)
  conv_impl: str = 'auto'

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = _conv(64, 7, 2, 'conv1', self.conv_impl)(as_float(x))
    x = nn.relu(BatchNorm(name='bn1')(x, not train))
    x = max_pool(x, 3, 2, 1, self.conv_impl)
    for s, (blocks, planes) in enumerate(zip(self.stages, (64, 128, 256, 512))):
      for b in range(blocks):
        x = BasicBlock(
          planes,
          2 if s and not b else 1,
          self.conv_impl,
          name=f'layer{s + 1}_{b}',
        )(x, train)
    return Dense(self.num_classes, convention='pytorch', name='output')(
      x.mean(axis=(1, 2))
    )
