"""FedJAX's language models (``fedjax_lstm_lm``, ``fedjax_char_lstm``)
against FedJAX 0.0.17 itself: ``tests/data/fedjax_model_reference.npz`` holds
FedJAX's ``create_lstm_model`` of Stack Overflow and of Shakespeare at small
sizes, their parameters, logits, per-example training losses, the loss its
``model_grad`` differentiates and the gradient, on one padded and masked
batch (``benchmarks/peers/fedjax_model_reference.py``, in FedJAX's venv).
The same module at the same small sizes, given FedJAX's parameters, must
give the same numbers."""

import dataclasses
import os

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_personal import models
from fedjax_personal.core.training import Batch, batch_loss
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import initializers, weights

REFERENCE = os.path.join(
  os.path.dirname(__file__), 'data', 'fedjax_model_reference.npz'
)
# Haiku's LSTM kernel columns are the gates i, g, f, o; ours i, f, g, o.
HAIKU_GATES = 'igfo'


def _reference(task):
  d = np.load(REFERENCE)
  return {k[len(task) + 1 :]: d[k] for k in d if k.startswith(task + '/')}


def _module(name, task):
  """The registry's module of ``name`` at the reference's small sizes."""
  ref = helpers.script_module(
    'benchmarks', 'peers', 'fedjax_model_reference.py'
  )
  sizes = ref.SIZES[task][0]
  vocab = sizes['vocab_size'] + 4  # PAD, BOS, EOS, OOV
  module = models.instantiate(name, vocab, 0, 'auto', 'haiku')
  small = dict(embed_dim=sizes['embed_size'], hidden=sizes['lstm_hidden_size'])
  if module.projection:
    # FedJAX projects back to the embedding's width
    small['projection'] = sizes['embed_size']
  return dataclasses.replace(module, **small), vocab


def _lstm_names(task):
  return ['lstm'] if task == 'stackoverflow' else ['lstm', 'lstm_1']


def to_ours(flat, task):
  """FedJAX's (Haiku's) parameters in this module's layout."""
  p = {'embed': {'embedding': flat['param/embed/embeddings']}}
  for i, name in enumerate(_lstm_names(task)):
    w, b = flat[f'param/{name}/linear/w'], flat[f'param/{name}/linear/b']
    hidden = w.shape[1] // 4
    d_in = w.shape[0] - hidden
    cell = {}
    for g in initializers.GATES:
      cols = slice(
        HAIKU_GATES.index(g) * hidden, (HAIKU_GATES.index(g) + 1) * hidden
      )
      cell[f'i{g}'] = {'kernel': w[:d_in, cols]}
      # hk.LSTM adds 1 to the forget gate's pre-activation: here its bias.
      cell[f'h{g}'] = {'kernel': w[d_in:, cols], 'bias': b[cols] + (g == 'f')}
    p[f'lstm_{i}'] = {'cell': cell}
  dense = ['linear', 'linear_1'] if task == 'stackoverflow' else ['linear']
  ours = ['project', 'output'] if task == 'stackoverflow' else ['output']
  for h, o in zip(dense, ours):
    p[o] = {'kernel': flat[f'param/{h}/w'], 'bias': flat[f'param/{h}/b']}
  return jax.tree.map(jnp.asarray, p)


def grads_as_haiku(g, task):
  """Our gradient in FedJAX's layout (the inverse of ``to_ours``'s split)."""
  out = {'embed/embeddings': g['embed']['embedding']}
  for i, name in enumerate(_lstm_names(task)):
    cell = g[f'lstm_{i}']['cell']
    out[f'{name}/linear/w'] = np.concatenate(
      [
        np.concatenate([cell[f'i{c}']['kernel'], cell[f'h{c}']['kernel']], 0)
        for c in HAIKU_GATES
      ],
      1,
    )
    out[f'{name}/linear/b'] = np.concatenate(
      [cell[f'h{c}']['bias'] for c in HAIKU_GATES]
    )
  dense = ['linear', 'linear_1'] if task == 'stackoverflow' else ['linear']
  ours = ['project', 'output'] if task == 'stackoverflow' else ['output']
  for h, o in zip(dense, ours):
    out[f'{h}/w'], out[f'{h}/b'] = g[o]['kernel'], g[o]['bias']
  return out


