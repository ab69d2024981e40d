"""FedJAX's ``fedjax.serialization``, without TensorFlow: ``save_state`` /
``load_state`` pickle a state to a local path (FedJAX pickles through
``tf.io.gfile``: the same bytes for a local file), and FedJAX's msgpack
encoding of pytrees of arrays (``msgpack_serialize`` /
``msgpack_deserialize``: arrays as (shape, dtype name, C-order bytes))."""

import enum
import pickle

import jax
import msgpack
import numpy as np

__all__ = [
  'load_state',
  'msgpack_deserialize',
  'msgpack_serialize',
  'save_state',
]


def save_state(state, path) -> None:
  """Pickles ``state`` to ``path``.

  Args:
    state: the state (a pytree of arrays).
    path: a local file path.

  Returns:
    None.
  """
  with open(path, 'wb') as f:
    pickle.dump(state, f)


def load_state(path):
  """The state pickled at ``path``.

  Args:
    path: a local file path.

  Returns:
    The state.
  """
  with open(path, 'rb') as f:
    return pickle.load(f)


class _Ext(enum.IntEnum):
  """FedJAX's msgpack extension type codes."""

  ndarray = 1
  native_complex = 2
  npscalar = 3
  bytes_ndarray = 4


def _array_bytes(arr) -> bytes:
  arr = np.asarray(arr)
  if arr.dtype.hasobject or arr.dtype.isalignedstruct:
    raise ValueError(
      'Object and structured dtypes not supported for serialization of '
      'ndarrays.'
    )
  return msgpack.packb(
    (arr.shape, arr.dtype.name, arr.tobytes('C')), use_bin_type=True
  )


def _array_from(data) -> np.ndarray:
  shape, name, buffer = msgpack.unpackb(data, raw=True)
  dtype = jax.numpy.bfloat16 if name == b'bfloat16' else np.dtype(name)
  return np.frombuffer(buffer, dtype=dtype).reshape(shape, order='C')


def _pack(x):
  if isinstance(x, np.ndarray) and x.dtype.hasobject:
    flat = list(x.flatten())
    if flat and not isinstance(flat[0], bytes):
      raise ValueError('Only ndarrays holding bytes objects can be serialized.')
    return msgpack.ExtType(
      _Ext.bytes_ndarray, msgpack.packb((x.shape, flat), use_bin_type=True)
    )
  if isinstance(x, (np.ndarray, jax.Array)):
    return msgpack.ExtType(_Ext.ndarray, _array_bytes(x))
  if isinstance(x, np.generic):
    return msgpack.ExtType(_Ext.npscalar, _array_bytes(np.asarray(x)))
  if isinstance(x, complex):
    return msgpack.ExtType(_Ext.native_complex, msgpack.packb((x.real, x.imag)))
  return x


def _unpack(code, data):
  if code == _Ext.ndarray:
    return _array_from(data)
  if code == _Ext.native_complex:
    real, imag = msgpack.unpackb(data)
    return complex(real, imag)
  if code == _Ext.npscalar:
    return _array_from(data)[()]
  if code == _Ext.bytes_ndarray:
    shape, flat = msgpack.unpackb(data, raw=True)
    return np.array(flat, dtype=object).reshape(shape)
  return msgpack.ExtType(code, data)


def msgpack_serialize(pytree) -> bytes:
  """A pytree of dicts, lists and arrays as msgpack bytes (FedJAX's format).

  Args:
    pytree: the tree.

  Returns:
    The bytes.
  """
  return msgpack.packb(pytree, default=_pack, strict_types=True)


def msgpack_deserialize(encoded_pytree: bytes):
  """The pytree ``msgpack_serialize`` wrote.

  Args:
    encoded_pytree: its bytes.

  Returns:
    The tree (arrays as NumPy arrays).
  """
  return msgpack.unpackb(encoded_pytree, ext_hook=_unpack, raw=False)
