"""Per-FedAvg (Fallah, Mokhtari and Ozdaglar, NeurIPS 2020).

Each of the tau local steps draws three independent batches D, D', D'':

    w_tmp = w - alpha grad f(w; D)
    FO:  w <- w - beta grad f(w_tmp; D')
    HF:  w <- w - beta (I - alpha H(w; D'')) grad f(w_tmp; D')

The Hessian-vector product is exact (forward-over-reverse autodiff, no Hessian
materialized; variant 'hf') or the finite-difference estimate
(grad f(w + delta v) - grad f(w - delta v)) / (2 delta) (variant 'hf_fd',
delta 1e-3, what other libraries ship). The server averages the returned
models. Evaluation: each client takes one (or a few) alpha-steps on its
*training* data, then is tested (the authors' code stepped on test batches,
which leaks).
"""

from typing import Optional

import jax
import jax.numpy as jnp
import optax

from fedjax_personal.algorithm import (ClientModels, Communication, FederatedAlgorithm,
                                       cohort_train_metrics)
from fedjax_personal.algorithms.fedavg import (ClientOutput, ServerState, server_step,
                                               summed_upload)
from fedjax_personal.batching import Batching
from fedjax_personal.models import Model
from fedjax_personal.training import (Batch, ClientWork, batch_loss, sgd_finetune, zero_stats)
from fedjax_personal.tree_util import tree_bytes, tree_sub

VARIANTS = ('fo', 'hf', 'hf_fd')


def hvp_exact(loss_fn, params, v):
  """H(params) v by forward-over-reverse differentiation (jvp of grad)."""
  return jax.jvp(jax.grad(loss_fn), (params,), (v,))[1]


def hvp_finite_difference(loss_fn, params, v, delta: float = 1e-3):
  """(grad(params + delta v) - grad(params - delta v)) / (2 delta)."""
  g = jax.grad(loss_fn)
  plus = g(jax.tree.map(lambda p, d: p + delta * d, params, v))
  minus = g(jax.tree.map(lambda p, d: p - delta * d, params, v))
  return jax.tree.map(lambda a, b: (a - b) / (2 * delta), plus, minus)


def perfedavg_update(model: Model, params, batches: Batch, alpha: float, beta: float,
                     variant: str, delta: float = 1e-3):
  """One Per-FedAvg local step on three batches ([3, B, ...]).

  Returns (new params, LossStats of the batch D).
  """
  d, d1, d2 = (Batch(batches.x[k], batches.y[k], batches.mask[k]) for k in range(3))
  (_, stats), g = jax.value_and_grad(lambda p: batch_loss(model, p, d), has_aux=True)(params)
  w_tmp = jax.tree.map(lambda p, gg: p - alpha * gg, params, g)
  g1 = jax.grad(lambda p: batch_loss(model, p, d1)[0])(w_tmp)
  if variant == 'fo':
    direction = g1
  else:
    loss2 = lambda p: batch_loss(model, p, d2)[0]
    hv = (hvp_exact(loss2, params, g1) if variant == 'hf'
          else hvp_finite_difference(loss2, params, g1, delta))
    direction = jax.tree.map(lambda a, h: a - alpha * h, g1, hv)
  return jax.tree.map(lambda p, gg: p - beta * gg, params, direction), stats


def perfedavg(model: Model, num_clients: int, batching: Batching, alpha: float, beta: float,
              variant: str = 'fo', delta: float = 1e-3,
              server_optimizer: Optional[optax.GradientTransformation] = None,
              weighting: str = 'num_examples', eval_steps: int = 1) -> FederatedAlgorithm:
  """Builds Per-FedAvg.

  Args:
    batching: local steps (each step draws 3 batches of this size).
    alpha: the inner (personalization) step size.
    beta: the outer step size.
    variant: 'fo', 'hf' (exact Hessian-vector product) or 'hf_fd'.
    delta: finite-difference step of 'hf_fd'.
    eval_steps: alpha-steps on the client's training data before testing.
  """
  if variant not in VARIANTS:
    raise ValueError(f'Per-FedAvg variant must be one of {VARIANTS}, got {variant!r}')
  server_optimizer = server_optimizer or optax.sgd(1.0)

  def init(key):
    params = model.init(key)
    return ServerState(params, server_optimizer.init(params))

  def step(ctx, carry, batch, key):
    params, stats = carry
    new, s = perfedavg_update(model, params, batch, alpha, beta, variant, delta)
    return new, jax.tree.map(jnp.add, stats, s)

  work = summed_upload(ClientWork(
      init=lambda ctx, key: (ctx.shared, zero_stats()), step=step,
      final=lambda ctx, carry: ClientOutput(delta=tree_sub(ctx.shared, carry[0]),
                                            num_examples=ctx.data.train.num_examples,
                                            stats=carry[1]),
      batching=batching, batches_per_step=3), weighting)

  def server_update(state, cohort, out):
    params, opt_state = server_step(state.params, state.opt_state, out.delta, server_optimizer)
    return ServerState(params, opt_state), cohort_train_metrics(out.stats, cohort.mask)

  eval_batching = Batching(batching.batch_size, num_epochs=None, num_steps=eval_steps)
  return FederatedAlgorithm(
      name=f'perfedavg_{variant}', model=model, init=init,
      server_broadcast=lambda s, c: (s.params, c.mask), client_work=work,
      server_update=server_update,
      client_models=lambda s: ClientModels.global_model(s.params, num_clients),
      communication=lambda s: Communication(tree_bytes(s.params), tree_bytes(s.params), 1),
      finetune=sgd_finetune(model, alpha, eval_batching) if eval_steps > 0 else None)
