"""FedJAX's type names (``fedjax.core.typing``), the names FedJAX's examples
annotate with."""

from typing import Any, Mapping, Union

import jax
import numpy as np
import optax

__all__ = [
  'ArrayLike',
  'BatchExample',
  'BatchPrediction',
  'OptState',
  'Params',
  'PRNGKey',
  'PyTree',
  'SingleExample',
  'SinglePrediction',
]

#: A JAX or NumPy array (FedJAX's batches are NumPy until they reach jit).
ArrayLike = Union[jax.Array, np.ndarray]
#: A batch: feature name -> [B, ...] array.
BatchExample = Mapping[str, ArrayLike]
#: One example: feature name -> array.
SingleExample = Mapping[str, ArrayLike]
#: A model's predictions for a batch: an array or a mapping of them.
BatchPrediction = Union[jax.Array, Mapping[str, jax.Array]]
#: A model's prediction for one example.
SinglePrediction = Union[jax.Array, Mapping[str, jax.Array]]
PyTree = Any
Params = PyTree
PRNGKey = jax.Array
OptState = optax.OptState
