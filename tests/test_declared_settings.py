"""One way to declare a setting: every flag of the command is a field of a
settings class declared next to what it configures (``hparam``), its flag
generated from the declaration, its range checked from it."""

import dataclasses
import os
from typing import Optional, Tuple

import pytest
from absl import flags
from helpers import parse_flags

from fedjax_personal import algorithms
from fedjax_personal.config import TrainingConfig
from fedjax_personal.datasets import registry
from fedjax_personal.errors import ConfigError
from fedjax_personal.hparams import flag_fields, flag_name, hparam, validate
from fedjax_personal.run import experiment_entry, experiment_flags, script_entry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _declared_flags():
  classes = [c for c, _ in experiment_flags.RUN_SETTINGS] + [TrainingConfig]
  classes += algorithms.config_classes() + registry.option_classes()
  return {flag_name(c, f.name): (c, f) for c in classes for f in flag_fields(c)}


def test_every_flag_of_the_command_is_a_declared_field():
  declared = _declared_flags()
  own = {
    f.name
    for module, fl in flags.FLAGS.flags_by_module_dict().items()
    if module.startswith('fedjax_personal')
    for f in fl
  }
  assert own and own <= set(declared), sorted(own - set(declared))
  assert set(experiment_flags.MAIN_JOB_DEFAULTS) <= own  # each names a flag
  for name, (cls, f) in declared.items():
    text = flags.FLAGS[name].help
    # absl adds how to repeat it
    if isinstance(flags.FLAGS[name], flags.MultiFlag):
      text = text.rsplit(';\n', 1)[0]
    assert text.endswith(f.metadata['help']), name
    default = experiment_flags.MAIN_JOB_DEFAULTS.get(name, f.default)
    assert flags.FLAGS[name].default == (
      list(default) if isinstance(default, tuple) else default
    )


def test_one_way_to_declare_a_flag_everywhere():
  """Every script's flags come from settings classes through the one
  generator (``script_entry.define_settings_flags``): no ``DEFINE_*`` by
  hand in the package, the scripts or the benchmarks. FedJAX's
  ``training.structured_flags`` is the exception: defining absl flags for
  a FedJAX user's script is that API itself (none of this project's
  scripts uses it)."""
  fedjax_api = os.path.join('fedjax', 'training', 'structured_flags.py')
  for folder in (
    'fedjax_personal',
    'algorithms',
    'datasets',
    'scripts',
    'benchmarks',
  ):
    for d, _, files in os.walk(os.path.join(ROOT, folder)):
      for name in files:
        path = os.path.join(d, name)
        src = open(path).read() if name.endswith('.py') else ''
        # the generator
        if path.endswith(os.path.join('run', 'script_entry.py')):
          body = src.split('def define_settings_flags', 1)
          src = body[0] + body[1].split('\ndef ', 1)[1]
        if path.endswith(fedjax_api):
          continue
        assert 'DEFINE_' not in src, path


@dataclasses.dataclass(frozen=True)
class _Made:
  names: Tuple[str, ...] = hparam(('a', 'b'), 'A list.')
  share: float = hparam(0.5, 'A share.', minimum=0, maximum=1, open_min=True)
  count: Optional[int] = hparam(None, 'A count.', minimum=1)
  seed: int = hparam(0, 'A seed.', minimum=0, flag='made_seed')
  score: float = hparam(
    0.5,
    'A fraction.',
    minimum=0,
    maximum=1,
    open_min=True,
    refusal='is a fraction in (0, 1]',
  )


@pytest.mark.parametrize(
  'field,value,message',
  [
    ('share', 0.0, '--share: must be in (0, 1], got 0.0'),
    ('share', float('nan'), '--share: must be finite, got nan'),
    ('count', 0, '--count: must be >= 1, got 0'),
    ('seed', -1, '--made_seed: must be >= 0, got -1'),
    ('score', 2.0, '--score: is a fraction in (0, 1], got 2.0'),
  ],
)
def test_a_value_out_of_its_declared_range_is_refused_naming_its_flag(
  field, value, message
):
  validate(_Made())  # the defaults, a None and a list pass
  with pytest.raises(ConfigError) as e:
    validate(_Made(**{field: value}))
  assert str(e.value) == message


def test_flags_are_generated_by_type():
  fv = flags.FlagValues()
  script_entry.define_settings_flags(
    _Made, 'made', {'count': 3}, flag_values=fv
  )
  fv(['prog', '--names=x,y,z', '--made_seed=4'])
  assert fv.names == ['x', 'y', 'z'] and fv.made_seed == 4 and fv.count == 3
  assert fv.share == 0.5 and fv['share'].help == 'A share.'


