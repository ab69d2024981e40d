"""Algorithm registry: build any algorithm by name from one set of
hyperparameters (what the scripts' flags fill in).

One algorithm per module; each module's builder takes explicit arguments and
is usable on its own (``fedavg.fedavg(model, num_clients, ...)``).
"""

import dataclasses
from typing import Callable, Dict, Optional

import optax

from fedjax_personal.algorithm import FederatedAlgorithm
from fedjax_personal.batching import Batching
from fedjax_personal.data import FederatedData
from fedjax_personal.models import Model
from fedjax_personal.training import sgd_finetune


@dataclasses.dataclass(frozen=True)
class HParams:
  """Hyperparameters shared by the registry's builders.

  Attributes:
    client_lr, client_momentum: local SGD.
    server_optimizer: 'sgd' (server_lr 1 and momentum 0 give FedAvg; momentum
      gives FedAvgM) or 'adam' (FedAdam).
    server_lr, server_momentum: server optimizer settings.
    batch_size: local batch size (None: full local batch).
    local_epochs / local_steps: exactly one is set.
    weighting: 'num_examples' or 'uniform' aggregation weights.
    prox_mu: FedProx proximal coefficient.
    finetune_steps: evaluation fine-tuning steps (0: none; fedavg_ft uses 5
      when 0 is given).
    finetune_lr: fine-tuning lr (None: client_lr).
  """
  client_lr: float = 0.05
  client_momentum: float = 0.0
  server_optimizer: str = 'sgd'
  server_lr: float = 1.0
  server_momentum: float = 0.0
  batch_size: Optional[int] = 32
  local_epochs: Optional[int] = 1
  local_steps: Optional[int] = None
  weighting: str = 'num_examples'
  prox_mu: float = 0.01
  finetune_steps: int = 0
  finetune_lr: Optional[float] = None

  def batching(self) -> Batching:
    return Batching(batch_size=self.batch_size, num_epochs=self.local_epochs,
                    num_steps=self.local_steps)

  def client_optimizer(self) -> optax.GradientTransformation:
    if self.client_lr <= 0:
      raise ValueError(f'client_lr must be > 0, got {self.client_lr}')
    return optax.sgd(self.client_lr, momentum=self.client_momentum or None)

  def server_opt(self) -> optax.GradientTransformation:
    if self.server_optimizer == 'sgd':
      return optax.sgd(self.server_lr, momentum=self.server_momentum or None)
    if self.server_optimizer == 'adam':
      return optax.adam(self.server_lr)
    raise ValueError(f"server_optimizer must be 'sgd' or 'adam', got {self.server_optimizer!r}")

  def finetuner(self, model: Model, default_steps: int = 0):
    steps = self.finetune_steps or default_steps
    if steps <= 0:
      return None
    return sgd_finetune(model, self.finetune_lr or self.client_lr,
                        Batching(batch_size=self.batch_size, num_epochs=None, num_steps=steps))


def _fedavg(hp, model, data):
  from fedjax_personal.algorithms.fedavg import fedavg
  return fedavg(model, data.num_clients, hp.client_optimizer(), hp.batching(),
                server_optimizer=hp.server_opt(), weighting=hp.weighting)


def _fedavg_ft(hp, model, data):
  from fedjax_personal.algorithms.fedavg import fedavg
  return fedavg(model, data.num_clients, hp.client_optimizer(), hp.batching(),
                server_optimizer=hp.server_opt(), weighting=hp.weighting,
                finetune=hp.finetuner(model, default_steps=5), name='fedavg_ft')


def _fedsgd(hp, model, data):
  from fedjax_personal.algorithms.fedsgd import fedsgd
  return fedsgd(model, data.num_clients, hp.client_lr, batch_size=None,
                server_optimizer=hp.server_opt(), weighting=hp.weighting)


def _fedprox(hp, model, data):
  from fedjax_personal.algorithms.fedprox import fedprox
  return fedprox(model, data.num_clients, hp.client_optimizer(), hp.batching(), hp.prox_mu,
                 server_optimizer=hp.server_opt(), weighting=hp.weighting)


def _local(hp, model, data):
  from fedjax_personal.algorithms.local import local
  return local(model, data.num_clients, hp.client_optimizer(), hp.batching())


def _oracle(hp, model, data):
  from fedjax_personal.algorithms.oracle import oracle
  return oracle(model, data.groups, hp.client_optimizer(), hp.batching(),
                server_optimizer=hp.server_opt(), weighting=hp.weighting)


ALGORITHMS: Dict[str, Callable[[HParams, Model, FederatedData], FederatedAlgorithm]] = {
    'fedavg': _fedavg,
    'fedavg_ft': _fedavg_ft,
    'fedsgd': _fedsgd,
    'fedprox': _fedprox,
    'local': _local,
    'oracle': _oracle,
}


def build(name: str, hp: HParams, model: Model, data: FederatedData) -> FederatedAlgorithm:
  """Builds a registered algorithm; ``hp.finetune_steps > 0`` adds evaluation
  fine-tuning to any algorithm that has none."""
  if name not in ALGORITHMS:
    raise ValueError(f'unknown algorithm {name!r}; choose one of {sorted(ALGORITHMS)}')
  alg = ALGORITHMS[name](hp, model, data)
  if alg.finetune is None and hp.finetune_steps > 0:
    alg = alg.replace(finetune=hp.finetuner(model))
  return alg
