"""Models (Flax Linen) and the pure (init, apply) pair the engine uses.
All image models take float or uint8 images [B, H, W, C] (uint8 is scaled to
[0, 1] inside the model, so data can be stored compactly) and return logits.
"""

import dataclasses
import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_personal.config import ConfigError


def _as_float(x):
  if jnp.issubdtype(x.dtype, jnp.integer):
    return x.astype(jnp.float32) / 255.0
  return x.astype(jnp.float32)


CONV_IMPLS = ('auto', 'xla', 'matmul', 'tiled')
_SPATIAL = {'NHWC': (1, 2), 'CNHW': (2, 3)}
# ``tiled``: a layer is cut into batch chunks only when its whole batch's
# slice matrix exceeds TILE_MIN_BYTES (half the 32 MiB L3 of the measured CPU:
# below it one matrix stays in cache, and the chunk loop and its recomputed
# slices only cost time: LeNet-5's first layer on MNIST, 2.5 MB, ran 0.6 ms
# untiled against 1.6 ms in 2 MiB chunks), and then into chunks of at most
# TILE_BYTES (the CIFAR CNN's second layer, 52 MB: 72 ms untiled, 43 ms in
# 2 MiB chunks, 39 ms in 4-8 MiB chunks, forward and backward; BUILD.md,
# "Against the PyTorch loop").
TILE_BYTES = 4 << 20
TILE_MIN_BYTES = 16 << 20


def resolve_conv_impl(impl: str) -> str:
  """``auto`` -> ``tiled`` on CPU, ``xla`` elsewhere (measured: BUILD.md,
  "Against the PyTorch loop"); other names are returned as they are."""
  if impl not in CONV_IMPLS:
    raise ConfigError('conv_impl', f'unknown convolution implementation {impl!r}; '
                      f'choose one of {list(CONV_IMPLS)}')
  if impl == 'auto':
    return 'tiled' if jax.default_backend() == 'cpu' else 'xla'
  return impl


def conv_layout(impl: str) -> str:
  """The activation layout a convolutional model uses inside: channels-major
  ``CNHW`` for ``matmul`` and ``tiled`` (XLA:CPU vectorizes the slices and
  pooling along the contiguous width, not along a handful of channels),
  ``NHWC`` for ``xla``."""
  return 'NHWC' if resolve_conv_impl(impl) == 'xla' else 'CNHW'


def tile_budget(x_shape, kernel_shape, padding: str, layout: str) -> int:
  """The ``tile_bytes`` a ``tiled`` convolution of this input and kernel
  uses: 0 (one slice matrix) when the batch's slice matrix is at most
  ``TILE_MIN_BYTES``, else ``TILE_BYTES``. 0 as well when ``TILE_BYTES`` is 0."""
  kh, kw, cin, _ = kernel_shape
  hx, wx = _SPATIAL[layout]
  same = padding == 'SAME'
  ho = x_shape[hx] - (0 if same else kh - 1)
  wo = x_shape[wx] - (0 if same else kw - 1)
  b = x_shape[0 if layout == 'NHWC' else 1]
  return TILE_BYTES if kh * kw * cin * ho * wo * b * 4 > TILE_MIN_BYTES else 0


