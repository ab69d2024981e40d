"""FedJAX's ``fedjax.Model`` and what works on it: models from Haiku or
stax, gradients of the mean per-example loss, evaluation of metrics and of
the average loss, over batches or over each client (``for_each_client``).

Haiku is optional (``pip install 'fedjax_personal[fedjax]'``):
``create_model_from_haiku`` takes a ``haiku.Transformed`` the caller built,
so this module does not import Haiku.
"""

import functools
from typing import (
  Any,
  Callable,
  Dict,
  Iterable,
  Iterator,
  Mapping,
  Optional,
  Tuple,
)

import jax
import jax.numpy as jnp

from fedjax_personal.fedjax.core import for_each_client, metrics
from fedjax_personal.fedjax.core.client_datasets import EXAMPLE_MASK_KEY
from fedjax_personal.fedjax.core.dataclasses import dataclass
from fedjax_personal.fedjax.core.typing import (
  BatchExample,
  BatchPrediction,
  Params,
  PRNGKey,
)

__all__ = [
  'AverageLossEvaluator',
  'create_model_from_haiku',
  'create_model_from_stax',
  'evaluate_average_loss',
  'evaluate_model',
  'grad',
  'Model',
  'model_grad',
  'model_per_example_loss',
  'ModelEvaluator',
]

BatchTrainOutput = jax.Array
BatchEvalPrediction = BatchPrediction
PerExampleLoss = Callable[[Params, BatchExample, PRNGKey], jax.Array]
Regularizer = Callable[[Params], jax.Array]


@dataclass
class Model:
  """A model as FedJAX's: pure functions and its metrics.

  Compared (and hashed) by identity, as FedJAX's, so that it can be a static
  argument of ``jax.jit``.

  Attributes:
    init: ``key -> params``.
    apply_for_train: ``(params, batch, key) -> train output`` (dropout on).
    apply_for_eval: ``(params, batch) -> predictions``.
    train_loss: ``(batch, train output) -> per-example loss [B]``.
    eval_metrics: name -> ``metrics.Metric``.
  """

  init: Callable[[PRNGKey], Params]
  apply_for_train: Callable[[Params, BatchExample, PRNGKey], BatchTrainOutput]
  apply_for_eval: Callable[[Params, BatchExample], BatchEvalPrediction]
  train_loss: Callable[[BatchExample, BatchTrainOutput], jax.Array]
  eval_metrics: Mapping[str, metrics.Metric]

  def __hash__(self) -> int:
    return id(self)

  def __eq__(self, other: Any) -> bool:
    return self is other


def create_model_from_haiku(
  transformed_forward_pass: Any,
  sample_batch: BatchExample,
  train_loss: Callable[[BatchExample, BatchTrainOutput], jax.Array],
  eval_metrics: Optional[Mapping[str, metrics.Metric]] = None,
  train_kwargs: Optional[Mapping[str, Any]] = None,
  eval_kwargs: Optional[Mapping[str, Any]] = None,
) -> Model:
  """A ``Model`` from a ``haiku.Transformed`` forward pass over a batch.

  Args:
    transformed_forward_pass: ``hk.transform(forward)``, ``forward(batch,
      **kwargs)``.
    sample_batch: a batch to initialize with.
    train_loss: ``(batch, train output) -> per-example loss``.
    eval_metrics: name -> metric.
    train_kwargs: keyword arguments of the forward pass in training.
    eval_kwargs: keyword arguments of the forward pass in evaluation.

  Returns:
    The ``Model``.
  """
  train_kwargs, eval_kwargs = train_kwargs or {}, eval_kwargs or {}

  @jax.jit
  def init(rng):
    return transformed_forward_pass.init(rng, sample_batch)

  @jax.jit
  def apply_for_train(params, batch, rng=None):
    return transformed_forward_pass.apply(params, rng, batch, **train_kwargs)

  @jax.jit
  def apply_for_eval(params, batch):
    return transformed_forward_pass.apply(params, None, batch, **eval_kwargs)

  return Model(
    init, apply_for_train, apply_for_eval, train_loss, eval_metrics or {}
  )


