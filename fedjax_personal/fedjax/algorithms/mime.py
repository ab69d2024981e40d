"""FedJAX's Mime (``fedjax.algorithms.mime``; Karimireddy et al., "Breaking
the centralized barrier for cross-device federated learning", arXiv:
2008.03606) as FedJAX builds it: the server's full-batch gradient c at the
round's start (the clients' padded batches, weighted by examples); each
client steps with the base optimizer's *server* state held fixed on g(w) -
g(w_server) + c (SVRG-style correction, both gradients on the same batch and
key); the server moves by server_learning_rate times the size-weighted mean
delta and updates the base optimizer's state with c."""

from typing import Any, Callable, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from fedjax_personal.fedjax.algorithms.fed_avg import mean_delta
from fedjax_personal.fedjax.core import (
  for_each_client,
  models,
  optimizers,
  tree_util,
)
from fedjax_personal.fedjax.core.client_datasets import (
  EXAMPLE_MASK_KEY,
  ClientDataset,
  PaddedBatchHParams,
  ShuffleRepeatBatchHParams,
)
from fedjax_personal.fedjax.core.dataclasses import dataclass
from fedjax_personal.fedjax.core.federated_algorithm import FederatedAlgorithm
from fedjax_personal.fedjax.core.typing import (
  BatchExample,
  OptState,
  Params,
  PRNGKey,
)

__all__ = [
  'create_grads_for_each_client',
  'create_train_for_each_client',
  'mime',
  'ServerState',
]

Clients = Sequence[Tuple[bytes, ClientDataset, PRNGKey]]
Regularizer = Callable[[Params], jax.Array]


@dataclass
class ServerState:
  """The server's state between rounds.

  Attributes:
    params: the global model.
    opt_state: the base optimizer's state (updated only by the server).
  """

  params: Params
  opt_state: OptState


def create_grads_for_each_client(grad_fn):
  """``for_each_client`` of a client's gradient over its padded batches at
  the server's parameters, each batch weighted by its real examples.

  Args:
    grad_fn: ``(params, batch, key) -> gradients`` (the mean over a batch's
      real examples).

  Returns:
    ``(server params, [(client id, padded batches, key)]) -> iterator of
    (client id, (sum_b n_b g_b, sum_b n_b))``.
  """

  def client_init(server_params, client_rng):
    return {
      'params': server_params,
      'rng': client_rng,
      'num_sum': 0.0,
      'grads_sum': jax.tree.map(jnp.zeros_like, server_params),
    }

  def client_step(state, batch):
    rng, use_rng = jax.random.split(state['rng'])
    grads = grad_fn(state['params'], batch, use_rng)
    num = jnp.sum(batch[EXAMPLE_MASK_KEY])
    return {
      'params': state['params'],
      'rng': rng,
      'num_sum': state['num_sum'] + num,
      'grads_sum': tree_util.tree_add(
        tree_util.tree_weight(grads, num), state['grads_sum']
      ),
    }

  def client_final(server_params, state):
    del server_params
    return state['grads_sum'], state['num_sum']

  return for_each_client.for_each_client(client_init, client_step, client_final)


def create_train_for_each_client(grad_fn, base_optimizer):
  """``for_each_client`` of Mime's client steps: g(w) - g(w_server) + c on
  each batch, stepped by the base optimizer with the server's state held
  fixed.

  Args:
    grad_fn: ``(params, batch, key) -> gradients``.
    base_optimizer: the client optimizer (its state the server's).

  Returns:
    ``(shared input {params, opt_state, control_variate}, [(client id, batches,
    client key)]) -> iterator of
    (client id, delta)``.
  """

  def client_init(shared_input, client_rng):
    return {
      'params': shared_input['params'],
      'opt_state': shared_input['opt_state'],
      'rng': client_rng,
      'init_params': shared_input['params'],
      'control_variate': shared_input['control_variate'],
    }

  def client_step(state, batch):
    rng, use_rng = jax.random.split(state['rng'])
    at_start = grad_fn(state['init_params'], batch, use_rng)
    grads = grad_fn(state['params'], batch, use_rng)
    adjusted = jax.tree.map(
      lambda g, cc, c: g - cc + c, grads, at_start, state['control_variate']
    )
    _, params = base_optimizer.apply(
      adjusted, state['opt_state'], state['params']
    )
    return {**state, 'params': params, 'rng': rng}

  def client_final(shared_input, state):
    return jax.tree.map(
      lambda a, b: a - b, shared_input['params'], state['params']
    )

  return for_each_client.for_each_client(client_init, client_step, client_final)


def server_gradient(grads_for_each_client, params, clients, hparams):
  """The round's full-batch gradient at ``params``: the clients' padded
  batches' gradients weighted by their real examples."""
  batches = [(cid, cds.padded_batch(hparams), rng) for cid, cds, rng in clients]
  total, num = tree_util.tree_sum(
    out for _, out in grads_for_each_client(params, batches)
  )
  return tree_util.tree_inverse_weight(total, num)


def server_update(
  base_optimizer, server_learning_rate, state, server_grads, delta
):
  """w - server_learning_rate * delta; the base optimizer's state updated
  with the server gradient at the old w."""
  params = jax.tree.map(
    lambda p, q: p - server_learning_rate * q, state.params, delta
  )
  opt_state, _ = base_optimizer.apply(
    server_grads, state.opt_state, state.params
  )
  return ServerState(params, opt_state)


def mime(
  per_example_loss: Callable[[Params, BatchExample, PRNGKey], jax.Array],
  base_optimizer: optimizers.Optimizer,
  client_batch_hparams: ShuffleRepeatBatchHParams,
  grads_batch_hparams: PaddedBatchHParams,
  server_learning_rate: float,
  regularizer: Optional[Regularizer] = None,
) -> FederatedAlgorithm:
  """FedJAX's Mime.

  Args:
    per_example_loss: ``(params, batch, key) -> per-example loss``.
    base_optimizer: the optimizer whose server state the clients use.
    client_batch_hparams: the clients' training batches.
    grads_batch_hparams: the batches of the server's full gradient.
    server_learning_rate: the server's step on the mean delta.
    regularizer: added to the mean loss.

  Returns:
    The ``FederatedAlgorithm``.
  """
  grad_fn = models.grad(per_example_loss, regularizer)
  grads_each = create_grads_for_each_client(grad_fn)
  train = create_train_for_each_client(grad_fn, base_optimizer)

  def init(params: Params) -> ServerState:
    return ServerState(params, base_optimizer.init(params))

  def apply(
    state: ServerState, clients: Clients
  ) -> Tuple[ServerState, Mapping[bytes, Any]]:
    grads = server_gradient(
      grads_each, state.params, clients, grads_batch_hparams
    )
    shared = {
      'params': state.params,
      'opt_state': state.opt_state,
      'control_variate': grads,
    }
    delta, diagnostics = mean_delta(
      train, shared, state.params, clients, client_batch_hparams
    )
    return server_update(
      base_optimizer, server_learning_rate, state, grads, delta
    ), diagnostics

  return FederatedAlgorithm(init, apply)
