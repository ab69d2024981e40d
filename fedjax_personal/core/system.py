"""Clients as devices: stragglers and lost uploads, drawn inside the round.

Every sampled client of a round otherwise trains its full local work and
uploads. ``SystemConfig`` makes some of them devices that do not:

- **Stragglers** (``stragglers``, a fraction of the cohort): FedProx's
  systems-heterogeneity experiment (Li et al., "Federated Optimization in
  Heterogeneous Networks", MLSys 2020, arXiv 1812.06127, Section 5.2 and
  Figure 1), as its code draws them (litian96/FedProx,
  ``flearn/trainers/fedprox.py`` and ``fedavg.py``): of the K sampled
  clients, ``round(K (1 - stragglers))`` chosen uniformly without
  replacement do their full work, the others are stragglers that do
  ``np.random.randint(1, E)`` epochs, uniform in 1 .. E - 1 (E the local
  epochs; with ``--local_steps`` K, 1 .. K - 1 steps). The draw depends on
  the run's seed and the round only, so every algorithm of a run meets the
  same stragglers (its code seeds ``np.random.seed(round)`` for the same
  reason). What happens to a straggler's partial work is the algorithm's
  rule (``AlgorithmSpec.partial_work``): ``'drop'`` discards it (FedAvg in
  FedProx's experiment, and every algorithm that does not say otherwise),
  ``'keep'`` aggregates it (FedProx, FedNova).
- **Varying local work** (``local_work_min``): every sampled client that
  is not a straggler does a uniform draw of ``local_work_min`` .. E epochs
  (or steps) each round, FedNova's experiments (Wang et al., "Tackling the
  Objective Inconsistency Problem in Heterogeneous Federated Optimization",
  NeurIPS 2020, arXiv 2007.07481: E_i ~ U(2, 5)); every algorithm keeps it.
- **Lost uploads**: ``drop_before``, the probability that a sampled client
  drops out before it trains (it does no work), and ``drop_after``, that it
  trains and its upload is lost; each client independently.

A client whose upload the server never gets is a padded slot of the cohort
for the server's update (``without``): it takes no share of any aggregate
and its per-client state (a personal model, control variates) is left as
it was. The work a client is drawn is the work computed (``step_limit``:
its steps past the limit are masked, a dropped client runs none), so a
round with stragglers costs no more than one without.
"""

import dataclasses
from typing import ClassVar, NamedTuple, Optional

import jax
import jax.numpy as jnp

from fedjax_personal.core.batching import Batching
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.hparams import Declared, hparam

__all__ = ['draw', 'RoundSystem', 'step_limit', 'SYSTEM_DRAWS', 'SystemConfig', 'system_metrics',
           'without', 'PARTIAL_WORK']

#: What an algorithm does with a straggler's partial work (``AlgorithmSpec.partial_work``).
PARTIAL_WORK = ('drop', 'keep')
#: ``fold_in`` tag of the round's system draws (off the cohort's key).
SYSTEM_DRAWS = 0x5157
#: A client's work limit when it is not limited.
_UNLIMITED = 1 << 30


@dataclasses.dataclass(frozen=True)
class SystemConfig(Declared):
  """The clients' devices: stragglers and lost uploads (module doc)."""
  prefix: ClassVar[Optional[str]] = None
  stragglers: float = hparam(0.0, 'Fraction of each round\'s sampled clients that are '
                             'stragglers, doing 1 .. E - 1 of their E local epochs (or 1 .. K - 1 '
                             'of their --local_steps), drawn as FedProx\'s code draws them; the '
                             "algorithm keeps (fedprox, fednova) or drops (the others) their "
                             'partial work. The same clients for every algorithm of a run.',
                             minimum=0, maximum=1)
  local_work_min: Optional[int] = hparam(None, 'Each sampled client that is not a straggler '
                                         'does a uniform draw of this many .. E local epochs '
                                         '(or .. K --local_steps) each round, FedNova\'s '
                                         'experiments (2 .. 5). Default: all E.', minimum=1)
  drop_before: float = hparam(0.0, 'Probability that a sampled client drops out before it '
                              'trains: no work, no upload.', minimum=0, maximum=1,
                              open_max=True)
  drop_after: float = hparam(0.0, 'Probability that a sampled client trains and its upload is '
                             'lost.', minimum=0, maximum=1, open_max=True)

  @property
  def active(self) -> bool:
    """Whether any client is other than a full, reliable device."""
    return bool(self.stragglers or self.drop_before or self.drop_after
                or self.local_work_min is not None)

  def describe(self, specs) -> list:
    """The header's line (none for full, reliable devices).

    Args:
      specs: the run's algorithms' ``AlgorithmSpec`` (their ``partial_work``).

    Returns:
      A list of at most one line.
    """
    if not self.active:
      return []
    parts = []
    if self.stragglers:
      keep = sorted(s.name for s in specs if s.partial_work == 'keep')
      drop = sorted(s.name for s in specs if s.partial_work != 'keep')
      rule = '; '.join(f'{w} by {", ".join(n)}' for w, n in (('kept', keep), ('dropped', drop))
                       if n)
      parts.append(f'{self.stragglers:.0%} of each cohort stragglers doing 1 .. E - 1 of E '
                   f'local epochs (FedProx\'s draw), their work {rule}')
    if self.local_work_min is not None:
      parts.append(f'each other client {self.local_work_min} .. E local epochs (uniform)')
    if self.drop_before:
      parts.append(f'{self.drop_before:.0%} drop out before training')
    if self.drop_after:
      parts.append(f'{self.drop_after:.0%} of uploads lost')
    return ['clients as devices: ' + ', '.join(parts)]

  def problems(self, batching: Batching) -> list:
    """What cannot apply to an algorithm's local work: stragglers need
    E >= 2 (FedProx's ``randint(1, E)`` is empty at E = 1), a drawn minimum
    at most E.

    Args:
      batching: the algorithm's local work.

    Returns:
      ``[(setting, message)]``, empty when every setting applies.
    """
    unit = 'steps' if batching.num_steps is not None else 'epochs'
    e, out = full_work(batching), []
    if self.stragglers and e < 2:
      out.append(('stragglers', f'stragglers do 1 .. E - 1 of E local {unit}; the algorithm '
                                f'does {e}: give 2 or more'))
    if self.local_work_min is not None and self.local_work_min > e:
      out.append(('local_work_min', f'clients draw {self.local_work_min} .. E local {unit}; '
                                    f'the algorithm does E = {e}: give a minimum of at most E'))
    return out


