"""The models by name: the built-in table (``MODELS``, the seeds' reference
models, loss denominators) and the models a user registers from a file
(``register``: a Flax module or a ``Model`` of their own, with options
whose flags the command generates)."""

import dataclasses
import inspect
from functools import partial
from typing import Any, Callable, Dict, Optional, Protocol, Type, Union

import flax.linen as nn

from fedjax_personal.errors import caller_file
from fedjax_personal.hparams import Declared, check_name, claim_flags
from fedjax_personal.models.architectures import (
  CNN,
  MLP,
  CharLSTM,
  LeNet5,
  LogisticRegression,
)
from fedjax_personal.models.model import Model
from fedjax_personal.models.resnet_bn import ResNetBN
from fedjax_personal.models.seed_models import ResNetGN, TransformerLM

__all__ = [
  'LOSS_DENOMINATORS',
  'model_names',
  'ModelBuilder',
  'ModelOptions',
  'MODELS',
  'instantiate',
  'RUN_ARGUMENTS',
  'NoModelOptions',
  'option_classes',
  'options_class',
  'REFERENCE',
  'register',
  'REGISTERED',
  'RegisteredModel',
]


#: name -> the Linen module class with its own fixed arguments; ``instantiate``
#: adds the run's by name (``num_classes`` and, where the class takes them,
#: ``adapter_dim``, ``conv_impl`` and ``convention``).
MODELS: Dict[str, Callable[..., nn.Module]] = {
  'logreg': LogisticRegression,
  'mlp': MLP,
  'lenet5': LeNet5,
  'cnn': CNN,
  'cnn_cifar': partial(CNN, conv_features=(64, 64), dense=(384, 192)),
  'char_lstm': CharLSTM,
  'lstm_lm': partial(
    CharLSTM,
    embed_dim=96,
    hidden=670,
    num_layers=1,
    projection=96,
    mask_pad=True,
  ),
  'reddi_char_lstm': partial(
    CharLSTM, embed_dim=8, hidden=256, num_layers=2, mask_pad=True
  ),
  # FedJAX's own language models (its create_lstm_model of each data set).
  'fedjax_lstm_lm': partial(
    CharLSTM,
    embed_dim=96,
    hidden=670,
    num_layers=1,
    projection=96,
    tanh_after_lstm=True,
  ),
  'fedjax_char_lstm': partial(
    CharLSTM, embed_dim=8, hidden=256, num_layers=2, tanh_after_lstm=True
  ),
  # The seeds' own models, as their code builds them.
  'usercentric_lenet5': partial(LeNet5, pool='avg'),
  'feddyn_cnn': partial(
    CNN, conv_features=(64, 64), dense=(384, 192), padding='VALID'
  ),
  'fedfomo_cnn': partial(
    CNN,
    conv_features=(32, 64, 64),
    dense=(64,),
    padding='VALID',
    kernel=3,
    pooled=(True, True, False),
  ),
  'pfedme_cnn': partial(
    CNN, conv_features=(6, 16), dense=(120, 84), padding='VALID'
  ),
  # The partial-personalization seed's models (Pillutla et al., arXiv
  # 2204.03809).
  'transformer_lm': partial(TransformerLM, size='mini'),
  'transformer_lm_tied': partial(TransformerLM, size='mini', tied=True),
  'transformer_lm_tiny': partial(TransformerLM, size='tiny'),
  'resnet18_gn': ResNetGN,
  'gldv2_resnet18_gn': partial(ResNetGN, large_stem=True),
  'reddi_resnet18_gn': partial(ResNetGN, groups=2, large_stem=True),
  # Reddi et al.'s EMNIST model (the field's standard task).
  'reddi_emnist_cnn': partial(
    CNN,
    conv_features=(32, 64),
    dense=(128,),
    padding='VALID',
    kernel=3,
    pooled=(False, True),
    dropout=(0.25, 0.5),
  ),
  # torchvision's ResNet-18 with BatchNorm (PFLlib's default ResNet; FedBN's
  # model).
  'resnet18_bn': ResNetBN,
  # FedJAX's own EMNIST CNN (models.emnist.create_conv_model): the same layers.
  'fedjax_emnist_cnn': partial(
    CNN,
    conv_features=(32, 64),
    dense=(128,),
    padding='VALID',
    kernel=3,
    pooled=(False, True),
    dropout=(0.25, 0.5),
  ),
  # PFLlib's FedAvgCNN (its default -m CNN): conv 32, 64 @5x5 valid, dense 512.
  'pfllib_cnn': partial(CNN, padding='VALID'),
}

#: The arguments ``instantiate`` gives a table entry where its class takes them.
RUN_ARGUMENTS = ('adapter_dim', 'conv_impl', 'convention')


