"""Small data files written in the formats the field publishes, for tests.

Each writer follows the publisher's own code, not this package's readers:
FedJAX's ``SQLiteFederatedDataBuilder`` and msgpack encoding
(``fedjax/core/sqlite_federated_data.py``, ``serialization.py``), TFF's
``examples`` / ``client_metadata`` tables with serialized tf.train.Example
protos, the CIFAR page's pickled batches in a tar.gz, Karpathy's Tiny
Shakespeare text, LEAF's JSON and GLDv2's federated split (TFF's
``federated_train.csv`` over JPEG files named by image id).
"""

import io
import json
import pickle
import sqlite3
import tarfile
import zlib

import msgpack
import numpy as np

# -- FedJAX SQLite
# --------------------------------------------------------------


def _fedjax_pack(x):
  """FedJAX's msgpack ext types: 1 numeric ndarray, 4 ndarray of bytes."""
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


def write_fedjax_sqlite(path, clients):
  """``clients``: [(client_id bytes, {feature: ndarray})] in row order."""
  conn = sqlite3.connect(path)
  conn.execute(
    'CREATE TABLE federated_data (client_id BLOB NOT NULL PRIMARY KEY, '
    'data BLOB NOT NULL, num_examples INTEGER NOT NULL);'
  )
  rows = []
  for cid, ex in clients:
    n = len(next(iter(ex.values())))
    blob = zlib.compress(
      msgpack.packb(ex, default=_fedjax_pack, strict_types=True)
    )
    rows.append((cid, blob, n))
  conn.executemany('INSERT INTO federated_data VALUES (?, ?, ?);', rows)
  conn.commit()
  conn.close()


def emnist_clients(rng, sizes, num_classes=62, prefix=b'f'):
  """FedJAX EMNIST records: pixels [n, 28, 28] float32 (1 = background)."""
  out = []
  for i, n in enumerate(sizes):
    pixels = rng.uniform(0, 1, (n, 28, 28)).astype(np.float32)
    label = rng.integers(0, num_classes, n).astype(np.int32)
    out.append(
      (prefix + b'%04d_%02d' % (i, i % 7), {'pixels': pixels, 'label': label})
    )
  return out


def write_emnist(folder, rng, train_sizes, test_sizes, digits=False):
  name = 'federated_emnist_digitsonly' if digits else 'federated_emnist'
  classes = 10 if digits else 62
  train = emnist_clients(rng, train_sizes, classes)
  test = emnist_clients(rng, test_sizes, classes)
  write_fedjax_sqlite(folder / f'{name}_train.sqlite', train)
  write_fedjax_sqlite(folder / f'{name}_test.sqlite', test)
  return train, test


