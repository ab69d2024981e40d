"""Clipped gradients: PyTorch's ``clip_grad_norm_`` (PFLlib's FML, FedKD,
FedPCL clip before each step) and DP-SGD's per-example clipping with noise
(Abadi et al. 2016)."""

import jax
import jax.numpy as jnp
import optax

from fedjax_personal.core.losses import Batch
from fedjax_personal.core.tree_util import PyTree

__all__ = ['clip_grad_norm', 'dp_gradient', 'torch_clip']


def clip_grad_norm(grads: PyTree, max_norm: float) -> PyTree:
  """PyTorch's ``clip_grad_norm_``: scaled by ``min(1, max_norm / (norm +
  1e-6))``, the norm over every leaf.

  Args:
    grads: the gradients.
    max_norm: the bound.

  Returns:
    The clipped gradients.
  """
  norm = optax.global_norm(grads)
  scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
  return jax.tree.map(lambda g: g * scale, grads)


def torch_clip(max_norm: float) -> optax.GradientTransformation:
  """``clip_grad_norm`` as an optax transformation, chained before an
  optimizer where PyTorch code clips before its step (PFLlib's FML, FedKD,
  FedPCL); optax's ``clip_by_global_norm`` divides by the norm alone.

  Args:
    max_norm: the bound.

  Returns:
    The ``optax.GradientTransformation``.
  """
  return optax.stateless(
    lambda updates, params=None: clip_grad_norm(updates, max_norm)
  )


def dp_gradient(
  objective,
  params,
  batch: Batch,
  key,
  clip_norm: float,
  noise_multiplier: float,
):
  """DP-SGD gradient (Abadi et al. 2016): per-example gradients (vmapped over
  the batch) clipped to ``clip_norm``, summed over real examples, plus
  N(0, (noise_multiplier * clip_norm)^2) noise, divided by the real count.

  Returns (noisy mean gradient, LossStats of the batch).

  Args:
    objective: ``(params, batch) -> (loss, stats)``.
    params: the parameters.
    batch: the ``Batch``.
    key: draws the noise.
    clip_norm: per-example clipping norm C.
    noise_multiplier: sigma (noise std = sigma * C).

  Returns:
    ``(noisy mean gradient, LossStats of the batch)``.
  """

  def one(x, y):
    ex = Batch(x[None], y[None], jnp.ones((1,), bool))
    return jax.grad(lambda p: objective(p, ex)[0])(params)

  grads = jax.vmap(one)(batch.x, batch.y)
  norms = jnp.sqrt(
    sum(
      jnp.sum(jnp.square(g.reshape(g.shape[0], -1)), axis=1)
      for g in jax.tree.leaves(grads)
    )
  )
  scale = jnp.minimum(1.0, clip_norm / jnp.maximum(norms, 1e-12)) * batch.mask
  count = jnp.maximum(jnp.sum(batch.mask), 1.0)
  leaves, treedef = jax.tree.flatten(grads)
  keys = jax.random.split(key, len(leaves))
  noisy = [
    (
      jnp.tensordot(scale, g, axes=1)
      + noise_multiplier
      * clip_norm
      * jax.random.normal(k, g.shape[1:], g.dtype)
    )
    / count
    for g, k in zip(leaves, keys)
  ]
  return jax.tree.unflatten(treedef, noisy), objective(params, batch)[1]
