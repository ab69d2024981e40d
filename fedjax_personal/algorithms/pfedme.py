"""pFedMe (Dinh, Tran and Nguyen, NeurIPS 2020): personalization with Moreau
envelopes,

    min_w (1/N) sum_i F_i(w),  F_i(w) = min_theta f_i(theta) + lambda/2 ||theta - w||^2.

Each local step on a batch D: the personal model theta approximately solves the
inner problem by K steps theta <- theta - personal_lr (grad f(theta; D) +
lambda (theta - w_local)); then w_local <- w_local - lr lambda (w_local -
theta). The server takes w <- (1 - beta) w + beta mean_i w_local (server SGD
with learning rate beta on the mean delta). Clients are evaluated with their
personal theta_i.
"""

import jax
import jax.numpy as jnp
import optax

from fedjax_personal.algorithms.global_personal import (GlobalPersonalOutput,
                                                        global_personal_algorithm)
from fedjax_personal.batching import Batching
from fedjax_personal.models import Model
from fedjax_personal.training import ClientWork, batch_loss, zero_stats
from fedjax_personal.tree_util import tree_sub


def pfedme(model: Model, num_clients: int, batching: Batching, learning_rate: float,
           lam: float = 15.0, personal_lr: float = 0.01, inner_steps: int = 5,
           beta: float = 1.0, weighting: str = 'num_examples'):
  """Builds pFedMe (lambda 15, K 5 and personal lr 0.01 as the authors' MNIST setup)."""

  def init(ctx, key):
    return ctx.shared, ctx.shared, zero_stats()  # (w_local, theta, stats)

  def step(ctx, carry, batch, key):
    w, theta, stats = carry
    s = batch_loss(model, theta, batch)[1]
    for _ in range(inner_steps):
      g = jax.grad(lambda t: batch_loss(model, t, batch)[0])(theta)
      theta = jax.tree.map(lambda t, gg, ww: t - personal_lr * (gg + lam * (t - ww)), theta, g, w)
    w = jax.tree.map(lambda ww, t: ww - learning_rate * lam * (ww - t), w, theta)
    return w, theta, jax.tree.map(jnp.add, stats, s)

  def final(ctx, carry):
    w, theta, stats = carry
    return GlobalPersonalOutput(delta=tree_sub(ctx.shared, w), personal=theta,
                                num_examples=ctx.data.train.num_examples, stats=stats)

  return global_personal_algorithm('pfedme', model, num_clients,
                                   ClientWork(init, step, final, batching),
                                   server_optimizer=optax.sgd(beta), weighting=weighting)
