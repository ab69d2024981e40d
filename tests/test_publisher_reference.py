"""The project against google-research/federated's own code for Reddi et
al.'s tasks ("Adaptive Federated Optimization", arXiv 2003.00295), as
recorded by ``benchmarks/peers/publisher_reference.py`` (TensorFlow 2.15, the
paper's commit 0b7d004): Stack Overflow's and Shakespeare's rows in order,
their Keras models' logits and loss on the same weights, and one server
step after another of each server optimizer."""

import os

import helpers
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_personal import models
from fedjax_personal.config import TrainingConfig
from fedjax_personal.core.losses import Batch, batch_loss
from fedjax_personal.datasets import shakespeare, stackoverflow
from fedjax_personal.models import weights
from fedjax_personal.models.architectures import CharLSTM
from fedjax_personal.models.model import from_flax

REF = np.load(
  os.path.join(os.path.dirname(__file__), 'data', 'publisher_reference.npz')
)
PEER = helpers.script_module('benchmarks', 'peers', 'publisher_reference.py')

#: The project's server optimizer for each recorded Keras one.
SERVER = {
  'sgd': dict(server_optimizer='sgd', server_lr=0.5),
  'sgd_momentum': dict(
    server_optimizer='sgd', server_lr=0.5, server_momentum=0.9
  ),
  'adagrad': dict(
    server_optimizer='keras_adagrad', server_lr=0.1, server_tau=1e-2
  ),
  'adam': dict(
    server_optimizer='keras_adam',
    server_lr=0.01,
    server_tau=1e-3,
    server_beta2=0.999,
  ),
  'yogi': dict(
    server_optimizer='keras_yogi',
    server_lr=0.01,
    server_tau=1e-3,
    server_beta2=0.999,
  ),
}


@pytest.mark.parametrize('name', sorted(SERVER))
def test_server_steps_equal_the_publishers(name):
  """Three server steps on the pseudo-gradients -Delta equal its Keras
  optimizer's (its Yogi's) ``apply_gradients``."""
  assert dict(PEER.SERVER)[name]  # the recorded constructor arguments
  x0, deltas = PEER.server_deltas()
  opt = TrainingConfig(**SERVER[name]).make_server_optimizer()
  params = {'w': jnp.asarray(x0)}
  state = opt.init(params)
  for t, d in enumerate(deltas):
    updates, state = opt.update({'w': -jnp.asarray(d)}, state, params)
    params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(
      params['w'], REF[f'server_{name}'][t], rtol=2e-6, atol=2e-7
    )


def _so_to_publisher_ids(ids, vocab_size):
  """The project's (FedJAX's) Stack Overflow ids in the publisher's: PAD 0,
  words 1.., OOV, BOS, EOS (``stackoverflow_dataset.get_special_tokens``)."""
  table = np.array(
    [0, vocab_size + 2, vocab_size + 3]
    + list(range(1, vocab_size + 1))
    + [vocab_size + 1]
  )
  return table[ids]


def test_stackoverflow_rows_equal_the_publishers():
  """``rows='tff'``: the training rows of a client's first
  ``max_elements_per_user`` posts, and the test rows, id for id."""
  vocab = stackoverflow.word_ids(PEER.SO_VOCAB)
  x, y = stackoverflow.tokenize_sentences(
    PEER.SO_POSTS, vocab, PEER.SO_SEQ, rows='tff'
  )
  v = len(PEER.SO_VOCAB)
  np.testing.assert_array_equal(_so_to_publisher_ids(x, v), REF['so_test_x'])
  np.testing.assert_array_equal(_so_to_publisher_ids(y, v), REF['so_test_y'])
  n = PEER.SO_MAX_ELEMENTS  # --max_client_examples takes a client's first ones
  np.testing.assert_array_equal(_so_to_publisher_ids(x[:n], v), REF['so_x'])
  np.testing.assert_array_equal(_so_to_publisher_ids(y[:n], v), REF['so_y'])
  fx, fy = stackoverflow.tokenize_sentences(PEER.SO_POSTS, vocab, PEER.SO_SEQ)
  assert (fx != x).any() and (
    fy[x == stackoverflow.PAD] < 0
  ).all()  # FedJAX's differ


def _keras_model(tmp_path, module, keras_weights, x):
  path = tmp_path / 'keras.npz'
  np.savez(path, *keras_weights)
  model = from_flax('ref', module, x)
  return model, weights.load(str(path), model, x)


def _loss(model, params, x, y):
  loss, _ = batch_loss(
    model, params, Batch(jnp.asarray(x), jnp.asarray(y), jnp.ones(len(x), bool))
  )
  return float(loss)


