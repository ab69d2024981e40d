"""Aggregation as tensor contractions over stacked per-client models."""

import jax
import jax.numpy as jnp


def normalize(weights):
  """weights / sum(weights), or zeros when the sum is zero."""
  s = jnp.sum(weights)
  return jnp.where(s > 0, weights / jnp.where(s > 0, s, 1.0), 0.0)


def weighted_mean(stacked, weights):
  """sum_i w_i theta_i / sum_i w_i over the leading axis (FedAvg).

  Args:
    stacked: pytree with leading client axis [C, ...].
    weights: [C] non-negative weights (e.g. mask * n_i).
  Returns:
    The weighted mean pytree (zeros when all weights are zero).
  """
  w = normalize(weights.astype(jnp.float32))
  return jax.tree.map(lambda a: jnp.tensordot(w, a, axes=1).astype(a.dtype), stacked)


def mix(mixing_matrix, stacked):
  """Personalized aggregation theta_i <- sum_j W_ij theta_j.

  ``einsum('ij,j...->i...')``; W is [M, C] for C stacked models, so it also
  forms M stream models from C clients.
  """
  return jax.tree.map(lambda a: jnp.einsum('ij,j...->i...', mixing_matrix, a).astype(a.dtype),
                      stacked)


def group_matrix(groups, weights, num_groups: int):
  """Row-normalized [G, C] matrix averaging the C clients of each group."""
  one_hot = (groups[None, :] == jnp.arange(num_groups)[:, None]).astype(jnp.float32)
  m = one_hot * weights[None, :].astype(jnp.float32)
  s = m.sum(axis=1, keepdims=True)
  return jnp.where(s > 0, m / jnp.where(s > 0, s, 1.0), 0.0)


def group_means(stacked, groups, weights, num_groups: int):
  """Weighted mean of the clients of each group: [G, ...] (oracle clusters)."""
  return mix(group_matrix(groups, weights, num_groups), stacked)


def stream_models(centroids, stacked):
  """The k stream models of k centroid rows ([k, C]) of a mixing matrix."""
  return mix(centroids, stacked)
