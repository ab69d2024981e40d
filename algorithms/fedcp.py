"""FedCP (Zhang et al., "FedCP: Separating Feature Information for
Personalized Federated Learning via Conditional Policy", KDD 2023, arXiv
2307.01217): a conditional policy network splits each feature vector into a
personal part, read by the client's own head, and a global part, read by a
global head; the body, the policy and the global head are averaged.

The client's model, as PFLlib's ``clientcp.py`` (its ``Ensemble``): z the
body's features, c the client's context (L2-normalized), the policy
(``ConditionalSelection``) ReLU(LayerNorm(W (z * c) + b)) viewed as
[2, D] and passed through a Gumbel softmax over the pair (temperature 1,
soft) gives (s_p, s_g); the logits are h_p(z * s_p) + h_g(z * s_g). A
round on a client: the body starts from the global body, h_g is frozen;
E epochs on the cross-entropy plus lambda times the RBF maximum mean
discrepancy between its features and the global body's (bandwidths 10, 15,
20, 50: Eq. 6). It then uploads its body, its policy and 0.5 h_p + 0.5 h_g
(``generate_upload_head``); the server averages each (examples-weighted)
and hands the round's clients the global policy and head, and each its new
context, the sum over classes of its head's weights (``set_head_g``).

As PFLlib's code runs: the Gumbel noise is drawn at test time too (its
``gumbel_softmax`` ignores evaluation mode), so accuracy is a draw
(``--fedcp_gumbel=false`` turns the noise off everywhere); a client outside
the round keeps the policy, global head and context it last received (so
they are client rows); the context starts as one uniform draw shared by
every client (PFLlib draws it after reseeding torch for each client).
"""

import dataclasses
import math
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct

from fedjax_personal.algorithms.fedavg import summed_upload
from fedjax_personal.config import (
  BATCHING,
  CLIENT_OPTIMIZER,
  AlgorithmSpec,
  BuildData,
  Declared,
  TrainingConfig,
  hparam,
)
from fedjax_personal.core import aggregation
from fedjax_personal.core.algorithm import (
  ClientModels,
  ClientRows,
  Communication,
  FederatedAlgorithm,
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.data import LocalData
from fedjax_personal.core.losses import (
  Batch,
  LossStats,
  forward,
  logits_loss,
  per_example_stats,
)
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import ClientContext, sgd_client_work
from fedjax_personal.core.tree_util import (
  PyTree,
  leading_size,
  rows,
  tree_broadcast,
  tree_bytes,
  tree_scatter_where,
  tree_where,
)
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import Dense, HeadSplit, Model, functional

__all__ = [
  'build',
  'conditional_policy',
  'fedcp',
  'FedCPConfig',
  'init_policy',
  'mmd_rbf',
  'SPEC',
]

#: PFLlib's ``MMD(..., 'rbf')`` bandwidths.
BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)


@dataclasses.dataclass(frozen=True)
class FedCPConfig(Declared):
  """FedCP's own settings: the ``--fedcp_*`` flags (PFLlib's defaults)."""

  prefix: ClassVar[str] = 'fedcp'
  lamda: float = hparam(
    1.0,
    'Weight lambda of the feature discrepancy to the global body (PFLlib '
    '-lam).',
    minimum=0,
    sweep=True,
  )
  gumbel: bool = hparam(
    True,
    "Whether the policy's Gumbel softmax draws its noise (PFLlib's: in "
    'training and at test); false: a plain softmax.',
  )


@struct.dataclass
class FedCPState:
  """FedCP's state.

  Attributes:
    body: the global body.
    rows: client rows ``{'head': h_p, 'head_g': the global head it last
      received, 'policy': the policy it last received, 'context': [D]}``.
  """

  body: PyTree
  rows: PyTree


@struct.dataclass
class FedCPOutput:
  """What one FedCP client returns.

  Attributes:
    upload: its body, policy and 0.5 h_p + 0.5 h_g (each mean's weighted
      share once summed).
    head: its trained personal head (stacked).
    context: its new context [D] (stacked).
    num_examples: its training examples.
    stats: training statistics.
    num_steps: local steps taken.
  """

  upload: PyTree
  head: PyTree
  context: jax.Array
  num_examples: HostOrDevice
  stats: LossStats
  num_steps: Any = None


