"""Google's farmhash ``Fingerprint64`` (farmhashna's ``Hash64``) in Python:
the hash TensorFlow's ``tf.strings.to_hash_bucket_fast`` and
``tf.lookup.StaticVocabularyTable`` put out-of-vocabulary words into buckets
with (``fingerprint64(word) % num_oov_buckets``), so FedJAX's Stack
Overflow tokenizer is reproduced without TensorFlow. Equal to TensorFlow's
on words of every length branch (tests/test_fedjax_tutorial.py).
"""

__all__ = ['fingerprint64']

_M = (1 << 64) - 1
K0, K1, K2 = 0xC3A5C85C97CB3127, 0xB492B66FBE98F273, 0x9AE16A3B2F90404F


def _fetch(s, i):
  return int.from_bytes(s[i : i + 8], 'little')


def _fetch32(s, i):
  return int.from_bytes(s[i : i + 4], 'little')


def _rot(v, shift):
  return ((v >> shift) | (v << (64 - shift))) & _M if shift else v


def _shift_mix(v):
  return v ^ (v >> 47)


def _hash16(u, v, mul):
  a = ((u ^ v) * mul) & _M
  a ^= a >> 47
  b = ((v ^ a) * mul) & _M
  b ^= b >> 47
  return (b * mul) & _M


def _len0to16(s, n):
  if n >= 8:
    mul = (K2 + n * 2) & _M
    a = (_fetch(s, 0) + K2) & _M
    b = _fetch(s, n - 8)
    c = (_rot(b, 37) * mul + a) & _M
    d = ((_rot(a, 25) + b) * mul) & _M
    return _hash16(c, d, mul)
  if n >= 4:
    mul = (K2 + n * 2) & _M
    a = _fetch32(s, 0)
    return _hash16((n + (a << 3)) & _M, _fetch32(s, n - 4), mul)
  if n > 0:
    a, b, c = s[0], s[n >> 1], s[n - 1]
    y = (a + (b << 8)) & 0xFFFFFFFF
    z = (n + (c << 2)) & 0xFFFFFFFF
    return (_shift_mix(((y * K2) ^ (z * K0)) & _M) * K2) & _M
  return K2


def _len17to32(s, n):
  mul = (K2 + n * 2) & _M
  a = (_fetch(s, 0) * K1) & _M
  b = _fetch(s, 8)
  c = (_fetch(s, n - 8) * mul) & _M
  d = (_fetch(s, n - 16) * K2) & _M
  return _hash16(
    (_rot((a + b) & _M, 43) + _rot(c, 30) + d) & _M,
    (a + _rot((b + K2) & _M, 18) + c) & _M,
    mul,
  )


def _len33to64(s, n):
  mul = (K2 + n * 2) & _M
  a = (_fetch(s, 0) * K2) & _M
  b = _fetch(s, 8)
  c = (_fetch(s, n - 8) * mul) & _M
  d = (_fetch(s, n - 16) * K2) & _M
  y = (_rot((a + b) & _M, 43) + _rot(c, 30) + d) & _M
  z = _hash16(y, (a + _rot((b + K2) & _M, 18) + c) & _M, mul)
  e = (_fetch(s, 16) * mul) & _M
  f = _fetch(s, 24)
  g = ((y + _fetch(s, n - 32)) * mul) & _M
  h = ((z + _fetch(s, n - 24)) * mul) & _M
  return _hash16(
    (_rot((e + f) & _M, 43) + _rot(g, 30) + h) & _M,
    (e + _rot((f + a) & _M, 18) + g) & _M,
    mul,
  )


def _weak32(s, i, a, b):
  w, x, y, z = (
    _fetch(s, i),
    _fetch(s, i + 8),
    _fetch(s, i + 16),
    _fetch(s, i + 24),
  )
  a = (a + w) & _M
  b = _rot((b + a + z) & _M, 21)
  c = a
  a = (a + x + y) & _M
  b = (b + _rot(a, 44)) & _M
  return (a + z) & _M, (b + c) & _M


def fingerprint64(s: bytes) -> int:
  """farmhash's ``Fingerprint64`` of ``s``.

  Args:
    s: the bytes.

  Returns:
    The unsigned 64-bit fingerprint.
  """
  n = len(s)
  if n <= 16:
    return _len0to16(s, n)
  if n <= 32:
    return _len17to32(s, n)
  if n <= 64:
    return _len33to64(s, n)
  seed = 81
  x = seed
  y = (seed * K1 + 113) & _M
  z = (_shift_mix((y * K2 + 113) & _M) * K2) & _M
  v, w = (0, 0), (0, 0)
  x = (x * K2 + _fetch(s, 0)) & _M
  end = ((n - 1) // 64) * 64
  last64 = end + ((n - 1) & 63) - 63
  i = 0
  while True:
    x = (_rot((x + y + v[0] + _fetch(s, i + 8)) & _M, 37) * K1) & _M
    y = (_rot((y + v[1] + _fetch(s, i + 48)) & _M, 42) * K1) & _M
    x ^= w[1]
    y = (y + v[0] + _fetch(s, i + 40)) & _M
    z = (_rot((z + w[0]) & _M, 33) * K1) & _M
    v = _weak32(s, i, (v[1] * K1) & _M, (x + w[0]) & _M)
    w = _weak32(s, i + 32, (z + w[1]) & _M, (y + _fetch(s, i + 16)) & _M)
    z, x = x, z
    i += 64
    if i == end:
      break
  mul = (K1 + ((z & 0xFF) << 1)) & _M
  i = last64
  w = ((w[0] + ((n - 1) & 63)) & _M, w[1])
  v = ((v[0] + w[0]) & _M, v[1])
  w = ((w[0] + v[0]) & _M, w[1])
  x = (_rot((x + y + v[0] + _fetch(s, i + 8)) & _M, 37) * mul) & _M
  y = (_rot((y + v[1] + _fetch(s, i + 48)) & _M, 42) * mul) & _M
  x ^= (w[1] * 9) & _M
  y = (y + v[0] * 9 + _fetch(s, i + 40)) & _M
  z = (_rot((z + w[0]) & _M, 33) * mul) & _M
  v = _weak32(s, i, (v[1] * mul) & _M, (x + w[0]) & _M)
  w = _weak32(s, i + 32, (z + w[1]) & _M, (y + _fetch(s, i + 16)) & _M)
  z, x = x, z
  return _hash16(
    (_hash16(v[0], w[0], mul) + _shift_mix(y) * K0 + z) & _M,
    (_hash16(v[1], w[1], mul) + x) & _M,
    mul,
  )
