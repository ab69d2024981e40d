"""FedJAX's ``fedjax.optimizers``: an ``Optimizer`` (``init``, ``apply``)
over an optax transformation, and FedJAX's named optimizers with FedJAX's
defaults.

``opt_state, params = optimizer.apply(grads, opt_state, params)`` applies
one step, as FedJAX's does (optax's update, then ``apply_updates``).
"""

from typing import Any, Callable, List, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import optax

from fedjax_personal.fedjax.core.dataclasses import dataclass
from fedjax_personal.fedjax.core.typing import OptState, Params

__all__ = [
  'adafactor',
  'adagrad',
  'adam',
  'create_optimizer_from_optax',
  'ignore_grads_haiku',
  'Optimizer',
  'rmsprop',
  'sgd',
  'yogi',
]

Grads = Params
ScalarOrSchedule = Union[float, optax.Schedule]


@dataclass
class Optimizer:
  """An optimizer as FedJAX's.

  ``init(params) -> opt_state`` and
  ``apply(grads, opt_state, params) -> (opt_state, params)``.

  Attributes:
    init: the (possibly empty) optimizer state of the parameters.
    apply: one step: the new state and parameters.
  """

  init: Callable[[Params], OptState]
  apply: Callable[[Grads, OptState, Params], Tuple[OptState, Params]]


def create_optimizer_from_optax(opt: optax.GradientTransformation) -> Optimizer:
  """An ``Optimizer`` applying ``opt``'s updates (its ``apply`` jitted).

  Args:
    opt: an optax gradient transformation.

  Returns:
    The ``Optimizer``.
  """

  @jax.jit
  def apply(grads, opt_state, params):
    updates, opt_state = opt.update(grads, opt_state, params)
    return opt_state, optax.apply_updates(params, updates)

  return Optimizer(opt.init, apply)


def ignore_grads_haiku(
  optimizer: Optimizer, non_trainable_names: List[Tuple[str, str]]
) -> Optimizer:
  """``optimizer`` leaving a Haiku model's ``(module, name)`` parameters
  untouched (FedJAX's: those leaves are None to the optimizer).

  Args:
    optimizer: the optimizer.
    non_trainable_names: ``(module name, parameter name)`` pairs.

  Returns:
    The optimizer.
  """
  names = tuple(non_trainable_names)

  def trainable(tree):
    return {
      module: {
        name: (None if (module, name) in names else value)
        for name, value in bundle.items()
      }
      for module, bundle in tree.items()
    }

  def init(params):
    return optimizer.init(trainable(params))

  def apply(grads, opt_state, params):
    opt_state, moved = optimizer.apply(
      trainable(grads), opt_state, trainable(params)
    )
    moved = {module: dict(bundle) for module, bundle in moved.items()}
    for module, name in names:
      moved[module][name] = params[module][name]
    return opt_state, moved

  return Optimizer(init, apply)


def adagrad(
  learning_rate: ScalarOrSchedule,
  initial_accumulator_value: float = 0.1,
  eps: float = 1e-6,
) -> Optimizer:
  """Adagrad (Duchi et al. 2011): ``optax.adagrad``.

  Args:
    learning_rate: the step size or schedule.
    initial_accumulator_value: the accumulator's start.
    eps: added inside the square root.

  Returns:
    The ``Optimizer``.
  """
  return create_optimizer_from_optax(
    optax.adagrad(
      learning_rate=learning_rate,
      initial_accumulator_value=initial_accumulator_value,
      eps=eps,
    )
  )


def adam(
  learning_rate: ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps_root: float = 0.0,
) -> Optimizer:
  """Adam (Kingma and Ba 2014): ``optax.adam``.

  Args:
    learning_rate: the step size or schedule.
    b1: the first moment's decay.
    b2: the second moment's decay.
    eps: added outside the square root.
    eps_root: added inside it.

  Returns:
    The ``Optimizer``.
  """
  return create_optimizer_from_optax(
    optax.adam(
      learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root
    )
  )


