"""Many runs in one program: whole experiments over seeds and
hyperparameters.

A sweep of S configurations (seed, hyperparameter values) is one compiled
round function over a leading config axis of the algorithm states, the round
keys and the swept values (``jax.vmap`` on accelerators, a ``lax.map`` loop
on CPU: ``resolve_config_axis``), with the algorithm rebuilt
inside the trace from the (traced) values. Configuration s uses exactly the
keys of ``experiment.run(seed=seed_s)``, so its results equal its own single
run. Needs a fused executor (vmap, blocked, sharded). The loop around it is
``experiment.run_many``, the same as single runs' (evaluation cadence,
pre-round diagnostics, divergence per configuration, callbacks).
"""

import collections
import dataclasses
import itertools
from typing import Callable, Collection, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal import algorithms as algorithms_lib
from fedjax_personal import numerics
from fedjax_personal.config import TrainingConfig
from fedjax_personal.core.algorithm import FederatedAlgorithm
from fedjax_personal.core.data import FederatedData
from fedjax_personal.core.engine import RoundRunner, round_functions
from fedjax_personal.core.evaluation import eval_function
from fedjax_personal.core.executors import Executor
from fedjax_personal.core.sampling import CohortSampler
from fedjax_personal.core.system import Devices
from fedjax_personal.core.training import LossStats
from fedjax_personal.hparams import flag_name
from fedjax_personal.run import experiment
from fedjax_personal.run.experiment import SingleRun

__all__ = [
  'Config',
  'config_label',
  'configs',
  'LoopRuns',
  'parse_sweep',
  'resolve_config_axis',
  'sweepable',
  'SweepRunner',
]


Config = Tuple[int, Dict[str, float]]


def sweepable() -> Dict[str, tuple]:
  """{flag name: (config class, field)} of the settings ``--sweep`` accepts
  (declared ``hparam(..., sweep=True)``: the shared training settings and
  every registered algorithm's).

  Returns:
    ``{flag: (class, field)}``.
  """
  out = {}
  for cls in [TrainingConfig] + algorithms_lib.config_classes():
    for f in dataclasses.fields(cls):
      if f.metadata.get('sweep'):
        out[flag_name(cls, f.name)] = (cls, f.name)
  return out


def parse_sweep(
  spec: str, sweepable: Collection[str]
) -> Dict[str, List[float]]:
  """'client_lr:0.01,0.03;fedprox_mu:0,0.1' -> {'client_lr': [...],
  'fedprox_mu': [...]}.

  ``sweepable``: the names that may be swept (settings declared with
  ``hparam(..., sweep=True)``, used only arithmetically by the builders).

  Args:
    spec: ``--sweep``'s text.
    sweepable: ``{flag: (class, field)}``.

  Returns:
    ``{flag: [values]}``.
  """
  out = {}
  for part in filter(None, spec.split(';')):
    if ':' not in part:
      raise ValueError(f'expected name:v1,v2,... got {part!r}')
    name, values = part.split(':', 1)
    name = name.strip()
    if name in out:
      raise ValueError(
        f'{name} is swept twice; give its values once ({name}:v1,v2,...)'
      )
    if name not in sweepable:
      raise ValueError(
        f'{name!r} cannot be swept: only settings declared with hparam(..., '
        f'sweep=True) can (used only arithmetically by the builders, so one '
        f'program runs every value); choose from {sorted(sweepable)}'
      )
    try:
      out[name] = [float(v) for v in values.split(',') if v]
    except ValueError:
      raise ValueError(
        f'values of {name} must be numbers, got {values!r}'
      ) from None
    if not out[name]:
      raise ValueError(f'no values for {name}')
  return out


def configs(
  seeds: Sequence[int], values: Dict[str, List[float]]
) -> List[Config]:
  """The cross product of seeds and swept values.

  Args:
    seeds: the seeds.
    values: ``{name: [values]}``.

  Returns:
    ``[(seed, {name: value})]``.
  """
  names = sorted(values)
  return [
    (s, dict(zip(names, combo)))
    for s in seeds
    for combo in itertools.product(*(values[n] for n in names))
  ]


def config_label(config: Config) -> dict:
  """What a configuration's records carry: its seed and swept values.

  Args:
    config: ``(seed, {name: value})``.

  Returns:
    The label.
  """
  seed, values = config
  return {'seed': int(seed), **{k: float(v) for k, v in values.items()}}


CONFIG_AXES = ('auto', 'vmap', 'loop', 'host')


