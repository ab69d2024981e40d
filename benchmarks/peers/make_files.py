"""Writes the peer benchmark's FedJAX-format files (no project imports).

Runs in either venv (numpy, msgpack, sqlite3 only). With FedJAX installed
(``--writer=fedjax``) the files are written by FedJAX 0.0.17's own
``SQLiteFederatedDataBuilder``; otherwise by the same schema and msgpack
encoding (``fedjax/core/sqlite_federated_data.py``, ``serialization.py``).

Populations (the field's shapes, learnable so that accuracies compare):
  emnist: 3,400 writers, training examples per writer log-normal with median
    154 clipped to [24, 1067] (federated EMNIST-62's range), about a ninth as
    many test examples; 28x28 ``pixels`` (1 = background, as TFF/FedJAX
    store them) drawn around a class template (another class's for 20% of
    the examples: accuracy stays below ~82%, as on the real writers) with a
    per-writer stroke offset and noise; 62 labels.
  stackoverflow: users with 2-400 sentences (log-normal, median ~40; a tenth
    as many held-out and test sentences), each a space-separated string of
    5-24 words, half from the user's own 200-word topic and half Zipf-drawn
    from a vocabulary of 10,000 made-up words: FedJAX's ``tokens``, ``title``,
    ``tags`` and ``type`` features (bytes), plus ``stackoverflow.word_count``
    (words by frequency) beside them.
  shakespeare: speaking roles with 1-1,500 lines (log-normal, median ~20;
    a fifth as many test lines), each line 5-24 words of its role's own
    300-word stock and shared words, the words made of the 86 characters of
    FedJAX's Shakespeare vocabulary: FedJAX's ``snippets`` feature (bytes);
    ``shakespeare_train.windows`` beside them holds each role's number of
    80-character windows (FedJAX's ``preprocess_client``), the examples a
    round trains on.
"""

import argparse
import os
import sqlite3
import zlib

import msgpack
import numpy as np


def _pack(x):
  if isinstance(x, np.ndarray) and x.dtype == object:
    return msgpack.ExtType(
      4, msgpack.packb((x.shape, list(x.flatten())), use_bin_type=True)
    )
  if isinstance(x, np.ndarray):
    return msgpack.ExtType(
      1,
      msgpack.packb((x.shape, x.dtype.name, x.tobytes('C')), use_bin_type=True),
    )
  raise TypeError(type(x))


class _Writer:
  """FedJAX's table: federated_data(client_id, data, num_examples)."""

  def __init__(self, path, use_fedjax):
    self.path, self.rows = path, []
    self.fedjax = None
    if use_fedjax:
      from fedjax.core import sqlite_federated_data

      self.fedjax = sqlite_federated_data.SQLiteFederatedDataBuilder(path)

  def add(self, cid, ex):
    if self.fedjax is not None:
      self.rows.append((cid, ex))
      return
    n = len(next(iter(ex.values())))
    self.rows.append(
      (
        cid,
        zlib.compress(msgpack.packb(ex, default=_pack, strict_types=True)),
        n,
      )
    )

  def close(self):
    if self.fedjax is not None:
      # FedJAX's builder closes its connection on exit
      with self.fedjax as builder:
        builder.add_many(self.rows)
      return
    conn = sqlite3.connect(self.path)
    conn.execute(
      'CREATE TABLE federated_data (client_id BLOB NOT NULL PRIMARY KEY, '
      'data BLOB NOT NULL, num_examples INTEGER NOT NULL);'
    )
    conn.executemany('INSERT INTO federated_data VALUES (?, ?, ?);', self.rows)
    conn.commit()
    conn.close()


def emnist_sizes(rng, n):
  s2 = 0.55**2
  train = np.clip(
    np.round(rng.lognormal(np.log(154), np.sqrt(s2), n)), 24, 1067
  ).astype(int)
  test = np.maximum(1, rng.binomial(train, 0.11))
  return train, test


def write_emnist(folder, num_clients, seed, use_fedjax):
  rng = np.random.default_rng(seed)
  train_n, test_n = emnist_sizes(rng, num_clients)
  templates = (rng.random((62, 28, 28)) < 0.25).astype(np.float32)
  writers = [
    _Writer(os.path.join(folder, f'federated_emnist_{s}.sqlite'), use_fedjax)
    for s in ('train', 'test')
  ]
  for i in range(num_clients):
    style = rng.normal(0, 0.2, (28, 28)).astype(np.float32)
    for w, n in zip(writers, (train_n[i], test_n[i])):
      y = rng.integers(0, 62, n)
      # 20% drawn as another
      shown = np.where(rng.random(n) < 0.2, rng.integers(0, 62, n), y)
      ink = templates[shown] * 0.35 + style + rng.normal(0, 0.6, (n, 28, 28))
      pixels = np.round(np.clip(1.0 - ink, 0, 1) * 255).astype(np.float32) / 255
      w.add(
        b'f%04d_%02d' % (i, i % 100),
        {'pixels': pixels.astype(np.float32), 'label': y.astype(np.int32)},
      )
  for w in writers:
    w.close()
  return train_n, test_n


