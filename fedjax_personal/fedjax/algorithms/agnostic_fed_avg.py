"""FedJAX's AgnosticFedAvg (``fedjax.algorithms.agnostic_fed_avg``; Ro et
al., "Communication-Efficient Agnostic Federated Averaging",
arXiv:2104.02748) as FedJAX builds it. Each round: every client's loss and
example count per domain (``batch['domain_id']``) at the server's model on
its padded batches; alpha = the domain weights / the mean of the last
``domain_window_size`` rounds' domain counts; each client trains on
sum_d alpha_d (its domain-d loss sum) / beta, beta = sum_d alpha_d n_d (its
own count); the deltas' mean weighted by beta goes to the server optimizer;
the domain weights take an exponentiated-gradient step ('eg') on the mean
domain losses, or stay ('none')."""

from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from fedjax_personal.fedjax.algorithms.mime import Clients, Regularizer
from fedjax_personal.fedjax.core import for_each_client, optimizers, tree_util
from fedjax_personal.fedjax.core.client_datasets import (
  EXAMPLE_MASK_KEY,
  PaddedBatchHParams,
  ShuffleRepeatBatchHParams,
)
from fedjax_personal.fedjax.core.dataclasses import dataclass
from fedjax_personal.fedjax.core.federated_algorithm import FederatedAlgorithm
from fedjax_personal.fedjax.core.metrics import safe_div
from fedjax_personal.fedjax.core.typing import (
  BatchExample,
  OptState,
  Params,
  PRNGKey,
)

__all__ = [
  'agnostic_federated_averaging',
  'create_domain_metrics_for_each_client',
  'create_scaled_loss',
  'create_train_for_each_client',
  'ServerState',
  'update_domain_weights',
]

PerExampleLoss = Callable[[Params, BatchExample, PRNGKey], jax.Array]


def create_domain_metrics_for_each_client(
  per_example_loss: PerExampleLoss,
  num_domains: int,
  regularizer: Optional[Regularizer] = None,
):
  """``for_each_client`` of a client's loss sum and example count per
  domain over its padded batches.

  Args:
    per_example_loss: ``(params, batch, key) -> loss per example``.
    num_domains: D.
    regularizer: added to every domain's loss once a batch, or None.

  Returns:
    ``({params, alpha}, [(id, padded batches, key)]) -> iterator of (id,
    {domain_loss [D], domain_num [D], beta})``.
  """

  def client_init(shared_input, client_rng):
    return {
      'params': shared_input['params'],
      'rng': client_rng,
      'domain_loss': jnp.zeros(num_domains),
      'domain_num': jnp.zeros(num_domains),
    }

  def client_step(state, batch):
    rng, use_rng = jax.random.split(state['rng'])
    mask = batch[EXAMPLE_MASK_KEY]
    loss = per_example_loss(state['params'], batch, use_rng) * mask
    domain_loss = jax.ops.segment_sum(loss, batch['domain_id'], num_domains)
    if regularizer is not None:
      domain_loss += regularizer(state['params'])
    domain_num = jax.ops.segment_sum(
      mask.astype(jnp.float32), batch['domain_id'], num_domains
    )
    return {
      'params': state['params'],
      'rng': rng,
      'domain_loss': state['domain_loss'] + domain_loss,
      'domain_num': state['domain_num'] + domain_num,
    }

  def client_final(shared_input, state):
    return {
      'domain_loss': state['domain_loss'],
      'domain_num': state['domain_num'],
      'beta': jnp.sum(shared_input['alpha'] * state['domain_num']),
    }

  return for_each_client.for_each_client(client_init, client_step, client_final)


def create_scaled_loss(
  per_example_loss: PerExampleLoss,
  num_domains: int,
  regularizer: Optional[Regularizer] = None,
):
  """A client's AgnosticFedAvg loss.

  Args:
    per_example_loss: ``(params, batch, key) -> loss per example``.
    num_domains: D.
    regularizer: added to the loss, or None.

  Returns:
    ``(params, batch, key, alpha, beta) -> sum_d alpha_d L_d / beta``.
  """

  def scaled_loss(params, batch, rng, alpha, beta):
    per_domain = jax.ops.segment_sum(
      per_example_loss(params, batch, rng), batch['domain_id'], num_domains
    )
    loss = jnp.sum(alpha * per_domain) / beta
    return loss if regularizer is None else loss + regularizer(params)

  return scaled_loss


def create_train_for_each_client(
  per_example_loss: PerExampleLoss,
  client_optimizer: optimizers.Optimizer,
  num_domains: int,
  regularizer: Optional[Regularizer] = None,
):
  """``for_each_client`` of a client's steps on the scaled loss.

  Args:
    per_example_loss: ``(params, batch, key) -> loss per example``.
    client_optimizer: the clients' optimizer.
    num_domains: D.
    regularizer: added to the loss, or None.

  Returns:
    ``({params, alpha}, [(id, batches, {rng, beta})]) -> iterator of (id,
    delta)``.
  """
  grad_fn = jax.grad(
    create_scaled_loss(per_example_loss, num_domains, regularizer)
  )

  def client_init(shared_input, client_input):
    return {
      'params': shared_input['params'],
      'alpha': shared_input['alpha'],
      'opt_state': client_optimizer.init(shared_input['params']),
      'rng': client_input['rng'],
      'beta': client_input['beta'],
    }

  def client_step(state, batch):
    rng, use_rng = jax.random.split(state['rng'])
    grads = grad_fn(
      state['params'], batch, use_rng, state['alpha'], state['beta']
    )
    opt_state, params = client_optimizer.apply(
      grads, state['opt_state'], state['params']
    )
    return {**state, 'params': params, 'opt_state': opt_state, 'rng': rng}

  def client_final(shared_input, state):
    return jax.tree.map(
      lambda a, b: a - b, shared_input['params'], state['params']
    )

  return for_each_client.for_each_client(client_init, client_step, client_final)


