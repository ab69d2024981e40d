"""GPFL (Zhang et al., "GPFL: Simultaneously Learning Global and
Personalized Feature Information for Personalized Federated Learning",
ICCV 2023, arXiv 2308.10279): a conditional valve (CoV) turns the body's
features into a personalized and a generic version, conditioned on two
inputs made from global class embeddings (GCE); the personalized features
feed the client's own head, the generic ones a cosine classifier over the
embeddings.

The client's work, as PFLlib's ``clientgpfl.py`` / ``servergpfl.py``: z the
body's features, CoV(z, c) = ReLU(z * (gamma(c) + 1) + beta(c)) with
gamma, beta = LayerNorm(ReLU(W c + b)) each; the loss is the cross-entropy
of h(CoV(z, c_p)), plus the cross-entropy of the cosine similarities
between CoV(z, c_g) and the class embeddings E, plus lambda times the
Frobenius norm over the batch of CoV(z, c_g) minus the embeddings of the
labels in the round's starting E (held fixed, ``GCE_frozen``). The body
and head train with the client optimizer, E and the valve with it after a
weight decay mu (its separate SGDs with ``weight_decay``). The server
averages the bodies, E and the valve (examples-weighted) and hands every
client the new E and valve; before it does, each client makes its inputs
from the E it holds (``set_GCE``): c_g the mean of the embeddings, c_p
their mean weighted by its label shares. The body is shared, the head
personal.

As PFLlib's code runs: in the first round both inputs are zero; a client
outside a round makes its inputs from the E it received the round before
(so those of a client that trained are its own trained E's). The label
shares are those of all of the client's training examples (PFLlib counts
one shuffled pass of its full batches when it creates the client).
"""

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import struct

from fedjax_personal.algorithms.fedavg import summed_upload
from fedjax_personal.algorithms.fedpcl import normalize
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
from fedjax_personal.core.data import LocalData, label_counts
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
from fedjax_personal.models import Model, functional

__all__ = [
  'build',
  'conditional_valve',
  'gpfl',
  'GPFLConfig',
  'init_valve',
  'SPEC',
]


@dataclasses.dataclass(frozen=True)
class GPFLConfig(Declared):
  """GPFL's own settings: the ``--gpfl_*`` flags (PFLlib's defaults)."""

  prefix: ClassVar[str] = 'gpfl'
  lamda: float = hparam(
    1.0,
    "Weight lambda of the generic features' distance to the embeddings "
    '(PFLlib -lam).',
    minimum=0,
    sweep=True,
  )
  mu: float = hparam(
    0.0,
    'Weight decay mu of the embeddings and the valve (PFLlib -mu).',
    minimum=0,
    sweep=True,
  )


@struct.dataclass
class GPFLState:
  """GPFL's state.

  Attributes:
    body: the global body.
    gce: the global class embeddings E [K, D].
    prev_gce: the embeddings of the round before (the inputs of a client
      that did not train in the last round are made from them).
    valve: the global CoV.
    rounds: rounds done.
    rows: client rows ``{'head', 'generic': c_g, 'personal': c_p,
      'last': the round it last trained (-1: never)}``.
  """

  body: PyTree
  gce: jax.Array
  prev_gce: jax.Array
  valve: PyTree
  rounds: jax.Array
  rows: PyTree


@struct.dataclass
class GPFLShared:
  """What every client receives."""

  body: PyTree
  gce: jax.Array
  prev_gce: jax.Array
  valve: PyTree
  round: jax.Array


@struct.dataclass
class GPFLOutput:
  """What one GPFL client returns.

  Attributes:
    upload: its body, embeddings and valve (each mean's weighted share once
      summed).
    row: its new row (head, inputs from its trained embeddings, the round).
    num_examples: its training examples.
    stats: training statistics.
    num_steps: local steps taken.
  """

  upload: PyTree
  row: PyTree
  num_examples: HostOrDevice
  stats: LossStats
  num_steps: Any = None


def init_valve(key, dim: int):
  """The CoV's parameters as PyTorch initializes them: its two ``Linear(D,
  D)`` (then ReLU) and ``LayerNorm``.

  Args:
    key: draws them.
    dim: D.

  Returns:
    ``{'gamma': layer, 'beta': layer}``.
  """
  kg, kb = jax.random.split(key)
  return {
    'gamma': functional.dense_norm_params(kg, dim, dim),
    'beta': functional.dense_norm_params(kb, dim, dim),
  }


