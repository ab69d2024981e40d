import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_personal.core.batching import (
  Batching,
  batch_indices,
  traced_num_steps,
)


@pytest.mark.parametrize('n', [0, 1, 5, 8, 13])
@pytest.mark.parametrize(
  'batching',
  [
    Batching(4, num_epochs=2),
    Batching(4, num_epochs=1),
    Batching(4, num_epochs=None, num_steps=3),
    Batching(None, num_epochs=None, num_steps=1),
    Batching(4, num_epochs=2, drop_last=True),
    Batching(16, num_epochs=1, drop_last=True),
  ],
)
def test_batches_cover_epochs_and_real_steps_come_first(n, batching):
  max_n = 13
  idx, mask = batch_indices(jax.random.key(0), jnp.int32(n), max_n, batching)
  idx, mask = np.asarray(idx), np.asarray(mask)
  assert (
    idx.shape
    == mask.shape
    == (batching.num_padded_steps(max_n), batching.effective_batch_size(max_n))
  )
  real = mask.any(axis=1)
  k = batching.num_steps_for(n, max_n)
  assert real.sum() == k and real[:k].all()  # a prefix
  assert np.all(idx[mask] < n)
  if batching.drop_last and n:
    # Each epoch visits floor(n / B) * B distinct real examples, in full
    # batches (PyTorch's DataLoader(drop_last=True)).
    b = batching.batch_size
    assert k == batching.num_epochs * (n // b) and mask[:k].all()
    per_epoch = n // b
    for e in range(batching.num_epochs):
      seen = idx[e * per_epoch : (e + 1) * per_epoch].ravel()
      assert len(set(seen)) == per_epoch * b
  elif batching.num_epochs is not None and n:
    # Each epoch visits every real example exactly once.
    per_epoch = k // batching.num_epochs
    for e in range(batching.num_epochs):
      seen = idx[e * per_epoch : (e + 1) * per_epoch][
        mask[e * per_epoch : (e + 1) * per_epoch]
      ]
      assert sorted(seen) == list(range(n))
  if batching.num_steps is not None and n:
    for s in range(k):  # without replacement within a batch
      assert (
        len(set(idx[s][mask[s]]))
        == mask[s].sum()
        == min(n, batching.effective_batch_size(max_n))
      )


def test_batches_do_not_depend_on_padding():
  b = Batching(4, num_epochs=2)
  a_idx, a_mask = batch_indices(jax.random.key(3), jnp.int32(5), 5, b)
  p_idx, p_mask = batch_indices(jax.random.key(3), jnp.int32(5), 40, b)
  k = b.num_steps_for(5, 5)
  np.testing.assert_array_equal(
    np.asarray(a_idx)[:k][np.asarray(a_mask)[:k]],
    np.asarray(p_idx)[:k][np.asarray(p_mask)[:k]],
  )


def test_epochs_give_each_client_its_own_number_of_steps():
  b = Batching(10, num_epochs=3)
  assert b.num_steps_for(25, 100) == 9 and b.num_steps_for(100, 100) == 30
  assert b.num_steps_for(0, 100) == 0
  assert Batching(10, num_epochs=None, num_steps=7).num_steps_for(3, 100) == 7
  dropped = Batching(10, num_epochs=3, drop_last=True)
  assert dropped.num_steps_for(25, 100) == 6
  assert dropped.num_steps_for(9, 100) == 0  # fewer than B: no step


def test_traced_steps_equal_the_static_count():
  for b in (
    Batching(4, num_epochs=2),
    Batching(4, num_epochs=2, drop_last=True),
  ):
    counts = jnp.arange(14)
    got = np.asarray(traced_num_steps(b, counts, 13))
    want = [b.num_steps_for(int(n), 13) for n in counts]
    np.testing.assert_array_equal(got, want)


def test_bad_batching_is_rejected():
  with pytest.raises(ValueError, match='exactly one'):
    Batching(4, num_epochs=1, num_steps=2)
  with pytest.raises(ValueError, match='batch_size'):
    Batching(0, num_epochs=1)
  with pytest.raises(ValueError, match='drop_last'):
    Batching(4, num_epochs=None, num_steps=2, drop_last=True)


def test_row_groups_are_shuffled_whole_and_in_order():
  """TFF's Shakespeare shuffle: snippets (groups of rows, the first starting
  with BOS) shuffled, a snippet's rows together and in order, every epoch
  its own order; padding changes nothing."""
  from fedjax_personal.core.batching import row_groups

  bos = 88
  x = np.array(
    [[bos, 1], [5, 6], [bos, 2], [bos, 3], [7, 8], [9, 9], [bos, 4]], np.int32
  )
  groups = row_groups(jnp.asarray(x), bos)
  np.testing.assert_array_equal(groups, [1, 1, 2, 3, 3, 3, 4])
  b = Batching(batch_size=2, num_epochs=3)
  orders = set()
  for seed in range(6):
    idx, mask = batch_indices(jax.random.key(seed), jnp.int32(7), 7, b, groups)
    flat = np.asarray(idx)[np.asarray(mask)]
    for epoch in flat.reshape(3, 7):
      assert sorted(epoch) == list(range(7))
      runs = [
        list(g)
        for g in np.split(
          epoch, np.flatnonzero(np.diff(np.asarray(groups)[epoch])) + 1
        )
      ]
      # whole, in order
      assert all(r == list(range(r[0], r[0] + len(r))) for r in runs)
      orders.add(tuple(epoch))
    padded_x = np.concatenate([x, np.zeros((5, 2), np.int32)])
    idx2, mask2 = batch_indices(
      jax.random.key(seed),
      jnp.int32(7),
      12,
      b,
      row_groups(jnp.asarray(padded_x), bos),
    )
    np.testing.assert_array_equal(np.asarray(idx2)[np.asarray(mask2)], flat)
  assert len(orders) > 3
