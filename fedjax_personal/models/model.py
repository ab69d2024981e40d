"""The pure model: ``Model`` (``init`` / ``apply`` and what training and
evaluation read of it) and ``from_flax``, which makes one of a Flax Linen
module (its ``train`` argument, dropout keys, batch statistics)."""

import dataclasses
import inspect
import math
from typing import Any, Callable, Dict, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_personal import numerics
from fedjax_personal.errors import ConfigError
from fedjax_personal.models.head import (
  HeadSplit,
  capture_features,
  find_head,
  module_calls,
)

__all__ = ['DROPOUT_RNG', 'from_flax', 'Model', 'takes_train']


@dataclasses.dataclass(frozen=True)
class Model:
  """A pure model: ``init(key) -> params`` and ``apply(params, x) -> logits``.

  Attributes:
    name: registry name.
    init: PRNG key -> parameter pytree.
    apply: (params, inputs [B, ...]) -> logits [B, ..., C].
    module: the Flax module (for inspection), or None.
    loss: 'cross_entropy' (classification, integer targets) or 'squared'
      (least squares, float targets).
    unscored_targets: class ids counted in the loss but not in the accuracy
      (next-word prediction's PAD, BOS, EOS, OOV: ``scoring_only_words``).
    top_k: when > 0, evaluations also report the top-k accuracy.
    unpredicted: class ids the accuracy's prediction never takes (their
      logits masked before the argmax and the top-k; FedJAX's
      ``accuracy_in_vocab``: PAD, BOS, EOS, OOV); the loss is unchanged.
    accuracy_definition: what the accuracy counts, in words (printed).
    train_apply: ``(params, x, key) -> logits`` for training batches when
      the inputs are transformed at random (``inputs.with_inputs``); None:
      ``apply``.
    inputs: the ``inputs.InputTransform`` ``apply`` and ``train_apply`` see
      their inputs through, or None.
    matmul_precision: the precision ``apply``, ``train_apply`` and
      ``features`` are traced at (``at_matmul_precision``), or None: JAX's
      setting where they are traced.
    loss_denominator: what a batch's summed training loss is divided by
      (``LOSS_DENOMINATORS``): 'targets' (its counted targets: the mean loss
      of a target), 'examples' (its real examples: a sequence's loss summed
      over its tokens, FedJAX's Stack Overflow ``train_loss``) or
      'positions' (real examples x sequence length: a sequence's mean over
      all its positions, padded ones included, FedJAX's Shakespeare
      ``train_loss``). Evaluations report the mean loss of a target
      whatever it is.
    collections: the module's mutable collections kept with its parameters
      (Flax's ``batch_stats``): the parameter pytree is then the variables
      ``{'params': ..., 'batch_stats': ...}``, averaged and kept per client
      as the parameters are (the PyTorch libraries' ``state_dict``); () for
      a stateless model, whose pytree is Flax's ``params`` alone.
    train_arg: the module's ``__call__`` takes Flax's ``train`` argument
      (``nn.Dropout(deterministic=not train)``, ``nn.BatchNorm(
      use_running_average=not train)``): ``apply`` passes ``train=False``,
      training passes ``train=True`` with a dropout key.
    train_state: ``(params, x, key, mask) -> (logits, new collections)``:
      a training forward pass of a stateful model (``collections``), its
      batch statistics over the real examples (``mask``) only; None for a
      stateless one.
    mode_arg: the argument of ``MODE_ARGUMENTS`` by which its module tells
      training from evaluation (``train`` or Flax's ``deterministic``, ...),
      or None.
    reads: what a user's builder read while building it: files, modules
      and environment variables (``user_reads.Reads.record``), part of the
      run identity; None for a built-in model.
    head: where the body ends and the head begins (``head.HeadSplit``: the
      classifier module), or None for a model without one (a tied decoder,
      a ``Model`` built by hand).
  """

  name: str
  init: Callable[[jax.Array], Any]
  apply: Callable[[Any, Any], Any]
  module: Any = None
  loss: str = 'cross_entropy'
  unscored_targets: tuple = ()
  top_k: int = 0
  unpredicted: tuple = ()
  accuracy_definition: str = ''
  train_apply: Optional[Callable[[Any, jax.Array, jax.Array], jax.Array]] = None
  inputs: Any = None
  matmul_precision: Optional[str] = None
  loss_denominator: str = 'targets'
  collections: Tuple[str, ...] = ()
  train_arg: bool = False
  train_state: Optional[
    Callable[[Any, jax.Array, jax.Array, jax.Array], Tuple[jax.Array, Any]]
  ] = None
  reads: Optional[dict] = None
  mode_arg: Optional[str] = None
  head: Optional[HeadSplit] = None

  @property
  def evaluate_kwargs(self) -> dict:
    """What ``module.apply`` takes beside the variables and inputs for an
    evaluation (``{'train': False}`` for a module with ``train_arg``,
    ``{'deterministic': True}`` for one written with Flax's
    ``deterministic``)."""
    return _mode(self.mode_arg or ('train' if self.train_arg else None), False)

  def param_shapes(self):
    """The parameters' shapes and dtypes (``jax.ShapeDtypeStruct`` leaves),
    nothing computed."""
    return jax.eval_shape(self.init, jax.random.key(0))

  def variables(self, params):
    """The Flax variables of ``params`` (``{'params': params}``, or
    ``params`` itself for a model with ``collections``).

    Args:
      params: the model's parameter pytree.

    Returns:
      The variables dict ``module.apply`` takes.
    """
    return params if self.collections else {'params': params}

  def with_state(self, params, state):
    """``params`` with its ``collections`` replaced by ``state`` (what a
    training forward pass returned); ``params`` as it is when ``state`` is
    None.

    Args:
      params: the model's parameter pytree.
      state: ``{collection: values}`` or None.

    Returns:
      The parameter pytree.
    """
    if state is None or not self.collections:
      return params
    return {**params, **{c: state[c] for c in self.collections}}

  def loss_divisor(self, counted_targets, mask, y):
    """What a batch's summed training loss is divided by
    (``loss_denominator``): its counted targets; its real examples (FedJAX's
    ``grad``: the mean over real examples of a per-example loss, here a
    sequence's summed token losses); or its real examples times the
    positions of one (a sequence's token losses averaged over all its
    positions, as FedJAX's Shakespeare ``train_loss`` does). At least 1 (a
    batch of nothing has loss 0).

    Args:
      counted_targets: the batch's counted targets (``LossStats.count``).
      mask: [B] its real examples.
      y: its targets [B, ...].

    Returns:
      The divisor, a scalar.
    """
    if self.loss_denominator == 'targets':
      return jnp.maximum(counted_targets, 1.0)
    examples = jnp.sum(mask.astype(jnp.float32))
    if self.loss_denominator == 'positions':
      examples = examples * math.prod(y.shape[1:])
    return jnp.maximum(examples, 1.0)

  def require_head(self, needs: str) -> HeadSplit:
    """This model's ``HeadSplit``, or a ``ConfigError`` naming ``--model``
    and what needs one.

    Args:
      needs: who needs it, in words (``'--algorithm=fedrod'``).

    Returns:
      The ``HeadSplit``.
    """
    if self.head is None:
      raise ConfigError(
        'model',
        f'{needs} reads a body and a head, and model '
        f'{self.name!r} has no head (no layer with parameters returns its '
        'output); pick another --model, or register it with '
        "head='<module path>' (docs/add_a_model.md)",
      )
    return self.head

  def and_features(self, fn: Callable[..., Any]) -> Callable[..., tuple]:
    """``fn`` (a forward pass of this model: ``apply``, ``train_apply``,
    ...) returning ``(its result, features)``, the features being the
    head's input in that same pass (``head.capture_features``): one pass.

    Args:
      fn: a function that runs this model's module once.

    Returns:
      The function returning ``(result, features)``.
    """
    head = self.require_head('the features of a forward pass')

    def both(*args, **kwargs):
      with capture_features(head) as seen:
        out = fn(*args, **kwargs)
      return out, seen[-1]

    return both

  def features(self, params, x):
    """The representation the head reads (the penultimate layer's output),
    in evaluation mode.

    Args:
      params: the model's parameters.
      x: inputs [B, ...].

    Returns:
      The features [B, ..., D].
    """
    return self.and_features(self.apply)(params, x)[1]

  def at_matmul_precision(self, name: str) -> 'Model':
    """This model with ``apply`` and ``train_apply`` traced at matmul
    precision ``name`` (``numerics.scoped``), whatever JAX's setting where
    they are traced.

    Args:
      name: one of ``numerics.MATMUL_PRECISIONS``.

    Returns:
      The ``Model``.
    """
    if self.matmul_precision == name:
      return self
    train_apply = (
      None
      if self.train_apply is None
      else numerics.scoped(self.train_apply, name)
    )
    train_state = (
      None
      if self.train_state is None
      else numerics.scoped(self.train_state, name)
    )
    return dataclasses.replace(
      self,
      apply=numerics.scoped(self.apply, name),
      train_apply=train_apply,
      train_state=train_state,
      matmul_precision=name,
    )

  def scoring_only_words(
    self, ids, top_k: int = 5, unpredicted=(), definition: str = ''
  ) -> 'Model':
    """This model with accuracy over the targets not in ``ids``, predictions
    never in ``unpredicted``, and the top-``top_k`` accuracy reported
    (next-word prediction); ``definition`` names it."""
    return dataclasses.replace(
      self,
      unscored_targets=tuple(int(i) for i in ids),
      top_k=top_k,
      unpredicted=tuple(int(i) for i in unpredicted),
      accuracy_definition=definition,
    )

  def forward_only(self) -> 'Model':
    """This model for a forward pass alone, outside a loop (a pooled
    evaluation's chunks): on a CPU a module whose ``conv_impl`` is ``auto``
    convolves there with XLA's own convolution, which runs a forward pass
    alone near the matmul peak (Reddi et al.'s EMNIST CNN, 2 cores: 95-116
    GFLOP/s at 64-1,024 images, ``tiled`` 35-61,
    ``benchmarks/probes/forward_conv.txt``; inside a loop of steps or
    in a gradient XLA's is the slow one, so training keeps ``auto``'s
    choice). The same parameters and, up to float reassociation, the same
    logits; any other model is returned as it is.

    Returns:
      The ``Model``.
    """
    module = self.module
    if (
      getattr(module, 'conv_impl', None) != 'auto'
      or jax.default_backend() != 'cpu'
    ):
      return self
    forward, transform = module.clone(conv_impl='xla'), self.inputs
    variables, kw = self.variables, self.evaluate_kwargs

    def apply(params, x):
      if transform is not None:
        x = transform.evaluate(x)
      return forward.apply(variables(params), x, **kw)

    if self.matmul_precision is not None:
      apply = numerics.scoped(apply, self.matmul_precision)
    return dataclasses.replace(self, apply=apply, module=forward)

  def starting_from(self, params) -> 'Model':
    """This model with ``init`` returning ``params`` whatever the key: every
    run, trial and client starts from these weights (``--init_weights``)."""
    params = jax.tree.map(jnp.asarray, params)
    return dataclasses.replace(self, init=lambda key: params)


