"""A model's body and head (``models/head.py``): the split found in the
module's own trace (PFLlib's ``BaseHeadSplit``: the last layer with
parameters that returns the output), or named when it is registered; one
forward pass gives the features and the logits; an algorithm that needs the
split refuses a model without one, naming ``--model`` and itself."""

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_personal import algorithms, models
from fedjax_personal.core.losses import Batch, forward
from fedjax_personal.errors import ConfigError

IMAGES = jnp.zeros((2, 28, 28, 1))


@pytest.mark.parametrize(
  'name,path,features',
  [
    ('logreg', ('output',), 784),
    ('mlp', ('output',), 200),
    ('cnn', ('output',), 512),
    ('pfllib_cnn', ('output',), 512),
  ],
)
def test_the_head_is_the_last_layer_and_one_pass_gives_both(
  name, path, features
):
  model = models.create_model(name, 10, IMAGES)
  assert model.head.path == path
  assert model.head.feature_shape == (features,)
  params = model.init(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), IMAGES.shape)
  logits, z = model.and_features(model.apply)(params, x)
  # the features are those of the module's own ``features`` (a second pass)
  second = model.module.apply({'params': params}, x, method='features')
  np.testing.assert_allclose(z, second, atol=1e-6)
  np.testing.assert_allclose(logits, model.apply(params, x), atol=1e-6)
  body, head = model.head.split(params)
  assert 'output' not in body and set(head) == {'kernel', 'bias'}
  np.testing.assert_allclose(model.head.logits(head, z), logits, atol=1e-6)
  assert helpers.max_diff(model.head.merge(body, head), params) == 0
  # a training pass (losses.forward) gives the same features
  out = forward(
    model, params, Batch(x, jnp.zeros(2, jnp.int32), jnp.ones(2, bool)), True
  )
  np.testing.assert_allclose(out.features, z, atol=1e-6)


class TwoHeads(nn.Module):
  """A model whose last layer is not its classifier."""

  @nn.compact
  def __call__(self, x):
    z = nn.relu(nn.Dense(16, name='body')(x.reshape((x.shape[0], -1))))
    logits = nn.Dense(10, name='classifier')(z)
    return nn.Dense(10, name='calibration')(logits)


def test_a_registered_model_may_name_its_head_and_a_wrong_name_is_refused():
  found = models.from_flax('two', TwoHeads(), IMAGES)
  assert found.head.path == ('calibration',)
  named = models.from_flax('two', TwoHeads(), IMAGES, head='classifier')
  assert named.head.path == ('classifier',)
  assert named.head.feature_shape == (16,)
  with pytest.raises(ConfigError, match="head 'nothing'.*classifier"):
    models.from_flax('two', TwoHeads(), IMAGES, head='nothing')


@pytest.mark.parametrize('name', ['fedrod', 'fedbabu', 'feddbe', 'fedgh'])
def test_an_algorithm_that_needs_a_head_refuses_a_model_without_one(name):
  model = models.create_model('mlp', 10, IMAGES)
  headless = models.Model('mine', model.init, model.apply)
  data = helpers.digits_data(num_clients=2, max_examples=8)
  with pytest.raises(ConfigError) as e:
    algorithms.build(name, headless, data)
  assert e.value.name == 'model'
  assert f'--algorithm={name}' in str(e.value) and "'mine'" in str(e.value)


@pytest.mark.parametrize('count', [0, 1, 63, 64, 65, 100])
def test_a_feature_pass_over_a_clients_real_rows_is_the_whole_pass(count):
  """``features_of_real``: the features of the client's rows, chunk by
  chunk while they hold its examples (64 rows a chunk), equal to one pass
  over them; zeros past its count."""
  from fedjax_personal.core.losses import features_of_real

  rng = np.random.default_rng(0)
  x = rng.normal(size=(100, 28, 28, 1)).astype(np.float32)
  model = models.create_model('lenet5', 10, x[:1])
  params = model.init(jax.random.key(0))
  got = np.asarray(
    jax.jit(features_of_real, static_argnums=0)(model, params, x, count)
  )
  whole = np.asarray(model.features(params, jnp.asarray(x)))
  assert got.shape == whole.shape
  np.testing.assert_allclose(got[:count], whole[:count], atol=1e-5)
  assert not np.any(got[count:])
