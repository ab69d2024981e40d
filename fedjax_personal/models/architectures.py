"""The model architectures (Flax Linen modules).

All image models take float or uint8 images [B, H, W, C] (uint8 is scaled to
[0, 1] inside the model, so data can be stored compactly) and return logits;
``features`` is the penultimate representation. Every model takes
``convention``, the initialisation convention of its layers (``initializers``:
``flax``, ``pytorch`` or ``keras``), and the ones with hidden layers
``adapter_dim`` (residual adapters for adapter-based partial personalization).

Besides the library's own models, the reference variants of the seeds' code
(``REFERENCE`` in ``fedjax_personal.models`` names them): FedDyn's CIFAR CNN,
FedFomo's default (TensorFlow-tutorial) CNN, pFedMe's (PyTorch-tutorial)
CifarNet, and the user-centric paper's LeNet-5 with average pooling.
"""

from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_personal.models import initializers
from fedjax_personal.models.layers import (
  Adapter,
  Conv,
  Dense,
  LSTMCell,
  as_float,
  conv_layout,
  from_layout,
  pool_2x2,
  to_layout,
)
from fedjax_personal.models.recurrent import cell_kernels, lstm_sequence

__all__ = ['CharLSTM', 'CNN', 'flatten', 'LeNet5', 'LogisticRegression', 'MLP']


def flatten(module: nn.Module, x):
  """[B, ...] -> [B, features]. Convolutional models record the NHWC shape
  they flatten (``sow``, a no-op unless asked for): a PyTorch state dict's
  first dense layer after the convolutions is read with it (PyTorch flattens
  C, H, W; these models H, W, C).

  Args:
    module: the calling Linen module (records the shape).
    x: activations [B, ...].

  Returns:
    [B, features].
  """
  module.sow('intermediates', 'flatten_input', x)
  return x.reshape((x.shape[0], -1))


class LogisticRegression(nn.Module):
  """Multinomial logistic regression on flattened inputs."""

  num_classes: int
  convention: str = 'flax'

  def setup(self):
    self.output = Dense(self.num_classes, convention=self.convention)

  def features(self, x):
    return as_float(x).reshape((x.shape[0], -1))

  def __call__(self, x):
    return self.output(self.features(x))


class MLP(nn.Module):
  """Fully connected ReLU network (FedAvg's 2NN with hidden=(200, 200))."""

  num_classes: int
  hidden: Sequence[int] = (200, 200)
  adapter_dim: int = 0
  convention: str = 'flax'

  def setup(self):
    self.hidden_layers = [
      Dense(h, convention=self.convention, name=f'hidden_{i}')
      for i, h in enumerate(self.hidden)
    ]
    if self.adapter_dim:
      self.adapters = [
        Adapter(
          self.adapter_dim, convention=self.convention, name=f'adapter_{i}'
        )
        for i in range(len(self.hidden))
      ]
    self.output = Dense(self.num_classes, convention=self.convention)

  def features(self, x):
    """The penultimate representation (input to the output layer)."""
    x = as_float(x).reshape((x.shape[0], -1))
    for i, layer in enumerate(self.hidden_layers):
      x = nn.relu(layer(x))
      if self.adapter_dim:
        x = self.adapters[i](x)
    return x

  def __call__(self, x):
    return self.output(self.features(x))


