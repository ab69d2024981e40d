"""The project's tf.train.Example reader (``datasets/tf_example.py``) reads
what protobuf's own parser reads, on random Examples and on hand-made
edges: lists and messages given twice (merged), a key given twice (the last
wins), overlong varints, wire-type mismatches, unknown groups, field number
0. The Example schema is built from its .proto's fields at run time, so no
TensorFlow is needed; skipped where protobuf is not installed."""

import numpy as np
import pytest

from fedjax_personal.datasets import tf_example

protobuf = pytest.importorskip('google.protobuf')


def _example_class():
  """tf.train.Example from example.proto and feature.proto's fields."""
  from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

  fd = descriptor_pb2.FileDescriptorProto(
    name='made_example.proto', package='made', syntax='proto3'
  )
  F = descriptor_pb2.FieldDescriptorProto

  def message(name, *fields, options=None):
    m = fd.message_type.add(name=name)
    for number, fname, ftype, label, type_name, oneof in fields:
      f = m.field.add(name=fname, number=number, type=ftype, label=label)
      if type_name:
        f.type_name = type_name
      if oneof is not None:
        f.oneof_index = oneof
    return m

  rep, opt = F.LABEL_REPEATED, F.LABEL_OPTIONAL
  message('BytesList', (1, 'value', F.TYPE_BYTES, rep, None, None))
  fl = message('FloatList', (1, 'value', F.TYPE_FLOAT, rep, None, None))
  fl.field[0].options.packed = True
  il = message('Int64List', (1, 'value', F.TYPE_INT64, rep, None, None))
  il.field[0].options.packed = True
  feature = message(
    'Feature',
    (1, 'bytes_list', F.TYPE_MESSAGE, opt, '.made.BytesList', 0),
    (2, 'float_list', F.TYPE_MESSAGE, opt, '.made.FloatList', 0),
    (3, 'int64_list', F.TYPE_MESSAGE, opt, '.made.Int64List', 0),
  )
  feature.oneof_decl.add(name='kind')
  features = message(
    'Features',
    (1, 'feature', F.TYPE_MESSAGE, rep, '.made.Features.FeatureEntry', None),
  )
  entry = features.nested_type.add(name='FeatureEntry')
  entry.field.add(name='key', number=1, type=F.TYPE_STRING, label=opt)
  entry.field.add(
    name='value',
    number=2,
    type=F.TYPE_MESSAGE,
    label=opt,
    type_name='.made.Feature',
  )
  entry.options.map_entry = True
  message(
    'Example', (1, 'features', F.TYPE_MESSAGE, opt, '.made.Features', None)
  )
  pool = descriptor_pool.DescriptorPool()
  pool.Add(fd)
  return message_factory.GetMessageClass(
    pool.FindMessageTypeByName('made.Example')
  )


Example = _example_class()


def _theirs(data: bytes):
  """{key: values} as protobuf reads ``data``, or None where it refuses."""
  from google.protobuf.message import DecodeError

  e = Example()
  try:
    e.ParseFromString(data)
  except (DecodeError, ValueError, RuntimeError):
    return None
  out = {}
  for key, feature in e.features.feature.items():
    kind = feature.WhichOneof('kind')
    if kind == 'bytes_list':
      out[key] = list(feature.bytes_list.value)
    elif kind == 'float_list':
      out[key] = np.asarray(feature.float_list.value, np.float32)
    elif kind == 'int64_list':
      out[key] = np.asarray(feature.int64_list.value, np.int64)
    else:
      out[key] = np.zeros(0, np.int64)
  return out


def _ours(data: bytes):
  try:
    return tf_example.parse(data)
  except ValueError:
    return None


def _same(a, b):
  if a is None or b is None:
    return a is b
  if set(a) != set(b):
    return False
  for k in a:
    x, y = a[k], b[k]
    if isinstance(x, list) or isinstance(y, list):
      if list(x) != list(y):
        return False
    elif x.size or y.size:
      if x.dtype != y.dtype or not np.array_equal(x, y, equal_nan=True):
        return False
  return True


def _random_example(rng) -> bytes:
  e = Example()
  for i in range(int(rng.integers(0, 5))):
    f = e.features.feature[f'k{i}' if rng.random() < 0.8 else '']
    kind = rng.integers(0, 4)
    if kind == 0:
      f.bytes_list.value.extend(
        [
          bytes(rng.integers(0, 256, rng.integers(0, 5)).astype(np.uint8))
          for _ in range(rng.integers(0, 4))
        ]
      )
    elif kind == 1:
      f.float_list.value.extend(
        rng.normal(size=rng.integers(0, 6)).astype(np.float32).tolist()
      )
    elif kind == 2:
      f.int64_list.value.extend(
        int(v)
        for v in rng.integers(
          -(2**63), 2**63 - 1, rng.integers(0, 6), dtype=np.int64
        )
      )
  return e.SerializeToString()


def _mutate(rng, data: bytes) -> bytes:
  """Protobuf-meaningful changes: concatenations (merges), cut ends, flipped
  bytes, inserted unknown fields and groups."""
  kind = rng.integers(0, 5)
  if kind == 0:
    return data + _random_example(rng)  # two messages: merged
  if kind == 1 and data:
    return data[: int(rng.integers(0, len(data)))]
  if kind == 2 and data:
    b = bytearray(data)
    b[int(rng.integers(0, len(b)))] = int(rng.integers(0, 256))
    return bytes(b)
  if kind == 3:  # an unknown varint field, or a group of them
    field = int(rng.integers(2, 30))
    junk = bytes([field << 3 | 0, 0x96, 0x01])
    if rng.random() < 0.5:
      junk = (
        bytes([field << 3 | 3])
        + bytes([(field + 1) << 3 | 0, 5])
        + bytes([field << 3 | 4])
      )
    return junk + data
  return data


def test_random_and_mutated_examples_read_as_protobuf_reads_them():
  rng = np.random.default_rng(0)
  checked = refused = 0
  for _ in range(3000):
    data = _random_example(rng)
    for _ in range(int(rng.integers(0, 3))):
      data = _mutate(rng, data)
    theirs, ours = _theirs(data), _ours(data)
    assert _same(theirs, ours), (data, theirs, ours)
    checked += 1
    refused += theirs is None
  assert refused > 50 and checked - refused > 2000  # both kinds well covered


@pytest.mark.parametrize(
  'data',
  [
    # one Feature whose int64 list comes in two parts: merged [1, 2, 3]
    bytes.fromhex(
      '0a110a0f0a0161120a1a03 0a0101 1a03 0a020203'.replace(' ', '')
    ),
    # a 10-byte varint (protobuf keeps its low 64 bits) in an unpacked int64
    # list
    bytes.fromhex('0a150a130a0161120e1a0c08ffffffffffffffffff01'),
    # an 11-byte varint: refused by both
    bytes.fromhex('0a160a140a0161120f1a0d08ffffffffffffffffffff01'),
    # an int64 value of wire type fixed32: an unknown field to protobuf, skipped
    bytes.fromhex('0a0f0a0d0a016112081a060d01000000'),
    # field number 0: refused
    bytes.fromhex('0002'),
    # an end of group nobody opened: refused
    bytes.fromhex('0c'),
  ],
)
def test_edges_read_as_protobuf_reads_them(data):
  assert _same(_theirs(data), _ours(data)), (_theirs(data), _ours(data))
