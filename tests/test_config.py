"""One configuration path: every shared setting reaches every algorithm or is
refused, and the registry, flags and configs agree."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from helpers import SmallBN, digits_data, parse_flags, run_rounds

from fedjax_personal import algorithms
from fedjax_personal.config import TrainingConfig, validate
from fedjax_personal.core.data import to_device
from fedjax_personal.datasets import DataConfig, load_federated
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import MLP, from_flax
from fedjax_personal.run import experiment_entry

# The base run every variant is compared with: 2 rounds of 2 local steps.
BASE = {'batch_size': '4', 'local_steps': '2', 'client_lr': '0.05'}

# One non-default value per shared setting; a tuple gives changes to BASE the
# variant needs (its baseline shares them; None removes a flag), then the flag.
VARIANTS = {
  'client_optimizer': '--client_optimizer=adam',
  'client_lr': '--client_lr=0.2',
  'client_momentum': '--client_momentum=0.9',
  'client_weight_decay': '--client_weight_decay=0.5',
  'client_grad_clip': '--client_grad_clip=0.01',
  'client_lr_decay': '--client_lr_decay=0.1',
  'client_lr_schedule': '--client_lr_schedule=linear',  # round 0 at rate 0
  'client_lr_warmup': (
    {'client_lr_schedule': 'linear'},
    '--client_lr_warmup=0',
  ),
  'client_lr_horizon': (
    {'client_lr_schedule': 'linear', 'client_lr_warmup': '0'},
    '--client_lr_horizon=2',
  ),
  'client_lr_cut_every': (
    {'client_lr_schedule': 'cut'},
    '--client_lr_cut_every=1',
  ),
  'client_lr_cut_factor': (
    {'client_lr_schedule': 'cut', 'client_lr_cut_every': '1'},
    '--client_lr_cut_factor=0.1',
  ),
  'client_opt_state': (
    {'client_optimizer': 'adam'},
    '--client_opt_state=persistent',
  ),
  'batch_size': '--batch_size=8',
  'local_epochs': ({'local_steps': None}, '--local_epochs=2'),
  'local_steps': '--local_steps=4',
  'drop_last': ({'local_steps': None, 'batch_size': '3'}, '--drop_last'),
  'weighting': None,  # the other value of the algorithm's default
  'server_optimizer': '--server_optimizer=adam',
  'server_lr': '--server_lr=0.5',
  'server_momentum': '--server_momentum=0.9',
  'server_beta1': ({'server_optimizer': 'yogi'}, '--server_beta1=0.5'),
  'server_beta2': ({'server_optimizer': 'yogi'}, '--server_beta2=0.5'),
  'server_tau': ({'server_optimizer': 'yogi'}, '--server_tau=0.1'),
  'finetune_steps': '--finetune_steps=2',
  'finetune_lr': '--finetune_lr=0.5',
}


def test_variants_cover_every_shared_setting():
  assert set(VARIANTS) == {f.name for f in dataclasses.fields(TrainingConfig)}


@functools.lru_cache(maxsize=None)
def _data_and_model():
  # Rotation groups (oracle), a validation split (FedFomo), unequal client
  # sizes (weighting) from Dirichlet label skew inside the groups.
  data = to_device(
    load_federated(
      DataConfig(
        dataset='digits',
        partition='rotation',
        num_groups=2,
        group_base='dirichlet',
        alpha=0.5,
        num_clients=4,
        max_examples=160,
        val_fraction=0.2,
        seed=0,
      )
    )
  )
  assert len(set(np.asarray(data.train.num_examples).tolist())) > 1
  model = from_flax(
    'mlp', MLP(data.num_classes, hidden=(8,)), data.train.x[0, :1]
  )
  return data, model


# FedBN personalizes a model's batch normalization: it runs a model with one.
BATCH_NORM_MODEL = ('fedbn',)


@functools.lru_cache(maxsize=None)
def _batch_norm_model():
  data, _ = _data_and_model()
  return from_flax('small_bn', SmallBN(data.num_classes), data.train.x[0, :1])


# Per algorithm: user-centric with one stream per client (W itself), a
# cheaper collaboration round; it runs compiled (COMPILED: 9 s against 37 s
# op by op on 2 cores).
ALGORITHM_BASE = {'usercentric': ('--usercentric_num_streams=4',)}
COMPILED = ('usercentric',)


def _parse(args):
  parse_flags(*args)


def _settings(name, base: tuple, args=()):
  """What the CLI would build: (spec, training, config) or ConfigError."""
  uses = algorithms.REGISTRY[name].uses
  flagged = [
    f'--{k}={v}'
    for k, v in {**BASE, **dict(base)}.items()
    if v is not None and k in uses
  ]
  _parse(
    [f'--algorithm={name}']
    + flagged
    + list(ALGORITHM_BASE.get(name, ()))
    + list(args)
  )
  (a,) = experiment_entry.read_flags().algorithms
  return a.spec, a.training, a.config


# Settings whose effect starts in the second round.
TWO_ROUNDS = (
  'client_lr_decay',
  'client_opt_state',
  'server_momentum',
  'client_lr_horizon',
  'client_lr_cut_every',
  'client_lr_cut_factor',
)
#: Algorithms whose clients first train in the second round (FedPCL's
#: clients only compute prototypes in their first).
TRAIN_FROM_SECOND_ROUND = ('fedpcl',)


@functools.lru_cache(maxsize=None)
def _result(
  name, base: tuple, args: tuple = (), rounds: int = 1, evaluate: bool = False
):
  """The state after ``rounds`` rounds, and every client's evaluation."""
  data, model = _data_and_model()
  if name in BATCH_NORM_MODEL:
    model = _batch_norm_model()
  spec, training, config = _settings(name, base, args)
  alg = algorithms.build(name, model, data, training=training, config=config)
  # Tiny problem: op by op beats compiling 400 programs, except for
  # algorithms whose round has many small ops (the collaboration round).
  with jax.disable_jit(name not in COMPILED):
    runner, state = run_rounds(alg, data, rounds=rounds)
    stats = runner.evaluate(state, jax.random.key(5)) if evaluate else None
  return jax.device_get((stats, state))


