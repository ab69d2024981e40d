"""One way to declare a setting: every flag of the command is a field of a
settings class declared next to what it configures (``hparam``), its flag
generated from the declaration, its range checked from it."""

import dataclasses
import os
from typing import Optional, Tuple

from absl import flags
import pytest

from fedjax_personal import algorithms
from fedjax_personal.config import TrainingConfig
from fedjax_personal.errors import ConfigError
from fedjax_personal.hparams import flag_fields, flag_name, hparam, validate
from fedjax_personal.run import cli, command_flags
from helpers import parse_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _declared_flags():
  classes = [c for c, _ in command_flags.RUN_SETTINGS] + [TrainingConfig]
  classes += algorithms.config_classes()
  return {flag_name(c, f.name): (c, f) for c in classes for f in flag_fields(c)}


def test_every_flag_of_the_command_is_a_declared_field():
  declared = _declared_flags()
  own = {f.name for module, fl in flags.FLAGS.flags_by_module_dict().items()
         if module.startswith('fedjax_personal') for f in fl}
  assert own and own <= set(declared), sorted(own - set(declared))
  assert set(command_flags.MAIN_JOB_DEFAULTS) <= own  # each names a flag
  for name, (cls, f) in declared.items():
    assert flags.FLAGS[name].help.endswith(f.metadata['help']), name
    default = command_flags.MAIN_JOB_DEFAULTS.get(name, f.default)
    assert flags.FLAGS[name].default == (list(default) if isinstance(default, tuple) else default)
  # The module declares no flag by hand: only the generator calls DEFINE_*.
  src = open(os.path.join(ROOT, 'fedjax_personal', 'run', 'command_flags.py')).read()
  body = src.split('def define_config_flags', 1)
  assert 'DEFINE_' not in body[0] and 'DEFINE_' not in body[1].split('\ndef ', 1)[1]


@dataclasses.dataclass(frozen=True)
class _Made:
  names: Tuple[str, ...] = hparam(('a', 'b'), 'A list.')
  share: float = hparam(0.5, 'A share.', minimum=0, maximum=1, open_min=True)
  count: Optional[int] = hparam(None, 'A count.', minimum=1)
  seed: int = hparam(0, 'A seed.', minimum=0, flag='made_seed')
  score: float = hparam(0.5, 'A fraction.', minimum=0, maximum=1, open_min=True,
                        refusal='is a fraction in (0, 1]')


@pytest.mark.parametrize('field,value,message', [
    ('share', 0.0, '--share: must be in (0, 1], got 0.0'),
    ('share', float('nan'), '--share: must be finite, got nan'),
    ('count', 0, '--count: must be >= 1, got 0'),
    ('seed', -1, '--made_seed: must be >= 0, got -1'),
    ('score', 2.0, '--score: is a fraction in (0, 1], got 2.0'),
])
def test_a_value_out_of_its_declared_range_is_refused_naming_its_flag(field, value, message):
  validate(_Made())  # the defaults, a None and a list pass
  with pytest.raises(ConfigError) as e:
    validate(_Made(**{field: value}))
  assert str(e.value) == message


def test_flags_are_generated_by_type():
  fv = flags.FlagValues()
  command_flags.define_config_flags(_Made, 'made', {'count': 3}, flag_values=fv)
  fv(['prog', '--names=x,y,z', '--made_seed=4'])
  assert fv.names == ['x', 'y', 'z'] and fv.made_seed == 4 and fv.count == 3
  assert fv.share == 0.5 and fv['share'].help == 'A share.'


def test_the_data_flags_make_the_data_config():
  """The data set's settings reach ``DataConfig`` whole, with the main job's
  resolutions: --data_seed (else --seed), the partition, the validation share."""
  parse_flags('--dataset=synthetic', '--synthetic_beta=2', '--seed=3', '--algorithm=fedavg')
  cfg = cli.data_config(cli.read_flags())
  assert (cfg.synthetic_alpha, cfg.synthetic_beta, cfg.seed) == (1.0, 2.0, 3)
  assert 'synthetic_alpha' not in flags.FLAGS  # it changes no label: no flag (declared so)
  assert (cfg.partition, cfg.num_clients, cfg.val_fraction) == ('natural', 40, 0.0)
  parse_flags('--dataset=shakespeare', '--seq_len=40', '--data_seed=1', '--algorithm=fedfomo')
  cfg = cli.data_config(cli.read_flags())
  assert (cfg.seq_len, cfg.seed, cfg.num_clients, cfg.val_fraction) == (40, 1, None, 0.1)


def test_an_option_added_to_the_data_config_reaches_its_reader_and_keys_its_store(monkeypatch):
  """A data set's new option (BUILD.md, "Add a data set"): a DataConfig field
  its reader names reaches the reader, and a store made with another value
  is not reused."""
  import numpy as np
  from fedjax_personal.datasets import DataConfig, load_store, readers
  from fedjax_personal.datasets.natural_data import NaturalData, listed

  @dataclasses.dataclass(frozen=True)
  class ScaledConfig(DataConfig):
    scale: float = hparam(1.0, 'What my clients are scaled by.', minimum=0)

  seen = []

  def read_clients(num_clients=None, data_dir=None, download=False, scale=1.0):
    seen.append(scale)
    x, y = np.full((4, 3), scale, np.float32), np.zeros(4, np.int32)
    return NaturalData(listed(['a', 'b'], [(x, y)] * 2, [(x[:1], y[:1])] * 2), 2, 2, 2)

  monkeypatch.setattr(readers, 'LOADERS', dict(readers.LOADERS))
  readers.register('scaled_clients', read_clients)
  cfg = lambda scale: ScaledConfig(dataset='scaled_clients', partition='natural',
                                   num_clients=None, scale=scale)
  stores = [load_store(cfg(s)) for s in (2.0, 3.0, 2.0)]
  assert seen == [2.0, 3.0, 2.0]  # the option reached the reader (which streams lazily)
  assert [s.client('a')['train'][0].max() for s in stores] == [2.0, 3.0, 2.0]
  assert stores[0].folder == stores[2].folder != stores[1].folder  # the first store reused
