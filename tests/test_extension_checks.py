"""Extension points check what they are given: a reader, a model builder or
an ``AlgorithmSpec`` naming what it is never given is refused at
registration (exit 2 from the command with ``--import``); ``--dry_run``
traces every requested round, so a broken one fails before anything
trains; a user's round raising while the others train ends in one line
naming the file, the line and the algorithm, the others' results written;
``fedavg.variant``'s callbacks receive what its docstring says."""

import dataclasses
import json

import pytest
from helpers import main_in_one_process

from fedjax_personal import algorithms
from fedjax_personal.datasets import registry

VARIANTS = """
import jax.numpy as jnp
import optax

from fedjax_personal import algorithms
from fedjax_personal.algorithms import fedavg
from fedjax_personal.config import AlgorithmSpec, NoConfig


def with_loss(training, config, model, data):
  # each client also uploads its mean training loss; weighs by its delta's norm
  loss = lambda ctx, out: out.stats.loss_sum / jnp.maximum(out.stats.count, 1.0)
  weight = lambda ctx, out: out.num_examples * (1.0 + 0.0 * optax.global_norm(out.delta))
  server = lambda mean_delta, mean_loss, state: mean_delta
  return fedavg.variant(model, data, training, weight=weight, extra=loss, server=server,
                        name='fedavg_loss')


def broken(training, config, model, data):
  server = lambda mean_delta, mean_extra, state: mean_delta['no_such_layer']
  return fedavg.variant(model, data, training, server=server, name='fedavg_broken')


algorithms.register(AlgorithmSpec('fedavg_loss', NoConfig, with_loss, fedavg.FEDAVG_SETTINGS))
algorithms.register(AlgorithmSpec('fedavg_broken', NoConfig, broken, fedavg.FEDAVG_SETTINGS))
"""

COMMON = [
  '--import=variants.py',
  '--dataset=digits',
  '--model=logreg',
  '--num_clients=6',
  '--rounds=2',
  '--eval_every=1',
  '--progress=false',
]


@pytest.mark.slow
def test_variant_uploads_its_loss_and_broken_rounds_are_one_line(tmp_path):
  (tmp_path / 'variants.py').write_text(VARIANTS)
  out = tmp_path / 'out'
  results = main_in_one_process(
    [
      [*COMMON, '--algorithm=fedavg,fedavg_loss', f'--output_dir={out}/ok'],
      [
        *COMMON,
        '--algorithm=fedavg,fedavg_broken',
        '--dry_run',
        f'--output_dir={out}/dry',
      ],
      [
        *COMMON,
        '--algorithm=fedavg,fedavg_broken,local',
        f'--output_dir={out}/run',
      ],
    ],
    cwd=str(tmp_path),
  )
  (c0, e0), (c1, e1), (c2, e2) = results
  assert c0 == 0, e0
  fedavg = [
    json.loads(l) for l in open(out / 'ok' / 'fedavg' / 'metrics.jsonl')
  ]
  loss = [
    json.loads(l) for l in open(out / 'ok' / 'fedavg_loss' / 'metrics.jsonl')
  ]
  # its weight is n_i
  assert loss[-1]['accuracy_mean'] == fedavg[-1]['accuracy_mean']
  # + one float32 a client
  assert loss[0]['bytes_up'] == fedavg[0]['bytes_up'] + 6 * 4
  for code, err in ((c1, e1), (c2, e2)):
    lines = [l for l in err.splitlines() if l.startswith('error:')]
    assert code == 2 and 'Traceback' not in err and len(lines) == 1, err
    assert 'fedavg_broken failed' in lines[0] and 'variants.py:' in lines[0], (
      lines
    )
    assert "KeyError: 'no_such_layer'" in lines[0], lines
  assert 'when its round is traced' in e1
  assert not (out / 'dry').exists()
  # the one after it ran
  summary = json.load(open(out / 'run' / 'local' / 'summary.json'))
  assert summary['algorithm'] == 'local'
  assert (out / 'run' / 'fedavg' / 'summary.json').exists()


TYPO_READER = """
import dataclasses
import numpy as np
from fedjax_personal.datasets import registry
from fedjax_personal.datasets.options import DataOptions
from fedjax_personal.hparams import hparam


@dataclasses.dataclass(frozen=True)
class ContrastOptions(DataOptions):
  contrast: float = hparam(1.0, 'Contrast.')


def read_clients(num_clients=None, data_dir=None, download=False, contrst=1.0):
  raise AssertionError('never read')


registry.register('contrasted', read_clients, options=ContrastOptions)
"""