#: The Flax rng stream ``nn.Dropout`` draws from.
DROPOUT_RNG = 'dropout'
#: Collections a module may create that are not model state.
_NOT_STATE = ('params', 'intermediates', 'losses')


#: The arguments by which a Linen module's ``__call__`` tells training from
#: evaluation, and the value each has in training: Flax's ``train``, its
#: ``deterministic`` (``not train``), Keras' ``training``, Haiku's
#: ``is_training``.
MODE_ARGUMENTS = {
  'train': True,
  'training': True,
  'is_training': True,
  'deterministic': False,
}


def mode_argument(module: nn.Module) -> Optional[str]:
  """The argument of ``MODE_ARGUMENTS`` a Linen module's ``__call__``
  takes, or None.

  Args:
    module: a Flax Linen module.

  Returns:
    Its name, or None.
  """
  try:
    params = inspect.signature(type(module).__call__).parameters
  except (TypeError, ValueError):
    return None
  return next((a for a in MODE_ARGUMENTS if a in params), None)


def takes_train(module: nn.Module) -> bool:
  """Whether a Linen module's ``__call__`` tells training from evaluation
  (``mode_argument``: ``train``, ``deterministic``, ...).

  Args:
    module: a Flax Linen module.

  Returns:
    True when it takes one of ``MODE_ARGUMENTS``.
  """
  return mode_argument(module) is not None


