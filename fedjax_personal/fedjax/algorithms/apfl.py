"""FedJAX's APFL (``fedjax.algorithms.apfl``; Deng et al., "Adaptive
Personalized Federated Learning", arXiv:2003.13461) as FedJAX builds it: a
client keeps its own model v and per-leaf mixing coefficients alpha; each
step updates the server model's copy w on its own gradient, v on the
gradient at the mixture alpha v + (1 - alpha) w, and alpha on
<v - w, that gradient> (clipped to [0, 1]), all with the client optimizer;
the server applies the size-weighted mean of the w deltas. As FedJAX's,
``apply`` writes the clients' states into ``server_state.client_states``
(a dict, updated in place). The native APFL is ``--algorithm=apfl``."""

from typing import Any, Callable, Mapping, Sequence, Tuple

import jax
import jax.numpy as jnp

from fedjax_personal.fedjax.algorithms.mime import Clients
from fedjax_personal.fedjax.core import (
  for_each_client,
  models,
  optimizers,
  tree_util,
)
from fedjax_personal.fedjax.core.client_datasets import (
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
  'adaptive_personalized_federated_learning',
  'ClientState',
  'create_eval_for_each_client',
  'create_train_for_each_client',
  'eval_adaptive_personalized_federated_learning',
  'interpolate_params',
  'interpolation_grad_fn',
  'ServerState',
]


@dataclass
class ClientState:
  """A client's own model and mixing coefficients.

  Attributes:
    params: v.
    interpolation_coefficients: alpha, one per leaf.
  """

  params: Params
  interpolation_coefficients: Params


@dataclass
class ServerState:
  """APFL's server state.

  Attributes:
    params: w.
    opt_state: the server optimizer's state.
    client_states: client id -> ``ClientState``.
  """

  params: Params
  opt_state: OptState
  client_states: Mapping[bytes, ClientState]


@jax.jit
def interpolate_params(
  interpolation_coefficients, client_params, server_params
):
  """alpha v + (1 - alpha) w, leaf by leaf.

  Args:
    interpolation_coefficients: alpha.
    client_params: v.
    server_params: w.

  Returns:
    The mixture.
  """
  return jax.tree.map(
    lambda a, b, c: a * b + (1 - a) * c,
    interpolation_coefficients,
    client_params,
    server_params,
  )


@jax.jit
def interpolation_grad_fn(grads, client_params, server_params):
  """alpha's gradient: <v - w, g> per leaf.

  Args:
    grads: g, the gradient at the mixture.
    client_params: v.
    server_params: w.

  Returns:
    One scalar per leaf.
  """
  return jax.tree.map(
    lambda v, w, g: jnp.tensordot(v - w, g, axes=len(g.shape)),
    client_params,
    server_params,
    grads,
  )


def create_train_for_each_client(grad_fn, client_optimizer):
  """``for_each_client`` of APFL's client steps.

  Args:
    grad_fn: ``(params, batch, key) -> gradients``.
    client_optimizer: the optimizer of w, v and alpha (three states).

  Returns:
    ``(server params, [(id, batches, {rng, state})]) -> iterator of (id,
    {state, delta_params})``.
  """

  def client_init(server_params, client_input):
    state = client_input['state']
    return {
      'server_params': server_params,
      'server_opt_state': client_optimizer.init(server_params),
      'client_opt_state': client_optimizer.init(state.params),
      'interpolation_opt_state': client_optimizer.init(
        state.interpolation_coefficients
      ),
      'rng': client_input['rng'],
      'state': state,
    }

  def client_step(s, batch):
    rng, server_rng, client_rng = jax.random.split(s['rng'], 3)
    state = s['state']
    mixed = interpolate_params(
      state.interpolation_coefficients, state.params, s['server_params']
    )
    server_grads = grad_fn(s['server_params'], batch, server_rng)
    client_grads = grad_fn(mixed, batch, client_rng)
    alpha_grads = interpolation_grad_fn(
      client_grads, state.params, s['server_params']
    )
    server_opt_state, server_params = client_optimizer.apply(
      server_grads, s['server_opt_state'], s['server_params']
    )
    client_opt_state, client_params = client_optimizer.apply(
      client_grads, s['client_opt_state'], state.params
    )
    alpha_opt_state, alpha = client_optimizer.apply(
      alpha_grads,
      s['interpolation_opt_state'],
      state.interpolation_coefficients,
    )
    return {
      'server_params': server_params,
      'server_opt_state': server_opt_state,
      'client_opt_state': client_opt_state,
      'interpolation_opt_state': alpha_opt_state,
      'rng': rng,
      'state': ClientState(
        params=client_params,
        interpolation_coefficients=jax.tree.map(
          lambda a: jnp.clip(a, 0, 1), alpha
        ),
      ),
    }

  def client_final(server_params, s):
    return {
      'state': s['state'],
      'delta_params': jax.tree.map(
        jnp.subtract, server_params, s['server_params']
      ),
    }

  return for_each_client.for_each_client(client_init, client_step, client_final)


