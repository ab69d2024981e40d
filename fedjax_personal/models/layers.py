"""The layers the models are built from (Flax Linen).

``Conv`` (a 2-D convolution with a choice of implementation: XLA's op,
or a matmul over shifted slices, whole or in cache-sized batch chunks),
2x2 max and average pooling to match, ``Dense``, ``Adapter`` and
``LSTMCell``. Every layer with parameters takes ``init``, the framework whose
default initialisers it draws them with (``initializers``); ``'flax'`` is
``nn.Dense`` / ``nn.Conv`` / ``nn.OptimizedLSTMCell``'s, with the same
parameter names, shapes and, for the same key, values.
"""

import functools
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_personal.errors import ConfigError
from fedjax_personal.models import initializers

__all__ = [
  'Adapter',
  'as_float',
  'avg_pool_2x2',
  'batch_chunk',
  'Conv',
  'conv_as_matmul',
  'CONV_IMPLS',
  'conv_layout',
  'Dense',
  'from_layout',
  'LSTMCell',
  'max_pool',
  'max_pool_2x2',
  'pool_2x2',
  'resolve_conv_impl',
  'tile_budget',
  'TILE_BYTES',
  'TILE_MIN_BYTES',
  'to_layout',
]


def as_float(x):
  """Images as float32; integer (uint8) images scaled to [0, 1].

  Args:
    x: images (any dtype).

  Returns:
    float32 images.
  """
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
# 2 MiB chunks, 39 ms in 4-8 MiB chunks, forward and backward;
# benchmarks/speed/README.md, "Against the PyTorch loop").
TILE_BYTES = 4 << 20
TILE_MIN_BYTES = 16 << 20


def resolve_conv_impl(impl: str) -> str:
  """``auto`` -> ``tiled`` on a CPU (benchmarks/speed/README.md, "Against the
  PyTorch loop"), ``matmul`` on a GPU or TPU: a convolution vmapped over clients
  becomes one grouped convolution there (a group per client), whose kernels
  collapse as the cohort grows (benchmarks/speed/README.md, "On a GPU": 6.7x
  slower for LeNet-5 at 1,000 clients, 10.7x for the EMNIST CNN at a cohort of
  500); ``tiled``'s chunk loop keeps a CPU's caches warm and only serializes a
  GPU. Other names are returned as they are.

  Args:
    impl: a ``conv_impl`` (``auto`` or a concrete one).

  Returns:
    The concrete implementation.
  """
  if impl not in CONV_IMPLS:
    raise ConfigError(
      'conv_impl',
      f'unknown convolution implementation {impl!r}; '
      f'choose one of {list(CONV_IMPLS)}',
    )
  if impl == 'auto':
    return 'tiled' if jax.default_backend() == 'cpu' else 'matmul'
  return impl


def conv_layout(impl: str) -> str:
  """The activation layout a convolutional model uses inside: channels-major
  ``CNHW`` for ``matmul`` and ``tiled`` (XLA:CPU vectorizes the slices and
  pooling along the contiguous width, not along a handful of channels),
  ``NHWC`` for ``xla``.

  Args:
    impl: a resolved ``conv_impl``.

  Returns:
    ``'CNHW'`` or ``'NHWC'``.
  """
  return 'NHWC' if resolve_conv_impl(impl) == 'xla' else 'CNHW'


def _conv_pads(x_shape, kernel_shape, padding, layout: str, strides=(1, 1)):
  """The explicit ((top, bottom), (left, right)) padding of ``padding``
  ('SAME', 'VALID' or explicit pairs, as ``lax.conv_general_dilated`` means
  them) and the output's (height, width)."""
  kh, kw = kernel_shape[:2]
  hx, wx = _SPATIAL[layout]
  size = (x_shape[hx], x_shape[wx])
  if isinstance(padding, str):
    if padding not in ('SAME', 'VALID'):
      raise ValueError(
        f'padding must be SAME, VALID or explicit pairs, got {padding!r}'
      )
    pads = jax.lax.padtype_to_pads(size, (kh, kw), tuple(strides), padding)
  else:
    pads = [(int(p[0]), int(p[1])) for p in padding]
  out = tuple(
    (n + lo + hi - k) // s + 1
    for n, (lo, hi), k, s in zip(size, pads, (kh, kw), strides)
  )
  return tuple(tuple(p) for p in pads), out


