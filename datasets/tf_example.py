"""A reader of serialized ``tf.train.Example`` protos, of the project's own.

TFF's SQLite files hold one ``tf.train.Example`` per row. Its schema
(``tensorflow/core/example/example.proto`` and ``feature.proto``, stable
since TensorFlow 1.0) in protobuf's wire format:

- ``Example``: field 1 ``features`` (a ``Features`` message);
- ``Features``: field 1 ``feature``, a map<string, Feature>: repeated
  entries, each a message of field 1 ``key`` (string) and field 2 ``value``
  (a ``Feature``);
- ``Feature``: one of field 1 ``bytes_list``, 2 ``float_list``,
  3 ``int64_list``, each a message whose field 1 ``value`` is repeated
  (bytes; float, packed as little-endian float32 or one fixed32 per value;
  int64, packed as varints or one varint per value).

Reading this here keeps the loaders off another package's generated modules
(tensorflow-datasets' ``tf_example_generated_pb2`` may move with any
release). Packed int64 lists, as TensorFlow writes them (``[packed = true]``),
are decoded with NumPy in one pass: an image of 3,072 pixels costs
microseconds, not a Python loop per value.
"""

from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import numpy as np

__all__ = ['parse']


_VARINT, _FIXED64, _LEN, _START_GROUP, _END_GROUP, _FIXED32 = 0, 1, 2, 3, 4, 5
_MASK64 = (1 << 64) - 1
_MAX_FIELD = (1 << 29) - 1  # protobuf's largest field number
Value = Union[np.ndarray, List[bytes]]


def _varint(buf: memoryview, pos: int) -> Tuple[int, int]:
  """The varint at ``buf[pos:]`` and the position after it: at most 10
  bytes, bits past the 64th dropped (protobuf's reading)."""
  result = shift = 0
  while True:
    if pos >= len(buf):
      raise ValueError('truncated varint')
    b = buf[pos]
    pos += 1
    result |= (b & 0x7F) << shift
    if b < 0x80:
      return result & _MASK64, pos
    shift += 7
    if shift >= 70:
      raise ValueError('varint longer than 10 bytes')


def _fields(buf: memoryview) -> Iterator[Tuple[int, int, Any]]:
  """(field number, wire type, value) of each field of a message: an int
  for varints, the bytes for the other wire types. Groups (wire types 3
  and 4, of no field of tf.train.Example) are skipped whole, as protobuf
  skips unknown fields; a field number 0, an unmatched end of group or an
  undefined wire type is an error, as in protobuf."""
  pos, end = 0, len(buf)
  while pos < end:
    key, pos = _varint(buf, pos)
    field, wire = key >> 3, key & 7
    if not 0 < field <= _MAX_FIELD:
      raise ValueError(f'field number {field} outside [1, 2^29 - 1]')
    if wire == _START_GROUP:
      pos = _skip_group(buf, pos, field)
      yield field, wire, None
      continue
    value, pos = _value(buf, pos, field, wire)
    yield field, wire, value


def _value(buf: memoryview, pos: int, field: int, wire: int):
  """One field's value (after its key) and the position after it."""
  if wire == _VARINT:
    return _varint(buf, pos)
  if wire in (_FIXED64, _FIXED32, _LEN):
    if wire == _LEN:
      n, pos = _varint(buf, pos)
    else:
      n = 8 if wire == _FIXED64 else 4
    if pos + n > len(buf):
      raise ValueError(f'field {field} runs past the end of its message')
    return buf[pos : pos + n], pos + n
  if wire == _END_GROUP:
    raise ValueError(f'an end of group (field {field}) that no group opened')
  raise ValueError(
    f'field {field} has wire type {wire}, which protobuf does not define'
  )


def _skip_group(buf: memoryview, pos: int, field: int) -> int:
  """The position after the group of ``field`` that starts at ``pos``."""
  while pos < len(buf):
    key, pos = _varint(buf, pos)
    # inside a skipped group protobuf (upb) checks no number
    inner, wire = (
      key >> 3,
      key & 7,
    )
    if wire == _END_GROUP:
      if inner != field:
        raise ValueError(f'group {field} ended as group {inner}')
      return pos
    if wire == _START_GROUP:
      pos = _skip_group(buf, pos, inner)
    else:
      _, pos = _value(buf, pos, inner, wire)
  raise ValueError(f'group {field} has no end')