def _differs(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  if len(la) != len(lb):
    return True
  return any(
    x.shape != y.shape
    or np.max(
      np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)), initial=0.0
    )
    > 1e-6
    for x, y in zip(la, lb)
  )


# CI runs client_momentum (silently ignored by 17 algorithms before this check
# existed) for every algorithm, and test_every_shared_setting_is_used_or_refused
# checks the declarations of all settings; the full behavioural matrix (25 x 16,
# about 8 minutes on 2 cores) is marked slow:
#   python -m pytest -m slow tests/test_config.py
CI_SETTINGS = ('client_momentum',)


def _matrix():
  for setting in sorted(VARIANTS):
    for name in algorithms.REGISTRY:
      marks = () if setting in CI_SETTINGS else (pytest.mark.slow,)
      yield pytest.param(name, setting, marks=marks, id=f'{name}-{setting}')


@pytest.mark.parametrize('name,setting', list(_matrix()))
@pytest.mark.ci_variants(
  'ditto-client_momentum',
  'fedalt-client_momentum',
  'fedavg-client_momentum',
  'feddyn-client_momentum',
  'pfedme-client_momentum',
  'scaffold-client_momentum',
)
def test_no_silent_setting(name, setting):
  """The setting changes a 2-round result, or the CLI refuses it naming it."""
  variant = VARIANTS[setting]
  if variant is None:  # weighting: the value that is not the default
    other = {'num_examples': 'uniform', 'uniform': 'num_examples'}
    variant = (
      '--weighting=' + other[algorithms.REGISTRY[name].default_weighting]
    )
  extra, flag = variant if isinstance(variant, tuple) else ({}, variant)
  extra = tuple(sorted(extra.items()))
  try:
    _settings(name, extra, [flag])
  except ConfigError as e:
    assert e.name == setting, str(e)
    return
  kw = dict(
    rounds=2 if setting in TWO_ROUNDS or name in TRAIN_FROM_SECOND_ROUND else 1,
    evaluate=setting.startswith('finetune'),
  )
  base = _result(name, extra, **kw)
  changed = _result(name, extra, (flag,), **kw)
  assert _differs(base, changed), f'{flag} changed nothing for {name}'


@pytest.mark.parametrize('setting', sorted(VARIANTS))
def test_every_shared_setting_is_used_or_refused(setting):
  """Without running: each algorithm either declares that it reads the
  setting or the CLI refuses it (the behaviour is test_no_silent_setting's)."""
  for name, spec in algorithms.REGISTRY.items():
    variant = VARIANTS[setting]
    if variant is None:
      other = {'num_examples': 'uniform', 'uniform': 'num_examples'}
      variant = '--weighting=' + other[spec.default_weighting]
    extra, flag = variant if isinstance(variant, tuple) else ({}, variant)
    try:
      _settings(name, tuple(sorted(extra.items())), [flag])
    except ConfigError as e:
      assert e.name == setting, (name, str(e))
      continue
    assert setting in spec.uses, (name, setting)


