"""Hyperparameters, declared once.

Every setting is a field of a frozen dataclass with its default, help text
and valid range (``hparam``). ``TrainingConfig`` holds what any algorithm may
use (client optimizer, batching, weighting, server optimizer, evaluation
fine-tuning); each algorithm module declares its own config next to its
builder, with a flag ``prefix`` (fedjax's structured flags: ``--fedprox_mu``
is ``FedProxConfig.mu``). An ``AlgorithmSpec`` ties a registry name to its
config class, its builder and the shared settings it reads, so the CLI can
refuse a setting that would do nothing.

Assembling an algorithm from its settings (its defaults, evaluation
fine-tuning, persistent client optimizer state) is the registry's job
(``fedjax_personal.algorithms.build``); errors are ``errors.ConfigError``.
"""

import dataclasses
from typing import Any, Callable, ClassVar, FrozenSet, Optional, Protocol

import jax
import optax

from fedjax_personal.core import server_optimizers
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.tree_util import is_concrete
from fedjax_personal.errors import ConfigError
from fedjax_personal.hparams import (  # noqa: F401
  Declared,
  field_types,
  flag_name,
  hparam,
  require_filled,
  validate,
)

__all__ = [
  'AlgorithmSpec',
  'BATCHING',
  'BuildData',
  'CLIENT_LR_SCHEDULE',
  'CLIENT_OPTIMIZER',
  'cut_schedule',
  'Declared',
  'field_types',
  'FINETUNE',
  'flag_name',
  'linear_schedule',
  'NoConfig',
  'scale_by_round_decay',
  'SERVER_OPTIMIZER',
  'TrainingConfig',
  'validate',
  'WEIGHTING',
  'WEIGHTINGS',
]


def scale_by_round(factor: Callable) -> optax.GradientTransformationExtraArgs:
  """Multiplies updates by ``factor(round_num)``, the round number (from 0)
  being an extra argument of ``update`` (the engine passes
  ``round_num=ctx.round``): a per-round learning-rate schedule that composes
  with any optimizer (SGD's and Adam's steps scale with their rate)."""

  def update(updates, state, params=None, *, round_num=None, **extra):
    del params, extra
    if round_num is None:
      return updates, state
    scale = factor(jax.numpy.asarray(round_num, jax.numpy.float32))
    return jax.tree.map(lambda u: u * scale, updates), state

  return optax.GradientTransformationExtraArgs(
    lambda params: optax.EmptyState(), update
  )


def scale_by_round_decay(decay: float) -> optax.GradientTransformationExtraArgs:
  """Updates times ``decay ** round_num``: a per-round learning-rate decay.

  Args:
    decay: the per-round factor.

  Returns:
    An optax transformation reading the ``round_num`` extra argument.
  """
  return scale_by_round(lambda t: jax.numpy.power(decay, t))


def linear_schedule(rounds: int, warmup: float) -> Callable:
  """The partial-personalization seed's ``linear`` schedule of the client
  rate (Pillutla et al., arXiv 2204.03809; ``get_fed_global_lr_scheduler``
  of its ``pfl/utils.py``): t / w over the first w = warmup * rounds rounds
  (0 in round 0, as its code has it), then (rounds - t) / (rounds - w),
  reaching 0 at the end.

  Args:
    rounds: the run's rounds.
    warmup: the warm-up share of the rounds.

  Returns:
    ``t -> multiplier of the client rate in round t``.
  """
  w = warmup * rounds
  jnp = jax.numpy
  return lambda t: jnp.where(
    t < w,
    t / max(1.0, w),
    jnp.maximum(0.0, (rounds - t) / max(1.0, rounds - w)),
  )


def cut_schedule(every: int, factor: float) -> Callable:
  """The seed's ``const_and_cut``: ``factor ** (t // every)``.

  Args:
    every: rounds between cuts.
    factor: the multiplier at each cut.

  Returns:
    ``t -> factor ** (t // every)``.
  """
  return lambda t: jax.numpy.power(factor, jax.numpy.floor(t / every))