def _mode(argument: Optional[str], train: bool) -> Dict[str, Any]:
  """``{argument: its value}`` in training (``train``) or evaluation."""
  if argument is None:
    return {}
  return {argument: train if MODE_ARGUMENTS[argument] else not train}


def _dropout_rates(seen: list):
  """A Flax method interceptor noting the rate of every ``nn.Dropout`` of a
  positive rate that is called (``from_flax``: a module with dropout that
  cannot be told it trains)."""

  def interceptor(next_fun, args, kwargs, context):
    if isinstance(context.module, nn.Dropout) and context.module.rate > 0:
      seen.append(context.module.rate)
    return next_fun(*args, **kwargs)

  return interceptor


def _batch_norm_mask(mask):
  """A Flax method interceptor giving every ``nn.BatchNorm`` (and every
  module whose class says ``masks_examples``) of a training forward pass the
  batch's real examples as its ``mask``: a padded row never
  enters the batch statistics (PyTorch's last, smaller batch)."""

  def interceptor(next_fun, args, kwargs, context):
    if (
      (
        isinstance(context.module, nn.BatchNorm)
        or getattr(type(context.module), 'masks_examples', False)
      )
      and context.method_name == '__call__'
      and kwargs.get('mask') is None
      and args
      and jnp.ndim(args[0]) >= 1
      and jnp.shape(args[0])[0] == mask.shape[0]
    ):
      x = args[0]
      kwargs = {**kwargs, 'mask': mask.reshape((-1,) + (1,) * (x.ndim - 1))}
    return next_fun(*args, **kwargs)

  return interceptor