def _condition(layer, c):
  h = jax.nn.relu(c @ layer['kernel'] + layer['bias'])
  return functional.layer_norm(h, layer['scale'], layer['shift'])


def conditional_valve(valve, z, c):
  """PFLlib's ``CoV``: ReLU(z * (gamma(c) + 1) + beta(c)).

  Args:
    valve: its parameters (``init_valve``).
    z: [B, D] features.
    c: [D] the conditional input.

  Returns:
    [B, D].
  """
  gamma = _condition(valve['gamma'], c)
  beta = _condition(valve['beta'], c)
  return jax.nn.relu(z * (gamma + 1) + beta)


def gce_loss(features, embeddings, labels, mask):
  """PFLlib's ``GCE`` loss: the mean cross-entropy of the cosine similarities
  between the features and the class embeddings."""
  cosine = normalize(features) @ normalize(embeddings).T
  nll = -jnp.take_along_axis(
    jax.nn.log_softmax(cosine), labels[:, None], axis=1
  )[:, 0]
  return jnp.sum(jnp.where(mask, nll, 0)) / jnp.maximum(jnp.sum(mask), 1)


def conditional_inputs(gce, shares):
  """``set_GCE``'s inputs from embeddings E [K, D]: (the mean embedding,
  the embeddings weighted by the label shares)."""
  return jnp.mean(gce, axis=0), shares @ gce


def current_inputs(row, rounds, prev_gce, shares):
  """The inputs a client holds after ``rounds`` rounds: zero before the
  first; its own if it trained in the last round; else made from the
  embeddings of the round before."""
  generic, personal = conditional_inputs(prev_gce, shares)
  own = row['last'] == rounds - 1
  generic = jnp.where(own, row['generic'], generic)
  personal = jnp.where(own, row['personal'], personal)
  fresh = rounds == 0
  return jnp.where(fresh, 0.0, generic), jnp.where(fresh, 0.0, personal)


def label_shares(train, num_classes):
  """A client's share of each label among its training examples."""
  counts = label_counts(train, num_classes).astype(jnp.float32)
  return counts / jnp.maximum(jnp.sum(counts), 1)


