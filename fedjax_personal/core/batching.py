"""Local batches drawn inside the compiled round.

Each client draws its own batches from its own padded examples with its own
PRNG key. The result is a fixed-shape array of example indices [S, B] and a
mask [S, B]; padded steps (a small client has fewer real steps than the
largest one) are all-false rows and are skipped by the training loop.
"""

import dataclasses
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

__all__ = [
  'batch_indices',
  'Batching',
  'epoch_examples',
  'row_groups',
  'StepBatches',
  'traced_num_steps',
]


@dataclasses.dataclass(frozen=True)
class Batching:
  """How a client walks through its local data in one round.

  Exactly one of ``num_epochs`` and ``num_steps`` is set.

  Attributes:
    batch_size: examples per step; ``None`` means the full local data set
      (full-batch gradient steps, as in FedSGD).
    num_epochs: E shuffled passes over each client's own examples; client i
      then takes E * ceil(n_i / B) steps (the last batch of an epoch may be
      partial), so clients of different sizes get their own number of steps.
    num_steps: K steps for every client, each on B examples drawn without
      replacement (all of them when n_i < B).
    drop_last: with ``num_epochs``, each epoch's last partial batch is
      dropped: client i takes E * floor(n_i / B) steps, none when n_i < B
      (PyTorch's ``DataLoader(drop_last=True)``, PFLlib's training loader).
  """

  batch_size: Optional[int] = 32
  num_epochs: Optional[int] = 1
  num_steps: Optional[int] = None
  drop_last: bool = False

  def __post_init__(self):
    if (self.num_epochs is None) == (self.num_steps is None):
      raise ValueError('Batching: set exactly one of num_epochs and num_steps')
    if self.batch_size is not None and self.batch_size <= 0:
      raise ValueError(
        f'Batching: batch_size must be positive, got {self.batch_size}'
      )
    if self.num_epochs is not None and self.num_epochs < 0:
      raise ValueError(
        f'Batching: num_epochs must be >= 0, got {self.num_epochs}'
      )
    if self.num_steps is not None and self.num_steps < 0:
      raise ValueError(
        f'Batching: num_steps must be >= 0, got {self.num_steps}'
      )
    if self.drop_last and (self.num_steps is not None or not self.batch_size):
      raise ValueError(
        "Batching: drop_last drops an epoch's partial batch; it needs "
        'num_epochs and a batch_size'
      )

  def effective_batch_size(self, max_examples: int) -> int:
    b = (
      max_examples
      if self.batch_size is None
      else min(self.batch_size, max_examples)
    )
    return max(b, 1)

  @property
  def epochs(self) -> int:
    """E, where the batching counts epochs (``num_steps`` is None)."""
    if self.num_epochs is None:
      raise ValueError('Batching: counts steps (num_steps), not epochs')
    return self.num_epochs

  @property
  def steps(self) -> int:
    """S, where the batching counts steps (``num_epochs`` is None)."""
    if self.num_steps is None:
      raise ValueError('Batching: counts epochs (num_epochs), not steps')
    return self.num_steps

  @property
  def full_batch(self) -> int:
    """B of a batching that drops the partial batch (it has a batch size)."""
    if self.batch_size is None:
      raise ValueError('Batching: drop_last needs a batch_size')
    return self.batch_size

  def num_padded_steps(self, max_examples: int) -> int:
    """S, the static number of steps (the largest client's)."""
    b = self.effective_batch_size(max_examples)
    if self.num_steps is not None:
      return self.num_steps
    if self.drop_last:
      return self.epochs * (max_examples // self.full_batch)
    return self.epochs * math.ceil(max_examples / b) if max_examples else 0

  def num_steps_for(self, num_examples: int, max_examples: int) -> int:
    """The number of real steps of a client with ``num_examples`` examples."""
    if num_examples == 0:
      return 0
    b = self.effective_batch_size(max_examples)
    if self.num_steps is not None:
      return self.num_steps
    if self.drop_last:
      return self.epochs * (num_examples // self.full_batch)
    return self.epochs * math.ceil(num_examples / b)


def _shuffled(key, num_examples, max_examples, groups=None):
  """A random order of the first num_examples positions, padding last.

  Position j's sort key depends only on (key, j), not on the padded length,
  so a client gets the same batches however much it is padded. With
  ``groups`` (int [max_examples], a group id per position, ascending), the
  groups are shuffled and each keeps its positions together, in order:
  position j's key is its group's (``fold_in(key, group)``).
  """
  pos = jnp.arange(max_examples)
  ids = pos if groups is None else groups
  u = jax.vmap(lambda j: jax.random.uniform(jax.random.fold_in(key, j)))(ids)
  u = jnp.where(pos < num_examples, u, 2.0)
  if groups is None:
    return jnp.argsort(u)
  return jnp.lexsort((pos, u))  # by the group's key, then in order within it


def row_groups(x, start_id: int):
  """The group of each row of one client's token rows: a row whose first
  input is ``start_id`` starts a new group (TFF's Shakespeare rows: each
  snippet's first row starts with BOS).

  Args:
    x: int [rows, seq_len] a client's (padded) input rows.
    start_id: the id that starts a group.

  Returns:
    int32 [rows], ascending group ids.
  """
  return jnp.cumsum((x[:, 0] == start_id).astype(jnp.int32))


class StepBatches(NamedTuple):
  """Every local step's batch of one client.

  Attributes:
    idx: int32 [S, B] (or [S, k, B]), indices into the client's examples.
    mask: bool, the same shape, marking real examples. The client's real
      steps come first; a padded step's mask row is all false.
  """

  idx: jax.Array
  mask: jax.Array


def batch_indices(
  key: jax.Array,
  num_examples: jax.Array,
  max_examples: int,
  batching: Batching,
  groups=None,
) -> StepBatches:
  """Example indices and masks of every local step of one client.

  Args:
    key: the client's PRNG key for this round.
    num_examples: scalar int, the client's real example count n_i.
    max_examples: static padded length.
    batching: the Batching configuration.
    groups: int [max_examples] a group per example (``row_groups``): each
      epoch shuffles the groups, a group's examples staying together in
      order (TFF's shuffle of Shakespeare snippets before they are cut into
      rows); None: the examples one by one.

  Returns:
    The ``StepBatches`` ([S, B]; the client's real steps,
    ``batching.num_steps_for(n_i)``, first).
  """
  b = batching.effective_batch_size(max_examples)
  if batching.num_steps is not None:
    keys = jax.random.split(key, batching.num_steps)
    idx = jax.vmap(
      lambda k: _shuffled(k, num_examples, max_examples, groups)[:b]
    )(keys)
    mask = jnp.broadcast_to(jnp.arange(b) < num_examples, idx.shape)
    return StepBatches(idx.astype(jnp.int32), mask)
  nb = math.ceil(max_examples / b) if max_examples else 0
  if batching.drop_last:
    nb = max_examples // b if b == batching.batch_size else 0
  num_steps = batching.epochs * nb
  keys = jax.random.split(key, max(batching.epochs, 1))
  perms = jax.vmap(lambda k: _shuffled(k, num_examples, max_examples, groups))(
    keys
  )
  perms = jnp.pad(perms, ((0, 0), (0, max(nb * b - max_examples, 0))))
  # The client's own batches per epoch, ceil(n_i / B) (floor with
  # drop_last), laid out epoch after epoch so that its real steps are a
  # prefix; the rest is padding.
  if batching.drop_last:
    full = num_examples // b
  else:
    full = (num_examples + b - 1) // b * (num_examples > 0)
  nb_i = jnp.maximum(full, 1)
  s = jnp.arange(num_steps)
  epoch = jnp.minimum(s // nb_i, max(batching.epochs - 1, 0))
  pos = (s % nb_i)[:, None] * b + jnp.arange(b)[None, :]
  idx = perms[epoch[:, None], pos]
  real_step = s < batching.epochs * full
  mask = real_step[:, None] & (pos < num_examples)
  return StepBatches(idx.astype(jnp.int32), mask)


def traced_num_steps(batching: Batching, num_examples, max_examples: int):
  """``num_steps_for`` on a traced example count (inside a compiled round).

  Args:
    batching: the ``Batching``.
    num_examples: a client's examples (traced int).
    max_examples: the padded length.

  Returns:
    The client's local steps (traced int32).
  """
  if batching.num_steps is not None:
    return jnp.where(num_examples > 0, batching.num_steps, 0)
  if batching.drop_last:
    return batching.epochs * (num_examples // batching.full_batch)
  b = batching.effective_batch_size(max_examples)
  return batching.epochs * ((num_examples + b - 1) // b)


def epoch_examples(
  key, num_examples, max_examples: int, batch_size: int, drop_last: bool
):
  """The examples one shuffled epoch in batches of ``batch_size`` visits:
  every real one, or with ``drop_last`` those of its full batches (a random
  floor(n / B) * B of them: what PyTorch's shuffled
  ``DataLoader(drop_last=True)`` yields, PFLlib's ``load_train_data``).

  Args:
    key: draws the order.
    num_examples: the client's examples (traced).
    max_examples: the padded length.
    batch_size: B.
    drop_last: whether the partial batch is dropped.

  Returns:
    bool [max_examples].
  """
  idx, mask = batch_indices(
    key,
    num_examples,
    max_examples,
    Batching(batch_size, num_epochs=1, drop_last=drop_last),
  )
  return jnp.zeros(max_examples, bool).at[idx.reshape(-1)].max(mask.reshape(-1))