# Names of the shared settings, by what an algorithm does with them.
#: The per-round client-rate schedule (a uniform scale of a round's steps).
CLIENT_LR_SCHEDULE = frozenset(
  {
    'client_lr_decay',
    'client_lr_schedule',
    'client_lr_warmup',
    'client_lr_horizon',
    'client_lr_cut_every',
    'client_lr_cut_factor',
  }
)
CLIENT_OPTIMIZER = (
  frozenset(
    {
      'client_optimizer',
      'client_lr',
      'client_momentum',
      'client_weight_decay',
      'client_grad_clip',
      'client_opt_state',
    }
  )
  | CLIENT_LR_SCHEDULE
)
BATCHING = frozenset({'batch_size', 'local_epochs', 'local_steps', 'drop_last'})
WEIGHTING = frozenset({'weighting'})
#: How client uploads are weighted in a mean (``--weighting``): by the
#: client's training examples, by its training tokens (google-research/
#: federated's weighting of its next-word tasks) or uniformly.
WEIGHTINGS = ('num_examples', 'tokens', 'uniform')
SERVER_OPTIMIZER = frozenset(
  {
    'server_optimizer',
    'server_lr',
    'server_momentum',
    'server_beta1',
    'server_beta2',
    'server_tau',
  }
)
FINETUNE = frozenset({'finetune_steps', 'finetune_lr'})


