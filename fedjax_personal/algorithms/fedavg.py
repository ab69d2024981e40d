"""FedAvg (McMahan et al., AISTATS 2017) with a server optimizer.

Clients run local SGD (E epochs or K steps) from the server model; the server
treats the weighted mean of the client deltas theta_server - theta_i as a
pseudo-gradient for an optax optimizer (Reddi et al., ICLR 2021). With
``optax.sgd(1.0)`` this is FedAvg's theta <- sum_i n_i theta_i / sum_i n_i;
with momentum it is FedAvgM.
"""

from typing import Callable, Optional

from flax import struct
import jax
import jax.numpy as jnp
import optax

from fedjax_personal import aggregation
from fedjax_personal.algorithm import (ClientModels, Communication, FederatedAlgorithm,
                                       cohort_train_metrics)
from fedjax_personal.batching import Batching
from fedjax_personal.models import Model
from fedjax_personal.training import ClientWork, LossStats, plain_objective, sgd_client_work
from fedjax_personal.tree_util import tree_bytes, tree_sub, tree_where

WEIGHTINGS = ('num_examples', 'uniform')


@struct.dataclass
class ServerState:
  """Attributes:
    params: the global model.
    opt_state: server optimizer state.
  """
  params: optax.Params
  opt_state: optax.OptState


@struct.dataclass
class ClientOutput:
  """Attributes:
    delta: theta_server - theta_i after local training (the upload).
    num_examples: n_i, the client's training examples.
    stats: local training LossStats.
  """
  delta: optax.Params
  num_examples: jax.Array
  stats: LossStats


def client_weights(cohort, num_examples, weighting: str):
  """Aggregation weights: n_i (or 1) on active clients, 0 on padded slots."""
  if weighting not in WEIGHTINGS:
    raise ValueError(f'weighting must be one of {WEIGHTINGS}, got {weighting!r}')
  w = num_examples.astype(jnp.float32) if weighting == 'num_examples' else jnp.ones_like(num_examples, jnp.float32)
  return w * cohort.mask


def server_step(params, opt_state, deltas, weights, server_optimizer):
  """Applies the server optimizer to the weighted mean delta.

  Leaves params and optimizer state unchanged when no weight is positive.
  """
  pseudo_grad = aggregation.weighted_mean(deltas, weights)
  updates, new_opt_state = server_optimizer.update(pseudo_grad, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  any_client = jnp.sum(weights) > 0
  return (tree_where(any_client, new_params, params),
          tree_where(any_client, new_opt_state, opt_state))


def make_client_work(model: Model, client_optimizer, batching: Batching,
                     objective_fn: Optional[Callable] = None,
                     start_fn: Optional[Callable] = None) -> ClientWork:
  """FedAvg's client work: local SGD from the broadcast model, upload the delta.

  Args:
    objective_fn: ``ctx -> objective`` (default: the plain empirical risk).
      FedProx passes its proximal objective.
    start_fn: ``ctx -> params`` the client starts from (default: the broadcast
      ``ctx.shared``; oracle clusters start from the client's group model).
  """
  start_fn = start_fn or (lambda ctx: ctx.shared)
  plain = plain_objective(model)
  objective_fn = objective_fn or (lambda ctx: plain)

  def final(ctx, carry):
    return ClientOutput(delta=tree_sub(start_fn(ctx), carry.params),
                        num_examples=ctx.data.train.num_examples, stats=carry.stats)

  return sgd_client_work(objective_fn, client_optimizer, batching, final, start_fn)


def fedavg(model: Model, num_clients: int, client_optimizer: optax.GradientTransformation,
           batching: Batching,
           server_optimizer: Optional[optax.GradientTransformation] = None,
           weighting: str = 'num_examples', objective_fn: Optional[Callable] = None,
           finetune=None, name: str = 'fedavg') -> FederatedAlgorithm:
  """Builds FedAvg.

  Args:
    model: the model.
    num_clients: N.
    client_optimizer: local optimizer (e.g. ``optax.sgd(lr)``).
    batching: local epochs/steps and batch size.
    server_optimizer: applied to the mean delta; default ``optax.sgd(1.0)``.
    weighting: 'num_examples' (n_i-weighted mean) or 'uniform'.
    objective_fn: optional local objective builder (see make_client_work).
    finetune: optional evaluation fine-tuning (FedAvg + fine-tuning).
    name: registry name.
  """
  server_optimizer = server_optimizer or optax.sgd(1.0)
  if weighting not in WEIGHTINGS:
    raise ValueError(f'weighting must be one of {WEIGHTINGS}, got {weighting!r}')

  def init(key):
    params = model.init(key)
    return ServerState(params=params, opt_state=server_optimizer.init(params))

  def server_broadcast(state, cohort):
    return state.params, cohort.mask

  def server_update(state, cohort, out: ClientOutput):
    w = client_weights(cohort, out.num_examples, weighting)
    params, opt_state = server_step(state.params, state.opt_state, out.delta, w,
                                    server_optimizer)
    return (ServerState(params=params, opt_state=opt_state),
            cohort_train_metrics(out.stats, cohort.mask))

  def communication(state):
    b = tree_bytes(state.params)
    return Communication(b, b, 1)

  return FederatedAlgorithm(
      name=name, model=model, init=init, server_broadcast=server_broadcast,
      client_work=make_client_work(model, client_optimizer, batching, objective_fn),
      server_update=server_update,
      client_models=lambda s: ClientModels.global_model(s.params, num_clients),
      communication=communication, finetune=finetune)
