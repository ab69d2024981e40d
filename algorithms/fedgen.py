"""FedGen (Zhu, Hong and Zhou, "Data-Free Knowledge Distillation for
Heterogeneous Federated Learning", ICML 2021, arXiv:2105.10056), as PFLlib
runs it (``servergen.py`` / ``clientgen.py``), compiled into one round.

A generator G(y, eps) maps a label and uniform noise eps in [0, 1)^noise to
the model's feature space (PFLlib's ``Generative``: Dense, BatchNorm on the
batch, ReLU, Dense). Each local step adds to the client's cross-entropy the
cross-entropy of its head on G's features for ``batch`` labels drawn in
proportion to the population's label counts (PFLlib's ``qualified_labels``,
counted once before training), G fixed. The server averages the models
(FedAvg) and, before that, trains G for ``server_epochs`` Adam steps so
that the round's uploaded heads, weighted by examples, classify G(y, eps)
as y. Their weighted sum of logits is the logits of their weighted mean
head, the head being linear in its parameters (PFLlib's ``fc``): a model
whose head is not one dense layer is refused.

PFLlib's generator is trained on the models the round uploaded and sent
with the next round's model; so here. The population's label counts are
summed in the first compiled round (a pre-round phase over every client).
PFLlib keeps the generator in training mode throughout (its batch norm
normalizes by each batch of labels): so here. PFLlib initializes the
generator's layers as PyTorch's ``Linear`` (uniform in 1/sqrt(fan_in)) and
its batch norm to scale 1, bias 0: so here.
"""

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import struct
from optax import tree_utils as otu

from fedjax_personal.algorithms.fedavg import (
  FEDAVG_SETTINGS,
  ServerState,
  make_client_work,
  server_apply,
  summed_upload,
)
from fedjax_personal.config import (
  AlgorithmSpec,
  BuildData,
  Declared,
  TrainingConfig,
  hparam,
)
from fedjax_personal.core import aggregation
from fedjax_personal.core.algorithm import (
  ClientModels,
  FederatedAlgorithm,
  PreRound,
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.data import LocalData, label_counts
from fedjax_personal.core.losses import Batch, batch_loss
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import ClientContext
from fedjax_personal.core.tree_util import PyTree, tree_where
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import Model

__all__ = [
  'build',
  'draw_labels',
  'draw_noise',
  'fedgen',
  'FedGenConfig',
  'FedGenState',
  'Generator',
  'SPEC',
]

#: fold_in constant of the generator's draws (labels and noise) in a key.
GENERATOR_DRAWS = 0x6E6


@dataclasses.dataclass(frozen=True)
class FedGenConfig(Declared):
  """FedGen's own settings: the ``--fedgen_*`` flags (PFLlib's defaults)."""

  prefix: ClassVar[str] = 'fedgen'
  noise_dim: int = hparam(512, "The generator's noise size.", minimum=1)
  hidden_dim: int = hparam(512, "The generator's hidden layer.", minimum=1)
  generator_lr: float = hparam(
    0.005, "The generator's Adam step.", minimum=0, open_min=True, sweep=True
  )
  server_epochs: int = hparam(
    1000, "The generator's Adam steps each round.", minimum=0
  )
  batch_size: Optional[int] = hparam(
    None,
    'Labels drawn per generator batch (unset: the client batch size, '
    "PFLlib's).",
    minimum=1,
  )


class Generator(nn.Module):
  """FedGen's generator: features from noise and a label.

  PFLlib's ``Generative``: [noise, one-hot label] -> Dense(hidden),
  BatchNorm (batch statistics), ReLU -> Dense(features); PyTorch's
  ``Linear`` initialization."""

  noise_dim: int
  num_classes: int
  hidden_dim: int
  features: int

  @nn.compact
  def __call__(self, labels, eps):
    z = jnp.concatenate(
      [eps, jax.nn.one_hot(labels, self.num_classes, dtype=eps.dtype)], -1
    )
    h = _torch_dense(self.hidden_dim, self.noise_dim + self.num_classes)(z)
    h = nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=1e-5)(h)
    return _torch_dense(self.features, self.hidden_dim)(nn.relu(h))


def _torch_dense(features: int, fan_in: int) -> nn.Dense:
  """A Dense layer initialized as PyTorch's ``Linear``: kernel and bias
  uniform in +-1/sqrt(fan_in)."""
  bound = fan_in**-0.5

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return nn.Dense(features, kernel_init=init, bias_init=init)