@dataclasses.dataclass(frozen=True)
class TrainingConfig(Declared):
  """Settings every algorithm may use (flags without a prefix)."""

  client_optimizer: str = hparam(
    'sgd', "Client optimizer: 'sgd' or 'adam'.", choices=('sgd', 'adam')
  )
  client_lr: float = hparam(
    0.05, 'Client learning rate.', minimum=0, open_min=True, sweep=True
  )
  client_momentum: float = hparam(
    0.0,
    'Client SGD momentum (heavy ball).',
    minimum=0,
    maximum=1,
    open_max=True,
  )
  client_weight_decay: float = hparam(
    0.0,
    'Client L2 weight decay (added to the gradient).',
    minimum=0,
    sweep=True,
  )
  client_grad_clip: float = hparam(
    0.0,
    'Clip each client gradient to this global norm (0: no clipping).',
    minimum=0,
  )
  client_lr_decay: float = hparam(
    1.0,
    'Client learning rate times this every round.',
    minimum=0,
    maximum=1,
    open_min=True,
  )
  client_lr_schedule: str = hparam(
    'const',
    'Client learning rate per round, as the '
    "partial-personalization seed's --global_scheduler: 'const', "
    "'linear' (up from 0 over client_lr_warmup of the rounds, "
    "then down to 0 at client_lr_horizon) or 'cut' (times "
    'client_lr_cut_factor every client_lr_cut_every rounds).',
    choices=('const', 'linear', 'cut'),
  )
  client_lr_warmup: float = hparam(
    0.1,
    "Share of the rounds the 'linear' schedule warms up over.",
    minimum=0,
    maximum=1,
  )
  client_lr_horizon: Optional[int] = hparam(
    None, "Rounds the 'linear' schedule spans (the CLI: --rounds).", minimum=1
  )
  client_lr_cut_every: int = hparam(
    100, "Rounds between the 'cut' schedule's cuts.", minimum=1
  )
  client_lr_cut_factor: float = hparam(
    0.5,
    "What each cut of the 'cut' schedule multiplies the rate by.",
    minimum=0,
    maximum=1,
    open_min=True,
  )
  client_opt_state: str = hparam(
    'reset',
    "Client optimizer state: 'reset' every round (the "
    "usual convention) or kept per client ('persistent').",
    choices=('reset', 'persistent'),
  )
  batch_size: int = hparam(
    32, 'Local batch size (0: the full local batch).', minimum=0
  )
  local_epochs: int = hparam(1, 'Local epochs per round (E).', minimum=1)
  local_steps: Optional[int] = hparam(
    None, 'Local steps per round (K); replaces local_epochs.', minimum=1
  )
  drop_last: bool = hparam(
    False,
    "Drop each epoch's last partial batch, as PyTorch's "
    "DataLoader(drop_last=True) in PFLlib's clients: floor(n / B) steps "
    'an epoch, none for a client with fewer than B examples.',
  )
  weighting: Optional[str] = hparam(
    None,
    "Aggregation weights: 'num_examples', 'tokens' (a "
    "client's non-padding training targets: google-research/"
    "federated's weighting of its next-word tasks; examples for "
    "one label per example) or 'uniform' (default: the "
    "algorithm's paper).",
    choices=WEIGHTINGS,
  )
  server_optimizer: str = hparam(
    'sgd',
    "Server optimizer on the mean delta: 'sgd' (lr 1: "
    "plain averaging; momentum: FedAvgM), or Reddi et al.'s "
    "'adagrad', 'yogi', 'adam' (FedAdagrad, FedYogi, FedAdam: the "
    "paper's Algorithm 2), or 'keras_adagrad', 'keras_yogi', "
    "'keras_adam' (as google-research/federated's code ran them: "
    "Keras's optimizers and its Yogi, from zero moments, Adam and "
    "Yogi bias-corrected, epsilon = --server_tau; Keras's beta2 is "
    '0.999).',
    choices=('sgd',) + server_optimizers.KINDS,
  )
  server_lr: float = hparam(
    1.0, 'Server learning rate.', minimum=0, open_min=True, sweep=True
  )
  server_momentum: float = hparam(
    0.0, "Server momentum ('sgd').", minimum=0, maximum=1, open_max=True
  )
  server_beta1: float = hparam(
    0.9,
    'First-moment decay of the adaptive server optimizers '
    "(Adagrad's in the paper's Algorithm 2; Keras's has none).",
    minimum=0,
    maximum=1,
    open_max=True,
  )
  server_beta2: float = hparam(
    0.99,
    'Second-moment decay of Yogi and Adam (Reddi et al.; '
    "Keras's default is 0.999).",
    minimum=0,
    maximum=1,
    open_max=True,
  )
  server_tau: float = hparam(
    1e-3,
    'Adaptivity tau of the adaptive server optimizers (Reddi '
    "et al.; Algorithm 2's v starts at tau^2; Keras's epsilon).",
    minimum=0,
    open_min=True,
  )
  finetune_steps: Optional[int] = hparam(
    None,
    'Evaluation fine-tuning steps on the training '
    "split (default: the algorithm's, 0 for most).",
    minimum=0,
  )
  finetune_lr: Optional[float] = hparam(
    None,
    "Fine-tuning learning rate (default: the algorithm's, else client_lr).",
    minimum=0,
    open_min=True,
    sweep=True,
  )

  def make_client_optimizer(
    self, learning_rate=None
  ) -> optax.GradientTransformationExtraArgs:
    """The client optimizer: clipping, weight decay, SGD (momentum) or Adam at
    ``learning_rate`` (default client_lr), then the per-round decay."""
    lr = self.client_lr if learning_rate is None else learning_rate
    parts = []
    if self.client_grad_clip:
      parts.append(optax.clip_by_global_norm(self.client_grad_clip))
    if not is_concrete(self.client_weight_decay) or self.client_weight_decay:
      parts.append(optax.add_decayed_weights(self.client_weight_decay))
    if self.client_optimizer == 'adam':
      parts.append(optax.adam(lr))
    else:
      parts.append(optax.sgd(lr, momentum=self.client_momentum or None))
    if self.client_lr_decay != 1.0:
      parts.append(scale_by_round_decay(self.client_lr_decay))
    if self.client_lr_schedule == 'linear':
      horizon = self.client_lr_horizon
      assert horizon is not None  # check() refuses 'linear' without it
      parts.append(
        scale_by_round(linear_schedule(horizon, self.client_lr_warmup))
      )
    elif self.client_lr_schedule == 'cut':
      parts.append(
        scale_by_round(
          cut_schedule(self.client_lr_cut_every, self.client_lr_cut_factor)
        )
      )
    return optax.chain(*parts)

  def make_server_optimizer(self) -> optax.GradientTransformation:
    if self.server_optimizer in server_optimizers.KINDS:
      return server_optimizers.adaptive_server(
        self.server_optimizer,
        self.server_lr,
        self.server_beta1,
        self.server_beta2,
        self.server_tau,
      )
    return optax.sgd(self.server_lr, momentum=self.server_momentum or None)

  def filled_weighting(self) -> str:
    """``weighting`` as an algorithm's builder reads it: filled by
    ``AlgorithmSpec.resolve`` (``--weighting``, else the algorithm's
    default); refused naming its flag when a caller left it None.

    Returns:
      The weighting.
    """
    return require_filled(self, 'weighting')

  def batching(self) -> Batching:
    if self.local_steps is not None:
      return Batching(
        self.batch_size or None, num_epochs=None, num_steps=self.local_steps
      )
    return Batching(
      self.batch_size or None,
      num_epochs=self.local_epochs,
      drop_last=self.drop_last,
    )

  def finetune_batching(self) -> Batching:
    """Evaluation fine-tuning: ``finetune_steps`` steps of ``batch_size``."""
    return Batching(
      self.batch_size or None, num_epochs=None, num_steps=self.finetune_steps
    )

  def check(self) -> None:
    """Consistency of settings that exclude each other."""
    if self.local_steps is not None and self.local_epochs != 1:
      raise ConfigError(
        'local_epochs', 'does nothing with --local_steps (steps replace epochs)'
      )
    if self.drop_last and (self.local_steps is not None or not self.batch_size):
      raise ConfigError(
        'drop_last',
        'drops the partial batch of an epoch; it does nothing with '
        '--local_steps or --batch_size=0',
      )
    self._refuse_unread(
      'client_lr_schedule',
      {
        'const': (),
        'linear': ('client_lr_warmup', 'client_lr_horizon'),
        'cut': ('client_lr_cut_every', 'client_lr_cut_factor'),
      },
    )
    if self.client_lr_schedule == 'linear' and self.client_lr_horizon is None:
      raise ConfigError(
        'client_lr_horizon', "give the rounds the 'linear' schedule spans"
      )
    self._refuse_unread(
      'server_optimizer',
      {
        'sgd': ('server_momentum',),
        'adagrad': ('server_beta1', 'server_tau'),
        'yogi': ('server_beta1', 'server_beta2', 'server_tau'),
        'adam': ('server_beta1', 'server_beta2', 'server_tau'),
        'keras_adam': ('server_beta1', 'server_beta2', 'server_tau'),
        'keras_yogi': ('server_beta1', 'server_beta2', 'server_tau'),
        'keras_adagrad': ('server_tau',),
      },
    )

  def _refuse_unread(self, choice: str, reads: dict) -> None:
    """Refuses a setting given a non-default value that the chosen ``choice``
    (``reads``: its value -> the settings it reads) does not read."""
    value = getattr(self, choice)
    every = set().union(*reads.values())
    for f in dataclasses.fields(self):
      if (
        f.name in every
        and f.name not in reads[value]
        and _differs(getattr(self, f.name), f.default)
      ):
        raise ConfigError(f.name, f'does nothing with --{choice}={value}')

  @property
  def stateful_client_optimizer(self) -> bool:
    """Whether the client optimizer keeps state between steps."""
    return self.client_optimizer == 'adam' or bool(self.client_momentum)


