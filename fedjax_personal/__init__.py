"""fedjax_personal: fast simulation of personalized federated learning in JAX.

Layers: ``core`` (the engine: data, batching, executors, the compiled round,
aggregation), ``models``, ``algorithms`` (one file each, and the registry),
``datasets``, ``run`` (the loop, sweeps, checkpoints, outputs, the CLI);
``config`` declares settings and ``errors`` the error types.
"""

import os as _os

from fedjax_personal import checkout as _checkout

# What a user imports (the subpackages algorithms, datasets and run are imported by name).
__all__ = ['aggregation', 'batching', 'Batching', 'ClientData', 'ClientModels', 'Cohort',
           'CohortSampler', 'Communication', 'compilation', 'config', 'ConfigError',
           'create_executor', 'create_model', 'data', 'executors', 'FederatedAlgorithm',
           'FederatedData', 'LocalData', 'models', 'numerics', 'RoundContext', 'RoundRunner',
           'sampling', 'summarize', 'training', 'TrainingConfig',
           'tree_util']


_checkout.use_this_checkout(_os.path.dirname(__file__))  # its algorithms/ and datasets/, not another's

# Importing the package changes no JAX configuration and writes nothing: the
# engine runs its computations at its own matmul precision (numerics.py), and
# the persistent compilation cache is the caller's choice (compilation.enable).
from fedjax_personal import compilation  # noqa: E402
from fedjax_personal import numerics  # noqa: E402
from fedjax_personal import config  # noqa: E402
from fedjax_personal import models  # noqa: E402
from fedjax_personal.config import TrainingConfig
from fedjax_personal.core import aggregation
from fedjax_personal.core import batching
from fedjax_personal.core import data
from fedjax_personal.core import executors
from fedjax_personal.core import sampling
from fedjax_personal.core import training
from fedjax_personal.core import tree_util
from fedjax_personal.core.algorithm import ClientModels
from fedjax_personal.core.algorithm import Communication
from fedjax_personal.core.algorithm import FederatedAlgorithm
from fedjax_personal.core.algorithm import LocalData
from fedjax_personal.core.algorithm import RoundContext
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.data import ClientData
from fedjax_personal.core.data import FederatedData
from fedjax_personal.core.engine import RoundRunner
from fedjax_personal.core.engine import summarize
from fedjax_personal.core.executor_choice import create_executor
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.sampling import CohortSampler
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import create_model

__version__ = '0.1.0'