def write_stackoverflow(folder, num_clients, seed, use_fedjax, vocab=10000):
  rng = np.random.default_rng(seed)
  words = np.array([b'w%d' % i for i in range(vocab)], dtype=object)
  zipf = 1.0 / np.arange(1, vocab + 1) ** 1.1
  zipf /= zipf.sum()
  sizes = np.clip(
    np.round(rng.lognormal(np.log(40), 1.0, num_clients)), 2, 400
  ).astype(int)
  counts = np.zeros(vocab, np.int64)
  writers = [
    _Writer(os.path.join(folder, f'stackoverflow_{s}.sqlite'), use_fedjax)
    for s in ('train', 'held_out', 'test')
  ]
  for i in range(num_clients):
    topic = rng.permutation(vocab)[:200]
    for w, n in zip(
      writers, (sizes[i], max(1, sizes[i] // 10), max(1, sizes[i] // 10))
    ):
      lens = rng.integers(5, 25, n)
      toks = []
      for ln in lens:
        ids = np.where(
          rng.random(ln) < 0.5,
          rng.choice(topic, ln),
          rng.choice(vocab, ln, p=zipf),
        )
        np.add.at(counts, ids, 1)
        toks.append(b' '.join(words[ids]))
      arr = np.empty(n, dtype=object)
      arr[:] = toks
      kinds = np.empty(n, dtype=object)
      kinds[:] = [b'answer' if k else b'question' for k in rng.random(n) < 0.6]
      tags = np.empty(n, dtype=object)
      tags[:] = [b't'] * n
      w.add(
        b'%08d' % i,
        {'tokens': arr, 'title': arr.copy(), 'tags': tags, 'type': kinds},
      )
  for w in writers:
    w.close()
  order = np.argsort(-counts, kind='stable')
  with open(os.path.join(folder, 'stackoverflow.word_count'), 'w') as f:
    for j in order:
      f.write(f'{words[j].decode()} {max(int(counts[j]), 1)}\n')
  return sizes


def write_shakespeare(folder, num_clients, seed, use_fedjax):
  rng = np.random.default_rng(seed)
  letters = np.frombuffer(
    b'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ', np.uint8
  )
  marks = np.frombuffer(b',.;:!?', np.uint8)
  words = [bytes(rng.choice(letters, rng.integers(1, 9))) for _ in range(3000)]
  sizes = np.clip(
    np.round(rng.lognormal(np.log(20), 1.2, num_clients)), 1, 1500
  ).astype(int)
  writers = [
    _Writer(os.path.join(folder, f'shakespeare_{s}.sqlite'), use_fedjax)
    for s in ('train', 'test')
  ]
  windows = []
  for i in range(num_clients):
    stock = rng.choice(len(words), 300)
    for w, n in zip(writers, (sizes[i], max(1, sizes[i] // 5))):
      lines = []
      for ln in rng.integers(5, 25, n):
        ids = np.where(
          rng.random(ln) < 0.7,
          rng.choice(stock, ln),
          rng.choice(len(words), ln),
        )
        text = b' '.join(words[j] for j in ids)
        lines.append(text + bytes([rng.choice(marks)]))
      arr = np.empty(n, dtype=object)
      arr[:] = lines
      w.add(b'%05d_ROLE' % i, {'snippets': arr})
      # FedJAX's windows: the snippets joined with BOS/EOS, cut by 80
      if w is writers[0]:
        windows.append(-(-(sum(len(t) + 2 for t in lines) - 1) // 80))
  for w in writers:
    w.close()
  np.savetxt(
    os.path.join(folder, 'shakespeare_train.windows'), windows, fmt='%d'
  )
  return sizes


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument(
    '--shape', choices=['emnist', 'shakespeare', 'stackoverflow'], required=True
  )
  p.add_argument('--num_clients', type=int, required=True)
  p.add_argument('--folder', required=True)
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--writer', choices=['fedjax', 'plain'], default='plain')
  a = p.parse_args()
  os.makedirs(a.folder, exist_ok=True)
  if a.shape == 'emnist':
    tr, te = write_emnist(a.folder, a.num_clients, a.seed, a.writer == 'fedjax')
    print(
      f'emnist: {a.num_clients} writers, train {tr.min()}-{tr.max()} (median '
      f'{int(np.median(tr))}, total {tr.sum():,}), test total {te.sum():,}'
    )
  elif a.shape == 'shakespeare':
    s = write_shakespeare(a.folder, a.num_clients, a.seed, a.writer == 'fedjax')
    print(
      f'shakespeare: {a.num_clients} roles, {s.min()}-{s.max()} lines '
      f'(median {int(np.median(s))}, total {s.sum():,})'
    )
  else:
    s = write_stackoverflow(
      a.folder, a.num_clients, a.seed, a.writer == 'fedjax'
    )
    print(
      f'stackoverflow: {a.num_clients} users, {s.min()}-{s.max()} sentences '
      f'(median {int(np.median(s))}, total {s.sum():,})'
    )


if __name__ == '__main__':
  main()
