"""FedJAX's aggregators (``fedjax.aggregators``): the weighted mean and the
compressed means (uniform, rotated, TernGrad and DRIVE quantization, with
their bit counts), FedJAX's interface and values."""

from fedjax_personal.fedjax.aggregators import compression, walsh_hadamard
from fedjax_personal.fedjax.aggregators.aggregator import (
  Aggregator,
  mean_aggregator,
)
from fedjax_personal.fedjax.aggregators.compression import (
  binary_stochastic_quantize,
  uniform_stochastic_quantize,
  uniform_stochastic_quantize_pytree,
  uniform_stochastic_quantizer,
)
from fedjax_personal.fedjax.aggregators.walsh_hadamard import (
  walsh_hadamard_transform,
)

__all__ = [
  'Aggregator',
  'binary_stochastic_quantize',
  'compression',
  'mean_aggregator',
  'uniform_stochastic_quantize',
  'uniform_stochastic_quantize_pytree',
  'uniform_stochastic_quantizer',
  'walsh_hadamard',
  'walsh_hadamard_transform',
]
