"""FedJAX's dataset tutorial (``docs/notebooks/dataset_tutorial.ipynb``) and
``examples/emnist_fed_avg.py``'s data code, cell by cell, on made files: run
by FedJAX 0.0.17 in its venv to record what each cell gives, and by
``tests/test_fedjax_tutorial.py`` with ``fedjax`` replaced by
``fedjax_personal.fedjax`` to compare.

  <FedJAX venv>/bin/python benchmarks/peers/fedjax_tutorial_reference.py \\
      --out=tests/data/fedjax_tutorial_reference.npz

``CELLS`` are the tutorial's cells in order, as a notebook runs them (one
namespace), each changed only where the made files differ from FedJAX's
downloads: ``cache_dir=CACHE`` (the made files, ``tests/made_files.
fedjax_reference_files``), client ids read off the files rather than
FedJAX's Shakespeare roles, MNIST made with NumPy rather than read from
TFDS, unseeded shuffles seeded; then ``emnist_fed_avg.py``'s data code
(its sampler, batches and evaluation batching, with the model left out) and
FedJAX's behaviour at the edges (a str id, an empty client, an ended
``RepeatableIterator``, the SQLite builder). A cell records what it shows in
``R``; a cell that raises records the exception's type.
"""

import argparse
import functools
import itertools
import os
import pathlib
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

