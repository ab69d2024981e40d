"""FedJAX's EMNIST models (``fedjax.models.emnist``): the CNN with dropout of
Reddi et al. ("Adaptive Federated Optimization", arXiv:2003.00295), a dense
and a logistic model in Haiku, and a dense model in stax, with FedJAX's
layers, initialization (Haiku's), loss and metrics."""

import functools
from typing import Any

import jax
import numpy as np
from jax.example_libraries import stax

from fedjax_personal.fedjax.core import metrics, models
from fedjax_personal.fedjax.models._haiku import haiku

__all__ = [
  'create_conv_model',
  'create_dense_model',
  'create_logistic_model',
  'create_stax_dense_model',
]

_HAIKU_SAMPLE_BATCH = {
  'x': np.zeros((1, 28, 28, 1), dtype=np.float32),
  'y': np.zeros(1, dtype=np.float32),
}
_STAX_SAMPLE_SHAPE = (-1, 28, 28, 1)


def _train_loss(batch, preds):
  return metrics.unreduced_cross_entropy_loss(batch['y'], preds)


def _eval_metrics():
  return {'loss': metrics.CrossEntropyLoss(), 'accuracy': metrics.Accuracy()}


@functools.lru_cache(maxsize=None)
def _modules():
  """FedJAX's Haiku modules, defined once Haiku is imported."""
  hk: Any = haiku()

  class Dropout(hk.Module):
    """Dropout at ``rate`` when ``is_train``."""

    def __init__(self, rate: float = 0.5):
      super().__init__()
      self._rate = rate

    def __call__(self, x, is_train: bool):
      if is_train:
        return hk.dropout(rng=hk.next_rng_key(), rate=self._rate, x=x)
      return x

  class ConvDropoutModule(hk.Module):
    """FedJAX's EMNIST CNN with dropout.

    Conv 32 and 64 (3x3, valid), max pool 2, dropout 0.25, dense 128,
    dropout 0.5, dense to the classes."""

    def __init__(self, num_classes):
      super().__init__()
      self._num_classes = num_classes

    def __call__(self, x, is_train: bool):
      x = jax.nn.relu(hk.Conv2D(32, kernel_shape=(3, 3), padding='VALID')(x))
      x = jax.nn.relu(hk.Conv2D(64, kernel_shape=(3, 3), padding='VALID')(x))
      x = hk.MaxPool(
        window_shape=(1, 2, 2, 1), strides=(1, 2, 2, 1), padding='VALID'
      )(x)
      x = Dropout(rate=0.25)(x, is_train)
      x = jax.nn.relu(hk.Linear(128)(hk.Flatten()(x)))
      x = Dropout(rate=0.5)(x, is_train)
      return hk.Linear(self._num_classes)(x)

  return Dropout, ConvDropoutModule


def __getattr__(name):
  # FedJAX's module-level classes, once Haiku is there
  if name in ('Dropout', 'ConvDropoutModule'):
    return dict(zip(('Dropout', 'ConvDropoutModule'), _modules()))[name]
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def create_conv_model(only_digits: bool = False) -> models.Model:
  """FedJAX's EMNIST CNN with dropout (Haiku).

  Args:
    only_digits: 10 classes, else 62.

  Returns:
    The ``Model`` (cross-entropy loss; loss and accuracy metrics).
  """
  hk = haiku()
  _, conv = _modules()
  num_classes = 10 if only_digits else 62

  def forward_pass(batch, is_train=True):
    return conv(num_classes)(batch['x'], is_train)

  return models.create_model_from_haiku(
    transformed_forward_pass=hk.transform(forward_pass),
    sample_batch=_HAIKU_SAMPLE_BATCH,
    train_loss=_train_loss,
    eval_metrics=_eval_metrics(),
    train_kwargs={'is_train': True},
    eval_kwargs={'is_train': False},
  )


def create_dense_model(
  only_digits: bool = False, hidden_units: int = 200
) -> models.Model:
  """FedJAX's EMNIST dense network, two hidden ReLU layers (Haiku).

  Args:
    only_digits: 10 classes, else 62.
    hidden_units: each hidden layer's width.

  Returns:
    The ``Model`` (cross-entropy loss; loss and accuracy metrics).
  """
  hk = haiku()
  num_classes = 10 if only_digits else 62

  def forward_pass(batch):
    return hk.Sequential(
      [
        hk.Flatten(),
        hk.Linear(hidden_units),
        jax.nn.relu,
        hk.Linear(hidden_units),
        jax.nn.relu,
        hk.Linear(num_classes),
      ]
    )(batch['x'])

  return models.create_model_from_haiku(
    transformed_forward_pass=hk.transform(forward_pass),
    sample_batch=_HAIKU_SAMPLE_BATCH,
    train_loss=_train_loss,
    eval_metrics=_eval_metrics(),
  )


def create_logistic_model(only_digits: bool = False) -> models.Model:
  """FedJAX's EMNIST logistic regression (Haiku).

  Args:
    only_digits: 10 classes, else 62.

  Returns:
    The ``Model`` (cross-entropy loss; loss and accuracy metrics).
  """
  hk = haiku()
  num_classes = 10 if only_digits else 62

  def forward_pass(batch):
    return hk.Sequential([hk.Flatten(), hk.Linear(num_classes)])(batch['x'])

  return models.create_model_from_haiku(
    transformed_forward_pass=hk.transform(forward_pass),
    sample_batch=_HAIKU_SAMPLE_BATCH,
    train_loss=_train_loss,
    eval_metrics=_eval_metrics(),
  )


def create_stax_dense_model(
  only_digits: bool = False, hidden_units: int = 200
) -> models.Model:
  """FedJAX's EMNIST dense network in stax (no Haiku needed).

  Args:
    only_digits: 10 classes, else 62.
    hidden_units: each hidden layer's width.

  Returns:
    The ``Model`` (cross-entropy loss; loss and accuracy metrics).
  """
  num_classes = 10 if only_digits else 62
  stax_init, stax_apply = stax.serial(
    stax.Flatten,
    stax.Dense(hidden_units),
    stax.Relu,
    stax.Dense(hidden_units),
    stax.Relu,
    stax.Dense(num_classes),
  )
  return models.create_model_from_stax(
    stax_init=stax_init,
    stax_apply=stax_apply,
    sample_shape=_STAX_SAMPLE_SHAPE,
    train_loss=_train_loss,
    eval_metrics=_eval_metrics(),
  )
