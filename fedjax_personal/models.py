"""Models (Flax Linen) and the pure (init, apply) pair the engine uses.
All image models take float or uint8 images [B, H, W, C] (uint8 is scaled to
[0, 1] inside the model, so data can be stored compactly) and return logits.
"""

import dataclasses
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_personal.config import ConfigError


def _as_float(x):
  if jnp.issubdtype(x.dtype, jnp.integer):
    return x.astype(jnp.float32) / 255.0
  return x.astype(jnp.float32)


class Adapter(nn.Module):
  """A residual adapter h + W2 relu(W1 h) (Houlsby et al. 2019), W2 zero at
  init so that a model with adapters starts as the model without them."""
  dim: int

  @nn.compact
  def __call__(self, h):
    z = nn.relu(nn.Dense(self.dim, name='down')(h))
    return h + nn.Dense(h.shape[-1], kernel_init=nn.initializers.zeros, name='up')(z)


class LogisticRegression(nn.Module):
  """Multinomial logistic regression on flattened inputs."""
  num_classes: int

  def setup(self):
    self.output = nn.Dense(self.num_classes)

  def features(self, x):
    return _as_float(x).reshape((x.shape[0], -1))

  def __call__(self, x):
    return self.output(self.features(x))


class MLP(nn.Module):
  """Fully connected ReLU network (FedAvg's 2NN with hidden=(200, 200))."""
  num_classes: int
  hidden: Sequence[int] = (200, 200)
  adapter_dim: int = 0

  def setup(self):
    self.hidden_layers = [nn.Dense(h, name=f'hidden_{i}') for i, h in enumerate(self.hidden)]
    if self.adapter_dim:
      self.adapters = [Adapter(self.adapter_dim, name=f'adapter_{i}') for i in range(len(self.hidden))]
    self.output = nn.Dense(self.num_classes)

  def features(self, x):
    """The penultimate representation (input to the output layer)."""
    x = _as_float(x).reshape((x.shape[0], -1))
    for i, layer in enumerate(self.hidden_layers):
      x = nn.relu(layer(x))
      if self.adapter_dim:
        x = self.adapters[i](x)
    return x

  def __call__(self, x):
    return self.output(self.features(x))


class LeNet5(nn.Module):
  """LeNet-5 (LeCun et al. 1998), the model of the user-centric FL paper.

  conv 6@5x5 (same padding on 28x28) - max pool - conv 16@5x5 - max pool -
  dense 120 - dense 84 - dense num_classes.
  """
  num_classes: int
  adapter_dim: int = 0

  def setup(self):
    self.conv_0 = nn.Conv(6, (5, 5), padding='SAME')
    self.conv_1 = nn.Conv(16, (5, 5), padding='VALID')
    self.dense_0 = nn.Dense(120)
    self.dense_1 = nn.Dense(84)
    if self.adapter_dim:
      self.adapter_0 = Adapter(self.adapter_dim)
      self.adapter_1 = Adapter(self.adapter_dim)
    self.output = nn.Dense(self.num_classes)

  def features(self, x):
    x = nn.max_pool(nn.relu(self.conv_0(_as_float(x))), (2, 2), (2, 2))
    x = nn.max_pool(nn.relu(self.conv_1(x)), (2, 2), (2, 2))
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(self.dense_0(x))
    if self.adapter_dim:
      x = self.adapter_0(x)
    x = nn.relu(self.dense_1(x))
    if self.adapter_dim:
      x = self.adapter_1(x)
    return x

  def __call__(self, x):
    return self.output(self.features(x))


class CNN(nn.Module):
  """The 2-conv-2-fc CNN of FedAvg (McMahan et al.) and FedDyn (Acar et al.).

  FedAvg's MNIST CNN is conv_features=(32, 64), dense=(512,); FedDyn's CIFAR-10
  CNN is conv_features=(64, 64), dense=(384, 192).
  """
  num_classes: int
  conv_features: Sequence[int] = (32, 64)
  dense: Sequence[int] = (512,)
  adapter_dim: int = 0

  def setup(self):
    self.convs = [nn.Conv(f, (5, 5), padding='SAME', name=f'conv_{i}')
                  for i, f in enumerate(self.conv_features)]
    self.denses = [nn.Dense(d, name=f'dense_{i}') for i, d in enumerate(self.dense)]
    if self.adapter_dim:
      self.adapters = [Adapter(self.adapter_dim, name=f'adapter_{i}') for i in range(len(self.dense))]
    self.output = nn.Dense(self.num_classes)

  def features(self, x):
    x = _as_float(x)
    for conv in self.convs:
      x = nn.max_pool(nn.relu(conv(x)), (2, 2), (2, 2))
    x = x.reshape((x.shape[0], -1))
    for i, d in enumerate(self.denses):
      x = nn.relu(d(x))
      if self.adapter_dim:
        x = self.adapters[i](x)
    return x

  def __call__(self, x):
    return self.output(self.features(x))


