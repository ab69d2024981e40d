"""The algorithm registry: a name -> ``AlgorithmSpec`` (config class,
builder, the shared settings it uses), ``register`` for an algorithm of the
user's, and the one way an algorithm is built from its settings: ``make``
(a spec and validated settings: what every algorithm shares filled in), which
``build`` calls after validating (an algorithm by name, settings as
overrides).

One algorithm per module; each module declares its hyperparameters (a frozen
config dataclass with a flag prefix) next to its builder and its ``SPEC``;
adding one to the package is its module plus its line in ``SPECS`` here.
"""

import dataclasses
from typing import Dict, Optional

from fedjax_personal.algorithms import (
  agnostic_fedavg,
  apfl,
  apple,
  cfl,
  ditto,
  fd,
  fedala,
  fedamp,
  fedas,
  fedavg,
  fedbabu,
  fedcac,
  fedcp,
  fedcross,
  feddbe,
  feddyn,
  fedfomo,
  fedgc,
  fedgen,
  fedgh,
  fedkd,
  fedlc,
  fedmtl,
  fednova,
  fedntd,
  fedpac,
  fedpcl,
  fedphp,
  fedproto,
  fedprox,
  fedrod,
  fedsgd,
  fml,
  gpfl,
  hyp_cluster,
  local,
  mime,
  mime_lite,
  moon,
  oracle,
  partial,
  perfedavg,
  pfeddyn,
  pfedme,
  pflda,
  qffl,
  scaffold,
  usercentric,
)
from fedjax_personal.config import AlgorithmSpec, TrainingConfig
from fedjax_personal.core.algorithm import FederatedAlgorithm
from fedjax_personal.core.client_state import persistent_client_optimizer
from fedjax_personal.core.data import FederatedData
from fedjax_personal.core.training import sgd_finetune
from fedjax_personal.errors import ConfigError, caller_file
from fedjax_personal.hparams import check_name, claim_flags
from fedjax_personal.models import Model

__all__ = [
  'build',
  'check_model_state',
  'config_classes',
  'make',
  'OWNERS',
  'register',
  'REGISTRY',
  'spec',
]


#: The package's algorithms, in the order ``--algorithm``'s help lists them.
REGISTRY: Dict[str, AlgorithmSpec] = {
  spec.name: spec
  for spec in [
    fedavg.SPEC,
    fedavg.FT_SPEC,
    fedsgd.SPEC,
    fedprox.SPEC,
    local.SPEC,
    oracle.SPEC,
    scaffold.SPEC,
    feddyn.SPEC,
    pfeddyn.FT_SPEC,
    pfeddyn.MAML_SPEC,
    pfeddyn.PROTO_SPEC,
    perfedavg.FO_SPEC,
    perfedavg.HF_SPEC,
    perfedavg.HF_FD_SPEC,
    partial.FEDALT_SPEC,
    partial.FEDSIM_SPEC,
    partial.FEDREP_SPEC,
    partial.FEDPER_SPEC,
    partial.LG_FEDAVG_SPEC,
    partial.FEDBN_SPEC,
    pfedme.SPEC,
    ditto.SPEC,
    apfl.SPEC,
    usercentric.SPEC,
    fedfomo.SPEC,
    cfl.SPEC,
    fednova.SPEC,
    qffl.SPEC,
    fedlc.SPEC,
    fedntd.SPEC,
    fedbabu.SPEC,
    fedrod.SPEC,
    feddbe.SPEC,
    fedgh.SPEC,
    pflda.SPEC,
    fedgc.SPEC,
    fedcac.SPEC,
    fedas.SPEC,
    fedpac.SPEC,
    fedcp.SPEC,
    gpfl.SPEC,
    moon.SPEC,
    fedpcl.SPEC,
    fedproto.SPEC,
    fd.SPEC,
    fml.SPEC,
    apple.SPEC,
    fedala.SPEC,
    fedamp.SPEC,
    fedmtl.SPEC,
    fedphp.SPEC,
    fedcross.SPEC,
    fedkd.SPEC,
    mime.SPEC,
    mime_lite.SPEC,
    hyp_cluster.SPEC,
    agnostic_fedavg.SPEC,
    fedgen.SPEC,
  ]
}


#: Who registered each algorithm added by ``register`` (its file).
OWNERS: Dict[str, str] = {}

claim_flags(TrainingConfig, 'a shared training setting')
for _name, _spec in REGISTRY.items():
  claim_flags(_spec.config, f'a setting of --algorithm={_name}')