def full_work(batching: Batching) -> int:
  """E, a client's full local work in epochs (or K in steps)."""
  return batching.num_steps if batching.num_steps is not None else batching.num_epochs


class RoundSystem(NamedTuple):
  """A round's draws, one entry per cohort slot.

  Attributes:
    straggler: bool [C], the sampled clients that are stragglers.
    work_limit: int32 [C], the epochs (or steps) each client may do.
    lost: bool [C], the sampled clients whose upload the server never gets.
  """
  straggler: jax.Array
  work_limit: jax.Array
  lost: jax.Array


def draw(config: SystemConfig, key, mask, batching: Batching, partial_work: str) -> RoundSystem:
  """The round's stragglers, work limits and lost uploads (module doc).

  Args:
    config: the ``SystemConfig``.
    key: the round's system key (``fold_in(cohort key, SYSTEM_DRAWS)``).
    mask: bool [C], the cohort's real slots.
    batching: the algorithm's local work (E epochs or K steps).
    partial_work: the algorithm's rule, ``'drop'`` or ``'keep'``.

  Returns:
    The ``RoundSystem``.
  """
  k_pick, k_work, k_before, k_after, k_vary = jax.random.split(key, 5)
  c = mask.shape[0]
  sampled = jnp.sum(mask.astype(jnp.int32))
  # FedProx: np.random.choice(selected, round(K (1 - drop_percent)), replace=False) work fully.
  full = jnp.round(sampled * (1.0 - config.stragglers)).astype(jnp.int32)
  u = jnp.where(mask, jax.random.uniform(k_pick, (c,)), 2.0)
  rank = jnp.argsort(jnp.argsort(u))
  straggler = mask & (rank >= full)
  e = full_work(batching)
  partial = jax.random.randint(k_work, (c,), 1, max(e, 2))  # np.random.randint(1, E)
  before = mask & (jax.random.uniform(k_before, (c,)) < config.drop_before)
  after = mask & (jax.random.uniform(k_after, (c,)) < config.drop_after)
  lost = before | after | (straggler & (partial_work == 'drop'))
  full_limit = _UNLIMITED
  if config.local_work_min is not None:  # FedNova: E_i ~ U(min, E)
    full_limit = jax.random.randint(k_vary, (c,), config.local_work_min, e + 1)
  limit = jnp.where(straggler, partial, full_limit)
  # A client whose upload is lost anyway does no work (its result is discarded).
  limit = jnp.where(before | (lost & (partial_work == 'drop')), 0, limit)
  return RoundSystem(straggler, limit.astype(jnp.int32), lost)


def step_limit(batching: Batching, work_limit, num_examples, max_examples: int):
  """The local steps a client may run: ``work_limit`` epochs of its own
  ``ceil(n / B)`` steps each (or ``work_limit`` steps with a fixed step
  count).

  Args:
    batching: the algorithm's local work.
    work_limit: the client's limit (traced int; ``RoundSystem.work_limit``).
    num_examples: its examples (traced).
    max_examples: the padded length.

  Returns:
    int32 scalar.
  """
  if batching.num_steps is not None:
    return jnp.asarray(work_limit, jnp.int32)
  b = batching.effective_batch_size(max_examples)
  per_epoch = (jnp.asarray(num_examples, jnp.int32) + b - 1) // b
  return jnp.minimum(jnp.asarray(work_limit, jnp.int32), _UNLIMITED // max(max_examples, 1)) * (
      per_epoch)


def without(cohort: Cohort, lost, num_clients: int) -> Cohort:
  """The cohort the server updates with: a lost client a padded slot (no
  share of any aggregate, its client rows not written).

  Args:
    cohort: the sampled cohort.
    lost: bool [C], ``RoundSystem.lost``.
    num_clients: N (a padded slot's index).

  Returns:
    The ``Cohort``.
  """
  idx = jnp.where(lost, num_clients, cohort.idx)
  row_idx = None if cohort.row_idx is None else jnp.where(lost, cohort.idx.shape[0],
                                                          cohort.row_idx)
  return cohort.replace(idx=idx, mask=cohort.mask & ~lost, row_idx=row_idx)


def system_metrics(system: RoundSystem, mask) -> dict:
  """The round's ``stragglers`` and ``uploads_lost`` (counts of sampled clients).

  Args:
    system: the round's ``RoundSystem``.
    mask: bool [C], the cohort's real slots.

  Returns:
    ``{'stragglers', 'uploads_lost'}`` (int32 scalars).
  """
  return {'stragglers': jnp.sum((system.straggler & mask).astype(jnp.int32)),
          'uploads_lost': jnp.sum((system.lost & mask).astype(jnp.int32))}