def create_model_from_stax(
  stax_init: Callable[..., Any],
  stax_apply: Callable[..., jax.Array],
  sample_shape: Tuple[int, ...],
  train_loss: Callable[[BatchExample, BatchTrainOutput], jax.Array],
  eval_metrics: Optional[Mapping[str, metrics.Metric]] = None,
  train_kwargs: Optional[Mapping[str, Any]] = None,
  eval_kwargs: Optional[Mapping[str, Any]] = None,
  input_key: str = 'x',
) -> Model:
  """A ``Model`` from ``jax.example_libraries.stax``'s ``(init, apply)``.

  Args:
    stax_init: ``(key, input shape) -> (output shape, params)``.
    stax_apply: ``(params, inputs, **kwargs) -> outputs``.
    sample_shape: the input's shape (with a batch axis, -1 allowed).
    train_loss: ``(batch, train output) -> per-example loss``.
    eval_metrics: name -> metric.
    train_kwargs: keyword arguments of ``stax_apply`` in training.
    eval_kwargs: keyword arguments of ``stax_apply`` in evaluation.
    input_key: the batch's input feature.

  Returns:
    The ``Model``.
  """
  train_kwargs, eval_kwargs = train_kwargs or {}, eval_kwargs or {}

  @jax.jit
  def init(rng):
    return stax_init(rng, sample_shape)[1]

  @jax.jit
  def apply_for_train(params, batch, rng=None):
    return stax_apply(params, batch[input_key], rng=rng, **train_kwargs)

  @jax.jit
  def apply_for_eval(params, batch):
    return stax_apply(params, batch[input_key], **eval_kwargs)

  return Model(
    init, apply_for_train, apply_for_eval, train_loss, eval_metrics or {}
  )


def _is_stat(value) -> bool:
  return isinstance(value, metrics.Stat)


def _batch_mask(batch: BatchExample) -> jax.Array:
  if EXAMPLE_MASK_KEY in batch:
    return jnp.asarray(batch[EXAMPLE_MASK_KEY]).astype(jnp.bool_)
  return jnp.ones([len(next(iter(batch.values())))], dtype=jnp.bool_)


@functools.partial(jax.jit, static_argnums=0)
def _evaluate_model_step(model: Model, params, batch, stat):
  pred = model.apply_for_eval(params, batch)
  mask = _batch_mask(batch)
  new = {
    k: metrics.evaluate_batch(metric, batch, pred, mask)
    for k, metric in model.eval_metrics.items()
  }
  return jax.tree.map(lambda a, b: a.merge(b), stat, new, is_leaf=_is_stat)


def evaluate_model(
  model: Model, params: Params, batches: Iterable[BatchExample]
) -> Dict[str, jax.Array]:
  """``model.eval_metrics`` over ``batches`` (examples whose mask is false
  left out).

  Args:
    model: the model.
    params: its parameters.
    batches: the batches (``padded_batch``'s, with their mask).

  Returns:
    Metric name -> value.
  """
  stat = {k: metric.zero() for k, metric in model.eval_metrics.items()}
  for batch in batches:
    stat = _evaluate_model_step(model, params, batch, stat)
  return jax.tree.map(lambda s: s.result(), stat, is_leaf=_is_stat)


class ModelEvaluator:
  """``evaluate_model`` for each client, with one model or each client's."""

  def __init__(self, model: Model):
    def client_init(shared_input, client_input):
      params = shared_input if shared_input is not None else client_input
      return params, {k: m.zero() for k, m in model.eval_metrics.items()}

    def client_step(state, batch):
      params, stat = state
      return params, _evaluate_model_step(model, params, batch, stat)

    def client_final(shared_input, state):
      del shared_input
      return {k: v.result() for k, v in state[1].items()}

    self._each = for_each_client.for_each_client(
      client_init, client_step, client_final
    )

  def evaluate_global_params(
    self, params: Params, clients: Iterable[Tuple[Any, Iterable[BatchExample]]]
  ) -> Iterator[Tuple[Any, Dict[str, jax.Array]]]:
    """(client id, metrics) of ``params`` on each client's batches."""
    yield from self._each(params, [(cid, b, None) for cid, b in clients])

  def evaluate_per_client_params(
    self, clients: Iterable[Tuple[Any, Iterable[BatchExample], Params]]
  ) -> Iterator[Tuple[Any, Dict[str, jax.Array]]]:
    """(client id, metrics) of each client's own parameters."""
    yield from self._each(None, clients)


def model_per_example_loss(model: Model) -> PerExampleLoss:
  """The model's training loss per example.

  Args:
    model: the model.

  Returns:
    ``(params, batch, key) -> model.train_loss`` of its training output.
  """

  def per_example_loss(params, batch, rng):
    return model.train_loss(batch, model.apply_for_train(params, batch, rng))

  return per_example_loss