def _linear_in_parameters(model: Model) -> bool:
  """Whether the model's head h(z; p) is linear in p (a dense layer: z W +
  b), checked on random parameters and features: the weighted sum of heads'
  logits is then the logits of the weighted mean head."""
  head = model.require_head('FedGen')
  # the head's shapes only: no initialization of the whole model
  _, p = head.split(jax.eval_shape(model.init, jax.random.key(0)))
  k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
  leaves, tree = jax.tree.flatten(p)

  def draw(key):
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(
      tree,
      [jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves)],
    )

  p1, p2 = draw(k1), draw(k2)
  z = jax.random.normal(k3, (3,) + tuple(head.feature_shape))
  both = head.logits(jax.tree.map(lambda a, b: 0.3 * a + 0.7 * b, p1, p2), z)
  apart = 0.3 * head.logits(p1, z) + 0.7 * head.logits(p2, z)
  return bool(jnp.allclose(both, apart, rtol=1e-4, atol=1e-4))


def draw_labels(key: jax.Array, counts: jax.Array, n: int) -> jax.Array:
  """``n`` labels drawn with replacement in proportion to ``counts``
  (PFLlib's ``np.random.choice(qualified_labels, batch_size)``).

  Args:
    key: the draws' key.
    counts: the population's examples per class [C].
    n: how many.

  Returns:
    int32 [n].
  """
  return jax.random.choice(
    key, counts.shape[0], (n,), p=counts / jnp.maximum(jnp.sum(counts), 1.0)
  ).astype(jnp.int32)


def draw_noise(key: jax.Array, n: int, dim: int) -> jax.Array:
  """The generator's noise: uniform in [0, 1) (PFLlib's ``torch.rand``).

  Args:
    key: the draws' key.
    n: rows.
    dim: noise size.

  Returns:
    float32 [n, dim].
  """
  return jax.random.uniform(key, (n, dim))


@struct.dataclass
class FedGenState:
  """FedGen's state.

  Attributes:
    server: FedAvg's (the global model and the server optimizer's state).
    generator: the generator's variables (params and batch statistics).
    generator_opt_state: its Adam state.
    counts: the population's examples per class [C] (summed before the
      first round's training).
  """

  server: ServerState
  generator: PyTree
  generator_opt_state: optax.OptState
  counts: jax.Array


@struct.dataclass
class Broadcast:
  """What every client receives: the model, the generator, the counts."""

  params: optax.Params
  generator: PyTree
  counts: jax.Array


