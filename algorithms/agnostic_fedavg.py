"""Agnostic Federated Averaging (Ro, Chen, Mathews, Mohri and Suresh,
"Communication-Efficient Agnostic Federated Averaging", arXiv:2104.02748;
the agnostic objective of Mohri, Sivek and Suresh, "Agnostic Federated
Learning", arXiv:1902.00146), as FedJAX builds it
(``fedjax.algorithms.agnostic_fed_avg``), compiled into one round.

The examples belong to D domains (``--agnostic_fedavg_domains``: each
client's known group, or each example's label). The server keeps domain
weights lambda (on the simplex) and a window of the last rounds' domain
counts. Each round, alpha = lambda / (the window's mean count per domain);
every client first measures its loss sum L_{i,d} and count n_{i,d} per
domain at the server model, then trains on

    sum_d alpha_d L_{i,d}(batch) / beta_i,   beta_i = sum_d alpha_d n_{i,d},

and uploads its delta, weighted by beta_i in the mean the server optimizer
takes. The domain weights take an exponentiated-gradient step on the mean
domain losses, lambda_d <- lambda_d exp(gamma sum_i L_{i,d} / sum_i
n_{i,d}) normalized ('eg'), or stay ('none'); the round's counts enter the
window. As FedJAX's, a batch's loss is its domain-weighted *sum* over
beta_i: with one batch of all a client's examples it is the mean. Where
FedJAX divides by zero (a domain absent from every round of the window:
alpha infinite, then NaN), its alpha here is 0, and a client with no
example of a weighted domain (beta_i = 0) trains on nothing and weighs 0.
"""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from optax import tree_utils as otu

