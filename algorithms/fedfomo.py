"""FedFomo (Zhang, Sapra, Fidler, Yeung and Alvarez, ICLR 2021): personalized
federated learning with first-order model optimization.

Each client splits its data into train and validation (``--val_fraction``,
0.2 in the paper). Every round, each active client downloads M models of other
clients, chosen by its affinity row P_i: the top-M, or with probability eps M
random ones (eps starts at eps0 and decays linearly per round). With
theta_base its own previous model it weighs each candidate by the validation
loss improvement per unit of parameter distance,

    w_n = (L_val(theta_base) - L_val(theta_n)) / ||theta_n - theta_base||,

adds w_n to P_i,n, keeps the positive w_n normalized to sum 1 and moves to
theta_base + sum_n w_n (theta_n - theta_base) (theta_base when none is
positive), then trains E local epochs. The weights of all (client, candidate)
pairs of the cohort are computed vectorized.

Options of the paper: ``leave_one_out`` scores candidates through model
averages (w_n from the average of the M candidates vs the average without
n), so no individual model is evaluated; DP-SGD local training (``dp`` =
(clip_norm, noise_multiplier)); targets that differ from the local training
distribution (``data.permute_eval_targets`` shuffles validation/test pairs
among clients).
"""

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from fedjax_personal.config import (
  BATCHING,
  CLIENT_OPTIMIZER,
  FINETUNE,
  AlgorithmSpec,
  BuildData,
  TrainingConfig,
  hparam,
)
from fedjax_personal.core.algorithm import (
  ClientModels,
  Communication,
  FederatedAlgorithm,
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.batching import Batching
from fedjax_personal.core.clustering import in_group_chance
from fedjax_personal.core.losses import Batch, mean_loss
from fedjax_personal.core.privacy import DPConfig, check_dp, dp_privacy
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import (
  ClientContext,
  ClientWork,
  plain_objective,
  sgd_client_work,
)
from fedjax_personal.core.tree_util import (
  PyTree,
  rows,
  tree_broadcast,
  tree_bytes,
  tree_scatter,
)
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import Model

__all__ = [
  'build',
  'check',
  'choose_candidates',
  'fedfomo',
  'FedFomoConfig',
  'FedFomoState',
  'fomo_update',
  'fomo_weights',
  'SPEC',
]


@dataclasses.dataclass(frozen=True)
class FedFomoConfig(DPConfig):
  """FedFomo's settings: the ``--fedfomo_*`` flags.

  Declared once (``hparam``: default, help, range, sweepable)."""

  prefix: ClassVar[str] = 'fedfomo'
  candidates: int = hparam(5, 'Models downloaded per round (M).', minimum=1)
  eps: float = hparam(
    0.3, 'Initial exploration probability.', minimum=0, maximum=1
  )
  eps_decay: float = hparam(
    0.05, 'Exploration probability decrease per round.', minimum=0
  )
  leave_one_out: bool = hparam(
    False, 'Score candidates through model averages.'
  )


@struct.dataclass
class FedFomoState:
  """FedFomo's state: the clients' models and their affinities.

  Attributes:
    models: stacked [N, ...] latest model of every client (the server's pool).
    affinity: [N, N] P, P_ij = client i's accumulated weight for client j.
    dp_steps: int32 [N] local (DP-)SGD steps each client has taken so far
      (for the privacy accountant).
  """

  models: optax.Params
  affinity: jax.Array
  dp_steps: jax.Array


def choose_candidates(
  key, affinity_rows, clients, num_candidates: int, eps, num_clients: int
):
  """Candidates per cohort client: top-M of its affinity row (itself
  excluded, ties broken at random), or with probability eps M random ones.

  Args:
    key: the round's server key.
    affinity_rows: the cohort clients' affinity rows [C, N].
    clients: the cohort's client indices [C].
    num_candidates: M.
    eps: the exploration probability.
    num_clients: N.

  Returns:
    Candidate indices [C, M].
  """
  k_explore, k_tie, k_rand = jax.random.split(key, 3)
  c = clients.shape[0]
  self_mask = jnp.arange(num_clients)[None, :] == clients[:, None]
  tie = 1e-6 * jax.random.uniform(k_tie, (c, num_clients))
  greedy = jnp.argsort(
    -jnp.where(self_mask, -jnp.inf, affinity_rows + tie), axis=1
  )[:, :num_candidates]
  rand = jnp.argsort(
    jnp.where(self_mask, 2.0, jax.random.uniform(k_rand, (c, num_clients))),
    axis=1,
  )[:, :num_candidates]
  explore = jax.random.uniform(k_explore, (c,)) < eps
  return jnp.where(explore[:, None], rand, greedy).astype(jnp.int32)


def _flat_dist(a, b):
  return jnp.sqrt(
    sum(
      jnp.sum(jnp.square(x - y))
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )
  )


def fomo_weights(val_loss, base, candidates, base_loss, candidate_losses):
  """w_n = (L(base) - L(theta_n)) / ||theta_n - base|| (0 at distance 0).

  Args:
    val_loss: ``params -> validation loss`` of the client.
    base: the client's model.
    candidates: the downloaded models [M, ...].
    base_loss: the base model's validation loss.
    candidate_losses: the candidates' validation losses [M].

  Returns:
    The weights [M].
  """
  dists = jax.vmap(lambda c: _flat_dist(c, base))(candidates)
  return jnp.where(
    dists > 0, (base_loss - candidate_losses) / jnp.maximum(dists, 1e-12), 0.0
  )


def fomo_update(base, candidates, weights):
  """theta_base + sum_n w_n+ (theta_n - theta_base), positive weights
  normalized to 1; theta_base when none is positive.

  Args:
    base: the client's model.
    candidates: the downloaded models [M, ...].
    weights: their weights [M].

  Returns:
    The client's new model.
  """
  pos = jnp.maximum(weights, 0.0)
  total = jnp.sum(pos)
  norm = jnp.where(total > 0, pos / jnp.where(total > 0, total, 1.0), 0.0)
  return jax.tree.map(
    lambda b, c: b + jnp.tensordot(norm, c - b[None], axes=1), base, candidates
  )


def fedfomo(
  model: Model,
  num_clients: int,
  client_optimizer,
  batching: Batching,
  num_candidates: int = 5,
  eps0: float = 0.3,
  eps_decay: float = 0.05,
  leave_one_out: bool = False,
  dp: Optional[tuple] = None,
  groups=None,
) -> FederatedAlgorithm:
  """Builds FedFomo (M = ``num_candidates``). The candidate choice (exploration
  and ties) draws from the round's server key. ``groups`` (optional known
  group of each client, e.g. the latent distribution) only feeds a diagnostic:
  ``fomo_in_group_share``, the share of the round's positive weight that goes
  to downloads from the client's own group (``fomo_in_group_chance``: the
  share of other clients in that group, what a group-blind choice gets).

  Args:
    model: the model (pure ``init`` / ``apply``).
    num_clients: N: per-client state has N rows.
    client_optimizer: the optax client optimizer.
    batching: local batching (epochs or steps, batch size).
    num_candidates: M, the models a client downloads.
    eps0: the first round's exploration probability.
    eps_decay: its decrease per round.
    leave_one_out: weigh candidates with the client's own model left out.
    dp: optional ``(clip_norm, noise_multiplier)``: DP-SGD local training.
    groups: each client's known group [N] (a diagnostic only), or None.

  Returns:
    The ``FederatedAlgorithm``.
  """
  if not 1 <= num_candidates < num_clients:
    raise ConfigError(
      'fedfomo_candidates',
      f'must be in [1, num_clients - 1], got {num_candidates}',
    )
  objective = plain_objective(model)
  groups_np = None if groups is None else np.asarray(groups)
  if groups_np is not None and groups_np.min() < 0:
    groups_np = None  # no known group structure

  def val_loss(params, val):
    return mean_loss(model, params, val)

  def init(key: jax.Array) -> FedFomoState:
    params = model.init(key)
    return FedFomoState(
      tree_broadcast(params, num_clients),
      jnp.zeros((num_clients, num_clients)),
      jnp.zeros(num_clients, jnp.int32),
    )

  def server_broadcast(state: FedFomoState, cohort: Cohort, rc: RoundContext):
    eps = jnp.maximum(eps0 - eps_decay * rc.round.astype(jnp.float32), 0.0)
    affinity = state.affinity.at[cohort.idx].get(mode='clip')
    cand = choose_candidates(
      rc.key, affinity, cohort.idx, num_candidates, eps, num_clients
    )
    return None, (
      rows(state.models, cohort.idx),
      cand,
      rows(state.models, cand),
    )

  def start(ctx: ClientContext):
    base, _, cand_models = ctx.state
    val = ctx.data.val
    base_loss = val_loss(base, val)
    if leave_one_out:
      m = num_candidates
      mean = jax.tree.map(lambda c: c.mean(0), cand_models)
      loo = jax.tree.map(
        lambda c, mu: (m * mu[None] - c) / max(m - 1, 1), cand_models, mean
      )
      mean_loss = val_loss(mean, val)
      loo_losses = jax.vmap(lambda p: val_loss(p, val))(loo)
      dists = jax.vmap(lambda p: _flat_dist(p, mean))(loo)
      w = jnp.where(
        dists > 0, (loo_losses - mean_loss) / jnp.maximum(dists, 1e-12), 0.0
      )
    else:
      losses = jax.vmap(lambda p: val_loss(p, val))(cand_models)
      w = fomo_weights(val_loss, base, cand_models, base_loss, losses)
    return fomo_update(base, cand_models, w), w

  inner = sgd_client_work(
    lambda ctx: objective,
    client_optimizer,
    batching,
    final=lambda ctx, c: c,
    dp=dp,
  )

  def work_init(ctx: ClientContext, key: jax.Array):
    params, w = start(ctx)
    return inner.init(dataclasses.replace(ctx, shared=params), key), w

  def work_step(
    ctx: ClientContext, carry: PyTree, batch: Batch, key: jax.Array
  ):
    return inner.step(ctx, carry[0], batch, key), carry[1]

  def work_final(ctx: ClientContext, carry: PyTree):
    c, w = carry
    return c.params, ctx.state[1], w, c.stats, c.num_steps

  work = ClientWork(
    work_init,
    work_step,
    work_final,
    batching,
    init_opt_state=inner.init_opt_state,
    opt_state=None if inner.opt_state is None else _first(inner.opt_state),
  )

  def server_update(state: FedFomoState, cohort: Cohort, out, rc: RoundContext):
    params, cand, w, stats, steps = out
    rows = jnp.where(cohort.mask[:, None], w, 0.0)
    i = jnp.broadcast_to(cohort.idx[:, None], cand.shape)
    affinity = state.affinity.at[i, cand].add(rows, mode='drop')  # P_i,n += w_n
    dp_steps = state.dp_steps.at[cohort.idx].add(
      jnp.where(cohort.mask, steps, 0).astype(jnp.int32), mode='drop'
    )
    new = FedFomoState(
      tree_scatter(state.models, cohort.idx, params), affinity, dp_steps
    )
    # Diagnostic: the share of downloaded candidates with a positive weight
    # (0 means every active client kept its own model, i.e. trained locally).
    active = cohort.mask.astype(jnp.float32)
    positive = jnp.sum((w > 0).astype(jnp.float32) * active[:, None])
    share = positive / jnp.maximum(jnp.sum(active) * w.shape[1], 1.0)
    info = {
      **cohort_train_metrics(stats, cohort.mask),
      'fomo_positive_share': share,
    }
    if groups_np is not None:
      g = jnp.asarray(groups_np, jnp.int32)
      same = (g[cand] == g[cohort.idx][:, None]).astype(jnp.float32)
      pos = jnp.maximum(w, 0.0) * active[:, None]
      info['fomo_in_group_share'] = jnp.sum(pos * same) / jnp.maximum(
        jnp.sum(pos), 1e-30
      )
      info['fomo_in_group_chance'] = jnp.float32(in_group_chance(groups_np))
    return new, info

  def communication(state: FedFomoState):
    # Each active client receives its own bundle of M models (unicast).
    b = tree_bytes(jax.tree.map(lambda a: a[0], state.models))
    return Communication(b, b * num_candidates, num_clients)

  return FederatedAlgorithm(
    name='fedfomo',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=work,
    server_update=server_update,
    client_models=lambda s: ClientModels.personal(s.models, num_clients),
    communication=communication,
  )


def build(
  training: TrainingConfig,
  config: FedFomoConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedFomo, built as ``AlgorithmSpec.build`` says; its settings
  ``FedFomoConfig``; every client needs a validation split."""
  if int(np.asarray(data.val.num_examples).min()) == 0:
    raise ConfigError(
      'val_fraction',
      'fedfomo needs a validation split on every client (0.2 in the paper)',
    )
  dp = config.dp()
  batching = training.batching()
  alg = fedfomo(
    model,
    data.num_clients,
    training.make_client_optimizer(),
    batching,
    num_candidates=min(config.candidates, data.num_clients - 1),
    eps0=config.eps,
    eps_decay=config.eps_decay,
    leave_one_out=config.leave_one_out,
    dp=dp,
    groups=data.groups,
  )
  if dp is None:
    return alg
  return alg.replace(
    privacy=dp_privacy(config, data, batching, lambda state: state.dp_steps)
  )


def check(training, config: FedFomoConfig):
  """``AlgorithmSpec.check`` of FedFomo: its DP settings (a ConfigError if they
  cannot apply)."""
  del training
  check_dp(config)


# Personalized by its own affinity-weighted combination: no weighting and no
# server optimizer.
SPEC = AlgorithmSpec(
  'fedfomo',
  FedFomoConfig,
  build,
  CLIENT_OPTIMIZER | BATCHING | FINETUNE,
  check=check,
  needs_validation=True,
  summary='FedFomo (Zhang et al. 2021): first-order model optimization',
  state_heatmap=lambda state: state.affinity,
)


def _first(opt_state):
  """``opt_state`` of the first of a carry's parts (the inner work's carry)."""
  return lambda carry: opt_state(carry[0])