def _check(name, task, denominator):
  flat = _reference(task)
  module, vocab = _module(name, task)
  assert models.LOSS_DENOMINATORS[name] == denominator
  x = jnp.asarray(flat['x'])
  model = dataclasses.replace(
    models.from_flax(name, module, x), loss_denominator=denominator
  )
  params = to_ours(flat, task)
  # The module's own parameter tree has exactly these names and shapes.
  drawn = jax.eval_shape(model.init, jax.random.key(0))
  assert jax.tree.map(lambda a: a.shape, drawn) == jax.tree.map(
    lambda a: a.shape, params
  )
  logits = model.apply(params, x)
  np.testing.assert_allclose(logits, flat['logits'], rtol=1e-5, atol=1e-5)
  # FedJAX's PAD target: here IGNORE
  y = np.where(flat['y'] == 0, -1, flat['y'])
  batch = Batch(x, jnp.asarray(y), jnp.asarray(flat['mask']), None)
  (loss, _), grads = jax.value_and_grad(
    lambda p: batch_loss(model, p, batch), has_aux=True
  )(params)
  np.testing.assert_allclose(loss, flat['loss'], rtol=1e-5)
  for k, g in grads_as_haiku(grads, task).items():
    np.testing.assert_allclose(
      g, flat[f'grad/{k}'], rtol=1e-4, atol=1e-6, err_msg=k
    )
  return model, params, flat


@pytest.mark.slow
def test_fedjax_lstm_lm_is_fedjax_stackoverflow_create_lstm_model():
  """Logits, the loss (a sentence's token losses summed, averaged over the
  real sentences) and every gradient equal FedJAX's."""
  model, params, flat = _check('fedjax_lstm_lm', 'stackoverflow', 'examples')
  # FedJAX's per-example loss is the sentence's summed token loss, by hand.
  logits = np.asarray(model.apply(params, jnp.asarray(flat['x'])), np.float64)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  y = flat['y']
  tok = -np.take_along_axis(logp, y[..., None], -1)[..., 0] * (y != 0)
  np.testing.assert_allclose(tok.sum(-1), flat['train_loss'], rtol=1e-5)


# slow: 17 s on CI's 2 cores (two LSTMs compiled)
@pytest.mark.slow
def test_fedjax_char_lstm_is_fedjax_shakespeare_create_lstm_model():
  """Logits, the loss (a sequence's token losses over all its positions,
  padded ones included, averaged over the real sequences) and every
  gradient equal FedJAX's."""
  _check('fedjax_char_lstm', 'shakespeare', 'positions')


def test_fedjax_models_at_full_size_have_fedjax_parameter_counts():
  """FedJAX's defaults: Stack Overflow's 10,004 ids, Shakespeare's 90."""
  for name, vocab, count in [
    ('fedjax_lstm_lm', 10004, 4_050_748),
    ('fedjax_char_lstm', 90, 820_522),
  ]:
    model = models.create_model(
      name, vocab, jnp.zeros((1, 20), jnp.int32), init='haiku'
    )
    assert (
      models.num_params(jax.eval_shape(model.init, jax.random.key(0))) == count
    )
    assert model.loss_denominator == models.LOSS_DENOMINATORS[name]
  assert (
    models.create_model(
      'lstm_lm', 10004, jnp.zeros((1, 20), jnp.int32)
    ).loss_denominator
    == 'targets'
  )


def _haiku_npz(path, flat):
  """FedJAX's parameters saved as ``--init_weights`` reads a Haiku dict."""
  np.savez(
    path,
    **{
      k[len('param/') :]: v for k, v in flat.items() if k.startswith('param/')
    },
  )
  return str(path)


