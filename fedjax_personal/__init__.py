"""fedjax_personal: fast simulation of personalized federated learning in JAX.

Layers: ``core`` (the engine: data, batching, executors, the compiled round,
aggregation), ``models``, ``algorithms`` (one file each, and the registry),
``datasets``, ``run`` (the loop, sweeps, checkpoints, outputs, the CLI);
``config`` declares settings and ``errors`` the error types.
"""

import os as _os

from fedjax_personal import checkout as _checkout

# What a user imports (the subpackages algorithms, datasets and run are imported
# by name).
__all__ = [
  'aggregation',
  'batching',
  'Batching',
  'ClientData',
  'ClientModels',
  'Cohort',
  'CohortSampler',
  'Communication',
  'compilation',
  'config',
  'ConfigError',
  'create_executor',
  'create_model',
  'data',
  'executors',
  'FederatedAlgorithm',
  'FederatedData',
  'LocalData',
  'models',
  'numerics',
  'RoundContext',
  'RoundRunner',
  'sampling',
  'summarize',
  'training',
  'TrainingConfig',
  'tree_util',
]


# its algorithms/ and datasets/, not another's
_checkout.use_this_checkout(_os.path.dirname(__file__))

# Importing the package changes no JAX configuration and writes nothing: the
# engine runs its computations at its own matmul precision (numerics.py), and
# the persistent compilation cache is the caller's choice (compilation.enable).
from fedjax_personal import (
  compilation,  # noqa: E402
  config,  # noqa: E402
  models,  # noqa: E402
  numerics,  # noqa: E402
)
from fedjax_personal.config import TrainingConfig
from fedjax_personal.core import (
  aggregation,
  batching,
  data,
  executors,
  sampling,
  training,
  tree_util,
)
from fedjax_personal.core.algorithm import (
  ClientModels,
  Communication,
  FederatedAlgorithm,
  LocalData,
  RoundContext,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.data import ClientData, FederatedData
from fedjax_personal.core.engine import RoundRunner, summarize
from fedjax_personal.core.executor_choice import create_executor
from fedjax_personal.core.sampling import Cohort, CohortSampler
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import create_model

__version__ = '0.1.0'
