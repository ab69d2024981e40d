"""FedJAX's HypCluster (``fedjax.algorithms.hyp_cluster``; Mansour, Mohri, Ro
and Suresh, "Three Approaches for Personalization with Applications to
Federated Learning", arXiv:2002.10619) as FedJAX builds it.

Each round, every client is assigned the cluster whose model has its lowest
average loss (the maximization step, on ``maximization_batch_hparams``
batches), then trains from that model; each cluster's model takes the
example-weighted mean of its members' deltas through the server optimizer
(the expectation step). A cluster no client chose keeps its model and
optimizer state. ``init`` takes the list of cluster models
(``random_init``, ``ModelKMeansInitializer`` or ``kmeans_init``). The native
HypCluster, compiled into one round, is ``--algorithm=hyp_cluster``.
"""

import functools
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal.fedjax.core import (
  for_each_client,
  models,
  optimizers,
  tree_util,
)
from fedjax_personal.fedjax.core.client_datasets import (
  PaddedBatchHParams,
  ShuffleRepeatBatchHParams,
)
from fedjax_personal.fedjax.core.dataclasses import dataclass
from fedjax_personal.fedjax.core.federated_algorithm import FederatedAlgorithm
from fedjax_personal.fedjax.core.typing import (
  BatchExample,
  OptState,
  Params,
  PRNGKey,
)

__all__ = [
  'ClientDeltaTrainer',
  'ClientParamsTrainer',
  'expectation_step',
  'hyp_cluster',
  'HypClusterEvaluator',
  'kmeans_init',
  'maximization_step',
  'ModelKMeansInitializer',
  'random_init',
  'ServerState',
]


@dataclass
class ServerState:
  """HypCluster's server state between rounds.

  Attributes:
    cluster_params: one model's parameters per cluster.
    opt_states: the server optimizer's state per cluster.
  """

  cluster_params: List[Params]
  opt_states: List[OptState]


def hyp_cluster(
  per_example_loss: Callable[[Params, BatchExample, PRNGKey], jax.Array],
  client_optimizer: optimizers.Optimizer,
  server_optimizer: optimizers.Optimizer,
  maximization_batch_hparams: PaddedBatchHParams,
  expectation_batch_hparams: ShuffleRepeatBatchHParams,
  regularizer: Optional[Callable[[Params], jax.Array]] = None,
) -> FederatedAlgorithm:
  """Federated hypothesis-based clustering (HypCluster), FedJAX's.

  Args:
    per_example_loss: ``(params, batch, key) -> per-example losses``.
    client_optimizer: the client optimizer (state fresh each round).
    server_optimizer: the server optimizer, one state per cluster.
    maximization_batch_hparams: batching of the cluster assignment's
      evaluation.
    expectation_batch_hparams: batching of the clients' training.
    regularizer: optional ``params -> penalty`` added to the losses.

  Returns:
    The ``FederatedAlgorithm``; its ``init`` takes the list of cluster
    models and ``apply`` returns each client's ``{'cluster_id': k}``.
  """

  def init(cluster_params: List[Params]) -> ServerState:
    return ServerState(
      cluster_params, [server_optimizer.init(p) for p in cluster_params]
    )

  evaluator = models.AverageLossEvaluator(per_example_loss, regularizer)
  trainer = ClientDeltaTrainer(
    models.grad(per_example_loss, regularizer), client_optimizer
  )

  def apply(server_state: ServerState, clients):
    client_rngs = [jax.random.split(rng) for _, _, rng in clients]
    client_cluster_ids = maximization_step(
      evaluator=evaluator,
      cluster_params=server_state.cluster_params,
      clients=[
        (cid, dataset, rng[0])
        for (cid, dataset, _), rng in zip(clients, client_rngs)
      ],
      batch_hparams=maximization_batch_hparams,
    )
    cluster_delta_params = expectation_step(
      trainer=trainer,
      cluster_params=server_state.cluster_params,
      client_cluster_ids=client_cluster_ids,
      clients=[
        (cid, dataset, rng[1])
        for (cid, dataset, _), rng in zip(clients, client_rngs)
      ],
      batch_hparams=expectation_batch_hparams,
    )
    cluster_params, opt_states = [], []
    for delta, opt_state, params in zip(
      cluster_delta_params,
      server_state.opt_states,
      server_state.cluster_params,
    ):
      # a cluster no client chose keeps its model and optimizer state
      if delta is not None:
        opt_state, params = server_optimizer.apply(delta, opt_state, params)
      cluster_params.append(params)
      opt_states.append(opt_state)
    diagnostics = {
      cid: {'cluster_id': k} for cid, k in client_cluster_ids.items()
    }
    return ServerState(cluster_params, opt_states), diagnostics

  return FederatedAlgorithm(init, apply)


