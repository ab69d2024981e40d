"""FML, Federated Mutual Learning (Shen et al., "Federated Mutual
Learning", 2020, arXiv 2006.16765): each client keeps its own model and
trains it together with a copy of a shared "meme" model, each distilled
into the other (deep mutual learning); only the meme model is averaged.

A local step, as PFLlib's ``clientfml.py``: with p, g the softmaxes of the
local and meme logits,

  L_local = alpha CE(local) + (1 - alpha) KL(g || p),
  L_meme  = beta CE(meme) + (1 - beta) KL(p || g),

KL PyTorch's ``KLDivLoss()`` with its default ``'mean'`` reduction (the sum
divided by the batch's entries, examples times classes); its targets are
not detached, so each model's gradient is that of L_local + L_meme (PFLlib
back-propagates both losses into both models). Each model's gradient is
clipped to norm 10 before its SGD step. The server averages the meme models
uniformly (PFLlib: "1/len as the weight for privacy and fairness"). A
client is evaluated with its own model. Defaults: PFLlib's ``-al`` 1 and
``-bt`` 0 (the local model learns from the labels, the meme model from the
local one); the paper's 0.5 and 0.5 are flags.
"""

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import struct
from optax import tree_utils as otu

from fedjax_personal.algorithms.fedavg import (
  global_model_communication,
  global_server_update,
  summed_upload,
)
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
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.clipping import torch_clip
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.losses import Batch, LossStats, forward, logits_loss
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import ClientContext, sgd_client_work
from fedjax_personal.core.tree_util import PyTree, rows, tree_broadcast
from fedjax_personal.models import Model

__all__ = ['build', 'fml', 'FMLConfig', 'kl_mean', 'SPEC']

#: PFLlib's ``clip_grad_norm_(..., 10)`` of each model.
CLIP = 10.0


@dataclasses.dataclass(frozen=True)
class FMLConfig(Declared):
  """FML's own settings: the ``--fml_*`` flags (PFLlib's defaults)."""

  prefix: ClassVar[str] = 'fml'
  alpha: float = hparam(
    1.0,
    "Weight alpha of the local model's cross-entropy (1 - alpha: its "
    'distillation from the meme model; PFLlib -al).',
    minimum=0,
    maximum=1,
    sweep=True,
  )
  beta: float = hparam(
    0.0,
    "Weight beta of the meme model's cross-entropy (1 - beta: its "
    'distillation from the local model; PFLlib -bt).',
    minimum=0,
    maximum=1,
    sweep=True,
  )


@struct.dataclass
class FMLState:
  """FML's state.

  Attributes:
    params: the meme model.
    opt_state: the server optimizer's state.
    models: every client's own model (client rows).
  """

  params: optax.Params
  opt_state: optax.OptState
  models: PyTree


@struct.dataclass
class FMLOutput:
  """What one FML client returns.

  Attributes:
    delta: the meme model minus its trained copy (a uniform share).
    model: its own trained model (its row, written by the engine).
    num_examples: its training examples.
    stats: its own model's training statistics.
    num_steps: local steps taken.
  """

  delta: PyTree
  model: PyTree
  num_examples: HostOrDevice
  stats: LossStats
  num_steps: Any = None


def kl_mean(log_input, target_logits, mask):
  """PyTorch's ``KLDivLoss()(log_input, softmax(target_logits))``: the sum
  of t (log t - log_input) over the real examples' entries divided by their
  number (examples times classes); the target carries its gradient.

  Args:
    log_input: [B, K] log-probabilities.
    target_logits: [B, K] the target's logits.
    mask: bool [B].

  Returns:
    A scalar.
  """
  log_t = jax.nn.log_softmax(target_logits)
  t = jnp.exp(log_t)
  per = jnp.sum(t * (log_t - log_input), axis=-1)
  count = jnp.maximum(jnp.sum(mask), 1) * log_input.shape[-1]
  return jnp.sum(jnp.where(mask, per, 0)) / count


def fml(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  alpha: float = 1.0,
  beta: float = 0.0,
) -> FederatedAlgorithm:
  """Builds FML.

  Args:
    model: the model (both the local and the meme model).
    num_clients: N.
    client_optimizer: each model's optimizer (after clipping to norm 10).
    batching: local batching.
    alpha: the local model's cross-entropy weight.
    beta: the meme model's.

  Returns:
    The ``FederatedAlgorithm``.
  """
  server_optimizer = optax.sgd(1.0)
  each = optax.chain(torch_clip(CLIP), client_optimizer)
  optimizer = optax.multi_transform(
    {'local': each, 'meme': each},
    lambda params: {k: jax.tree.map(lambda _: k, v) for k, v in params.items()},
  )

  def init(key: jax.Array) -> FMLState:
    params = model.init(key)
    return FMLState(
      params, server_optimizer.init(params), tree_broadcast(params, num_clients)
    )

  def server_broadcast(state: FMLState, cohort: Cohort, rc: RoundContext):
    return state.params, rows(state.models, cohort.rows)

  def objective(ctx: ClientContext):
    def loss(both, batch: Batch):
      out = forward(model, both['local'], batch)
      out_g = forward(model, both['meme'], batch)
      ce, stats = logits_loss(model, out.logits, batch)
      ce_g, _ = logits_loss(model, out_g.logits, batch)
      log_p = jax.nn.log_softmax(out.logits)
      log_g = jax.nn.log_softmax(out_g.logits)
      local = alpha * ce + (1 - alpha) * kl_mean(
        log_p, out_g.logits, batch.mask
      )
      meme = beta * ce_g + (1 - beta) * kl_mean(log_g, out.logits, batch.mask)
      return local + meme, stats

    return loss

  def final(ctx: ClientContext, carry) -> FMLOutput:
    return FMLOutput(
      delta=otu.tree_sub(ctx.shared, carry.params['meme']),
      model=carry.params['local'],
      num_examples=ctx.data.train.num_examples,
      stats=carry.stats,
      num_steps=carry.num_steps,
    )

  work = sgd_client_work(
    objective,
    optimizer,
    batching,
    final,
    start_fn=lambda ctx: {'local': ctx.state, 'meme': ctx.shared},
    trained_like=lambda p: {'local': p, 'meme': p},
  )

  return FederatedAlgorithm(
    name='fml',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=summed_upload(work, 'uniform'),
    server_update=global_server_update(server_optimizer),
    client_models=lambda s: ClientModels.personal(s.models, num_clients),
    communication=global_model_communication,
    client_rows=ClientRows.field('models', output='model'),
  )


def build(
  training: TrainingConfig,
  config: FMLConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FML, built as ``AlgorithmSpec.build`` says; its settings ``FMLConfig``."""
  return fml(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    config.alpha,
    config.beta,
  )


SPEC = AlgorithmSpec(
  'fml',
  FMLConfig,
  build,
  CLIENT_OPTIMIZER | BATCHING,
  summary='FML (Shen et al. 2020): personal models and a shared meme model '
  'learning from each other',
)
