"""How much device memory a round needs, the block size that fits, and what
a sharded round communicates.

``auto`` on a GPU or TPU vectorizes the whole cohort (``vmap``, or ``sharded``
over several devices); when that would not fit in the device's free memory it
processes the cohort in blocks (``lax.map`` over blocks inside the compiled
round), the largest block that fits, and when not even one client fits it
stops before the first round, saying what would. The estimate, per device:

* resident: the algorithm's state (server state, replicated; the per-client
  rows, N of them, split over the devices) and the stacked outputs of the
  cohort the round scatters back into it (per-client rows again, C of them:
  Ditto's new personal models; still counted where the blocked loop writes
  them in place, ``ClientRows.output``: measured on a CPU, not on a GPU);
* per client of a block: its working copies of the model (start, current
  parameters, gradients, optimizer state, update: ``MODEL_COPIES`` times the
  model's bytes) plus the working bytes of one local step (``step_bytes``:
  XLA's own count of the compiled step's temporaries on this backend).

The data set is already on the device when the plan is made, so it is in the
device's used bytes. ``HEADROOM`` of the free memory is left to XLA's own
temporaries.
"""

import dataclasses
import re
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal.core.training import Batch, batch_loss
from fedjax_personal.core.tree_util import tree_bytes
from fedjax_personal.errors import SettingError

__all__ = [
  'activation_bytes',
  'block_size',
  'device_free_bytes',
  'estimate',
  'GB',
  'HEADROOM',
  'hlo_collectives',
  'MODEL_COPIES',
  'Need',
  'step_bytes',
]