def init_policy(key, dim: int):
  """The policy's parameters as PyTorch initializes ``ConditionalSelection``
  (a ``Linear(D, 2D)`` and its ``LayerNorm``).

  Args:
    key: draws the dense layer.
    dim: D, the features.

  Returns:
    ``{'kernel' [D, 2D], 'bias', 'scale', 'shift'}``.
  """
  return functional.dense_norm_params(key, dim, 2 * dim)


def conditional_policy(policy, gate_in, key, gumbel: bool):
  """PFLlib's ``ConditionalSelection``: ReLU(LayerNorm(W x + b)) [B, 2D]
  viewed as [B, 2, D], a soft Gumbel softmax over the pair (temperature 1;
  the noise drawn by ``key`` when ``gumbel``).

  Args:
    policy: its parameters (``init_policy``).
    gate_in: [B, D] the features times the normalized context.
    key: draws the Gumbel noise.
    gumbel: whether to draw it.

  Returns:
    ``(s_p, s_g)``, each [B, D].
  """
  h = gate_in @ policy['kernel'] + policy['bias']
  h = functional.layer_norm(h, policy['scale'], policy['shift'])
  h = jax.nn.relu(h).reshape((h.shape[0], 2, -1))
  if gumbel:
    h = h + jax.random.gumbel(key, h.shape, h.dtype)
  s = jax.nn.softmax(h, axis=1)
  return s[:, 0], s[:, 1]


def mmd_rbf(x, y, mask):
  """PFLlib's ``MMD(x, y, 'rbf')`` over the batch's real rows: the mean of
  K(x, x) + K(y, y) - 2 K(x, y), K the sum of exp(-d / (2 a)) over the
  bandwidths a, d the squared distances.

  Args:
    x: [B, D].
    y: [B, D].
    mask: bool [B], the real rows.

  Returns:
    A scalar.
  """

  def sq(a, b):
    return jnp.sum(a * a, 1)[:, None] + jnp.sum(b * b, 1)[None, :] - 2 * a @ b.T

  def kernel(d):
    return sum(jnp.exp(-0.5 * d / a) for a in BANDWIDTHS)

  both = (mask[:, None] & mask[None, :]).astype(x.dtype)
  k = kernel(sq(x, x)) + kernel(sq(y, y)) - 2 * kernel(sq(x, y))
  return jnp.sum(k * both) / jnp.maximum(jnp.sum(both), 1)


def head_context(head_params):
  """``set_head_g``'s context: the sum over classes of the head's weights
  (a dense head's kernel [D, C] summed over C)."""
  return jnp.sum(head_params['kernel'], axis=-1)


def cp_logits(head: HeadSplit, parts, features, key, gumbel: bool):
  """The ensemble's logits from the body's features."""
  z = features.reshape((features.shape[0], -1))
  c = parts['context']
  c = c / jnp.maximum(jnp.linalg.norm(c), 1e-12)
  s_p, s_g = conditional_policy(parts['policy'], z * c[None, :], key, gumbel)
  shape = features.shape
  return head.logits(parts['head'], (z * s_p).reshape(shape)) + head.logits(
    parts['head_g'], (z * s_g).reshape(shape)
  )


