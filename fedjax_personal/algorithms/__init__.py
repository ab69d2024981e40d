"""Algorithm registry: build any algorithm by name from one set of
hyperparameters (what the scripts' flags fill in).

One algorithm per module; each module's builder takes explicit arguments and
is usable on its own (``fedavg.fedavg(model, num_clients, ...)``).
"""

import dataclasses
from typing import Callable, Dict, Optional

import numpy as np
import optax

from fedjax_personal.algorithm import FederatedAlgorithm
from fedjax_personal.batching import Batching
from fedjax_personal.data import FederatedData
from fedjax_personal.models import Model
from fedjax_personal.training import sgd_finetune
from fedjax_personal.tree_util import is_concrete


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
    feddyn_alpha: FedDyn alpha (personalized prototypes: None -> 0.1).
    adaptive_alpha: FedDyn alpha_i = alpha * mean(n) / n_i.
    max_grad_norm: FedDyn data-term gradient clipping (0: none).
    lr_decay: client learning rate multiplied by this every round (FedDyn).
    weight_decay: client weight decay (FedDyn family).
    feddyn_eval: which FedDyn model is evaluated ('server', 'active_mean',
      'all_clients_mean').
    maml_inner_steps, maml_inner_lr: MAML inner loop of pfeddyn_maml.
    personal_part: which parameters are personal for fedalt / fedsim ('input',
      'output', 'adapter', 'all_but_output', 'all' or 'split:<regex>,...').
    personal_lr: learning rate of personal parameters (None: client_lr).
    personal_epochs: FedAlt's personal phase in epochs (None: as the shared
      phase; FedRep: 5x when None).
    personal_finetune_epochs: evaluation fine-tuning of the personal part.
    perfedavg_alpha, hf_delta: Per-FedAvg's inner step and finite-difference
      delta (beta is client_lr).
    pfedme_lambda, pfedme_personal_lr, pfedme_inner_steps, pfedme_beta: pFedMe.
    ditto_lambda: Ditto's proximal coefficient.
    apfl_alpha: APFL's mixing weight.
    num_streams: user-centric m_t (0: silhouette choice; >= N: one stream
      per client).
    sigma_batches, sigma_batch_size: user-centric variance estimate (K
      batches of this size; 0: K equal parts of the local data).
    uc_warmup_rounds, uc_recompute_every: when W is computed.
    fomo_candidates, fomo_eps, fomo_eps_decay, fomo_leave_one_out: FedFomo.
    dp_clip_norm, dp_noise_multiplier: DP-SGD local training (FedFomo; 0: off).
    cfl_eps1, cfl_eps2, cfl_warmup_rounds: clustered FL's split test;
      cfl_ratio > 0: the scale-free test mean < ratio * max instead of eps1.
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
  feddyn_alpha: Optional[float] = None
  adaptive_alpha: bool = False
  max_grad_norm: float = 0.0
  lr_decay: float = 1.0
  weight_decay: float = 0.0
  feddyn_eval: str = 'server'
  maml_inner_steps: int = 5
  maml_inner_lr: float = 1e-2
  personal_part: str = 'output'
  personal_lr: Optional[float] = None
  personal_epochs: Optional[int] = None
  personal_finetune_epochs: int = 0
  perfedavg_alpha: float = 0.01
  hf_delta: float = 1e-3
  pfedme_lambda: float = 15.0
  pfedme_personal_lr: float = 0.01
  pfedme_inner_steps: int = 5
  pfedme_beta: float = 1.0
  ditto_lambda: float = 0.1
  apfl_alpha: float = 0.25
  num_streams: int = 0
  sigma_batches: int = 2
  sigma_batch_size: int = 0
  uc_warmup_rounds: int = 0
  uc_recompute_every: int = 0
  fomo_candidates: int = 5
  fomo_eps: float = 0.3
  fomo_eps_decay: float = 0.05
  fomo_leave_one_out: bool = False
  dp_clip_norm: float = 0.0
  dp_noise_multiplier: float = 0.0
  cfl_eps1: float = 0.4
  cfl_eps2: float = 1.6
  cfl_warmup_rounds: int = 5
  cfl_ratio: float = 0.0

  def feddyn_options(self) -> dict:
    return dict(adaptive_alpha=self.adaptive_alpha, max_grad_norm=self.max_grad_norm or None,
                lr_decay=self.lr_decay, weight_decay=self.weight_decay,
                eval_model=self.feddyn_eval)

  def batching(self) -> Batching:
    return Batching(batch_size=self.batch_size, num_epochs=self.local_epochs,
                    num_steps=self.local_steps)

  def client_optimizer(self) -> optax.GradientTransformation:
    if is_concrete(self.client_lr) and self.client_lr <= 0:
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


def _scaffold(hp, model, data):
  from fedjax_personal.algorithms.scaffold import scaffold
  return scaffold(model, data.num_clients, hp.client_lr, hp.batching(),
                  server_optimizer=hp.server_opt(), weighting='uniform')


def _feddyn(hp, model, data):
  from fedjax_personal.algorithms.feddyn import feddyn
  return feddyn(model, data.num_clients, data.train.num_examples, hp.client_lr, hp.batching(),
                alpha=hp.feddyn_alpha or 1e-2, **hp.feddyn_options())


def _pfeddyn(head):
  def build(hp, model, data):
    from fedjax_personal.algorithms.pfeddyn import pfeddyn
    return pfeddyn(model, data.num_clients, data.train.num_examples, data.num_classes,
                   hp.client_lr, hp.batching(), head=head, alpha=hp.feddyn_alpha,
                   inner_steps=hp.maml_inner_steps, inner_lr=hp.maml_inner_lr,
                   finetune_lr=hp.finetune_lr or 0.1, finetune_steps=hp.finetune_steps or 1,
                   **hp.feddyn_options())
  return build