class CharLSTM(nn.Module):
  """Next-character LSTM (LEAF's Shakespeare model, smaller by default).

  Input: int tokens [B, T]; output: logits [B, T, vocab_size].
  """
  num_classes: int  # vocabulary size
  embed_dim: int = 8
  hidden: int = 128
  num_layers: int = 2
  adapter_dim: int = 0

  def setup(self):
    self.embed = nn.Embed(self.num_classes, self.embed_dim)
    self.lstms = [nn.RNN(nn.OptimizedLSTMCell(self.hidden), name=f'lstm_{i}')
                  for i in range(self.num_layers)]
    if self.adapter_dim:
      self.adapters = [Adapter(self.adapter_dim, name=f'adapter_{i}') for i in range(self.num_layers)]
    self.output = nn.Dense(self.num_classes)

  def features(self, x):
    h = self.embed(x)
    for i, lstm in enumerate(self.lstms):
      h = lstm(h)
      if self.adapter_dim:
        h = self.adapters[i](h)
    return h

  def __call__(self, x):
    return self.output(self.features(x))


@dataclasses.dataclass(frozen=True)
class Model:
  """A pure model: ``init(key) -> params`` and ``apply(params, x) -> logits``.

  Attributes:
    name: registry name.
    init: PRNG key -> parameter pytree.
    apply: (params, inputs [B, ...]) -> logits [B, ..., C].
    module: the Flax module (for inspection), or None.
    loss: 'cross_entropy' (classification, integer targets) or 'squared'
      (least squares, float targets).
  """
  name: str
  init: Callable[[jax.Array], Any]
  apply: Callable[[Any, jax.Array], jax.Array]
  module: Any = None
  loss: str = 'cross_entropy'

  def features(self, params, x):
    """The penultimate representation (models with a ``features`` method)."""
    return self.module.apply({'params': params}, x, method='features')


def from_flax(name: str, module: nn.Module, sample_x) -> Model:
  """Wraps a Linen module into the pure (init, apply) pair."""
  sample_x = jnp.asarray(sample_x)[:1]
  return Model(name=name,
               init=lambda key: module.init(key, sample_x)['params'],
               apply=lambda params, x: module.apply({'params': params}, x),
               module=module)


MODELS = {
    'logreg': lambda c, a: LogisticRegression(c),
    'mlp': lambda c, a: MLP(c, adapter_dim=a),
    'lenet5': lambda c, a: LeNet5(c, adapter_dim=a),
    'cnn': lambda c, a: CNN(c, adapter_dim=a),
    'cnn_cifar': lambda c, a: CNN(c, conv_features=(64, 64), dense=(384, 192), adapter_dim=a),
    'char_lstm': lambda c, a: CharLSTM(c, adapter_dim=a),
}


def create_model(name: str, num_classes: int, sample_x, adapter_dim: int = 0) -> Model:
  """Builds a registered model by name.

  Args:
    adapter_dim: when > 0, residual adapters of this width after the hidden
      layers (for adapter-based partial personalization).

  Raises:
    ValueError: unknown name (the message lists the known ones).
  """
  if name not in MODELS:
    raise ConfigError('model', f'unknown model {name!r}; choose one of {sorted(MODELS)}')
  if name == 'logreg' and adapter_dim:
    raise ConfigError('adapter_dim', 'logreg has no hidden layer for adapters; pick another --model')
  model = from_flax(name, MODELS[name](num_classes, adapter_dim), sample_x)
  x = jnp.asarray(sample_x)[:1]
  try:
    params = jax.eval_shape(model.init, jax.random.key(0))
    jax.eval_shape(model.apply, params, x)
  except Exception as e:  # shape errors surface deep inside Flax/JAX
    raise ConfigError('model', f'model {name!r} does not fit inputs of shape {tuple(x.shape[1:])} '
                     f'and dtype {x.dtype} ({type(e).__name__}: {e}); pick another --model') from None
  return model
