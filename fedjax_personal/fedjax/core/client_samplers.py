"""FedJAX's client samplers (``fedjax.core.client_samplers``, 0.0.17), drawing
the same clients and keys as FedJAX for the same seed and round.

``UniformGetClientSampler`` draws each round's ids with NumPy's
``RandomState.choice`` (without replacement) from a state seeded by FedJAX's
``get_pseudo_random_state(seed, round)``, a multiplicative congruential
generator stepped ``round`` times from ``RandomState(seed)``'s first draw;
``UniformShuffledClientSampler`` takes the next clients of a
``shuffled_clients`` stream. Both hand each client the key
``jax.random.split(jax.random.PRNGKey(round), num_clients)[i]``, split as
FedJAX's JAX split it (``jax.threefry_partitionable(False)``).
"""

import abc
from typing import Iterator, List, Tuple

import jax
import numpy as np

from fedjax_personal.core.sampling import lehmer_random_state

__all__ = [
  'ClientSampler',
  'get_pseudo_random_state',
  'UniformGetClientSampler',
  'UniformShuffledClientSampler',
]

#: FedJAX's deterministic state of a round (``RandomState(16807^round * s mod
#: (2^31 - 1))``, ``s`` the first ``randint(1, 2^31 - 2)`` of
#: ``RandomState(seed)``):
#: the project's ``core.sampling.lehmer_random_state``,
#: google-research/federated's too.
get_pseudo_random_state = lehmer_random_state


class ClientSampler(abc.ABC):
  """The interface of FedJAX's client samplers.

  What a sampler does: ``sample()`` gives a round's ``(client id, client
  dataset, key)`` triples; ``set_round_num`` says which round comes next."""

  @abc.abstractmethod
  def sample(self) -> List[Tuple[bytes, object, jax.Array]]:
    """The next round's clients (FedJAX's ``ClientSampler.sample``)."""

  @abc.abstractmethod
  def set_round_num(self, round_num: int) -> None:
    """Sets the round the next ``sample`` draws (FedJAX's ``set_round_num``)."""


def _round_keys(round_num: int, num_clients: int):
  """FedJAX's keys of a round, split as the JAX it ran split them (JAX 0.5
  made ``jax_threefry_partitionable`` the default, which splits otherwise;
  set here for this split alone, JAX's setting left as it is)."""
  with jax.threefry_partitionable(False):
    return jax.random.split(jax.random.PRNGKey(round_num), num_clients)


def _with_keys(round_num: int, num_clients: int, clients) -> list:
  """``(id, dataset, key)`` of the round's ``(id, dataset)`` pairs."""
  keys = _round_keys(round_num, num_clients)
  return [
    (client_id, dataset, keys[i])
    for i, (client_id, dataset) in enumerate(clients)
  ]


class UniformShuffledClientSampler(ClientSampler):
  """FedJAX's sampler of a shuffled stream of clients.

  The next ``num_clients`` of a ``shuffled_clients`` stream each round
  (FedJAX's ``UniformShuffledClientSampler``); ``start_round_num`` skips
  that many rounds' clients.

  Args:
    shuffled_clients_iter: ``fd.shuffled_clients(buffer_size, seed)``.
    num_clients: clients a round.
    start_round_num: the first round.
  """

  def __init__(
    self,
    shuffled_clients_iter: Iterator,
    num_clients: int,
    start_round_num: int = 0,
  ):
    self._clients = shuffled_clients_iter
    self._num_clients = num_clients
    self._round_num = start_round_num
    for _ in range(start_round_num * num_clients):
      next(self._clients)

  def sample(self) -> List[Tuple[bytes, object, jax.Array]]:
    """The round's ``(id, dataset, key)`` triples.

    Returns:
      ``num_clients`` triples.
    """
    out = _with_keys(
      self._round_num,
      self._num_clients,
      [next(self._clients) for _ in range(self._num_clients)],
    )
    self._round_num += 1
    return out

  def set_round_num(self, round_num: int) -> None:
    """Not possible on a stream, as in FedJAX.

    Args:
      round_num: the round.

    Returns:
      Never.

    Raises:
      NotImplementedError, FedJAX's message.
    """
    raise NotImplementedError(
      'Use UniformGetClientSampler instead if set_round_num() is needed.'
    )


class UniformGetClientSampler(ClientSampler):
  """FedJAX's sampler of clients drawn without replacement.

  ``num_clients`` ids without replacement each round, by
  ``get_pseudo_random_state(seed, round)`` (FedJAX's
  ``UniformGetClientSampler``), read with ``fd.get_clients``.

  Args:
    fd: the federated data.
    num_clients: clients a round.
    seed: the draws' seed.
    start_round_num: the first round.
  """

  def __init__(self, fd, num_clients: int, seed: int, start_round_num: int = 0):
    self._fd = fd
    self._num_clients = num_clients
    self._seed = seed
    self._client_ids = list(fd.client_ids())
    self._round_num = start_round_num

  def sample(self) -> List[Tuple[bytes, object, jax.Array]]:
    """The round's ``(id, dataset, key)`` triples.

    Returns:
      ``num_clients`` triples.
    """
    state = get_pseudo_random_state(self._seed, self._round_num)
    ids = state.choice(
      np.array(self._client_ids, dtype=object),
      size=self._num_clients,
      replace=False,
    )
    out = _with_keys(
      self._round_num, self._num_clients, self._fd.get_clients(ids)
    )
    self._round_num += 1
    return out

  def set_round_num(self, round_num: int) -> None:
    """Sets the round the next ``sample`` draws.

    Args:
      round_num: the round.

    Returns:
      None.
    """
    self._round_num = round_num