def test_the_data_flags_make_the_data_config():
  """The data set's settings reach ``DataConfig`` whole, with the main job's
  resolutions: --data_seed (else --seed), the partition, the validation
  share."""
  parse_flags(
    '--dataset=synthetic',
    '--synthetic_beta=2',
    '--seed=3',
    '--algorithm=fedavg',
  )
  cfg = experiment_entry.read_flags().data
  assert (
    cfg.options.synthetic_alpha,
    cfg.options.synthetic_beta,
    cfg.seed,
  ) == (1.0, 2.0, 3)
  # it changes no label: no flag (declared so)
  assert 'synthetic_alpha' not in flags.FLAGS
  assert (cfg.partition, cfg.num_clients, cfg.val_fraction) == (
    'natural',
    40,
    0.0,
  )
  parse_flags(
    '--dataset=shakespeare',
    '--seq_len=40',
    '--data_seed=1',
    '--algorithm=fedfomo',
  )
  cfg = experiment_entry.read_flags().data
  assert (cfg.options.seq_len, cfg.seed, cfg.num_clients, cfg.val_fraction) == (
    40,
    1,
    None,
    0.1,
  )


@pytest.mark.slow
def test_an_option_of_a_data_set_of_ones_own_reaches_its_reader_and_keys_its_store():
  """A data set's own option (docs/add_a_data_set.md): the options class
  its module registers reaches its reader, keys its store (a store made
  with another value is not reused), gets a flag, and that flag given with
  another data set is refused, naming it; nothing in run/ changes."""
  import subprocess
  import sys

  code = r"""
import dataclasses, sys
import numpy as np
from fedjax_personal.datasets import DataConfig, DataOptions, load_store, registry
from fedjax_personal.datasets.natural_data import NaturalData, listed
from fedjax_personal.hparams import hparam

@dataclasses.dataclass(frozen=True)
class ScaledOptions(DataOptions):
  scale: float = hparam(1.0, 'What my clients are scaled by.', minimum=0, flag='scaled_scale')

seen = []
def read_clients(num_clients=None, data_dir=None, download=False, scale=1.0):
  seen.append(scale)
  x, y = np.full((4, 3), scale, np.float32), np.zeros(4, np.int32)
  return NaturalData(listed(['a', 'b'], [(x, y)] * 2, [(x[:1], y[:1])] * 2), 2, 2, 2)

registry.register('scaled_clients', read_clients, options=ScaledOptions)
cfg = lambda s: DataConfig(dataset='scaled_clients', partition='natural', num_clients=None,
                           options=ScaledOptions(scale=s))
stores = [load_store(cfg(s)) for s in (2.0, 3.0, 2.0)]
assert seen == [2.0, 3.0, 2.0], seen
assert [s.client('a')['train'][0].max() for s in stores] == [2.0, 3.0, 2.0]
assert stores[0].folder == stores[2].folder != stores[1].folder
from fedjax_personal.run import experiment_entry
sys.argv = ['run_experiment.py', '--dataset=scaled_clients', '--scaled_scale=4', '--model=logreg',
            '--algorithm=fedavg', '--rounds=1', '--noprogress', '--dry_run']
experiment_entry.run()
"""
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  r = subprocess.run(
    [sys.executable, '-c', code],
    capture_output=True,
    text=True,
    env=env,
    timeout=300,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert 'dry run: 1 algorithm(s) built' in r.stdout
  other = code.replace(
    "'--dataset=scaled_clients', '--scaled_scale=4'",
    "'--dataset=digits', '--scaled_scale=4'",
  )
  r = subprocess.run(
    [sys.executable, '-c', other],
    capture_output=True,
    text=True,
    env=env,
    timeout=300,
  )
  assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr[-3000:]
  assert r.stderr.strip().splitlines()[-1] == (
    'error: --scaled_scale: an option of --dataset=scaled_clients, not of '
    '--dataset=digits'
  )


def test_the_run_holds_no_branch_on_a_data_set_name():
  """A data set owns its options and their checks (``datasets/``): no
  module of ``run/`` names a data set (a string constant equal to one)."""
  import ast

  from fedjax_personal.datasets import registry

  names = set(registry.names()) | set(registry.LOADERS)
  found = []
  folder = os.path.join(ROOT, 'fedjax_personal', 'run')
  for name in sorted(os.listdir(folder)):
    if name.endswith('.py'):
      tree = ast.parse(open(os.path.join(folder, name)).read())
      found += [
        f'{name}:{n.lineno} {n.value!r}'
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant)
        and isinstance(n.value, str)
        and n.value in names
      ]
  assert not found, found