def test_init_weights_reads_fedjax_parameters(tmp_path):
  """``--init_weights`` of FedJAX's own parameters (module/name keys) gives
  what the hand conversion gives, and FedJAX's logits, for both models."""
  for name, task in [
    ('fedjax_lstm_lm', 'stackoverflow'),
    ('fedjax_char_lstm', 'shakespeare'),
  ]:
    flat = _reference(task)
    module, _ = _module(name, task)
    x = jnp.asarray(flat['x'])
    model = models.from_flax(name, module, x)
    got = weights.load(_haiku_npz(tmp_path / f'{task}.npz', flat), model, x)
    want = to_ours(flat, task)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(
      model.apply(got, x), flat['logits'], rtol=1e-5, atol=1e-5
    )


def test_init_weights_matches_haiku_layers_by_kind_and_index(tmp_path):
  """FedJAX's dense EMNIST model's three ``linear`` modules go to the MLP's
  layers by their index whatever the file's order; a module too many or of
  another shape is refused naming the flag."""
  x = jnp.zeros((1, 784))
  model = models.create_model('mlp', 62, x)
  rng = np.random.default_rng(0)
  shapes = [(784, 200), (200, 200), (200, 62)]
  layers = {
    ('linear' + (f'_{i}' if i else '')): (
      rng.normal(size=s).astype(np.float32),
      rng.normal(size=s[1]).astype(np.float32),
    )
    for i, s in enumerate(shapes)
  }
  arrays = {}
  for m in ['linear_2', 'linear', 'linear_1']:  # not in index order
    arrays[f'{m}/w'], arrays[f'{m}/b'] = layers[m]
  np.savez(tmp_path / 'dense.npz', **arrays)
  got = weights.load(str(tmp_path / 'dense.npz'), model, x)
  for ours, theirs in [
    ('hidden_0', 'linear'),
    ('hidden_1', 'linear_1'),
    ('output', 'linear_2'),
  ]:
    np.testing.assert_array_equal(got[ours]['kernel'], layers[theirs][0])
    np.testing.assert_array_equal(got[ours]['bias'], layers[theirs][1])
  arrays['linear_3/w'], arrays['linear_3/b'] = layers['linear_2']
  np.savez(tmp_path / 'extra.npz', **arrays)
  with pytest.raises(ConfigError, match='init_weights.*4 dense layer'):
    weights.load(str(tmp_path / 'extra.npz'), model, x)
  del arrays['linear_3/w'], arrays['linear_3/b']
  arrays['linear_1/w'] = arrays['linear_1/w'][:, :10]
  np.savez(tmp_path / 'shape.npz', **arrays)
  with pytest.raises(ConfigError, match='init_weights.*linear_1'):
    weights.load(str(tmp_path / 'shape.npz'), model, x)


@pytest.mark.slow
def test_fedjax_emnist_cnn_gives_fedjax_logits_on_fedjax_weights(tmp_path):
  """FedJAX's EMNIST CNN (``models.emnist.ConvDropoutModule``, recorded on 8x8
  images) given its own Haiku parameters through ``--init_weights``: the
  evaluation logits (dropout off) equal FedJAX's; training draws dropout."""
  ref = _reference('emnist_cnn')
  path = tmp_path / 'fedjax_emnist_cnn.npz'
  np.savez(
    path,
    **{k[len('param/') :]: v for k, v in ref.items() if k.startswith('param/')},
  )
  model = models.build_model(
    models.ModelConfig(model='fedjax_emnist_cnn', init_weights=str(path)),
    10,
    ref['x'],
  )
  params = model.init(jax.random.key(0))
  np.testing.assert_allclose(
    model.apply(params, ref['x']), ref['logits'], rtol=1e-5, atol=1e-6
  )
  y = jnp.zeros(ref['x'].shape[0], jnp.int32)
  mask = jnp.ones(ref['x'].shape[0], bool)
  evaluated = batch_loss(model, params, Batch(ref['x'], y, mask))[0]
  trained = [
    batch_loss(model, params, Batch(ref['x'], y, mask, jax.random.key(k)))[0]
    for k in (1, 2)
  ]
  assert float(trained[0]) != float(evaluated) and float(trained[0]) != float(
    trained[1]
  )
