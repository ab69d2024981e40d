"""Cohort sampling inside the compiled round, with a fixed shape."""

import dataclasses
import math
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

__all__ = [
  'lehmer_random_state',
  'tff_schedule',
  'client_keys',
  'Cohort',
  'CohortSampler',
]


@struct.dataclass
class Cohort:
  """The clients of one round.

  Attributes:
    idx: int32 [C] client indices; padded slots hold N (one past the last
      client), which gathers clip and scatters drop.
    mask: bool [C], true for real (active) slots.
    row_idx: where the round's state holds the cohort's client rows (see
      ``rows``); None: at ``idx`` (the whole population's rows).
  """

  idx: jax.Array
  mask: jax.Array
  row_idx: Optional[jax.Array] = None

  @property
  def rows(self) -> jax.Array:
    """Indices of the cohort's rows in the state's client rows (the part an
    algorithm declares as ``FederatedAlgorithm.client_rows``): ``idx`` when
    the state holds every client's rows; positions 0..C-1 (padded slots C,
    dropped by scatters) when the host layout hands the round only the
    cohort's rows. Anything else per client (groups, N x N matrices, keys)
    is indexed by ``idx``."""
    return self.idx if self.row_idx is None else self.row_idx

  def with_gathered_rows(self, num_clients: int) -> 'Cohort':
    """This cohort for a state holding only its rows, in cohort order."""
    c = self.idx.shape[0]
    return dataclasses.replace(
      self,
      row_idx=jnp.where(
        self.idx < num_clients, jnp.arange(c, dtype=jnp.int32), c
      ),
    )


def _binomial_capacity(n: int, p: float, tail: float = 1e-9) -> int:
  """Smallest c with P(Binomial(n, p) > c) < tail (exact pmf in log space)."""
  if p >= 1.0:
    return n
  k = np.arange(n + 1)
  logpmf = (
    np.array(
      [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
        for i in k
      ]
    )
    + k * math.log(p)
    + (n - k) * math.log1p(-p)
  )
  pmf = np.exp(logpmf - logpmf.max())
  pmf /= pmf.sum()
  tail_mass = np.cumsum(pmf[::-1])[::-1]  # P(X >= k)
  above = np.nonzero(tail_mass < tail)[0]
  return int(above[0]) if above.size else n


@dataclasses.dataclass(frozen=True)
class CohortSampler:
  """Draws the round's cohort.

  Exactly one of ``cohort_size`` (a fixed number of clients without
  replacement, FedAvg's scheme) and ``participation`` (each client active
  independently with probability p, FedDyn's scheme, redrawn while empty) is
  set. With ``participation`` the cohort has a fixed capacity (the 1 - 1e-9
  quantile of Binomial(N, p)) so that the round compiles once; in the
  vanishingly rare event of more active clients, a uniformly random subset of
  ``capacity`` of them is kept.

  ``eligible`` restricts the draw to clients ``0 .. eligible - 1`` (the rest
  are evaluated only, e.g. TFF's held-out CIFAR-100 test clients); padded
  slots still hold ``num_clients``.

  ``tff_seed`` draws the cohorts as google-research/federated's code does
  (``utils/training_utils.build_sample_fn``, Reddi et al.'s runs; FedJAX's
  ``UniformGetClientSampler`` the same): round r's ``cohort_size`` clients
  are ``RandomState(16807^r s mod (2^31 - 1)).choice(clients,
  replace=False)``, ``s`` the first ``randint(1, 2^31 - 2)`` of
  ``RandomState(tff_seed)``, the clients in the data set's order; the
  ``rounds`` rounds' cohorts are drawn once (``tff_schedule``) and round r
  reads row ``r mod rounds``.
  """

  num_clients: int
  cohort_size: Optional[int] = None
  participation: Optional[float] = None
  eligible: Optional[int] = None
  tff_seed: Optional[int] = None
  rounds: int = 0
  #: The ``tff_seed`` cohorts, [rounds, cohort_size] (set when made; not a
  #: field).
  _schedule: ClassVar[Optional[np.ndarray]] = None

  @property
  def drawn(self) -> int:
    """How many clients (the first ones) a round draws from."""
    return self.num_clients if self.eligible is None else self.eligible

  def __post_init__(self):
    if self.num_clients < 1:
      raise ValueError(f'num_clients must be >= 1, got {self.num_clients}')
    if (self.cohort_size is None) == (self.participation is None):
      raise ValueError('set exactly one of cohort_size and participation')
    if self.eligible is not None and not 1 <= self.eligible <= self.num_clients:
      raise ValueError(
        f'eligible must be in [1, num_clients={self.num_clients}], '
        f'got {self.eligible}'
      )
    if self.cohort_size is not None and not 1 <= self.cohort_size <= self.drawn:
      raise ValueError(
        f'cohort_size must be in [1, {self.drawn} clients that train], '
        f'got {self.cohort_size}'
      )
    if self.participation is not None and not 0 < self.participation <= 1:
      raise ValueError(
        f'participation must be in (0, 1], got {self.participation}'
      )
    if self.tff_seed is not None:
      if self.cohort_size is None or self.rounds < 1:
        raise ValueError(
          'tff_seed draws cohort_size clients for each of rounds >= 1 rounds'
        )
      object.__setattr__(
        self,
        '_schedule',
        tff_schedule(self.drawn, self.cohort_size, self.tff_seed, self.rounds),
      )

  @property
  def capacity(self) -> int:
    if self.cohort_size is not None:
      return self.cohort_size
    assert self.participation is not None  # set exactly one (__post_init__)
    return max(1, _binomial_capacity(self.drawn, self.participation))

  def __call__(
    self, key: jax.Array, available: Optional[jax.Array] = None, round_num=0
  ) -> Cohort:
    """The cohort drawn with ``key``.

    Args:
      key: the round's cohort key.
      available: bool [N], the clients online this round (``system.
        available``), or None: every client. Only online clients are drawn;
        a cohort of ``cohort_size`` with fewer online has padded slots.
      round_num: the round (traced int; the ``tff_seed`` schedule's row).

    Returns:
      The ``Cohort``.
    """
    if self.tff_seed is not None:
      table = jnp.asarray(self._schedule)
      idx = table[jnp.asarray(round_num, jnp.int32) % table.shape[0]]
      return Cohort(idx=idx, mask=jnp.ones(self.cohort_size, bool))
    if available is not None:
      return self._among(key, available)
    n, drawn = self.num_clients, self.drawn
    if self.cohort_size is not None:
      if self.cohort_size == drawn:
        idx = jnp.arange(drawn, dtype=jnp.int32)
      else:
        idx = jax.random.choice(
          key, drawn, (self.cohort_size,), replace=False
        ).astype(jnp.int32)
      return Cohort(idx=idx, mask=jnp.ones(self.cohort_size, bool))

    participation = self.participation
    assert participation is not None  # set exactly one (__post_init__)

    def draw(k):
      active = jax.random.uniform(k, (n,)) < participation
      return active if drawn == n else active & (jnp.arange(n) < drawn)

    key, active = _redrawn_while_empty(key, draw)
    return _first_by_priority(key, active, self.capacity)

  def _among(self, key, available) -> Cohort:
    """The cohort drawn from the online clients only: ``cohort_size`` of them
    uniformly without replacement (as many as are online), or each with
    probability ``participation`` (an empty cohort when none is online)."""
    n = self.num_clients
    online = available & (jnp.arange(n) < self.drawn)
    k_pick, k_order = jax.random.split(key)
    if self.participation is not None:
      reachable = online
      _, online = _redrawn_while_empty(
        k_pick,
        lambda k: (
          reachable & (jax.random.uniform(k, (n,)) < self.participation)
        ),
        jnp.any(reachable),
      )
    return _first_by_priority(k_order, online, self.capacity)


