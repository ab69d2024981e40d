"""What google-research/federated's own code computes for Reddi et al.'s
tasks ("Adaptive Federated Optimization", arXiv 2003.00295), recorded on
made inputs: the reference ``tests/test_publisher_reference.py`` compares
the project's rows, losses and server steps with.

Runs where TensorFlow installs (a venv of its own with ``tensorflow-cpu``
and ``attrs``), on a checkout of google-research/federated at the paper's
commit (0b7d004, 2020-09-28)::

  git -C federated archive 0b7d004 utils optimization/shared | tar -x -C /tmp/fed
  <venv with TensorFlow>/bin/python benchmarks/peers/publisher_reference.py \\
      --federated=/tmp/fed --out=tests/data/publisher_reference.npz

Its modules are imported as they are, with a stand-in for
``tensorflow_federated`` whose ``tf_computation`` is the identity (the
preprocessing then runs as plain ``tf.data``) and, for its Yogi, Keras's
``OptimizerV2`` (``tf.keras.optimizers.legacy``: the optimizer class of the
paper's TensorFlow). Recorded:

- Stack Overflow (``utils/datasets/stackoverflow_dataset.py``): a made
  client's training rows (``create_train_dataset_preprocess_fn``, 4 posts
  of at most ``max_elements_per_user`` = 3, rows of 6, batch 2, its shuffle
  off: ``max_shuffle_buffer_size=0``) and test rows, in its ids (PAD 0,
  words 1.., OOV, BOS, EOS).
- Shakespeare (``utils/datasets/shakespeare_dataset.py``): a made client's
  rows (``convert_snippets_to_character_sequence_examples``, rows of 10,
  batch 3, shuffle off).
- For each, its Keras model (``utils/models/*_models.py``, small sizes for
  Stack Overflow) with weights drawn from ``default_rng``: the logits of
  the first batch and ``SparseCategoricalCrossentropy(from_logits=True)``
  of them, as this Keras applies the output's mask (``masked``) and as a
  loss that does not (``unmasked``: the logits as a plain tensor).
- EMNIST (``utils/datasets/emnist_dataset.py``, its task builder given a
  made client and test set): the training batches' sizes and rows (as a set:
  its shuffle is unseeded) and the test batch; CIFAR-100
  (``cifar100_dataset.py``): the test batch (central crop, standardized) and
  the training batches' sizes and shapes (its crop is drawn unseeded).
- Server steps: three ``apply_gradients`` of -Delta (TFF's server update)
  by SGD, SGD with momentum 0.9, Adagrad (initial accumulator 0), Adam and
  its Yogi (initial accumulator 0), each at a learning rate and epsilon.
"""

import argparse
import collections
import importlib.util
import os
import sys
import types

import numpy as np

SO_VOCAB = ['the', 'a', 'to', 'is', 'of']
SO_POSTS = [b'the a zz', b'to is of the a the to', b'', b'a  of']
SO_SEQ, SO_BATCH, SO_MAX_ELEMENTS = 6, 2, 3
SO_SIZES = dict(embedding_size=4, latent_size=5)
SH_SNIPPETS = [
  b'To be, or not',
  b'What?',
  b'A horse! a horse! my kingdom for a horse!',
]
SH_SEQ, SH_BATCH = 10, 3
#: (name, constructor arguments) of the server optimizers recorded.
SERVER = [
  ('sgd', dict(learning_rate=0.5)),
  ('sgd_momentum', dict(learning_rate=0.5, momentum=0.9)),
  (
    'adagrad',
    dict(learning_rate=0.1, initial_accumulator_value=0.0, epsilon=1e-2),
  ),
  ('adam', dict(learning_rate=0.01, epsilon=1e-3)),
  (
    'yogi',
    dict(learning_rate=0.01, initial_accumulator_value=0.0, epsilon=1e-3),
  ),
]


EMNIST_BATCH, CIFAR_BATCH = 3, 2


def emnist_client():
  """Seven 28x28 images (TFF's float pixels, ink 0) and labels."""
  rng = np.random.default_rng(6)
  return rng.random((7, 28, 28)).astype(np.float32), rng.integers(
    0, 62, 7
  ).astype(np.int32)


def cifar100_client():
  """Five 32x32x3 uint8 images (one constant) and labels."""
  rng = np.random.default_rng(7)
  images = rng.integers(0, 256, (5, 32, 32, 3)).astype(np.uint8)
  images[3] = 9
  return images, rng.integers(0, 100, 5).astype(np.int64)