MODEL_COPIES = 6
ACTIVATION_COPIES = 3
STEP_COPIES = 2
PROBE_CLIENTS = 2
HEADROOM = 0.85
GB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Need:
  """Bytes a round needs.

  Attributes:
    shared_bytes: state every device holds whole (server state).
    client_state_bytes: per-client state of one client (rows of the stacked
      state, and of the cohort's stacked outputs).
    num_clients: N.
    cohort_size: C, clients per round.
    working_bytes: per client of a block (model copies, activations).
  """

  shared_bytes: int
  client_state_bytes: int
  num_clients: int
  cohort_size: int
  working_bytes: int

  def resident(self, num_devices: int = 1) -> int:
    rows = self.client_state_bytes * (
      -(-self.num_clients // num_devices) + -(-self.cohort_size // num_devices)
    )
    return self.shared_bytes + rows

  def total(self, block: int, num_devices: int = 1) -> int:
    return self.resident(num_devices) + block * self.working_bytes


def activation_bytes(model, sample_x, batch_size: int) -> int:
  """Bytes of every intermediate output of one forward pass of a batch (Flax
  modules' ``capture_intermediates``; the logits alone otherwise), from
  shapes alone (nothing compiled or allocated).

  Args:
    model: the ``Model``.
    sample_x: one input batch.
    batch_size: the batch's examples.

  Returns:
    Bytes.
  """
  x = jax.ShapeDtypeStruct(
    (batch_size,) + tuple(np.shape(sample_x)[1:]), jnp.asarray(sample_x).dtype
  )
  params = jax.eval_shape(model.init, jax.random.key(0))
  if getattr(model, 'module', None) is not None:
    try:
      _, state = jax.eval_shape(
        lambda p, x: model.module.apply(
          model.variables(p),
          x,
          capture_intermediates=True,
          mutable=['intermediates'],
          **model.evaluate_kwargs,
        ),
        params,
        x,
      )
      return tree_bytes(state)
    except Exception:  # a module that cannot capture: fall back to the output
      pass
  return tree_bytes(jax.eval_shape(model.apply, params, x))


def step_bytes(model, sample_x, batch_size: int) -> int:
  """The working bytes of one client's local gradient step of a batch:
  ``STEP_COPIES`` x the temporaries XLA's compiled memory analysis counts on
  this backend for the step vectorized over ``PROBE_CLIENTS`` clients, per
  client (forward values kept for the backward pass, a ``matmul``
  convolution's slice matrices and their gradients, which a module's
  outputs miss: the CIFAR CNN's step holds 136 MB for a batch of 32 on a
  CPU, its intermediate outputs 11 MB). Falls back to ``ACTIVATION_COPIES``
  x ``activation_bytes`` where the backend has no memory analysis.

  ``STEP_COPIES``: on an H200 a round of the CIFAR CNN over 1,000 clients
  planned from one step's temporaries asked for one 53 GB buffer (88 MB per
  client against 136 MB of temporaries) and ran out of memory; the round's
  scan over steps and XLA's GPU scheduling keep more alive than one step
  does (benchmarks/speed/README.md, "On a GPU").

  Args:
    model: the model.
    sample_x: one input batch.
    batch_size: the local batch.

  Returns:
    Bytes.
  """
  x = jax.ShapeDtypeStruct(
    (batch_size,) + tuple(np.shape(sample_x)[1:]), jnp.asarray(sample_x).dtype
  )
  params = jax.eval_shape(model.init, jax.random.key(0))
  out = jax.eval_shape(model.apply, params, x)
  y = (
    jax.ShapeDtypeStruct(out.shape[:-1], jnp.int32)
    if model.loss == 'cross_entropy'
    else jax.ShapeDtypeStruct(out.shape, jnp.float32)
  )

  def grad(p, xb, yb):
    batch = Batch(xb, yb, jnp.ones(xb.shape[0], bool))
    return jax.grad(lambda q: batch_loss(model, q, batch)[0])(p)

  stack = lambda t: jax.tree.map(
    lambda s: jax.ShapeDtypeStruct((PROBE_CLIENTS,) + tuple(s.shape), s.dtype),
    t,
  )
  try:
    analysis = (
      jax.jit(jax.vmap(grad)).lower(stack(params), stack(x), stack(y)).compile()
    )
    stats = analysis.memory_analysis()
    if stats is None:
      raise ValueError('no memory analysis')
    return int(STEP_COPIES * stats.temp_size_in_bytes / PROBE_CLIENTS)
  except Exception:  # no memory analysis on this backend: the outputs' count
    return ACTIVATION_COPIES * activation_bytes(model, sample_x, batch_size)


def estimate(algorithm, data, cohort_size: int) -> Need:
  """The memory a round of ``algorithm`` on ``data`` needs (see module doc).

  Args:
    algorithm: the algorithm.
    data: the federated data.
    cohort_size: clients per round.

  Returns:
    The estimate.
  """
  n = data.num_clients
  shapes = jax.eval_shape(algorithm.init, jax.random.key(0))
  per_client = [
    s for s in jax.tree.leaves(shapes) if s.ndim >= 1 and s.shape[0] == n
  ]
  client_bytes = tree_bytes(
    [jax.ShapeDtypeStruct(s.shape[1:], s.dtype) for s in per_client]
  )
  shared = tree_bytes(shapes) - client_bytes * n
  model_bytes = tree_bytes(algorithm.model.param_shapes())
  batching = algorithm.client_work.batching
  # padded data; a Population has counts
  widest = getattr(data.train, 'max_examples', None)
  if widest is None:
    widest = int(np.max(data.train.num_examples, initial=0))
  batch = batching.effective_batch_size(int(widest))
  sample_x = getattr(data, 'sample_x', None)
  act = step_bytes(
    algorithm.model,
    data.train.x[0, :1] if sample_x is None else sample_x,
    batch,
  )
  return Need(
    shared_bytes=int(shared),
    client_state_bytes=int(client_bytes),
    num_clients=n,
    cohort_size=int(cohort_size),
    working_bytes=MODEL_COPIES * model_bytes + act,
  )


def device_free_bytes(device=None) -> Optional[int]:
  """The device's free memory (``bytes_limit - bytes_in_use`` of its memory
  statistics), or None where there are none (CPU).

  Args:
    device: a device (None: the first).

  Returns:
    Bytes, or None where unknown (a CPU).
  """
  device = device or jax.local_devices()[0]
  try:
    stats = device.memory_stats()
  except Exception:
    return None
  if not stats or 'bytes_limit' not in stats:
    return None
  return int(stats['bytes_limit']) - int(stats.get('bytes_in_use', 0))


def block_size(
  need: Need, free_bytes: int, num_devices: int = 1
) -> Optional[int]:
  """Clients per block on each device: None when the device's whole share of
  the cohort fits at once, else the largest block that fits.

  Args:
    need: the round's memory estimate.
    free_bytes: a device's free bytes.
    num_devices: devices sharing the clients.

  Returns:
    Clients per block, or None.

  Raises:
    SettingError: not even one client fits (with what would: more devices or a
      smaller cohort).
  """
  budget = HEADROOM * free_bytes
  share = -(-need.cohort_size // num_devices)
  if need.total(share, num_devices) <= budget:
    return None
  room = budget - need.resident(num_devices)
  if room >= need.working_bytes:
    return int(room // need.working_bytes)
  devices = num_devices
  while devices < 4096 and need.total(1, devices) > budget:
    devices *= 2
  raise SettingError(
    'executor',
    f'a round needs {need.total(1, num_devices) / GB:.1f} GB per '
    f'device ({need.resident(num_devices) / GB:.1f} GB of state and stacked '
    f'cohort outputs), the device has {free_bytes / GB:.1f} GB free: shard '
    f'over '
    f'{devices} devices or more, or a smaller cohort_size',
  )


COLLECTIVES = (
  'all-reduce',
  'all-gather',
  'reduce-scatter',
  'all-to-all',
  'collective-permute',
)
_DTYPE_BYTES = {
  'pred': 1,
  's8': 1,
  'u8': 1,
  's16': 2,
  'u16': 2,
  'f16': 2,
  'bf16': 2,
  's32': 4,
  'u32': 4,
  'f32': 4,
  's64': 8,
  'u64': 8,
  'f64': 8,
  'c64': 8,
  'c128': 16,
}
_OP = re.compile(
  r'^\s*(?:ROOT\s+)?%[^ ]+\s*=\s*(.*?)\s+('
  + '|'.join(COLLECTIVES)
  + r')(?:-start)?\(',
  re.M,
)
_SHAPE = re.compile(r'([a-z]+[0-9]*)\[([0-9,]*)\]')


def hlo_collectives(hlo_text: str) -> dict:
  """{collective: (count, bytes)} of a compiled HLO module's text: every
  all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute,
  with the bytes of its result on one device (the data each device sends or
  receives, up to the algorithm's constant).

  Args:
    hlo_text: a compiled module's text.

  Returns:
    ``{collective: (count, bytes)}``.
  """
  out: Dict[str, Tuple[int, int]] = {}
  for m in _OP.finditer(hlo_text):
    nbytes = 0
    for dtype, dims in _SHAPE.findall(m.group(1)):
      size = 1
      for d in filter(None, dims.split(',')):
        size *= int(d)
      nbytes += size * _DTYPE_BYTES.get(dtype, 4)
    count, total = out.get(m.group(2), (0, 0))
    out[m.group(2)] = (count + 1, total + nbytes)
  return out
