"""A forward pass alone of the EMNIST CNN on a CPU: each ``conv_impl``, by batch.

Reddi et al.'s EMNIST CNN ("Adaptive Federated Optimization", arXiv
2003.00295; ``reddi_emnist_cnn``), one jitted forward pass of ``rows``
images, not inside a loop (as a pooled evaluation's chunk runs), for each
convolution implementation: microseconds an image and GFLOP/s (24 MFLOP a
forward pass). Behind ``Model.forward_only``: under ``auto`` a CPU trains
with ``tiled`` (XLA's convolution is the slow one inside a loop of steps and
in the gradient, ``conv_in_a_loop.txt``) and evaluates with ``xla``.

    python benchmarks/probes/forward_conv.py
"""

import time

import jax
import numpy as np

from fedjax_personal.models import create_model

# a forward pass of one 28x28 image, about (88% in the second convolution)
FLOPS = 24e6


def main():
  rng = np.random.RandomState(0)
  xs = rng.rand(1024, 28, 28, 1).astype(np.float32)
  print(f'JAX {jax.__version__}, {jax.default_backend()}')
  for impl in ('tiled', 'matmul', 'xla'):
    model = create_model('reddi_emnist_cnn', 62, xs[:1], conv_impl=impl)
    params = model.init(jax.random.key(0))
    f = jax.jit(lambda p, x: model.apply(p, x).sum())
    for rows in (16, 64, 256, 1024):
      x = jax.numpy.asarray(xs[:rows])
      f(params, x).block_until_ready()
      reps = max(1, 1024 // rows)
      start = time.perf_counter()
      for _ in range(reps):
        f(params, x).block_until_ready()
      per = (time.perf_counter() - start) / reps / rows
      print(
        f'{impl:7s} {rows:5d} images: {per * 1e6:7.1f} us an image, '
        f'{FLOPS / per / 1e9:4.0f} GFLOP/s',
        flush=True,
      )


if __name__ == '__main__':
  main()