class LeNet5(nn.Module):
  """LeNet-5 (LeCun et al. 1998), the model of the user-centric FL paper.

  conv 6@5x5 (same padding on 28x28) - 2x2 pool - conv 16@5x5 - 2x2 pool -
  dense 120 - dense 84 - dense num_classes, ReLU activations; ``pool`` is
  'max' (``lenet5``) or 'avg' (``usercentric_lenet5``, the average pooling of
  LeCun's LeNet-5 and of the Keras LeNet-5 the user-centric paper trains).
  61,706 parameters on 28x28x1 inputs with 10 classes.
  """

  num_classes: int
  adapter_dim: int = 0
  conv_impl: str = 'auto'
  convention: str = 'flax'
  pool: str = 'max'

  def setup(self):
    layout = conv_layout(self.conv_impl)
    self.conv_0 = Conv(
      6,
      (5, 5),
      padding='SAME',
      impl=self.conv_impl,
      layout=layout,
      convention=self.convention,
    )
    self.conv_1 = Conv(
      16,
      (5, 5),
      padding='VALID',
      impl=self.conv_impl,
      layout=layout,
      convention=self.convention,
    )
    self.dense_0 = Dense(120, convention=self.convention)
    self.dense_1 = Dense(84, convention=self.convention)
    if self.adapter_dim:
      self.adapter_0 = Adapter(self.adapter_dim, convention=self.convention)
      self.adapter_1 = Adapter(self.adapter_dim, convention=self.convention)
    self.output = Dense(self.num_classes, convention=self.convention)

  def features(self, x):
    layout = conv_layout(self.conv_impl)
    x = to_layout(as_float(x), layout)
    x = pool_2x2(nn.relu(self.conv_0(x)), self.pool, self.conv_impl, layout)
    x = pool_2x2(nn.relu(self.conv_1(x)), self.pool, self.conv_impl, layout)
    x = flatten(self, from_layout(x, layout))
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
  """A convolutional network with dense layers after it.

  Convolutions (each followed by ReLU and, where ``pooled`` says so, 2x2
  pooling), then dense ReLU layers and the output layer.

  FedAvg's MNIST CNN (McMahan et al.; ``cnn``) is conv_features=(32, 64) of
  5x5, dense=(512,), SAME padding. ``cnn_cifar`` is (64, 64), (384, 192) with
  SAME padding; the model of FedDyn's code (``feddyn_cnn``, utils_models.py
  'cifar10') is the same with VALID padding (64*5*5 features after the
  convolutions, 797,962 parameters on CIFAR-10). FedFomo's code defaults to
  the TensorFlow-tutorial CNN (``fedfomo_cnn``, federated/network.py
  TFConvNet): 3x3 VALID convolutions of 32, 64, 64 with pooling after the
  first two, dense 64 (122,570 parameters on CIFAR-10). pFedMe's CifarNet is
  the PyTorch-tutorial CNN (``pfedme_cnn``; FedFomo's ``base_cnn``): 5x5
  VALID convolutions of 6 and 16, dense (120, 84) (62,006 parameters on
  CIFAR-10). Reddi et al.'s EMNIST CNN (``reddi_emnist_cnn``, "Adaptive
  Federated Optimization", arXiv 2003.00295, as TFF builds it): 3x3 VALID
  convolutions of 32 and 64, pooling after the second, dense 128 (1,206,590
  parameters on EMNIST-62) with its dropout, 0.25 after the pooling and
  0.5 after the dense layer (``dropout``; TFF's
  ``create_conv_dropout_model``); FedJAX's EMNIST CNN
  (``fedjax_emnist_cnn``, ``fedjax.models.emnist.create_conv_model``) is the
  same network with Haiku's initialisers.

  ``dropout``: the rates of ``nn.Dropout`` after the convolutions (the
  first) and after each dense layer (the others); () for none. Dropout
  draws only when ``train`` (Flax's convention: the engine trains with
  ``train=True`` and a dropout key, evaluates with ``train=False``).
  """

  num_classes: int
  conv_features: Sequence[int] = (32, 64)
  dense: Sequence[int] = (512,)
  adapter_dim: int = 0
  conv_impl: str = 'auto'
  convention: str = 'flax'
  padding: str = 'SAME'
  pool: str = 'max'
  kernel: int = 5
  pooled: Optional[Sequence[bool]] = (
    None  # per convolution; default: after every one
  )
  dropout: Sequence[float] = ()

  def setup(self):
    self.convs = [
      Conv(
        f,
        (self.kernel, self.kernel),
        padding=self.padding,
        impl=self.conv_impl,
        layout=conv_layout(self.conv_impl),
        convention=self.convention,
        name=f'conv_{i}',
      )
      for i, f in enumerate(self.conv_features)
    ]
    self.denses = [
      Dense(d, convention=self.convention, name=f'dense_{i}')
      for i, d in enumerate(self.dense)
    ]
    if self.adapter_dim:
      self.adapters = [
        Adapter(
          self.adapter_dim, convention=self.convention, name=f'adapter_{i}'
        )
        for i in range(len(self.dense))
      ]
    self.output = Dense(self.num_classes, convention=self.convention)
    self.dropouts = [
      nn.Dropout(rate, name=f'dropout_{i}')
      for i, rate in enumerate(self.dropout)
    ]

  def _dropout(self, x, i: int, train: bool):
    if i >= len(self.dropout) or not self.dropout[i]:
      return x
    return self.dropouts[i](x, deterministic=not train)

  def features(self, x, train: bool = False):
    layout = conv_layout(self.conv_impl)
    x = to_layout(as_float(x), layout)
    pooled = self.pooled or [True] * len(self.convs)
    for conv, pool in zip(self.convs, pooled):
      x = nn.relu(conv(x))
      if pool:
        x = pool_2x2(x, self.pool, self.conv_impl, layout)
    x = self._dropout(flatten(self, from_layout(x, layout)), 0, train)
    for i, d in enumerate(self.denses):
      x = nn.relu(d(x))
      if self.adapter_dim:
        x = self.adapters[i](x)
      x = self._dropout(x, i + 1, train)
    return x

  def __call__(self, x, train: bool = False):
    return self.output(self.features(x, train))