def adaptive_personalized_federated_learning(
  grad_fn: Callable[[Params, BatchExample, PRNGKey], Params],
  client_optimizer: optimizers.Optimizer,
  server_optimizer: optimizers.Optimizer,
  client_batch_hparams: ShuffleRepeatBatchHParams,
  client_coefficient: float,
) -> FederatedAlgorithm:
  """FedJAX's APFL.

  Args:
    grad_fn: ``(params, batch, key) -> gradients``.
    client_optimizer: the clients' optimizer (w, v and alpha).
    server_optimizer: the server's, on the mean delta of w.
    client_batch_hparams: the clients' batching.
    client_coefficient: alpha of a client seen for the first time.

  Returns:
    The ``FederatedAlgorithm``.
  """
  train = create_train_for_each_client(grad_fn, client_optimizer)

  def init(params: Params) -> ServerState:
    return ServerState(params, server_optimizer.init(params), {})

  def apply(
    state: ServerState, clients: Clients
  ) -> Tuple[ServerState, Mapping[bytes, Any]]:
    sizes = {cid: len(cds) for cid, cds, _ in clients}
    default = ClientState(
      params=state.params,
      interpolation_coefficients=jax.tree.map(
        lambda _: client_coefficient, state.params
      ),
    )
    client_states: Any = state.client_states
    batches = (
      (
        cid,
        cds.shuffle_repeat_batch(client_batch_hparams),
        {'rng': rng, 'state': client_states.get(cid, default)},
      )
      for cid, cds, rng in clients
    )
    total = tree_util.tree_zeros_like(state.params)
    weight, diagnostics = 0.0, {}
    for cid, out in train(state.params, batches):
      delta = out['delta_params']
      # FedJAX's: the dict is updated in place
      client_states[cid] = out['state']
      total = tree_util.tree_add(
        total, tree_util.tree_weight(delta, sizes[cid])
      )
      weight += sizes[cid]
      diagnostics[cid] = {'delta_l2_norm': tree_util.tree_l2_norm(delta)}
    opt_state, params = server_optimizer.apply(
      tree_util.tree_inverse_weight(total, weight),
      state.opt_state,
      state.params,
    )
    return ServerState(params, opt_state, client_states), diagnostics

  return FederatedAlgorithm(init, apply)


def create_eval_for_each_client(model: models.Model):
  """``for_each_client`` of a client's metrics at its mixture.

  Args:
    model: the model.

  Returns:
    ``(server params, [(id, padded batches, ClientState)]) -> iterator of
    (id, metric name -> Stat)``.
  """

  def client_init(server_params, client_input):
    params = interpolate_params(
      client_input.interpolation_coefficients,
      client_input.params,
      server_params,
    )
    return {
      'params': params,
      'stat': {k: m.zero() for k, m in model.eval_metrics.items()},
    }

  def client_step(s, batch):
    stat = models._evaluate_model_step(model, s['params'], batch, s['stat'])
    return {'params': s['params'], 'stat': stat}

  def client_final(server_params, s):
    del server_params
    return s['stat']

  return for_each_client.for_each_client(client_init, client_step, client_final)


def eval_adaptive_personalized_federated_learning(
  model: models.Model, client_batch_hparams: PaddedBatchHParams
) -> Callable[[ServerState, Sequence[Tuple[bytes, ClientDataset]]], Any]:
  """APFL's evaluation at each client's mixture (a client never trained:
  alpha 0, the server model).

  Args:
    model: the model.
    client_batch_hparams: the evaluation batches.

  Returns:
    ``(server state, [(id, dataset)]) -> iterator of (id, metric name ->
    Stat)`` (FedJAX's: statistics, ``.result()`` gives the values).
  """
  each = create_eval_for_each_client(model)

  def evaluate(state: ServerState, clients):
    states: Any = state.client_states
    default = ClientState(
      params=state.params,
      interpolation_coefficients=tree_util.tree_zeros_like(state.params),
    )
    return each(
      state.params,
      (
        (cid, cds.padded_batch(client_batch_hparams), states.get(cid, default))
        for cid, cds in clients
      ),
    )

  return evaluate