class _BaseClientTrainer:
  """Trains each client of HypCluster with ``for_each_client``.

  From shared parameters or its own; yields its delta (initial - final) or
  its final parameters."""

  def __init__(self, grad_fn, client_optimizer, return_delta: bool):
    def client_init(shared_input, client_input):
      if shared_input is not None:
        init_params, rng = shared_input, client_input
      else:
        rng, init_params = client_input
      return (
        rng,
        init_params,
        client_optimizer.init(init_params),
        init_params,
      )

    def client_step(state, batch):
      rng, params, opt_state, init_params = state
      rng, use_rng = jax.random.split(rng)
      grads = grad_fn(params, batch, use_rng)
      opt_state, params = client_optimizer.apply(grads, opt_state, params)
      return rng, params, opt_state, init_params

    def client_final(shared_input, state):
      del shared_input
      _, params, _, init_params = state
      if return_delta:
        return jax.tree.map(jnp.subtract, init_params, params)
      return params

    self._train_each_client = for_each_client.for_each_client(
      client_init, client_step, client_final
    )
    self._return_delta = return_delta

  def returns_delta(self) -> bool:
    """Whether the outputs are deltas (else final parameters)."""
    return self._return_delta

  def train_global_params(self, params: Params, clients) -> Iterator:
    """``clients``: ``(client id, batches, key)``; all start from
    ``params``."""
    yield from self._train_each_client(shared_input=params, clients=clients)

  def train_per_client_params(self, clients) -> Iterator:
    """``clients``: ``(client id, batches, key, params)``; each starts from
    its own ``params``."""
    yield from self._train_each_client(
      shared_input=None,
      clients=[
        (cid, batches, (rng, params)) for cid, batches, rng, params in clients
      ],
    )


class ClientDeltaTrainer(_BaseClientTrainer):
  """Client training whose outputs are deltas (initial - final)."""

  def __init__(self, grad_fn, client_optimizer):
    super().__init__(grad_fn, client_optimizer, return_delta=True)


class ClientParamsTrainer(_BaseClientTrainer):
  """Client training whose outputs are the final parameters."""

  def __init__(self, grad_fn, client_optimizer):
    super().__init__(grad_fn, client_optimizer, return_delta=False)


def maximization_step(
  evaluator: models.AverageLossEvaluator,
  cluster_params: List[Params],
  clients,
  batch_hparams: PaddedBatchHParams,
) -> Dict[Any, np.ndarray]:
  """Each client's cluster: the one of lowest average loss (ties: the
  first).

  Args:
    evaluator: the average-loss evaluator.
    cluster_params: the cluster models.
    clients: ``(client id, ClientDataset, key)``.
    batch_hparams: the evaluation's batching.

  Returns:
    ``{client id: cluster index}``.
  """
  losses = _cluster_losses(evaluator, cluster_params, clients, batch_hparams)
  return jax.device_get(_cluster_assignment(losses))


def _cluster_losses(evaluator, cluster_params, clients, batch_hparams):
  """``{client id: [average loss under cluster k]}``; each client's key
  split once per cluster."""
  losses: Dict[Any, List[jax.Array]] = {cid: [] for cid, _, _ in clients}
  rngs = [jax.random.split(rng, len(cluster_params)) for _, _, rng in clients]
  for i, params in enumerate(cluster_params):
    for cid, average_loss in evaluator.evaluate_global_params(
      params,
      [
        (cid, dataset.padded_batch(batch_hparams), rng[i])
        for (cid, dataset, _), rng in zip(clients, rngs)
      ],
    ):
      losses[cid].append(average_loss)
  return losses


@jax.jit
def _cluster_assignment(cluster_losses):
  return {
    cid: jnp.argmin(jnp.stack(losses)) for cid, losses in cluster_losses.items()
  }


def expectation_step(
  trainer: ClientDeltaTrainer,
  cluster_params: List[Params],
  client_cluster_ids: Dict[Any, Any],
  clients,
  batch_hparams: ShuffleRepeatBatchHParams,
) -> List[Optional[Params]]:
  """Each cluster's example-weighted mean delta of its members (None for a
  cluster without examples).

  Args:
    trainer: the client trainer (deltas).
    cluster_params: the cluster models.
    client_cluster_ids: each client's cluster (an int).
    clients: ``(client id, ClientDataset, key)``.
    batch_hparams: the training's batching.

  Returns:
    One mean delta (or None) per cluster.
  """
  num_examples = {cid: len(dataset) for cid, dataset, _ in clients}
  sums = [jax.tree.map(jnp.zeros_like, p) for p in cluster_params]
  counts = [0 for _ in cluster_params]
  for cid, delta in trainer.train_per_client_params(
    [
      (
        cid,
        dataset.shuffle_repeat_batch(batch_hparams),
        rng,
        cluster_params[client_cluster_ids[cid]],
      )
      for cid, dataset, rng in clients
    ]
  ):
    k = client_cluster_ids[cid]
    sums[k] = tree_util.tree_add(
      sums[k], tree_util.tree_weight(delta, num_examples[cid])
    )
    counts[k] += num_examples[cid]
  return [
    tree_util.tree_inverse_weight(s, n) if n > 0 else None
    for s, n in zip(sums, counts)
  ]