def tile_budget(
  x_shape, kernel_shape, padding, layout: str, strides=(1, 1)
) -> int:
  """The ``tile_bytes`` a ``tiled`` convolution of this input and kernel
  uses: 0 (one slice matrix) when the batch's slice matrix is at most
  ``TILE_MIN_BYTES``, else ``TILE_BYTES``. 0 as well when ``TILE_BYTES`` is 0.

  Args:
    x_shape: the input's shape.
    kernel_shape: the kernel's shape.
    padding: the convolution's padding.
    layout: the activations' layout.
    strides: the convolution's strides.

  Returns:
    Bytes per tile (0: untiled).
  """
  kh, kw, cin, _ = kernel_shape
  _, (ho, wo) = _conv_pads(x_shape, kernel_shape, padding, layout, strides)
  b = x_shape[0 if layout == 'NHWC' else 1]
  return TILE_BYTES if kh * kw * cin * ho * wo * b * 4 > TILE_MIN_BYTES else 0


def batch_chunk(
  batch: int, bytes_per_example: int, budget: int = TILE_BYTES
) -> int:
  """The largest divisor of ``batch`` whose chunk of ``bytes_per_example``
  each fits in ``budget`` bytes (at least 1).

  Args:
    batch: the batch size.
    bytes_per_example: bytes one example's chunk holds.
    budget: bytes a chunk may hold.

  Returns:
    The chunk size.
  """
  fits = max(1, budget // max(1, bytes_per_example))
  return max(d for d in range(1, min(batch, fits) + 1) if batch % d == 0)


def to_layout(x, layout: str):
  """NHWC -> ``layout``.

  Args:
    x: NHWC activations.
    layout: ``'NHWC'`` or ``'CNHW'``.

  Returns:
    The activations in ``layout``.
  """
  return x.transpose(3, 0, 1, 2) if layout == 'CNHW' else x


def from_layout(x, layout: str):
  """``layout`` -> NHWC.

  Args:
    x: activations in ``layout``.
    layout: ``'NHWC'`` or ``'CNHW'``.

  Returns:
    The activations in NHWC.
  """
  return x.transpose(1, 2, 3, 0) if layout == 'CNHW' else x


def _pad_spatial(x, pads, layout: str, value=0.0):
  """``x`` padded by ((top, bottom), (left, right)) on its spatial axes with
  ``value`` (``x`` itself when there is nothing to pad)."""
  if not any(v for p in pads for v in p):
    return x
  widths = [(0, 0)] * 4
  hx, wx = _SPATIAL[layout]
  widths[hx], widths[wx] = pads
  return jnp.pad(x, widths, constant_values=value)


def conv_as_matmul(
  x, kernel, padding, layout: str = 'NHWC', tile_bytes: int = 0, strides=(1, 1)
):
  """A 2-D convolution as one matmul over shifted (strided) slices.

  The kh*kw shifted windows of the (padded) input, taken every ``strides``
  pixels, are concatenated on the channel axis (index (i*kw + j)*Cin + c) and
  contracted with the HWIO kernel reshaped to [kh*kw*Cin, Cout]: the sum of
  ``lax.conv_general_dilated``, in another order. In ``CNHW`` the product is
  ``K^T [Cout, kh*kw*Cin] @ cols [kh*kw*Cin, B*Ho*Wo]``, every slice copy runs
  along contiguous rows, and XLA:CPU runs it and its gradient (slices, pads,
  matmuls) faster than its own convolution, looped and vmapped alike; inside
  a loop (a client's local steps) XLA:CPU's own convolution runs 10-25x
  slower than outside it, this one does not (benchmarks/speed/README.md).

  With ``tile_bytes`` the batch is cut into equal chunks whose
  slice matrix fits in that many bytes, and the chunks are computed one after
  another (``lax.map``) with the chunk's slices recomputed in the backward pass
  (``jax.checkpoint``): the [kh*kw*Cin, chunk*Ho*Wo] matrix then stays in
  cache instead of streaming through memory (the CIFAR CNN's second layer
  builds 52 MB of it for a batch of 32). The same sums, in another order.

  Args:
    x: [B, H, W, Cin] (``NHWC``) or [Cin, B, H, W] (``CNHW``).
    kernel: [kh, kw, Cin, Cout].
    padding: 'SAME', 'VALID' or explicit ((top, bottom), (left, right)), as
      ``lax.conv_general_dilated`` means them.
    layout: 'NHWC' or 'CNHW'; the output has the same layout.
    tile_bytes: 0 for one slice matrix for the whole batch; otherwise the
      budget of one chunk's.
    strides: (rows, columns).

  Returns:
    The convolution, [B, Ho, Wo, Cout] (``NHWC``) or [Cout, B, Ho, Wo]
    (``CNHW``).
  """
  kh, kw, cin, cout = kernel.shape
  if layout not in _SPATIAL:
    raise ValueError(f'layout must be NHWC or CNHW, got {layout!r}')
  sh, sw = strides
  pads, (ho, wo) = _conv_pads(x.shape, kernel.shape, padding, layout, strides)
  hx, wx = _SPATIAL[layout]
  x = _pad_spatial(x, pads, layout)
  k2 = kernel.reshape(kh * kw * cin, cout)
  bx = 0 if layout == 'NHWC' else 1  # the batch axis

  def chunk_out(xc):
    # The slices in two stages, the kw column shifts and then the kh row
    # shifts of those (the same matrix, index (i*kw + j)*Cin + c): the
    # gradient then adds 5 + 5 shifted copies instead of 25 in one kernel
    # (the CIFAR CNN's second layer, forward and backward: 37.8 -> 33.9 ms).
    cax = -1 if layout == 'NHWC' else 0
    cols = jnp.concatenate(
      [
        jax.lax.slice_in_dim(xc, j, j + (wo - 1) * sw + 1, sw, axis=wx)
        for j in range(kw)
      ],
      axis=cax,
    )
    cols = jnp.concatenate(
      [
        jax.lax.slice_in_dim(cols, i, i + (ho - 1) * sh + 1, sh, axis=hx)
        for i in range(kh)
      ],
      axis=cax,
    )
    if layout == 'NHWC':
      return cols @ k2
    n = xc.shape[1]
    return (k2.T @ cols.reshape(kh * kw * cin, n * ho * wo)).reshape(
      cout, n, ho, wo
    )

  b = x.shape[bx]
  chunk = (
    batch_chunk(b, kh * kw * cin * ho * wo * x.dtype.itemsize, tile_bytes)
    if tile_bytes
    else b
  )
  if chunk == b:
    return chunk_out(x)
  xs = jnp.moveaxis(
    x.reshape(x.shape[:bx] + (b // chunk, chunk) + x.shape[bx + 1 :]), bx, 0
  )
  # chunks, then chunk
  ys = jnp.moveaxis(jax.lax.map(jax.checkpoint(chunk_out), xs), 0, bx)
  return ys.reshape(ys.shape[:bx] + (b,) + ys.shape[bx + 2 :])


class Conv(nn.Module):
  """A 2-D convolution with ``nn.Conv``'s parameters.

  2-D convolution with ``nn.Conv``'s parameters (same names, shapes and
  initializers, so the same key gives the same weights) and a choice of
  implementation: ``xla`` (``lax.conv_general_dilated``, as ``nn.Conv``),
  ``matmul`` (``conv_as_matmul``), ``tiled`` (``conv_as_matmul``, over batch
  chunks that stay in cache when the batch's slice matrix would not:
  ``tile_budget``), or ``auto`` (per platform, ``resolve_conv_impl``). All
  give the same outputs and gradients up to float reassociation
  (tests/test_models.py). ``layout`` is that of the input and output
  (``NHWC`` or ``CNHW``); ``convention`` the initialisation convention, or
  ``kernel_init`` a kernel initialiser of the model's own; ``padding``
  'SAME', 'VALID' or explicit pairs; ``use_bias`` False: no bias parameter
  (``nn.Conv``'s)."""

  features: int
  kernel_size: Sequence[int]
  padding: Any = 'SAME'
  impl: str = 'auto'
  layout: str = 'NHWC'
  convention: str = 'flax'
  strides: Sequence[int] = (1, 1)
  use_bias: bool = True
  kernel_init: Optional[Callable] = None

  @nn.compact
  def __call__(self, x):
    kh, kw = self.kernel_size
    cin = x.shape[-1] if self.layout == 'NHWC' else x.shape[0]
    kernel = self.param(
      'kernel',
      self.kernel_init or initializers.kernel_init(self.convention),
      (kh, kw, cin, self.features),
    )
    impl = resolve_conv_impl(self.impl)
    strides = tuple(self.strides)
    if impl != 'xla':
      tile = (
        tile_budget(x.shape, kernel.shape, self.padding, self.layout, strides)
        if impl == 'tiled'
        else 0
      )
      y = conv_as_matmul(x, kernel, self.padding, self.layout, tile, strides)
    else:
      y = jax.lax.conv_general_dilated(
        x,
        kernel,
        strides,
        self.padding,
        dimension_numbers=(self.layout, 'HWIO', self.layout),
      )
    if not self.use_bias:
      return y
    bias = self.param(
      'bias',
      initializers.bias_init(self.convention, kh * kw * cin),
      (self.features,),
    )
    return y + (bias if self.layout == 'NHWC' else bias[:, None, None, None])


def max_pool_2x2(x, impl: str = 'auto', layout: str = 'NHWC'):
  """2x2 max pooling, stride 2 (floor): ``max_pool(x, 2, 2, 0, impl, layout)``.

  Args:
    x: activations.
    impl: a ``conv_impl``.
    layout: ``'NHWC'`` or ``'CNHW'``.

  Returns:
    The pooled activations, in the same layout.
  """
  return max_pool(x, 2, 2, 0, impl, layout)


def max_pool(
  x,
  window: int,
  stride: int,
  pad: int,
  impl: str = 'auto',
  layout: str = 'NHWC',
):
  """Max pooling of ``window`` x ``window`` every ``stride`` pixels (floor),
  the input padded by ``pad`` on every side (PyTorch's ``MaxPool2d(window,
  stride, pad)``; padding never wins). ``xla``: ``nn.max_pool``
  (``reduce_window``, whose gradient is XLA:CPU's slow select-and-scatter,
  slower still inside a loop of local steps); ``matmul`` and ``tiled``: the
  values by ``reduce_window``, the derivatives by elementwise maxima of
  strided views, rows then columns (a few selects; 6-17x faster on CPU).
  Same values; the same gradients except at exact ties inside a window
  (split between the tied inputs), which ReLU outputs only have at 0, where
  the gradient is 0 anyway.

  Args:
    x: activations.
    window: the window's side.
    stride: the step between windows.
    pad: padding on every side.
    impl: a ``conv_impl``.
    layout: ``'NHWC'`` or ``'CNHW'``.

  Returns:
    The pooled activations, in the same layout.
  """
  if resolve_conv_impl(impl) == 'xla':
    args = ((window, window), (stride, stride), ((pad, pad), (pad, pad)))
    if layout == 'NHWC':
      return nn.max_pool(x, *args)
    return to_layout(nn.max_pool(from_layout(x, layout), *args), layout)
  return _strided_max_pool(x, (window, stride, pad, layout))


def avg_pool_2x2(x, layout: str = 'NHWC'):
  """2x2 average pooling, stride 2 (floor), in either layout: PyTorch's
  ``AvgPool2d(2)`` and Keras' ``AveragePooling2D()`` (``nn.avg_pool``'s
  numbers).

  Args:
    x: activations.
    layout: ``'NHWC'`` or ``'CNHW'``.

  Returns:
    The pooled activations, in the same layout.
  """
  hx, wx = _SPATIAL[layout]
  window = [1] * 4
  window[hx] = window[wx] = 2
  return (
    jax.lax.reduce_window(x, 0.0, jax.lax.add, window, window, 'VALID') * 0.25
  )


POOLS = ('max', 'avg')


def pool_2x2(x, kind: str, impl: str = 'auto', layout: str = 'NHWC'):
  """2x2 pooling of ``kind`` ('max' or 'avg').

  Args:
    x: activations.
    kind: ``'max'`` or ``'avg'``.
    impl: a ``conv_impl``.
    layout: ``'NHWC'`` or ``'CNHW'``.

  Returns:
    The pooled activations.
  """
  if kind == 'avg':
    return avg_pool_2x2(x, layout)
  if kind != 'max':
    raise ValueError(f'pooling must be one of {POOLS}, got {kind!r}')
  return max_pool_2x2(x, impl, layout)


def _strided_pool(x, spec):
  """Max pooling (``spec``: window, stride, pad, layout) as elementwise
  maxima of strided views."""
  window, stride, pad, layout = spec
  hx, wx = _SPATIAL[layout]
  x = _pad_spatial(x, ((pad, pad), (pad, pad)), layout, -jnp.inf)
  ho = (x.shape[hx] - window) // stride + 1
  wo = (x.shape[wx] - window) // stride + 1
  # Rows first (whole contiguous rows), then columns: the order whose
  # gradient XLA:CPU runs fastest (3x faster than the reshape to 2x2 windows).
  x = functools.reduce(
    jnp.maximum,
    [
      jax.lax.slice_in_dim(x, i, i + (ho - 1) * stride + 1, stride, axis=hx)
      for i in range(window)
    ],
  )
  return functools.reduce(
    jnp.maximum,
    [
      jax.lax.slice_in_dim(x, j, j + (wo - 1) * stride + 1, stride, axis=wx)
      for j in range(window)
    ],
  )


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _strided_max_pool(x, spec):
  """``_strided_pool``'s values computed by ``reduce_window`` and its
  derivatives by ``_strided_pool``'s own (same numbers). XLA:CPU duplicates
  cheap elementwise producers into every consumer: the next convolution's
  25 slices each recomputed bias, ReLU and pooling from the previous
  convolution's output (25 kernels, half of LeNet-5's step); a
  ``reduce_window`` is computed once."""
  window, stride, pad, layout = spec
  hx, wx = _SPATIAL[layout]
  dims, strides = [1] * 4, [1] * 4
  dims[hx] = dims[wx] = window
  strides[hx] = strides[wx] = stride
  x = _pad_spatial(x, ((pad, pad), (pad, pad)), layout, -jnp.inf)
  return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, dims, strides, 'VALID')


@_strided_max_pool.defjvp
def _strided_max_pool_jvp(spec, primals, tangents):
  (x,), (t,) = primals, tangents
  return _strided_max_pool(x, spec), jax.jvp(
    lambda x: _strided_pool(x, spec), (x,), (t,)
  )[1]


class Dense(nn.Module):
  """A dense layer with ``nn.Dense``'s parameters.

  ``nn.Dense`` (same parameter names and shapes, and for
  ``convention='flax'`` the same values and outputs) whose kernel and bias
  follow the initialisation convention ``init``: a PyTorch bias needs the
  layer's fan-in, which ``nn.Dense``'s ``bias_init`` is not given.
  ``zero_kernel`` starts the kernel at 0 whatever the convention (an adapter's
  up projection)."""

  features: int
  convention: str = 'flax'
  zero_kernel: bool = False

  @nn.compact
  def __call__(self, x):
    fan_in = x.shape[-1]
    k_init = (
      jax.nn.initializers.zeros
      if self.zero_kernel
      else initializers.kernel_init(self.convention)
    )
    kernel = self.param('kernel', k_init, (fan_in, self.features))
    bias = self.param(
      'bias', initializers.bias_init(self.convention, fan_in), (self.features,)
    )
    y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
    return y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


class Adapter(nn.Module):
  """A residual adapter (Houlsby et al. 2019).

  h + W2 relu(W1 h), W2 zero at init in every convention, so that a model
  with adapters starts as the model without them."""

  dim: int
  convention: str = 'flax'

  @nn.compact
  def __call__(self, h):
    z = nn.relu(Dense(self.dim, convention=self.convention, name='down')(h))
    return h + Dense(
      h.shape[-1], convention=self.convention, zero_kernel=True, name='up'
    )(z)


class _Given(nn.Module):
  """Parameters whose initial values are given.

  Parameters of the given ``shapes`` whose initial values are given
  (drawn jointly by the parent); ``values`` is None outside initialisation
  (Flax still evaluates an initialiser's shape then)."""

  shapes: Any
  values: Optional[dict] = None

  @nn.compact
  def __call__(self):
    def init(key, k):
      del key
      return (
        self.values[k] if self.values is not None else jnp.zeros(self.shapes[k])
      )

    return {k: self.param(k, init, k) for k in self.shapes}


class LSTMCell(nn.OptimizedLSTMCell):
  """An LSTM cell with ``nn.OptimizedLSTMCell``'s parameters.

  ``nn.OptimizedLSTMCell`` (same parameters: kernels ``ii``.. ``io``,
  recurrent kernels and biases ``hi``.. ``ho``, and the same update) with its
  initial parameters drawn by the convention ``convention``
  (``initializers.lstm_params``: one draw of the whole kernels, split by
  gate). With ``convention='flax'`` use ``nn.OptimizedLSTMCell`` itself."""

  convention: str = 'flax'

  @nn.compact
  def __call__(self, carry, inputs):
    c, h = carry
    drawn = None
    if self.is_initializing():
      drawn = initializers.lstm_params(
        self.convention, self.make_rng('params'), inputs.shape[-1], h.shape[-1]
      )
    d_in, hidden = inputs.shape[-1], h.shape[-1]
    p = {}
    for g in initializers.GATES:
      for kind, shapes in (
        ('i', {'kernel': (d_in, hidden)}),
        ('h', {'kernel': (hidden, hidden), 'bias': (hidden,)}),
      ):
        name = f'{kind}{g}'
        p[name] = _Given(shapes, drawn[name] if drawn else None, name=name)()
    w_in = jnp.concatenate(
      [p[f'i{g}']['kernel'] for g in initializers.GATES], -1
    )
    w_rec = jnp.concatenate(
      [p[f'h{g}']['kernel'] for g in initializers.GATES], -1
    )
    bias = jnp.concatenate([p[f'h{g}']['bias'] for g in initializers.GATES], -1)
    z = jnp.dot(inputs, w_in) + jnp.dot(h, w_rec) + bias
    zi, zf, zg, zo = jnp.split(z, 4, axis=-1)
    new_c = self.gate_fn(zf) * c + self.gate_fn(zi) * self.activation_fn(zg)
    new_h = self.gate_fn(zo) * self.activation_fn(new_c)
    return (new_c, new_h), new_h
