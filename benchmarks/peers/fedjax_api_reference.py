"""FedJAX 0.0.17's data objects on made files: the reference
``tests/test_fedjax_api.py`` compares this project's with (runs in FedJAX's
venv, with TensorFlow for FedJAX's Stack Overflow tokenizer; writes one
``.npz``).

  <FedJAX venv>/bin/python benchmarks/peers/fedjax_api_reference.py \
      --out=tests/data/fedjax_api_reference.npz

The files are ``tests/made_files.fedjax_reference_files``: EMNIST,
Shakespeare and Stack Overflow in FedJAX's SQLite format, each test file
in another order than its train file, with a client only there, and
CIFAR-100 in TFF's (which FedJAX converts to its own files, as there; the
made file's checksum is not the release's, so FedJAX's check of it is
skipped). Recorded
of each split FedJAX's ``load_data`` returns (``record_split``): ids,
``client_sizes``, every client's ``all_examples`` and ``padded_batch``,
``padded_batch_federated_data``, ``shuffled_clients``,
``shuffle_repeat_batch_federated_data``, ``subset`` and ``slice``; of
EMNIST's first train clients ``batch`` / ``padded_batch`` /
``shuffle_repeat_batch`` under several settings (``BATCHINGS``); Stack
Overflow tokenized by FedJAX's ``StackoverflowTokenizer`` at 4 and 30
tokens. And FedJAX's ``padded_batch_client_datasets`` /
``buffered_shuffle_batch_client_datasets`` run on this project's
``ClientDataset`` objects (``datasets/client_datasets.py``, loaded by path:
numpy alone), which must accept them (``record_helpers``).
"""

import argparse
import importlib.util
import os
import pathlib
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, '..', '..')

# (name, method, keyword arguments): each client's batches under it.
BATCHINGS = [
  ('batch4', 'batch', dict(batch_size=4)),
  ('batch4_drop', 'batch', dict(batch_size=4, drop_remainder=True)),
  ('padded4', 'padded_batch', dict(batch_size=4)),
  ('padded8_b3', 'padded_batch', dict(batch_size=8, num_batch_size_buckets=3)),
  (
    'srb3_e2_s7',
    'shuffle_repeat_batch',
    dict(batch_size=3, num_epochs=2, seed=7),
  ),
  (
    'srb4_drop_s1',
    'shuffle_repeat_batch',
    dict(batch_size=4, drop_remainder=True, seed=1),
  ),
  (
    'srb2_steps5_s0',
    'shuffle_repeat_batch',
    dict(batch_size=2, num_epochs=None, num_steps=5, seed=0),
  ),
  (
    'srb3_noshuffle',
    'shuffle_repeat_batch',
    dict(batch_size=3, num_epochs=1, skip_shuffle=True),
  ),
]
#: Stack Overflow's tokenized lengths recorded (train's 20 is FedJAX's recipe; 4
#: truncates).
SO_LENGTHS = (4, 30)
#: The vocabulary's words of the made word_count file the tokenizer takes.
SO_VOCAB = 10


def made_files_module():
  """``tests/made_files.py`` (numpy and msgpack only)."""
  sys.path.insert(0, os.path.join(ROOT, 'tests'))
  import made_files  # noqa: PLC0415

  return made_files