CELLS = [
  (
    'load',
    """
train_fd, test_fd = fedjax.datasets.shakespeare.load_data(sequence_length=8, cache_dir=CACHE)
""",
  ),
  (
    'client_ids',
    """
R['num_clients'] = train_fd.num_clients()
R['first_ids'] = [c for c in itertools.islice(train_fd.client_ids(), 3)]
R['first_sizes'] = [train_fd.client_size(c) for c in R['first_ids']]
""",
  ),
  (
    'slice',
    """
train_fd_0 = train_fd.slice(start=b'H', stop=b'L')
R['slice_num_clients'] = train_fd_0.num_clients()
R['slice_ids'] = list(train_fd_0.client_ids())
""",
  ),
  (
    'get_client',
    """
client_id = R['first_ids'][2]
client_dataset = train_fd.get_client(client_id)
examples = client_dataset.all_examples()
R['x0'], R['y0'] = examples['x'][0], examples['y'][0]
R['all_x'], R['all_y'] = examples['x'], examples['y']
""",
  ),
  (
    'load_split',
    """
raw_fd = fedjax.datasets.shakespeare.load_split('train', cache_dir=CACHE)
R['raw_snippets'] = list(raw_fd.get_client(client_id).all_examples()['snippets'])
""",
  ),
  (
    'clients',
    """
clients = train_fd.clients()
shuffled_clients = train_fd.shuffled_clients(buffer_size=100, seed=0)
R['clients'] = [(c, len(d)) for c, d in itertools.islice(clients, 3)]
R['shuffled'] = [(c, len(d)) for c, d in itertools.islice(shuffled_clients, 5)]
""",
  ),
  (
    'get_clients',
    """
ids = [R['first_ids'][2], R['first_ids'][0], R['first_ids'][1]]
R['get_clients'] = [(c, len(d)) for c, d in train_fd.get_clients(ids)]
""",
  ),
  (
    'batch',
    """
batches = list(client_dataset.batch(batch_size=8))
R['num_batches'] = len(batches)
R['last_batch_x'] = batches[-1]['x']
""",
  ),
  (
    'padded_batch',
    """
padded_batches = list(client_dataset.padded_batch(batch_size=8, num_batch_size_buckets=3))
R['num_padded'] = len(padded_batches)
R['padded_first_mask'] = padded_batches[0]['__mask__']
R['padded_last_x'] = padded_batches[-1]['x']
R['padded_last_mask'] = padded_batches[-1]['__mask__']
""",
  ),
  (
    'shuffle_repeat_batch',
    """
R['srb_len'] = len(list(client_dataset.shuffle_repeat_batch(batch_size=8)))
infinite_bs = client_dataset.shuffle_repeat_batch(batch_size=8, num_epochs=None, num_steps=None)
R['infinite'] = len([i for i, b in zip(range(6), infinite_bs)])
R['keep'] = len(list(client_dataset.shuffle_repeat_batch(batch_size=8, num_epochs=1,
                                                         num_steps=None)))
R['drop'] = len(list(client_dataset.shuffle_repeat_batch(batch_size=8, num_epochs=1,
                                                         num_steps=None, drop_remainder=True)))
R['steps_drop'] = len(list(client_dataset.shuffle_repeat_batch(
    batch_size=8, num_epochs=None, num_steps=3, drop_remainder=True)))
R['epochs_steps'] = len(list(client_dataset.shuffle_repeat_batch(batch_size=8, num_epochs=1,
                                                                 num_steps=6)))
R['fixed_first_x'] = list(client_dataset.shuffle_repeat_batch(batch_size=2, seed=0))[0]['x']
""",
  ),
  (
    'preprocess_batch',
    """
def parity_feature(examples):
  return {'z': examples['y'] % 2, **examples}

train_fd_z = train_fd.preprocess_batch(parity_feature)
batch = next(iter(train_fd_z.get_client(client_id).padded_batch(batch_size=4)))
R['parity_z'], R['parity_x'] = batch['z'], batch['x']
""",
  ),
  (
    'preprocess_client',
    """
raw_fd = fedjax.datasets.shakespeare.load_split('train', cache_dir=CACHE)

def truncate_and_cast(client_id, examples, max_length=10):
  labels = list(b''.join(examples['snippets']))
  num_sequences = (len(labels) + max_length - 1) // max_length
  padded = np.zeros((num_sequences, max_length), dtype=np.int32)
  for i in range(num_sequences):
    chars = labels[i * max_length:(i + 1) * max_length]
    padded[i, :len(chars)] = chars
  return {'snippets': padded}

partial_fd = raw_fd.preprocess_client(truncate_and_cast)
R['truncated'] = partial_fd.get_client(client_id).all_examples()['snippets']

def snippets_to_xy(examples):
  snippets = examples['snippets']
  return {'x': snippets[:, :-1], 'y': snippets[:, 1:]}

xy = partial_fd.preprocess_batch(snippets_to_xy).get_client(client_id).all_examples()
R['xy_x'], R['xy_y'] = xy['x'], xy['y']
""",
  ),
  (
    'in_memory',
    """
rng = np.random.RandomState(0)
features, labels = rng.randint(0, 255, (600, 4, 4, 1)).astype(np.uint8), rng.randint(0, 10, 600)
indices = rng.randint(10, size=600)
client_id_to_dataset_mapping = {}
for i in range(10):
  client_id_to_dataset_mapping[i] = {'x': features[indices == i, :, :, :],
                                     'y': labels[indices == i]}
iid_mnist_federated_data = fedjax.InMemoryFederatedData(client_id_to_dataset_mapping)
R['iid_num_clients'] = iid_mnist_federated_data.num_clients()
R['iid_sizes'] = [s for _, s in iid_mnist_federated_data.client_sizes()]
R['iid_ids'] = list(iid_mnist_federated_data.client_ids())
R['iid_shuffled'] = [c for c, _ in itertools.islice(
    iid_mnist_federated_data.shuffled_clients(buffer_size=4, seed=1), 12)]
R['iid_batch_y'] = next(iter(iid_mnist_federated_data.get_client(3).padded_batch(
    fedjax.PaddedBatchHParams(batch_size=16))))['y']
""",
  ),
  # examples/emnist_fed_avg.py's data code: load, batching hyperparameters,
  # the client sampler, evaluation batches.
  (
    'emnist_load',
    """
train_fd, test_fd = fedjax.datasets.emnist.load_data(only_digits=False, cache_dir=CACHE)
client_batch_hparams = fedjax.ShuffleRepeatBatchHParams(batch_size=2, seed=0)
""",
  ),
  (
    'emnist_sampler',
    """
train_client_sampler = fedjax.client_samplers.UniformGetClientSampler(
    fd=train_fd, num_clients=2, seed=0)
for round_num in range(1, 4):
  clients = train_client_sampler.sample()
  R[f'round{round_num}_ids'] = [cid for cid, _, _ in clients]
  R[f'round{round_num}_keys'] = [np.asarray(rng) for _, _, rng in clients]
  R[f'round{round_num}_batch_y'] = [
      next(iter(cds.shuffle_repeat_batch(client_batch_hparams)))['y'] for _, cds, _ in clients]
  if round_num == 3:
    client_ids = [cid for cid, _, _ in clients]
    train_eval_datasets = [cds for _, cds in train_fd.get_clients(client_ids)]
    test_eval_datasets = [cds for _, cds in test_fd.get_clients(client_ids)]
    train_eval_batches = fedjax.padded_batch_client_datasets(train_eval_datasets, batch_size=4)
    test_eval_batches = fedjax.padded_batch_client_datasets(test_eval_datasets, batch_size=4)
    R['train_eval_y'] = [b['y'] for b in train_eval_batches]
    R['train_eval_mask'] = [b['__mask__'] for b in train_eval_batches]
    R['test_eval_y'] = [b['y'] for b in test_eval_batches]
""",
  ),
  (
    'sampler_round',
    """
train_client_sampler.set_round_num(7)
R['round7_ids'] = [cid for cid, _, _ in train_client_sampler.sample()]
R['state_draw'] = fedjax.client_samplers.get_pseudo_random_state(3, 11).randint(0, 10 ** 6, 4)
""",
  ),
  (
    'shuffled_sampler',
    """
sampler = fedjax.client_samplers.UniformShuffledClientSampler(
    train_fd.shuffled_clients(buffer_size=3, seed=2), num_clients=3, start_round_num=1)
R['shuffled_rounds'] = [[cid for cid, _, _ in sampler.sample()] for _ in range(3)]
R['shuffled_keys'] = [np.asarray(k) for _, _, k in sampler.sample()]
""",
  ),
  (
    'hparams',
    """
cds = train_fd.get_client(R['round1_ids'][0])
R['hp_padded'] = [b['__mask__'] for b in cds.padded_batch(
    fedjax.PaddedBatchHParams(batch_size=4, num_batch_size_buckets=2))]
R['hp_batch'] = [b['y'] for b in cds.batch(fedjax.BatchHParams(batch_size=3,
                                                              drop_remainder=True))]
R['hp_override'] = len(list(cds.shuffle_repeat_batch(client_batch_hparams, num_epochs=2)))
""",
  ),
  # Stack Overflow's tokenizer with OOV buckets (TensorFlow's hash of a word).
  (
    'oov_buckets',
    """
tokenizer = fedjax.datasets.stackoverflow.StackoverflowTokenizer(
    vocab=['the', 'is', 'code', 'a'], num_oov_buckets=5)
posts = np.array([b'the zz is', b'unknownword code  x', b'', b'a b c d e f g h i j k l m n o',
                  ('w' * 70 + ' ' + 'v' * 20 + ' ' + 'u' * 40 + ' ' + 't' * 130).encode()],
                 dtype=object)  # words in each of farmhash's length branches
x, y = tokenizer.create_token_to_ids_fn(8)(posts)
R['oov_x'], R['oov_y'] = np.asarray(x), np.asarray(y)
""",
  ),
  # FedJAX at the edges.
  (
    'str_id',
    """
train_fd.get_client(R['round1_ids'][0].decode())
""",
  ),
  (
    'empty_client_no_steps',
    """
empty = fedjax.ClientDataset({'x': np.zeros((0, 2))})
R['empty_no_steps'] = len(list(empty.shuffle_repeat_batch(batch_size=2, num_epochs=None,
                                                          num_steps=0)))
""",
  ),
  (
    'shakespeare_length_1',
    """
fedjax.datasets.shakespeare.preprocess_client(None, {'snippets': np.array([], dtype=object)}, 1)
""",
  ),
  (
    'repeatable_iterator',
    """
it = fedjax.RepeatableIterator(x * x for x in range(4))
R['repeat_passes'] = [list(it), list(it)]
it = fedjax.RepeatableIterator(range(3))
m1 = map(lambda x: x + 1, it)
m2 = map(lambda x: x * 2, it)
R['repeat_interleaved'] = [next(m1), next(m2), next(m1), next(m2)]
""",
  ),
  (
    'builder',
    """
path = os.path.join(CACHE, 'built.sqlite')
with fedjax.SQLiteFederatedDataBuilder(path) as builder:
  builder.add_many([(b'k1', {'x': np.arange(6).reshape(3, 2), 't': np.array([b'a', b'bc', b''],
                                                                          dtype=object)}),
                    (b'k0', {'x': np.ones((1, 2), np.float32),
                             't': np.array([b'z'], dtype=object)})])
built = fedjax.SQLiteFederatedData.new(path)
R['built_ids'] = list(built.client_ids())
R['built_sizes'] = [s for _, s in built.client_sizes()]
R['built_x'] = built.get_client(b'k1').all_examples()['x']
R['built_t'] = list(built.get_client(b'k1').all_examples()['t'])
""",
  ),
]