from fedjax_personal.algorithms.fedavg import server_apply
from fedjax_personal.config import (
  BATCHING,
  CLIENT_OPTIMIZER,
  SERVER_OPTIMIZER,
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
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.losses import (
  Batch,
  LossStats,
  forward,
  per_example_stats,
)
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import (
  ClientContext,
  SGDCarry,
  sgd_client_work,
)
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import Model

__all__ = [
  'AFLState',
  'agnostic_fedavg',
  'AgnosticFedAvgConfig',
  'build',
  'domain_counts',
  'domain_sums',
  'DOMAINS',
  'SPEC',
  'update_domain_weights',
]

#: What an example's domain is: its client's known group, or its label.
DOMAINS = ('group', 'label')


@dataclasses.dataclass(frozen=True)
class AgnosticFedAvgConfig(Declared):
  """Agnostic FedAvg's own settings: the ``--agnostic_fedavg_*`` flags."""

  prefix: ClassVar[str] = 'agnostic_fedavg'
  domains: str = hparam(
    'group',
    "An example's domain: its client's known group (a partition with groups:"
    ' rotation, label_permutation, latent_clusters, sparse_classes) or its '
    'label.',
    choices=DOMAINS,
  )
  domain_lr: float = hparam(
    0.1,
    'gamma, the step of the domain weights on the mean domain losses.',
    minimum=0,
    sweep=True,
  )
  domain_algorithm: str = hparam(
    'eg',
    "The domain weights' update: exponentiated gradient, or none (fixed).",
    choices=('eg', 'none'),
  )
  window_size: int = hparam(
    1, 'Rounds of domain counts alpha divides by.', minimum=1
  )


@struct.dataclass
class AFLState:
  """Agnostic FedAvg's server state.

  Attributes:
    params: the global model.
    opt_state: the server optimizer's state.
    domain_weights: lambda [D].
    domain_window: the last rounds' domain counts [window, D], oldest first.
  """

  params: optax.Params
  opt_state: optax.OptState
  domain_weights: jax.Array
  domain_window: jax.Array


@struct.dataclass
class AFLBroadcast:
  """What every client receives: the model and alpha [D]."""

  params: optax.Params
  alpha: jax.Array


@struct.dataclass
class AFLOutput:
  """A client's upload to Agnostic FedAvg.

  A client's upload: its delta weighted by beta_i, and its domain loss
  sums and counts (summed over the cohort).

  Attributes:
    delta: ``weighted_upload(delta, beta_i)``.
    domain: ``Sum((L_i [D], n_i [D]))``.
    num_examples: n_i.
    stats: its local training's statistics.
  """

  delta: aggregation.Sum
  domain: aggregation.Sum
  num_examples: HostOrDevice
  stats: LossStats


def domain_sums(model: Model, logits, y, mask, domain, num_domains: int):
  """Loss sums and counts per domain of a batch's examples.

  Args:
    model: the model (its loss).
    logits: the batch's predictions.
    y: its targets.
    mask: [B] real examples.
    domain: int [B] each example's domain.
    num_domains: D.

  Returns:
    ``(loss sums [D], example counts [D])``.
  """

  def loss_sum(d):
    return per_example_stats(
      logits, y, mask & (domain == d), model.loss, model.unscored_targets
    ).loss_sum

  return jax.vmap(loss_sum)(jnp.arange(num_domains)), domain_counts(
    mask, domain, num_domains
  )


def domain_counts(mask, domain, num_domains: int):
  """Examples per domain (FedJAX's ``domain_num``: examples, not tokens).

  Args:
    mask: [B] real examples.
    domain: int [B] each example's domain.
    num_domains: D.

  Returns:
    float32 [D].
  """
  return jax.ops.segment_sum(
    mask.astype(jnp.float32), domain, num_segments=num_domains
  )


def update_domain_weights(weights, mean_loss, domain_lr, algorithm: str):
  """The domain weights' step (FedJAX's ``update_domain_weights``).

  Args:
    weights: lambda [D].
    mean_loss: the mean loss per domain [D].
    domain_lr: gamma.
    algorithm: 'eg' or 'none'.

  Returns:
    The new weights.
  """
  if algorithm == 'none':
    return weights
  new = jnp.maximum(weights * jnp.exp(domain_lr * mean_loss), 0.0)
  return new / jnp.sum(new)


def agnostic_fedavg(
  model: Model,
  num_clients: int,
  num_domains: int,
  client_domains,
  client_optimizer: optax.GradientTransformation,
  batching: Batching,
  server_optimizer=None,
  domain_lr: float = 0.1,
  domain_algorithm: str = 'eg',
  window_size: int = 1,
) -> FederatedAlgorithm:
  """Builds Agnostic FedAvg.

  Args:
    model: the model.
    num_clients: N.
    num_domains: D.
    client_domains: int [N], every example of client i in domain
      ``client_domains[i]`` (its known group); None: an example's domain is
      its label.
    client_optimizer: local optimizer.
    batching: local epochs / steps and batch size.
    server_optimizer: on the beta-weighted mean delta; default
      ``optax.sgd(1.0)``.
    domain_lr: gamma.
    domain_algorithm: 'eg' or 'none'.
    window_size: rounds of counts alpha divides by.

  Returns:
    The ``FederatedAlgorithm``.
  """
  server_optimizer = server_optimizer or optax.sgd(1.0)
  by_client = None if client_domains is None else jnp.asarray(client_domains)

  def domain_of(ctx: ClientContext, y):
    if by_client is None:
      return y.astype(jnp.int32)
    return jnp.full(y.shape[0], ctx.state, jnp.int32)

  def init(key: jax.Array) -> AFLState:
    params = model.init(key)
    return AFLState(
      params,
      server_optimizer.init(params),
      jnp.full(num_domains, 1.0 / num_domains),
      jnp.ones((window_size, num_domains)),
    )

  def server_broadcast(state: AFLState, cohort: Cohort, rc: RoundContext):
    # a domain the window never saw weighs 0 (FedJAX divides by 0: inf, and
    # NaN once a client without it multiplies its 0 count)
    seen = jnp.mean(state.domain_window, axis=0)
    alpha = jnp.where(
      seen > 0, state.domain_weights / jnp.where(seen > 0, seen, 1.0), 0.0
    )
    # each client's domain (its group) goes to it with the broadcast
    own = (
      cohort.mask
      if by_client is None
      else by_client.at[cohort.idx].get(mode='clip')
    )
    return AFLBroadcast(state.params, alpha), own

  def beta(ctx: ClientContext):
    # beta_i = sum_d alpha_d n_{i,d}: from the labels or the group, no
    # forward pass
    train = ctx.data.train
    mask = jnp.arange(train.y.shape[0]) < train.num_examples
    num = domain_counts(mask, domain_of(ctx, train.y), num_domains)
    return jnp.sum(ctx.shared.alpha * num)

  def objective_fn(ctx: ClientContext):
    b = beta(ctx)

    def objective(params, batch: Batch):
      out = forward(model, params, batch)
      loss, _ = domain_sums(
        model,
        out.logits,
        batch.y,
        batch.mask,
        domain_of(ctx, batch.y),
        num_domains,
      )
      stats = per_example_stats(
        out.logits, batch.y, batch.mask, model.loss, model.unscored_targets
      )
      # a client with no example in a weighted domain trains on nothing
      scaled = jnp.sum(ctx.shared.alpha * loss) / jnp.where(b > 0, b, 1.0)
      return jnp.where(b > 0, scaled, 0.0), stats

    return objective

  def final(ctx: ClientContext, carry: SGDCarry):
    train = ctx.data.train
    loss, num = domain_sums(
      model,
      model.apply(ctx.shared.params, train.x),
      train.y,
      jnp.arange(train.x.shape[0]) < train.num_examples,
      domain_of(ctx, train.y),
      num_domains,
    )
    b = jnp.sum(ctx.shared.alpha * num)
    return AFLOutput(
      delta=aggregation.weighted_upload(
        otu.tree_sub(ctx.shared.params, carry.params), b
      ),
      domain=aggregation.Sum((loss, num)),
      num_examples=ctx.data.train.num_examples,
      stats=carry.stats,
    )

  def server_update(
    state: AFLState, cohort: Cohort, out: AFLOutput, rc: RoundContext
  ):
    mean_delta, weight = aggregation.upload_mean(out.delta)
    params, opt_state = server_apply(
      state.params, state.opt_state, mean_delta, weight, server_optimizer
    )
    loss, num = out.domain.value
    mean_loss = jnp.where(num > 0, loss / jnp.where(num > 0, num, 1.0), 0.0)
    weights = update_domain_weights(
      state.domain_weights, mean_loss, domain_lr, domain_algorithm
    )
    window = jnp.concatenate([state.domain_window[1:], num[None]])
    return (
      AFLState(params, opt_state, weights, window),
      {
        **cohort_train_metrics(out.stats, cohort.mask),
        'max_domain_weight': jnp.max(weights),
      },
    )

  return FederatedAlgorithm(
    name='agnostic_fedavg',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=sgd_client_work(
      objective_fn,
      client_optimizer,
      batching,
      final,
      start_fn=lambda ctx: ctx.shared.params,
    ),
    server_update=server_update,
    client_models=lambda s: ClientModels.global_model(s.params, num_clients),
    # counted from what moves: the model and alpha down, the delta and the
    # domain sums up
    communication=None,
  )


def _one_label_per_example(model: Model, data) -> bool:
  """Whether the model gives one class prediction per example (logits
  [B, C]; a language model's are [B, T, C]), from shapes only."""
  if model.loss != 'cross_entropy':
    return False
  # a batch of one input: the population's sample, or client 0's first
  sample = getattr(data, 'sample_x', None)
  if sample is None:
    sample = data.train.x[0, :1]
  x = jax.ShapeDtypeStruct(np.shape(sample), np.asarray(sample).dtype)
  params = jax.eval_shape(model.init, jax.random.key(0))
  return len(jax.eval_shape(model.apply, params, x).shape) == 2


def build(
  training: TrainingConfig,
  config: AgnosticFedAvgConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """Agnostic FedAvg, built as ``AlgorithmSpec.build`` says: the domains
  are the data's known groups or its labels.

  Raises:
    ConfigError: group domains on data without groups; label domains on
      sequence targets.
  """
  client_domains = None
  num_domains = int(data.num_classes)
  if config.domains == 'group':
    groups = np.asarray(data.groups)
    if groups.size == 0 or groups.min() < 0:
      raise ConfigError(
        'agnostic_fedavg_domains',
        'group: this partition has no known groups (use --partition='
        'rotation, label_permutation, latent_clusters or sparse_classes, '
        'or --agnostic_fedavg_domains=label)',
      )
    client_domains, num_domains = groups, int(groups.max()) + 1
  elif not _one_label_per_example(model, data):
    raise ConfigError(
      'agnostic_fedavg_domains',
      'label: needs one class label per example (this data set has '
      'sequence or real-valued targets; use group)',
    )
  return agnostic_fedavg(
    model,
    data.num_clients,
    num_domains,
    client_domains,
    training.make_client_optimizer(),
    training.batching(),
    server_optimizer=training.make_server_optimizer(),
    domain_lr=config.domain_lr,
    domain_algorithm=config.domain_algorithm,
    window_size=config.window_size,
  )


SPEC = AlgorithmSpec(
  'agnostic_fedavg',
  AgnosticFedAvgConfig,
  build,
  CLIENT_OPTIMIZER | BATCHING | SERVER_OPTIMIZER,
  summary='Agnostic FedAvg (Ro et al. 2021): domain-weighted clients, '
  'domain weights by exponentiated gradient',
)
