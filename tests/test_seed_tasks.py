"""The flagfiles of the seeds' and Reddi et al.'s tasks (``scripts/configs``):
each is accepted as written, builds everything on made files in the
published formats (dry run), and trains a few rounds there (slow)."""

import os

import made_files
import numpy as np
import pytest
from helpers import parse_flags

from fedjax_personal.run import experiment_entry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = [
  'partial_stackoverflow_transformer',
  'partial_emnist_resnet',
  'partial_gldv2_resnet',
  'reddi_emnist_cnn',
  'reddi_shakespeare_lstm',
  'reddi_stackoverflow_lstm',
  'reddi_cifar100_resnet',
]


def write_data(folder, task):
  """Three or four small clients of the task's data set, in its published
  format."""
  rng = np.random.default_rng(0)
  if 'gldv2' in task:  # users need 50 images to be the seed's clients
    made_files.write_gldv2(folder, rng, [50, 52, 51])
  elif 'emnist' in task:
    made_files.write_emnist(folder, rng, [6, 9, 5], [3, 2, 4])
  elif 'shakespeare' in task:
    for split, n in (('train', 3), ('test', 1)):
      made_files.write_fedjax_sqlite(
        folder / f'shakespeare_{split}.sqlite',
        [
          (
            b'ROLE_%d' % i,
            {
              'snippets': made_files.bytes_array(
                [b'To be, or not to be' * (n + i)]
              )
            },
          )
          for i in range(3)
        ],
      )
  elif 'stackoverflow' in task:
    (folder / 'stackoverflow.word_count').write_text(
      ''.join(f'w{i} {10**5 - i}\n' for i in range(10**4))
    )
    for split, n in (('train', 4), ('test', 2)):
      made_files.write_fedjax_sqlite(
        folder / f'stackoverflow_{split}.sqlite',
        [
          (
            b'%05d' % i,
            {
              'tokens': made_files.bytes_array(
                [
                  b' '.join(b'w%d' % w for w in rng.integers(0, 12000, 9))
                  for _ in range(n + i)
                ]
              ),
              'type': made_files.bytes_array([b'question'] * (n + i)),
            },
          )
          for i in range(3)
        ],
      )
  else:
    made_files.write_tff_cifar100(
      folder / 'raw.sqlite', rng, [5, 4, 6], [3, 2, 2]
    )
    made_files.lzma_file(folder / 'raw.sqlite', folder / 'cifar100.sqlite.lzma')


def _job(tmp_path, task, *extra):
  data = tmp_path / 'data'
  data.mkdir(exist_ok=True)
  write_data(data, task)
  parse_flags(
    f'--flagfile={os.path.join(ROOT, "scripts", "configs", task + ".flags")}',
    '--num_clients=3',
    '--cohort_size=2',
    f'--data_dir={data}',
    f'--output_dir={tmp_path / "out"}',
    '--progress=false',
    *extra,
  )
  with pytest.MonkeyPatch.context() as mp:
    from fedjax_personal.datasets import stackoverflow

    # the made test file holds 6 posts
    mp.setattr(stackoverflow, 'VALIDATION_EXAMPLES', 2)
    return experiment_entry.main_job()


@pytest.mark.parametrize('task', TASKS)
@pytest.mark.ci_variants(
  'partial_emnist_resnet',
  'reddi_shakespeare_lstm',
  'reddi_stackoverflow_lstm',
)
def test_task_flagfile_builds_on_made_files(
  tmp_path, task, made_not_released, capsys
):
  assert _job(tmp_path, task, '--dry_run') == {}
  assert 'dry run: 1 algorithm(s) built' in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize('layout', ['device', 'host'])
@pytest.mark.parametrize('task', TASKS)
def test_task_flagfile_trains_on_made_files(
  tmp_path, task, layout, made_not_released
):
  # 224 x 224 trains slowly on a CPU
  small = ['--image_size=32'] if 'gldv2' in task else []
  out = _job(
    tmp_path, task, '--rounds=2', '--eval_every=1', f'--layout={layout}', *small
  )
  (summary,) = out.values()
  assert (
    np.isfinite(summary['loss_weighted']) and 0 <= summary['accuracy_mean'] <= 1
  )