def keep_last_real(h, real):
  """Each position's row of ``h`` replaced by the row at the last real
  position up to it (zeros where none is): Keras's masked RNN steps
  (``return_sequences=True``) output the previous step's output.

  Args:
    h: [B, T, H] the LSTM's outputs.
    real: bool [B, T], the inputs that are not PAD.

  Returns:
    [B, T, H].
  """
  t = jnp.arange(real.shape[1])
  last = jax.lax.cummax(jnp.where(real, t, -1), axis=1)
  kept = jnp.take_along_axis(h, jnp.maximum(last, 0)[..., None], axis=1)
  return jnp.where((last >= 0)[..., None], kept, jnp.zeros_like(h))


class CharLSTM(nn.Module):
  """A next-token LSTM.

  Next-token LSTM: embedding, LSTM layers, an optional linear projection,
  the output layer. Input: int tokens [B, T]; output: logits [B, T, vocab].

  ``char_lstm`` is LEAF's Shakespeare model, smaller; ``lstm_lm`` is Reddi et
  al.'s Stack Overflow next-word model ("Adaptive Federated Optimization",
  arXiv 2003.00295, as TFF builds it): embedding 96, one LSTM of 670 units, a
  dense projection to 96, the output layer (4,050,748 parameters on its
  10,004 ids: the 10K vocabulary, PAD, BOS, EOS, one OOV).
  ``fedjax_lstm_lm`` and ``fedjax_char_lstm`` are FedJAX's
  ``models.stackoverflow.create_lstm_model`` and
  ``models.shakespeare.create_lstm_model``: the same layers with a tanh on
  every LSTM layer's output (``tanh_after_lstm``; its ``hk.DeepRNN`` of
  ``hk.LSTM``, ``jnp.tanh``), Haiku's initialisers.

  ``mask_pad`` is Keras's ``Embedding(mask_zero=True)`` of the TFF models
  (``reddi_char_lstm``, ``lstm_lm``): an LSTM's output at a PAD (0) input is
  its output at the last input before it that is not PAD (zeros before the
  first), as Keras's masked RNN steps hand the previous output on
  (``keep_last_real``). Exact where PAD inputs only trail a row, as in every
  text data set's rows here; a real position's output never changes.
  """

  num_classes: int  # vocabulary size
  embed_dim: int = 8
  hidden: int = 128
  num_layers: int = 2
  adapter_dim: int = 0
  convention: str = 'flax'
  projection: int = 0  # width of a linear layer before the output (0: none)
  tanh_after_lstm: bool = False  # FedJAX's models: tanh(h) of every LSTM layer
  mask_pad: bool = (
    False  # Keras's mask_zero=True: PAD inputs repeat the last real output
  )

  def setup(self):
    self.embed = nn.Embed(
      self.num_classes,
      self.embed_dim,
      embedding_init=initializers.embedding_init(self.convention),
    )
    cell = (
      (lambda: nn.OptimizedLSTMCell(self.hidden))
      if self.convention == 'flax'
      else (lambda: LSTMCell(self.hidden, convention=self.convention))
    )
    self.lstms = [
      nn.RNN(cell(), name=f'lstm_{i}') for i in range(self.num_layers)
    ]
    if self.adapter_dim:
      self.adapters = [
        Adapter(
          self.adapter_dim, convention=self.convention, name=f'adapter_{i}'
        )
        for i in range(self.num_layers)
      ]
    if self.projection:
      self.project = Dense(self.projection, convention=self.convention)
    self.output = Dense(self.num_classes, convention=self.convention)

  def features(self, x):
    h: Any = self.embed(x)
    real = x != 0
    for i, lstm in enumerate(self.lstms):
      # Initialisation draws the cell's parameters through nn.RNN; applying
      # runs them over the sequence in large matmuls (recurrent.lstm_sequence).
      h = (
        lstm(h)
        if self.is_initializing()
        else lstm_sequence(h, *cell_kernels(lstm.variables['params']['cell']))
      )
      if self.mask_pad:
        h = keep_last_real(h, real)
      if self.tanh_after_lstm:
        h = nn.tanh(h)
      if self.adapter_dim:
        h = self.adapters[i](h)
    return self.project(h) if self.projection else h

  def __call__(self, x):
    return self.output(self.features(x))
