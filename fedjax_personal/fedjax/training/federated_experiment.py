"""FedJAX's experiment loop (``fedjax.training.federated_experiment``):
rounds of ``algorithm.apply`` on sampled clients, a checkpoint and periodic
evaluation every so many rounds, resumption from the newest checkpoint, a
final evaluation written as ``<root_dir>/<name>.tsv``. As FedJAX's, with
local paths instead of TensorFlow's file system."""

import abc
import os
import sys
import time
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Tuple

import jax.numpy as jnp
from absl import logging

from fedjax_personal.fedjax.core import client_datasets, federated_data, models
from fedjax_personal.fedjax.core.federated_algorithm import FederatedAlgorithm
from fedjax_personal.fedjax.training import checkpoint
from fedjax_personal.fedjax.training import logging as fedjax_logging

__all__ = [
  'EvaluationFn',
  'FederatedExperimentConfig',
  'ModelFullEvaluationFn',
  'ModelSampleClientsEvaluationFn',
  'ModelTrainClientsEvaluationFn',
  'run_federated_experiment',
  'set_tf_cpu_only',
  'TrainClientsEvaluationFn',
]


def set_tf_cpu_only() -> None:
  """Hides GPUs and TPUs from TensorFlow when the program has imported it
  (FedJAX read its data with TensorFlow, which would otherwise take the
  accelerator's memory); nothing otherwise: this package reads data
  without TensorFlow and never imports it.

  Returns:
    None.
  """
  tf = sys.modules.get('tensorflow')
  if tf is None:
    return
  tf.config.experimental.set_visible_devices([], 'GPU')
  tf.config.experimental.set_visible_devices([], 'TPU')


class EvaluationFn(metaclass=abc.ABCMeta):
  """An evaluation given the state and the round."""

  @abc.abstractmethod
  def __call__(self, state: Any, round_num: int) -> Mapping[str, jnp.ndarray]:
    """The metrics."""


class ModelSampleClientsEvaluationFn(EvaluationFn):
  """Evaluates the state's model on the clients a sampler draws.

  The state's ``params`` evaluated on the clients a sampler draws for
  the round."""

  def __init__(
    self,
    client_sampler,
    model: models.Model,
    batch_hparams: client_datasets.PaddedBatchHParams,
  ):
    self._client_sampler = client_sampler
    self._model = model
    self._batch_hparams = batch_hparams

  def __call__(self, state, round_num):
    self._client_sampler.set_round_num(round_num)
    clients = self._client_sampler.sample()
    batches = client_datasets.padded_batch_client_datasets(
      [dataset for _, dataset, _ in clients], self._batch_hparams
    )
    return models.evaluate_model(self._model, state.params, batches)


class ModelFullEvaluationFn(EvaluationFn):
  """The state's ``params`` evaluated on a whole federated data set."""

  def __init__(
    self,
    fd: federated_data.FederatedData,
    model: models.Model,
    batch_hparams: client_datasets.PaddedBatchHParams,
  ):
    self._fd = fd
    self._model = model
    self._batch_hparams = batch_hparams

  def __call__(self, state, round_num):
    del round_num
    batches = federated_data.padded_batch_federated_data(
      self._fd, self._batch_hparams
    )
    return models.evaluate_model(self._model, state.params, batches)


class TrainClientsEvaluationFn(metaclass=abc.ABCMeta):
  """An evaluation given the state, the round and its training clients."""

  @abc.abstractmethod
  def __call__(
    self,
    state: Any,
    round_num: int,
    train_clients: Sequence[Tuple[Any, Any, Any]],
  ) -> Mapping[str, jnp.ndarray]:
    """The metrics."""


class ModelTrainClientsEvaluationFn(TrainClientsEvaluationFn):
  """The state's ``params`` evaluated on the round's training clients."""

  def __init__(
    self, model: models.Model, batch_hparams: client_datasets.PaddedBatchHParams
  ):
    self._model = model
    self._batch_hparams = batch_hparams

  def __call__(self, state, round_num, train_clients):
    del round_num
    batches = client_datasets.padded_batch_client_datasets(
      [dataset for _, dataset, _ in train_clients], self._batch_hparams
    )
    return models.evaluate_model(self._model, state.params, batches)


