"""Building a model: the run's model settings (``ModelConfig``, its flags)
and ``create_model``, which makes a built-in model (the registry's table) or
a registered one (the user's builder, what it read recorded) into the pure
``Model`` and checks that it fits the inputs."""

import dataclasses
import inspect
import os
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_personal import user_reads
from fedjax_personal.errors import ConfigError, user_frame
from fedjax_personal.hparams import Declared, fill_options, hparam
from fedjax_personal.models import initializers, weights
from fedjax_personal.models.initializers import INITS
from fedjax_personal.models.layers import CONV_IMPLS, resolve_conv_impl
from fedjax_personal.models.model import Model, from_flax
from fedjax_personal.models.registry import (
  LOSS_DENOMINATORS,
  MODELS,
  REFERENCE,
  REGISTERED,
  ModelOptions,
  instantiate,
  model_names,
  options_class,
)

__all__ = [
  'build_model',
  'check_known',
  'create_model',
  'ModelConfig',
  'num_params',
]


@dataclasses.dataclass(frozen=True)
class ModelConfig(Declared):
  """The model of a run.

  Declared once (``hparam``): the command's model flags are generated from these
  fields; ``build_model`` builds it (``create_model(model, ..., adapter_dim,
  conv_impl, init=model_init)``, its first weights from ``init_weights``:
  ``models.weights``)."""

  model: str = hparam(
    'mlp',
    'Model: '
    + ', '.join(sorted(MODELS))
    + "; the seeds' own: "
    + '; '.join(f'{k} ({v[0]})' for k, v in REFERENCE.items()),
  )
  model_init: str = hparam(
    'flax',
    "Initialisation convention of the model's layers: each "
    "framework's default initialisers (flax: LeCun normal kernels, zero "
    'biases; pytorch: U(+-1/sqrt(fan_in)) kernels and biases; keras: '
    'Glorot uniform kernels, zero biases; haiku: truncated normal '
    "kernels of scale 1/sqrt(fan_in), zero biases, as FedJAX's models; "
    'LSTMs and embeddings too).',
    choices=tuple(INITS),
  )
  init_weights: Optional[str] = hparam(
    None,
    'Start from these initial global parameters: a '
    ".npz (Flax parameter paths as keys, a Keras model's "
    'get_weights() saved by np.savez, or a Haiku parameter '
    "dict as module/name keys: FedJAX's models) or a PyTorch "
    'state dict (.pt/.pth), matched by layer order and '
    'converted.',
  )
  adapter_dim: int = hparam(
    0,
    'Add residual adapters of this width to the model (for '
    '--partial_personal_part=adapter).',
    minimum=0,
  )
  conv_impl: str = hparam(
    'auto',
    'How convolutional models compute convolutions and pooling: '
    "xla (XLA's convolution op), matmul (one matmul over shifted slices), "
    'tiled (matmul over cache-sized batch chunks) or auto (tiled on a CPU, '
    'matmul on a GPU/TPU, where a convolution vmapped over clients becomes '
    'a slow grouped convolution). Same parameters; the same numbers up to '
    'float reassociation. Recorded in the run identity.',
    choices=tuple(CONV_IMPLS),
  )

  options: ModelOptions = hparam(
    None,
    "A registered model's own options (its registered "
    'class; None: its defaults); their flags are its fields.',
    command=False,
  )

  def __post_init__(self):
    fill_options(self, 'model', options_class(self.model))
    super().__post_init__()

  def check(self) -> None:
    """A known model; a weights file that exists and gives every weight."""
    check_known(self.model)
    if self.model in REGISTERED:
      for flag, what in (('adapter_dim', 0), ('model_init', 'flax')):
        if getattr(self, flag) != what:
          raise ConfigError(
            flag,
            f'does nothing for --model={self.model} (a registered '
            'model builds its own layers)',
          )
    if self.init_weights:
      if self.model_init != 'flax':
        raise ConfigError(
          'model_init',
          'does nothing with --init_weights (the file gives every '
          'initial weight)',
        )
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
  model = create_model(
    cfg.model,
    num_classes,
    sample_x,
    cfg.adapter_dim,
    conv_impl=cfg.conv_impl,
    init=cfg.model_init,
    options=cfg.options,
  )
  if cfg.init_weights:
    model = model.starting_from(weights.load(cfg.init_weights, model, sample_x))
  return model


