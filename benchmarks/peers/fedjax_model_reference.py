"""FedJAX 0.0.17's language models and its EMNIST CNN on small sizes: the
reference ``tests/test_fedjax_models.py`` compares ``fedjax_lstm_lm``,
``fedjax_char_lstm`` and ``fedjax_emnist_cnn`` with (runs in FedJAX's venv;
writes one ``.npz``).

  <FedJAX venv>/bin/python benchmarks/peers/fedjax_model_reference.py \
      --out=tests/data/fedjax_model_reference.npz

For each of FedJAX's ``models.stackoverflow.create_lstm_model`` and
``models.shakespeare.create_lstm_model`` (at the sizes of ``SIZES``), drawn
with ``model.init(PRNGKey(0))``, on one padded batch (``batch``: targets
PAD after each sequence's end, the last example masked out): its parameters
(``<task>/param/<module>/<name>``), ``apply_for_eval``'s logits, the
per-example ``train_loss``, the loss ``fedjax.model_grad``
differentiates (the mean over the real examples) and its gradient
(``<task>/grad/...``). For the EMNIST CNN (``models.emnist.
ConvDropoutModule``, the module of ``create_conv_model``, 10 classes), on
``CNN_INPUT`` images of 8x8 (its flattened features then 256, not 9,216:
the same layers at a small size): its parameters
(``emnist_cnn/param/...``) and its evaluation logits (``is_train=False``).
"""

import argparse

import numpy as np

# task -> (create_lstm_model's arguments, batch size, sequence length).
SIZES = {
  'stackoverflow': (
    dict(vocab_size=13, embed_size=5, lstm_hidden_size=7),
    4,
    6,
  ),
  'shakespeare': (
    dict(vocab_size=11, embed_size=4, lstm_hidden_size=6, lstm_num_layers=2),
    4,
    6,
  ),
}
# Real (unpadded) length of each example's targets; the last example is masked.
LENGTHS = (6, 3, 1, 4)


def batch(vocab_size: int, size: int, length: int, seed: int = 0):
  """A padded batch in FedJAX's layout: ids 1..vocab_size + 3, PAD (0) after
  each example's ``LENGTHS``, the last example's mask False."""
  rng = np.random.default_rng(seed)
  x = rng.integers(1, vocab_size + 4, (size, length)).astype(np.int32)
  y = rng.integers(1, vocab_size + 4, (size, length)).astype(np.int32)
  for i, n in enumerate(LENGTHS[:size]):
    x[i, n:] = 0
    y[i, n:] = 0
  mask = np.ones(size, bool)
  mask[-1] = False
  return {'x': x, 'y': y, '__mask__': mask}


def record(task: str) -> dict:
  """The arrays recorded for one task (FedJAX's model, on FedJAX)."""
  import fedjax  # noqa: PLC0415  (FedJAX's venv)
  import jax  # noqa: PLC0415

  # FedJAX's LSTMs name it; jax 0.4.30 removed it
  jax.numpy.NINF = -jax.numpy.inf
  kwargs, size, length = SIZES[task]
  create = getattr(fedjax.models, task).create_lstm_model
  model = create(**kwargs)
  params = model.init(jax.random.PRNGKey(0))
  b = batch(kwargs['vocab_size'], size, length)
  logits = model.apply_for_eval(params, b)
  per_example = model.train_loss(b, logits)
  per_example_loss = fedjax.model_per_example_loss(model)

  def mean_loss(p):
    losses = per_example_loss(p, b, None)
    return (losses * b['__mask__']).sum() / b['__mask__'].sum()

  loss, grads = jax.value_and_grad(mean_loss)(params)
  fedjax_grads = fedjax.model_grad(model)(params, b, None)
  out = {
    f'{task}/x': b['x'],
    f'{task}/y': b['y'],
    f'{task}/mask': b['__mask__'],
    f'{task}/logits': np.asarray(logits),
    f'{task}/train_loss': np.asarray(per_example),
    f'{task}/loss': np.asarray(loss),
  }
  for module, leaves in params.items():
    for name, value in leaves.items():
      out[f'{task}/param/{module}/{name}'] = np.asarray(value)
      out[f'{task}/grad/{module}/{name}'] = np.asarray(
        fedjax_grads[module][name]
      )
      # model_grad differentiates mean_loss
      np.testing.assert_allclose(
        grads[module][name], fedjax_grads[module][name], rtol=1e-5, atol=1e-7
      )
  return out


# The EMNIST CNN's small input: 5 images of 8x8x1.
CNN_INPUT = (5, 8, 8, 1)


def record_cnn() -> dict:
  """FedJAX's EMNIST CNN module at a small input: parameters and logits."""
  import fedjax  # noqa: PLC0415  (FedJAX's venv)
  import haiku as hk  # noqa: PLC0415
  import jax  # noqa: PLC0415

  forward = hk.transform(
    lambda x, is_train: fedjax.models.emnist.ConvDropoutModule(10)(x, is_train)
  )
  x = np.random.default_rng(0).random(CNN_INPUT).astype(np.float32)
  params = forward.init(jax.random.PRNGKey(0), x, False)
  logits = forward.apply(params, None, x, False)
  out = {'emnist_cnn/x': x, 'emnist_cnn/logits': np.asarray(logits)}
  for module, leaves in params.items():
    for name, value in leaves.items():
      out[f'emnist_cnn/param/{module}/{name}'] = np.asarray(value)
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--out', required=True)
  a = p.parse_args()
  out = {}
  for task in SIZES:
    out.update(record(task))
  out.update(record_cnn())
  np.savez(a.out, **out)
  print(f'wrote {a.out}: {len(out)} arrays')


if __name__ == '__main__':
  main()
