"""Privacy accounting of DP-SGD (Abadi et al., CCS 2016) with Google's
``dp-accounting`` package (Renyi DP accountant, Mironov 2017).

A client running DP-SGD on its own data with per-example clipping and
Gaussian noise of std ``noise_multiplier * clip`` per batch of B from its
n_i examples is accounted as a Poisson-subsampled Gaussian mechanism with
sampling rate q_i = B / n_i, composed over every local step it has taken so
far (the batches here are drawn by shuffling without replacement; the
Poisson accounting is the usual approximation of it). A run's epsilon at
``delta`` is the worst client's.
"""

import dataclasses
import functools
from typing import Callable

import numpy as np

from fedjax_personal.errors import SettingError
from fedjax_personal.hparams import Declared, hparam

__all__ = [
  'check_dp',
  'dp_privacy',
  'dp_sgd_epsilon',
  'DPConfig',
  'epsilon_text',
  'Privacy',
  'worst_epsilon',
]


@functools.lru_cache(maxsize=65536)
def dp_sgd_epsilon(
  sampling_rate: float, noise_multiplier: float, steps: int, delta: float = 1e-5
) -> float:
  """epsilon of ``steps`` compositions of the subsampled Gaussian mechanism
  at ``delta`` (RDP accountant); 0 for no steps, inf without noise."""
  if steps <= 0:
    return 0.0
  if noise_multiplier <= 0:
    return float('inf')
  import dp_accounting

  accountant = dp_accounting.rdp.RdpAccountant()
  event = dp_accounting.PoissonSampledDpEvent(
    min(float(sampling_rate), 1.0),
    dp_accounting.GaussianDpEvent(noise_multiplier),
  )
  accountant.compose(event, int(steps))
  return float(accountant.get_epsilon(delta))


@dataclasses.dataclass(frozen=True)
class Privacy:
  """What an algorithm offering DP-SGD exposes for accounting.

  Attributes:
    noise_multiplier: sigma of DP-SGD.
    sampling_rates: [N] q_i = batch size / n_i.
    steps: ``state -> [N]`` DP-SGD steps each client has taken so far (a
      counter the algorithm keeps in its state).
  """

  noise_multiplier: float
  sampling_rates: np.ndarray
  steps: Callable


def worst_epsilon(privacy: Privacy, steps, delta: float = 1e-5) -> float:
  """max_i epsilon_i over clients with their steps so far.

  Args:
    privacy: the accounting record.
    steps: each client's steps so far.
    delta: the delta.

  Returns:
    The largest epsilon.
  """
  steps = np.asarray(steps)
  return max(
    (
      dp_sgd_epsilon(
        round(float(q), 12), privacy.noise_multiplier, int(s), delta
      )
      for q, s in zip(privacy.sampling_rates, steps)
    ),
    default=0.0,
  )


def epsilon_text(epsilon) -> str:
  """A reported epsilon: ``None`` (no DP-SGD) is infinite privacy loss.

  Args:
    epsilon: an epsilon, or None.

  Returns:
    The text.
  """
  return 'inf' if epsilon is None else f'{epsilon:.2f}'


@dataclasses.dataclass(frozen=True)
class DPConfig(Declared):
  """DP-SGD local training settings.

  Shared by the algorithms offering it (their config classes inherit these
  fields and get ``--<prefix>_dp_*`` flags)."""

  dp_clip_norm: float = hparam(
    0.0, 'DP-SGD per-example clip norm (0: no DP).', minimum=0
  )
  dp_noise_multiplier: float = hparam(
    0.0, 'DP-SGD noise multiplier.', minimum=0
  )

  def dp(self):
    """(clip_norm, noise_multiplier) for ``training.sgd_client_work``, or
    None."""
    return (
      (self.dp_clip_norm, self.dp_noise_multiplier)
      if self.dp_clip_norm > 0
      else None
    )


def check_dp(config: DPConfig):
  """Refuses noise without clipping (the noise scale is sigma * clip).

  Args:
    config: the algorithm's settings (its DP fields).

  Returns:
    None.
  """
  if config.dp_noise_multiplier and not config.dp_clip_norm:
    raise SettingError(
      'dp_noise_multiplier',
      f'{config.dp_noise_multiplier} needs a clip norm (dp_clip_norm) > 0, got '
      f'{config.dp_clip_norm}',
      owner=type(config),
    )


def dp_privacy(config: DPConfig, data, batching, steps: Callable) -> Privacy:
  """The accounting record of an algorithm built with DP-SGD: q_i = B / n_i
  from the training split and ``steps(state) -> [N]`` steps so far.

  Args:
    config: the DP settings.
    data: the federated data (client sizes).
    batching: the local batching.
    steps: each client's steps so far (the state's counter).

  Returns:
    The accounting record.
  """
  n = np.asarray(data.train.num_examples, np.float64)
  b = batching.effective_batch_size(int(data.train.max_examples))
  return Privacy(
    config.dp_noise_multiplier, np.minimum(b / np.maximum(n, 1), 1.0), steps
  )