def test_a_misspelled_reader_option_is_refused_when_imported(
  tmp_path, monkeypatch
):
  (tmp_path / 'typo.py').write_text(TYPO_READER)
  [(code, err)] = main_in_one_process(
    [['--import=typo.py', '--dataset=contrasted']], cwd=str(tmp_path)
  )
  lines = [l for l in err.splitlines() if l.startswith('error:')]
  assert code == 2 and len(lines) == 1 and 'Traceback' not in err, err
  assert (
    "'contrst'" in lines[0] and 'contrast' in lines[0] and 'typo.py' in lines[0]
  ), lines
  monkeypatch.setattr(registry, 'LOADERS', dict(registry.LOADERS))
  with pytest.raises(TypeError, match="takes 'contrst'"):
    registry.register('contrasted', lambda num_clients=None, contrst=1.0: None)


def test_a_spec_naming_a_setting_that_does_not_exist_is_refused():
  spec = algorithms.spec('fedavg')
  with pytest.raises(ValueError, match=r"uses names \['client_lrr'\]"):
    dataclasses.replace(spec, name='typo', uses=frozenset({'client_lrr'}))
  with pytest.raises(ValueError, match=r"ignores names \['mue'\]"):
    dataclasses.replace(spec, name='typo', ignores=frozenset({'mue'}))


def test_a_complete_algorithms_bytes_are_counted_from_what_its_clients_upload():
  """Without a ``communication`` of its own, a round's bytes are what it
  moved: FedAvg's counts, and an extra field a client uploads on top."""
  import jax
  import optax
  from flax import struct
  from helpers import digits_data

  import fedjax_personal as fp
  from fedjax_personal.algorithms.fedavg import fedavg
  from fedjax_personal.core.engine import RoundRunner

  @struct.dataclass
  class WithLoss:
    delta: object
    num_examples: object
    stats: object
    loss: object

  data = digits_data(num_clients=4)
  model = fp.models.from_flax(
    'mlp', fp.models.MLP(data.num_classes, hidden=(8,)), data.train.x[0, :1]
  )
  base = fedavg(
    model, 4, optax.sgd(0.1), fp.Batching(batch_size=16, num_epochs=1)
  )
  work = base.client_work

  def final(ctx, carry):
    out = work.final(ctx, carry)
    return WithLoss(out.delta, out.num_examples, out.stats, out.stats.loss_sum)

  variants = {
    'own': base,
    'counted': base.replace(communication=None),
    'extra': base.replace(
      communication=None, client_work=dataclasses.replace(work, final=final)
    ),
  }
  metrics = {}
  for name, alg in variants.items():
    runner = RoundRunner(
      alg, data, fp.CohortSampler(4, cohort_size=4), fp.executors.VmapExecutor()
    )
    _, m = runner.round(runner.init(jax.random.key(0)), jax.random.key(1))
    metrics[name] = {k: float(v) for k, v in m.items() if k.startswith('bytes')}
  assert metrics['counted'] == metrics['own']
  # a float32 each
  assert metrics['extra']['bytes_up'] == metrics['own']['bytes_up'] + 4 * 4
  assert (
    metrics['extra']['bytes_down_broadcast']
    == metrics['own']['bytes_down_broadcast']
  )


TYPO_SPEC = """
from fedjax_personal import algorithms
from fedjax_personal.algorithms import fedavg
from fedjax_personal.config import AlgorithmSpec, NoConfig

algorithms.register(AlgorithmSpec('typo', NoConfig, fedavg.build, frozenset({'client_lrr'})))
"""


def test_a_spec_with_a_misspelled_setting_is_refused_when_imported(tmp_path):
  (tmp_path / 'typo_spec.py').write_text(TYPO_SPEC)
  [(code, err)] = main_in_one_process(
    [['--import=typo_spec.py', '--algorithm=typo']], cwd=str(tmp_path)
  )
  lines = [l for l in err.splitlines() if l.startswith('error:')]
  assert code == 2 and len(lines) == 1 and 'Traceback' not in err, err
  assert "'client_lrr'" in lines[0] and 'client_lr' in lines[0], lines
