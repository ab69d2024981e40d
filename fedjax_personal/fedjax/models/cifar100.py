"""FedJAX's CIFAR-100 model (``fedjax.models.cifar100``): logistic
regression on 24x24x3 crops in Haiku, FedJAX's loss and metrics."""

import numpy as np

from fedjax_personal.fedjax.core import metrics, models
from fedjax_personal.fedjax.models._haiku import haiku

__all__ = ['create_logistic_model']

_HAIKU_SAMPLE_BATCH = {
  'x': np.zeros((1, 24, 24, 3), dtype=np.float32),
  'y': np.zeros(1, dtype=np.int32),
}


def _train_loss(batch, preds):
  return metrics.unreduced_cross_entropy_loss(batch['y'], preds)


def create_logistic_model() -> models.Model:
  """FedJAX's CIFAR-100 logistic model: flatten, dense to 100 classes.

  Returns:
    The ``Model`` (cross-entropy loss; loss and accuracy metrics).
  """
  hk = haiku()

  def forward_pass(batch):
    return hk.Sequential([hk.Flatten(), hk.Linear(100)])(batch['x'])

  return models.create_model_from_haiku(
    transformed_forward_pass=hk.transform(forward_pass),
    sample_batch=_HAIKU_SAMPLE_BATCH,
    train_loss=_train_loss,
    eval_metrics={
      'loss': metrics.CrossEntropyLoss(),
      'accuracy': metrics.Accuracy(),
    },
  )