def instantiate(
  name: str, num_classes: int, adapter_dim: int, conv_impl: str, init: str
) -> nn.Module:
  """The built-in model ``name`` as a Linen module: its table entry given
  the classes and, where its class declares them, the adapter width, the
  convolution implementation and the initialisation convention.

  Args:
    name: a ``MODELS`` name.
    num_classes: the data set's classes.
    adapter_dim: the adapters' width (0: none).
    conv_impl: a ``layers.CONV_IMPLS`` name.
    init: an ``initializers.INITS`` convention.

  Returns:
    The module.
  """
  entry = MODELS[name]
  cls = entry.func if isinstance(entry, partial) else entry
  fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
  given = dict(adapter_dim=adapter_dim, conv_impl=conv_impl, convention=init)
  return entry(num_classes, **{k: v for k, v in given.items() if k in fields})


#: The seeds' reference models: whose code they come from, and the
#: initialisation that code gets by default.
REFERENCE = {
  'usercentric_lenet5': (
    'user-centric FL (Mestoukirdi et al.): LeNet-5 with average pooling '
    '(Keras)',
    'keras',
  ),
  'feddyn_cnn': (
    "FedDyn (Acar et al.), utils_models.py 'cifar10': conv 64@5x5 valid x2, "
    'max pool, dense 384-192 (PyTorch)',
    'pytorch',
  ),
  'fedfomo_cnn': (
    "FedFomo (Zhang et al.), federated/network.py TFConvNet, the code's "
    'default '
    '--arch: conv 32, 64, 64 @3x3 valid, dense 64 (PyTorch)',
    'pytorch',
  ),
  'reddi_emnist_cnn': (
    'Adaptive Federated Optimization (Reddi et al., arXiv 2003.00295), its '
    'EMNIST CNN as TFF builds it: conv 32, 64 @3x3 valid, max pool after the '
    'second, dense 128, dropout 0.25 after the pooling and 0.5 after the '
    'dense layer (Keras)',
    'keras',
  ),
  'resnet18_bn': (
    "torchvision's resnet18 (PFLlib's -m resnet, on 32x32 images as they are): "
    '7x7 stride-2 stem, max pool, 4 stages of basic blocks, BatchNorm after '
    "every convolution (PyTorch's BatchNorm2d: momentum 0.1, unbiased running "
    'variance), Kaiming-normal fan-out convolutions (PyTorch)',
    'pytorch',
  ),
  'fedjax_emnist_cnn': (
    "FedJAX 0.0.17's models.emnist.create_conv_model: conv 32, 64 @3x3 "
    'valid, max pool, dropout 0.25, dense 128, dropout 0.5 (Haiku)',
    'haiku',
  ),
  'reddi_char_lstm': (
    'Adaptive Federated Optimization (Reddi et al.), its Shakespeare '
    'next-character model as TFF builds it: embedding 8, two LSTM layers of '
    '256 (Keras)',
    'keras',
  ),
  'lstm_lm': (
    'Adaptive Federated Optimization (Reddi et al.), its Stack Overflow '
    'next-word '
    'LSTM as TFF builds it: embedding 96, LSTM 670, dense 96, output (Keras)',
    'keras',
  ),
  'fedjax_lstm_lm': (
    "FedJAX 0.0.17's models.stackoverflow.create_lstm_model: embedding 96, "
    "LSTM 670, tanh, dense 96, output; its loss a sentence's token losses "
    'summed, averaged over sentences (Haiku)',
    'haiku',
  ),
  'fedjax_char_lstm': (
    "FedJAX 0.0.17's models.shakespeare.create_lstm_model: embedding 8, two "
    "LSTMs of 256 each followed by a tanh, output; its loss a sequence's "
    'token losses averaged over all its positions, padded ones included '
    '(Haiku)',
    'haiku',
  ),
  'transformer_lm': (
    'partial personalization (Pillutla et al., arXiv 2204.03809), '
    'pfl/models/wordlm_transformer.py at --arch_size mini, decoder untied '
    '(as the code unties it for input/output personal parts): 4 post-norm '
    'blocks, 4 heads of 64, d 256, MLP 1,024 (PyTorch; its own N(0, 0.02))',
    'pytorch',
  ),
  'transformer_lm_tied': (
    'the same transformer with the decoder tied to the word embedding '
    "(the code's default, about 6M parameters)",
    'pytorch',
  ),
  'transformer_lm_tiny': (
    'the same transformer at --arch_size tiny: 2 blocks, 2 heads of 64, '
    'd 128, MLP 512 (untied)',
    'pytorch',
  ),
  'resnet18_gn': (
    'partial personalization (Pillutla et al.), pfl/models/resnet_utils.py '
    'ResNetGN for 28x28 (EMNIST): ResNet-18, GroupNorm by its table, 3x3 stem '
    '(PyTorch; Kaiming-normal convolutions)',
    'pytorch',
  ),
  'gldv2_resnet18_gn': (
    'partial personalization (Pillutla et al.), pfl/models/gldv2_resnet.py '
    'GLDv2ResNetGN: the same ResNetGN for 224x224 RGB (original_size: 7x7 '
    'stride-2 stem, max pool; GroupNorm by its table)',
    'pytorch',
  ),
  'reddi_resnet18_gn': (
    'Adaptive Federated Optimization (Reddi et al.), the CIFAR-100 '
    'ResNet-18: ImageNet stem (7x7 stride 2, max pool), GroupNorm of 2 '
    'groups',
    'pytorch',
  ),
  'pfllib_cnn': (
    'PFLlib (TsingZ0/PFLlib), system/flcore/trainmodel/models.py FedAvgCNN, '
    'its default -m CNN: conv 32, 64 @5x5 valid, max pools, dense 512, fc '
    '(PyTorch)',
    'pytorch',
  ),
  'pfedme_cnn': (
    'pFedMe (Dinh et al.), FLAlgorithms/trainmodel/models.py CifarNet, the '
    "PyTorch tutorial CNN (also FedFomo's base_cnn): conv 6, 16 @5x5 valid, "
    'dense 120-84 (PyTorch)',
    'pytorch',
  ),
}


