"""FedJAX's Mime Lite (``fedjax.algorithms.mime_lite``; Karimireddy et al.,
arXiv:2008.03606) as FedJAX builds it: Mime without the control variate.
Each client steps with the base optimizer's server state held fixed on its
own gradients; the server moves by server_learning_rate times the
size-weighted mean delta (each delta first clipped to
``client_delta_clip_norm`` when given), then updates the base optimizer's
state with the full-batch gradient at the round's start."""

from typing import Any, Callable, Mapping, Optional, Tuple

import jax

from fedjax_personal.fedjax.algorithms.fed_avg import mean_delta
from fedjax_personal.fedjax.algorithms.mime import (
  Clients,
  Regularizer,
  ServerState,
  create_grads_for_each_client,
  server_gradient,
  server_update,
)
from fedjax_personal.fedjax.core import for_each_client, models, optimizers
from fedjax_personal.fedjax.core.client_datasets import (
  PaddedBatchHParams,
  ShuffleRepeatBatchHParams,
)
from fedjax_personal.fedjax.core.federated_algorithm import FederatedAlgorithm
from fedjax_personal.fedjax.core.typing import BatchExample, Params, PRNGKey

__all__ = ['create_train_for_each_client', 'mime_lite']


def create_train_for_each_client(grad_fn, base_optimizer):
  """``for_each_client`` of Mime Lite's client steps: its own gradients,
  stepped by the base optimizer with the server's state held fixed.

  Args:
    grad_fn: ``(params, batch, key) -> gradients``.
    base_optimizer: the client optimizer (its state the server's).

  Returns:
    ``(shared input {params, opt_state}, [(client id, batches, client key)]) ->
    iterator of
    (client id, delta)``.
  """

  def client_init(shared_input, client_rng):
    return {
      'params': shared_input['params'],
      'opt_state': shared_input['opt_state'],
      'rng': client_rng,
    }

  def client_step(state, batch):
    rng, use_rng = jax.random.split(state['rng'])
    grads = grad_fn(state['params'], batch, use_rng)
    _, params = base_optimizer.apply(grads, state['opt_state'], state['params'])
    return {'params': params, 'opt_state': state['opt_state'], 'rng': rng}

  def client_final(shared_input, state):
    return jax.tree.map(
      lambda a, b: a - b, shared_input['params'], state['params']
    )

  return for_each_client.for_each_client(client_init, client_step, client_final)


def mime_lite(
  per_example_loss: Callable[[Params, BatchExample, PRNGKey], jax.Array],
  base_optimizer: optimizers.Optimizer,
  client_batch_hparams: ShuffleRepeatBatchHParams,
  grads_batch_hparams: PaddedBatchHParams,
  server_learning_rate: float,
  regularizer: Optional[Regularizer] = None,
  client_delta_clip_norm: Optional[float] = None,
) -> FederatedAlgorithm:
  """FedJAX's Mime Lite.

  Args:
    per_example_loss: ``(params, batch, key) -> per-example loss``.
    base_optimizer: the optimizer whose server state the clients use.
    client_batch_hparams: the clients' training batches.
    grads_batch_hparams: the batches of the server's full gradient.
    server_learning_rate: the server's step on the mean delta.
    regularizer: added to the mean loss.
    client_delta_clip_norm: each delta's largest l2 norm, or None.

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
    shared = {'params': state.params, 'opt_state': state.opt_state}
    delta, diagnostics = mean_delta(
      train,
      shared,
      state.params,
      clients,
      client_batch_hparams,
      client_delta_clip_norm,
    )
    grads = server_gradient(
      grads_each, state.params, clients, grads_batch_hparams
    )
    return server_update(
      base_optimizer, server_learning_rate, state, grads, delta
    ), diagnostics

  return FederatedAlgorithm(init, apply)
