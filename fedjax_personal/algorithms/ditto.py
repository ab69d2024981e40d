"""Ditto (Li, Hu, Beirami and Smith, ICML 2021): fair and robust personalization.

Global model: FedAvg (local SGD from the broadcast w). Personal model v_i of
each client: local steps on f_i(v) + lambda/2 ||v - w||^2 with w the received
global model, taken on the same batches. lambda -> infinity gives the global
model; lambda = 0 gives Local training. Clients are evaluated with v_i.
"""

from typing import Optional

import jax
import jax.numpy as jnp
import optax

from fedjax_personal.algorithms.global_personal import (GlobalPersonalOutput,
                                                        global_personal_algorithm)
from fedjax_personal.batching import Batching
from fedjax_personal.models import Model
from fedjax_personal.training import ClientWork, batch_loss, zero_stats
from fedjax_personal.tree_util import tree_sub


def ditto(model: Model, num_clients: int, batching: Batching, learning_rate: float,
          lam: float = 0.1, personal_lr: Optional[float] = None,
          server_optimizer: Optional[optax.GradientTransformation] = None,
          weighting: str = 'num_examples'):
  """Builds Ditto."""
  personal_lr = learning_rate if personal_lr is None else personal_lr
  grad = lambda p, b: jax.grad(lambda q: batch_loss(model, q, b)[0])(p)

  def step(ctx, carry, batch, key):
    w, v, stats = carry
    s = batch_loss(model, v, batch)[1]
    w = jax.tree.map(lambda a, g: a - learning_rate * g, w, grad(w, batch))
    v = jax.tree.map(lambda a, g, s_: a - personal_lr * (g + lam * (a - s_)), v, grad(v, batch),
                     ctx.shared)
    return w, v, jax.tree.map(jnp.add, stats, s)

  def final(ctx, carry):
    w, v, stats = carry
    return GlobalPersonalOutput(delta=tree_sub(ctx.shared, w), personal=v,
                                num_examples=ctx.data.train.num_examples, stats=stats)

  work = ClientWork(lambda ctx, key: (ctx.shared, ctx.state, zero_stats()), step, final, batching)
  return global_personal_algorithm('ditto', model, num_clients, work, server_optimizer, weighting)
