"""Keras's own logits of TFF's Shakespeare character model: the reference
``tests/test_model_init.py`` loads the same Keras weights onto
``reddi_char_lstm`` against (runs where TensorFlow installs, e.g. FedJAX's
venv with ``tensorflow-cpu``; writes one small ``.npz``).

  <venv with TensorFlow>/bin/python benchmarks/peers/keras_reference.py \
      --out=tests/data/keras_char_lstm_logits.npz

The network is google-research/federated's
``shakespeare_models.create_recurrent_model``: Embedding(vocab, 8), two
LSTM(256, return_sequences=True), Dense(vocab); its weights are
``weights(vocab)`` (drawn from ``numpy.random.default_rng(0)``, Keras's
``get_weights()`` order and shapes), its input ``inputs(vocab)``. Recorded:
the input, the logits, and each weight's sum (so a change in NumPy's
draws shows as such, not as a wrong model).
"""

import argparse

import numpy as np

VOCAB = 90


def weights(vocab: int = VOCAB):
  """The Keras weights (``get_weights()`` order and shapes) drawn from
  ``default_rng(0)``."""
  rng = np.random.default_rng(0)
  shapes = [
    (vocab, 8),
    (8, 1024),
    (256, 1024),
    (1024,),
    (256, 1024),
    (256, 1024),
    (1024,),
    (256, vocab),
    (vocab,),
  ]
  return [rng.normal(0, 0.1, s).astype(np.float32) for s in shapes]


def inputs(vocab: int = VOCAB):
  """Two rows of six character ids."""
  return np.random.default_rng(1).integers(1, vocab, (2, 6)).astype(np.int32)


def main():
  import tensorflow as tf  # noqa: PLC0415  (where it installs)

  p = argparse.ArgumentParser()
  p.add_argument('--out', required=True)
  a = p.parse_args()
  keras = tf.keras
  w, x = weights(), inputs()
  net = keras.Sequential(
    [
      keras.layers.Embedding(VOCAB, 8),
      keras.layers.LSTM(256, return_sequences=True),
      keras.layers.LSTM(256, return_sequences=True),
      keras.layers.Dense(VOCAB),
    ]
  )
  net(x)
  net.set_weights(w)
  np.savez_compressed(
    a.out,
    x=x,
    logits=net(x).numpy(),
    weight_sums=np.array([v.astype(np.float64).sum() for v in w]),
    tensorflow=np.array(tf.__version__),
    keras=np.array(keras.__version__),
  )
  print(
    f'wrote {a.out}: Keras {keras.__version__}, TensorFlow {tf.__version__}'
  )


if __name__ == '__main__':
  main()