def register(new: AlgorithmSpec) -> None:
  """Adds an algorithm defined outside this package to the registry (the
  CLI's ``experiment_entry.register`` also defines its flags). Registering the same
  name again replaces it when it comes from the same module (a re-run
  notebook cell); another algorithm's name is refused.

  Args:
    new: the algorithm's ``AlgorithmSpec`` (its ``name`` is the registry key).

  Returns:
    None.
  """
  owner = caller_file()
  check_name('algorithm', new.name)
  old = REGISTRY.get(new.name)
  if old is not None and old is not new and OWNERS.get(new.name) != owner:
    raise ValueError(
      f'an algorithm named {new.name!r} is registered already, by '
      f'{OWNERS.get(new.name, "this package")} ({old.summary or new.name})'
    )
  claim_flags(new.config, f'a setting of --algorithm={new.name}')
  REGISTRY[new.name] = new
  OWNERS[new.name] = owner


def spec(name: str) -> AlgorithmSpec:
  """The ``AlgorithmSpec`` registered as ``name``.

  Args:
    name: the registry name (``--algorithm``).

  Returns:
    Its ``AlgorithmSpec``.

  Raises:
    ConfigError: no algorithm has that name.
  """
  if name not in REGISTRY:
    raise ConfigError(
      'algorithm', f'unknown algorithm {name!r}; choose from {sorted(REGISTRY)}'
    )
  return REGISTRY[name]


def config_classes():
  """The distinct per-algorithm config classes with a flag prefix, in
  registry order.

  Returns:
    The config classes, each once.
  """
  out = []
  for s in REGISTRY.values():
    if getattr(s.config, 'prefix', None) and s.config not in out:
      out.append(s.config)
  return out


def build(
  name: str,
  model: Model,
  data: FederatedData,
  training: Optional[TrainingConfig] = None,
  config=None,
  **overrides,
) -> FederatedAlgorithm:
  """Builds a registered algorithm.

  Args:
    name: registry name.
    model, data: the model and the (device) data.
    training: shared settings (default ``TrainingConfig()``).
    config: the algorithm's config (default: its config class's defaults).
    overrides: shorthand for fields of ``training`` or ``config``, by field
      or flag name (``build('fedprox', model, data, client_lr=0.1, mu=0.1)``
      or ``fedprox_mu=0.1``).

  Returns:
    The algorithm, ready for a ``RoundRunner``.

  Raises:
    ConfigError: an invalid setting, or one the algorithm would ignore.
  """
  s = spec(name)
  training = training or TrainingConfig()
  config = config if config is not None else s.config()
  t_names = {f.name for f in dataclasses.fields(TrainingConfig)}
  prefix = getattr(s.config, 'prefix', None)
  c_names = {f.name: f.name for f in dataclasses.fields(s.config)}
  c_names.update({f'{prefix}_{f}': f for f in list(c_names)} if prefix else {})
  for k in overrides:
    if k not in t_names and k not in c_names:
      raise ConfigError(
        k,
        f'not a setting of {name} (shared: {sorted(t_names)}; own: '
        f'{sorted(c_names)})',
      )
  training = dataclasses.replace(
    training, **{k: v for k, v in overrides.items() if k in t_names}
  )
  config = dataclasses.replace(
    config, **{c_names[k]: v for k, v in overrides.items() if k in c_names}
  )
  s.validate(training, config)
  return make(s, training, config, model, data)


def check_model_state(spec: AlgorithmSpec, model: Model) -> None:
  """Refuses a model with batch statistics (``Model.collections``) for an
  algorithm that does not carry them (``AlgorithmSpec.model_state``).

  Args:
    spec: the registry entry.
    model: the model.

  Returns:
    None.

  Raises:
    ConfigError naming --model.
  """
  if getattr(model, 'collections', ()) and not spec.model_state:
    able = sorted(n for n, s in REGISTRY.items() if s.model_state)
    raise ConfigError(
      'model',
      f'{model.name} keeps {", ".join(model.collections)} (batch '
      f'statistics), which {spec.name} does not carry; algorithms that do: '
      f'{", ".join(able)}',
    )


def make(spec: AlgorithmSpec, training: TrainingConfig, config, model, data):
  """Builds the algorithm from settings already validated for ``spec``: its
  defaults filled in, evaluation fine-tuning added when asked for and the
  algorithm has none of its own, persistent client optimizer state when
  asked for.

  Args:
    spec: the registry entry.
    training: the shared settings.
    config: its own settings.
    model: the model.
    data: the federated data.

  Returns:
    The algorithm.
  """
  check_model_state(spec, model)
  training = spec.resolve(training)
  alg = spec.build(training, config, model, data).replace(
    partial_work=spec.partial_work
  )
  if (
    alg.finetune is None
    and training.finetune_steps
    and 'finetune_steps' in spec.uses
  ):
    lr = (
      training.client_lr
      if training.finetune_lr is None
      else training.finetune_lr
    )
    alg = alg.replace(
      finetune=sgd_finetune(model, lr, training.finetune_batching())
    )
  if training.client_opt_state == 'persistent':
    alg = persistent_client_optimizer(alg, data.num_clients)
  return alg
