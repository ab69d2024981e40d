"""FedJAX's ``FederatedAlgorithm``: ``init(...) -> server state`` and
``apply(state, clients) -> (state, client diagnostics)``, clients given as
``(client id, ClientDataset, PRNG key)`` triples."""

from typing import Any, Callable, Mapping, Sequence, Tuple

from fedjax_personal.fedjax.core.dataclasses import dataclass
from fedjax_personal.fedjax.core.typing import PRNGKey, PyTree

__all__ = ['FederatedAlgorithm', 'ServerState']

ServerState = PyTree


@dataclass
class FederatedAlgorithm:
  """A federated algorithm as FedJAX's examples build one.

  Attributes:
    init: ``(...) -> server state`` (usually from initial parameters).
    apply: ``(server state, [(client id, client dataset, key)]) ->
      (server state, {client id: diagnostics})``: one round.
  """

  init: Callable[..., ServerState]
  apply: Callable[
    [ServerState, Sequence[Tuple[bytes, Any, PRNGKey]]],
    Tuple[ServerState, Mapping[bytes, Any]],
  ]
