"""A data set's input pipeline as its paper's code has it, inside the round.

Reddi et al. ("Adaptive Federated Optimization", arXiv 2003.00295) train
CIFAR-100 on distorted images: google-research/federated's
``utils/datasets/cifar100_dataset.py`` casts each image to float32, takes a
random 24x24 crop of each training batch (one window for the batch: its map
follows ``.batch``) and a random left-right flip of each image (drawn again
each time: the map follows the repeat),
the central 24x24 crop of each test image
(``tf.image.resize_with_crop_or_pad``), then
``tf.image.per_image_standardization`` on both. ``InputTransform`` holds the
two halves: ``train(key, x)`` for a training batch (its draws from the
step's key, so a run is reproducible: client, round and step each draw
their own; a step of several batches, Per-FedAvg's three or MAML's support
and query, draws for each: ``training.part``) and ``evaluate(x)`` for
everything else (evaluation, and batches an algorithm forms itself from a
client's whole data: pFedDyn's prototypes, user-centric's gradients). The model
sees only transformed inputs (``with_inputs``).
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

__all__ = [
  'InputTransform',
  'per_image_standardization',
  'centre_crop',
  'random_crop_flip',
  'reddi_cifar100',
  'TRANSFORMS',
  'with_inputs',
]


@dataclasses.dataclass(frozen=True)
class InputTransform:
  """A training and an evaluation input pipeline.

  Attributes:
    name: its name (the flag's value).
    train: ``(key, x [B, ...]) -> x'``, a training batch's inputs.
    evaluate: ``x [B, ...] -> x'``, every other batch's.
    description: what it does, in words (the header).
  """

  name: str
  train: Callable
  evaluate: Callable
  description: str = ''


def per_image_standardization(x):
  """``tf.image.per_image_standardization``: each image [H, W, C] less its
  mean, over ``max(stddev, 1 / sqrt(H * W * C))``.

  Args:
    x: [B, H, W, C] images (any dtype; computed in float32).

  Returns:
    [B, H, W, C] float32.
  """
  x = x.astype(jnp.float32)
  axes = tuple(range(1, x.ndim))
  n = 1
  for a in axes:
    n *= x.shape[a]
  mean = jnp.mean(x, axis=axes, keepdims=True)
  std = jnp.sqrt(jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True))
  return (x - mean) / jnp.maximum(std, 1.0 / jnp.sqrt(float(n)))


def centre_crop(x, height: int, width: int):
  """``tf.image.resize_with_crop_or_pad`` to a smaller size: the central
  ``height`` x ``width`` window (offsets ``(H - height) // 2``, ``(W -
  width) // 2``) of [B, H, W, C] images.

  Args:
    x: images [B, H, W, C].
    height: the crop's height.
    width: the crop's width.

  Returns:
    The crops.
  """
  top, left = (x.shape[1] - height) // 2, (x.shape[2] - width) // 2
  return x[:, top : top + height, left : left + width]


def random_crop_flip(key, x, height: int, width: int):
  """``tf.image.random_crop`` then ``tf.image.random_flip_left_right`` of a
  batch [B, H, W, C], as google-research/federated applies them (to the
  batch, after ``.batch``): one window for the whole batch, at offsets drawn
  uniformly in ``[0, H - height]`` x ``[0, W - width]`` (``random_crop`` of
  a 4-D tensor draws one offset per dimension), then each image mirrored
  left-right with probability 1/2 on its own.

  Args:
    key: draws the batch's crop and each image's flip.
    x: images [B, H, W, C].
    height: the crop's height.
    width: the crop's width.

  Returns:
    The crops.
  """
  k_top, k_left, k_flip = jax.random.split(key, 3)
  top = jax.random.randint(k_top, (), 0, x.shape[1] - height + 1)
  left = jax.random.randint(k_left, (), 0, x.shape[2] - width + 1)
  out = jax.lax.dynamic_slice(
    x, (0, top, left, 0), (x.shape[0], height, width, x.shape[3])
  )
  flip = jax.random.bernoulli(k_flip, shape=(x.shape[0],))
  return jnp.where(flip[:, None, None, None], out[:, :, ::-1], out)


def reddi_cifar100(crop: int = 24) -> InputTransform:
  """Reddi et al.'s CIFAR-100 pipeline (module doc), ``crop`` x ``crop``.

  Args:
    crop: the crop's side (24).

  Returns:
    The ``InputTransform``.
  """
  return InputTransform(
    name='reddi',
    train=lambda key, x: per_image_standardization(
      random_crop_flip(key, x.astype(jnp.float32), crop, crop)
    ),
    evaluate=lambda x: per_image_standardization(
      centre_crop(x.astype(jnp.float32), crop, crop)
    ),
    description=f'a random {crop}x{crop} crop of each training batch and left-right flips of '
    f'its images, the '
    f'central {crop}x{crop} of the others, each standardized '
    "(tf.image.per_image_standardization): Reddi et al.'s CIFAR-100 task",
  )


#: ``--cifar100_preprocess`` name -> its transform (``none``: the images as
#: the file holds them, scaled to [0, 1] by the model).
TRANSFORMS = {'reddi': reddi_cifar100}


#: ``fold_in`` tag of the key a stochastic model's training pass draws from
#: (its dropout), apart from the input transform's draws.
MODEL_DRAWS = 1


def with_inputs(model, transform: InputTransform):
  """``model`` seeing ``transform``'s inputs: ``apply`` (and ``features``)
  through ``transform.evaluate``, ``train_apply(params, x, key)`` through
  ``transform.train`` (``core.training.batch_loss`` calls it for the
  batches of a client's local steps). Build ``model`` on a transformed
  sample (``transform.evaluate(sample_x)``).

  Args:
    model: the model.
    transform: an ``InputTransform``.

  Returns:
    The wrapped ``Model``.
  """
  inner, inner_train, inner_state = (
    model.apply,
    model.train_apply,
    model.train_state,
  )

  def train_apply(params, x, key):
    x = transform.train(key, x)
    if inner_train is None:
      return inner(params, x)
    return inner_train(params, x, jax.random.fold_in(key, MODEL_DRAWS))

  def train_state(params, x, key, mask):
    return inner_state(
      params,
      transform.train(key, x),
      jax.random.fold_in(key, MODEL_DRAWS),
      mask,
    )

  return dataclasses.replace(
    model,
    apply=lambda params, x: inner(params, transform.evaluate(x)),
    train_apply=train_apply,
    train_state=None if inner_state is None else train_state,
    inputs=transform,
  )