def fedgen(
  model: Model,
  num_clients: int,
  num_classes: int,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  draws: int,
  noise_dim: int = 512,
  hidden_dim: int = 512,
  generator_lr: float = 0.005,
  server_epochs: int = 1000,
  server_optimizer: Optional[optax.GradientTransformation] = None,
  weighting: str = 'num_examples',
) -> FederatedAlgorithm:
  """Builds FedGen.

  Args:
    model: the model (its head one dense layer).
    num_clients: N.
    num_classes: C.
    client_optimizer: local optimizer.
    batching: local epochs / steps and batch size.
    draws: labels per generator batch (client steps and server steps).
    noise_dim: the generator's noise size.
    hidden_dim: its hidden layer.
    generator_lr: its Adam step.
    server_epochs: its Adam steps each round.
    server_optimizer: FedAvg's; default ``optax.sgd(1.0)``.
    weighting: the means' weights.

  Returns:
    The ``FederatedAlgorithm``.

  Raises:
    ConfigError: a model whose head is not one dense layer.
  """
  head = model.require_head('FedGen')
  if len(head.feature_shape) != 1 or not _linear_in_parameters(model):
    raise ConfigError(
      'model',
      "FedGen trains its generator on the weighted mean of the clients' "
      'heads, which needs a head linear in its parameters on flat features '
      f'(one dense layer); {model.name!r} has {type(head.module).__name__} '
      f'on {head.feature_shape}',
    )
  server_optimizer = server_optimizer or optax.sgd(1.0)
  generator = Generator(
    noise_dim, num_classes, hidden_dim, head.feature_shape[0]
  )
  generator_optimizer = optax.adam(generator_lr, b1=0.9, b2=0.999, eps=1e-8)

  def generate(variables, drawn):
    """``(labels, G's features)`` of drawn ``(labels, noise)``; batch norm
    on the batch (its running statistics discarded)."""
    labels, eps = drawn
    out, _ = generator.apply(variables, labels, eps, mutable=['batch_stats'])
    return labels, out

  def draws_of(key, counts):
    k_labels, k_noise = jax.random.split(
      jax.random.fold_in(key, GENERATOR_DRAWS)
    )
    return draw_labels(k_labels, counts, draws), draw_noise(
      k_noise, draws, noise_dim
    )

  def init(key: jax.Array) -> FedGenState:
    k_model, k_gen = jax.random.split(key)
    params = model.init(k_model)
    variables = generator.init(
      k_gen, jnp.zeros(draws, jnp.int32), jnp.zeros((draws, noise_dim))
    )
    return FedGenState(
      ServerState(params, server_optimizer.init(params)),
      variables,
      generator_optimizer.init(variables['params']),
      jnp.zeros(num_classes, jnp.float32),
    )

  def objective_fn(ctx: ClientContext):
    shared = ctx.shared

    def objective(params, batch: Batch):
      loss, stats = batch_loss(model, params, batch)
      labels, z = generate(shared.generator, draws_of(batch.key, shared.counts))
      logits = head.logits(head.split(params)[1], jax.lax.stop_gradient(z))
      distill = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
      return loss + jnp.mean(distill), stats

    return objective

  def server_broadcast(state: FedGenState, cohort: Cohort, rc: RoundContext):
    return Broadcast(
      state.server.params, state.generator, state.counts
    ), cohort.mask

  def train_generator(variables, opt_state, mean_head, counts, key):
    """``server_epochs`` Adam steps of G against the mean head."""

    def step(carry, k):
      params, opt_state = carry
      batch = draws_of(k, counts)

      def loss(p):
        labels, z = generate({**variables, 'params': p}, batch)
        return jnp.mean(
          optax.softmax_cross_entropy_with_integer_labels(
            head.logits(mean_head, z), labels
          )
        )

      updates, opt_state = generator_optimizer.update(
        jax.grad(loss)(params), opt_state, params
      )
      return (optax.apply_updates(params, updates), opt_state), None

    (params, opt_state), _ = jax.lax.scan(
      step,
      (variables['params'], opt_state),
      jax.random.split(key, server_epochs),
    )
    return {**variables, 'params': params}, opt_state

  def server_update(state: FedGenState, cohort: Cohort, out, rc: RoundContext):
    mean_delta, weight = aggregation.upload_mean(out.delta)
    mean_head = head.split(otu.tree_sub(state.server.params, mean_delta))[1]
    variables, gen_opt = train_generator(
      state.generator,
      state.generator_opt_state,
      mean_head,
      state.counts,
      jax.random.fold_in(rc.key, GENERATOR_DRAWS),
    )
    any_client = weight > 0
    params, opt_state = server_apply(
      state.server.params,
      state.server.opt_state,
      mean_delta,
      weight,
      server_optimizer,
    )
    return (
      FedGenState(
        ServerState(params, opt_state),
        tree_where(any_client, variables, state.generator),
        tree_where(any_client, gen_opt, state.generator_opt_state),
        state.counts,
      ),
      cohort_train_metrics(out.stats, cohort.mask),
    )

  def count_update(state: FedGenState, outputs, rc: RoundContext):
    del rc
    return dataclasses.replace(state, counts=jnp.sum(outputs, axis=0)), {}

  def client_counts(shared, data: LocalData, key):
    del shared, key
    return label_counts(data.train, num_classes)

  return FederatedAlgorithm(
    name='fedgen',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=summed_upload(
      make_client_work(
        model,
        client_optimizer,
        batching,
        objective_fn=objective_fn,
        start_fn=lambda ctx: ctx.shared.params,
      ),
      weighting,
    ),
    server_update=server_update,
    client_models=lambda s: ClientModels.global_model(
      s.server.params, num_clients
    ),
    pre_round=PreRound(
      due=lambda t: t == 0, update=count_update, client=client_counts
    ),
    # counted from what moves: the model, the generator and the counts
    # down, the delta up
    communication=None,
  )


def build(
  training: TrainingConfig,
  config: FedGenConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedGen, built as ``AlgorithmSpec.build`` says; its settings
  ``FedGenConfig``.

  Raises:
    ConfigError: no batch size for the generator's draws.
  """
  draws = config.batch_size or training.batching().batch_size
  if draws is None:
    raise ConfigError(
      'fedgen_batch_size',
      'full-batch local steps give no batch size for the generator: set it',
    )
  return fedgen(
    model,
    data.num_clients,
    data.num_classes,
    training.make_client_optimizer(),
    training.batching(),
    draws,
    noise_dim=config.noise_dim,
    hidden_dim=config.hidden_dim,
    generator_lr=config.generator_lr,
    server_epochs=config.server_epochs,
    server_optimizer=training.make_server_optimizer(),
    weighting=training.filled_weighting(),
  )


SPEC = AlgorithmSpec(
  'fedgen',
  FedGenConfig,
  build,
  FEDAVG_SETTINGS,
  summary='FedGen (Zhu et al. 2021): a server-trained generator of features '
  'distilled into the clients',
)
