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
- **Speeds and a deadline** (``client_speeds``, ``deadline``): client i
  runs ``speed_i`` local steps per time unit (1 without a file); a round's
  deadline D lets it run ``floor(D speed_i)`` steps. A client whose work
  would take longer is a straggler that did what its time allowed (PFLlib's
  time threshold; FedScale's device speeds), kept or dropped by the rule
  above. Each round reports ``compute_time``: the longest time a client
  whose upload arrived worked, ``steps / speed``, in these units, and
  ``local_steps``, the steps every sampled device ran.
- **Availability** (``availability``, ``availability_trace``): a client is
  online in a round with a probability (each client, each round, apart), or
  as a file of on/off rounds says (FedScale's availability traces, by
  round); the cohort is drawn from the online clients only, and each round
  reports ``available``.

A client whose upload the server never gets is a padded slot of the cohort
for the server's update (``without``): it takes no share of any aggregate
and its per-client state (a personal model, control variates) is left as
it was. The work a client is drawn is the work computed (``step_limit``:
its steps past the limit are masked, a dropped client runs none), so a
round with stragglers costs no more than one without.
"""

import dataclasses
from typing import ClassVar, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal import user_reads
from fedjax_personal.core.batching import Batching, traced_num_steps
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.errors import SettingError
from fedjax_personal.hparams import Declared, hparam

__all__ = [
  'available',
  'ClientSystem',
  'draw',
  'draw_cohort',
  'PARTIAL_WORK',
  'prepare',
  'read_values',
  'RoundSystem',
  'SettingError',
  'step_limit',
  'SYSTEM_DRAWS',
  'SystemConfig',
  'system_metrics',
  'uploading',
  'without',
  'Devices',
]

#: What an algorithm does with a straggler's partial work
#: (``AlgorithmSpec.partial_work``).
PARTIAL_WORK = ('drop', 'keep')
#: ``fold_in`` tag of the round's system draws (off the cohort's key).
SYSTEM_DRAWS = 0x5157
#: ``fold_in`` tag of the round's availability draws (off the cohort's key).
AVAILABILITY_DRAWS = 0xA7A1
#: A client's work limit when it is not limited.
_UNLIMITED = 1 << 30


@dataclasses.dataclass(frozen=True)
class SystemConfig(Declared):
  """The clients' devices: stragglers and lost uploads (module doc)."""

  prefix: ClassVar[Optional[str]] = None
  stragglers: float = hparam(
    0.0,
    "Fraction of each round's sampled clients that are "
    'stragglers, doing 1 .. E - 1 of their E local epochs (or 1 .. K - 1 '
    "of their K local_steps), drawn as FedProx's code draws them; the "
    'algorithm keeps (fedprox, fednova) or drops (the others) their '
    'partial work. The same clients for every algorithm of a run.',
    minimum=0,
    maximum=1,
  )
  local_work_min: Optional[int] = hparam(
    None,
    'Each sampled client that is not a straggler '
    'does a uniform draw of this many .. E local epochs '
    "(or .. K local_steps) each round, FedNova's "
    'experiments (2 .. 5). Default: all E.',
    minimum=1,
  )
  drop_before: float = hparam(
    0.0,
    'Probability that a sampled client drops out before it '
    'trains: no work, no upload.',
    minimum=0,
    maximum=1,
    open_max=True,
  )
  drop_after: float = hparam(
    0.0,
    'Probability that a sampled client trains and its upload is lost.',
    minimum=0,
    maximum=1,
    open_max=True,
  )
  client_speeds: Optional[str] = hparam(
    None,
    'A file of one speed per client, local steps per '
    'time unit (text, one number a line, or .npy; the data '
    "set's client order). Default: 1 for every client.",
  )
  deadline: Optional[float] = hparam(
    None,
    'Round deadline, in time units: a client whose local '
    'steps would take longer (steps / speed) is a straggler '
    'that did floor(deadline x speed) steps, its work kept or '
    "dropped by the algorithm's rule.",
    minimum=0,
    open_min=True,
  )
  availability: float = hparam(
    1.0,
    'Probability that a client is online in a round (each '
    'client, each round, apart); cohorts are drawn from the online '
    'clients.',
    minimum=0,
    maximum=1,
    open_min=True,
  )
  availability_trace: Optional[str] = hparam(
    None,
    'A file of on/off rounds: one row per round, '
    'one 0/1 per client (text or .npy); round t reads '
    'row t mod its rows. Cohorts are drawn from the '
    'clients on.',
  )

  @property
  def active(self) -> bool:
    """Whether any client is other than a full, reliable device."""
    return bool(
      self.stragglers
      or self.drop_before
      or self.drop_after
      or self.local_work_min is not None
      or self.client_speeds
      or self.deadline
      or self.availability < 1
      or self.availability_trace
    )

  #: The settings that name a file: the identity records its contents.
  FILES: ClassVar[tuple] = ('client_speeds', 'availability_trace')

  def identity(self) -> dict:
    """The settings as a run's identity records them: a file a setting
    names by the SHA-256 of its contents, not its path (an edited file is
    another run; the same file moved is the same run).

    Returns:
      A JSON-like dict.
    """
    out = dataclasses.asdict(self)
    for name in self.FILES:
      if out[name]:
        out[name] = {'sha256': user_reads.digest_of(out[name])}
    return out

  def describe(self, specs, steps: bool = False) -> list:
    """The header's line (none for full, reliable devices).

    Args:
      specs: the run's algorithms' ``AlgorithmSpec`` (their ``partial_work``).
      steps: the local work is counted in steps (``local_steps``: K), not
        epochs (E).

    Returns:
      A list of at most one line.
    """
    if not self.active:
      return []
    n, unit = ('K', 'local steps') if steps else ('E', 'local epochs')
    parts = []
    if self.stragglers:
      keep = sorted(s.name for s in specs if s.partial_work == 'keep')
      drop = sorted(s.name for s in specs if s.partial_work != 'keep')
      rule = '; '.join(
        f'{w} by {", ".join(n)}'
        for w, n in (('kept', keep), ('dropped', drop))
        if n
      )
      parts.append(
        f'{self.stragglers:.0%} of each cohort stragglers doing 1 .. {n} - 1 '
        f"of {n} {unit} (FedProx's draw), their work {rule}"
      )
    if self.local_work_min is not None:
      parts.append(
        f'each other client {self.local_work_min} .. {n} {unit} (uniform)'
      )
    if self.drop_before:
      parts.append(f'{self.drop_before:.0%} drop out before training')
    if self.drop_after:
      parts.append(f'{self.drop_after:.0%} of uploads lost')
    if self.client_speeds:
      parts.append(f'speeds from {self.client_speeds}')
    if self.deadline:
      parts.append(f'a deadline of {self.deadline:g} time units')
    if self.availability < 1:
      parts.append(f'each client online with probability {self.availability:g}')
    if self.availability_trace:
      parts.append(f'online as {self.availability_trace} says')
    return ['clients as devices: ' + ', '.join(parts)]

  def check(self) -> None:
    """Availability by probability or by trace, not both."""
    if self.availability < 1 and self.availability_trace:
      raise SettingError(
        'availability',
        'does nothing with an availability trace (the trace '
        'says who is online)',
        owner=type(self),
      )

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
      out.append(
        (
          'stragglers',
          f'stragglers do 1 .. E - 1 of E local {unit}; the algorithm '
          f'does {e}: give 2 or more',
        )
      )
    if self.local_work_min is not None and self.local_work_min > e:
      out.append(
        (
          'local_work_min',
          f'clients draw {self.local_work_min} .. E local {unit}; '
          f'the algorithm does E = {e}: give a minimum of at most E',
        )
      )
    return out


def full_work(batching: Batching) -> int:
  """E, a client's full local work in epochs (or K in steps)."""
  return int(
    batching.num_steps
    if batching.num_steps is not None
    else batching.num_epochs or 0
  )


def read_values(path: str, what: str) -> np.ndarray:
  """The numbers of a ``.npy`` or text file (whitespace or commas apart, one
  row a line, ``#`` comments skipped), as float64.

  Args:
    path: the file.
    what: what it holds, for the error.

  Returns:
    The array (1-D for one column or one row of a text file as written).

  Raises:
    ValueError naming the file: unreadable, or not finite numbers.
  """
  try:
    if path.endswith('.npy'):
      out = np.asarray(np.load(path, allow_pickle=False), np.float64)
    else:
      with open(path, encoding='utf-8') as f:
        rows = [line.split('#')[0].replace(',', ' ').split() for line in f]
      rows = [r for r in rows if r]
      out = np.array([[float(v) for v in r] for r in rows], np.float64)
      out = out[:, 0] if out.ndim == 2 and out.shape[1] == 1 else out
  except (OSError, ValueError) as e:
    raise ValueError(f'{path}: cannot read {what} ({e})') from None
  if not out.size or not np.all(np.isfinite(out)):
    raise ValueError(f'{path}: {what} must be finite numbers, one or more')
  return out


class ClientSystem(NamedTuple):
  """A ``SystemConfig`` with its files read, for a population of N clients.

  Attributes:
    config: the ``SystemConfig``.
    speeds: float32 [N] local steps per time unit, or None (1 each).
    trace: bool [T, N] who is online in round t (row t mod T), or None.
  """

  config: SystemConfig
  speeds: Optional[np.ndarray] = None
  trace: Optional[np.ndarray] = None


#: What the engine takes for the clients' devices: the settings, or the
#: ``ClientSystem`` already prepared from them (its files read once).
Devices = Union[SystemConfig, ClientSystem]


def prepare(system: Devices, num_clients: int) -> ClientSystem:
  """The ``ClientSystem`` of a config (its files read and checked against
  the population), or ``system`` itself when already one.

  Args:
    system: a ``SystemConfig`` or a ``ClientSystem``.
    num_clients: N, the population's clients.

  Returns:
    The ``ClientSystem``.

  Raises:
    SettingError naming the setting whose file does not fit.
  """
  if isinstance(system, ClientSystem):
    return system
  speeds = trace = None
  try:
    if system.client_speeds:
      speeds = read_values(system.client_speeds, 'client speeds')
      speeds = (
        speeds.reshape(-1)
        if speeds.ndim == 2 and speeds.shape[0] == 1
        else speeds
      )
      if (
        speeds.ndim != 1
        or speeds.shape[0] != num_clients
        or (speeds <= 0).any()
      ):
        raise ValueError(
          f'{system.client_speeds}: {speeds.size} speeds as '
          f'{list(speeds.shape)}; the data has {num_clients} clients, and a '
          'speed must be positive: one per client, one per line'
        )
  except ValueError as e:
    raise SettingError('client_speeds', str(e), owner=SystemConfig) from None
  try:
    if system.availability_trace:
      trace = read_values(system.availability_trace, 'on/off rounds')
      trace = trace.reshape(1, -1) if trace.ndim == 1 else trace
      if (
        trace.ndim != 2
        or trace.shape[1] != num_clients
        or not np.isin(trace, (0, 1)).all()
      ):
        raise ValueError(
          f'{system.availability_trace}: rows of {trace.shape[-1]} values; the '
          f'data has {num_clients} clients: one 0/1 per client, one row per '
          f'round'
        )
      if not trace.any():
        raise ValueError(
          f'{system.availability_trace}: no client is ever online (every value '
          '0): no round would train'
        )
  except ValueError as e:
    raise SettingError(
      'availability_trace', str(e), owner=SystemConfig
    ) from None
  return ClientSystem(
    system,
    None if speeds is None else speeds.astype(np.float32),
    None if trace is None else trace.astype(bool),
  )


def available(system: Optional[ClientSystem], key, round_num, num_clients: int):
  """bool [N], the clients online this round, or None: every client.

  Args:
    system: the ``ClientSystem`` (None: none).
    key: the cohort's key (its availability draws are ``fold_in(key,
      AVAILABILITY_DRAWS)``).
    round_num: the round (traced int; picks the trace's row).
    num_clients: N.

  Returns:
    The mask, or None.
  """
  if system is None:
    return None
  if system.trace is not None:
    trace = jnp.asarray(system.trace)
    return trace[jnp.asarray(round_num, jnp.int32) % trace.shape[0]]
  if system.config.availability < 1:
    u = jax.random.uniform(
      jax.random.fold_in(key, AVAILABILITY_DRAWS), (num_clients,)
    )
    return u < system.config.availability
  return None


class RoundSystem(NamedTuple):
  """A round's draws, one entry per cohort slot.

  Attributes:
    straggler: bool [C], the sampled clients that are stragglers.
    work_limit: int32 [C], the epochs (or steps) each client may do.
    lost: bool [C], the sampled clients whose upload the server never gets.
    step_cap: int32 [C], the steps its deadline lets each client run.
    compute_time: float32, the longest time an uploading client worked.
    available: int32, the clients online this round (None: every client).
    local_steps: int32, the local steps the sampled clients' devices ran.
  """

  straggler: jax.Array
  work_limit: Optional[jax.Array]
  lost: jax.Array
  step_cap: Optional[jax.Array] = None
  compute_time: Optional[jax.Array] = None
  available: Optional[jax.Array] = None
  local_steps: Optional[jax.Array] = None


def draw(
  system,
  key,
  mask,
  batching: Batching,
  partial_work: str,
  counts=None,
  max_examples: int = 1,
  idx=None,
) -> RoundSystem:
  """The round's stragglers, work limits, deadline and lost uploads (module
  doc).

  Args:
    system: the ``ClientSystem`` (or a ``SystemConfig`` without files).
    key: the round's system key (``fold_in(cohort key, SYSTEM_DRAWS)``).
    mask: bool [C], the cohort's real slots.
    batching: the algorithm's local work (E epochs or K steps).
    partial_work: the algorithm's rule, ``'drop'`` or ``'keep'``.
    counts: int [C], the cohort's training examples (None: the time and the
      deadline are not computed).
    max_examples: the padded length of a client's examples.
    idx: int [C], the cohort's clients (their speeds; None: speed 1).

  Returns:
    The ``RoundSystem``.
  """
  system = prepare(system, 0)
  config = system.config
  k_pick, k_work, k_before, k_after, k_vary = jax.random.split(key, 5)
  c = mask.shape[0]
  sampled = jnp.sum(mask.astype(jnp.int32))
  # FedProx: np.random.choice(selected, round(K (1 - drop_percent)),
  # replace=False) work fully.
  full = jnp.round(sampled * (1.0 - config.stragglers)).astype(jnp.int32)
  u = jnp.where(mask, jax.random.uniform(k_pick, (c,)), 2.0)
  rank = jnp.argsort(jnp.argsort(u))
  straggler = mask & (rank >= full)
  e = full_work(batching)
  # np.random.randint(1, E)
  partial = jax.random.randint(k_work, (c,), 1, max(e, 2))
  before = mask & (jax.random.uniform(k_before, (c,)) < config.drop_before)
  after = mask & (jax.random.uniform(k_after, (c,)) < config.drop_after)
  full_limit: int | jax.Array = _UNLIMITED
  if config.local_work_min is not None:  # FedNova: E_i ~ U(min, E)
    full_limit = jax.random.randint(k_vary, (c,), config.local_work_min, e + 1)
  limit = jnp.where(straggler, partial, full_limit)
  cap, time = None, None
  if counts is not None:
    speed = (
      jnp.ones(c, jnp.float32)
      if system.speeds is None or idx is None
      else jnp.asarray(system.speeds)[
        jnp.clip(idx, 0, system.speeds.shape[0] - 1)
      ]
    )
    planned = jax.vmap(lambda w, n: step_limit(batching, w, n, max_examples))(
      limit, counts
    )
    planned = jnp.minimum(planned, _full_steps(batching, counts, max_examples))
    cap = jnp.full(c, _UNLIMITED, jnp.int32)
    if config.deadline:
      cap = jnp.floor(config.deadline * speed).astype(jnp.int32)
      straggler |= mask & (planned > cap)  # late: the steps its time allowed
    steps = jnp.minimum(planned, cap)
  lost = before | after | (straggler & (partial_work == 'drop'))
  # A client whose upload is lost anyway does no work (its result is discarded).
  limit = jnp.where(before | (lost & (partial_work == 'drop')), 0, limit)
  work = None
  if counts is not None:
    worked = jnp.where(mask & ~lost, steps / speed, 0.0)
    time = jnp.max(worked, initial=0.0)
    # a client that does no work (lost anyway) runs none
    ran = jnp.where(limit == 0, 0, steps)
    work = jnp.sum(jnp.where(mask, ran, 0)).astype(jnp.int32)
  return RoundSystem(
    straggler, limit.astype(jnp.int32), lost, cap, time, None, work
  )


def _full_steps(batching: Batching, counts, max_examples: int):
  """Each client's full local steps (``Batching.num_steps_for``, traced)."""
  return jnp.asarray(
    traced_num_steps(batching, counts, max_examples), jnp.int32
  )


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
  return jnp.minimum(
    jnp.asarray(work_limit, jnp.int32), _UNLIMITED // max(max_examples, 1)
  ) * (per_epoch)


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
  row_idx = (
    None
    if cohort.row_idx is None
    else jnp.where(lost, cohort.idx.shape[0], cohort.row_idx)
  )
  return dataclasses.replace(
    cohort, idx=idx, mask=cohort.mask & ~lost, row_idx=row_idx
  )


def system_metrics(system: RoundSystem, mask) -> dict:
  """The round's ``stragglers`` and ``uploads_lost`` (counts of sampled
  clients).

  Args:
    system: the round's ``RoundSystem``.
    mask: bool [C], the cohort's real slots.

  Returns:
    ``{'stragglers', 'uploads_lost'}`` (int32 scalars) and, when the round
    knew its clients' work, ``compute_time`` and ``local_steps``; with
    availability, ``available``.
  """
  out = {
    'stragglers': jnp.sum((system.straggler & mask).astype(jnp.int32)),
    'uploads_lost': jnp.sum((system.lost & mask).astype(jnp.int32)),
  }
  if system.compute_time is not None:
    out['compute_time'] = system.compute_time
  if system.available is not None:
    out['available'] = system.available.astype(jnp.int32)
  if system.local_steps is not None:
    out['local_steps'] = system.local_steps
  return out


def draw_cohort(sampler, key, round_num=0, system=None):
  """The cohort of the round whose key is ``key`` (the round's own draw,
  ``split(key)[0]``; the host layout draws it ahead with this), from the
  clients online in round ``round_num`` when ``system`` says who is.

  Args:
    sampler: the ``CohortSampler``.
    key: the round's key.
    round_num: the round (an availability trace's row).
    system: a prepared ``ClientSystem``, or None.

  Returns:
    The ``Cohort``.
  """
  k = jax.random.split(key)[0]
  return sampler(
    k,
    available=available(system, k, round_num, sampler.num_clients),
    round_num=round_num,
  )


def uploading(cohort, devices: Optional['RoundSystem']):
  """The cohort's slots whose client work reaches the server (``active``
  for the executor): the sampled clients less the lost uploads the round's
  system drew.

  Args:
    cohort: the sampled ``Cohort``.
    devices: the round's ``RoundSystem`` (``engine.RoundShared.devices``),
      or None: every client a full, reliable device.

  Returns:
    bool [C].
  """
  return cohort.mask if devices is None else cohort.mask & ~devices.lost
