"""Models: the pure (init, apply) pair the engine uses, the models by name
and how a run builds one, re-exported here.

``building`` holds ``ModelConfig`` and ``create_model`` (a model by name,
checked against the inputs), ``model`` holds ``Model`` and ``from_flax`` (a Flax
Linen module as the pure pair: its ``train`` argument, dropout keys, batch
statistics), ``registry`` the models by name (the built-in table and the user's
``register``), ``layers`` the building blocks (convolutions as XLA ops or
matmuls, pooling, dense, adapters, LSTM cells), ``initializers`` the
initialisation conventions of Flax, PyTorch, Keras and Haiku, ``architectures``
the networks, ``head`` a model's body and head (one forward pass gives features
and logits), and ``weights`` reading initial parameters from a ``.npz`` or a
PyTorch state dict.
"""

from fedjax_personal.errors import ConfigError
from fedjax_personal.models import initializers, weights
from fedjax_personal.models.architectures import (
  CNN,
  MLP,
  CharLSTM,
  LeNet5,
  LogisticRegression,
  flatten,
)
from fedjax_personal.models.building import (
  ModelConfig,
  build_model,
  check_known,
  create_model,
  num_params,
)
from fedjax_personal.models.head import BodyAndHead, HeadSplit
from fedjax_personal.models.initializers import INITS
from fedjax_personal.models.layers import (
  CONV_IMPLS,
  TILE_BYTES,
  TILE_MIN_BYTES,
  Adapter,
  Conv,
  Dense,
  LSTMCell,
  as_float,
  avg_pool_2x2,
  batch_chunk,
  conv_as_matmul,
  conv_layout,
  from_layout,
  max_pool,
  max_pool_2x2,
  resolve_conv_impl,
  tile_budget,
  to_layout,
)
from fedjax_personal.models.model import (
  DROPOUT_RNG,
  Model,
  from_flax,
  takes_train,
)
from fedjax_personal.models.registry import (
  LOSS_DENOMINATORS,
  MODELS,
  REFERENCE,
  REGISTERED,
  ModelBuilder,
  ModelOptions,
  NoModelOptions,
  RegisteredModel,
  instantiate,
  model_names,
  option_classes,
  options_class,
  register,
)
from fedjax_personal.models.seed_models import (
  TRANSFORMER_SIZES,
  ResNetGN,
  TransformerLM,
)

__all__ = [
  'Adapter',
  'as_float',
  'avg_pool_2x2',
  'batch_chunk',
  'BodyAndHead',
  'build_model',
  'check_known',
  'CharLSTM',
  'CNN',
  'ConfigError',
  'Conv',
  'conv_as_matmul',
  'CONV_IMPLS',
  'conv_layout',
  'create_model',
  'Dense',
  'DROPOUT_RNG',
  'flatten',
  'from_flax',
  'from_layout',
  'BodyAndHead',
  'HeadSplit',
  'instantiate',
  'initializers',
  'INITS',
  'LeNet5',
  'LogisticRegression',
  'LOSS_DENOMINATORS',
  'LSTMCell',
  'max_pool',
  'max_pool_2x2',
  'MLP',
  'Model',
  'model_names',
  'ModelBuilder',
  'ModelConfig',
  'ModelOptions',
  'MODELS',
  'NoModelOptions',
  'num_params',
  'option_classes',
  'options_class',
  'REFERENCE',
  'register',
  'REGISTERED',
  'RegisteredModel',
  'ResNetGN',
  'resolve_conv_impl',
  'takes_train',
  'tile_budget',
  'TILE_BYTES',
  'TILE_MIN_BYTES',
  'to_layout',
  'TRANSFORMER_SIZES',
  'TransformerLM',
  'weights',
]