def _perfedavg(variant):
  def build(hp, model, data):
    from fedjax_personal.algorithms.perfedavg import perfedavg
    b = hp.batching()
    if b.num_steps is None:
      raise ValueError('perfedavg takes --local_steps (each step draws 3 batches), not epochs')
    return perfedavg(model, data.num_clients, b, alpha=hp.perfedavg_alpha, beta=hp.client_lr,
                     variant=variant, delta=hp.hf_delta, server_optimizer=hp.server_opt(),
                     weighting=hp.weighting)
  return build


def _partial(mode, personal_part=None, head_ratio=1, name=None):
  def build(hp, model, data):
    import jax
    from fedjax_personal.algorithms.partial import partial_personalization, personal_finetune
    from fedjax_personal.personalization import make_split
    split = make_split(personal_part or hp.personal_part,
                       jax.eval_shape(model.init, jax.random.key(0)))
    b = hp.batching()
    personal_b = None
    if mode == 'alt':
      if b.num_epochs is not None:
        personal_b = Batching(b.batch_size, num_epochs=hp.personal_epochs or head_ratio * b.num_epochs)
      else:
        personal_b = Batching(b.batch_size, num_epochs=None,
                              num_steps=hp.personal_epochs or head_ratio * b.num_steps)
    ft = None
    if hp.personal_finetune_epochs:
      ft = personal_finetune(model, split, hp.personal_lr or hp.client_lr,
                             Batching(hp.batch_size, num_epochs=hp.personal_finetune_epochs))
    return partial_personalization(model, data.num_clients, split, mode, hp.client_lr, b,
                                   personal_batching=personal_b, personal_lr=hp.personal_lr,
                                   server_optimizer=hp.server_opt(), weighting=hp.weighting,
                                   finetune=ft, name=name)
  return build


def _pfedme(hp, model, data):
  from fedjax_personal.algorithms.pfedme import pfedme
  return pfedme(model, data.num_clients, hp.batching(), hp.client_lr, lam=hp.pfedme_lambda,
                personal_lr=hp.pfedme_personal_lr, inner_steps=hp.pfedme_inner_steps,
                beta=hp.pfedme_beta, weighting=hp.weighting)


def _ditto(hp, model, data):
  from fedjax_personal.algorithms.ditto import ditto
  return ditto(model, data.num_clients, hp.batching(), hp.client_lr, lam=hp.ditto_lambda,
               personal_lr=hp.personal_lr, server_optimizer=hp.server_opt(), weighting=hp.weighting)


def _apfl(hp, model, data):
  from fedjax_personal.algorithms.apfl import apfl
  return apfl(model, data.num_clients, hp.batching(), hp.client_lr, alpha=hp.apfl_alpha,
              server_optimizer=hp.server_opt(), weighting=hp.weighting)


def _usercentric(hp, model, data):
  from fedjax_personal.algorithms.usercentric import usercentric
  return usercentric(model, data.num_clients, data.train.num_examples, hp.client_optimizer(),
                     hp.batching(), num_streams=hp.num_streams or None,
                     sigma_batches=hp.sigma_batches, sigma_batch_size=hp.sigma_batch_size or None,
                     warmup_rounds=hp.uc_warmup_rounds, recompute_every=hp.uc_recompute_every,
                     groups=data.groups)


def _fedfomo(hp, model, data):
  from fedjax_personal.algorithms.fedfomo import fedfomo
  if int(np.asarray(data.val.num_examples).min()) == 0:
    raise ValueError('fedfomo needs a validation split on every client: set --val_fraction '
                     '(0.2 in the paper)')
  dp = (hp.dp_clip_norm, hp.dp_noise_multiplier) if hp.dp_clip_norm > 0 else None
  return fedfomo(model, data.num_clients, hp.client_optimizer(), hp.batching(),
                 num_candidates=min(hp.fomo_candidates, data.num_clients - 1), eps0=hp.fomo_eps,
                 eps_decay=hp.fomo_eps_decay, leave_one_out=hp.fomo_leave_one_out, dp=dp)


def _cfl(hp, model, data):
  from fedjax_personal.algorithms.cfl import cfl
  return cfl(model, data.num_clients, data.train.num_examples, hp.client_optimizer(),
             hp.batching(), eps1=hp.cfl_eps1, eps2=hp.cfl_eps2, warmup_rounds=hp.cfl_warmup_rounds,
             ratio=hp.cfl_ratio)


ALGORITHMS: Dict[str, Callable[[HParams, Model, FederatedData], FederatedAlgorithm]] = {
    'fedavg': _fedavg,
    'fedavg_ft': _fedavg_ft,
    'fedsgd': _fedsgd,
    'fedprox': _fedprox,
    'local': _local,
    'oracle': _oracle,
    'scaffold': _scaffold,
    'feddyn': _feddyn,
    'pfeddyn_ft': _pfeddyn('finetune'),
    'pfeddyn_maml': _pfeddyn('maml'),
    'pfeddyn_proto': _pfeddyn('prototype'),
    'perfedavg_fo': _perfedavg('fo'),
    'perfedavg_hf': _perfedavg('hf'),
    'perfedavg_hf_fd': _perfedavg('hf_fd'),
    'fedalt': _partial('alt'),
    'fedsim': _partial('sim'),
    'fedrep': _partial('alt', 'output', head_ratio=5, name='fedrep'),
    'fedper': _partial('sim', 'output', name='fedper'),
    'lg_fedavg': _partial('sim', 'all_but_output', name='lg_fedavg'),
    'pfedme': _pfedme,
    'ditto': _ditto,
    'apfl': _apfl,
    'usercentric': _usercentric,
    'fedfomo': _fedfomo,
    'cfl': _cfl,
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
