"""FedJAX's ``fedjax.regularizers``: an l2 penalty on the parameters."""

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from fedjax_personal.fedjax.core.typing import Params

__all__ = ['l2_regularizer']


def l2_regularizer(
  weight: float,
  center_params: Optional[Params] = None,
  params_weights: Optional[Params] = None,
) -> Callable[[Params], jax.Array]:
  """``params -> weight * sum_j w_j (params_j - center_j)^2``.

  Args:
    weight: the penalty's weight.
    center_params: the point to pull toward (default 0).
    params_weights: per-parameter weights w (default 1).

  Returns:
    The penalty function.
  """

  def penalty(params):
    if center_params is not None:
      params = jax.tree.map(jnp.subtract, params, center_params)
    leaves = jax.tree.leaves(params)
    if params_weights is None:
      return sum(jnp.vdot(x, x) for x in leaves) * weight
    return (
      sum(
        jnp.vdot(w, jnp.square(x))
        for w, x in zip(jax.tree.leaves(params_weights), leaves)
      )
      * weight
    )

  return penalty
