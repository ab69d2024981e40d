"""FedJAX's training utilities (``fedjax.training``): the experiment loop
with checkpoints and periodic evaluation, its evaluation functions, the
logger, the standard tasks and the structured flags, without TensorFlow
(local paths; metrics logged with absl and written as TSV)."""

from fedjax_personal.fedjax.training import structured_flags
from fedjax_personal.fedjax.training.checkpoint import (
  load_latest_checkpoint,
  save_checkpoint,
)
from fedjax_personal.fedjax.training.federated_experiment import (
  EvaluationFn,
  FederatedExperimentConfig,
  ModelFullEvaluationFn,
  ModelSampleClientsEvaluationFn,
  ModelTrainClientsEvaluationFn,
  TrainClientsEvaluationFn,
  run_federated_experiment,
  set_tf_cpu_only,
)
from fedjax_personal.fedjax.training.logging import Logger
from fedjax_personal.fedjax.training.tasks import ALL_TASKS, get_task

__all__ = [
  'ALL_TASKS',
  'EvaluationFn',
  'FederatedExperimentConfig',
  'get_task',
  'load_latest_checkpoint',
  'Logger',
  'ModelFullEvaluationFn',
  'ModelSampleClientsEvaluationFn',
  'ModelTrainClientsEvaluationFn',
  'run_federated_experiment',
  'save_checkpoint',
  'set_tf_cpu_only',
  'structured_flags',
  'TrainClientsEvaluationFn',
]
