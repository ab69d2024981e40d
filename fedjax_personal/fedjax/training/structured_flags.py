"""FedJAX's structured flags (``fedjax.training.structured_flags``): groups
of absl flags, under an optional name prefix, that build an optimizer,
batching hyperparameters, an experiment's settings or a task."""

import sys
from typing import Optional, Sequence

from absl import flags

from fedjax_personal.fedjax.core import client_datasets, optimizers
from fedjax_personal.fedjax.training import federated_experiment, tasks

__all__ = [
  'BatchHParamsFlags',
  'FederatedExperimentConfigFlags',
  'NamedFlags',
  'OptimizerFlags',
  'PaddedBatchHParamsFlags',
  'ShuffleRepeatBatchHParamsFlags',
  'TaskFlags',
]

FLAGS = flags.FLAGS


class NamedFlags:
  """Flags named after a prefix.

  Flags named ``<name>_<flag>`` (``<flag>`` without a name), their help
  ending ``for <name>``, shown by the script's ``--help``."""

  def __init__(self, name: Optional[str]):
    self._name = name
    self._prefix = '' if name is None else name + '_'
    self._description = '' if name is None else f' for {name}'

  def _define(self, define, name, default, help_, *args):
    define(
      self._prefix + name,
      default,
      *args,
      help_ + self._description,
      module_name=sys.argv[0],
    )

  def _enum(
    self,
    name: str,
    default: Optional[str],
    enum_values: Sequence[str],
    help_: str,
  ):
    self._define(flags.DEFINE_enum, name, default, help_, enum_values)

  def _string(self, name: str, default: Optional[str], help_: str):
    self._define(flags.DEFINE_string, name, default, help_)

  def _float(self, name: str, default: Optional[float], help_: str):
    self._define(flags.DEFINE_float, name, default, help_)

  def _integer(self, name: str, default: Optional[int], help_: str):
    self._define(flags.DEFINE_integer, name, default, help_)

  def _get_flag(self, flag):
    return getattr(FLAGS, self._prefix + flag)


class OptimizerFlags(NamedFlags):
  """An ``Optimizer`` from flags.

  ``--optimizer``, ``--learning_rate`` and each optimizer's own flags
  (FedJAX's defaults)."""

  SUPPORTED = ('sgd', 'momentum', 'adam', 'rmsprop', 'adagrad', 'yogi')

  def __init__(
    self, name: Optional[str] = None, default_optimizer: str = 'sgd'
  ):
    super().__init__(name)
    self._enum('optimizer', default_optimizer, self.SUPPORTED, 'Optimizer')
    self._float('learning_rate', 0.005, 'Server step size')
    self._float('momentum', 0.0, 'Momentum parameter')
    self._float('adam_beta1', 0.9, 'Adam beta 1 parameter')
    self._float('adam_beta2', 0.99, 'Adam beta 2 parameter')
    self._float('adam_epsilon', 1e-3, 'Adam epsilon parameter')
    self._float('rmsprop_decay', 0.9, 'RMSProp decay parameter')
    self._float('rmsprop_epsilon', 1e-3, 'RMSprop epsilon parameter')
    # FedJAX's help repeats the description on this one
    self._float(
      'adagrad_epsilon',
      1e-6,
      'Adagrad epsilon parameter that is added to second moment'
      + self._description,
    )
    self._float('yogi_beta1', 0.9, 'Yogi beta 1 parameter')
    self._float('yogi_beta2', 0.999, 'Yogi beta 2 parameter')
    self._float('yogi_epsilon', 1e-3, 'Yogi epsilon parameter')

  def get(self) -> optimizers.Optimizer:
    """The optimizer the flags name."""
    name = self._get_flag('optimizer')
    lr = self._get_flag('learning_rate')
    get = self._get_flag
    build = {
      'sgd': lambda: optimizers.sgd(lr),
      'momentum': lambda: optimizers.sgd(lr, get('momentum')),
      'adam': lambda: optimizers.adam(
        lr, get('adam_beta1'), get('adam_beta2'), get('adam_epsilon')
      ),
      'rmsprop': lambda: optimizers.rmsprop(
        lr, get('rmsprop_decay'), get('rmsprop_epsilon')
      ),
      'adagrad': lambda: optimizers.adagrad(lr, eps=get('adagrad_epsilon')),
      'yogi': lambda: optimizers.yogi(
        lr, get('yogi_beta1'), get('yogi_beta2'), get('yogi_epsilon')
      ),
    }.get(name)
    if build is None:
      raise ValueError(
        f'Unsupported optimizer {name!r} from --{self._prefix}optimizer.'
      )
    return build()


