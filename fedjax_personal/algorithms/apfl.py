"""APFL (Deng, Kamani and Mahdavi, 2020): adaptive personalized FL.

Each client keeps a personal model v_i and uses the mixture
alpha v_i + (1 - alpha) w of it with the global model w. Locally, on each
batch: w <- w - lr grad f(w); v_i <- v_i - lr grad_v f(alpha v_i + (1 - alpha) w).
The server averages the global models. alpha = 0 is FedAvg's global model;
alpha = 1 trains v_i alone (Local). The mixing weight is a fixed alpha here
(the paper's adaptive alpha update is not implemented).
"""

from typing import Optional

import jax
import jax.numpy as jnp
import optax

from fedjax_personal.algorithm import ClientModels
from fedjax_personal.algorithms.global_personal import (GlobalPersonalOutput,
                                                        global_personal_algorithm)
from fedjax_personal.batching import Batching
from fedjax_personal.models import Model
from fedjax_personal.training import ClientWork, batch_loss, zero_stats
from fedjax_personal.tree_util import is_concrete, tree_broadcast, tree_sub


def mixture(alpha, personal, global_params):
  return jax.tree.map(lambda v, w: alpha * v + (1 - alpha) * w, personal, global_params)


def apfl(model: Model, num_clients: int, batching: Batching, learning_rate: float,
         alpha: float = 0.25, server_optimizer: Optional[optax.GradientTransformation] = None,
         weighting: str = 'num_examples'):
  """Builds APFL with a fixed mixing weight ``alpha`` in [0, 1]."""
  if is_concrete(alpha) and not 0 <= alpha <= 1:
    raise ValueError(f'APFL alpha must be in [0, 1], got {alpha}')

  def step(ctx, carry, batch, key):
    w, v, stats = carry
    gw = jax.grad(lambda q: batch_loss(model, q, batch)[0])(w)
    loss_v = lambda vv: batch_loss(model, mixture(alpha, vv, w), batch)
    (_, s), gv = jax.value_and_grad(loss_v, has_aux=True)(v)
    w = jax.tree.map(lambda a, g: a - learning_rate * g, w, gw)
    v = jax.tree.map(lambda a, g: a - learning_rate * g, v, gv)
    return w, v, jax.tree.map(jnp.add, stats, s)

  def final(ctx, carry):
    w, v, stats = carry
    return GlobalPersonalOutput(delta=tree_sub(ctx.shared, w), personal=v,
                                num_examples=ctx.data.train.num_examples, stats=stats)

  def eval_models(state):
    return ClientModels.personal(
        mixture(alpha, state.personal, tree_broadcast(state.params, num_clients)), num_clients)

  work = ClientWork(lambda ctx, key: (ctx.shared, ctx.state, zero_stats()), step, final, batching)
  return global_personal_algorithm('apfl', model, num_clients, work, server_optimizer, weighting,
                                   eval_models=eval_models)