def test_stackoverflow_loss_equals_the_publishers(tmp_path):
  """Its Keras LSTM (``mask_zero=True``) on the same weights, ids relabeled:
  the logits, and the loss its TFF model computed (every target, PAD ones
  included: the cross-entropy of the logits, ``unmasked``)."""
  v = len(PEER.SO_VOCAB)
  table = _so_to_publisher_ids(np.arange(v + 4), v)
  w = PEER.keras_weights(
    [(v + 4, 4), (4, 20), (5, 20), (20,), (5, 4), (4,), (4, v + 4), (v + 4,)], 4
  )
  # its ids -> the project's
  w[0], w[6], w[7] = (
    w[0][table],
    w[6][:, table],
    w[7][table],
  )
  vocab = stackoverflow.word_ids(PEER.SO_VOCAB)
  x, y = stackoverflow.tokenize_sentences(
    PEER.SO_POSTS[: PEER.SO_BATCH], vocab, PEER.SO_SEQ, rows='tff'
  )
  module = CharLSTM(
    v + 4,
    embed_dim=4,
    hidden=5,
    num_layers=1,
    projection=4,
    convention='keras',
    mask_pad=True,
  )
  model, params = _keras_model(tmp_path, module, w, x)
  np.testing.assert_allclose(
    np.asarray(model.apply(params, x)),
    REF['so_logits'][..., table],
    rtol=1e-5,
    atol=1e-5,
  )
  assert _loss(model, params, x, y) == pytest.approx(
    float(REF['so_loss_unmasked']), rel=1e-5
  )


@pytest.mark.slow
def test_shakespeare_rows_and_loss_equal_the_publishers(tmp_path):
  """``--shakespeare_windows=tff`` rows equal
  ``convert_snippets_to_character_sequence_examples``'s in order (its
  shuffle off); ``reddi_char_lstm`` on its weights gives its logits (a PAD
  input repeats the last real output) and its unmasked loss."""
  x, y = shakespeare.tff_sequences(PEER.SH_SNIPPETS, PEER.SH_SEQ)
  np.testing.assert_array_equal(x, REF['sh_x'])
  np.testing.assert_array_equal(y, REF['sh_y'])
  b = PEER.SH_BATCH
  shapes = [
    (90, 8),
    (8, 1024),
    (256, 1024),
    (1024,),
    (256, 1024),
    (256, 1024),
    (1024,),
    (256, 90),
    (90,),
  ]
  w = PEER.keras_weights(shapes, 5)
  path = tmp_path / 'keras.npz'
  np.savez(path, *w)
  model = models.create_model('reddi_char_lstm', 90, x[:b], init='keras')
  params = weights.load(str(path), model, x[:b])
  np.testing.assert_allclose(
    np.asarray(model.apply(params, x[:b])),
    REF['sh_logits'],
    rtol=1e-4,
    atol=1e-5,
  )
  assert _loss(model, params, x[:b], y[:b]) == pytest.approx(
    float(REF['sh_loss_unmasked']), rel=1e-5
  )


# -- the flagfiles against the publisher's defaults and best hyperparameters ---

TASKS = {
  'cifar100_image': 'reddi_cifar100_resnet',
  'emnist_character': 'reddi_emnist_cnn',
  'shakespeare_character': 'reddi_shakespeare_lstm',
  'stackoverflow_word': 'reddi_stackoverflow_lstm',
}


def _publisher_tables():
  """``tests/data/publisher_hyperparameters.md`` (its
  ``optimization/docs/hyperparameters.md``): the table after each bold
  title, as {title: {task: {column: value}}}."""
  text = open(
    os.path.join(
      os.path.dirname(__file__), 'data', 'publisher_hyperparameters.md'
    )
  ).read()
  tables, title, header = {}, None, None
  for line in text.splitlines():
    if line.startswith('**') and line.endswith('**'):
      title, header = line.strip('*'), None
    elif '|' in line and title:
      cells = [c.strip() for c in line.split('|')]
      if header is None:
        header = cells
      elif not set(cells[0]) <= set('- '):
        tables.setdefault(title, {})[cells[0]] = dict(
          zip(header[1:], cells[1:])
        )
  return tables


def _flags(name):
  path = os.path.join(
    os.path.dirname(__file__), '..', 'scripts', 'configs', name + '.flags'
  )
  return dict(
    line.strip()[2:].split('=', 1)
    for line in open(path)
    if line.startswith('--')
  )


