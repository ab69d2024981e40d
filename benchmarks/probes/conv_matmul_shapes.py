"""Where the EMNIST CNN's step goes on a CPU: its second convolution's three
products (forward, kernel gradient, slice gradient) as XLA:CPU runs them.

Reddi et al.'s EMNIST CNN ("Adaptive Federated Optimization", arXiv
2003.00295; ``reddi_emnist_cnn``) spends about 88% of a step's FLOPs in its
second convolution (3x3, 32 -> 64 channels, 26x26 -> 24x24). Under
``conv_impl=tiled`` (``models.layers.conv_as_matmul``, layout CNHW) at a
batch of 20 it is three matmuls of the slice matrix cols [288, 11520]:
forward W^T [64, 288] @ cols, kernel gradient dY [64, N] @ cols^T, slice
gradient W [288, 64] @ dY. This times each (and the other layout's
orientation, and the forward cut into column chunks or per example) in a
scan of 10, so each is compiled as a client's loop is, and a 1024^2 matmul
for the peak. Run it on one core the way the blocked executor runs a client
(``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false taskset -c 0``) and on two.

    python benchmarks/probes/conv_matmul_shapes.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

STEPS = 10
M, K, N = 64, 288, 11520  # Cout, kh*kw*Cin, batch*Ho*Wo


def per_call_ms(f, *args, reps=9):
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t)
  return np.median(times) / STEPS * 1e3


def in_a_loop(fn):
  @jax.jit
  def run(xs, k):
    def body(c, x):
      return c + fn(x, k).sum(), None  # every output used: nothing left out

    return jax.lax.scan(body, 0.0, xs)[0]

  return run


def column_chunks(c):
  def f(x, k):
    return jnp.concatenate(
      [k @ x[:, i * (N // c) : (i + 1) * (N // c)] for i in range(c)], axis=1
    )

  return f


def main():
  rng = np.random.RandomState(0)
  r = lambda *s: jnp.asarray(rng.rand(*s).astype(np.float32))
  dot = lambda a, b, ca, cb: jax.lax.dot_general(
    a, b, (((ca,), (cb,)), ((), ()))
  )
  cases = {
    'forward, CNHW: W^T[64,288] @ cols[288,N]': (
      lambda x, k: k @ x,
      r(STEPS, K, N),
      r(M, K),
    ),
    'forward, NHWC: cols[N,288] @ W[288,64]': (
      lambda x, k: x @ k,
      r(STEPS, N, K),
      r(K, M),
    ),
    'forward, CNHW, per example (batched)': (
      lambda x, k: jnp.einsum('ok,bkn->obn', k, x),
      r(STEPS, 20, K, 576),
      r(M, K),
    ),
    'forward, CNHW, 10 column chunks': (
      column_chunks(10),
      r(STEPS, K, N),
      r(M, K),
    ),
    'kernel gradient, CNHW: dY[64,N] @ cols^T': (
      lambda x, k: dot(x, k, 1, 1),
      r(STEPS, M, N),
      r(K, N),
    ),
    'kernel gradient, NHWC: cols^T @ dY[N,64]': (
      lambda x, k: dot(x, k, 0, 0),
      r(STEPS, N, K),
      r(N, M),
    ),
    'slice gradient, CNHW: W[288,64] @ dY[64,N]': (
      lambda x, k: dot(k, x, 0, 0),
      r(STEPS, M, N),
      r(M, K),
    ),
    'slice gradient, NHWC: dY[N,64] @ W^T': (
      lambda x, k: dot(x, k, 1, 1),
      r(STEPS, N, M),
      r(K, M),
    ),
  }
  gflop = 2 * M * K * N / 1e9
  for name, (f, x, k) in cases.items():
    ms = per_call_ms(in_a_loop(f), x, k)
    print(
      f'{name:44s} {ms:6.2f} ms  {gflop / ms * 1e3:4.0f} GFLOP/s', flush=True
    )
  a = r(1024, 1024)
  mm = jax.jit(lambda a: a @ a)
  jax.block_until_ready(mm(a))
  t = time.perf_counter()
  for _ in range(10):
    jax.block_until_ready(mm(a))
  print(
    f'1024^2 matmul: '
    f'{2 * 1024**3 / ((time.perf_counter() - t) / 10) / 1e9:.0f} GFLOP/s; '
    f'JAX {jax.__version__}, {jax.default_backend()}'
  )


if __name__ == '__main__':
  main()