def _safe_div(a, b):
  return metrics.safe_div(a, b)


@functools.partial(jax.jit, static_argnums=0)
def _average_loss_step(per_example_loss, params, batch, rng, total, count):
  rng, use_rng = jax.random.split(rng)
  loss = per_example_loss(params, batch, use_rng)
  if EXAMPLE_MASK_KEY in batch:
    mask = batch[EXAMPLE_MASK_KEY]
    return rng, total + jnp.vdot(mask, loss), count + jnp.sum(mask)
  return rng, total + jnp.sum(loss), count + len(loss)


@functools.partial(jax.jit, static_argnums=0)
def _final_average_loss(regularizer, params, total, count):
  loss = _safe_div(total, count)
  return loss if regularizer is None else loss + regularizer(params)


def evaluate_average_loss(
  params: Params,
  batches: Iterable[BatchExample],
  rng: PRNGKey,
  per_example_loss: PerExampleLoss,
  regularizer: Optional[Regularizer] = None,
) -> jax.Array:
  """The mean per-example loss over ``batches``, plus ``regularizer``.

  Args:
    params: the parameters.
    batches: the batches (masked examples left out).
    rng: split once per batch.
    per_example_loss: ``(params, batch, key) -> loss per example``.
    regularizer: ``params -> penalty``, or None.

  Returns:
    The average loss.
  """
  total, count = 0, 0
  for batch in batches:
    rng, total, count = _average_loss_step(
      per_example_loss, params, batch, rng, total, count
    )
  return _final_average_loss(regularizer, params, total, count)


class AverageLossEvaluator:
  """``evaluate_average_loss`` for each client."""

  def __init__(
    self,
    per_example_loss: PerExampleLoss,
    regularizer: Optional[Regularizer] = None,
  ):
    def client_init(shared_input, client_input):
      if shared_input is not None:
        params, rng = shared_input, client_input
      else:
        rng, params = client_input
      return rng, params, 0.0, 0.0

    def client_step(state, batch):
      rng, params, total, count = state
      rng, total, count = _average_loss_step(
        per_example_loss, params, batch, rng, total, count
      )
      return rng, params, total, count

    def client_final(shared_input, state):
      del shared_input
      _, params, total, count = state
      return _final_average_loss(regularizer, params, total, count)

    self._each = for_each_client.for_each_client(
      client_init, client_step, client_final
    )

  def evaluate_global_params(
    self,
    params: Params,
    clients: Iterable[Tuple[Any, Iterable[BatchExample], PRNGKey]],
  ) -> Iterator[Tuple[Any, jax.Array]]:
    """(client id, average loss) of ``params``."""
    yield from self._each(params, clients)

  def evaluate_per_client_params(
    self, clients: Iterable[Tuple[Any, Iterable[BatchExample], PRNGKey, Params]]
  ) -> Iterator[Tuple[Any, jax.Array]]:
    """(client id, average loss) of each client's own parameters."""
    yield from self._each(
      None, [(cid, b, (rng, p)) for cid, b, rng, p in clients]
    )


def grad(
  per_example_loss: PerExampleLoss, regularizer: Optional[Regularizer] = None
) -> Callable[[Params, BatchExample, PRNGKey], Params]:
  """The jitted gradient of the mean per-example loss (over a batch's
  unmasked examples) plus ``regularizer``.

  Args:
    per_example_loss: ``(params, batch, key) -> loss per example``.
    regularizer: ``params -> penalty``, or None.

  Returns:
    ``(params, batch, key) -> gradients``.
  """

  def scalar_loss(params, batch, rng):
    loss = per_example_loss(params, batch, rng)
    if EXAMPLE_MASK_KEY in batch:
      mask = batch[EXAMPLE_MASK_KEY]
      value = _safe_div(jnp.vdot(loss, mask), jnp.sum(mask))
    else:
      value = jnp.mean(loss)
    return value if regularizer is None else value + regularizer(params)

  return jax.jit(jax.grad(scalar_loss))


def model_grad(
  model: Model, regularizer: Optional[Regularizer] = None
) -> Callable[[Params, BatchExample, PRNGKey], Params]:
  """``grad(model_per_example_loss(model), regularizer)``.

  Args:
    model: the model.
    regularizer: ``params -> penalty``, or None.

  Returns:
    ``(params, batch, key) -> gradients``.
  """
  return grad(model_per_example_loss(model), regularizer)
