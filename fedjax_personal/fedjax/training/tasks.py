"""FedJAX's standard tasks (``fedjax.training.tasks``): ``(train data, test
data, model)`` by name, as FedJAX builds each."""

from typing import Optional, Tuple

from fedjax_personal.fedjax import datasets, models
from fedjax_personal.fedjax.core.federated_data import FederatedData
from fedjax_personal.fedjax.core.models import Model

__all__ = ['ALL_TASKS', 'get_task']

ALL_TASKS = (
  'EMNIST_CONV',
  'EMNIST_LOGISTIC',
  'EMNIST_DENSE',
  'SHAKESPEARE_CHARACTER',
  'STACKOVERFLOW_WORD',
  'CIFAR100_LOGISTIC',
)


def get_task(
  name: str, mode: str = 'sqlite', cache_dir: Optional[str] = None
) -> Tuple[FederatedData, FederatedData, Model]:
  """A standard task.

  Args:
    name: one of ``ALL_TASKS``.
    mode: 'sqlite'.
    cache_dir: where the files are (None: where ``load_data`` looks).

  Returns:
    ``(train data, test data, model)``.

  Raises:
    ValueError: an unknown task.
  """
  if name.startswith('EMNIST_'):
    train, test = datasets.emnist.load_data(
      only_digits=False, mode=mode, cache_dir=cache_dir
    )
    build = {
      'EMNIST_CONV': models.emnist.create_conv_model,
      'EMNIST_LOGISTIC': models.emnist.create_logistic_model,
      'EMNIST_DENSE': models.emnist.create_dense_model,
    }.get(name)
    if build is not None:
      return train, test, build(only_digits=False)
  elif name == 'SHAKESPEARE_CHARACTER':
    train, test = datasets.shakespeare.load_data(mode=mode, cache_dir=cache_dir)
    return train, test, models.shakespeare.create_lstm_model()
  elif name == 'STACKOVERFLOW_WORD':
    train, _, test = datasets.stackoverflow.load_data(
      mode=mode, cache_dir=cache_dir
    )
    tokenizer = datasets.stackoverflow.StackoverflowTokenizer()
    # the maximum sequence length of arXiv:2003.00295
    preprocess = tokenizer.as_preprocess_batch(20)
    return (
      train.preprocess_batch(preprocess),
      test.preprocess_batch(preprocess),
      models.stackoverflow.create_lstm_model(expected_length=13.3),
    )
  elif name == 'CIFAR100_LOGISTIC':
    train, test = datasets.cifar100.load_data(mode=mode, cache_dir=cache_dir)
    preprocess = datasets.cifar100.preprocess_batch_tff
    return (
      train.preprocess_batch(preprocess),
      test.preprocess_batch(preprocess),
      models.cifar100.create_logistic_model(),
    )
  raise ValueError(f'Unsupported task: {name!r}')