class ShuffleRepeatBatchHParamsFlags(NamedFlags):
  """``ShuffleRepeatBatchHParams`` from flags.

  ``ShuffleRepeatBatchHParams`` from ``--batch_size``, ``--num_epochs``,
  ``--num_steps``."""

  def __init__(self, name: Optional[str] = None, default_batch_size: int = 128):
    super().__init__(name)
    defaults = client_datasets.ShuffleRepeatBatchHParams(batch_size=-1)
    self._integer('batch_size', default_batch_size, 'Batch size')
    self._integer('num_epochs', defaults.num_epochs, 'Number of epochs')
    self._integer('num_steps', defaults.num_steps, 'Number of steps')

  def get(self):
    """The batching hyperparameters."""
    return client_datasets.ShuffleRepeatBatchHParams(
      batch_size=self._get_flag('batch_size'),
      num_epochs=self._get_flag('num_epochs'),
      num_steps=self._get_flag('num_steps'),
    )


class PaddedBatchHParamsFlags(NamedFlags):
  """``PaddedBatchHParams`` from ``--batch_size``."""

  def __init__(self, name: Optional[str] = None, default_batch_size: int = 128):
    super().__init__(name)
    self._integer('batch_size', default_batch_size, 'Batch size')

  def get(self):
    """The batching hyperparameters."""
    return client_datasets.PaddedBatchHParams(
      batch_size=self._get_flag('batch_size')
    )


class BatchHParamsFlags(NamedFlags):
  """``BatchHParams`` from ``--batch_size``."""

  def __init__(self, name: Optional[str] = None, default_batch_size: int = 128):
    super().__init__(name)
    self._integer('batch_size', default_batch_size, 'Batch size')

  def get(self):
    """The batching hyperparameters."""
    return client_datasets.BatchHParams(batch_size=self._get_flag('batch_size'))


class FederatedExperimentConfigFlags(NamedFlags):
  """``FederatedExperimentConfig`` from flags.

  ``FederatedExperimentConfig`` from ``--root_dir``, ``--num_rounds``,
  ``--checkpoint_frequency``, ``--num_checkpoints_to_keep``,
  ``--eval_frequency``."""

  def __init__(self, name: Optional[str] = None):
    super().__init__(name)
    defaults = federated_experiment.FederatedExperimentConfig(
      root_dir='', num_rounds=-1
    )
    self._string('root_dir', None, 'Root directory of experiment outputs')
    self._integer('num_rounds', None, 'Number of federated training rounds')
    self._integer(
      'checkpoint_frequency',
      defaults.checkpoint_frequency,
      'Checkpoint frequency in rounds. If <= 0, no checkpointing is done.',
    )
    self._integer(
      'num_checkpoints_to_keep',
      defaults.num_checkpoints_to_keep,
      'Maximum number of checkpoints to keep',
    )
    self._integer(
      'eval_frequency',
      defaults.eval_frequency,
      'Evaluation frequency in rounds. If <= 0, no evaluation is done.',
    )

  def get(self):
    """The experiment's settings."""
    return federated_experiment.FederatedExperimentConfig(
      root_dir=self._get_flag('root_dir'),
      num_rounds=self._get_flag('num_rounds'),
      checkpoint_frequency=self._get_flag('checkpoint_frequency'),
      num_checkpoints_to_keep=self._get_flag('num_checkpoints_to_keep'),
      eval_frequency=self._get_flag('eval_frequency'),
    )


class TaskFlags(NamedFlags):
  """A standard task from ``--task``, ``--data_mode``, ``--cache_dir``."""

  def __init__(self, name: Optional[str] = None):
    super().__init__(name)
    self._enum('task', None, tasks.ALL_TASKS, 'Which task to run')
    self._string('data_mode', 'sqlite', 'Data loading mode')
    self._string(
      'cache_dir', None, 'Cache directory when loading SQLite federated data'
    )

  def get(self):
    """``(train data, test data, model)``."""
    return tasks.get_task(
      self._get_flag('task'),
      self._get_flag('data_mode'),
      self._get_flag('cache_dir'),
    )