def fedcp(
  model: Model,
  num_clients: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  lamda: float = 1.0,
  gumbel: bool = True,
) -> FederatedAlgorithm:
  """Builds FedCP.

  Args:
    model: the model; its head a dense layer on flat features.
    num_clients: N.
    client_optimizer: the client optimizer (body, personal head, policy).
    batching: local batching.
    lamda: the discrepancy's weight.
    gumbel: whether the policy draws Gumbel noise.

  Returns:
    The ``FederatedAlgorithm``.
  """
  head = model.require_head('--algorithm=fedcp')
  if not isinstance(head.module, (Dense, nn.Dense)):
    raise ConfigError(
      'model',
      "--algorithm=fedcp takes its context from a dense head's weights; "
      f'model {model.name!r} ends in {type(head.module).__name__}',
    )
  dim = math.prod(head.feature_shape)

  def init(key: jax.Array) -> FedCPState:
    k_model, k_policy, k_context = jax.random.split(key, 3)
    body, top = head.split(model.init(k_model))
    row = {
      'head': top,
      'head_g': top,
      'policy': init_policy(k_policy, dim),
      'context': jax.random.uniform(k_context, (dim,), jnp.float32),
    }
    return FedCPState(body, tree_broadcast(row, num_clients))

  def server_broadcast(state: FedCPState, cohort: Cohort, rc: RoundContext):
    return state.body, rows(state.rows, cohort.rows)

  def objective(ctx: ClientContext):
    row = ctx.state

    def loss(trained, batch: Batch):
      out = forward(model, head.merge(trained['body'], trained['head']), batch,
                    features=True)  # fmt: skip
      frozen = forward(
        model, head.merge(ctx.shared, trained['head']), batch, features=True
      ).features
      parts = {**row, 'head': trained['head'], 'policy': trained['policy']}
      logits = cp_logits(head, parts, out.features, batch.key, gumbel)
      ce, stats = logits_loss(model, logits, batch)
      z = out.features.reshape((out.features.shape[0], -1))
      zg = jax.lax.stop_gradient(frozen.reshape((frozen.shape[0], -1)))
      return ce + lamda * mmd_rbf(z, zg, batch.mask), stats

    return loss

  def final(ctx: ClientContext, carry) -> FedCPOutput:
    trained = carry.params
    up_head = jax.tree.map(
      lambda p, g: 0.5 * p + 0.5 * g, trained['head'], ctx.state['head_g']
    )
    return FedCPOutput(
      upload={
        'body': trained['body'],
        'policy': trained['policy'],
        'head_g': up_head,
      },
      head=trained['head'],
      context=head_context(trained['head']),
      num_examples=ctx.data.train.num_examples,
      stats=carry.stats,
      num_steps=carry.num_steps,
    )

  work = sgd_client_work(
    objective,
    client_optimizer,
    batching,
    final,
    start_fn=lambda ctx: {
      'body': ctx.shared,
      'head': ctx.state['head'],
      'policy': ctx.state['policy'],
    },
    trained_like=lambda p: {
      'body': head.split(p)[0],
      'head': head.split(p)[1],
      'policy': init_policy(jax.random.key(0), dim),
    },
  )

  def server_update(
    state: FedCPState, cohort: Cohort, out: FedCPOutput, rc: RoundContext
  ):
    mean, weight = aggregation.upload_mean(out.upload)
    some = weight > 0
    body = tree_where(some, mean['body'], state.body)
    c = cohort.mask.shape[0]
    new = {
      'head': out.head,
      'head_g': tree_broadcast(mean['head_g'], c),
      'policy': tree_broadcast(mean['policy'], c),
      'context': out.context,
    }
    active = cohort.mask & some
    return (
      dataclasses.replace(
        state,
        body=body,
        rows=tree_scatter_where(state.rows, cohort.rows, new, active),
      ),
      cohort_train_metrics(out.stats, cohort.mask),
    )

  def client_models(state: FedCPState) -> ClientModels:
    n = leading_size(state.rows)
    return ClientModels.personal(
      {'body': tree_broadcast(state.body, n), **state.rows}, num_clients
    )

  def evaluate_client(parts, local: LocalData, test, key) -> LossStats:
    del local
    params = head.merge(parts['body'], parts['head'])
    _, z = model.and_features(model.apply)(params, test.x)
    logits = cp_logits(head, parts, z, key, gumbel)
    mask = jnp.arange(test.x.shape[0]) < test.num_examples
    return per_example_stats(logits, test.y, mask)

  def communication(state: FedCPState) -> Communication:
    body = tree_bytes(state.body)
    row = jax.tree.map(lambda a: a[0], state.rows)
    shared = tree_bytes(row['policy']) + tree_bytes(row['head_g'])
    # up: body, policy, the head to average; down: the body, and to the
    # round's clients the global policy and head
    return Communication(body + shared, body + shared, 1)

  return FederatedAlgorithm(
    name='fedcp',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=summed_upload(work, 'num_examples', field='upload'),
    server_update=server_update,
    client_models=client_models,
    evaluate_client=evaluate_client,
    communication=communication,
    client_rows=ClientRows.field('rows'),
  )


def build(
  training: TrainingConfig,
  config: FedCPConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedCP, built as ``AlgorithmSpec.build`` says; its settings
  ``FedCPConfig``."""
  return fedcp(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    training.batching(),
    config.lamda,
    config.gumbel,
  )


SPEC = AlgorithmSpec(
  'fedcp',
  FedCPConfig,
  build,
  CLIENT_OPTIMIZER | BATCHING,
  summary='FedCP (Zhang et al. 2023): a conditional policy splits features '
  'between a personal and a global head',
)