def _flatten(key, value, out):
  """``R``'s values as arrays: lists of arrays or pairs one key per item."""
  if (
    isinstance(value, (list, tuple))
    and value
    and (
      isinstance(value[0], (np.ndarray, list, tuple))
      or any(np.asarray(v).shape != np.asarray(value[0]).shape for v in value)
    )
  ):
    out[f'{key}/len'] = np.array(len(value))
    for i, v in enumerate(value):
      _flatten(f'{key}/{i}', v, out)
  else:
    out[key] = np.asarray(value)


def run_cells(fedjax, cache: str) -> dict:
  """Runs ``CELLS`` in one namespace with ``fedjax`` as given; returns
  ``{key: array}`` of what they recorded, each raising cell's error type
  under ``<cell>/error``."""
  space = {
    'fedjax': fedjax,
    'np': np,
    'itertools': itertools,
    'functools': functools,
    'os': os,
    'CACHE': cache,
    'R': {},
  }
  out = {}
  for name, code in CELLS:
    before = set(space['R'])
    try:
      exec(code, space)  # noqa: S102  (the tutorial's cells)
    except Exception as e:  # noqa: BLE001  (a cell's error is what it shows)
      out[f'{name}/error'] = np.array(type(e).__name__)
    for k in sorted(set(space['R']) - before):
      _flatten(f'{name}/{k}', space['R'][k], out)
  return out


def main():
  import fedjax  # noqa: PLC0415  (FedJAX's venv only)
  from fedjax.datasets import downloads  # noqa: PLC0415

  # made files, not the releases
  downloads.validate_file = lambda *args, **kwargs: None
  sys.path.insert(0, os.path.join(HERE, '..', '..', 'tests'))
  import made_files  # noqa: PLC0415

  p = argparse.ArgumentParser()
  p.add_argument('--out', required=True)
  a = p.parse_args()
  with tempfile.TemporaryDirectory() as folder:
    made_files.fedjax_reference_files(pathlib.Path(folder))
    out = run_cells(fedjax, folder)
  np.savez_compressed(a.out, **out)
  print(
    f'wrote {len(out)} arrays to {a.out}: errors in',
    sorted(k for k in out if k.endswith('/error')),
  )


if __name__ == '__main__':
  main()
