"""The run's TensorBoard event files, written without TensorFlow, load in
TensorBoard's own reader: one scalar per metric and evaluated round, equal
to metrics.jsonl's, each algorithm (and a sweep's configuration) a run of
its own; a resumed run's rounds appear once."""

import json

import pytest
from helpers import main_in_one_process

from fedjax_personal.run import tensorboard


def _scalars(folder):
  from tensorboard.backend.event_processing import event_accumulator  # noqa: PLC0415

  acc = event_accumulator.EventAccumulator(
    str(folder), size_guidance={'scalars': 0}
  )
  acc.Reload()
  return {
    tag: [(e.step, e.value) for e in acc.Scalars(tag)]
    for tag in acc.Tags()['scalars']
  }


def test_the_crc_is_tfrecords():
  # TFRecord's masked CRC-32C of b'' and of 8 zero bytes (a record's empty
  # length).
  assert tensorboard.masked_crc32c(b'') == 0xA282EAD8
  # the CRC-32C check value
  assert tensorboard._crc32c(b'123456789') == 0xE3069283


@pytest.mark.slow
def test_event_files_load_in_tensorboard_with_every_evaluated_round(tmp_path):
  pytest.importorskip('tensorboard')
  out = tmp_path / 'run'
  args = [
    '--algorithm=fedavg,local',
    '--dataset=digits',
    '--num_clients=6',
    '--eval_every=2',
    '--progress=false',
    '--checkpoint_every=1',
    f'--output_dir={out}',
  ]
  results = main_in_one_process(
    [
      [*args, '--rounds=3'],
      [*args, '--rounds=4', '--resume'],
      [
        '--algorithm=fedavg',
        '--dataset=digits',
        '--num_clients=6',
        '--rounds=2',
        '--sweep=client_lr:0.05,0.1',
        '--progress=false',
        f'--output_dir={tmp_path}/sweep',
      ],
    ]
  )
  for code, err in results:
    assert code == 0, err
  for alg in ('fedavg', 'local'):
    got = _scalars(out / 'tensorboard' / alg)
    lines = [json.loads(l) for l in open(out / alg / 'metrics.jsonl')]
    evaluated = [r for r in lines if 'accuracy_mean' in r]
    # each once
    assert [s for s, _ in got['accuracy_mean']] == [
      r['round'] for r in evaluated
    ]
    for (step, value), r in zip(got['accuracy_mean'], evaluated):
      assert value == pytest.approx(r['accuracy_mean'], rel=1e-6), step
    assert 'loss_weighted' in got and 'per_client_accuracy' not in got
  runs = sorted(
    p.name for p in (tmp_path / 'sweep' / 'tensorboard' / 'fedavg').iterdir()
  )
  assert runs == ['seed=0_client_lr=0.05', 'seed=0_client_lr=0.1'], runs
  for run in runs:
    assert _scalars(tmp_path / 'sweep' / 'tensorboard' / 'fedavg' / run)[
      'accuracy_mean'
    ]
