"""Reddi et al.'s CIFAR-100 input pipeline (``models/inputs.py``) against
what google-research/federated's ``cifar100_dataset.py`` asks of TensorFlow
(``tf.image.random_crop``, ``random_flip_left_right``,
``resize_with_crop_or_pad``, ``per_image_standardization``, as TF documents
them), and the CLI feeding it to training and evaluation."""

import json
import os

import jax
import jax.numpy as jnp
import made_files
import numpy as np
import pytest
from helpers import parse_flags

from fedjax_personal.core.training import Batch, batch_loss
from fedjax_personal.models import create_model, inputs


def _standardized(img):
  """TF's per_image_standardization, written from its documentation."""
  img = np.asarray(img, np.float64)
  adjusted = max(img.std(), 1.0 / np.sqrt(img.size))
  return (img - img.mean()) / adjusted


def test_standardization_and_centre_crop_as_tensorflow_documents_them():
  rng = np.random.default_rng(0)
  x = rng.integers(0, 256, (3, 32, 32, 3)).astype(np.uint8)
  x[2] = 7  # a constant image: its stddev 0, divided by 1 / sqrt(N) instead
  got = np.asarray(inputs.per_image_standardization(jnp.asarray(x)))
  for i in range(3):
    np.testing.assert_allclose(
      got[i], _standardized(x[i]), rtol=1e-4, atol=1e-5
    )
  assert not got[2].any()
  # (32 - 24) // 2 on each side
  np.testing.assert_array_equal(
    np.asarray(inputs.centre_crop(jnp.asarray(x), 24, 24)), x[:, 4:28, 4:28]
  )
  t = inputs.reddi_cifar100()
  want = np.stack([_standardized(x[i, 4:28, 4:28]) for i in range(3)])
  np.testing.assert_allclose(
    np.asarray(t.evaluate(jnp.asarray(x))), want, rtol=1e-4, atol=1e-5
  )


def test_random_crops_are_one_window_per_batch_and_flips_per_image():
  """As google-research/federated's ``preprocess_cifar_example`` on a batch
  (``tf.image.random_crop`` of [B, 32, 32, 3] to [B, 24, 24, 3]: one offset
  per dimension, so one window for the batch; ``random_flip_left_right``:
  each image on its own): every window and both flips reached, from the key."""
  x = jnp.asarray(
    np.arange(3 * 32 * 32 * 3, dtype=np.float32).reshape(3, 32, 32, 3)
  )
  seen, flips = set(), set()
  for seed in range(80):
    out = np.asarray(inputs.random_crop_flip(jax.random.key(seed), x, 24, 24))
    windows = set()
    for i in range(3):
      img = np.asarray(x[i])
      match = [
        (t, l, f)
        for t in range(9)
        for l in range(9)
        for f in (False, True)
        if np.array_equal(
          out[i],
          (
            img[t : t + 24, l : l + 24][:, ::-1]
            if f
            else img[t : t + 24, l : l + 24]
          ),
        )
      ]
      assert len(match) == 1, (seed, i)
      windows.add(match[0][:2])
      flips.add(match[0][2])
    assert len(windows) == 1  # one window for the batch
    seen |= windows
  assert {t for t, _ in seen} == set(range(9)) and {l for _, l in seen} == set(
    range(9)
  )
  assert flips == {False, True}
  a = inputs.random_crop_flip(jax.random.key(1), x, 24, 24)
  b = inputs.random_crop_flip(jax.random.key(1), x, 24, 24)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the key decides


def test_training_batches_see_the_random_half_and_everything_else_the_centre():
  t = inputs.reddi_cifar100()
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.integers(0, 256, (4, 32, 32, 3)).astype(np.uint8))
  y = jnp.asarray(rng.integers(0, 100, 4).astype(np.int32))
  base = create_model('mlp', 100, t.evaluate(x[:1]))
  model = inputs.with_inputs(base, t)
  params = model.init(jax.random.key(0))
  np.testing.assert_allclose(
    np.asarray(model.apply(params, x)),
    np.asarray(base.apply(params, t.evaluate(x))),
    rtol=1e-6,
  )
  mask = jnp.ones(4, bool)
  plain, _ = batch_loss(model, params, Batch(x, y, mask))
  centre, _ = batch_loss(base, params, Batch(t.evaluate(x), y, mask))
  assert np.isclose(plain, centre)  # no key: the evaluation half
  drawn, _ = batch_loss(model, params, Batch(x, y, mask, jax.random.key(3)))
  want, _ = batch_loss(
    base, params, Batch(t.train(jax.random.key(3), x), y, mask)
  )
  assert np.isclose(drawn, want) and not np.isclose(drawn, plain)


@pytest.mark.slow
def test_cli_records_the_pipeline_and_refuses_it_elsewhere(
  tmp_path, made_not_released, capsys
):
  from fedjax_personal.run import experiment_entry

  rng = np.random.default_rng(2)
  made_files.write_tff_cifar100(tmp_path / 'raw.sqlite', rng, [5, 4, 6], [3])
  made_files.lzma_file(
    tmp_path / 'raw.sqlite', tmp_path / 'cifar100.sqlite.lzma'
  )
  common = [
    '--algorithm=fedavg',
    '--dataset=cifar100',
    '--model=logreg',
    '--rounds=1',
    '--cohort_size=2',
    f'--data_dir={tmp_path}',
    '--progress=false',
    '--batch_size=4',
    '--cifar100_test=tff_clients',
  ]
  parse_flags(
    *common, '--cifar100_preprocess=reddi', f'--output_dir={tmp_path}/reddi'
  )
  (summary,) = experiment_entry.main_job().values()
  assert (
    'inputs: reddi, a random 24x24 crop of each training batch'
    in capsys.readouterr().out
  )
  assert np.isfinite(summary['loss_weighted'])
  written = json.load(
    open(os.path.join(tmp_path, 'reddi', 'fedavg', 'summary.json'))
  )
  assert (
    written['identity']['data']['options']['cifar100_preprocess'] == 'reddi'
  )
  parse_flags(*common, f'--output_dir={tmp_path}/plain')
  (plain,) = experiment_entry.main_job().values()
  assert plain['loss_weighted'] != summary['loss_weighted']
  written = json.load(
    open(os.path.join(tmp_path, 'plain', 'fedavg', 'summary.json'))
  )
  assert written['identity']['data']['options']['cifar100_preprocess'] == 'none'
  parse_flags('--dataset=digits', '--cifar100_preprocess=reddi', '--dry_run')
  with pytest.raises(experiment_entry.ConfigError, match='cifar100_preprocess'):
    experiment_entry.main_job()