def client_datasets_module():
  """This project's ``datasets/client_datasets.py``, loaded by path."""
  spec = importlib.util.spec_from_file_location(
    'project_client_datasets',
    os.path.join(ROOT, 'datasets', 'client_datasets.py'),
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _arrays(prefix: str, examples, out: dict) -> None:
  """Every feature of ``examples`` (images, and float rows, as each row's
  sum in float64, so the file stays small; a row out of place or a pixel
  changed shows)."""
  for k, v in examples.items():
    v = np.asarray(v)
    if v.dtype == object:
      continue  # raw text: its tokenized form is recorded
    image = v.ndim > 2 or (v.dtype.kind == 'f' and v.ndim > 1)
    out[f'{prefix}/{k}'] = (
      v.reshape(len(v), -1).astype(np.float64).sum(1) if image else v
    )


def record_split(name: str, fd, lib) -> dict:
  """The arrays recorded of one split, FedJAX's or this project's.

  Args:
    name: the split's key prefix.
    fd: the split (FedJAX's FederatedData API).
    lib: the module with ``padded_batch_federated_data`` and
      ``shuffle_repeat_batch_federated_data`` (``fedjax`` or this project's
      ``datasets.store_federated_data``), also with ``SubsetFederatedData``.

  Returns:
    ``{key: array}``.
  """
  out = {}
  ids = list(fd.client_ids())
  out[f'{name}/ids'] = np.array(ids)
  sizes = list(fd.client_sizes())
  out[f'{name}/size_ids'] = np.array([c for c, _ in sizes])
  out[f'{name}/sizes'] = np.array([s for _, s in sizes], np.int64)
  out[f'{name}/num_clients'] = np.array(fd.num_clients())
  out[f'{name}/size_of_last'] = np.array(fd.client_size(ids[-1]))
  for i, (cid, client) in enumerate(fd.clients()):
    out[f'{name}/client{i}/id'] = np.array(cid)
    _arrays(f'{name}/client{i}/all', client.all_examples(), out)
    for j, batch in enumerate(
      client.padded_batch(batch_size=3, num_batch_size_buckets=2)
    ):
      _arrays(f'{name}/client{i}/padded3/{j}', batch, out)
  for j, batch in enumerate(
    lib.padded_batch_federated_data(fd, batch_size=4, num_batch_size_buckets=2)
  ):
    _arrays(f'{name}/federated_padded4/{j}', batch, out)
  shuffled = fd.shuffled_clients(buffer_size=2, seed=3)
  out[f'{name}/shuffled_ids'] = np.array(
    [next(shuffled)[0] for _ in range(2 * len(ids) + 1)]
  )
  stream = lib.shuffle_repeat_batch_federated_data(
    fd, batch_size=3, client_buffer_size=2, example_buffer_size=5, seed=1
  )
  for j in range(4):
    _arrays(f'{name}/federated_srb/{j}', next(stream), out)
  sub = lib.SubsetFederatedData(fd, [ids[-1], ids[0], ids[-1]])
  out[f'{name}/subset_ids'] = np.array(list(sub.client_ids()))
  out[f'{name}/subset_size_ids'] = np.array([c for c, _ in sub.client_sizes()])
  out[f'{name}/subset_clients'] = np.array([c for c, _ in sub.clients()])
  shuffled = sub.shuffled_clients(buffer_size=2, seed=5)
  out[f'{name}/subset_shuffled'] = np.array(
    [next(shuffled)[0] for _ in range(5)]
  )
  out[f'{name}/slice_ids'] = np.array(list(fd.slice(ids[1], None).client_ids()))
  out[f'{name}/slice_stop_ids'] = np.array(
    list(fd.slice(None, ids[1]).client_ids())
  )
  return out


def record_batchings(train) -> dict:
  """``BATCHINGS`` of the first three train clients."""
  out = {}
  for i, cid in enumerate(list(train.client_ids())[:3]):
    client = train.get_client(cid)
    for name, method, kwargs in BATCHINGS:
      for j, batch in enumerate(getattr(client, method)(**kwargs)):
        _arrays(f'emnist/batchings/client{i}/{name}/{j}', batch, out)
  return out


def record_all(
  emnist, shakespeare, stackoverflow, tokenizer, cifar100, cifar100_module, lib
) -> dict:
  """The arrays of the four data sets' ``load_data`` splits.

  Args:
    emnist: ``(train, test)``.
    shakespeare: ``(train, test)`` at sequence length 5.
    stackoverflow: ``(train, held_out, test)``, raw.
    tokenizer: a ``StackoverflowTokenizer`` of the made vocabulary.
    cifar100: ``(train, test)``.
    cifar100_module: the module with CIFAR-100's ``preprocess_batch`` and
      ``preprocess_batch_tff`` (FedJAX's or this project's).
    lib: see ``record_split``.

  Returns:
    ``{key: array}``.
  """
  out = {}
  for split, fd in zip(('train', 'test'), emnist):
    out.update(record_split(f'emnist/{split}', fd, lib))
  out.update(record_batchings(emnist[0]))
  for split, fd in zip(('train', 'test'), shakespeare):
    out.update(record_split(f'shakespeare/{split}', fd, lib))
  for split, fd in zip(('train', 'test'), cifar100):
    out.update(record_split(f'cifar100/{split}', fd, lib))
  batch = next(iter(cifar100[0].clients()))[1].all_examples()
  # FedJAX's image preprocessing draws from NumPy's global state
  np.random.seed(3)
  for name, fn in (
    ('train', lambda b: cifar100_module.preprocess_batch(b, is_train=True)),
    ('eval', lambda b: cifar100_module.preprocess_batch(b, is_train=False)),
    (
      'tff_distort',
      lambda b: cifar100_module.preprocess_batch_tff(b, distort=True),
    ),
    ('tff', cifar100_module.preprocess_batch_tff),
  ):
    for k in range(2):
      _arrays(f'cifar100/preprocessed/{name}/{k}', fn(batch), out)
  for length in SO_LENGTHS:
    for split, fd in zip(('train', 'held_out', 'test'), stackoverflow):
      out.update(
        record_split(
          f'stackoverflow{length}/{split}',
          fd.preprocess_batch(tokenizer.as_preprocess_batch(length)),
          lib,
        )
      )
  return out


def record_helpers(
  cd, padded_batch_client_datasets, buffered_shuffle_batch_client_datasets
) -> dict:
  """FedJAX's helpers (or this project's) over this project's
  ``ClientDataset`` objects sharing one ``BatchPreprocessor``.

  Args:
    cd: this project's ``client_datasets`` module.
    padded_batch_client_datasets: the helper to run.
    buffered_shuffle_batch_client_datasets: the other.

  Returns:
    ``{key: array}``.
  """
  rng = np.random.default_rng(4)
  pre = cd.BatchPreprocessor([lambda e: {**e, 'y2': e['y'] * 2}]).append(
    lambda e: {**e, 'x': e['x'] + 1}
  )
  clients = [
    cd.ClientDataset(
      {'x': rng.integers(0, 9, (n, 2)), 'y': rng.integers(0, 5, n)}, pre
    )
    for n in (3, 6, 1, 4)
  ]
  out = {}
  for j, b in enumerate(
    padded_batch_client_datasets(
      clients, batch_size=4, num_batch_size_buckets=3
    )
  ):
    _arrays(f'helpers/padded4/{j}', b, out)
  for j, b in enumerate(
    buffered_shuffle_batch_client_datasets(
      clients, batch_size=3, buffer_size=4, rng=np.random.RandomState(2)
    )
  ):
    _arrays(f'helpers/shuffled3/{j}', b, out)
  return out


def main():
  import fedjax  # noqa: PLC0415  (FedJAX's venv only)
  from fedjax.core import client_datasets  # noqa: PLC0415
  from fedjax.datasets import (  # noqa
    cifar100,
    downloads,
    emnist,
    shakespeare,
    stackoverflow,
  )

  # The made CIFAR-100 file is not TFF's release: FedJAX's checksum of it
  # (and of the FedJAX files it writes from it) is skipped, nothing else.
  downloads.validate_file = lambda *args, **kwargs: None
  p = argparse.ArgumentParser()
  p.add_argument('--out', required=True)
  a = p.parse_args()
  with tempfile.TemporaryDirectory() as folder:
    words = made_files_module().fedjax_reference_files(pathlib.Path(folder))
    out = record_all(
      emnist.load_data(only_digits=False, cache_dir=folder),
      shakespeare.load_data(sequence_length=5, cache_dir=folder),
      stackoverflow.load_data(cache_dir=folder),
      stackoverflow.StackoverflowTokenizer(vocab=words[:SO_VOCAB]),
      cifar100.load_data(cache_dir=folder),
      cifar100,
      fedjax,
    )
  out.update(
    record_helpers(
      client_datasets_module(),
      fedjax.padded_batch_client_datasets,
      client_datasets.buffered_shuffle_batch_client_datasets,
    )
  )
  np.savez_compressed(a.out, **out)
  print(f'wrote {len(out)} arrays to {a.out}')


if __name__ == '__main__':
  main()