def batch_chunk(batch: int, bytes_per_example: int, budget: int = TILE_BYTES) -> int:
  """The largest divisor of ``batch`` whose chunk of ``bytes_per_example``
  each fits in ``budget`` bytes (at least 1)."""
  fits = max(1, budget // max(1, bytes_per_example))
  return max(d for d in range(1, min(batch, fits) + 1) if batch % d == 0)


def to_layout(x, layout: str):
  """NHWC -> ``layout``."""
  return x.transpose(3, 0, 1, 2) if layout == 'CNHW' else x


def from_layout(x, layout: str):
  """``layout`` -> NHWC."""
  return x.transpose(1, 2, 3, 0) if layout == 'CNHW' else x


def _pad_spatial(x, kh, kw, layout):
  pads = [(0, 0)] * 4
  h, w = _SPATIAL[layout]
  pads[h], pads[w] = ((kh - 1) // 2, kh // 2), ((kw - 1) // 2, kw // 2)  # lax's SAME
  return jnp.pad(x, pads)


def conv_as_matmul(x, kernel, padding: str, layout: str = 'NHWC', tile_bytes: int = 0):
  """A stride-1 2-D convolution as one matmul over shifted slices.

  The kh*kw shifted windows of the (padded) input are concatenated on the
  channel axis (index (i*kw + j)*Cin + c) and contracted with the HWIO kernel
  reshaped to [kh*kw*Cin, Cout]: the sum of ``lax.conv_general_dilated``, in
  another order. In ``CNHW`` the product is ``K^T [Cout, kh*kw*Cin] @ cols
  [kh*kw*Cin, B*Ho*Wo]``, every slice copy runs along contiguous rows, and
  XLA:CPU runs it and its gradient (slices, pads, matmuls) faster than its
  own convolution, looped and vmapped alike (BUILD.md).

  With ``tile_bytes`` the batch is cut into equal chunks whose
  slice matrix fits in that many bytes, and the chunks are computed one after
  another (``lax.map``) with the chunk's slices recomputed in the backward pass
  (``jax.checkpoint``): the [kh*kw*Cin, chunk*Ho*Wo] matrix then stays in
  cache instead of streaming through memory (the CIFAR CNN's second layer
  builds 52 MB of it for a batch of 32). The same sums, in another order.

  Args:
    x: [B, H, W, Cin] (``NHWC``) or [Cin, B, H, W] (``CNHW``).
    kernel: [kh, kw, Cin, Cout].
    padding: 'SAME' or 'VALID' (Flax's meaning, stride 1).
    layout: 'NHWC' or 'CNHW'; the output has the same layout.
    tile_bytes: 0 for one slice matrix for the whole batch; otherwise the
      budget of one chunk's.
  """
  kh, kw, cin, cout = kernel.shape
  if layout not in _SPATIAL:
    raise ValueError(f'layout must be NHWC or CNHW, got {layout!r}')
  if padding == 'SAME':
    x = _pad_spatial(x, kh, kw, layout)
  elif padding != 'VALID':
    raise ValueError(f'padding must be SAME or VALID, got {padding!r}')
  hx, wx = _SPATIAL[layout]
  ho, wo = x.shape[hx] - kh + 1, x.shape[wx] - kw + 1
  k2 = kernel.reshape(kh * kw * cin, cout)
  bx = 0 if layout == 'NHWC' else 1  # the batch axis

  def chunk_out(xc):
    # The slices in two stages, the kw column shifts and then the kh row
    # shifts of those (the same matrix, index (i*kw + j)*Cin + c): the
    # gradient then adds 5 + 5 shifted copies instead of 25 in one kernel
    # (the CIFAR CNN's second layer, forward and backward: 37.8 -> 33.9 ms).
    cax = -1 if layout == 'NHWC' else 0
    cols = jnp.concatenate([jax.lax.slice_in_dim(xc, j, j + wo, axis=wx) for j in range(kw)],
                           axis=cax)
    cols = jnp.concatenate([jax.lax.slice_in_dim(cols, i, i + ho, axis=hx) for i in range(kh)],
                           axis=cax)
    if layout == 'NHWC':
      return cols @ k2
    n = xc.shape[1]
    return (k2.T @ cols.reshape(kh * kw * cin, n * ho * wo)).reshape(cout, n, ho, wo)

  b = x.shape[bx]
  chunk = batch_chunk(b, kh * kw * cin * ho * wo * x.dtype.itemsize, tile_bytes) \
      if tile_bytes else b
  if chunk == b:
    return chunk_out(x)
  xs = jnp.moveaxis(x.reshape(x.shape[:bx] + (b // chunk, chunk) + x.shape[bx + 1:]), bx, 0)
  ys = jnp.moveaxis(jax.lax.map(jax.checkpoint(chunk_out), xs), 0, bx)  # chunks, then chunk
  return ys.reshape(ys.shape[:bx] + (b,) + ys.shape[bx + 2:])


class Conv(nn.Module):
  """Stride-1 2-D convolution with ``nn.Conv``'s parameters (same names,
  shapes and initializers, so the same key gives the same weights) and a
  choice of implementation: ``xla`` (``lax.conv_general_dilated``, as
  ``nn.Conv``), ``matmul`` (``conv_as_matmul``), ``tiled`` (``conv_as_matmul``,
  over batch chunks that stay in cache when the batch's slice matrix would
  not: ``tile_budget``), or ``auto`` (per platform,
  ``resolve_conv_impl``). All give the same outputs and gradients up to float
  reassociation (tests/test_models.py). ``layout`` is that of the input and
  output (``NHWC`` or ``CNHW``)."""
  features: int
  kernel_size: Sequence[int]
  padding: str = 'SAME'
  impl: str = 'auto'
  layout: str = 'NHWC'

  @nn.compact
  def __call__(self, x):
    kh, kw = self.kernel_size
    cin = x.shape[-1] if self.layout == 'NHWC' else x.shape[0]
    kernel = self.param('kernel', nn.initializers.lecun_normal(), (kh, kw, cin, self.features))
    bias = self.param('bias', nn.initializers.zeros_init(), (self.features,))
    impl = resolve_conv_impl(self.impl)
    if impl != 'xla':
      tile = tile_budget(x.shape, kernel.shape, self.padding, self.layout) if impl == 'tiled' else 0
      y = conv_as_matmul(x, kernel, self.padding, self.layout, tile)
    else:
      y = jax.lax.conv_general_dilated(x, kernel, (1, 1), self.padding,
                                       dimension_numbers=(self.layout, 'HWIO', self.layout))
    return y + (bias if self.layout == 'NHWC' else bias[:, None, None, None])


def max_pool_2x2(x, impl: str = 'auto', layout: str = 'NHWC'):
  """2x2 max pooling, stride 2 (floor). ``xla``: ``nn.max_pool``
  (``reduce_window``, whose gradient is XLA:CPU's slow select-and-scatter);
  ``matmul`` and ``tiled``: elementwise maxima of strided views, rows then
  columns (its gradient is a few selects; 6-17x faster on CPU). Same values; the same
  gradients except at exact ties inside a window (split between the tied
  inputs), which ReLU outputs only have at 0, where the gradient is 0 anyway.
  """
  if resolve_conv_impl(impl) == 'xla':
    if layout == 'NHWC':
      return nn.max_pool(x, (2, 2), (2, 2))
    return to_layout(nn.max_pool(from_layout(x, layout), (2, 2), (2, 2)), layout)
  return _strided_max_pool(x, layout)


def _strided_pool(x, layout):
  hx, wx = _SPATIAL[layout]
  x = jax.lax.slice_in_dim(x, 0, x.shape[hx] // 2 * 2, axis=hx)
  x = jax.lax.slice_in_dim(x, 0, x.shape[wx] // 2 * 2, axis=wx)
  # Rows first (whole contiguous rows), then columns: the order whose
  # gradient XLA:CPU runs fastest (3x faster than the reshape to 2x2 windows).
  x = jnp.maximum(jax.lax.slice_in_dim(x, 0, None, 2, hx), jax.lax.slice_in_dim(x, 1, None, 2, hx))
  return jnp.maximum(jax.lax.slice_in_dim(x, 0, None, 2, wx),
                     jax.lax.slice_in_dim(x, 1, None, 2, wx))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _strided_max_pool(x, layout):
  """``_strided_pool``'s values computed by ``reduce_window`` and its
  derivatives by ``_strided_pool``'s own (same numbers). XLA:CPU duplicates
  cheap elementwise producers into every consumer: the next convolution's
  25 slices each recomputed bias, ReLU and pooling from the previous
  convolution's output (25 kernels, half of LeNet-5's step); a
  ``reduce_window`` is computed once."""
  hx, wx = _SPATIAL[layout]
  window = [1] * 4
  window[hx] = window[wx] = 2
  return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, window, window, 'VALID')


@_strided_max_pool.defjvp
def _strided_max_pool_jvp(layout, primals, tangents):
  (x,), (t,) = primals, tangents
  return _strided_max_pool(x, layout), jax.jvp(lambda x: _strided_pool(x, layout), (x,), (t,))[1]


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
  conv_impl: str = 'auto'

  def setup(self):
    layout = conv_layout(self.conv_impl)
    self.conv_0 = Conv(6, (5, 5), padding='SAME', impl=self.conv_impl, layout=layout)
    self.conv_1 = Conv(16, (5, 5), padding='VALID', impl=self.conv_impl, layout=layout)
    self.dense_0 = nn.Dense(120)
    self.dense_1 = nn.Dense(84)
    if self.adapter_dim:
      self.adapter_0 = Adapter(self.adapter_dim)
      self.adapter_1 = Adapter(self.adapter_dim)
    self.output = nn.Dense(self.num_classes)

  def features(self, x):
    layout = conv_layout(self.conv_impl)
    x = to_layout(_as_float(x), layout)
    x = max_pool_2x2(nn.relu(self.conv_0(x)), self.conv_impl, layout)
    x = max_pool_2x2(nn.relu(self.conv_1(x)), self.conv_impl, layout)
    x = from_layout(x, layout)
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
  conv_impl: str = 'auto'

  def setup(self):
    self.convs = [Conv(f, (5, 5), padding='SAME', impl=self.conv_impl,
                       layout=conv_layout(self.conv_impl), name=f'conv_{i}')
                  for i, f in enumerate(self.conv_features)]
    self.denses = [nn.Dense(d, name=f'dense_{i}') for i, d in enumerate(self.dense)]
    if self.adapter_dim:
      self.adapters = [Adapter(self.adapter_dim, name=f'adapter_{i}') for i in range(len(self.dense))]
    self.output = nn.Dense(self.num_classes)

  def features(self, x):
    layout = conv_layout(self.conv_impl)
    x = to_layout(_as_float(x), layout)
    for conv in self.convs:
      x = max_pool_2x2(nn.relu(conv(x)), self.conv_impl, layout)
    x = from_layout(x, layout)
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
    'logreg': lambda c, a, k: LogisticRegression(c),
    'mlp': lambda c, a, k: MLP(c, adapter_dim=a),
    'lenet5': lambda c, a, k: LeNet5(c, adapter_dim=a, conv_impl=k),
    'cnn': lambda c, a, k: CNN(c, adapter_dim=a, conv_impl=k),
    'cnn_cifar': lambda c, a, k: CNN(c, conv_features=(64, 64), dense=(384, 192), adapter_dim=a,
                                     conv_impl=k),
    'char_lstm': lambda c, a, k: CharLSTM(c, adapter_dim=a),
}


def create_model(name: str, num_classes: int, sample_x, adapter_dim: int = 0,
                 conv_impl: str = 'auto') -> Model:
  """Builds a registered model by name.

  Args:
    adapter_dim: when > 0, residual adapters of this width after the hidden
      layers (for adapter-based partial personalization).
    conv_impl: how convolutional models compute their convolutions and
      pooling: 'auto' (per platform), 'xla', 'matmul' or 'tiled' (``Conv``). Same
      parameters and, up to float reassociation, the same numbers.

  Raises:
    ValueError: unknown name (the message lists the known ones).
  """
  if name not in MODELS:
    raise ConfigError('model', f'unknown model {name!r}; choose one of {sorted(MODELS)}')
  if name == 'logreg' and adapter_dim:
    raise ConfigError('adapter_dim', 'logreg has no hidden layer for adapters; pick another --model')
  resolve_conv_impl(conv_impl)  # validates the name
  model = from_flax(name, MODELS[name](num_classes, adapter_dim, conv_impl), sample_x)
  x = jnp.asarray(sample_x)[:1]
  try:
    params = jax.eval_shape(model.init, jax.random.key(0))
    jax.eval_shape(model.apply, params, x)
  except Exception as e:  # shape errors surface deep inside Flax/JAX
    raise ConfigError('model', f'model {name!r} does not fit inputs of shape {tuple(x.shape[1:])} '
                     f'and dtype {x.dtype} ({type(e).__name__}: {e}); pick another --model') from None
  return model