def resolve_config_axis(config_axis: str) -> str:
  """``auto`` -> ``host`` on CPU, ``vmap`` on GPU/TPU
  (benchmarks/speed/README.md: on 2 CPU cores a sweep of 8 ran at 0.50-0.74x of
  8 separate runs vmapped and 0.95x as a ``lax.map`` loop, fusions inside the
  loop losing XLA:CPU's thread partitioning; the host loop over the one compiled
  round is the separate runs' own program).

  Args:
    config_axis: ``auto``, ``host`` or ``vmap``.

  Returns:
    ``host`` or ``vmap``.
  """
  if config_axis not in CONFIG_AXES:
    raise ValueError(
      f'config_axis must be one of {list(CONFIG_AXES)}, got {config_axis!r}'
    )
  if config_axis == 'auto':
    return 'host' if jax.default_backend() == 'cpu' else 'vmap'
  return config_axis


@jax.jit
def _take(tree, s):
  return jax.tree.map(lambda a: a[s], tree)


@jax.jit
def _stack(trees):
  return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def _host_loop(one):
  """``one`` (jitted, one configuration) run for each configuration from
  the host; inputs sliced and outputs stacked by two small jitted helpers."""

  def looped(values, state, keys, *shared):
    outs = [
      one(_take(values, s), _take(state, s), keys[s], *shared)
      for s in range(keys.shape[0])
    ]
    return _stack([o[0] for o in outs]), _stack([o[1] for o in outs])

  return looped


def _over_configs(fn, config_axis: str, in_axes):
  """``fn`` mapped over the leading config axis of the arguments whose
  ``in_axes`` entry is 0 (others shared): ``jax.vmap``, or ``lax.map`` (a loop
  inside the compiled program)."""
  if config_axis == 'vmap':
    return jax.vmap(fn, in_axes=in_axes)

  def looped(*args):
    mapped = tuple(a for a, ax in zip(args, in_axes) if ax == 0)

    def one(xs):
      it = iter(xs)
      return fn(*(next(it) if ax == 0 else a for a, ax in zip(args, in_axes)))

    return jax.lax.map(one, mapped)

  return looped


