"""Convolution implementations: every one gives lax.conv's numbers; the
sequence LSTM gives nn.RNN's.

``models.Conv`` computes a convolution either with XLA's op (``xla``) or as
one matmul over shifted slices (``matmul``, the CPU default), in NHWC or
channels-major CNHW; pooling has a matching pair. These tests pin outputs
and gradients to ``lax.conv_general_dilated`` / ``nn.max_pool`` (1e-5), the
parameters to ``nn.Conv``'s, and whole models across implementations.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_personal as fp
from fedjax_personal import models
from fedjax_personal.core.executor_choice import model_has_conv
from fedjax_personal.errors import ConfigError


def normal(seed, shape):
  # numpy, not jax.random: compiling threefry takes seconds per shape on CPU.
  return jnp.asarray(
    np.random.default_rng(seed).normal(size=shape), jnp.float32
  )


def lax_conv(x, k, padding):
  return jax.lax.conv_general_dilated(
    x, k, (1, 1), padding, dimension_numbers=('NHWC', 'HWIO', 'NHWC')
  )


@pytest.mark.parametrize(
  'layout,tile_bytes',
  [('NHWC', 0), ('NHWC', 1), ('CNHW', 0), ('CNHW', 1), ('CNHW', 10000)],
)
@pytest.mark.parametrize('padding', ['SAME', 'VALID'])
@pytest.mark.parametrize(
  'shape,kernel',
  [((3, 9, 9, 1), (5, 5)), ((2, 8, 7, 4), (3, 3)), ((6, 6, 8, 3), (4, 2))],
)
@pytest.mark.ci_variants(
  'shape1-kernel1-SAME-CNHW-0',
  'shape1-kernel1-SAME-CNHW-1',
  'shape1-kernel1-SAME-CNHW-10000',
  'shape1-kernel1-SAME-NHWC-0',
  'shape1-kernel1-SAME-NHWC-1',
  'shape1-kernel1-VALID-CNHW-0',
  'shape1-kernel1-VALID-CNHW-1',
  'shape1-kernel1-VALID-CNHW-10000',
  'shape1-kernel1-VALID-NHWC-0',
  'shape1-kernel1-VALID-NHWC-1',
)
def test_conv_as_matmul_equals_lax_conv(
  shape, kernel, padding, layout, tile_bytes
):
  # tile_bytes 1: chunks of one example; 10000: chunks of 2 or 3 of 6 (or the
  # batch).
  x, k = normal(0, shape), normal(1, kernel + (shape[-1], 5)) * 0.3
  ref = lax_conv(x, k, padding)
  g = normal(2, ref.shape)

  def ours(x, k):
    y = models.conv_as_matmul(
      models.to_layout(x, layout), k, padding, layout, tile_bytes
    )
    return models.from_layout(y, layout)

  np.testing.assert_allclose(jax.jit(ours)(x, k), ref, atol=1e-5, rtol=1e-5)
  # Gradients with respect to the input and the kernel, for a random cotangent.
  grads = jax.jit(jax.grad(lambda x, k: jnp.sum(ours(x, k) * g), (0, 1)))(x, k)
  ref_grads = jax.jit(
    jax.grad(lambda x, k: jnp.sum(lax_conv(x, k, padding) * g), (0, 1))
  )(x, k)
  for a, b in zip(grads, ref_grads):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('layout', ['NHWC', 'CNHW'])
@pytest.mark.slow_variants('CNHW')
def test_strided_and_explicitly_padded_convolutions_equal_lax_conv(layout):
  # The ResNets' convolutions: 3x3 and 7x7 with PyTorch's padding k // 2 at
  # stride 2, a 1x1 at stride 2 (the shortcut), SAME at stride 2 (lax's split).
  for n, (shape, kernel, strides, padding) in enumerate(
    [
      ((2, 9, 8, 3), (3, 3), (2, 2), ((1, 1), (1, 1))),
      ((2, 11, 11, 2), (7, 7), (2, 2), ((3, 3), (3, 3))),
      ((3, 8, 8, 4), (1, 1), (2, 2), ((0, 0), (0, 0))),
      ((2, 9, 9, 3), (3, 3), (2, 1), 'SAME'),
    ]
  ):
    x, k = normal(n, shape), normal(n + 10, kernel + (shape[-1], 5)) * 0.3
    conv = lambda x, k: jax.lax.conv_general_dilated(
      x, k, strides, padding, dimension_numbers=('NHWC', 'HWIO', 'NHWC')
    )
    ref = conv(x, k)
    g = normal(n + 20, ref.shape)
    for tile_bytes in (0, 1):
      ours = lambda x, k: models.from_layout(
        models.conv_as_matmul(
          models.to_layout(x, layout), k, padding, layout, tile_bytes, strides
        ),
        layout,
      )
      np.testing.assert_allclose(jax.jit(ours)(x, k), ref, atol=1e-5, rtol=1e-5)
      grads = jax.jit(jax.grad(lambda x, k: jnp.sum(ours(x, k) * g), (0, 1)))(
        x, k
      )
      ref_grads = jax.jit(
        jax.grad(lambda x, k: jnp.sum(conv(x, k) * g), (0, 1))
      )(x, k)
      for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_conv_module_strided_without_bias_has_nn_conv_parameters_and_outputs():
  x = normal(1, (2, 9, 9, 3))
  init = jax.nn.initializers.variance_scaling(2.0, 'fan_out', 'normal')
  ref_module = nn.Conv(
    4,
    (3, 3),
    strides=(2, 2),
    padding=((1, 1), (1, 1)),
    use_bias=False,
    kernel_init=init,
  )
  ref_params = ref_module.init(jax.random.key(0), x)['params']
  ref = ref_module.apply({'params': ref_params}, x)
  for impl in ('xla', 'matmul', 'tiled'):
    module = models.Conv(
      4,
      (3, 3),
      strides=(2, 2),
      padding=((1, 1), (1, 1)),
      use_bias=False,
      kernel_init=init,
      impl=impl,
    )
    params = module.init(jax.random.key(0), x)['params']
    jax.tree.map(np.testing.assert_array_equal, params, ref_params)
    np.testing.assert_allclose(
      module.apply({'params': params}, x), ref, atol=1e-5
    )


@pytest.mark.parametrize('layout', ['NHWC', 'CNHW'])
def test_padded_strided_max_pool_equals_nn_max_pool(layout):
  # The ImageNet stem's pooling: 3x3 windows every 2 pixels, padded by 1.
  x = normal(4, (2, 9, 8, 3))
  ref_fn = lambda x: nn.max_pool(x, (3, 3), (2, 2), ((1, 1), (1, 1)))
  ref = ref_fn(x)
  g = normal(5, ref.shape)
  for impl in ('xla', 'matmul', 'tiled'):
    ours = lambda x: models.from_layout(
      models.max_pool(models.to_layout(x, layout), 3, 2, 1, impl, layout),
      layout,
    )
    np.testing.assert_array_equal(jax.jit(ours)(x), ref)
    np.testing.assert_allclose(
      jax.jit(jax.grad(lambda x: jnp.sum(ours(x) * g)))(x),
      jax.grad(lambda x: jnp.sum(ref_fn(x) * g))(x),
      atol=1e-6,
    )


@pytest.mark.parametrize('layout', ['NHWC', 'CNHW'])
@pytest.mark.parametrize('impl', ['xla', 'matmul', 'tiled'])
def test_conv_module_has_nn_conv_parameters_and_outputs(impl, layout):
  x = normal(1, (2, 9, 9, 3))
  for padding in ('SAME', 'VALID'):
    ref_module = nn.Conv(4, (5, 5), padding=padding)
    ref_params = ref_module.init(jax.random.key(0), x)['params']
    module = models.Conv(4, (5, 5), padding=padding, impl=impl, layout=layout)
    params = module.init(jax.random.key(0), models.to_layout(x, layout))[
      'params'
    ]
    jax.tree.map(np.testing.assert_array_equal, params, ref_params)
    ref_params = {
      'kernel': ref_params['kernel'],
      'bias': ref_params['bias'] + 0.1,
    }
    out = models.from_layout(
      module.apply({'params': ref_params}, models.to_layout(x, layout)), layout
    )
    np.testing.assert_allclose(
      out, ref_module.apply({'params': ref_params}, x), atol=1e-5
    )


@pytest.mark.parametrize('layout', ['NHWC', 'CNHW'])
@pytest.mark.parametrize('hw', [(8, 8), (7, 9)])
def test_max_pool_equals_nn_max_pool(hw, layout):
  x = normal(2, (3,) + hw + (4,))
  g = normal(3, (3, hw[0] // 2, hw[1] // 2, 4))
  for impl in ('xla', 'matmul', 'tiled'):
    ours = lambda x: models.from_layout(
      models.max_pool_2x2(models.to_layout(x, layout), impl, layout), layout
    )
    np.testing.assert_array_equal(
      jax.jit(ours)(x), nn.max_pool(x, (2, 2), (2, 2))
    )
    # No ties in random normals: the gradients are the same selection.
    np.testing.assert_allclose(
      jax.jit(jax.grad(lambda x: jnp.sum(ours(x) * g)))(x),
      jax.jit(jax.grad(lambda x: jnp.sum(nn.max_pool(x, (2, 2), (2, 2)) * g)))(
        x
      ),
      atol=1e-6,
    )


# same class as cnn_cifar
@pytest.mark.parametrize(
  'name,shape',
  [
    ('lenet5', (28, 28, 1)),
    ('cnn_cifar', (32, 32, 3)),
    pytest.param('cnn', (28, 28, 1), marks=pytest.mark.slow),
  ],
)
@pytest.mark.slow_variants('cnn_cifar-shape1')
def test_models_agree_across_conv_implementations(name, shape):
  # A batch of 12: `tiled` cuts the CIFAR CNN's second layer (1.6 MB of
  # slices per image, 19.7 MB for the batch) into chunks of 2; LeNet-5's
  # layers stay whole (below TILE_MIN_BYTES).
  x = jnp.asarray(
    np.random.default_rng(0).integers(0, 256, (12,) + shape, dtype=np.uint8)
  )
  y = jnp.arange(12) % 10
  built = {
    impl: fp.create_model(name, 10, x[:1], conv_impl=impl)
    for impl in ('xla', 'matmul', 'tiled', 'auto')
  }
  params = {
    impl: jax.jit(built[impl].init)(jax.random.key(0))
    for impl in ('xla', 'matmul')
  }
  jax.tree.map(np.testing.assert_array_equal, params['matmul'], params['xla'])

  def out_and_grad(m):
    loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(
      m.apply(p, x), y
    ).mean()
    return jax.jit(lambda p: (m.apply(p, x), jax.grad(loss)(p)))(params['xla'])

  ref_out, ref_grad = out_and_grad(built['xla'])
  for impl in ('matmul', 'tiled', 'auto'):
    out, grad = out_and_grad(built[impl])
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4),
      grad,
      ref_grad,
    )
  # Convolutional either way, so `auto` executors treat them alike.
  assert all(model_has_conv(m, x[:1]) for m in built.values())


def test_a_forward_pass_alone_convolves_with_xla_where_auto_would_tile():
  """``Model.forward_only``: under ``auto`` on a CPU XLA's convolution (the
  same parameters, the same logits up to float reassociation), the input
  transform kept; a named ``conv_impl`` and a model without convolutions
  are left as they are."""
  x = jnp.asarray(
    np.random.default_rng(3).integers(0, 256, (5, 28, 28, 1), dtype=np.uint8)
  )
  model = fp.create_model('reddi_emnist_cnn', 10, x[:1])
  params = model.init(jax.random.key(0))
  forward = model.forward_only()
  expected = 'xla' if jax.default_backend() == 'cpu' else 'auto'
  assert (
    forward.module.conv_impl == expected and model.module.conv_impl == 'auto'
  )
  np.testing.assert_allclose(
    jax.jit(forward.apply)(params, x),
    jax.jit(model.apply)(params, x),
    atol=1e-5,
    rtol=1e-5,
  )
  from fedjax_personal.models import inputs

  shifted = inputs.with_inputs(
    model,
    inputs.InputTransform(
      'half',
      train=lambda key, x: x,
      evaluate=lambda x: x.astype(jnp.float32) / 2,
    ),
  )
  np.testing.assert_allclose(
    jax.jit(shifted.forward_only().apply)(params, x),
    jax.jit(shifted.apply)(params, x),
    atol=1e-5,
    rtol=1e-5,
  )
  tiled = fp.create_model('reddi_emnist_cnn', 10, x[:1], conv_impl='tiled')
  assert tiled.forward_only() is tiled
  mlp = fp.create_model('mlp', 10, x[:1])
  assert mlp.forward_only() is mlp


def test_tile_budget_cuts_only_slice_matrices_above_the_threshold():
  # CIFAR CNN, second layer, B = 32: 52 MB of slices -> chunks of TILE_BYTES.
  assert (
    models.tile_budget((64, 32, 16, 16), (5, 5, 64, 64), 'SAME', 'CNHW')
    == models.TILE_BYTES
  )
  assert (
    models.tile_budget((32, 16, 16, 64), (5, 5, 64, 64), 'SAME', 'NHWC')
    == models.TILE_BYTES
  )
  # LeNet-5, B = 32: 2.5 MB (first layer) and 1.9 MB (second, VALID) stay whole.
  assert models.tile_budget((1, 32, 28, 28), (5, 5, 1, 6), 'SAME', 'CNHW') == 0
  assert (
    models.tile_budget((6, 32, 14, 14), (5, 5, 6, 16), 'VALID', 'CNHW') == 0
  )
  # VALID output sizes: 25 * 64 * 12 * 12 * 4 bytes * 100 = 92 MB.
  assert (
    models.tile_budget((100, 16, 16, 64), (5, 5, 64, 8), 'VALID', 'NHWC') > 0
  )
  # 9.2 MB
  assert (
    models.tile_budget((10, 16, 16, 64), (5, 5, 64, 8), 'VALID', 'NHWC') == 0
  )


def test_auto_resolves_per_platform_and_bad_names_are_refused():
  expected = 'tiled' if jax.default_backend() == 'cpu' else 'matmul'
  assert models.resolve_conv_impl('auto') == expected
  assert (
    models.conv_layout('matmul') == 'CNHW'
    and models.conv_layout('xla') == 'NHWC'
  )
  assert models.conv_layout('tiled') == 'CNHW'
  with pytest.raises(ConfigError, match='conv_impl'):
    fp.create_model(
      'lenet5', 10, np.zeros((1, 28, 28, 1), np.uint8), conv_impl='fft'
    )


def test_batch_chunk_is_the_largest_divisor_within_the_budget():
  assert models.batch_chunk(32, 1_600_000, 2 << 20) == 1
  assert models.batch_chunk(32, 300_000, 2 << 20) == 4  # 6 fit; 4 divides 32
  assert models.batch_chunk(50, 300_000, 2 << 20) == 5
  assert models.batch_chunk(32, 10, 2 << 20) == 32
  assert models.batch_chunk(7, 10**9, 2 << 20) == 1


@pytest.mark.slow
def test_pooling_has_forward_and_reverse_derivatives_of_the_strided_form():
  # The pooling's value is a reduce_window (computed once, not fused into the
  # next convolution's slices); its derivatives are the strided maxima's, in
  # forward mode too: Per-FedAvg's Hessian-vector product (jvp of grad) works
  # and equals lax.conv + nn.max_pool's.
  x = jnp.asarray(
    np.random.default_rng(1).integers(0, 256, (4, 28, 28, 1), dtype=np.uint8)
  )
  y = jnp.arange(4)
  built = {
    impl: fp.create_model('lenet5', 10, x[:1], conv_impl=impl)
    for impl in ('xla', 'tiled')
  }
  params = built['xla'].init(jax.random.key(0))
  v = jax.tree.map(lambda a: jnp.full_like(a, 0.01), params)

  def hvp(m):
    loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(
      m.apply(p, x), y
    ).mean()
    return jax.jit(lambda p: jax.jvp(jax.grad(loss), (p,), (v,))[1])(params)

  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4),
    hvp(built['tiled']),
    hvp(built['xla']),
  )
  for layout in ('NHWC', 'CNHW'):
    z = jnp.asarray(
      np.random.default_rng(2).standard_normal((3, 2, 9, 8)), jnp.float32
    )
    f = lambda z: (models.max_pool_2x2(z, 'matmul', layout) ** 3).sum()
    g = lambda z: (models.layers._strided_pool(z, (2, 2, 0, layout)) ** 3).sum()
    np.testing.assert_array_equal(f(z), g(z))
    np.testing.assert_allclose(jax.grad(f)(z), jax.grad(g)(z), rtol=1e-6)
    np.testing.assert_allclose(
      jax.vmap(jax.grad(f))(z[None]), jax.grad(g)(z)[None], rtol=1e-6
    )


@pytest.mark.parametrize('convention', ['flax', 'keras'])
@pytest.mark.slow_variants('flax', 'keras')
def test_lstm_sequence_equals_nn_rnn_in_values_gradients_and_hessian_products(
  convention,
):
  """``CharLSTM`` applies its cells by ``recurrent.lstm_sequence`` (the input
  projection and the weight gradients out of the time loop); its outputs,
  gradients and Hessian-vector products (forward over reverse, as Per-FedAvg
  takes them) equal the same parameters run through ``nn.RNN`` of the cell,
  two layers deep."""
  net = models.CharLSTM(
    30,
    embed_dim=6,
    hidden=10,
    num_layers=2,
    projection=5,
    convention=convention,
  )

  # the cells stepped by nn.RNN, as Flax runs them
  class ByCell(models.CharLSTM):
    def features(self, x):
      h = self.embed(x)
      for lstm in self.lstms:
        h = lstm(h)
      return self.project(h)

  ref = ByCell(
    30,
    embed_dim=6,
    hidden=10,
    num_layers=2,
    projection=5,
    convention=convention,
  )
  x = jnp.asarray(np.random.default_rng(0).integers(0, 30, (3, 7)))
  y = jnp.asarray(np.random.default_rng(1).integers(0, 30, (3, 7)))
  params = net.init(jax.random.key(0), x)
  assert jax.tree.structure(params) == jax.tree.structure(
    ref.init(jax.random.key(0), x)
  )
  np.testing.assert_allclose(
    net.apply(params, x), ref.apply(params, x), atol=1e-6
  )

  def loss_of(m):
    return lambda p: optax.softmax_cross_entropy_with_integer_labels(
      m.apply(p, x), y
    ).mean()

  got, want = jax.grad(loss_of(net))(params), jax.grad(loss_of(ref))(params)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), got, want
  )
  v = jax.tree.map(lambda a: normal(2, a.shape), params)
  hvp = lambda m: jax.jvp(jax.grad(loss_of(m)), (params,), (v,))[1]
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), hvp(net), hvp(ref)
  )
