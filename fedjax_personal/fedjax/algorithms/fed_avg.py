"""FedJAX's federated averaging (``fedjax.algorithms.fed_avg``; McMahan et
al., "Communication-Efficient Learning of Deep Networks from Decentralized
Data", arXiv:1602.05629) as FedJAX builds it: each client's SGD steps with
``client_optimizer`` on ``shuffle_repeat_batch`` batches through
``for_each_client`` (the current backend: ``for_each_client_backend('vmap')``
runs a round's clients stacked), the deltas' mean weighted by client size
applied by ``server_optimizer``. The native, compiled FedAvg of this
project is ``--algorithm=fedavg``."""

from typing import Any, Callable, Mapping, Sequence, Tuple

import jax
import jax.numpy as jnp

from fedjax_personal.fedjax.core import for_each_client, optimizers, tree_util
from fedjax_personal.fedjax.core.client_datasets import (
  ClientDataset,
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
  'create_train_for_each_client',
  'federated_averaging',
  'mean_delta',
  'mean_delta_apply',
  'ServerState',
]

Grads = Params


def create_train_for_each_client(grad_fn, client_optimizer):
  """``for_each_client`` of a client's SGD from the server's parameters: its
  delta (server params - client params).

  Args:
    grad_fn: ``(params, batch, key) -> gradients``.
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
    }

  def client_step(state, batch):
    rng, use_rng = jax.random.split(state['rng'])
    grads = grad_fn(state['params'], batch, use_rng)
    opt_state, params = client_optimizer.apply(
      grads, state['opt_state'], state['params']
    )
    return {'params': params, 'opt_state': opt_state, 'rng': rng}

  def client_final(server_params, state):
    return jax.tree.map(lambda a, b: a - b, server_params, state['params'])

  return for_each_client.for_each_client(client_init, client_step, client_final)


@dataclass
class ServerState:
  """The server's state between rounds.

  Attributes:
    params: the global model.
    opt_state: the server optimizer's state.
  """

  params: Params
  opt_state: OptState


def federated_averaging(
  grad_fn: Callable[[Params, BatchExample, PRNGKey], Grads],
  client_optimizer: optimizers.Optimizer,
  server_optimizer: optimizers.Optimizer,
  client_batch_hparams: ShuffleRepeatBatchHParams,
) -> FederatedAlgorithm:
  """FedJAX's federated averaging.

  Args:
    grad_fn: ``(params, batch, key) -> gradients`` (``fedjax.model_grad``).
    client_optimizer: the clients' optimizer.
    server_optimizer: the server's, on the mean delta.
    client_batch_hparams: the clients' batching.

  Returns:
    The ``FederatedAlgorithm``; ``apply``'s diagnostics: each client's
    ``delta_l2_norm``.
  """
  train = create_train_for_each_client(grad_fn, client_optimizer)

  def init(params: Params) -> ServerState:
    return ServerState(params, server_optimizer.init(params))

  return FederatedAlgorithm(
    init, mean_delta_apply(train, server_optimizer, client_batch_hparams)
  )


def mean_delta_apply(train, server_optimizer, client_batch_hparams):
  """FedJAX's round of FedAvg and FedProx: each client's delta from
  ``train`` (a ``for_each_client`` of (server params, client key)), their
  mean weighted by client size applied by ``server_optimizer``.

  Args:
    train: the clients' work, ``(server params, clients) -> (id, delta)``.
    server_optimizer: the server's optimizer.
    client_batch_hparams: the clients' batching.

  Returns:
    ``apply(server_state, clients) -> (server_state, diagnostics)``.
  """

  def apply(
    server_state: ServerState,
    clients: Sequence[Tuple[bytes, ClientDataset, PRNGKey]],
  ) -> Tuple[ServerState, Mapping[bytes, Any]]:
    delta, diagnostics = mean_delta(
      train, server_state.params, server_state.params, clients,
      client_batch_hparams,
    )  # fmt: skip
    opt_state, params = server_optimizer.apply(
      delta, server_state.opt_state, server_state.params
    )
    return ServerState(params, opt_state), diagnostics

  return apply


def mean_delta(train, shared_input, params, clients, hparams, clip_norm=None):
  """The clients' deltas (``train``) weighted by size, and each one's
  diagnostics (``delta_l2_norm``; with ``clip_norm``: each delta clipped to
  it first, ``clipped_delta_l2_norm`` and ``clipped``): the round of FedAvg,
  FedProx, Mime and Mime Lite.

  Args:
    train: the clients' work, ``(shared_input, clients) -> (id, delta)``.
    shared_input: what ``train`` shares with every client.
    params: the server's parameters (the deltas' shape).
    clients: ``(id, dataset, key)`` triples.
    hparams: the clients' batching.
    clip_norm: each delta's largest l2 norm, or None.

  Returns:
    ``(mean delta, {id: diagnostics})``.
  """
  sizes = {cid: len(cds) for cid, cds, _ in clients}
  batches = [
    (cid, cds.shuffle_repeat_batch(hparams), rng) for cid, cds, rng in clients
  ]
  total = tree_util.tree_zeros_like(params)
  weight, diagnostics = 0.0, {}
  for cid, delta in train(shared_input, batches):
    diagnostics[cid] = {'delta_l2_norm': tree_util.tree_l2_norm(delta)}
    if clip_norm is not None:
      delta = tree_util.tree_clip_by_global_norm(delta, clip_norm)
      clipped = tree_util.tree_l2_norm(delta)
      diagnostics[cid]['clipped_delta_l2_norm'] = clipped
      diagnostics[cid]['clipped'] = jnp.not_equal(
        diagnostics[cid]['delta_l2_norm'], clipped
      )
    total = tree_util.tree_add(total, tree_util.tree_weight(delta, sizes[cid]))
    weight += sizes[cid]
  return tree_util.tree_inverse_weight(total, weight), diagnostics
