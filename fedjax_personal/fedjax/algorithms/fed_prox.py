"""FedJAX's FedProx (``fedjax.algorithms.fed_prox``; Li et al., "Federated
Optimization in Heterogeneous Networks", arXiv:1812.06127) as FedJAX builds
it: FedAvg's round with each client's loss mean(l_i + mu/2 ||w_server -
w||^2) (FedJAX adds the proximal term to every example's loss before the
mean: the same value). The native FedProx is ``--algorithm=fedprox``."""

from typing import Callable

import jax
import jax.numpy as jnp

from fedjax_personal.fedjax.algorithms.fed_avg import (
  ServerState,
  mean_delta_apply,
)
from fedjax_personal.fedjax.core import for_each_client, optimizers, tree_util
from fedjax_personal.fedjax.core.client_datasets import (
  ShuffleRepeatBatchHParams,
)
from fedjax_personal.fedjax.core.federated_algorithm import FederatedAlgorithm
from fedjax_personal.fedjax.core.typing import BatchExample, Params, PRNGKey

__all__ = ['create_train_for_each_client', 'fed_prox', 'ServerState']


def create_train_for_each_client(grad_fn, client_optimizer):
  """``for_each_client`` of a client's SGD on the proximal loss: its delta.

  Args:
    grad_fn: ``(params, server params, batch, key) -> gradients``.
    client_optimizer: the client optimizer (state fresh each round).

  Returns:
    ``(shared input, [(client id, batches, client key)]) -> iterator of
    (client id, delta)``.
  """

  def client_init(server_params, client_rng):
    return {
      'params': server_params,
      'opt_state': client_optimizer.init(server_params),
      'rng': client_rng,
      'server_params': server_params,
    }

  def client_step(state, batch):
    rng, use_rng = jax.random.split(state['rng'])
    grads = grad_fn(state['params'], state['server_params'], batch, use_rng)
    opt_state, params = client_optimizer.apply(
      grads, state['opt_state'], state['params']
    )
    return {**state, 'params': params, 'opt_state': opt_state, 'rng': rng}

  def client_final(server_params, state):
    return jax.tree.map(lambda a, b: a - b, server_params, state['params'])

  return for_each_client.for_each_client(client_init, client_step, client_final)


def fed_prox(
  per_example_loss: Callable[[Params, BatchExample, PRNGKey], jax.Array],
  client_optimizer: optimizers.Optimizer,
  server_optimizer: optimizers.Optimizer,
  client_batch_hparams: ShuffleRepeatBatchHParams,
  proximal_weight: float,
) -> FederatedAlgorithm:
  """FedJAX's FedProx.

  Args:
    per_example_loss: ``(params, batch, key) -> per-example loss``.
    client_optimizer: the clients' optimizer.
    server_optimizer: the server's, on the mean delta.
    client_batch_hparams: the clients' batching.
    proximal_weight: mu (0 is FedAvg).

  Returns:
    The ``FederatedAlgorithm``.
  """

  def loss(params, server_params, batch, rng):
    proximal = (
      0.5
      * proximal_weight
      * tree_util.tree_l2_squared(
        jax.tree.map(lambda a, b: a - b, server_params, params)
      )
    )
    return jnp.mean(per_example_loss(params, batch, rng) + proximal)

  train = create_train_for_each_client(jax.grad(loss), client_optimizer)

  def init(params: Params) -> ServerState:
    return ServerState(params, server_optimizer.init(params))

  return FederatedAlgorithm(
    init, mean_delta_apply(train, server_optimizer, client_batch_hparams)
  )
