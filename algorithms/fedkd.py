"""FedKD (Wu, Wu, Lyu, Qi, Huang and Xie, "Communication-efficient
federated learning via knowledge distillation", Nature Communications
2022, arXiv 2108.13323), as PFLlib's ``clientkd.py`` / ``serverkd.py`` run
it: each client keeps a mentor model (its own, evaluated) and trains it
together with the shared mentee model and a feature map W_h [D, D]; only
the mentee travels, its weights truncated by SVD.

A local step: with t = CE_mentor + CE_mentee,

  mentor: CE_mentor + KL(mentee || mentor) / t + MSE(h, W_h h_g) / t,
  mentee: CE_mentee + KL(mentor || mentee) / t + MSE(h, W_h h_g) / t

(PFLlib's ``L_h_g`` is ``L_h`` again, the mentor's features h against the
mapped mentee features h_g; KL ``KLDivLoss()``'s mean, targets not
detached, the denominators not detached): every parameter takes the
gradient of the two losses' sum, each model's (and W_h's) clipped to norm
10; the mentor and W_h step with the client optimizer, the mentee with SGD
at ``--fedkd_mentee_learning_rate``.

Compression (``decomposition``): each weight with more than one output and two
or four dimensions is replaced by its truncated SVD (a 4-d convolution kernel
per (output, input) pair of its spatial matrix), keeping the first r singular
values, r the smallest index whose preceding squared singular values (summed
over the whole tensor) exceed the energy times their total; none such gives r =
0 (a zero tensor), as PFLlib's loop runs. Clients upload their compressed
mentee; the server averages the uploads uniformly and compresses the mean, which
every client receives (the clients' uploads are compressed in the server's part
of the round). The energy climbs from T_start to T_end: T_start + R / H (T_end -
T_start) in round R, H PFLlib's ``-gr`` (``--fedkd_horizon``, the command:
``--rounds - 1``). Defaults PFLlib's: mentee rate 0.005, T_start 0.95, T_end
0.98.

Bytes moved are counted as the uncompressed model's (an upper bound: the
kept rank is decided by the data).
"""

import dataclasses
import math
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct, traverse_util