def from_flax(
  name: str, module: nn.Module, sample_x, head: Optional[str] = None
) -> Model:
  """Wraps a Linen module into the pure (init, apply) pair.

  A module whose ``__call__`` takes ``train`` (Flax's convention:
  ``nn.Dropout(rate, deterministic=not train)``, ``nn.BatchNorm(
  use_running_average=not train)``) is evaluated with ``train=False`` and
  trained with ``train=True`` and a dropout key (``rngs={'dropout': key}``,
  the training step's own: ``core.training``). Mutable collections its
  ``init`` creates (``batch_stats``) are kept with the parameters
  (``Model.collections``): a training step's forward pass updates them, the
  batch statistics over the batch's real examples only.

  Args:
    name: the model's name.
    module: a Flax Linen module.
    sample_x: one input batch (shapes the parameters).
    head: the path of the module that is the model's head ('/'-joined
      names, ``Model.head``), or None: the last module with parameters of
      its own whose call returns the model's output (``head.find_head``).

  Returns:
    The ``Model``.
  """
  sample_x = jnp.asarray(sample_x)[:1]
  argument = mode_argument(module)
  train_arg = argument is not None
  evaluate = _mode(argument, False)
  training = _mode(argument, True)
  dropouts: list = []
  calls: list = []
  with nn.intercept_methods(_dropout_rates(dropouts)):
    with nn.intercept_methods(module_calls(calls)):
      output, made = jax.eval_shape(
        lambda k: module.init_with_output(
          {'params': k, DROPOUT_RNG: k}, sample_x, **evaluate
        ),
        jax.random.key(0),
      )
  try:
    split = find_head(
      calls, made.get('params', {}), getattr(output, 'shape', ()), head
    )
  except ValueError as e:
    raise ConfigError('model', f'model {name!r}: {e}') from None
  if not train_arg and dropouts:
    raise ConfigError(
      'model',
      f'model {name!r} has dropout but its __call__ takes no train argument, '
      "so it could never be told it trains: give it one (Flax's convention, "
      'nn.Dropout(rate, deterministic=not train))',
    )
  collections = tuple(sorted(c for c in made if c not in _NOT_STATE))
  if collections and not train_arg:
    raise ConfigError(
      'model',
      f'model {name!r} has mutable collections {list(collections)} but '
      "its __call__ takes no train argument: give it one (Flax's convention, "
      'nn.BatchNorm(use_running_average=not train))',
    )
  if collections:
    keep = ('params',) + collections
    init = lambda key: {
      c: v
      for c, v in module.init(key, sample_x, **evaluate).items()
      if c in keep
    }
    apply = lambda params, x: module.apply(params, x, **evaluate)
  else:
    init = lambda key: module.init(key, sample_x, **evaluate)['params']
    apply = lambda params, x: module.apply({'params': params}, x, **evaluate)

  def train_apply(params, x, key):
    return module.apply(
      {'params': params}, x, rngs={DROPOUT_RNG: key}, **training
    )

  def train_state(params, x, key, mask):
    with nn.intercept_methods(_batch_norm_mask(mask)):
      return module.apply(
        params,
        x,
        rngs={DROPOUT_RNG: key},
        mutable=list(collections),
        **training,
      )

  return Model(
    name=name,
    init=init,
    apply=apply,
    module=module,
    train_apply=train_apply if train_arg and not collections else None,
    collections=collections,
    train_arg=train_arg,
    train_state=train_state if collections else None,
    mode_arg=argument,
    head=split,
  )