def fedjax_reference_files(folder):
  """FedJAX's EMNIST, Shakespeare and Stack Overflow files and TFF's CIFAR-100
  file, small, in ``folder``: what ``benchmarks/peers/fedjax_api_reference.py``
  reads with FedJAX 0.0.17 and ``tests/test_fedjax_api.py`` with this project.
  Each test file lists its clients in another order than the train file, with a
  client found only there (and a train client it lacks), as FedJAX's reader must
  show them. Returns the Stack Overflow vocabulary's words."""
  rng = np.random.default_rng(0)
  writers = emnist_clients(rng, [5, 9, 3, 7, 2])
  tests = emnist_clients(rng, [2, 1, 3, 2, 2])
  write_fedjax_sqlite(folder / 'federated_emnist_train.sqlite', writers[:4])
  # f0004_04 only here, f0003_03 absent
  write_fedjax_sqlite(
    folder / 'federated_emnist_test.sqlite', [tests[i] for i in (2, 0, 4, 1)]
  )

  # '~' and bytes of 'e-acute' are OOV
  chars = list(b'abcdefghij ,.\nXYZ~') + [
    0xC3,
    0xA9,
  ]
  roles = [
    b'THE_TEMPEST_ARIEL',
    b'HAMLET_OPHELIA',
    b'KING_LEAR_FOOL',
    b'MACBETH_WITCH',
  ]

  def snippets(k):
    return bytes_array(
      [
        rng.choice(chars, int(rng.integers(0, 30))).astype(np.uint8).tobytes()
        for _ in range(k)
      ]
    )

  write_fedjax_sqlite(
    folder / 'shakespeare_train.sqlite',
    [(r, {'snippets': snippets(k)}) for r, k in zip(roles[:3], (4, 1, 6))],
  )
  write_fedjax_sqlite(
    folder / 'shakespeare_test.sqlite',
    [
      (roles[i], {'snippets': snippets(k)}) for i, k in ((2, 2), (3, 3), (0, 1))
    ],
  )

  words = [
    'the',
    'is',
    'code',
    'a',
    'to',
    'in',
    'java',
    'error',
    'i',
    'if',
    'class',
    'x',
  ]
  (folder / 'stackoverflow.word_count').write_text(
    ''.join(f'{w} {1000 - 7 * i}\n' for i, w in enumerate(words))
  )
  # '' : two spaces in a row (an empty word)
  pool = words + [
    'unknownword',
    'zz',
    '',
  ]

  def posts(k):
    kinds = rng.choice([b'question', b'answer'], k)
    return {
      'creation_date': bytes_array(
        [b'2010-0%d-01 10:00:00.1 UTC' % (1 + i % 9) for i in range(k)]
      ),
      'title': bytes_array([b'title %d' % i for i in range(k)]),
      'score': rng.integers(-3, 20, k).astype(np.int64),
      'tags': bytes_array([b'java|c' for _ in range(k)]),
      'tokens': bytes_array(
        [
          ' '.join(rng.choice(pool, int(rng.integers(1, 40)))).encode()
          for _ in range(k)
        ]
      ),
      'type': bytes_array([bytes(t) for t in kinds]),
    }

  users = [b'00000017', b'00000042', b'00000101', b'00000555']
  write_fedjax_sqlite(
    folder / 'stackoverflow_train.sqlite',
    [(u, posts(k)) for u, k in zip(users[:3], (3, 7, 2))],
  )
  write_fedjax_sqlite(
    folder / 'stackoverflow_test.sqlite',
    [(users[i], posts(k)) for i, k in ((1, 2), (3, 4), (0, 1))],
  )
  write_fedjax_sqlite(
    folder / 'stackoverflow_held_out.sqlite',
    [(u, posts(k)) for u, k in ((b'00900001', 3), (b'00900002', 5))],
  )

  # TFF's file, lzma'd
  write_tff_cifar100(folder / 'cifar100.sqlite', rng, [3, 2, 4], [2, 3])
  lzma_file(folder / 'cifar100.sqlite', folder / 'cifar100.sqlite.lzma')
  (folder / 'cifar100.sqlite').unlink()
  return words


def random_writers(folder, seed, num_clients, most_train, most_test):
  """FedJAX EMNIST files in ``folder`` (made) of ``num_clients`` writers with
  3..most_train training and 1..most_test test images drawn from ``seed``."""
  folder.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(seed)
  write_emnist(
    folder,
    rng,
    [int(v) for v in rng.integers(3, most_train, num_clients)],
    [int(v) for v in rng.integers(1, most_test, num_clients)],
  )
  return folder


def bytes_array(items):
  a = np.empty(len(items), dtype=object)
  a[:] = items
  return a


# -- TFF SQLite
# ------------------------------------------------------------------


