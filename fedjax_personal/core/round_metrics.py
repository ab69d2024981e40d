"""A round's counts: the clients that took part and the bytes moved
(traceable: computed inside the compiled round)."""

from typing import TYPE_CHECKING, Any, Optional

import jax.numpy as jnp

if TYPE_CHECKING:  # annotations only: algorithm imports this module's users
  from fedjax_personal.core.algorithm import Communication
  from fedjax_personal.core.sampling import Cohort

__all__ = ['cohort_counts', 'communication_metrics', 'PARTICIPATED']


def communication_metrics(
  alg: Any,
  state: Any,
  num_active: Any,
  num_uploads: Any = None,
  comm: Optional['Communication'] = None,
) -> dict:
  """Bytes of one round from the algorithm's static sizes and the cohort
  (traceable: computed inside the compiled round).

  ``bytes_down_broadcast`` sends each distinct downlink model once (FedAvg: 1,
  streams: m_t); ``bytes_down_unicast`` sends one model to every active client.

  Args:
    alg: the FederatedAlgorithm (or a RoundRunner, for its algorithm).
    num_active: the sampled clients (each received the downlink).
    num_uploads: the clients that sent an upload (None: every sampled one;
      fewer when the algorithm marks some as not participating).
    comm: the round's ``Communication`` counted from what it moved; None: the
      algorithm's.

  Returns:
    ``{'bytes_up', 'bytes_down_broadcast', 'bytes_down_unicast', ...}`` of
    the round (traced scalars).
  """
  if comm is None:
    comm = getattr(alg, 'algorithm', alg).communication(state)
  num_active = jnp.asarray(num_active, jnp.float32)
  num_uploads = (
    num_active if num_uploads is None else jnp.asarray(num_uploads, jnp.float32)
  )
  distinct = jnp.minimum(
    jnp.asarray(comm.num_downlink_models, jnp.float32), num_active
  )
  has_down = jnp.asarray(comm.num_downlink_models) > 0
  return {
    'bytes_up': num_uploads * comm.uplink_bytes_per_client,
    'bytes_down_broadcast': jnp.where(has_down, distinct, 0.0)
    * comm.downlink_bytes_per_model,
    'bytes_down_unicast': jnp.where(
      has_down, num_active * comm.downlink_bytes_per_model, 0.0
    ),
  }


#: A server update's metric naming the clients that took part: bool [C]; a
#: sampled client it marks False received the round's model and sent nothing
#: (a dropout, a straggler). Without it every sampled client took part.
PARTICIPATED = 'participated'


def cohort_counts(
  alg: Any,
  state: Any,
  cohort: 'Cohort',
  metrics: dict,
  comm: Optional['Communication'] = None,
) -> dict:
  """``num_active`` (the clients that took part) and the round's bytes,
  from the cohort's mask and the server update's ``PARTICIPATED`` (which is
  replaced by these counts: a round's metrics stay scalars).

  Args:
    alg: the FederatedAlgorithm (or a RoundRunner).
    state: the state after the server's update.
    cohort: the sampled cohort.
    metrics: the server update's metrics (``PARTICIPATED`` popped from it).
    comm: as for ``communication_metrics``.

  Returns:
    The counts and bytes (traced scalars).
  """
  sampled = jnp.sum(cohort.mask.astype(jnp.float32))
  if PARTICIPATED not in metrics:
    return communication_metrics(alg, state, sampled, comm=comm)
  took_part = jnp.sum(
    (cohort.mask & metrics.pop(PARTICIPATED)).astype(jnp.int32)
  )
  return {
    'num_active': took_part,
    'num_sampled': sampled.astype(jnp.int32),
    **communication_metrics(alg, state, sampled, took_part, comm=comm),
  }
