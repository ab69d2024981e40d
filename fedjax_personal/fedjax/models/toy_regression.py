"""FedJAX's toy regression model (``fedjax.models.toy_regression``), of Ro
et al. ("Communication-Efficient Agnostic Federated Averaging",
arXiv:2104.02748): a scalar weight w, the prediction mean(w x) over the
batch, the loss (mean(y) - prediction)^2."""

import jax.numpy as jnp
import numpy as np

from fedjax_personal.fedjax.core import models
from fedjax_personal.fedjax.models._haiku import haiku

__all__ = ['create_regression_model']


def create_regression_model() -> models.Model:
  """FedJAX's toy regression model (Haiku).

  Returns:
    The ``Model``.
  """
  hk = haiku()

  def forward_pass(batch):
    return jnp.mean(hk.Sequential([hk.Linear(1, with_bias=False)])(batch['x']))

  def train_loss(batch, preds):
    return jnp.square(jnp.mean(batch['y']) - preds)

  return models.create_model_from_haiku(
    transformed_forward_pass=hk.transform(forward_pass),
    sample_batch={'x': np.zeros((1, 1)), 'y': np.zeros((1,))},
    train_loss=train_loss,
  )