@pytest.mark.parametrize('task', sorted(TASKS))
def test_reddi_flagfiles_use_the_publishers_settings(task):
  """Each Reddi flagfile runs FedAdam as the publisher's code ran it (Keras's
  Adam, beta2 0.999) at its best client and server rates and epsilon
  (10^x in its table), with its clients per round, batch, rounds and one
  local epoch; Stack Overflow with its 1,000 examples a client."""
  tables, flags = _publisher_tables(), _flags(TASKS[task])
  assert (flags['server_optimizer'], flags['server_beta2']) == (
    'keras_adam',
    '0.999',
  )
  for title, flag in (
    ('Client learning rates', 'client_lr'),
    ('Server learning rates', 'server_lr'),
    ('Epsilon values', 'server_tau'),
  ):
    want = 10 ** float(tables[title][task]['Adam'])
    assert float(flags[flag]) == pytest.approx(want, rel=1e-9), (task, flag)
  defaults = tables['Default values'][task]
  assert int(flags['cohort_size']) == int(defaults['Clients per round'])
  assert int(flags['batch_size']) == int(defaults['Batch size'])
  assert int(flags['rounds']) == int(defaults['Total rounds'])
  cross = tables['Cross-task hyperparameters']
  assert int(flags['local_epochs']) == int(
    cross['Number of client epochs']['Value']
  )
  # its default, 1
  assert flags['cohort_sampler'] == 'tff' and 'cohort_seed' not in flags
  from fedjax_personal.run.settings import ExperimentSettings

  assert ExperimentSettings().cohort_seed == int(
    cross['Client sampling seed']['Value']
  )
  if task == 'stackoverflow_word':
    so = tables['Stack Overflow NWP']
    assert int(flags['max_client_examples']) == int(
      so['Max examples per client']['Value']
    )
    options = stackoverflow.StackOverflowOptions()
    assert options.vocab_size is None  # the default, 10,000
    assert int(so['Vocabulary size']['Value']) == 10000
    assert options.sequence_length == int(so['Sequence length']['Value'])
    assert stackoverflow.VALIDATION_EXAMPLES == int(
      so['Validation set size']['Value']
    )
    assert (flags['stackoverflow_rows'], flags['stackoverflow_test']) == (
      'tff',
      'tff_test_file',
    )
  if task == 'shakespeare_character':
    length = tables['Shakespeare Character Prediction'][
      'Character sequence length'
    ]['Value']
    assert shakespeare.ShakespeareOptions().sequence_length == int(length)
    assert 'seq_len' not in flags


def test_emnist_and_cifar100_inputs_equal_the_publishers():
  """EMNIST (``--emnist_pixels=tff``): its test batch, pixels as they are
  with a channel, and its training batches of 3 over a client of 7 (sizes
  3, 3, 1, every row once); CIFAR-100 (``--cifar100_preprocess=reddi``): its
  test batch, the central 24x24 standardized, and training batches of 24x24
  windows, every image in a batch cropped at one window."""
  import jax

  from fedjax_personal.core import batching as batching_lib
  from fedjax_personal.datasets import emnist
  from fedjax_personal.models import inputs

  pixels, labels = PEER.emnist_client()
  got = emnist.preprocess_batch_tff(
    {'pixels': pixels, 'label': labels, 'domain_id': labels * 0}
  )
  np.testing.assert_array_equal(got['x'], REF['emnist_test_x'])
  np.testing.assert_array_equal(got['y'], REF['emnist_test_y'])
  idx, mask = batching_lib.batch_indices(
    jax.random.key(0),
    jnp.int32(7),
    7,
    batching_lib.Batching(PEER.EMNIST_BATCH, num_epochs=1),
  )
  np.testing.assert_array_equal(np.asarray(mask).sum(1), REF['emnist_batches'])
  rows = np.asarray(idx)[np.asarray(mask)]
  np.testing.assert_array_equal(
    np.sort(labels[rows]), REF['emnist_train_labels']
  )
  np.testing.assert_allclose(
    np.sort(pixels[rows].reshape(7, -1).sum(1)),
    REF['emnist_train_pixel_sums'],
    rtol=1e-6,
  )
  images, image_labels = PEER.cifar100_client()
  t = inputs.reddi_cifar100()
  np.testing.assert_allclose(
    np.asarray(t.evaluate(jnp.asarray(images))),
    REF['cifar_test_x'],
    rtol=1e-5,
    atol=1e-5,
  )
  shapes = [
    np.asarray(
      t.train(jax.random.key(k), jnp.asarray(images[2 * k : 2 * k + 2]))
    ).shape
    for k in range(2)
  ]
  np.testing.assert_array_equal(shapes, REF['cifar_train_shapes'])


def test_tff_cohorts_are_the_publishers():
  """--cohort_sampler=tff: round r's cohort is google-research/federated's
  ``build_sample_fn`` draw (and FedJAX's ``UniformGetClientSampler``'s, the
  same Lehmer-seeded ``RandomState.choice``), whatever the run's keys."""
  import jax

  from fedjax_personal.core.sampling import CohortSampler
  from fedjax_personal.fedjax.core.client_samplers import (
    get_pseudo_random_state,
  )

  sampler = CohortSampler(20, cohort_size=4, tff_seed=1, rounds=6)
  for r in range(6):
    want = get_pseudo_random_state(1, r).choice(
      np.arange(20), size=4, replace=False
    )
    for key in (0, 9):
      got = sampler(jax.random.key(key), round_num=r)
      np.testing.assert_array_equal(np.asarray(got.idx), want)
  # The publisher's code: RandomState(pow(16807, r, M) * start % M).choice(ids,
  # 4, replace=False).
  start = np.random.RandomState(1).randint(1, 2**31 - 2)
  ids = np.array([f'c{i:02d}' for i in range(20)])
  theirs = np.random.RandomState(
    pow(16807, 3, 2**31 - 1) * start % (2**31 - 1)
  ).choice(ids, size=4, replace=False)
  np.testing.assert_array_equal(
    ids[np.asarray(sampler(jax.random.key(0), round_num=3).idx)], theirs
  )
