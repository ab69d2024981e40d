"""FedJAX 0.0.17's FedAvg on the peer benchmark's files (runs in FedJAX's venv).

As FedJAX's own EMNIST (and Stack Overflow, ``--model=lstm``) experiments run
it: ``fedjax.datasets.emnist.load_data`` from ``--data_dir`` (its cache),
``fedjax.models.emnist.create_dense_model`` / ``create_conv_model``,
``fedjax.algorithms.fed_avg.federated_averaging`` (``for_each_client``
underneath) with SGD client and server optimizers,
``ShuffleRepeatBatchHParams(batch_size, num_epochs=1)``, and a
``UniformGetClientSampler``. Prints one JSON line: seconds per round (each round
timed to ``block_until_ready`` of the server parameters), pooled test accuracy
after the rounds, peak RSS (VmHWM).
"""

import argparse
import json
import time

import fedjax
import jax
import numpy as np


def peak_rss_bytes():
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith('VmHWM:'):
        return int(line.split()[1]) * 1024
  return 0


def stackoverflow(a):
  """FedJAX's Stack Overflow splits and LSTM (``create_lstm_model``: embedding
  96, LSTM 670, vocabulary + 4 outputs). FedJAX's tokenizer needs
  TensorFlow; the same ids (PAD 0, BOS 1, EOS 2, word i of the
  ``stackoverflow.word_count`` vocabulary i + 3, OOV after them; x = ids[:-1],
  y = ids[1:], padded / cut to ``max_length``) are made here in numpy."""
  # FedJAX's LSTM names it; jax 0.4.30 removed it
  jax.numpy.NINF = -jax.numpy.inf
  with open(f'{a.data_dir}/stackoverflow.word_count') as f:
    vocab = {
      line.split()[0].encode(): i for i, line in zip(range(a.vocab_size), f)
    }
  oov = a.vocab_size + 3

  def tokenize(examples):
    n = len(examples['tokens'])
    x = np.zeros((n, a.max_length), np.int32)
    y = np.zeros((n, a.max_length), np.int32)
    for j, t in enumerate(examples['tokens']):
      ids = [1] + [vocab.get(w, oov - 3) + 3 for w in t.split(b' ')] + [2]
      xs, ys = ids[:-1][: a.max_length], ids[1:][: a.max_length]
      x[j, : len(xs)], y[j, : len(ys)] = xs, ys
    return {'x': x, 'y': y}

  train, _, test = fedjax.datasets.stackoverflow.load_data(cache_dir=a.data_dir)
  model = fedjax.models.stackoverflow.create_lstm_model(vocab_size=a.vocab_size)
  return (
    train.preprocess_batch(tokenize),
    test.preprocess_batch(tokenize),
    model,
  )


def shakespeare(a):
  """FedJAX's Shakespeare splits (80-character windows) and LSTM
  (``create_lstm_model``: embedding 8, two LSTMs of 256, 90 outputs)."""
  # FedJAX's LSTM names it; jax 0.4.30 removed it
  jax.numpy.NINF = -jax.numpy.inf
  train, test = fedjax.datasets.shakespeare.load_data(cache_dir=a.data_dir)
  return train, test, fedjax.models.shakespeare.create_lstm_model()


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--data_dir', required=True)
  p.add_argument(
    '--model', choices=['mlp', 'cnn', 'lstm', 'shakespeare'], default='mlp'
  )
  p.add_argument('--cohort_size', type=int, default=10)
  p.add_argument('--rounds', type=int, default=31)
  p.add_argument('--batch_size', type=int, default=20)
  p.add_argument('--client_lr', type=float, default=0.1)
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--vocab_size', type=int, default=10000)
  p.add_argument('--max_length', type=int, default=20)
  p.add_argument(
    '--save_init',
    default=None,
    help="Write the model's initial parameters here "
    "(a .npz of Haiku's module/name keys: the project's --init_weights reads "
    'it).',
  )
  a = p.parse_args()
  if a.model == 'lstm':
    train, test, model = stackoverflow(a)
  elif a.model == 'shakespeare':
    train, test, model = shakespeare(a)
  else:
    train, test = fedjax.datasets.emnist.load_data(
      only_digits=False, cache_dir=a.data_dir
    )
    model = (
      fedjax.models.emnist.create_dense_model(only_digits=False)
      if a.model == 'mlp'
      else fedjax.models.emnist.create_conv_model(only_digits=False)
    )
  grad_fn = fedjax.model_grad(model)
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=a.batch_size, num_epochs=1)
  alg = fedjax.algorithms.fed_avg.federated_averaging(
    grad_fn, fedjax.optimizers.sgd(a.client_lr), fedjax.optimizers.sgd(1.0), hp
  )
  params = model.init(jax.random.PRNGKey(a.seed))
  if a.save_init:
    np.savez(
      a.save_init,
      **{
        f'{m}/{n}': np.asarray(v)
        for m, d in params.items()
        for n, v in d.items()
      },
    )
  state = alg.init(params)
  sampler = fedjax.client_samplers.UniformGetClientSampler(
    train, a.cohort_size, seed=a.seed
  )
  seconds = []
  for _ in range(a.rounds):
    clients = sampler.sample()
    start = time.perf_counter()
    state, _ = alg.apply(state, clients)
    jax.block_until_ready(state.params)
    seconds.append(time.perf_counter() - start)
  # Pooled test accuracy over every test client (FedJAX's evaluate_model).
  batches = fedjax.padded_batch_federated_data(test, batch_size=1024)
  metrics = fedjax.evaluate_model(model, state.params, batches)
  print(
    json.dumps(
      {
        'side': 'fedjax',
        'model': a.model,
        'cohort_size': a.cohort_size,
        'rounds': a.rounds,
        'seconds': seconds,
        's_per_round': float(np.median(seconds[1:])),
        'accuracy': float(
          metrics[
            'accuracy_in_vocab'
            if a.model in ('lstm', 'shakespeare')
            else 'accuracy'
          ]
        ),
        # The mean loss of a test target (the language models' padded targets
        # left out): the project's loss_weighted.
        'loss': float(
          metrics[
            'token_loss' if a.model in ('lstm', 'shakespeare') else 'loss'
          ]
        ),
        'peak_rss_bytes': peak_rss_bytes(),
      }
    )
  )


if __name__ == '__main__':
  main()
