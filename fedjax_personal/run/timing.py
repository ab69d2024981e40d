"""The communication and time model of the user-centric FL paper
(Mestoukirdi et al.), usable with every algorithm.

Times are in units of T_dl, the time to send one model down. Per round:
  * downlink: one transmission per distinct downlink model (1 for a FedAvg
    broadcast, m_t for user-centric streams, one per active client for
    unicast personal models): ``num_downlink_models * T_dl``;
  * computing: clients have shifted-exponential computing times T_min +
    Exp(mu), and a synchronous round of m clients waits for the slowest,
    E[max] = T_min + H_m / mu (H_m the m-th harmonic number);
  * uplink: the clients upload in parallel, each model taking
    T_ul = rho * T_dl (rho in [2, 4] for wireless systems, 1 for wired).
Rounds with nothing uploaded or sent down cost only their computing time.
"""

import dataclasses

import numpy as np

__all__ = ['harmonic', 'PAPER_SYSTEMS', 'simulated_times', 'TimeModel']


def harmonic(m: int) -> float:
  """The harmonic number H_m (0 for m <= 0).

  Args:
    m: an int.

  Returns:
    H_m.
  """
  return float(np.sum(1.0 / np.arange(1, m + 1))) if m > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class TimeModel:
  """The user-centric paper's time model of a round.

  Upload, download and computing times.

  Attributes:
    rho: T_ul / T_dl.
    t_min: minimum computing time (in T_dl units).
    inv_mu: 1 / mu, the mean extra computing delay (in T_dl units).
  """

  rho: float = 4.0
  t_min: float = 1.0
  inv_mu: float = 1.0

  def computing_time(self, num_active: int) -> float:
    """E[max of num_active shifted exponentials] = T_min + H_m / mu."""
    return self.t_min + harmonic(int(num_active)) * self.inv_mu

  def round_time(
    self, num_active: int, num_downlink_models: int, uploads: bool = True
  ) -> float:
    down = float(num_downlink_models)
    up = self.rho if uploads and num_active > 0 else 0.0
    return down + self.computing_time(num_active) + up


# The paper's Fig. 3 systems.
PAPER_SYSTEMS = {
  'wireless_unreliable (rho=4)': TimeModel(rho=4.0, t_min=1.0, inv_mu=1.0),
  'wireless_reliable (rho=2)': TimeModel(rho=2.0, t_min=1.0, inv_mu=0.0),
  'wired (rho=1)': TimeModel(rho=1.0, t_min=1.0, inv_mu=0.0),
}


def simulated_times(
  history, model: TimeModel, num_downlink_models
) -> np.ndarray:
  """Cumulative simulated time after each round of a history.

  ``num_downlink_models``: an int, or a function of the round's record
  (records carry 'num_active' and, for streams, 'num_streams').

  Args:
    history: a run's records.
    model: the time model.
    num_downlink_models: models sent down per round.

  Returns:
    Seconds after each round.
  """
  times, t = [], 0.0
  for r in history:
    m = int(r.get('num_active', 0))
    d = (
      num_downlink_models(r)
      if callable(num_downlink_models)
      else num_downlink_models
    )
    t += model.round_time(
      m, min(d, m) if d else 0, uploads=r.get('bytes_up', 1) > 0
    )
    times.append(t)
  return np.array(times)
