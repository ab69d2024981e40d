"""FedSGD (McMahan et al. 2017): each active client takes one gradient step
(on its full local data by default, or on one minibatch) and the server
averages the models, i.e. one large-batch SGD step per round."""

import optax

from fedjax_personal.algorithms.fedavg import fedavg
from fedjax_personal.batching import Batching
from fedjax_personal.models import Model


def fedsgd(model: Model, num_clients: int, learning_rate: float, batch_size=None, **kw):
  """Builds FedSGD (``batch_size=None``: the full local batch)."""
  return fedavg(model, num_clients, optax.sgd(learning_rate),
                Batching(batch_size=batch_size, num_epochs=None, num_steps=1),
                name='fedsgd', **kw)