def _redrawn_while_empty(key, draw, possible=True):
  """``(key, active)``: ``draw(sub)`` of a split of ``key``, drawn again from
  further splits while nobody is active (and ``possible``: someone can be)."""

  def cond(carry):
    return ~jnp.any(carry[1]) & possible

  def body(carry):
    k, sub = jax.random.split(carry[0])
    return k, draw(sub)

  key, sub = jax.random.split(key)
  return jax.lax.while_loop(cond, body, (key, draw(sub)))


def _first_by_priority(key, active, cap: int) -> Cohort:
  """The cohort of at most ``cap`` active clients, a uniformly random
  subset when more are active, in ascending order (padding, N, last)."""
  n = active.shape[0]
  priority = jnp.where(active, jax.random.uniform(key, (n,)), 2.0)
  order = jnp.argsort(priority)[:cap]
  mask = jnp.arange(cap) < jnp.minimum(jnp.sum(active), cap)
  idx = jnp.where(mask, order, n).astype(jnp.int32)
  perm = jnp.argsort(idx)
  return Cohort(idx=idx[perm], mask=mask[perm])


def tff_schedule(
  num_clients: int, cohort_size: int, seed: int, rounds: int
) -> np.ndarray:
  """google-research/federated's cohorts of rounds 0 .. rounds - 1
  (``build_sample_fn``: a Lehmer generator seeds each round's
  ``RandomState``, whose ``choice`` draws without replacement).

  Args:
    num_clients: the clients drawn from (in the data set's order).
    cohort_size: clients a round.
    seed: its ``client_datasets_random_seed``.
    rounds: the rounds.

  Returns:
    int32 [rounds, cohort_size] client indices.
  """
  return np.stack(
    [
      lehmer_random_state(seed, r).choice(
        num_clients, size=cohort_size, replace=False
      )
      for r in range(rounds)
    ]
  ).astype(np.int32)


#: The multiplicative congruential (Lehmer, MINSTD) generator seeding each
#: round.
_LEHMER_MODULUS, _LEHMER_MULTIPLIER = 2**31 - 1, 16807


def lehmer_random_state(seed: int, round_num: int) -> np.random.RandomState:
  """Round ``round_num``'s ``RandomState`` as google-research/federated's
  ``build_sample_fn`` and FedJAX's ``get_pseudo_random_state`` seed it:
  ``RandomState(16807^round * s mod (2^31 - 1))``, ``s`` the first
  ``randint(1, 2^31 - 2)`` of ``RandomState(seed)``.

  Args:
    seed: the sampler's seed.
    round_num: the round.

  Returns:
    The ``numpy.random.RandomState``.
  """
  start = np.random.RandomState(seed).randint(1, _LEHMER_MODULUS - 1)
  return np.random.RandomState(
    pow(_LEHMER_MULTIPLIER, round_num, _LEHMER_MODULUS)
    * start
    % _LEHMER_MODULUS
  )


@jax.jit
def client_keys(key, idx):
  """Client i's key of a round or phase: ``fold_in(key, i)``.

  Args:
    key: the round's (or phase's) key.
    idx: client indices (int array).

  Returns:
    One key per index.
  """
  return jax.vmap(lambda i: jax.random.fold_in(key, i))(idx)