def packed_varints(data) -> np.ndarray:
  """Packed varints as int64 (two's complement, as protobuf's int64)."""
  a = np.frombuffer(data, np.uint8)
  if a.size == 0:
    return np.zeros(0, np.int64)
  last = a < 0x80
  if not last[-1]:
    raise ValueError('truncated packed varint')
  ends = np.flatnonzero(last)
  if ends.size == a.size:  # every value below 128: one byte each
    return a.astype(np.int64)
  starts = np.concatenate([[0], ends[:-1] + 1])
  lengths = ends - starts + 1
  longest = int(lengths.max())
  if longest > 10:
    raise ValueError('varint longer than 10 bytes')
  low = (a & 0x7F).astype(np.uint64)
  values = low[starts]
  for k in range(1, longest):  # the k-th byte of the values that have one
    more = lengths > k
    values[more] |= low[starts[more] + k] << np.uint64(7 * k)
  return values.view(np.int64)


def _list(buf: memoryview, kind: int) -> Value:
  """The values of a BytesList (1), FloatList (2) or Int64List (3). A value
  of another wire type than its field's is an unknown field to protobuf:
  skipped."""
  if kind == 1:
    return [bytes(v) for f, w, v in _fields(buf) if f == 1 and w == _LEN]
  chunks = []
  for f, w, v in _fields(buf):
    if f != 1:
      continue
    if kind == 2:
      if w in (_LEN, _FIXED32):
        if len(v) % 4:
          raise ValueError(
            'a packed float list of a length not a multiple of 4'
          )
        chunks.append(np.frombuffer(v, '<f4'))
    elif w == _LEN:
      chunks.append(packed_varints(v))
    elif w == _VARINT:
      chunks.append(np.asarray([v], np.uint64).view(np.int64))
  dtype = np.float32 if kind == 2 else np.int64
  return np.concatenate(chunks).astype(dtype) if chunks else np.zeros(0, dtype)


def _feature(parts) -> Value:
  """The values of a Feature given in ``parts`` (its serialized parts, one
  or more: protobuf parses each in turn into the same message). Its lists
  are a oneof: the same list given again is merged (values concatenated),
  another list given later replaces it. Each part of each list is parsed
  alone (a malformed part is an error even if the next would complete it)."""
  kind: Optional[int] = None
  values: list = []
  for part in parts:
    for k, w, lst in _fields(memoryview(part)):
      if k in (1, 2, 3) and w == _LEN:
        if k != kind:
          kind, values = k, []
        values.append(_list(lst, k))
  if kind is None:
    return np.zeros(0, np.int64)  # a Feature with no list set
  if kind == 1:
    return [v for part in values for v in part]
  return np.concatenate(values)


def parse(serialized: bytes) -> Dict[str, Value]:
  """Every feature of a serialized ``tf.train.Example``: {name: int64 or
  float32 array, or a list of bytes}, as protobuf's parser reads it: parts
  of one message given twice are merged, a map key given twice takes its
  last value, unknown fields and groups are skipped.

  Args:
    serialized: the proto's bytes.

  Returns:
    ``{name: array or list of bytes}``.

  Raises:
    ValueError: the bytes are not a tf.train.Example.
  """
  out = {}
  for f, w, features in _fields(memoryview(serialized)):
    if f != 1 or w != _LEN:
      continue
    for g, w2, entry in _fields(features):
      if g != 1 or w2 != _LEN:
        continue
      key, feature, unknown = '', [], False  # protobuf's default key: ''
      for h, w3, v in _fields(entry):
        if h == 1 and w3 == _LEN:
          key = bytes(v).decode('utf-8')
        elif h == 2 and w3 == _LEN:
          feature.append(bytes(v))  # a value given twice: one Feature, merged
        else:
          unknown = True
      value = _feature(feature)  # parsed (a malformed one is an error)
      # protobuf (upb) keeps an entry with unknown fields out of the map
      if not unknown:
        out[key] = value
  return out