def update_domain_weights(
  domain_weights: jax.Array,
  domain_loss: jax.Array,
  domain_learning_rate: float,
  domain_algorithm: str,
) -> jax.Array:
  """The domain weights' update.

  Args:
    domain_weights: lambda [D].
    domain_loss: the mean loss per domain [D].
    domain_learning_rate: gamma.
    domain_algorithm: 'eg' (lambda exp(gamma L), normalized) or 'none'.

  Returns:
    The new weights.
  """
  if domain_algorithm == 'eg':
    new = domain_weights * jnp.exp(domain_learning_rate * domain_loss)
    new = jnp.maximum(new, jnp.zeros_like(new))
    return new / jnp.sum(new)
  if domain_algorithm == 'none':
    return domain_weights
  raise ValueError(f'Unsupported domain algorithm {domain_algorithm!r}.')


@dataclass
class ServerState:
  """AgnosticFedAvg's server state.

  Attributes:
    params: the global model.
    opt_state: the server optimizer's state.
    domain_weights: lambda [D].
    domain_window: the last rounds' domain counts, oldest first.
  """

  params: Params
  opt_state: OptState
  domain_weights: jax.Array
  domain_window: List[jax.Array]


def agnostic_federated_averaging(
  per_example_loss: PerExampleLoss,
  client_optimizer: optimizers.Optimizer,
  server_optimizer: optimizers.Optimizer,
  client_batch_hparams: ShuffleRepeatBatchHParams,
  domain_batch_hparams: PaddedBatchHParams,
  init_domain_weights: Sequence[float],
  domain_learning_rate: float,
  domain_algorithm: str = 'eg',
  domain_window_size: int = 1,
  init_domain_window: Optional[Sequence[float]] = None,
  regularizer: Optional[Regularizer] = None,
) -> FederatedAlgorithm:
  """FedJAX's AgnosticFedAvg.

  Args:
    per_example_loss: ``(params, batch, key) -> loss per example``.
    client_optimizer: the clients' optimizer.
    server_optimizer: the server's, on the beta-weighted mean delta.
    client_batch_hparams: the clients' training batches.
    domain_batch_hparams: the batches of the domain losses.
    init_domain_weights: lambda at the start (summing to 1).
    domain_learning_rate: gamma.
    domain_algorithm: 'eg' or 'none'.
    domain_window_size: rounds of domain counts alpha divides by.
    init_domain_window: the window's first counts (default ones).
    regularizer: added to the clients' loss, or None.

  Returns:
    The ``FederatedAlgorithm``.
  """
  if abs(sum(init_domain_weights) - 1) > 1e-6:
    raise ValueError('init_domain_weights must sum to approximately 1.')
  window = (
    [1.0] * len(init_domain_weights)
    if init_domain_window is None
    else list(init_domain_window)
  )
  if len(init_domain_weights) != len(window):
    raise ValueError(
      'init_domain_weights and init_domain_window must be equal lengths. '
      f'{len(init_domain_weights)} != {len(window)}'
    )
  num_domains = len(init_domain_weights)
  metrics_each = create_domain_metrics_for_each_client(
    per_example_loss, num_domains
  )
  train = create_train_for_each_client(
    per_example_loss, client_optimizer, num_domains, regularizer
  )

  def init(params: Params) -> ServerState:
    return ServerState(
      params,
      server_optimizer.init(params),
      jnp.array(init_domain_weights),
      [jnp.array(window)] * domain_window_size,
    )

  def apply(
    state: ServerState, clients: Clients
  ) -> Tuple[ServerState, Mapping[bytes, Any]]:
    alpha = state.domain_weights / jnp.mean(
      jnp.asarray(state.domain_window), axis=0
    )
    shared = {'params': state.params, 'alpha': alpha}
    domain = dict(
      metrics_each(
        shared,
        [
          (cid, cds.padded_batch(domain_batch_hparams), rng)
          for cid, cds, rng in clients
        ],
      )
    )
    batches = [
      (
        cid,
        cds.shuffle_repeat_batch(client_batch_hparams),
        {'rng': rng, 'beta': domain[cid]['beta']},
      )
      for cid, cds, rng in clients
    ]
    total = tree_util.tree_zeros_like(state.params)
    weight, diagnostics = 0.0, {}
    for cid, delta in train(shared, batches):
      beta = domain[cid]['beta']
      total = tree_util.tree_add(total, tree_util.tree_weight(delta, beta))
      weight += beta
      diagnostics[cid] = {'delta_l2_norm': tree_util.tree_l2_norm(delta)}
    mean = tree_util.tree_inverse_weight(total, weight)
    loss = tree_util.tree_sum(d['domain_loss'] for d in domain.values())
    num = tree_util.tree_sum(d['domain_num'] for d in domain.values())
    opt_state, params = server_optimizer.apply(
      mean, state.opt_state, state.params
    )
    weights = update_domain_weights(
      state.domain_weights,
      safe_div(loss, num),
      domain_learning_rate,
      domain_algorithm,
    )
    return ServerState(
      params, opt_state, weights, state.domain_window[1:] + [num]
    ), diagnostics

  return FederatedAlgorithm(init, apply)