def _varint(n: int) -> bytes:
  """Protobuf's varint of ``n`` (an int64 as its 64-bit two's complement)."""
  n &= (1 << 64) - 1
  out = bytearray()
  while True:
    b, n = n & 0x7F, n >> 7
    out.append(b | 0x80 if n else b)
    if not n:
      return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
  """A length-delimited field (wire type 2)."""
  return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def tf_example(features, packed=True):
  """A serialized tf.train.Example written by hand in protobuf's wire format
  (example.proto / feature.proto, as TensorFlow writes it): a list of bytes
  is a BytesList, a float array a FloatList, anything else an Int64List
  (packed, or one varint per value with ``packed=False``)."""
  entries = b''
  for name, v in features.items():
    if isinstance(v, list) and v and isinstance(v[0], bytes):
      kind, payload = 1, b''.join(_field(1, b) for b in v)
    elif np.asarray(v).dtype.kind == 'f':
      kind, payload = 2, _field(1, np.asarray(v, '<f4').reshape(-1).tobytes())
    else:
      values = [int(x) for x in np.asarray(v).reshape(-1)]
      kind, payload = (
        3,
        (
          _field(1, b''.join(_varint(x) for x in values))
          if packed
          else b''.join(_varint(1 << 3) + _varint(x) for x in values)
        ),
      )
    entries += _field(
      1, _field(1, name.encode()) + _field(2, _field(kind, payload))
    )
  return _field(1, entries)