def test_momentum_applies_to_every_algorithm_or_is_refused():
  refused = []
  for name in algorithms.REGISTRY:
    try:
      _settings(name, (), ['--client_momentum=0.9'])
    except ConfigError:
      refused.append(name)
  # FedSGD: one step from a fresh buffer; APPLE: PFLlib moves its cores by
  # plain SGD steps, never its optimizer's
  assert refused == ['fedsgd', 'apple']


def test_flags_are_derived_from_the_declarations():
  for cls in [TrainingConfig] + algorithms.config_classes():
    for f in dataclasses.fields(cls):
      name = f.name if cls is TrainingConfig else f'{cls.prefix}_{f.name}'
      assert flags.FLAGS[name].default == f.default, name
      assert flags.FLAGS[name].help.endswith(f.metadata['help'])


def test_setting_for_an_algorithm_not_run_is_refused():
  _parse(['--algorithm=fedavg', '--fedprox_mu=0.5'])
  with pytest.raises(ConfigError, match='fedprox_mu.*applies to fedprox'):
    experiment_entry.read_flags()


def test_setting_used_by_some_algorithms_is_noted(capsys):
  _parse(['--algorithm=fedavg,feddyn', '--server_lr=0.5'])
  out = experiment_entry.read_flags().algorithms
  assert out[0].training.server_lr == 0.5 and out[0].ignored == ()
  assert out[1].training.server_lr == 1.0 and out[1].ignored == ('server_lr',)
  assert 'feddyn does not use --server_lr' in capsys.readouterr().out


def test_variant_fields_are_refused_where_ignored():
  _parse(['--algorithm=fedrep', '--partial_personal_part=input'])
  with pytest.raises(ConfigError, match='partial_personal_part'):
    experiment_entry.read_flags()


@pytest.mark.parametrize(
  'field,value',
  [
    ('client_lr', 0.0),
    ('client_momentum', 1.0),
    ('client_lr_decay', 1.5),
    ('weighting', 'sizes'),
    ('client_lr', float('nan')),
  ],
)
def test_ranges_name_the_field(field, value):
  with pytest.raises(ConfigError, match=field):
    validate(dataclasses.replace(TrainingConfig(), **{field: value}))


def test_library_build_refuses_unknown_and_inapplicable_settings():
  data, model = _data_and_model()
  with pytest.raises(ConfigError, match='mu'):
    algorithms.build('fedavg', model, data, mu=0.1)
  with pytest.raises(ConfigError, match='server_lr'):
    algorithms.build('feddyn', model, data, server_lr=0.5)
  alg = algorithms.build('fedprox', model, data, mu=0.5, client_lr=0.1)
  assert alg.name == 'fedprox'


def test_persistent_optimizer_state_is_kept_per_client():
  data, model = _data_and_model()
  alg = algorithms.build(
    'fedavg',
    model,
    data,
    client_momentum=0.9,
    client_opt_state='persistent',
    local_steps=2,
    local_epochs=1,
  )
  _, state = run_rounds(alg, data, rounds=2)
  trace = jax.tree.leaves(state.opt_state)
  assert trace and all(a.shape[0] == data.num_clients for a in trace)
  assert all(
    float(np.abs(np.asarray(a)).max()) > 0 for a in trace if a.dtype != np.int32
  )
  chex.assert_tree_all_finite(state)