#: What a model's training loss on a batch is divided by
#: (``Model.loss_denominator``),
#: where not each counted target ('targets').
LOSS_DENOMINATORS = {
  'fedjax_lstm_lm': 'examples',
  'fedjax_char_lstm': 'positions',
}


@dataclasses.dataclass(frozen=True)
class ModelOptions(Declared):
  """The base of a registered model's own options.

  A frozen dataclass of ``hparam`` fields (its flags generated like a data set's
  options; give it a ``prefix`` ClassVar so that they read
  ``--<prefix>_<field>``). Its fields reach the model's ``build`` by name."""


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

  def __call__(
    self, *, num_classes: int, **options: Any
  ) -> Union[nn.Module, 'Model']: ...


@dataclasses.dataclass(frozen=True)
class RegisteredModel:
  """A model registered from outside the built-in table.

  Attributes:
    build: its ``ModelBuilder``.
    options: its ``ModelOptions`` class (``NoModelOptions`` when none).
    owner: the file that registered it.
    head: the path of its head module ('/'-joined), or None: found
      (``head.find_head``).
  """

  build: Callable[..., Any]
  options: Type[ModelOptions]
  owner: str = ''
  head: Optional[str] = None


#: Models registered with ``register`` (the user's own file, ``--import``).
REGISTERED: Dict[str, RegisteredModel] = {}


def _builder_params(
  name: str, build: Callable, options: Type[ModelOptions]
) -> None:
  """Refuses a builder whose signature names something it would never be
  given (a misspelled option silently left at its default)."""
  try:
    params = inspect.signature(build).parameters
  except (TypeError, ValueError):
    raise TypeError(
      f'model {name!r}: build must be a function of num_classes, got {build!r}'
    ) from None
  given = ['num_classes'] + [f.name for f in dataclasses.fields(options)]
  if any(p.kind is p.VAR_KEYWORD for p in params.values()):
    return
  if 'num_classes' not in params:
    raise TypeError(
      f'model {name!r}: build{inspect.signature(build)} must take num_classes '
      "(the data set's number of classes)"
    )
  for pname, p in params.items():
    if p.kind is p.VAR_POSITIONAL:
      continue
    if pname not in given:
      raise TypeError(
        f'model {name!r}: build takes {pname!r}, which it is never given; it '
        f'is given {", ".join(given)}'
        + (
          ''
          if options is not NoModelOptions
          else ' (an option of its own: a field of its options class, '
          'register(name, build, options=MyOptions))'
        )
      )


def register(
  name: str,
  build: ModelBuilder,
  options: Optional[Type[ModelOptions]] = None,
  head: Optional[str] = None,
) -> None:
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
    head: the module that is its head, for the algorithms that train a body
      and a head ('/'-joined module names, e.g. ``'classifier'``); None:
      the last layer with parameters whose call returns the model's output
      (PFLlib's split: its last ``fc``).

  Returns:
    None.

  Raises:
    ValueError: a built-in model's name, or a name another module
      registered.
    TypeError: options that are not a ``ModelOptions`` dataclass, or a
      builder taking a parameter it is never given (a misspelled option).
  """
  check_name('model', name)
  if name in MODELS:
    raise ValueError(
      f'{name!r} is a built-in model; register yours under another name'
    )
  options = options or NoModelOptions
  if not (
    isinstance(options, type)
    and issubclass(options, ModelOptions)
    and dataclasses.is_dataclass(options)
  ):
    raise TypeError(
      f'the options of model {name!r} must be a ModelOptions dataclass, got '
      f'{options!r}'
    )
  _builder_params(name, build, options)
  owner = caller_file()
  old = REGISTERED.get(name)
  if old is not None and old.build is not build and old.owner != owner:
    raise ValueError(
      f'a model named {name!r} is registered already, by {old.owner}'
    )
  claim_flags(options, f'an option of --model={name}')
  REGISTERED[name] = RegisteredModel(build, options, owner, head)


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