def write_tff_cifar100(path, rng, train_sizes, test_sizes):
  """TFF's cifar100.sqlite layout; returns {split: [(client_id, images,
  labels)]}."""
  conn = sqlite3.connect(path)
  conn.execute(
    'CREATE TABLE examples (split_name TEXT NOT NULL, client_id TEXT NOT NULL, '
    'serialized_example_proto BLOB NOT NULL);'
  )
  conn.execute(
    'CREATE TABLE client_metadata (client_id TEXT NOT NULL, split_name TEXT '
    'NOT NULL, '
    'num_examples INTEGER NOT NULL);'
  )
  out = {}
  for split, sizes in (('train', train_sizes), ('test', test_sizes)):
    out[split] = []
    for i, n in enumerate(sizes):
      cid = str(i if split == 'train' else 1000 + i)
      images = rng.integers(0, 256, (n, 32, 32, 3)).astype(np.uint8)
      labels = rng.integers(0, 100, n)
      for img, lab in zip(images, labels):
        conn.execute(
          'INSERT INTO examples VALUES (?, ?, ?)',
          (
            split,
            cid,
            tf_example(
              {'image': img, 'label': [lab], 'coarse_label': [lab // 5]}
            ),
          ),
        )
      conn.execute(
        'INSERT INTO client_metadata VALUES (?, ?, ?)', (cid, split, n)
      )
      out[split].append((cid, images, labels))
  conn.commit()
  conn.close()
  return out


def lzma_file(src, dest):
  import lzma

  with open(src, 'rb') as f, lzma.open(dest, 'wb') as out:
    out.write(f.read())


# -- CIFAR python archives
# -------------------------------------------------------


def write_cifar_archive(path, rng, train_n, test_n, hundred=False):
  """cifar-10-python.tar.gz (5 data batches + test batch) or
  cifar-100-python.tar.gz (train + test, fine and coarse labels)."""
  classes = 100 if hundred else 10
  truth = {}

  def batch(n):
    data = rng.integers(0, 256, (n, 3072)).astype(np.uint8)
    labels = rng.integers(0, classes, n).tolist()
    d = {b'data': data}
    if hundred:
      d[b'fine_labels'], d[b'coarse_labels'] = labels, [l // 5 for l in labels]
    else:
      d[b'labels'] = labels
    return (
      d,
      data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1),
      np.asarray(labels),
    )

  with tarfile.open(path, 'w:gz') as tar:

    def add(name, d):
      raw = pickle.dumps(d)
      info = tarfile.TarInfo(name)
      info.size = len(raw)
      tar.addfile(info, io.BytesIO(raw))

    if hundred:
      members = {
        'train': ['cifar-100-python/train'],
        'test': ['cifar-100-python/test'],
      }
      sizes = {'train': [train_n], 'test': [test_n]}
    else:
      members = {
        'train': [f'cifar-10-batches-py/data_batch_{i}' for i in range(1, 6)],
        'test': ['cifar-10-batches-py/test_batch'],
      }
      sizes = {
        'train': [train_n // 5] * 4 + [train_n - 4 * (train_n // 5)],
        'test': [test_n],
      }
    for part in ('train', 'test'):
      xs, ys = [], []
      for name, n in zip(members[part], sizes[part]):
        d, x, y = batch(n)
        add(name, d)
        xs.append(x)
        ys.append(y)
      truth[part] = (np.concatenate(xs), np.concatenate(ys))
  return truth


def write_cifar10_jpeg_npz(path, labels, test_labels=None, rng=None):
  """The JPEG re-encoding of CIFAR-10 as an .npz (image i of a split is
  ``jpeg[offsets[i]:offsets[i + 1]]``); flat grey images unless ``rng``."""
  from PIL import Image

  out = {}
  for part, labs in (
    ('train', labels),
    ('test', labels if test_labels is None else test_labels),
  ):
    blobs = []
    for i in range(len(labs)):
      img = (
        np.full((32, 32, 3), 20 * i % 256, np.uint8)
        if rng is None  # a class's colour + noise
        else np.clip(
          25 * labs[i] + rng.normal(0, 8, (32, 32, 3)), 0, 255
        ).astype(np.uint8)
      )
      buf = io.BytesIO()
      Image.fromarray(img).save(buf, format='JPEG')
      blobs.append(np.frombuffer(buf.getvalue(), np.uint8))
    out[f'{part}_jpeg'] = np.concatenate(blobs)
    out[f'{part}_offsets'] = np.cumsum([0] + [len(b) for b in blobs])
    out[f'{part}_labels'] = np.asarray(labs, np.int64)
  np.savez(path, **out)


# -- LEAF JSON
# ---------------------------------------------------------------------


def write_leaf(folder, name, users_train, users_test):
  """LEAF's layout: <folder>/leaf/<name>/{train,test}/*.json; ``users_*``:
  {user: {'x': [...], 'y': [...]}} (split over two files)."""
  for split, users in (('train', users_train), ('test', users_test)):
    d = folder / 'leaf' / name / split
    d.mkdir(parents=True, exist_ok=True)
    names = sorted(users)
    for k, part in enumerate((names[::2], names[1::2])):
      doc = {
        'users': part,
        'num_samples': [len(users[u]['y']) for u in part],
        'user_data': {u: users[u] for u in part},
      }
      (d / f'all_data_{k}_niid_0_keep_0_{split}_9.json').write_text(
        json.dumps(doc)
      )


def gldv2_rows(sizes, rng, num_classes=5):
  """TFF's federated_train.csv rows: user ``i`` (numbered from 0) with
  ``sizes[i]`` images of random classes; image ids are hex like GLDv2's."""
  rows = []
  for user, n in enumerate(sizes):
    for k in range(n):
      rows.append(
        (
          str(user),
          f'{user:04x}{k:04x}{int(rng.integers(1 << 30)):08x}',
          int(rng.integers(num_classes)),
        )
      )
  return rows


def write_jpeg(path, rng, shape=(12, 16)):
  from PIL import Image

  Image.fromarray(rng.integers(0, 256, shape + (3,), dtype=np.uint8)).save(
    path, 'JPEG'
  )


def write_gldv2(folder, rng, sizes, num_classes=5, shape=(12, 16)):
  """GLDv2 as its loaders expect it by hand: <folder>/gldv2/federated_train.csv
  (user_id,image_id,class as TFF's split bundle has it) and
  <folder>/gldv2/images/<image_id>.jpg; returns the rows."""
  rows = gldv2_rows(sizes, rng, num_classes)
  d = folder / 'gldv2'
  (d / 'images').mkdir(parents=True, exist_ok=True)
  (d / 'federated_train.csv').write_text(
    'user_id,image_id,class\n' + ''.join(f'{u},{i},{c}\n' for u, i, c in rows)
  )
  for _, image_id, _ in rows:
    write_jpeg(d / 'images' / f'{image_id}.jpg', rng, shape)
  return rows
