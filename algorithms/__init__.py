"""The algorithms, one module each (``fedavg``, ``ditto``, ...), and their
registry (``registry``: ``REGISTRY``, ``register``, ``build``), re-exported
here.

Each module declares its hyperparameters (a frozen config dataclass with a
flag prefix) next to its builder, and its builder is usable on its own
(``fedavg.fedavg(model, num_clients, optax.sgd(0.1), ...)``). Adding an
algorithm is its module plus one line in ``registry.py``.
"""

from fedjax_personal.algorithms import (
  apfl,
  cfl,
  ditto,
  fd,
  fedala,
  fedas,
  fedavg,
  fedbabu,
  fedcac,
  fedcp,
  feddbe,
  feddyn,
  fedfomo,
  fedgc,
  fedgh,
  fedlc,
  fednova,
  fedntd,
  fedpac,
  fedproto,
  fedprox,
  fedrod,
  fedsgd,
  fml,
  gpfl,
  local,
  moon,
  oracle,
  partial,
  perfedavg,
  pfeddyn,
  pfedme,
  pflda,
  qffl,
  registry,
  scaffold,
  usercentric,
)
from fedjax_personal.algorithms.registry import (
  OWNERS,
  REGISTRY,
  build,
  check_model_state,
  config_classes,
  make,
  register,
  spec,
)
from fedjax_personal.config import AlgorithmSpec, TrainingConfig
from fedjax_personal.core.algorithm import FederatedAlgorithm
from fedjax_personal.core.client_state import persistent_client_optimizer
from fedjax_personal.core.data import FederatedData
from fedjax_personal.core.training import sgd_finetune
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import Model

__all__ = [
  'AlgorithmSpec',
  'apfl',
  'build',
  'cfl',
  'check_model_state',
  'config_classes',
  'ConfigError',
  'ditto',
  'fd',
  'fedala',
  'fedas',
  'fedavg',
  'fedbabu',
  'fedcac',
  'fedcp',
  'feddbe',
  'feddyn',
  'FederatedAlgorithm',
  'FederatedData',
  'fedfomo',
  'fedgc',
  'fedgh',
  'fedlc',
  'fednova',
  'fedntd',
  'fedpac',
  'make',
  'fedproto',
  'fedprox',
  'fedrod',
  'fedsgd',
  'fml',
  'gpfl',
  'local',
  'Model',
  'moon',
  'oracle',
  'partial',
  'perfedavg',
  'OWNERS',
  'persistent_client_optimizer',
  'pfeddyn',
  'pfedme',
  'pflda',
  'qffl',
  'registry',
  'register',
  'REGISTRY',
  'scaffold',
  'sgd_finetune',
  'spec',
  'TrainingConfig',
  'usercentric',
]
