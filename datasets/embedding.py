"""Semantic features for latent-distribution partitions.

FedFomo (Zhang et al., 2021, appendix A.5) builds its latent distributions
by k-means on semantic embeddings: a VGG-11 trained on the data set to at
least 85% accuracy, the 4,096-d second fully connected layer, PCA to 256
dimensions. Raw pixels cluster by colour and brightness instead, and their
clusters hold every class in similar shares (on CIFAR-10, 5 clusters: label
skew 0.41 against 1.55 for 2 classes per client,
benchmarks/reproductions/README.md), the near-IID regime where the paper itself
expects averaging to be hard to beat.

``semantic_features`` is the same recipe with a network this machine trains
in a minute: LeNet-5 (images) or the MLP (small images, other inputs) trained
centrally on the pool with SGD and momentum, its penultimate layer (84-d for
LeNet-5, no PCA needed), standardized. Deterministic given the seed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_personal import numerics
from fedjax_personal.models import create_model

__all__ = ['semantic_features']


def semantic_features(
  x: np.ndarray,
  y: np.ndarray,
  num_classes: int,
  seed: int,
  epochs: int = 10,
  batch_size: int = 64,
  learning_rate: float = 0.01,
) -> np.ndarray:
  """Penultimate features [n, d] of a classifier trained centrally on (x, y).

  Args:
    x: the pool's inputs [n, ...] (images [n, h, w, c] of at least 28 x 28
      get LeNet-5, other inputs the MLP (200, 200)).
    y: integer labels [n].
    num_classes: output classes.
    seed: initialization and batch order derive from it.
    epochs, batch_size, learning_rate: central training (SGD, momentum 0.9).

  Returns:
    float32 [n, d], each column standardized to mean 0 and unit variance.
  """
  # LeNet-5 needs images of at least 28 x 28 (two 5 x 5 convolutions and pools).
  big_image = x.ndim == 4 and min(x.shape[1:3]) >= 28
  # At the engine's default precision: the partition is the same on every card.
  model = create_model(
    'lenet5' if big_image else 'mlp', num_classes, x[:1]
  ).at_matmul_precision(numerics.DEFAULT_MATMUL_PRECISION)
  key_init, key_order = jax.random.split(jax.random.key(seed))
  params = model.init(key_init)
  opt = optax.sgd(learning_rate, momentum=0.9)
  xs, ys = jnp.asarray(x), jnp.asarray(y, jnp.int32)
  batch_size = min(batch_size, len(y))
  steps = len(y) // batch_size

  def loss(p, xb, yb):
    return optax.softmax_cross_entropy_with_integer_labels(
      model.apply(p, xb), yb
    ).mean()

  @jax.jit
  def epoch(carry, key):
    order = jax.random.permutation(key, len(ys))[: steps * batch_size].reshape(
      steps, batch_size
    )

    def step(c, idx):
      p, s = c
      g = jax.grad(loss)(p, xs[idx], ys[idx])
      u, s = opt.update(g, s, p)
      return (optax.apply_updates(p, u), s), None

    return jax.lax.scan(step, carry, order)[0]

  carry = (params, opt.init(params))
  for k in jax.random.split(key_order, epochs):
    carry = epoch(carry, k)
  params = carry[0]
  features = jax.jit(model.features)
  f = np.concatenate(
    [
      np.asarray(features(params, xs[i : i + 1000]))
      for i in range(0, len(ys), 1000)
    ]
  ).astype(np.float32)
  return (f - f.mean(0)) / np.maximum(f.std(0), 1e-6)