def server_deltas():
  """x_0 and the three mean model changes Delta_t the server steps apply."""
  rng = np.random.default_rng(3)
  return (
    rng.normal(0, 1, 5).astype(np.float32),
    [rng.normal(0, s, 5).astype(np.float32) for s in (0.1, 0.01, 0.5)],
  )


def keras_weights(shapes, seed):
  """Weights of Keras's ``get_weights()`` shapes drawn from
  ``default_rng(seed)``."""
  rng = np.random.default_rng(seed)
  return [rng.normal(0, 0.3, s).astype(np.float32) for s in shapes]


def _load(root, relative, name):
  spec = importlib.util.spec_from_file_location(
    name, os.path.join(root, relative)
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


class _MadeClientData:
  """What a task builder gets from ``tff.simulation.datasets.<task>.
  load_data()``: ``preprocess(fn)`` keeps ``fn`` (applied here to a made
  client); ``create_tf_dataset_from_all_clients()`` is the made test set."""

  def __init__(self, pooled=None):
    self.pooled, self.fn = pooled, None

  def preprocess(self, fn):
    self.fn = fn
    return self

  def create_tf_dataset_from_all_clients(self):
    return self.pooled


def _stand_in_tff(tasks):
  tff = types.ModuleType('tensorflow_federated')
  tff.tf_computation = lambda *a, **k: lambda f: f
  tff.SequenceType = lambda *a, **k: None
  tff.simulation = types.SimpleNamespace(
    datasets=types.SimpleNamespace(**tasks)
  )
  sys.modules['tensorflow_federated'] = tff
  # its Python's name (gone in 3.10)
  collections.Iterable = collections.abc.Iterable


def _rows(dataset):
  xs, ys, sizes = [], [], []
  for x, y in dataset:
    xs.append(x.numpy())
    ys.append(y.numpy())
    sizes.append(len(x))
  return (
    np.concatenate(xs).astype(np.int32),
    np.concatenate(ys).astype(np.int32),
    sizes,
  )


def _losses(tf, model, x, y):
  logits = model(x)
  loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  return (
    logits.numpy(),
    float(loss(y, logits)),
    float(loss(y, tf.constant(logits.numpy()))),
  )


def main():
  p = argparse.ArgumentParser()
  p.add_argument(
    '--federated', required=True, help='google-research/federated at 0b7d004'
  )
  p.add_argument('--out', required=True)
  a = p.parse_args()
  import tensorflow as tf  # noqa: PLC0415  (its own venv)

  pixels, labels = emnist_client()
  images, image_labels = cifar100_client()
  emnist_data = (
    _MadeClientData(),
    _MadeClientData(
      tf.data.Dataset.from_tensor_slices(
        collections.OrderedDict(label=labels, pixels=pixels)
      )
    ),
  )
  cifar_data = (
    _MadeClientData(),
    _MadeClientData(
      tf.data.Dataset.from_tensor_slices(
        collections.OrderedDict(
          coarse_label=image_labels // 5, image=images, label=image_labels
        )
      )
    ),
  )
  _stand_in_tff(
    {
      'emnist': types.SimpleNamespace(
        load_data=lambda only_digits=False: emnist_data
      ),
      'cifar100': types.SimpleNamespace(load_data=lambda: cifar_data),
    }
  )
  out = {'tensorflow': np.array(tf.__version__)}

  emnist = _load(
    a.federated, 'utils/datasets/emnist_dataset.py', 'emnist_dataset'
  )
  train, test = emnist.get_emnist_datasets(
    client_batch_size=EMNIST_BATCH, client_epochs_per_round=1
  )
  client = tf.data.Dataset.from_tensor_slices(
    collections.OrderedDict(label=labels, pixels=pixels)
  )
  # shuffled unseeded: its rows as a set, its batch sizes
  batches = list(train.fn(client))
  out['emnist_batches'] = np.array([len(y) for _, y in batches])
  out['emnist_train_labels'] = np.sort(
    np.concatenate([y.numpy() for _, y in batches])
  )
  out['emnist_train_pixel_sums'] = np.sort(
    np.concatenate([x.numpy().reshape(len(x), -1).sum(1) for x, _ in batches])
  )
  ((x, y),) = list(test)
  out['emnist_test_x'], out['emnist_test_y'] = x.numpy(), y.numpy()

  cifar = _load(
    a.federated, 'utils/datasets/cifar100_dataset.py', 'cifar100_dataset'
  )
  train, test = cifar.get_federated_cifar100(
    client_epochs_per_round=1,
    train_batch_size=CIFAR_BATCH,
    crop_shape=(24, 24, 3),
  )
  ((x, y),) = list(test)
  out['cifar_test_x'], out['cifar_test_y'] = x.numpy(), y.numpy()
  client = tf.data.Dataset.from_tensor_slices(
    collections.OrderedDict(
      coarse_label=image_labels // 5, image=images, label=image_labels
    )
  )
  batches = list(train.fn(client))
  # drop_remainder=True
  out['cifar_batches'] = np.array([len(y) for _, y in batches])
  out['cifar_train_shapes'] = np.array([list(x.shape) for x, _ in batches])

  so = _load(
    a.federated, 'utils/datasets/stackoverflow_dataset.py', 'so_dataset'
  )
  posts = collections.OrderedDict(
    creation_date=[b'd'] * 4,
    title=[b't'] * 4,
    score=np.zeros(4, np.int64),
    tags=[b'g'] * 4,
    tokens=SO_POSTS,
    type=[b'question'] * 4,
  )
  raw = tf.data.Dataset.from_tensor_slices(posts)
  train = so.create_train_dataset_preprocess_fn(
    vocab=SO_VOCAB,
    num_oov_buckets=1,
    client_batch_size=SO_BATCH,
    client_epochs_per_round=1,
    max_seq_len=SO_SEQ,
    max_training_elements_per_user=SO_MAX_ELEMENTS,
    max_shuffle_buffer_size=0,
  )
  out['so_x'], out['so_y'], out['so_batches'] = _rows(train(raw))
  test = so.create_test_dataset_preprocess_fn(
    vocab=SO_VOCAB, num_oov_buckets=1, max_seq_len=SO_SEQ
  )
  out['so_test_x'], out['so_test_y'], _ = _rows(test(raw))
  so_models = _load(
    a.federated, 'utils/models/stackoverflow_models.py', 'so_models'
  )
  net = so_models.create_recurrent_model(
    vocab_size=len(SO_VOCAB), num_oov_buckets=1, **SO_SIZES
  )
  net.set_weights(keras_weights([w.shape for w in net.get_weights()], 4))
  x, y = out['so_x'][:SO_BATCH], out['so_y'][:SO_BATCH]
  out['so_logits'], out['so_loss_masked'], out['so_loss_unmasked'] = _losses(
    tf, net, x, y
  )

  sh = _load(a.federated, 'utils/datasets/shakespeare_dataset.py', 'sh_dataset')
  snippets = tf.data.Dataset.from_tensor_slices(
    collections.OrderedDict(snippets=SH_SNIPPETS)
  )
  rows = sh.convert_snippets_to_character_sequence_examples(
    snippets,
    batch_size=SH_BATCH,
    epochs=1,
    shuffle_buffer_size=0,
    sequence_length=SH_SEQ,
  )
  out['sh_x'], out['sh_y'], out['sh_batches'] = _rows(rows)
  sh_models = _load(
    a.federated, 'utils/models/shakespeare_models.py', 'sh_models'
  )
  net = sh_models.create_recurrent_model(
    vocab_size=len(sh.CHAR_VOCAB) + 4, sequence_length=SH_SEQ
  )
  net.build((None, SH_SEQ))
  net.set_weights(keras_weights([w.shape for w in net.get_weights()], 5))
  rows = slice(0, SH_BATCH)  # the first batch: PAD inputs in two rows
  out['sh_logits'], out['sh_loss_masked'], out['sh_loss_unmasked'] = _losses(
    tf, net, out['sh_x'][rows], out['sh_y'][rows]
  )

  # the paper's OptimizerV2
  tf.keras.optimizers.Optimizer = tf.keras.optimizers.legacy.Optimizer
  yogi = _load(
    a.federated, 'optimization/shared/keras_optimizers/yogi.py', 'yogi'
  )
  make = {
    'sgd': tf.keras.optimizers.legacy.SGD,
    'sgd_momentum': tf.keras.optimizers.legacy.SGD,
    'adagrad': tf.keras.optimizers.legacy.Adagrad,
    'adam': tf.keras.optimizers.legacy.Adam,
    'yogi': yogi.Yogi,
  }
  x0, deltas = server_deltas()
  for name, kwargs in SERVER:
    var, opt = tf.Variable(x0), make[name](**kwargs)
    steps = []
    for d in deltas:  # TFF's server_update: apply_gradients of -Delta
      opt.apply_gradients([(tf.constant(-d), var)])
      steps.append(var.numpy().copy())
    out[f'server_{name}'] = np.stack(steps)
  np.savez_compressed(a.out, **{k: np.asarray(v) for k, v in out.items()})
  print(f'wrote {a.out}: TensorFlow {tf.__version__}')


if __name__ == '__main__':
  main()