class SweepRunner:
  """A sweep's configurations as one compiled program.

  S configurations of one algorithm as one compiled program: the ``Runs``
  of ``experiment.run_many`` (the loop of single runs).

  Args:
    build: ``{name: value} -> FederatedAlgorithm`` (values may be traced).
    configs: list of (seed, {name: value}), all with the same names.
    data, sampler, executor: as for RoundRunner (executor must be fused).
    config_axis: how the configurations run: ``vmap`` (vectorized in one
      program), ``loop`` (``lax.map``, one after another inside one
      program), ``host`` (the one-configuration round, compiled once, called
      for each configuration), or ``auto`` (per platform,
      ``resolve_config_axis``). Same keys and math either way.
    matmul_precision: as for RoundRunner.
    system: as for RoundRunner (the clients' devices).
    row_groups: as for RoundRunner (rows shuffled in groups).
  """

  def __init__(
    self,
    build: Callable[[Dict], FederatedAlgorithm],
    configs: List[Config],
    data: FederatedData,
    sampler: CohortSampler,
    executor: Executor,
    config_axis: str = 'auto',
    matmul_precision: str = numerics.DEFAULT_MATMUL_PRECISION,
    system: Optional[Devices] = None,
    row_groups: Optional[int] = None,
  ):
    precision = numerics.check_precision(matmul_precision)
    made = build
    build = lambda hv: made(hv).at_matmul_precision(precision)  # noqa: E731
    executor = executor.at_matmul_precision(precision)
    if not executor.fused:
      raise ValueError(
        f'a sweep needs a fused executor (vmap, blocked, sharded), '
        f'not {executor.name}'
      )
    self.config_axis = resolve_config_axis(config_axis)
    self.configs, self.data = configs, data
    self.labels = [config_label(c) for c in configs]
    names = sorted(configs[0][1])
    self.values = {
      n: jnp.asarray([c[1][n] for c in configs], jnp.float32) for n in names
    }
    keys = jax.vmap(
      lambda s: jnp.stack(jax.random.split(jax.random.key(s), 3))
    )(jnp.asarray([c[0] for c in configs]))
    self.init_keys, self.train_keys, self.eval_keys = (
      keys[:, 0],
      keys[:, 1],
      keys[:, 2],
    )
    self.trace_counts: collections.Counter = collections.Counter()
    counts = self.trace_counts
    test_counts = np.asarray(data.test.num_examples)

    def one_init(hv, key):
      return build(hv).init(key)

    def one_round(hv, state, key, round_num, train, val):
      return round_functions(
        build(hv), sampler, executor, counts, system, row_groups
      ).fused_round(state, key, round_num, train, val)

    def one_eval(hv, state, key, data):
      alg = build(hv)
      return eval_function(alg, executor, counts, test_counts)(
        alg.client_models(state), data, key, alg.finetune is not None
      )

    # init / eval
    axis = 'loop' if self.config_axis == 'host' else self.config_axis
    over = lambda fn, *axes: _over_configs(fn, axis, axes)
    self._init = executor.jit(over(one_init, 0, 0))
    if self.config_axis == 'host':
      self._round = _host_loop(executor.jit(one_round))
    else:
      self._round = executor.jit(
        over(one_round, 0, 0, 0, None, None, None), donate_argnums=1
      )
    self._eval = executor.jit(over(one_eval, 0, 0, 0, None))

  @property
  def num_configs(self) -> int:
    return len(self.configs)

  def init(self):
    return self._init(self.values, self.init_keys)

  def round(self, state, t: int, donate: bool = True):
    """(state, {name: [S] array}) of round t (the state is consumed)."""
    del donate  # always donated
    keys = jax.vmap(lambda k: jax.random.fold_in(k, t))(self.train_keys)
    state, metrics = self._round(
      self.values,
      state,
      keys,
      jnp.asarray(t, jnp.int32),
      self.data.train,
      self.data.val,
    )
    return state, jax.device_get(metrics)

  def evaluate(self, state, t: int) -> LossStats:
    keys = jax.vmap(lambda k: jax.random.fold_in(k, t))(self.eval_keys)
    return LossStats(
      *[
        np.asarray(a)
        for a in jax.device_get(self._eval(self.values, state, keys, self.data))
      ]
    )

  def run(
    self, num_rounds: int, eval_every: int = 5, callbacks=()
  ) -> List[List[dict]]:
    """One history per configuration (``experiment.run_many``)."""
    self.state, histories = experiment.run_many(
      self, num_rounds, eval_every, callbacks
    )
    return histories


class LoopRuns:
  """A sweep's configurations run one after another.

  S configurations run one after another within each round (the
  ``Runs`` of ``experiment.run_many`` for executors that cannot be traced
  into a vmapped program, e.g. ``sequential``, and for the host layout):
  one RoundRunner per distinct set of values (compiled once, shared by the
  seeds), one state per configuration (the state is their list). Same
  keys, same numbers as the single runs.

  In the host layout every runner reads one ``placement.CohortFeed``, so the
  configurations of one seed (whose rounds draw the same cohort) share each
  round's gather of its examples; each seed's next cohort is gathered while
  the current round runs.
  """

  def __init__(
    self,
    build: Callable[[Dict], FederatedAlgorithm],
    configs: List[Config],
    data,
    sampler: CohortSampler,
    executor: Executor,
    matmul_precision: str = numerics.DEFAULT_MATMUL_PRECISION,
    system: Optional[Devices] = None,
    row_groups: Optional[int] = None,
  ):
    self.configs = configs
    self.labels = [config_label(c) for c in configs]
    runners = {}
    self.runs = []
    feed = None
    for seed, values in configs:
      k = tuple(sorted(values.items()))
      if k not in runners:
        runners[k] = RoundRunner(
          build(dict(values)),
          data,
          sampler,
          executor,
          feed=feed,
          matmul_precision=matmul_precision,
          system=system,
          row_groups=row_groups,
        )
        feed = getattr(runners[k], 'feed', None)
      self.runs.append(SingleRun(runners[k], seed))
    self.feed = feed

  @property
  def num_configs(self) -> int:
    return len(self.runs)

  def init(self):
    return [r.init() for r in self.runs]

  def round(self, state, t: int, donate: bool = True):
    out = [r.round(s, t, donate) for r, s in zip(self.runs, state)]
    metrics = jax.tree.map(lambda *a: np.concatenate(a), *[m for _, m in out])
    return [s for s, _ in out], metrics

  def evaluate(self, state, t: int) -> LossStats:
    stats = [r.evaluate(s, t) for r, s in zip(self.runs, state)]
    return LossStats(*[np.concatenate(a) for a in zip(*stats)])