from fedjax_personal.algorithms.fedavg import (
  global_model_communication,
)
from fedjax_personal.algorithms.fml import CLIP, kl_mean
from fedjax_personal.config import (
  BATCHING,
  CLIENT_OPTIMIZER,
  AlgorithmSpec,
  BuildData,
  Declared,
  TrainingConfig,
  hparam,
)
from fedjax_personal.core.algorithm import (
  ClientModels,
  ClientRows,
  FederatedAlgorithm,
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.clipping import torch_clip
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.losses import Batch, LossStats, forward, logits_loss
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import ClientContext, sgd_client_work
from fedjax_personal.core.tree_util import PyTree, rows, tree_broadcast
from fedjax_personal.hparams import require_filled
from fedjax_personal.models import Model

__all__ = [
  'build',
  'compress',
  'energy_at',
  'fedkd',
  'FedKDConfig',
  'SPEC',
  'truncated_svd',
  'truncation_on_host',
]


@dataclasses.dataclass(frozen=True)
class FedKDConfig(Declared):
  """FedKD's own settings: the ``--fedkd_*`` flags (PFLlib's defaults)."""

  prefix: ClassVar[str] = 'fedkd'
  mentee_learning_rate: float = hparam(
    0.005,
    "The mentee's SGD rate (PFLlib -mlr).",
    minimum=0,
    open_min=True,
    sweep=True,
  )
  t_start: float = hparam(
    0.95,
    "The SVD's energy kept in round 0 (PFLlib -Ts).",
    minimum=0,
    maximum=1,
    sweep=True,
  )
  t_end: float = hparam(
    0.98,
    'The energy kept in round H (PFLlib -Te).',
    minimum=0,
    maximum=1,
    sweep=True,
  )
  horizon: Optional[int] = hparam(
    None,
    'H: the energy is T_start + R / H (T_end - T_start) in round R (PFLlib '
    '-gr; the command: --rounds - 1, at least 1).',
    minimum=1,
    of_run=lambda run: max(run.rounds - 1, 1),
  )


@struct.dataclass
class FedKDState:
  """FedKD's state.

  Attributes:
    params: the compressed global mentee (as every client receives it).
    rows: client rows: ``mentor`` (the client's model) and ``w_h`` (its
      feature map, PyTorch's [out, in] layout).
  """

  params: optax.Params
  rows: PyTree


@struct.dataclass
class FedKDOutput:
  """What one FedKD client returns.

  Attributes:
    mentee: its trained mentee (compressed by the server, the cohort's
      uploads at once).
    row: its new rows (written by the engine).
    num_examples: its training examples.
    stats: its mentor's training statistics.
    num_steps: local steps taken.
  """

  mentee: PyTree
  row: PyTree
  num_examples: HostOrDevice
  stats: LossStats
  num_steps: jax.Array


def energy_at(round_num, t_start: float, t_end: float, horizon: int):
  """The energy of round R: T_start + R / H (T_end - T_start) (PFLlib's
  server updates it after each round).

  Args:
    round_num: R.
    t_start: T_start.
    t_end: T_end.
    horizon: H.

  Returns:
    A float32 scalar.
  """
  r = jnp.asarray(round_num, jnp.float32)
  return t_start + r / horizon * (t_end - t_start)


def truncation_on_host(mats: np.ndarray, energy) -> np.ndarray:
  """PFLlib's truncated SVD of a stack of matrices, reconstructed, on the
  host in float64: the right (or left) singular vectors and squared
  singular values are the eigenvectors and eigenvalues of the smaller Gram
  matrix, and U_r S_r V_r^T = M V_r V_r^T. The same truncation as
  ``np.linalg.svd`` (PFLlib's call) to float32 rounding, a third of its
  time on a 1024 x 512 weight (one Gram product and a 512 x 512
  eigendecomposition where the SVD bidiagonalizes the whole matrix).

  Args:
    mats: [..., m, n] float32, one tensor's matrices.
    energy: the share of the squared singular values to exceed.

  Returns:
    [..., m, n] float32: the matrices truncated at the rank PFLlib's loop
    picks over the whole tensor (``mats`` itself when it is all zeros).
  """
  a = np.asarray(mats, np.float64)
  tall = a.shape[-2] >= a.shape[-1]
  b = a if tall else np.swapaxes(a, -1, -2)  # [..., m, n], m >= n
  lam, v = np.linalg.eigh(np.swapaxes(b, -1, -2) @ b)  # ascending
  lam, v = np.clip(lam[..., ::-1], 0.0, None), v[..., ::-1]
  sq = lam.reshape((-1, lam.shape[-1])).sum(axis=0)  # over the tensor
  total = sq.sum()
  if total == 0:
    return np.asarray(mats)
  before = np.cumsum(sq) - sq  # the sum of sigma[:r] squared
  hit = before > float(energy) * total
  rank = int(np.argmax(hit)) if hit.any() else 0
  kept = v[..., :rank]
  out = (b @ kept) @ np.swapaxes(kept, -1, -2)
  out = out if tall else np.swapaxes(out, -1, -2)
  return out.astype(np.asarray(mats).dtype)


def truncated_svd(w: jax.Array, energy) -> jax.Array:
  """PFLlib's ``decomposition`` of one weight, reconstructed: the SVD of
  its matrix (a Flax kernel [in, out] is PyTorch's [out, in] transposed; a
  convolution [kh, kw, in, out] one [kh, kw] matrix per (out, in) pair)
  truncated at the rank PFLlib's loop picks (see the module docstring),
  computed on the host (``truncation_on_host``; XLA's CPU SVD kernel, run
  by two client programs at once, was seen to hang jaxlib 0.10.2).

  Args:
    w: a 2-d or 4-d kernel in Flax's layout.
    energy: the share of the squared singular values to exceed.

  Returns:
    The truncated weight, ``w``'s shape.
  """
  if w.ndim == 2:
    mats = w
  else:  # [kh, kw, in, out] -> [in, out, kh, kw]
    mats = jnp.transpose(w, (2, 3, 0, 1))
  out = jax.pure_callback(
    truncation_on_host,
    jax.ShapeDtypeStruct(mats.shape, mats.dtype),
    mats,
    jnp.asarray(energy, jnp.float32),
    vmap_method='sequential',  # the rank is each tensor's own
  )
  if w.ndim == 4:
    out = jnp.transpose(out, (2, 3, 0, 1))
  return out


def compress(params: PyTree, energy) -> PyTree:
  """Every weight PFLlib compresses (2-d or 4-d, more than one output, not
  an embedding) truncated (``truncated_svd``); the rest as they are.

  Args:
    params: a model's parameters.
    energy: the energy kept.

  Returns:
    The compressed parameters, reconstructed.
  """
  flat = traverse_util.flatten_dict(params)
  out = {}
  for key, w in flat.items():
    wide = w.ndim in (2, 4) and w.shape[-1] > 1
    out[key] = (
      truncated_svd(w, energy) if wide and 'embedding' not in key else w
    )
  return traverse_util.unflatten_dict(out)


def _mse_mean(a, b, mask):
  """PyTorch's ``MSELoss()`` over the real examples' entries."""
  per = jnp.sum(jnp.square(a - b), axis=-1)
  count = jnp.maximum(jnp.sum(mask), 1) * a.shape[-1]
  return jnp.sum(jnp.where(mask, per, 0)) / count


def fedkd(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  mentee_learning_rate: float = 0.005,
  t_start: float = 0.95,
  t_end: float = 0.98,
  horizon: int = 1,
) -> FederatedAlgorithm:
  """Builds FedKD.

  Args:
    model: the model (with a head: W_h maps the body's features).
    num_clients: N.
    client_optimizer: the mentor's and W_h's optimizer (after clipping).
    batching: local batching.
    mentee_learning_rate: the mentee's SGD rate.
    t_start: the energy of round 0.
    t_end: the energy of round ``horizon``.
    horizon: H.

  Returns:
    The ``FederatedAlgorithm``.
  """
  head = model.require_head('--algorithm=fedkd')
  dim = math.prod(head.feature_shape)
  clipped = lambda opt: optax.chain(torch_clip(CLIP), opt)
  optimizer = optax.multi_transform(
    {
      'mentor': clipped(client_optimizer),
      'mentee': clipped(optax.sgd(mentee_learning_rate)),
      'w_h': clipped(client_optimizer),
    },
    lambda params: {k: jax.tree.map(lambda _: k, v) for k, v in params.items()},
  )

  def init(key: jax.Array) -> FedKDState:
    k_model, k_map = jax.random.split(key)
    params = model.init(k_model)
    bound = 1.0 / math.sqrt(dim)  # PyTorch's Linear(D, D) initialization
    w_h = jax.random.uniform(
      k_map, (num_clients, dim, dim), minval=-bound, maxval=bound
    )
    rows_ = {'mentor': tree_broadcast(params, num_clients), 'w_h': w_h}
    return FedKDState(params, rows_)

  def server_broadcast(state: FedKDState, cohort: Cohort, rc: RoundContext):
    energy = energy_at(rc.round, t_start, t_end, horizon)
    shared = {'params': state.params, 'energy': energy}
    return shared, rows(state.rows, cohort.rows)

  def flat(z):
    return z.reshape((z.shape[0], -1))

  def objective(ctx: ClientContext):
    def loss(p, batch: Batch):
      out = forward(model, p['mentor'], batch, features=True)
      out_g = forward(model, p['mentee'], batch, features=True)
      ce, stats = logits_loss(model, out.logits, batch, out.state)
      ce_g, _ = logits_loss(model, out_g.logits, batch)
      t = ce + ce_g
      log_p = jax.nn.log_softmax(out.logits)
      log_g = jax.nn.log_softmax(out_g.logits)
      distill = kl_mean(log_p, out_g.logits, batch.mask) + kl_mean(
        log_g, out.logits, batch.mask
      )
      mapped = flat(out_g.features) @ p['w_h'].T
      hidden = _mse_mean(flat(out.features), mapped, batch.mask)
      return t + (distill + 2 * hidden) / t, stats

    return loss

  def final(ctx: ClientContext, carry) -> FedKDOutput:
    return FedKDOutput(
      mentee=carry.params['mentee'],
      row={'mentor': carry.params['mentor'], 'w_h': carry.params['w_h']},
      num_examples=ctx.data.train.num_examples,
      stats=carry.stats,
      num_steps=carry.num_steps,
    )

  work = sgd_client_work(
    objective,
    optimizer,
    batching,
    final,
    start_fn=lambda ctx: {
      'mentor': ctx.state['mentor'],
      'mentee': ctx.shared['params'],
      'w_h': ctx.state['w_h'],
    },
    trained_like=lambda p: {
      'mentor': p,
      'mentee': p,
      'w_h': jnp.zeros((dim, dim), jnp.float32),
    },
  )

  def server_update(
    state: FedKDState, cohort: Cohort, out: FedKDOutput, rc: RoundContext
  ):
    energy = energy_at(rc.round, t_start, t_end, horizon)
    uploads = jax.vmap(compress, in_axes=(0, None))(out.mentee, energy)
    w = cohort.mask.astype(jnp.float32)
    total = jnp.sum(w)
    mean = jax.tree.map(
      lambda a: jnp.tensordot(w / jnp.maximum(total, 1.0), a, axes=1), uploads
    )
    params = jax.tree.map(
      lambda new, old: jnp.where(total > 0, new, old),
      compress(mean, energy),
      state.params,
    )
    return (
      dataclasses.replace(state, params=params),
      cohort_train_metrics(out.stats, cohort.mask),
    )

  return FederatedAlgorithm(
    name='fedkd',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=work,
    server_update=server_update,
    client_models=lambda s: ClientModels.personal(
      s.rows['mentor'], num_clients
    ),
    communication=global_model_communication,
    client_rows=ClientRows.field('rows', output='row'),
  )


def build(
  training: TrainingConfig,
  config: FedKDConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedKD, built as ``AlgorithmSpec.build`` says; its settings
  ``FedKDConfig`` (its ``horizon`` given: the command fills it)."""
  return fedkd(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    config.mentee_learning_rate,
    config.t_start,
    config.t_end,
    require_filled(config, 'horizon'),
  )


SPEC = AlgorithmSpec(
  'fedkd',
  FedKDConfig,
  build,
  CLIENT_OPTIMIZER | BATCHING,
  summary='FedKD (Wu et al. 2022): mentor and mentee distillation, the '
  'mentee sent SVD-compressed',
)
