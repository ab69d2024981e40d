"""How a run's arithmetic is done: float32 matmul precision and the
convolution implementation, as settings a run records.

**Matmul precision.** JAX computes a float32 matmul or convolution at the
backend's default precision: full float32 on a CPU, TF32 (10-bit mantissa
products) on an NVIDIA GPU since Ampere, a single bfloat16 pass on a TPU.
The same run then gives other numbers on another card, silently: MAML's
Hessian-vector products were off by up to 5% relative on an H200 and the
main job's cells moved by up to 0.35 points (benchmarks/speed/README.md, "On a
GPU"). A research simulator's numbers should not depend on the card, so the
engine traces every computation of a run at one precision, ``float32`` unless
the run says otherwise (``--matmul_precision``, ``RoundRunner(...,
matmul_precision=)``): ``scoped`` enters JAX's ``default_matmul_precision``
around what it traces, so the precision is a parameter of each matmul the engine
compiles. JAX's own configuration is left as the user set it (importing the
package changes nothing), and a user's own computations keep their precision.
The precision is named in the header, ``summary.json`` and the run identity (a
resume with another precision is refused). XLA:CPU computes float32 whatever the
setting.

Names (``MATMUL_PRECISIONS``): ``float32`` (JAX's ``highest``), ``tf32``
(``tensorfloat32``), ``bf16x3`` (three bfloat16 passes, about float32's
accuracy on bfloat16 units: JAX's ``BF16_BF16_F32_X3`` algorithm), ``bf16``
(one bfloat16 pass, ``bfloat16``) and JAX's ``default``, ``high`` and
``highest`` as JAX means them (``default``: the backend's own).

**Convolutions** (``models.layers.resolve_conv_impl``): ``auto`` is
``tiled`` on a CPU and ``matmul`` on a GPU or TPU, where a convolution
vmapped over clients would become one grouped convolution (a group per
client) whose kernels collapse as the cohort grows (benchmarks/speed/README.md).
"""

import contextlib
import functools
from typing import Callable, Optional

import jax

from fedjax_personal.errors import ConfigError

__all__ = [
  'canonical',
  'check_precision',
  'CPU_PRECISIONS',
  'DEFAULT_MATMUL_PRECISION',
  'effective_matmul',
  'MATMUL_PRECISIONS',
  'precision',
  'record',
  'scoped',
]


#: --matmul_precision's names -> JAX's ``jax_default_matmul_precision`` value.
MATMUL_PRECISIONS = {
  'float32': 'highest',
  'tf32': 'tensorfloat32',
  'bf16x3': 'BF16_BF16_F32_X3',
  'bf16': 'bfloat16',
  'default': 'default',
  'high': 'high',
  'highest': 'highest',
}
#: JAX's values back to this package's names (what a run records).
_NAMES = {
  'highest': 'float32',
  'float32': 'float32',
  'tensorfloat32': 'tf32',
  'BF16_BF16_F32_X3': 'bf16x3',
  'bfloat16': 'bf16',
  'default': 'default',
  'high': 'high',
}
DEFAULT_MATMUL_PRECISION = 'float32'


def canonical(name: str) -> str:
  """The recorded name of a precision given as ours or as JAX's
  (``highest`` -> ``float32``, ``tensorfloat32`` -> ``tf32``).

  Args:
    name: a key of ``MATMUL_PRECISIONS`` or a JAX value.

  Returns:
    This package's name for it.

  Raises:
    ConfigError naming --matmul_precision for an unknown name.
  """
  if name in MATMUL_PRECISIONS:
    return _NAMES[MATMUL_PRECISIONS[name]]
  if name in _NAMES:
    return _NAMES[name]
  raise ConfigError(
    'matmul_precision',
    f'unknown precision {name!r}; choose one of {list(MATMUL_PRECISIONS)}',
  )


#: What a CPU accepts: XLA:CPU computes float32 products whatever the
#: setting (a run recording tf32 would not have used it), and rejects the
#: bfloat16x3 algorithm outright.
CPU_PRECISIONS = ('float32', 'default')


def check_precision(name: str, backend: Optional[str] = None) -> str:
  """The recorded name of a precision a run may use on ``backend``.

  Args:
    name: one of ``MATMUL_PRECISIONS`` (or JAX's own value).
    backend: a JAX backend's name (None: JAX's default backend).

  Returns:
    The recorded name (``canonical``).

  Raises:
    ConfigError naming --matmul_precision for an unknown name, or for a
    reduced precision on a CPU (``CPU_PRECISIONS``).
  """
  recorded = canonical(name)
  if (
    recorded not in CPU_PRECISIONS
    and (backend or jax.default_backend()) == 'cpu'
  ):
    raise ConfigError(
      'matmul_precision',
      f'{name}: XLA:CPU computes float32 products whatever '
      'the setting, so a run would record a precision it did not use; give '
      '--matmul_precision=float32 here, or run on a GPU/TPU',
    )
  return recorded


def precision(name: str) -> contextlib.AbstractContextManager:
  """JAX's ``default_matmul_precision`` at ``name`` while the context is
  open (in this thread): what is traced inside gets it as a parameter of
  each matmul and convolution.

  Args:
    name: one of ``MATMUL_PRECISIONS``.

  Returns:
    The context manager.
  """
  return jax.default_matmul_precision(MATMUL_PRECISIONS[canonical(name)])


def scoped(fn: Callable, name: str) -> Callable:
  """``fn`` traced (and run) at precision ``name``: the context is entered
  inside the function, so a function compiled from it, in any thread,
  carries the precision whatever JAX's setting outside.

  Args:
    fn: a function of arrays.
    name: one of ``MATMUL_PRECISIONS``.

  Returns:
    The wrapped function.
  """

  @functools.wraps(fn)
  def at_precision(*args, **kwargs):
    with precision(name):
      return fn(*args, **kwargs)

  return at_precision


def effective_matmul(name: str, backend: Optional[str] = None) -> str:
  """What the float32 products are on ``backend`` (default: JAX's) at the
  precision ``name``, in words for the header.

  Args:
    name: the run's precision (``canonical`` name).
    backend: a JAX backend's name (None: the default).

  Returns:
    A description.
  """
  backend = backend or jax.default_backend()
  if backend == 'cpu':
    return f'{name} (XLA:CPU computes float32 whatever the setting)'
  if name in ('default', 'high'):
    native = {
      'gpu': 'TF32 on NVIDIA since Ampere',
      'tpu': 'one bfloat16 pass',
    }.get(backend, '')
    return f"{name} (the backend's own: {native})" if native else name
  return name


def record(
  matmul_precision: str,
  conv_impl: Optional[str],
  forward_conv_impl: Optional[str] = None,
) -> dict:
  """What a run records of its arithmetic (identity, header, summary):
  the matmul precision and, for a convolutional model, the convolution
  implementation it resolved to (None: no convolution), and the one a
  forward pass alone uses where it differs (``Model.forward_only``: a
  pooled evaluation's chunks).

  Args:
    matmul_precision: the run's precision.
    conv_impl: the convolution implementation (None: no convolution).
    forward_conv_impl: a forward pass alone's, where not ``conv_impl``.

  Returns:
    The record.
  """
  out = {'matmul_precision': canonical(matmul_precision)}
  if conv_impl is not None:
    out['conv_impl'] = conv_impl
  if forward_conv_impl is not None and forward_conv_impl != conv_impl:
    out['forward_conv_impl'] = forward_conv_impl
  return out