class FederatedExperimentConfig(NamedTuple):
  """An experiment's settings.

  Attributes:
    root_dir: the output folder (checkpoints, metrics).
    num_rounds: how many rounds.
    checkpoint_frequency: a checkpoint every so many rounds (<= 0: none).
    num_checkpoints_to_keep: how many checkpoints stay.
    eval_frequency: periodic evaluation every so many rounds (<= 0: none).
  """

  root_dir: str
  num_rounds: int
  checkpoint_frequency: int = 0
  num_checkpoints_to_keep: int = 1
  eval_frequency: int = 0


def _due(frequency: int, round_num: int, start_round_num: int) -> bool:
  """The first round run and every ``frequency``-th (never when <= 0)."""
  return bool(frequency) and (
    round_num == start_round_num or round_num % frequency == 0
  )


def run_federated_experiment(
  algorithm: FederatedAlgorithm,
  init_state: Any,
  client_sampler,
  config: FederatedExperimentConfig,
  periodic_eval_fn_map: Optional[Mapping[str, Any]] = None,
  final_eval_fn_map: Optional[Mapping[str, EvaluationFn]] = None,
) -> Any:
  """FedJAX's training loop.

  Args:
    algorithm: the federated algorithm.
    init_state: its initial server state (unused when a checkpoint exists).
    client_sampler: draws each round's clients.
    config: the experiment's settings.
    periodic_eval_fn_map: name -> ``EvaluationFn`` or
      ``TrainClientsEvaluationFn``, run every ``eval_frequency`` rounds.
    final_eval_fn_map: name -> ``EvaluationFn``, run once at the end and
      written to ``<root_dir>/<name>.tsv``.

  Returns:
    The final server state.

  Raises:
    ValueError: a periodic evaluation of neither kind.
  """
  if config.root_dir:
    os.makedirs(config.root_dir, exist_ok=True)
  periodic_eval_fn_map = periodic_eval_fn_map or {}
  final_eval_fn_map = final_eval_fn_map or {}
  logger = fedjax_logging.Logger(config.root_dir)
  latest = checkpoint.load_latest_checkpoint(config.root_dir)
  if latest:
    state, last_round_num = latest
    start_round_num = last_round_num + 1
  else:
    state, start_round_num = init_state, 1
  client_sampler.set_round_num(start_round_num)
  round_num = start_round_num
  start = time.time()
  for round_num in range(start_round_num, config.num_rounds + 1):
    clients = client_sampler.sample()
    logging.info(
      'round_num %d: client_ids = %s', round_num, [c[0] for c in clients]
    )
    state, _ = algorithm.apply(state, clients)
    if _due(config.checkpoint_frequency, round_num, start_round_num):
      checkpoint.save_checkpoint(
        config.root_dir, state, round_num, config.num_checkpoints_to_keep
      )
    if _due(config.eval_frequency, round_num, start_round_num):
      eval_start = time.time()
      for eval_name, eval_fn in periodic_eval_fn_map.items():
        if isinstance(eval_fn, EvaluationFn):
          metrics = eval_fn(state, round_num)
        elif isinstance(eval_fn, TrainClientsEvaluationFn):
          metrics = eval_fn(state, round_num, clients)
        else:
          raise ValueError(f'Invalid eval_fn type {type(eval_fn)}')
        for metric_name, metric_value in (metrics or {}).items():
          logger.log(eval_name, metric_name, metric_value, round_num)
      logger.log(
        '.', 'periodic_eval_duration_sec', time.time() - eval_start, round_num
      )
    logger.log(
      '.',
      'mean_round_duration_sec',
      (time.time() - start) / (round_num + 1 - start_round_num),
      round_num,
    )
  jnp.zeros([]).block_until_ready()
  num_rounds = config.num_rounds - start_round_num + 1
  mean_round_duration = (
    (time.time() - start) / num_rounds if num_rounds > 0 else 0
  )
  final_eval_start = time.time()
  for eval_name, eval_fn in final_eval_fn_map.items():
    metrics = eval_fn(state, round_num)
    if metrics:
      with open(os.path.join(config.root_dir, f'{eval_name}.tsv'), 'w') as f:
        f.write('\t'.join(metrics.keys()) + '\n')
        f.write('\t'.join(str(v) for v in metrics.values()))
  logging.info('mean_round_duration = %f sec.', mean_round_duration)
  logging.info('final_eval_duration = %f sec.', time.time() - final_eval_start)
  return state