def gpfl(
  model: Model,
  num_clients: int,
  num_classes: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  lamda: float = 1.0,
  mu: float = 0.0,
) -> FederatedAlgorithm:
  """Builds GPFL.

  Args:
    model: the model (with a head on flat features).
    num_clients: N.
    num_classes: K.
    client_optimizer: the client optimizer.
    batching: local batching.
    lamda: the embedding distance's weight.
    mu: the embeddings' and the valve's weight decay.

  Returns:
    The ``FederatedAlgorithm``.
  """
  head = model.require_head('--algorithm=gpfl')
  dim = math.prod(head.feature_shape)
  optimizer = optax.multi_transform(
    {
      'model': client_optimizer,
      'decayed': optax.chain(optax.add_decayed_weights(mu), client_optimizer),
    },
    lambda params: {
      part: jax.tree.map(
        lambda _: 'decayed' if part in ('gce', 'valve') else 'model', value
      )
      for part, value in params.items()
    },
  )

  def init(key: jax.Array) -> GPFLState:
    k_model, k_gce, k_valve = jax.random.split(key, 3)
    body, top = head.split(model.init(k_model))
    gce = jax.random.normal(k_gce, (num_classes, dim), jnp.float32)
    row = {
      'head': top,
      'generic': jnp.zeros(dim, jnp.float32),
      'personal': jnp.zeros(dim, jnp.float32),
      'last': jnp.asarray(-1, jnp.int32),
    }
    return GPFLState(
      body,
      gce,
      gce,
      init_valve(k_valve, dim),
      jnp.zeros((), jnp.int32),
      tree_broadcast(row, num_clients),
    )

  def server_broadcast(state: GPFLState, cohort: Cohort, rc: RoundContext):
    shared = GPFLShared(
      state.body, state.gce, state.prev_gce, state.valve, rc.round
    )
    return shared, rows(state.rows, cohort.rows)

  def inputs(ctx: ClientContext):
    shared = ctx.shared
    shares = label_shares(ctx.data.train, num_classes)
    return current_inputs(ctx.state, shared.round, shared.prev_gce, shares)

  def objective(ctx: ClientContext):
    generic, personal = inputs(ctx)
    frozen = ctx.shared.gce

    def loss(trained, batch: Batch):
      out = forward(
        model, head.merge(trained['body'], trained['head']), batch, True
      )
      z = out.features.reshape((out.features.shape[0], -1))
      valve = trained['valve']
      z_p = conditional_valve(valve, z, personal)
      ce, stats = logits_loss(
        model,
        head.logits(trained['head'], z_p.reshape(out.features.shape)),
        batch,
      )
      z_g = conditional_valve(valve, z, generic)
      labels = jnp.clip(batch.y, 0, num_classes - 1)
      soft = gce_loss(z_g, trained['gce'], labels, batch.mask)
      diff = jnp.where(batch.mask[:, None], z_g - frozen[labels], 0)
      sq = jnp.sum(diff * diff)
      norm = jnp.where(sq > 0, jnp.sqrt(jnp.where(sq > 0, sq, 1.0)), 0.0)
      return ce + soft + lamda * norm, stats

    return loss

  def final(ctx: ClientContext, carry) -> GPFLOutput:
    trained = carry.params
    shares = label_shares(ctx.data.train, num_classes)
    generic, personal = conditional_inputs(trained['gce'], shares)
    return GPFLOutput(
      upload={
        'body': trained['body'],
        'gce': trained['gce'],
        'valve': trained['valve'],
      },
      row={
        'head': trained['head'],
        'generic': generic,
        'personal': personal,
        'last': jnp.asarray(ctx.shared.round, jnp.int32),
      },
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
      'body': ctx.shared.body,
      'head': ctx.state['head'],
      'gce': ctx.shared.gce,
      'valve': ctx.shared.valve,
    },
    trained_like=lambda p: {
      'body': head.split(p)[0],
      'head': head.split(p)[1],
      'gce': jnp.zeros((num_classes, dim), jnp.float32),
      'valve': init_valve(jax.random.key(0), dim),
    },
  )

  def server_update(
    state: GPFLState, cohort: Cohort, out: GPFLOutput, rc: RoundContext
  ):
    mean, weight = aggregation.upload_mean(out.upload)
    some = weight > 0
    active = cohort.mask & some
    return (
      dataclasses.replace(
        state,
        body=tree_where(some, mean['body'], state.body),
        gce=jnp.where(some, mean['gce'], state.gce),
        prev_gce=jnp.where(some, state.gce, state.prev_gce),
        valve=tree_where(some, mean['valve'], state.valve),
        rounds=rc.round + 1,
        rows=tree_scatter_where(state.rows, cohort.rows, out.row, active),
      ),
      cohort_train_metrics(out.stats, cohort.mask),
    )

  def client_models(state: GPFLState) -> ClientModels:
    n = leading_size(state.rows)
    return ClientModels.personal(
      {
        'body': tree_broadcast(state.body, n),
        'valve': tree_broadcast(state.valve, n),
        'prev_gce': tree_broadcast(state.prev_gce, n),
        'rounds': tree_broadcast(state.rounds, n),
        **state.rows,
      },
      num_clients,
    )

  def evaluate_client(parts, local: LocalData, test, key) -> LossStats:
    del key
    shares = label_shares(local.train, num_classes)
    _, personal = current_inputs(
      parts, parts['rounds'], parts['prev_gce'], shares
    )
    params = head.merge(parts['body'], parts['head'])
    _, z = model.and_features(model.apply)(params, test.x)
    flat = z.reshape((z.shape[0], -1))
    z_p = conditional_valve(parts['valve'], flat, personal).reshape(z.shape)
    logits = head.logits(parts['head'], z_p)
    mask = jnp.arange(test.x.shape[0]) < test.num_examples
    return per_example_stats(logits, test.y, mask)

  def communication(state: GPFLState) -> Communication:
    shared = (
      tree_bytes(state.body) + tree_bytes(state.gce) + tree_bytes(state.valve)
    )
    return Communication(shared, shared, 1)

  return FederatedAlgorithm(
    name='gpfl',
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
  config: GPFLConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """GPFL, built as ``AlgorithmSpec.build`` says; its settings
  ``GPFLConfig``."""
  return gpfl(
    model,
    data.num_clients,
    data.num_classes,
    training.make_client_optimizer(),
    training.batching(),
    config.lamda,
    config.mu,
  )


SPEC = AlgorithmSpec(
  'gpfl',
  GPFLConfig,
  build,
  CLIENT_OPTIMIZER | BATCHING,
  summary='GPFL (Zhang et al. 2023): a conditional valve makes personalized '
  'and generic features from global class embeddings',
)