def rmsprop(
  learning_rate: ScalarOrSchedule,
  decay: float = 0.9,
  eps: float = 1e-8,
  initial_scale: float = 0.0,
  centered: bool = False,
  momentum: Optional[float] = None,
  nesterov: bool = False,
) -> Optimizer:
  """RMSProp (Tieleman and Hinton 2012): ``optax.rmsprop``.

  Args:
    learning_rate: the step size or schedule.
    decay: the squared gradients' decay.
    eps: added to the denominator.
    initial_scale: the accumulator's start.
    centered: whether the variance (not the second moment) scales.
    momentum: the momentum's decay, or None.
    nesterov: whether momentum is Nesterov's.

  Returns:
    The ``Optimizer``.
  """
  return create_optimizer_from_optax(
    optax.rmsprop(
      learning_rate=learning_rate,
      decay=decay,
      eps=eps,
      initial_scale=initial_scale,
      centered=centered,
      momentum=momentum,
      nesterov=nesterov,
    )
  )


def sgd(
  learning_rate: ScalarOrSchedule,
  momentum: Optional[float] = None,
  nesterov: bool = False,
) -> Optimizer:
  """SGD with optional (Nesterov) momentum: ``optax.sgd``.

  Args:
    learning_rate: the step size or schedule.
    momentum: the momentum's decay, or None.
    nesterov: whether momentum is Nesterov's.

  Returns:
    The ``Optimizer``.
  """
  return create_optimizer_from_optax(
    optax.sgd(learning_rate=learning_rate, momentum=momentum, nesterov=nesterov)
  )


def yogi(
  learning_rate: ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-3,
) -> Optimizer:
  """Yogi (Zaheer et al. 2018): ``optax.yogi``.

  Args:
    learning_rate: the step size or schedule.
    b1: the first moment's decay.
    b2: the second moment's decay.
    eps: added outside the square root.

  Returns:
    The ``Optimizer``.
  """
  return create_optimizer_from_optax(
    optax.yogi(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps)
  )


def adafactor(
  learning_rate: ScalarOrSchedule,
  min_dim_size_to_factor: int = 128,
  decay_rate: float = 0.8,
  decay_offset: int = 0,
  multiply_by_parameter_scale: bool = True,
  clipping_threshold: Optional[float] = 1.0,
  momentum: Optional[float] = None,
  dtype_momentum: Any = jnp.float32,
  weight_decay_rate: Optional[float] = None,
  eps: float = 1e-30,
  factored: bool = True,
  weight_decay_mask: Optional[Any] = None,
) -> Optimizer:
  """Adafactor (Shazeer and Stern 2018): ``optax.adafactor``.

  Args:
    learning_rate: the step size or schedule.
    min_dim_size_to_factor: the smallest dimensions factored.
    decay_rate: the second moment's decay exponent.
    decay_offset: the step the decay starts from.
    multiply_by_parameter_scale: scale by the parameters' norm.
    clipping_threshold: the update's clipping, or None.
    momentum: the momentum's decay, or None.
    dtype_momentum: the momentum's dtype.
    weight_decay_rate: weight decay, or None.
    eps: the root mean square's floor.
    factored: whether second moments are factored.
    weight_decay_mask: where weight decay applies.

  Returns:
    The ``Optimizer``.
  """
  return create_optimizer_from_optax(
    optax.adafactor(
      learning_rate=learning_rate,
      min_dim_size_to_factor=min_dim_size_to_factor,
      decay_rate=decay_rate,
      decay_offset=decay_offset,
      multiply_by_parameter_scale=multiply_by_parameter_scale,
      clipping_threshold=clipping_threshold,
      momentum=momentum,
      dtype_momentum=dtype_momentum,
      weight_decay_rate=weight_decay_rate,
      eps=eps,
      factored=factored,
      weight_decay_mask=weight_decay_mask,
    )
  )
