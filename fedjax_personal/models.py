"""Models (Flax Linen) and the pure (init, apply) pair the engine uses.

All image models take float or uint8 images [B, H, W, C] (uint8 is scaled to
[0, 1] inside the model, so data can be stored compactly) and return logits.
"""

import dataclasses
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


def _as_float(x):
  if jnp.issubdtype(x.dtype, jnp.integer):
    return x.astype(jnp.float32) / 255.0
  return x.astype(jnp.float32)


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

  def setup(self):
    self.hidden_layers = [nn.Dense(h, name=f'hidden_{i}') for i, h in enumerate(self.hidden)]
    self.output = nn.Dense(self.num_classes)

  def features(self, x):
    """The penultimate representation (input to the output layer)."""
    x = _as_float(x).reshape((x.shape[0], -1))
    for layer in self.hidden_layers:
      x = nn.relu(layer(x))
    return x

  def __call__(self, x):
    return self.output(self.features(x))


class LeNet5(nn.Module):
  """LeNet-5 (LeCun et al. 1998), the model of the user-centric FL paper.

  conv 6@5x5 (same padding on 28x28) - max pool - conv 16@5x5 - max pool -
  dense 120 - dense 84 - dense num_classes.
  """
  num_classes: int

  def setup(self):
    self.conv_0 = nn.Conv(6, (5, 5), padding='SAME')
    self.conv_1 = nn.Conv(16, (5, 5), padding='VALID')
    self.dense_0 = nn.Dense(120)
    self.dense_1 = nn.Dense(84)
    self.output = nn.Dense(self.num_classes)

  def features(self, x):
    x = nn.max_pool(nn.relu(self.conv_0(_as_float(x))), (2, 2), (2, 2))
    x = nn.max_pool(nn.relu(self.conv_1(x)), (2, 2), (2, 2))
    x = x.reshape((x.shape[0], -1))
    return nn.relu(self.dense_1(nn.relu(self.dense_0(x))))

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

  def setup(self):
    self.convs = [nn.Conv(f, (5, 5), padding='SAME', name=f'conv_{i}')
                  for i, f in enumerate(self.conv_features)]
    self.denses = [nn.Dense(d, name=f'dense_{i}') for i, d in enumerate(self.dense)]
    self.output = nn.Dense(self.num_classes)

  def features(self, x):
    x = _as_float(x)
    for conv in self.convs:
      x = nn.max_pool(nn.relu(conv(x)), (2, 2), (2, 2))
    x = x.reshape((x.shape[0], -1))
    for d in self.denses:
      x = nn.relu(d(x))
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

  @nn.compact
  def __call__(self, x):
    h = nn.Embed(self.num_classes, self.embed_dim, name='embed')(x)
    for i in range(self.num_layers):
      h = nn.RNN(nn.OptimizedLSTMCell(self.hidden), name=f'lstm_{i}')(h)
    return nn.Dense(self.num_classes, name='output')(h)


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
    'logreg': lambda c: LogisticRegression(c),
    'mlp': lambda c: MLP(c),
    'lenet5': lambda c: LeNet5(c),
    'cnn': lambda c: CNN(c),
    'cnn_cifar': lambda c: CNN(c, conv_features=(64, 64), dense=(384, 192)),
    'char_lstm': lambda c: CharLSTM(c),
}


def create_model(name: str, num_classes: int, sample_x) -> Model:
  """Builds a registered model by name.

  Raises:
    ValueError: unknown name (the message lists the known ones).
  """
  if name not in MODELS:
    raise ValueError(f'unknown model {name!r}; choose one of {sorted(MODELS)}')
  model = from_flax(name, MODELS[name](num_classes), sample_x)
  x = jnp.asarray(sample_x)[:1]
  try:
    params = jax.eval_shape(model.init, jax.random.key(0))
    jax.eval_shape(model.apply, params, x)
  except Exception as e:  # shape errors surface deep inside Flax/JAX
    raise ValueError(f'model {name!r} does not fit inputs of shape {tuple(x.shape[1:])} '
                     f'and dtype {x.dtype} ({type(e).__name__}: {e}); pick another --model') from None
  return model
