"""fedjax_personal: fast simulation of personalized federated learning in JAX."""

from fedjax_personal import aggregation
from fedjax_personal import batching
from fedjax_personal import config
from fedjax_personal import data
from fedjax_personal import executors
from fedjax_personal import models
from fedjax_personal import sampling
from fedjax_personal import training
from fedjax_personal import tree_util
from fedjax_personal.algorithm import ClientModels
from fedjax_personal.algorithm import Communication
from fedjax_personal.algorithm import FederatedAlgorithm
from fedjax_personal.algorithm import LocalData
from fedjax_personal.algorithm import RoundContext
from fedjax_personal.batching import Batching
from fedjax_personal.config import ConfigError
from fedjax_personal.config import TrainingConfig
from fedjax_personal.data import ClientData
from fedjax_personal.data import FederatedData
from fedjax_personal.engine import RoundRunner
from fedjax_personal.engine import summarize
from fedjax_personal.executors import create_executor
from fedjax_personal.models import create_model
from fedjax_personal.sampling import Cohort
from fedjax_personal.sampling import CohortSampler

__version__ = '0.1.0'