@functools.partial(jax.jit, static_argnums=(0, 1))
def random_init(
  num_clusters: int, init: Callable[[PRNGKey], Params], rng: PRNGKey
) -> List[Params]:
  """``num_clusters`` models, each ``init`` of one split of ``rng``."""
  return [init(k) for k in jax.random.split(rng, num_clusters)]


class ModelKMeansInitializer:
  """FedJAX's ``kmeans_init`` from a ``Model``.

  ``kmeans_init`` from a ``Model``: the clients train from one shared
  initialization (``model.init`` of the first split of ``rng``)."""

  def __init__(
    self,
    model: models.Model,
    client_optimizer: optimizers.Optimizer,
    regularizer: Optional[Callable[[Params], jax.Array]] = None,
  ):
    self._model = model
    self._trainer = ClientParamsTrainer(
      models.model_grad(model, regularizer), client_optimizer
    )
    self._evaluator = models.AverageLossEvaluator(
      models.model_per_example_loss(model), regularizer
    )

  def cluster_params(
    self,
    num_clusters: int,
    rng: PRNGKey,
    clients,
    train_batch_hparams: ShuffleRepeatBatchHParams,
    eval_batch_hparams: PaddedBatchHParams,
  ) -> List[Params]:
    """The cluster models; see ``kmeans_init``."""
    init_rng, center_rng = jax.random.split(rng)
    return kmeans_init(
      num_clusters=num_clusters,
      init_params=self._model.init(init_rng),
      clients=clients,
      trainer=self._trainer,
      train_batch_hparams=train_batch_hparams,
      evaluator=self._evaluator,
      eval_batch_hparams=eval_batch_hparams,
      rng=center_rng,
    )


def kmeans_init(
  num_clusters: int,
  init_params: Params,
  clients,
  trainer: ClientParamsTrainer,
  train_batch_hparams: ShuffleRepeatBatchHParams,
  evaluator: models.AverageLossEvaluator,
  eval_batch_hparams: PaddedBatchHParams,
  rng: PRNGKey,
) -> List[Params]:
  """HypCluster's k-means++-like initialization, FedJAX's: every client
  trains from ``init_params``; the first center is a random client's model
  (``rng``, over the sorted client ids), then, repeatedly, the model of the
  client whose best loss over the centers so far is the worst.

  Args:
    num_clusters: how many centers (> 0).
    init_params: every client's starting point.
    clients: ``(client id, ClientDataset, key)``; each key split into
      ``num_clusters``: the first trains, the others evaluate.
    trainer: the client trainer (final parameters).
    train_batch_hparams: the training's batching.
    evaluator: the average-loss evaluator.
    eval_batch_hparams: the evaluation's batching.
    rng: chooses the first center.

  Returns:
    The cluster models.

  Raises:
    ValueError: ``num_clusters`` <= 0.
  """
  if num_clusters <= 0:
    raise ValueError(f'num_clusters should be > 0, got {num_clusters}')
  first = jax.random.choice(rng, len(clients))
  client_rngs = [jax.random.split(k, num_clusters) for _, _, k in clients]
  client_params = dict(
    trainer.train_global_params(
      init_params,
      [
        (cid, dataset.shuffle_repeat_batch(train_batch_hparams), k[0])
        for (cid, dataset, _), k in zip(clients, client_rngs)
      ],
    )
  )
  centers = [client_params[sorted(client_params)[first]]]
  best_losses = {cid: jnp.inf for cid in client_params}
  for i in range(1, num_clusters):
    new_losses = dict(
      evaluator.evaluate_global_params(
        centers[-1],
        [
          (cid, dataset.padded_batch(eval_batch_hparams), k[i])
          for (cid, dataset, _), k in zip(clients, client_rngs)
        ],
      )
    )
    best_losses = jax.tree.map(min, best_losses, jax.device_get(new_losses))
    worst = max(best_losses, key=lambda c: best_losses[c])
    centers.append(client_params[worst])
  return centers


class HypClusterEvaluator:
  """Evaluates each test client on the cluster its training data chooses."""

  def __init__(
    self,
    model: models.Model,
    regularizer: Optional[Callable[[Params], jax.Array]] = None,
  ):
    self._maximization_step_evaluator = models.AverageLossEvaluator(
      models.model_per_example_loss(model), regularizer
    )
    self._model_evaluator = models.ModelEvaluator(model)

  def evaluate_clients(
    self,
    cluster_params: List[Params],
    train_clients,
    test_clients: Iterable,
    batch_hparams: PaddedBatchHParams,
  ) -> Iterator:
    """``(client id, metrics)`` of each test client under the cluster
    chosen on its training data (``train_clients``: ``(client id,
    ClientDataset, key)``)."""
    chosen = maximization_step(
      evaluator=self._maximization_step_evaluator,
      cluster_params=cluster_params,
      clients=train_clients,
      batch_hparams=batch_hparams,
    )
    yield from self._model_evaluator.evaluate_per_client_params(
      [
        (cid, dataset.padded_batch(batch_hparams), cluster_params[chosen[cid]])
        for cid, dataset in test_clients
      ]
    )
