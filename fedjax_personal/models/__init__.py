"""Models: the registry (``create_model``) and the pure (init, apply) pair the
engine uses.

``layers`` holds the building blocks (convolutions as XLA ops or matmuls,
pooling, dense, adapters, LSTM cells), ``initializers`` the initialisation
conventions of Flax, PyTorch and Keras, ``architectures`` the networks, and
``weights`` reading initial parameters from a ``.npz`` or a PyTorch state
dict.
"""

import dataclasses
import inspect
import math
import os
import traceback
from typing import Any, Callable, Dict, Optional, Protocol, Tuple, Type, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_personal import numerics
from fedjax_personal.errors import ConfigError
from fedjax_personal.hparams import Declared, hparam
from fedjax_personal.models import initializers
from fedjax_personal.models.architectures import (CNN, CharLSTM, LeNet5, LogisticRegression, MLP,
                                                  flatten)
from fedjax_personal.models.initializers import INITS
from fedjax_personal.models.seed_models import TRANSFORMER_SIZES, ResNetGN, TransformerLM
from fedjax_personal.models.layers import (CONV_IMPLS, TILE_BYTES, TILE_MIN_BYTES, Adapter, Conv,
                                           Dense, LSTMCell, _strided_pool, as_float, avg_pool_2x2,
                                           batch_chunk, conv_as_matmul, conv_layout, from_layout,
                                           max_pool, max_pool_2x2, resolve_conv_impl, tile_budget,
                                           to_layout)