def _seed_lr_lambda(
  kind, rounds, warmup_fraction=0.1, decay_factor=0.5, decay_every=100
):
  """``get_fed_global_lr_scheduler`` of the partial-personalization seed's
  pfl/utils.py, as its code has it."""
  if kind == 'linear':
    num_warmup_steps = warmup_fraction * rounds

    def lr_lambda(current_step):
      if current_step < num_warmup_steps:
        return current_step / max(1.0, num_warmup_steps)
      return max(
        0.0, (rounds - current_step) / max(1.0, rounds - num_warmup_steps)
      )

    return lr_lambda
  return lambda current_step: decay_factor ** (current_step // decay_every)


@pytest.mark.parametrize(
  'kind,rounds,a,b',
  [
    ('linear', 500, 0.1, None),
    ('linear', 7, 0.3, None),
    ('cut', 500, 0.5, 100),
    ('cut', 9, 0.1, 2),
  ],
)
def test_client_rate_schedules_are_the_seeds(kind, rounds, a, b):
  """Every round's factor equals the seed's ``lr_lambda``, and the client
  optimizer's step in round t is SGD's at client_lr times it."""
  from fedjax_personal import config as config_lib

  fn = (
    config_lib.linear_schedule(rounds, a)
    if kind == 'linear'
    else config_lib.cut_schedule(b, a)
  )
  want = _seed_lr_lambda(
    kind, rounds, warmup_fraction=a, decay_factor=a, decay_every=b
  )
  got = np.asarray(jax.vmap(fn)(np.arange(rounds, dtype=np.float32)))
  np.testing.assert_allclose(
    got, [want(t) for t in range(rounds)], rtol=1e-6, atol=1e-7
  )
  extra = (
    {'client_lr_warmup': a, 'client_lr_horizon': rounds}
    if kind == 'linear'
    else {'client_lr_cut_factor': a, 'client_lr_cut_every': b}
  )
  training = TrainingConfig(client_lr=0.3, client_lr_schedule=kind, **extra)
  training.check()
  opt, g, p = (
    training.make_client_optimizer(),
    {'w': jnp.ones(3)},
    {'w': jnp.zeros(3)},
  )
  for t in (0, 1, rounds // 2, rounds - 1):
    step, _ = opt.update(g, opt.init(p), p, round_num=t)
    np.testing.assert_allclose(
      step['w'], -0.3 * want(t) * np.ones(3), rtol=1e-6, atol=1e-8
    )


def test_a_setting_of_the_run_is_filled_from_it_unless_told():
  """FedPHP's schedule horizon (``hparam(of_run=...)``): the run's rounds
  minus one when not given, the value given otherwise; a library build
  without it is refused naming the flag."""
  _parse(['--algorithm=fedphp', '--rounds=7'])
  assert experiment_entry.read_flags().algorithms[0].config.horizon == 6
  _parse(['--algorithm=fedphp', '--rounds=1'])
  assert experiment_entry.read_flags().algorithms[0].config.horizon == 1
  _parse(['--algorithm=fedphp', '--rounds=7', '--fedphp_horizon=3'])
  assert experiment_entry.read_flags().algorithms[0].config.horizon == 3
  data = to_device(digits_data(num_clients=2))
  model = from_flax('mlp', MLP(10, hidden=(8,)), data.train.x[0, :1])
  with pytest.raises(ConfigError, match='--fedphp_horizon'):
    algorithms.build('fedphp', model, data)


def test_fedcross_models_are_the_cohort_and_refuse_participation():
  _parse(['--algorithm=fedcross', '--cohort_size=5'])
  assert experiment_entry.read_flags().algorithms[0].config.num_models == 5
  _parse(['--algorithm=fedcross', '--participation=0.5'])
  with pytest.raises(ConfigError, match='give --cohort_size') as e:
    experiment_entry.read_flags()
  assert e.value.name == 'participation'
  # only the run's algorithms read the run: FedCross's rule refuses nothing
  # in a run without it
  _parse(['--algorithm=fedavg', '--participation=0.5'])
  assert experiment_entry.read_flags().algorithms[0].spec.name == 'fedavg'


def test_linear_schedule_spans_the_rounds_unless_told():
  _parse(['--algorithm=fedavg', '--client_lr_schedule=linear', '--rounds=7'])
  assert (
    experiment_entry.read_flags().algorithms[0].training.client_lr_horizon == 7
  )
  _parse(
    [
      '--algorithm=fedavg',
      '--client_lr_schedule=linear',
      '--rounds=7',
      '--client_lr_horizon=20',
    ]
  )
  assert (
    experiment_entry.read_flags().algorithms[0].training.client_lr_horizon == 20
  )
  for args in (
    ['--client_lr_warmup=0.2'],
    ['--client_lr_schedule=linear', '--client_lr_cut_every=5'],
  ):
    _parse(['--algorithm=fedavg', *args])
    with pytest.raises(ConfigError) as e:
      experiment_entry.read_flags()
    assert e.value.name == args[-1][2:].split('=')[0] and 'does nothing' in str(
      e.value
    )