@dataclasses.dataclass(frozen=True)
class NoConfig(Declared):
  """An algorithm without hyperparameters of its own."""

  prefix: ClassVar[Optional[str]] = None


class BuildData(Protocol):
  """What an algorithm's builder reads of its population.

  A ``FederatedData`` (the device layout, a library caller's data) or a
  ``Population`` (the host layout: counts without the examples): its
  clients, classes and groups, and each split's example counts
  (``train.num_examples``).
  """

  @property
  def num_clients(self) -> int: ...

  @property
  def num_classes(self) -> int: ...

  @property
  def groups(self) -> Any: ...

  @property
  def train(self) -> Any: ...

  @property
  def val(self) -> Any: ...


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
  """A registry entry.

  Attributes:
    name: registry name.
    config: the algorithm's config class (a frozen dataclass with a ``prefix``).
    build: ``(training, config, model, data) -> FederatedAlgorithm``, the
      algorithm built from the run's shared settings (``training``, a
      ``TrainingConfig``: the client optimizer, batching, server optimizer,
      weighting), its own settings (``config``, an instance of ``config``
      above), the ``models.Model`` and the federated data (its clients'
      sizes, groups); each algorithm's module docstring names its paper.
    uses: the TrainingConfig fields the algorithm reads; a non-default
      value of any other field is refused (it would do nothing).
    ignores: fields of ``config`` this registry name does not read (variants
      sharing a config class).
    default_weighting: weighting when ``--weighting`` is not given.
    default_finetune_steps: evaluation fine-tuning steps when
      ``--finetune_steps`` is not given.
    check: optional ``(training, config) -> None`` raising ConfigError for
      combinations that cannot apply (e.g. momentum on a one-step client).
    summary: one line for ``--algorithm``'s help.
    needs_validation: the algorithm needs a per-client validation split
      (the CLI then holds out 0.1 unless ``--val_fraction`` says otherwise).
    model_state: the algorithm carries a model's mutable collections
      (batch statistics, ``models.Model.collections``) with its parameters:
      its client steps keep what each forward pass computed
      (``training.keep_model_state``); a model with batch statistics is
      refused by an algorithm without it.
    partial_work: what the server does with a straggler's partial work
      (``core.system``): ``'drop'`` it (FedAvg in FedProx's experiment; a
      dropped client's per-client state stays as it was) or ``'keep'`` it
      (FedProx, FedNova).
    state_heatmap: ``state -> matrix``, a matrix-valued part of its state
      the command draws at every evaluated round (``affinity.png``:
      FedFomo's affinity P), or None.

  ``uses`` and ``ignores`` are checked when the spec is made: a name that is
  no ``TrainingConfig`` field, or no field of ``config``, is refused (a
  misspelled setting would otherwise be refused as "does nothing" for the
  algorithm whose file names it).
  """

  name: str
  config: type
  build: Callable
  uses: FrozenSet[str]
  ignores: FrozenSet[str] = frozenset()
  default_weighting: str = 'num_examples'
  default_finetune_steps: int = 0
  check: Optional[Callable] = None
  summary: str = ''
  needs_validation: bool = False
  model_state: bool = False
  partial_work: str = 'drop'
  state_heatmap: Optional[Callable[[Any], Any]] = None

  def __post_init__(self):
    training = [f.name for f in dataclasses.fields(TrainingConfig)]
    bad = sorted(set(self.uses) - set(training))
    if bad:
      raise ValueError(
        f'algorithm {self.name!r}: uses names {bad}, which are not shared '
        f'training settings; they are {training}'
      )
    if not (
      isinstance(self.config, type) and dataclasses.is_dataclass(self.config)
    ):
      raise TypeError(
        f'algorithm {self.name!r}: config must be a dataclass type, got '
        f'{self.config!r}'
      )
    own = [f.name for f in dataclasses.fields(self.config)]
    bad = sorted(set(self.ignores) - set(own))
    if bad:
      raise ValueError(
        f'algorithm {self.name!r}: ignores names {bad}, which are not fields '
        f'of '
        f'{self.config.__name__}; they are {own}'
      )
    if self.partial_work not in ('drop', 'keep'):
      raise ValueError(
        f"algorithm {self.name!r}: partial_work must be 'drop' or 'keep', got "
        f'{self.partial_work!r}'
      )

  def weighting(self, training: TrainingConfig) -> str:
    return training.weighting or self.default_weighting

  def finetune_steps(self, training: TrainingConfig) -> int:
    if training.finetune_steps is None:
      return self.default_finetune_steps
    return training.finetune_steps

  def inapplicable(self, training: TrainingConfig) -> list:
    """Shared settings given a non-default value that this algorithm does not
    use."""
    default = TrainingConfig()
    out = [
      f.name
      for f in dataclasses.fields(training)
      if f.name not in self.uses
      and _differs(getattr(training, f.name), getattr(default, f.name))
    ]
    if (
      'finetune_lr' in self.uses
      and training.finetune_lr is not None
      and self.finetune_steps(training) == 0
    ):
      out.append('finetune_lr')
    if (
      'client_opt_state' in self.uses
      and training.client_opt_state == 'persistent'
      and not training.stateful_client_optimizer
    ):
      out.append('client_opt_state')
    return out

  def ignored_fields(self, config) -> list:
    """Fields of ``config`` in ``ignores`` given a non-default value."""
    default = type(config)()
    return [
      flag_name(type(config), f)
      for f in sorted(self.ignores)
      if _differs(getattr(config, f), getattr(default, f))
    ]

  def validate(self, training: TrainingConfig, config) -> None:
    """Inapplicable settings and the algorithm's own check (the settings'
    ranges were checked when they were made: ``Declared``).

    Args:
      training: the shared settings.
      config: the algorithm's own.

    Returns:
      None.

    Raises:
      ConfigError naming the flag.
    """
    if not isinstance(config, self.config):
      raise TypeError(
        f'{self.name} takes a {self.config.__name__}, got '
        f'{type(config).__name__}'
      )
    # a user's config class of plain fields
    if not isinstance(config, Declared):
      validate(config)
    bad = self.inapplicable(training) + self.ignored_fields(config)
    if bad:
      raise ConfigError(
        bad[0], f'does nothing for {self.name}' + _reason(bad[0])
      )
    if self.check is not None:
      self.check(training, config)

  def resolve(self, training: TrainingConfig) -> TrainingConfig:
    """``training`` with the algorithm's defaults filled in (weighting,
    fine-tuning steps)."""
    return dataclasses.replace(
      training,
      weighting=self.weighting(training),
      finetune_steps=self.finetune_steps(training),
    )


def _differs(a, b) -> bool:
  if not (is_concrete(a) and is_concrete(b)):
    return True
  return a != b


def _reason(name: str) -> str:
  if name == 'client_opt_state':
    return (
      ' (plain SGD keeps no optimizer state; set --client_momentum or '
      '--client_optimizer=adam)'
    )
  if name == 'finetune_lr':
    return ' (no evaluation fine-tuning: set --finetune_steps)'
  return ''
