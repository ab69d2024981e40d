"""FedJAX's aggregator interface (``fedjax.aggregators.aggregator``): an
``init`` of the state kept between rounds and an ``apply`` of (client id,
params, weight) triples and the state to the aggregate and the new
state."""

from typing import Any, Callable, Iterable, Tuple

from fedjax_personal.fedjax.core import tree_util
from fedjax_personal.fedjax.core.dataclasses import dataclass
from fedjax_personal.fedjax.core.typing import Params

__all__ = [
  'Aggregator',
  'AggregatorState',
  'mean_aggregator',
  'MeanAggregatorState',
]

AggregatorState = Any


@dataclass
class Aggregator:
  """An aggregation rule run each round.

  Attributes:
    init: ``() -> state``.
    apply: ``(iterable of (client id, params, weight), state) ->
      (aggregate, state)``.
  """

  init: Callable[[], AggregatorState]
  apply: Callable[
    [Iterable[Tuple[Any, Params, float]], AggregatorState],
    Tuple[Params, AggregatorState],
  ]


@dataclass
class MeanAggregatorState:
  """The mean aggregator keeps nothing."""


def mean_aggregator() -> Aggregator:
  """The weighted mean of the clients' params.

  Returns:
    The ``Aggregator``.
  """

  def apply(clients_params_and_weights, state):
    pairs = (
      (params, weight) for _, params, weight in clients_params_and_weights
    )
    return tree_util.tree_mean(pairs), state

  return Aggregator(MeanAggregatorState, apply)
