"""The flags of ``scripts/run_experiment.py``, generated: one flag per field
of the settings classes, each declared once next to what it configures
(``hparam`` fields): the run's own (``run/run_settings.py``), the data set's
(``datasets.DataConfig``), the model's, the engine's, the process's, the
processes', the shared training settings and each algorithm's (``--<prefix>_*``).
Only the entry reads their values (``run/cli.py``, into ``settings.Settings``).
"""

import dataclasses

from absl import flags

from fedjax_personal import algorithms as algorithms_lib
from fedjax_personal.config import TrainingConfig
from fedjax_personal.core.engine import EngineSettings
from fedjax_personal.datasets import DataConfig
from fedjax_personal.hparams import field_types, flag_fields, flag_name, is_list
from fedjax_personal.models import ModelSettings
from fedjax_personal.run.distributed import DistributedSettings
from fedjax_personal.run.process_settings import ProcessSettings
from fedjax_personal.run.run_settings import ExperimentSettings, InputSettings, OutputSettings

__all__ = ['algorithm_group', 'define_config_flags', 'FLAGS', 'MAIN_JOB_DEFAULTS', 'register',
           'RUN_SETTINGS', 'SHARED_FLAGS_MODULE']

FLAGS = flags.FLAGS  # where the flags are declared; read by the entry alone (``settings.read``)

#: The run's settings classes and their ``--helpfull`` groups, in the order
#: the help lists them; every flag of the command but the training and
#: algorithm settings is a field of one of these.
RUN_SETTINGS = (
    (ExperimentSettings, 'fedjax_personal: the experiment'),
    (DataConfig, 'fedjax_personal: the data set (datasets.DataConfig)'),
    (InputSettings, 'fedjax_personal: what the run reads of its data'),
    (ModelSettings, 'fedjax_personal: the model (models.ModelSettings)'),
    (EngineSettings, 'fedjax_personal: the engine (core.engine.EngineSettings)'),
    (ProcessSettings, 'fedjax_personal: the process (numerics, compilation cache)'),
    (OutputSettings, 'fedjax_personal: outputs, checkpoints, resuming'),
    (DistributedSettings, 'fedjax_personal: several processes'),
)

#: The main job's defaults where they are not the library's: the command
#: shows personalization on 40 rotated clients (``DataConfig()`` is 20
#: Dirichlet clients); its data seed and validation share follow from
#: --seed and the algorithms when not given (``run/settings.py``).
MAIN_JOB_DEFAULTS = {'partition': 'rotation', 'num_clients': 40, 'data_seed': None,
                     'val_fraction': None}


# -- hyperparameter flags, derived from the config dataclasses -----------------

SHARED_FLAGS_MODULE = 'fedjax_personal: shared training settings (every algorithm)'


def define_config_flags(cls, module_name: str, defaults=None, flag_values=None):
  """One flag per field of ``cls`` (``flag_name``: ``<prefix>_<field>`` or
  its declared ``flag``), typed by the field's annotation (a tuple: a comma
  list; ``choices``: an enum), help and default from its ``hparam``.

  Args:
    cls: a settings dataclass.
    module_name: the ``--helpfull`` group.
    defaults: ``{flag: default}`` replacing the declared ones (the main
      job's, ``MAIN_JOB_DEFAULTS``).
    flag_values: the absl ``FlagValues`` to define them in (default: absl's
      global ``FLAGS``).

  Returns:
    None.
  """
  types = field_types(cls)
  for f in flag_fields(cls):
    name, meta, t = flag_name(cls, f.name), f.metadata, types[f.name]
    default = (defaults or {}).get(name, f.default)
    kw = dict(module_name=module_name, flag_values=FLAGS if flag_values is None else flag_values)
    if is_list(t):
      flags.DEFINE_list(name, list(default), meta['help'], **kw)
    elif t is bool:
      flags.DEFINE_bool(name, default, meta['help'], **kw)
    elif t is int:
      flags.DEFINE_integer(name, default, meta['help'], **kw)
    elif t is float:
      flags.DEFINE_float(name, default, meta['help'], **kw)
    elif meta.get('choices'):
      flags.DEFINE_enum(name, default, list(meta['choices']), meta['help'], **kw)
    else:
      flags.DEFINE_string(name, default, meta['help'], **kw)


def algorithm_group(cls) -> str:
  """The ``--helpfull`` group of a settings class: the algorithms using it.

  Args:
    cls: a settings class.

  Returns:
    The group's name.
  """
  users = [n for n, s in algorithms_lib.REGISTRY.items() if s.config is cls]
  return f'fedjax_personal: --{cls.prefix}_* settings of ' + ', '.join(users)


for _cls, _group in RUN_SETTINGS:
  define_config_flags(_cls, _group, MAIN_JOB_DEFAULTS)
define_config_flags(TrainingConfig, SHARED_FLAGS_MODULE)
for _cls in algorithms_lib.config_classes():
  define_config_flags(_cls, algorithm_group(_cls))


def register(spec) -> None:
  """Adds an algorithm defined outside the package (``AlgorithmSpec``) to
  the registry and defines its config's ``--<prefix>_*`` flags, before the
  flags are parsed (docs/add_an_algorithm.md): ``--algorithm=<its name>``
  then works as for a built-in one.

  Args:
    spec: the algorithm's ``AlgorithmSpec``.

  Returns:
    None.
  """
  algorithms_lib.register(spec)
  prefix = getattr(spec.config, 'prefix', None)
  if prefix and not any(f'{prefix}_{f.name}' in FLAGS for f in dataclasses.fields(spec.config)):
    define_config_flags(spec.config, algorithm_group(spec.config))