__all__ = ['DROPOUT_RNG', 'ModelBuilder', 'ModelOptions', 'model_names', 'NoModelOptions',
           'option_classes', 'options_class', 'register', 'REGISTERED', 'RegisteredModel',
           'takes_train', 'Adapter', 'as_float', 'avg_pool_2x2', 'batch_chunk', 'CharLSTM', 'CNN', 'ConfigError',
           'Conv', 'conv_as_matmul', 'CONV_IMPLS', 'conv_layout', 'create_model', 'Dense',
           'flatten', 'from_flax', 'from_layout', 'initializers', 'INITS', 'LeNet5',
           'LogisticRegression', 'LOSS_DENOMINATORS', 'LSTMCell', 'max_pool', 'max_pool_2x2', 'MLP',
           'Model', 'MODELS', 'ModelConfig', 'build_model', 'num_params', 'REFERENCE', 'ResNetGN',
           'resolve_conv_impl', 'tile_budget', 'TILE_BYTES', 'TILE_MIN_BYTES', 'to_layout',
           'TRANSFORMER_SIZES', 'TransformerLM']


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
  """
  name: str
  init: Callable[[jax.Array], Any]
  apply: Callable[[Any, jax.Array], jax.Array]
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
  train_state: Optional[Callable[[Any, jax.Array, jax.Array, jax.Array],
                                 Tuple[jax.Array, Any]]] = None

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

  def features(self, params, x):
    """The penultimate representation (models with a ``features`` method)."""
    if self.inputs is not None:
      x = self.inputs.evaluate(x)
    if self.matmul_precision is None:
      return self.module.apply(self.variables(params), x, method='features')
    with numerics.precision(self.matmul_precision):
      return self.module.apply(self.variables(params), x, method='features')

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
    train_apply = (None if self.train_apply is None
                   else numerics.scoped(self.train_apply, name))
    train_state = (None if self.train_state is None
                   else numerics.scoped(self.train_state, name))
    return dataclasses.replace(self, apply=numerics.scoped(self.apply, name),
                               train_apply=train_apply, train_state=train_state,
                               matmul_precision=name)

  def scoring_only_words(self, ids, top_k: int = 5, unpredicted=(),
                         definition: str = '') -> 'Model':
    """This model with accuracy over the targets not in ``ids``, predictions
    never in ``unpredicted``, and the top-``top_k`` accuracy reported
    (next-word prediction); ``definition`` names it."""
    return dataclasses.replace(self, unscored_targets=tuple(int(i) for i in ids), top_k=top_k,
                               unpredicted=tuple(int(i) for i in unpredicted),
                               accuracy_definition=definition)

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
    if (getattr(module, 'conv_impl', None) != 'auto' or jax.default_backend() != 'cpu'):
      return self
    forward, transform = module.clone(conv_impl='xla'), self.inputs
    variables, kw = self.variables, ({'train': False} if self.train_arg else {})

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


def takes_train(module: nn.Module) -> bool:
  """Whether a Linen module's ``__call__`` takes Flax's ``train`` argument.

  Args:
    module: a Flax Linen module.

  Returns:
    True when ``train`` is among its parameters.
  """
  try:
    return 'train' in inspect.signature(type(module).__call__).parameters
  except (TypeError, ValueError):
    return False


def _batch_norm_mask(mask):
  """A Flax method interceptor giving every ``nn.BatchNorm`` of a training
  forward pass the batch's real examples as its ``mask``: a padded row never
  enters the batch statistics (PyTorch's last, smaller batch)."""
  def interceptor(next_fun, args, kwargs, context):
    if (isinstance(context.module, nn.BatchNorm) and context.method_name == '__call__'
        and kwargs.get('mask') is None and args and jnp.ndim(args[0]) >= 1
        and jnp.shape(args[0])[0] == mask.shape[0]):
      x = args[0]
      kwargs = {**kwargs, 'mask': mask.reshape((-1,) + (1,) * (x.ndim - 1))}
    return next_fun(*args, **kwargs)
  return interceptor


def from_flax(name: str, module: nn.Module, sample_x) -> Model:
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

  Returns:
    The ``Model``.
  """
  sample_x = jnp.asarray(sample_x)[:1]
  train_arg = takes_train(module)
  evaluate = {'train': False} if train_arg else {}
  made = jax.eval_shape(lambda k: module.init(k, sample_x, **evaluate), jax.random.key(0))
  collections = tuple(sorted(c for c in made if c not in _NOT_STATE))
  if collections and not train_arg:
    raise ConfigError('model', f'model {name!r} has mutable collections {list(collections)} but '
                      "its __call__ takes no train argument: give it one (Flax's convention, "
                      'nn.BatchNorm(use_running_average=not train))')
  if collections:
    keep = ('params',) + collections
    init = lambda key: {c: v for c, v in module.init(key, sample_x, **evaluate).items()
                        if c in keep}
    apply = lambda params, x: module.apply(params, x, train=False)
  else:
    init = lambda key: module.init(key, sample_x, **evaluate)['params']
    apply = lambda params, x: module.apply({'params': params}, x, **evaluate)
  train_apply, train_state = None, None
  if train_arg and not collections:
    train_apply = lambda params, x, key: module.apply({'params': params}, x, train=True,
                                                      rngs={DROPOUT_RNG: key})
  if collections:
    def train_state(params, x, key, mask):
      with nn.intercept_methods(_batch_norm_mask(mask)):
        return module.apply(params, x, train=True, rngs={DROPOUT_RNG: key},
                            mutable=list(collections))
  return Model(name=name, init=init, apply=apply, module=module, train_apply=train_apply,
               collections=collections, train_arg=train_arg, train_state=train_state)


# name -> (num_classes, adapter_dim, conv_impl, init) -> module.
MODELS = {
    'logreg': lambda c, a, k, i: LogisticRegression(c, convention=i),
    'mlp': lambda c, a, k, i: MLP(c, adapter_dim=a, convention=i),
    'lenet5': lambda c, a, k, i: LeNet5(c, adapter_dim=a, conv_impl=k, convention=i),
    'cnn': lambda c, a, k, i: CNN(c, adapter_dim=a, conv_impl=k, convention=i),
    'cnn_cifar': lambda c, a, k, i: CNN(c, conv_features=(64, 64), dense=(384, 192),
                                        adapter_dim=a, conv_impl=k, convention=i),
    'char_lstm': lambda c, a, k, i: CharLSTM(c, adapter_dim=a, convention=i),
    'lstm_lm': lambda c, a, k, i: CharLSTM(c, embed_dim=96, hidden=670, num_layers=1,
                                           projection=96, adapter_dim=a, convention=i),
    'reddi_char_lstm': lambda c, a, k, i: CharLSTM(c, embed_dim=8, hidden=256, num_layers=2,
                                                   adapter_dim=a, convention=i),
    # FedJAX's own language models (its create_lstm_model of each data set).
    'fedjax_lstm_lm': lambda c, a, k, i: CharLSTM(c, embed_dim=96, hidden=670, num_layers=1,
                                                  projection=96, adapter_dim=a, convention=i,
                                                  tanh_after_lstm=True),
    'fedjax_char_lstm': lambda c, a, k, i: CharLSTM(c, embed_dim=8, hidden=256, num_layers=2,
                                                    adapter_dim=a, convention=i,
                                                    tanh_after_lstm=True),
    # The seeds' own models, as their code builds them.
    'usercentric_lenet5': lambda c, a, k, i: LeNet5(c, adapter_dim=a, conv_impl=k, convention=i,
                                                    pool='avg'),
    'feddyn_cnn': lambda c, a, k, i: CNN(c, conv_features=(64, 64), dense=(384, 192),
                                         adapter_dim=a, conv_impl=k, convention=i, padding='VALID'),
    'fedfomo_cnn': lambda c, a, k, i: CNN(c, conv_features=(32, 64, 64), dense=(64,),
                                          adapter_dim=a, conv_impl=k, convention=i, padding='VALID',
                                          kernel=3, pooled=(True, True, False)),
    'pfedme_cnn': lambda c, a, k, i: CNN(c, conv_features=(6, 16), dense=(120, 84),
                                         adapter_dim=a, conv_impl=k, convention=i, padding='VALID'),
    # The partial-personalization seed's models (Pillutla et al., arXiv 2204.03809).
    'transformer_lm': lambda c, a, k, i: TransformerLM(c, 'mini', adapter_dim=a, convention=i),
    'transformer_lm_tied': lambda c, a, k, i: TransformerLM(c, 'mini', adapter_dim=a, tied=True,
                                                            convention=i),
    'transformer_lm_tiny': lambda c, a, k, i: TransformerLM(c, 'tiny', adapter_dim=a,
                                                            convention=i),
    'resnet18_gn': lambda c, a, k, i: ResNetGN(c, adapter_dim=a, convention=i, conv_impl=k),
    'gldv2_resnet18_gn': lambda c, a, k, i: ResNetGN(c, adapter_dim=a, large_stem=True,
                                                     convention=i, conv_impl=k),
    'reddi_resnet18_gn': lambda c, a, k, i: ResNetGN(c, adapter_dim=a, groups=2, large_stem=True,
                                                     convention=i, conv_impl=k),
    # Reddi et al.'s EMNIST model (the field's standard task).
    'reddi_emnist_cnn': lambda c, a, k, i: CNN(c, conv_features=(32, 64), dense=(128,),
                                               adapter_dim=a, conv_impl=k, convention=i,
                                               padding='VALID', kernel=3, pooled=(False, True)),
}

#: The seeds' reference models: whose code they come from, and the
#: initialisation that code gets by default.
REFERENCE = {
    'usercentric_lenet5': ('user-centric FL (Mestoukirdi et al.): LeNet-5 with average pooling '
                           '(Keras)', 'keras'),
    'feddyn_cnn': ("FedDyn (Acar et al.), utils_models.py 'cifar10': conv 64@5x5 valid x2, "
                   'max pool, dense 384-192 (PyTorch)', 'pytorch'),
    'fedfomo_cnn': ("FedFomo (Zhang et al.), federated/network.py TFConvNet, the code's default "
                    "--arch: conv 32, 64, 64 @3x3 valid, dense 64 (PyTorch)", 'pytorch'),
    'reddi_emnist_cnn': ('Adaptive Federated Optimization (Reddi et al., arXiv 2003.00295), its '
                         'EMNIST CNN as TFF builds it: conv 32, 64 @3x3 valid, max pool after the '
                         'second, dense 128 (Keras); without its dropout (0.25, 0.5)', 'keras'),
    'reddi_char_lstm': ('Adaptive Federated Optimization (Reddi et al.), its Shakespeare '
                        'next-character model as TFF builds it: embedding 8, two LSTM layers of '
                        '256 (Keras)', 'keras'),
    'lstm_lm': ('Adaptive Federated Optimization (Reddi et al.), its Stack Overflow next-word '
                'LSTM as TFF builds it: embedding 96, LSTM 670, dense 96, output (Keras)', 'keras'),
    'fedjax_lstm_lm': ("FedJAX 0.0.17's models.stackoverflow.create_lstm_model: embedding 96, "
                       'LSTM 670, tanh, dense 96, output; its loss a sentence\'s token losses '
                       'summed, averaged over sentences (Haiku)', 'haiku'),
    'fedjax_char_lstm': ("FedJAX 0.0.17's models.shakespeare.create_lstm_model: embedding 8, two "
                         'LSTMs of 256 each followed by a tanh, output; its loss a sequence\'s '
                         'token losses averaged over all its positions, padded ones included '
                         '(Haiku)', 'haiku'),
    'transformer_lm': ('partial personalization (Pillutla et al., arXiv 2204.03809), '
                       'pfl/models/wordlm_transformer.py at --arch_size mini, decoder untied '
                       '(as the code unties it for input/output personal parts): 4 post-norm '
                       'blocks, 4 heads of 64, d 256, MLP 1,024 (PyTorch; its own N(0, 0.02))',
                       'pytorch'),
    'transformer_lm_tied': ('the same transformer with the decoder tied to the word embedding '
                            '(the code\'s default, about 6M parameters)', 'pytorch'),
    'transformer_lm_tiny': ('the same transformer at --arch_size tiny: 2 blocks, 2 heads of 64, '
                            'd 128, MLP 512 (untied)', 'pytorch'),
    'resnet18_gn': ('partial personalization (Pillutla et al.), pfl/models/resnet_utils.py '
                    'ResNetGN for 28x28 (EMNIST): ResNet-18, GroupNorm by its table, 3x3 stem '
                    '(PyTorch; Kaiming-normal convolutions)', 'pytorch'),
    'gldv2_resnet18_gn': ('partial personalization (Pillutla et al.), pfl/models/gldv2_resnet.py '
                          'GLDv2ResNetGN: the same ResNetGN for 224x224 RGB (original_size: 7x7 '
                          'stride-2 stem, max pool; GroupNorm by its table)', 'pytorch'),
    'reddi_resnet18_gn': ('Adaptive Federated Optimization (Reddi et al.), the CIFAR-100 '
                          'ResNet-18: ImageNet stem (7x7 stride 2, max pool), GroupNorm of 2 '
                          'groups', 'pytorch'),
    'pfedme_cnn': ('pFedMe (Dinh et al.), FLAlgorithms/trainmodel/models.py CifarNet, the '
                   'PyTorch tutorial CNN (also FedFomo\'s base_cnn): conv 6, 16 @5x5 valid, '
                   'dense 120-84 (PyTorch)', 'pytorch'),
}


#: What a model's training loss on a batch is divided by (``Model.loss_denominator``),
#: where not each counted target ('targets').
LOSS_DENOMINATORS = {'fedjax_lstm_lm': 'examples', 'fedjax_char_lstm': 'positions'}


@dataclasses.dataclass(frozen=True)
class ModelOptions(Declared):
  """The base of a registered model's own options: a frozen dataclass of
  ``hparam`` fields (its flags generated like a data set's options; give it
  a ``prefix`` ClassVar so that they read ``--<prefix>_<field>``). Its
  fields reach the model's ``build`` by name."""


@dataclasses.dataclass(frozen=True)
class NoModelOptions(ModelOptions):
  """The options of a model that has none."""


class ModelBuilder(Protocol):
  """What ``register`` takes: ``build(num_classes=..., **options)``.

  It is given the data set's number of classes as ``num_classes`` and each
  field of the model's options class it names, and returns a Flax Linen
  module (``__call__(self, x, train: bool)`` when it has dropout or batch
  normalization: Flax's convention) or a ``Model``.
  """

  def __call__(self, *, num_classes: int, **options: Any) -> Union[nn.Module, 'Model']:
    ...


@dataclasses.dataclass(frozen=True)
class RegisteredModel:
  """A model registered from outside the built-in table.

  Attributes:
    build: its ``ModelBuilder``.
    options: its ``ModelOptions`` class (``NoModelOptions`` when none).
  """
  build: Callable[..., Any]
  options: Type[ModelOptions]


#: Models registered with ``register`` (the user's own file, ``--import``).
REGISTERED: Dict[str, RegisteredModel] = {}


def _builder_params(name: str, build: Callable, options: Type[ModelOptions]) -> None:
  """Refuses a builder whose signature names something it would never be
  given (a misspelled option silently left at its default)."""
  try:
    params = inspect.signature(build).parameters
  except (TypeError, ValueError):
    raise TypeError(f'model {name!r}: build must be a function of num_classes, got '
                    f'{build!r}') from None
  given = ['num_classes'] + [f.name for f in dataclasses.fields(options)]
  if any(p.kind is p.VAR_KEYWORD for p in params.values()):
    return
  if 'num_classes' not in params:
    raise TypeError(f'model {name!r}: build{inspect.signature(build)} must take num_classes '
                    '(the data set\'s number of classes)')
  for pname, p in params.items():
    if p.kind is p.VAR_POSITIONAL:
      continue
    if pname not in given:
      raise TypeError(f'model {name!r}: build takes {pname!r}, which it is never given; it '
                      f'is given {", ".join(given)}'
                      + ('' if options is not NoModelOptions else
                         ' (an option of its own: a field of its options class, '
                         'register(name, build, options=MyOptions))'))


def register(name: str, build: ModelBuilder,
             options: Optional[Type[ModelOptions]] = None) -> None:
  """Adds a model of your own: ``--model=<name>`` then builds it as a
  built-in one (the command, flagfiles, ``--sweep``, ``--trials``, every
  layout and executor, ``--resume``: the file that registers it is part of
  the run identity through ``--import``).

  ``build(num_classes=..., **options)`` returns a Flax Linen module (its
  ``__call__(self, x, train: bool)`` when it has ``nn.Dropout`` or
  ``nn.BatchNorm``: ``from_flax``) or a ``Model``. Its options are the
  ``hparam`` fields of ``options`` (a ``ModelOptions`` dataclass), whose
  flags the command generates; each reaches ``build`` by name.

  Args:
    name: the ``--model`` name.
    build: the ``ModelBuilder``.
    options: its ``ModelOptions`` class (None: none).

  Returns:
    None.

  Raises:
    ValueError: a built-in model's name, or a name another module
      registered.
    TypeError: options that are not a ``ModelOptions`` dataclass, or a
      builder taking a parameter it is never given (a misspelled option).
  """
  if name in MODELS:
    raise ValueError(f'{name!r} is a built-in model; register yours under another name')
  options = options or NoModelOptions
  if not (isinstance(options, type) and issubclass(options, ModelOptions)
          and dataclasses.is_dataclass(options)):
    raise TypeError(f'the options of model {name!r} must be a ModelOptions dataclass, got '
                    f'{options!r}')
  _builder_params(name, build, options)
  old = REGISTERED.get(name)
  if old is not None and old.build is not build and (
      getattr(old.build, '__module__', None) != getattr(build, '__module__', None)):
    raise ValueError(f'a model named {name!r} is registered already '
                     f'(by {getattr(old.build, "__module__", "?")})')
  REGISTERED[name] = RegisteredModel(build, options)


def model_names() -> list:
  """Every ``--model`` name: the built-in ones, then those registered.

  Returns:
    The names.
  """
  return sorted(MODELS) + [n for n in REGISTERED if n not in MODELS]


def options_class(model: str) -> Type[ModelOptions]:
  """The options class of ``model`` (``NoModelOptions`` for a built-in one).

  Args:
    model: a ``--model`` name.

  Returns:
    The class.
  """
  entry = REGISTERED.get(model)
  return entry.options if entry is not None else NoModelOptions


def option_classes() -> list:
  """The distinct options classes of the registered models, in order.

  Returns:
    The classes.
  """
  out: list = []
  for entry in REGISTERED.values():
    if entry.options is not NoModelOptions and entry.options not in out:
      out.append(entry.options)
  return out


@dataclasses.dataclass(frozen=True)
class ModelConfig(Declared):
  """The model of a run, declared once (``hparam``): the command's model
  flags are generated from these fields; ``build_model`` builds it
  (``create_model(model, ..., adapter_dim, conv_impl, init=model_init)``,
  its first weights from ``init_weights``: ``models.weights``).
  """
  model: str = hparam('mlp', 'Model: ' + ', '.join(sorted(MODELS)) + '; the seeds\' own: '
                      + '; '.join(f'{k} ({v[0]})' for k, v in REFERENCE.items()))
  model_init: str = hparam('flax', "Initialisation convention of the model's layers: each "
                           "framework's default initialisers (flax: LeCun normal kernels, zero "
                           'biases; pytorch: U(+-1/sqrt(fan_in)) kernels and biases; keras: '
                           'Glorot uniform kernels, zero biases; haiku: truncated normal '
                           'kernels of scale 1/sqrt(fan_in), zero biases, as FedJAX\'s models; '
                           'LSTMs and embeddings too).',
                           choices=tuple(INITS))
  init_weights: Optional[str] = hparam(None, 'Start from these initial global parameters: a '
                                       '.npz (Flax parameter paths as keys, a Keras model\'s '
                                       'get_weights() saved by np.savez, or a Haiku parameter '
                                       "dict as module/name keys: FedJAX's models) or a PyTorch "
                                       'state dict (.pt/.pth), matched by layer order and '
                                       'converted.')
  adapter_dim: int = hparam(0, 'Add residual adapters of this width to the model (for '
                            '--partial_personal_part=adapter).', minimum=0)
  conv_impl: str = hparam('auto', "How convolutional models compute convolutions and pooling: "
                          "xla (XLA's convolution op), matmul (one matmul over shifted slices), "
                          "tiled (matmul over cache-sized batch chunks) or auto (tiled on a CPU, "
                          'matmul on a GPU/TPU, where a convolution vmapped over clients becomes '
                          'a slow grouped convolution). Same parameters; the same numbers up to '
                          'float reassociation. Recorded in the run identity.',
                          choices=tuple(CONV_IMPLS))

  options: ModelOptions = hparam(None, "A registered model's own options (its registered "
                                 'class; None: its defaults); their flags are its fields.',
                                 command=False)

  def __post_init__(self):
    cls = options_class(self.model)
    if self.options is None:
      object.__setattr__(self, 'options', cls())
    elif type(self.options) is not cls:
      raise ConfigError('model', f'{type(self.options).__name__} are not the options of '
                        f'{self.model} ({cls.__name__})')
    super().__post_init__()

  def check(self) -> None:
    """A known model; a weights file that exists and gives every weight."""
    if self.model not in MODELS and self.model not in REGISTERED:
      raise ConfigError('model', f'unknown model {self.model!r}; choose from {model_names()}')
    if self.model in REGISTERED:
      for flag, what in (('adapter_dim', 0), ('model_init', 'flax')):
        if getattr(self, flag) != what:
          raise ConfigError(flag, f'does nothing for --model={self.model} (a registered '
                            'model builds its own layers)')
    if self.init_weights:
      if self.model_init != 'flax':
        raise ConfigError('model_init', 'does nothing with --init_weights (the file gives every '
                          'initial weight)')
      if not os.path.isfile(self.init_weights):
        raise ConfigError('init_weights', f'{self.init_weights}: no such file')


def build_model(cfg: ModelConfig, num_classes: int, sample_x) -> 'Model':
  """The model ``cfg`` describes, built on ``sample_x`` (``create_model``),
  starting from the weights of ``cfg.init_weights`` when given.

  Args:
    cfg: the ``ModelConfig``.
    num_classes: the data set's classes.
    sample_x: one input batch.

  Returns:
    The ``Model``.
  """
  model = create_model(cfg.model, num_classes, sample_x, cfg.adapter_dim,
                       conv_impl=cfg.conv_impl, init=cfg.model_init,
                       options=cfg.options)
  if cfg.init_weights:
    from fedjax_personal.models import weights  # noqa: PLC0415  (torch files on demand)
    model = model.starting_from(weights.load(cfg.init_weights, model, sample_x))
  return model


def create_model(name: str, num_classes: int, sample_x, adapter_dim: int = 0,
                 conv_impl: str = 'auto', init: str = 'flax',
                 options: Optional[ModelOptions] = None) -> Model:
  """Builds a registered model by name.

  Args:
    name: a built-in model (``MODELS``) or one ``register`` added.
    num_classes: the data set's classes.
    sample_x: one input batch.
    adapter_dim: when > 0, residual adapters of this width after the hidden
      layers (for adapter-based partial personalization).
    conv_impl: how convolutional models compute their convolutions and
      pooling: 'auto' (per platform), 'xla', 'matmul' or 'tiled' (``Conv``). Same
      parameters and, up to float reassociation, the same numbers.
    init: the initialisation convention of every layer: 'flax' (Linen's
      defaults), 'pytorch', 'keras' or 'haiku' (``initializers``).
    options: a registered model's options (None: its defaults).

  Returns:
    The ``Model`` (pure ``init`` / ``apply``).

  Raises:
    ConfigError: unknown name or convention, or a model that does not fit
      the inputs (the message names the flag).
  """
  if name not in MODELS and name not in REGISTERED:
    raise ConfigError('model', f'unknown model {name!r}; choose one of {model_names()}')
  if name == 'logreg' and adapter_dim:
    raise ConfigError('adapter_dim', 'logreg has no hidden layer for adapters; pick another --model')
  resolve_conv_impl(conv_impl)  # validates the name
  initializers.check(init)
  if name in REGISTERED:
    model = _build_registered(name, num_classes, sample_x, options)
  else:
    model = from_flax(name, MODELS[name](num_classes, adapter_dim, conv_impl, init), sample_x)
    model = dataclasses.replace(model, loss_denominator=LOSS_DENOMINATORS.get(name, 'targets'))
  x = jnp.asarray(sample_x)[:1]
  try:
    params = jax.eval_shape(model.init, jax.random.key(0))
    jax.eval_shape(model.apply, params, x)
  except Exception as e:  # shape errors surface deep inside Flax/JAX
    raise ConfigError('model', f'model {name!r} does not fit inputs of shape {tuple(x.shape[1:])} '
                     f'and dtype {x.dtype} ({type(e).__name__}: {e}); pick another --model') from None
  return model


def _build_registered(name: str, num_classes: int, sample_x,
                      options: Optional[ModelOptions]) -> Model:
  """A registered model, built by its ``build`` with its options."""
  entry = REGISTERED[name]
  options = options if options is not None else entry.options()
  kwargs = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
  try:
    built = entry.build(num_classes=num_classes, **kwargs)
  except ConfigError:
    raise
  except Exception as e:  # the user's builder failed: one line naming where
    raise ConfigError('model', f'{name}: its build failed at {_where(e)}: '
                      f'{type(e).__name__}: {e}') from None
  if isinstance(built, Model):
    return dataclasses.replace(built, name=name)
  if not isinstance(built, nn.Module):
    raise ConfigError('model', f'{name}: its build returned {type(built).__name__}, not a Flax '
                      'Linen module or a Model')
  return from_flax(name, built, sample_x)


def _where(e: BaseException) -> str:
  """``file:line`` of the innermost frame of ``e`` outside this package."""
  frames = traceback.extract_tb(e.__traceback__)
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  outside = [f for f in frames if not os.path.abspath(f.filename).startswith(here)]
  f = (outside or frames or [None])[-1]
  return f'{f.filename}:{f.lineno}' if f is not None else '?'


def num_params(params) -> int:
  """The number of scalars in a parameter pytree.

  Args:
    params: a parameter pytree.

  Returns:
    The count.
  """
  return sum(int(a.size) for a in jax.tree.leaves(params))
