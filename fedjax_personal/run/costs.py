"""What a round costs and what the machine can do, for the benchmarks'
"% of peak" figures: XLA's count of one local step's FLOPs, and the
device's matmul rate and memory bandwidth measured in the same process.
"""

import contextlib
import time
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import optax

from fedjax_personal import numerics
from fedjax_personal.core.training import Batch, batch_loss
from fedjax_personal.models import layers

__all__ = [
  'local_step_cost',
  'matmul_flops_per_second',
  'stream_bytes_per_second',
]


def local_step_cost(
  model, opt, batch_size: int, in_shape, x_dtype='uint8'
) -> Tuple[float, float, object]:
  """XLA's cost analysis of one local SGD step (forward, backward, update).

  The analysis counts a loop's body once, so the step is analysed with
  ``tiled`` convolutions computed untiled (``models.layers.TILE_BYTES = 0``
  while it is traced): the same FLOPs, and the bytes of one slice matrix
  per batch.

  Args:
    model: a ``models.Model``.
    opt: the optax client optimizer.
    batch_size: examples per step.
    in_shape: one example's shape.
    x_dtype: the examples' dtype.

  Returns:
    (FLOPs, bytes read and written, the step function ``(params, opt_state,
    x, y) -> (params, opt_state)``).
  """
  params = model.init(jax.random.key(0))

  def step(p, s, x, y):
    g = jax.grad(
      lambda q: batch_loss(model, q, Batch(x, y, jnp.ones(x.shape[0], bool)))[0]
    )(p)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  x = jnp.zeros((batch_size,) + tuple(in_shape), x_dtype)
  y = jnp.zeros((batch_size,), jnp.int32)
  tile, layers.TILE_BYTES = layers.TILE_BYTES, 0
  try:
    cost = (
      jax.jit(step)
      .lower(params, opt.init(params), x, y)
      .compile()
      .cost_analysis()
    )
  finally:
    layers.TILE_BYTES = tile
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  return (
    float(cost.get('flops', 0.0)),
    float(cost.get('bytes accessed', 0.0)),
    step,
  )


def matmul_flops_per_second(
  n: int = 2048, reps: int = 10, precision: Optional[str] = None
) -> float:
  """The float32 rate of an ``n`` x ``n`` matmul on the default device.

  Args:
    n: the matrices' side.
    reps: timed repetitions (after one compiling call).
    precision: a ``numerics.MATMUL_PRECISIONS`` name for this measurement
      (None: the precision in effect).

  Returns:
    FLOP/s (2 n^3 per product).
  """
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  f = jax.jit(lambda a: a @ a)
  scope = (
    contextlib.nullcontext()
    if precision is None
    else jax.default_matmul_precision(numerics.MATMUL_PRECISIONS[precision])
  )
  with scope:  # part of the jit key: compiled at this precision
    f(a).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
      out = f(a)
    out.block_until_ready()
  return 2 * n**3 * reps / (time.perf_counter() - t)


def stream_bytes_per_second(mib: int = 64, reps: int = 10) -> float:
  """Memory bandwidth as XLA sees it: a jitted ``a * 1.5`` over ``mib`` MiB
  (read and written), the best of ``reps``; bytes/s.

  Args:
    mib: MiB streamed.
    reps: repetitions (the best kept).

  Returns:
    Bytes per second.
  """
  a = jnp.ones((mib << 18,), jnp.float32)
  f = jax.jit(lambda a: a * 1.5)
  f(a).block_until_ready()
  best = float('inf')
  for _ in range(reps):
    t = time.perf_counter()
    f(a).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return 2 * a.nbytes / best