def check_known(name: str) -> None:
  """Refuses a name no model has (built-in or registered).

  Args:
    name: a ``--model`` name.

  Returns:
    None.

  Raises:
    ConfigError naming ``--model``.
  """
  if name not in MODELS and name not in REGISTERED:
    raise ConfigError(
      'model',
      f'unknown model {name!r}; choose one of {model_names()}, or register '
      'your own in a file given with --import=FILE.py (models.register: '
      'docs/add_a_model.md)',
    )


def create_model(
  name: str,
  num_classes: int,
  sample_x,
  adapter_dim: int = 0,
  conv_impl: str = 'auto',
  init: str = 'flax',
  options: Optional[ModelOptions] = None,
) -> Model:
  """Builds a registered model by name.

  Args:
    name: a built-in model (``MODELS``) or one ``register`` added.
    num_classes: the data set's classes.
    sample_x: one input batch.
    adapter_dim: when > 0, residual adapters of this width after the hidden
      layers (for adapter-based partial personalization).
    conv_impl: how convolutional models compute their convolutions and
      pooling: 'auto' (per platform), 'xla', 'matmul' or 'tiled' (``Conv``).
        Same
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
  check_known(name)
  if name == 'logreg' and adapter_dim:
    raise ConfigError(
      'adapter_dim',
      'logreg has no hidden layer for adapters; pick another --model',
    )
  resolve_conv_impl(conv_impl)  # validates the name
  initializers.check(init)
  x = jnp.asarray(sample_x)[:1]
  try:
    if name in REGISTERED:
      model = _build_registered(name, num_classes, sample_x, options)
    else:
      module = instantiate(name, num_classes, adapter_dim, conv_impl, init)
      model = from_flax(name, module, sample_x)
      model = dataclasses.replace(
        model, loss_denominator=LOSS_DENOMINATORS.get(name, 'targets')
      )
    params = jax.eval_shape(model.init, jax.random.key(0))
    jax.eval_shape(model.apply, params, x)
  except ConfigError:
    raise
  except Exception as e:  # shape errors surface deep inside Flax/JAX
    if name in REGISTERED:
      raise ConfigError(
        'model',
        f'model {name!r} does not fit inputs of shape '
        f'{tuple(x.shape[1:])} and dtype {x.dtype}: {type(e).__name__} at '
        f'{_where(e, REGISTERED[name].build)}: {e}',
      ) from None
    raise ConfigError(
      'model',
      f'model {name!r} does not fit inputs of shape {tuple(x.shape[1:])} '
      f'and dtype {x.dtype} ({type(e).__name__}: {e}); pick another --model',
    ) from None
  return model


def _build_registered(
  name: str, num_classes: int, sample_x, options: Optional[ModelOptions]
) -> Model:
  """A registered model, built by its ``build`` with its options."""
  entry = REGISTERED[name]
  options = options if options is not None else entry.options()
  kwargs = {
    f.name: getattr(options, f.name) for f in dataclasses.fields(options)
  }
  with user_reads.recording() as reads:
    try:
      built = entry.build(num_classes=num_classes, **kwargs)
    except ConfigError:
      raise
    except Exception as e:  # the user's builder failed: one line naming where
      raise ConfigError(
        'model',
        f'{name}: its build failed at {_where(e, entry.build)}: '
        f'{type(e).__name__}: {e}',
      ) from None
    if isinstance(built, Model):
      model = dataclasses.replace(built, name=name)
    elif not isinstance(built, nn.Module):
      raise ConfigError(
        'model',
        f'{name}: its build returned {type(built).__name__}, not a Flax '
        'Linen module or a Model',
      )
    else:
      model = from_flax(name, built, sample_x, entry.head)
  return dataclasses.replace(
    model, reads=user_reads.so_far(('model', name), reads).record()
  )


def _where(e: BaseException, build) -> str:
  """``file:line`` where the user's builder (or what it built) raised."""
  try:
    own = [inspect.getsourcefile(build) or '']
  except TypeError:
    own = []
  return user_frame(e, own) or '?'


def num_params(params) -> int:
  """The number of scalars in a parameter pytree.

  Args:
    params: a parameter pytree.

  Returns:
    The count.
  """
  return sum(int(a.size) for a in jax.tree.leaves(params))
