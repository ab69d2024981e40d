"""The reproduce scripts: their scales resolve to the documented sizes, bad
flags exit 2 naming the flag, one tiny user-centric table is written as JSON and
Markdown (CI); every script end to end with trials and the user-centric study
(slow: a few minutes; python -m pytest -m slow tests/test_reproduce.py)."""

import json
import os
import subprocess
import sys

import helpers
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPTS = {
  'reproduce_user_centric.py': [
    '--rounds=2',
    '--num_clients=4',
    '--examples_per_client=60',
    '--eval_every=1',
  ],
  'reproduce_debiasing.py': [
    '--rounds=2',
    '--personal_rounds=2',
    '--num_clients=4',
    '--personal_eval_every=1',
    '--participation=1',
  ],
  'reproduce_personalization.py': [
    '--mnist_clients=10',
    '--mnist_rounds=2',
    '--shakespeare_clients=2',
    '--shakespeare_rounds=1',
    '--shakespeare_local_steps=1',
    '--cifar_clients=4',
    '--cifar_rounds=2',
    '--methods=fedalt/output,fedsim/output',
  ],
  'reproduce_fedfomo.py': [
    '--datasets=mnist',
    '--rounds_15=1',
    '--rounds_100=2',
    '--eval_every_100=1',
    '--local_epochs=1',
    '--cifar_per_client=60',
    '--methods=fedavg,perfedavg,fedfomo_m5',
    '--dp_sigmas=0,1',
  ],
  'reproduce_fedprox.py': [
    '--rounds=2',
    '--eval_every=1',
    '--num_clients=6',
    '--cohort_size=3',
    '--stragglers=0,0.5',
  ],
}


def script(name, *args, cwd=None, timeout=1200):
  return subprocess.run(
    [sys.executable, os.path.join(ROOT, 'scripts', name), *args],
    cwd=cwd or ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def resolved(name, *args):
  r = script(name, '--dry_run', *args, timeout=120)
  assert r.returncode == 0, r.stderr[-3000:]
  return dict(line.split(': ', 1) for line in r.stdout.strip().splitlines())


@pytest.mark.slow
def test_scales_resolve_to_the_documented_sizes():
  cpu = resolved('reproduce_user_centric.py')
  assert (cpu['scale'], cpu['trials'], cpu['rounds']) == ('cpu', '3', '30')
  assert (
    "dataset='mnist'" in cpu['scenario 2']
    and 'num_clients=20' in cpu['scenario 2']
  )
  # 1,000 CIFAR-10 images per user
  assert 'max_examples=20000' in cpu['scenario 3']
  paper = resolved('reproduce_user_centric.py', '--scale=paper')
  assert (paper['trials'], paper['rounds']) == ('5', '50')
  assert "dataset='tfds:emnist/digits'" in paper['scenario 2']
  assert (
    'num_clients=100' in paper['scenario 2']
    and 'max_examples=100000' in paper['scenario 2']
  )
  assert 'max_examples=10000' in paper['scenario 1']
  # all 60,000: 3,000 per user
  assert 'max_examples=None' in paper['scenario 3']
  # Explicit flags override the scale.
  assert (
    resolved('reproduce_user_centric.py', '--scale=paper', '--rounds=7')[
      'rounds'
    ]
    == '7'
  )
  deb = resolved('reproduce_debiasing.py', '--scale=paper')
  # The seeds' own models and initialisation at paper scale; the stated
  # reduction at cpu.
  assert (
    deb['num_clients'],
    deb['participation'],
    deb['model'],
    deb['model_init'],
  ) == ('100', '0.1', 'feddyn_cnn', 'pytorch')
  assert (paper['model'], paper['model_init']) == (
    'usercentric_lenet5',
    'keras',
  )
  assert (cpu['model'], cpu['model_init']) == ('lenet5', 'flax')
  fomo = resolved('reproduce_fedfomo.py')
  assert (
    fomo['mnist_model'],
    fomo['cifar_model'],
    fomo['cifar_per_client'],
  ) == ('mlp', 'lenet5', '600')
  fomo = resolved('reproduce_fedfomo.py', '--scale=paper')
  assert (
    fomo['mnist'],
    fomo['mnist_model'],
    fomo['cifar_model'],
    fomo['model_init'],
  ) == ('tfds:mnist', 'fedfomo_cnn', 'fedfomo_cnn', 'pytorch')
  per = resolved('reproduce_personalization.py', '--scale=paper', '--trials=2')
  assert (per['trials'], per['mnist_rounds'], per['cifar_clients']) == (
    '2',
    '1000',
    '100',
  )


@pytest.mark.parametrize(
  'name, args, flag',
  [
    ('reproduce_user_centric.py', ['--methods=fedavg,bogus'], '--methods'),
    ('reproduce_user_centric.py', ['--scenarios=4'], '--scenarios'),
    (
      'reproduce_user_centric.py',
      ['--scenarios=1', '--group_base=iid'],
      '--group_base',
    ),
    (
      'reproduce_user_centric.py',
      ['--study', '--study_variants=nope'],
      '--study_variants',
    ),
    ('reproduce_debiasing.py', ['--tables=3'], '--tables'),
    ('reproduce_debiasing.py', ['--tables=2', '--methods=fedavg'], '--methods'),
    (
      'reproduce_debiasing.py',
      ['--tables=2', '--eval_every=3'],
      '--eval_every',
    ),
    (
      'reproduce_debiasing.py',
      ['--tables=1', '--personal_rounds=3'],
      '--personal_rounds',
    ),
    (
      'reproduce_debiasing.py',
      ['--tables=1', '--personal_methods=pfeddyn_ft'],
      '--personal_methods',
    ),
    (
      'reproduce_debiasing.py',
      ['--tables=2', '--personal_methods=maml'],
      '--personal_methods',
    ),
    ('reproduce_fedfomo.py', ['--settings=7'], '--settings'),
    ('reproduce_fedfomo.py', ['--tables=dp', '--methods=fedavg'], '--methods'),
    ('reproduce_fedfomo.py', ['--tables=1', '--dp_sigmas=1'], '--dp_sigmas'),
    ('reproduce_fedfomo.py', ['--dp_sigmas=-1'], '--dp_sigmas'),
    ('reproduce_fedfomo.py', ['--dp_methods=fedavg,ditto'], '--dp_methods'),
    (
      'reproduce_fedfomo.py',
      ['--dp_methods=local', '--dp_sigmas=1'],
      '--dp_methods',
    ),
    (
      'reproduce_fedfomo.py',
      ['--dp_latent_features=vgg'],
      '--dp_latent_features',
    ),
    ('reproduce_fedprox.py', ['--stragglers=1.5'], '--stragglers'),
    ('reproduce_fedprox.py', ['--cohort_size=40'], '--cohort_size'),
  ],
)
@pytest.mark.ci_variants(
  'reproduce_debiasing.py-args4---tables',
  'reproduce_debiasing.py-args8---personal_methods',
  'reproduce_fedfomo.py-args10---settings',
  'reproduce_fedfomo.py-args12---dp_sigmas',
  'reproduce_user_centric.py-args0---methods',
  'reproduce_fedprox.py-args17---stragglers',
)
def test_bad_flags_exit_2_naming_the_flag(tmp_path, name, args, flag):
  r = script(name, f'--output_dir={tmp_path}', *args, timeout=300)
  assert r.returncode == 2, r.stderr[-2000:]
  assert flag in r.stderr and 'Traceback' not in r.stderr


@pytest.mark.slow  # ~35 s; the epsilon per round is test_privacy's
def test_fedfomo_dp_table_reports_epsilon(tmp_path):
  # One sigma (2 cells, each compiles its own round): sigma = 0 is the plain
  # algorithm, with nothing to account (test_privacy.py), and its epsilon
  # None reads 'inf' (privacy.epsilon_text, test below).
  made_cifar10(tmp_path, 600, 100)
  r = script(
    'reproduce_fedfomo.py',
    f'--output_dir={tmp_path}/out',
    '--tables=dp',
    '--trials=1',
    '--rounds_15=1',
    '--local_epochs=1',
    '--cifar_per_client=30',
    '--dp_sigmas=1',
    f'--data_dir={tmp_path}',
    cwd=tmp_path,
    timeout=600,
  )
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  res = json.load(open(tmp_path / 'out' / 'tables_cpu.json'))['results']['dp']
  assert set(res) == {f'{m}/sigma=1' for m in ('fedavg', 'fedfomo')} | {
    'label_skew'
  }
  assert 0 <= res['label_skew'] <= 2
  for m in ('fedavg', 'fedfomo'):
    # With noise epsilon is finite (monotonicity in sigma and steps:
    # test_privacy.py).
    assert 0 < res[f'{m}/sigma=1']['epsilon'] < 1e3
  md = open(tmp_path / 'out' / 'tables_cpu.md').read()
  assert '| method | delta | sigma | epsilon | accuracy |' in md
  assert '| fedavg | 1e-05 | 1 |' in md and '| fedfomo | 1e-05 | 1 |' in md


def test_results_json_is_strict(tmp_path):
  """A diverged trial's NaN curve point is written as null, not NaN (in a
  subprocess: the reproduce flags are the scripts', not the CLI's)."""
  code = (
    'import sys; from fedjax_personal.run import reproduce; '
    'reproduce.write_results(reproduce.ReproduceSettings(), sys.argv[1], "t", '
    '"title", '
    '"|a|", {"curve": [[45, 0.14, float("nan")]]})'
  )
  r = subprocess.run(
    [sys.executable, '-c', code, str(tmp_path)],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  text = open(tmp_path / 't_cpu.json').read()
  assert 'NaN' not in text and json.loads(text)['results']['curve'] == [
    [45, 0.14, None]
  ]


def test_dp_epsilon_text():
  from fedjax_personal.core.privacy import epsilon_text

  assert epsilon_text(None) == 'inf' and epsilon_text(4.7312) == '4.73'


@pytest.mark.slow  # ~16 s; strict JSON is test_results_json_is_strict's
def test_user_centric_table_written_as_json_and_markdown(tmp_path):
  r = script(
    'reproduce_user_centric.py',
    f'--output_dir={tmp_path}',
    '--scenarios=1',
    '--methods=fedavg,usercentric_k4',
    '--trials=1',
    '--rounds=1',
    '--num_clients=4',
    '--examples_per_client=40',
    '--eval_every=1',
    cwd=tmp_path,
    timeout=600,
  )
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  out = json.load(open(tmp_path / 'table1_cpu.json'))
  assert (
    out['scale'] == 'cpu'
    and out['trials'] == 1
    and '--scenarios=1' in out['command']
  )
  assert set(out['results']) == {'1/fedavg', '1/usercentric_k4'}
  uc = out['results']['1/usercentric_k4']
  assert uc['w_effective_neighbours_mean'] >= 1.0 and uc['w_diagnostics'][0]
  md = open(tmp_path / 'table1_cpu.md').read()
  assert (
    '| scenario | fedavg | usercentric_k4 |' in md
    and '±' in md
    and out['command'] in md
  )


def made_cifar10(folder, train=6000, test=1200):
  """A folder with CIFAR-10 as a made JPEG archive (each class its own
  colour plus noise): the scripts' shape, not their accuracy."""
  import made_files
  import numpy as np

  made_files.write_cifar10_jpeg_npz(
    folder / 'cifar10_jpeg.npz',
    np.arange(train) % 10,
    np.arange(test) % 10,
    np.random.default_rng(0),
  )
  return folder


@pytest.mark.slow
@pytest.mark.parametrize(
  'name',
  [
    n
    if n != 'reproduce_personalization.py'
    else pytest.param(
      n, marks=pytest.mark.needs_data(('input.txt', 'tinyshakespeare.txt'))
    )
    for n in sorted(SCRIPTS)
  ],
)
def test_reproduce_script_runs_with_trials(tmp_path, tmp_path_factory, name):
  # CIFAR-10 made here unless the real data sets are given
  # (FEDJAX_PERSONAL_DATA)
  data = (
    []
    if os.environ.get('FEDJAX_PERSONAL_DATA')
    else [f'--data_dir={made_cifar10(tmp_path_factory.mktemp("data"))}']
  )
  r = script(
    name,
    '--trials=2',
    f'--output_dir={tmp_path}',
    *SCRIPTS[name],
    *data,
    cwd=tmp_path,
  )
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
  assert '±' in r.stdout and '2 trials' in r.stdout, r.stdout[-3000:]
  files = os.listdir(tmp_path)
  assert any(f.endswith('_cpu.json') for f in files) and any(
    f.endswith('_cpu.md') for f in files
  )
  tables = {
    f: open(tmp_path / f).read() for f in files if f.endswith('_cpu.md')
  }
  # Run again: every trial is reused and the tables are the same.
  r = script(
    name,
    '--trials=2',
    f'--output_dir={tmp_path}',
    *SCRIPTS[name],
    *data,
    cwd=tmp_path,
  )
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
  assert 'reused' in r.stdout and 'trial 1 (seed 1): reused' in r.stdout, (
    r.stdout[-3000:]
  )
  assert {f: open(tmp_path / f).read() for f in tables} == tables


@pytest.mark.slow
def test_user_centric_study_runs(tmp_path):
  r = script(
    'reproduce_user_centric.py',
    '--study',
    '--trials=1',
    f'--output_dir={tmp_path}',
    *SCRIPTS['reproduce_user_centric.py'],
    '--scenarios=2',
    '--study_variants=b32,wu3_every10',
    cwd=tmp_path,
  )
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
  md = open(tmp_path / 'study_cpu.md').read()
  assert 'oracle' in md and 'b32: sigma B32' in md and 'ARI' in md


@pytest.mark.slow
def test_a_diverged_trial_is_reported_not_fatal():
  """run_trials keeps a diverged trial (marked) and the cell counts it."""
  from fedjax_personal import algorithms
  from fedjax_personal.core.data import to_device
  from fedjax_personal.core.engine import RoundRunner
  from fedjax_personal.core.executor_choice import create_executor
  from fedjax_personal.core.sampling import CohortSampler
  from fedjax_personal.datasets import DataConfig, load_federated
  from fedjax_personal.models import create_model
  from fedjax_personal.run import reporting, reproduce

  data = to_device(
    load_federated(
      DataConfig(
        dataset='digits', partition='iid', num_clients=4, max_examples=200
      )
    )
  )
  model = create_model('mlp', data.num_classes, data.train.x[0, :1])

  def trials(lr):
    alg = algorithms.build(
      'fedavg', model, data, client_lr=lr, local_steps=2, batch_size=10
    )
    runner = RoundRunner(
      alg,
      data,
      CohortSampler(4, cohort_size=4),
      create_executor('vmap', model, data.train.x[0, :1]),
    )
    return reproduce.run_trials(runner, 3, 0, 2, 1)[0]

  bad = trials(1e30)
  assert len(bad) == 2 and all(h[-1].get('diverged') for h in bad)
  summary = reporting.trials_summary(bad)
  assert (
    summary['diverged']
    and reproduce.cell(summary, 'accuracy_mean_window') == 'diverged'
  )
  mixed = reporting.trials_summary(trials(0.05) + bad[:1])
  assert mixed['diverged_trials'] == 1 and mixed['trials'] == 3
  assert reproduce.cell(mixed, 'accuracy_mean_window').endswith(
    '(1/3 diverged)'
  )


def test_pfllib_leaderboard_counts_a_diverged_trial():
  """The PFLlib leaderboard's row of a trial (``trial_final``): a trial that
  diverged is counted as diverged and left out of the mean, also when an
  evaluation came before its divergence (that evaluation is not its
  final accuracy); a trial without one is counted too (FD's, at round 2)."""
  from fedjax_personal.run import reporting, reproduce

  board = helpers.script_module('scripts', 'reproduce_pfllib.py')
  ok = [
    {'round': 1, 'accuracy_weighted': 0.5},
    {'round': 2, 'accuracy_weighted': 0.7},
    {'round': 3, 'accuracy_weighted': 0.6},
  ]
  late = [
    {'round': 1, 'accuracy_weighted': 0.9},
    {'round': 2, 'diverged': True, 'train_loss': float('nan')},
  ]
  early = [{'round': 1}, {'round': 2, 'diverged': True}]
  assert board.trial_final(ok) == {'accuracy': 0.6, 'best': 0.7}
  assert board.trial_final(late) == {'diverged': True, 'diverged_at_round': 2}
  summary = reporting.aggregate_trials(
    [board.trial_final(h) for h in (ok, late, early)]
  )
  assert summary['diverged_trials'] == 2 and summary['accuracy'] == 0.6
  assert reproduce.cell(summary, 'accuracy') == '60.0 ± 0.0 (2/3 diverged)'
  every = reporting.aggregate_trials([board.trial_final(early)] * 3)
  assert reproduce.cell(every, 'accuracy') == 'diverged'


def test_trial_curves_leave_diverged_trials_out_as_the_tables():
  import numpy as np

  from fedjax_personal.run.reporting import trial_curves

  def hist(accs, diverged_at=None):
    h = []
    for t, a in enumerate(accs, 1):
      r = {'round': t, 'accuracy_mean': a, 'accuracy_worst': a / 2}
      if diverged_at is not None and t >= diverged_at:
        r = {'round': t, 'diverged': True, 'diverged_at_round': diverged_at}
      h.append(r)
    return h

  ok = [hist([0.1, 0.2, 0.3, 0.4]), hist([0.3, 0.4, 0.5, 0.6])]
  rounds, stats, count = trial_curves(
    ok + [hist([0.9, 0.9, 0.9, 0.9], diverged_at=3)]
  )
  assert rounds == [1, 2, 3, 4] and count == '2 of 3 trials, 1 diverged'
  np.testing.assert_allclose(stats['accuracy_mean'][0], [0.2, 0.3, 0.4, 0.5])
  np.testing.assert_allclose(
    stats['accuracy_mean'][1],
    np.std([[0.1, 0.2, 0.3, 0.4], [0.3, 0.4, 0.5, 0.6]], 0, ddof=1),
  )
  # Every trial diverged: drawn up to the first divergence.
  rounds, stats, count = trial_curves([hist([0.1] * 4, 3), hist([0.2] * 4, 2)])
  assert rounds == [1] and count == '2 of 2 trials, 2 diverged'


@pytest.mark.slow
def test_finished_trials_are_reused_only_by_the_same_cell(
  tmp_path, monkeypatch, capsys
):
  """A table run again (killed, or with more trials) reuses the trials of the
  same cell and gives the same histories as a fresh run; another setting,
  a damaged file or another identity are run again; diverged trials are not
  kept."""
  import glob

  from fedjax_personal import algorithms
  from fedjax_personal.core.data import to_device
  from fedjax_personal.core.engine import RoundRunner
  from fedjax_personal.core.executor_choice import create_executor
  from fedjax_personal.core.sampling import CohortSampler
  from fedjax_personal.datasets import DataConfig, load_federated
  from fedjax_personal.models import create_model
  from fedjax_personal.run import reproduce

  data = to_device(
    load_federated(
      DataConfig(
        dataset='digits', partition='iid', num_clients=4, max_examples=200
      )
    )
  )
  model = create_model('mlp', data.num_classes, data.train.x[0, :1])

  def trials(lr, n, cache=True, reuse=True):
    settings = dict(client_lr=lr, local_steps=2, batch_size=10)
    alg = algorithms.build('fedavg', model, data, **settings)
    runner = RoundRunner(
      alg,
      data,
      CohortSampler(4, cohort_size=4),
      create_executor('vmap', model, data.train.x[0, :1]),
    )
    cell = {'algorithm': 'fedavg', 'settings': settings} if cache else None
    return reproduce.run_trials(
      runner, 3, 0, n, 1, cell=cell, reuse=reuse, directory=str(tmp_path)
    )[0]

  def accs(hists):
    return [[r.get('accuracy_mean') for r in h] for h in hists]

  fresh = trials(0.05, 2, cache=False)
  assert not os.path.exists(tmp_path / 'trials')  # no cell: nothing kept
  one = trials(0.05, 1)
  files = glob.glob(str(tmp_path / 'trials' / '*' / 'seed_*.json'))
  assert [os.path.basename(f) for f in files] == ['seed_0.json']
  capsys.readouterr()
  two = trials(0.05, 2)  # trial 0 reused, trial 1 run
  out = capsys.readouterr().out
  assert 'trial 0 (seed 0): reused' in out and 'trial 1' not in out
  assert accs(two) == accs(fresh) and accs(one) == accs(fresh[:1])
  assert len(glob.glob(str(tmp_path / 'trials' / '*' / 'seed_*.json'))) == 2
  # --noreuse_trials runs them again.
  assert accs(trials(0.05, 1, reuse=False)) == accs(fresh[:1])
  assert 'reused' not in capsys.readouterr().out
  # Another setting: its own folder, nothing reused.
  trials(0.02, 1)
  assert 'reused' not in capsys.readouterr().out
  assert len(glob.glob(str(tmp_path / 'trials' / '*'))) == 2
  # A damaged file, or one whose identity differs (other code), is run again.
  with open(files[0], 'w') as f:
    f.write('{"identity": ')
  trials(0.05, 1)
  assert 'reused' not in capsys.readouterr().out
  saved = json.load(open(files[0]))
  saved['identity']['code'] = 'other'
  json.dump(saved, open(files[0], 'w'))
  assert accs(trials(0.05, 1)) == accs(fresh[:1])
  assert 'reused' not in capsys.readouterr().out
  assert (
    json.load(open(files[0]))['identity']['code']
    == reproduce.code_fingerprint()
  )
  # A diverged trial is not kept.
  trials(1e30, 1)
  assert len(glob.glob(str(tmp_path / 'trials' / '*'))) == 2
  # The fingerprint covers the engine, the algorithms and the data sets.
  names = [n for n, _ in reproduce.source_files()]
  for name in (
    'fedjax_personal/core/engine.py',
    'fedjax_personal.algorithms/fedfomo.py',
    'fedjax_personal.datasets/embedding.py',
  ):
    assert name in names, names


def test_code_fingerprint_is_of_the_code_loaded_not_of_later_edits(
  tmp_path, monkeypatch
):
  """A job whose source files are edited while it runs keeps saving its trials
  under the fingerprint of the code it loaded (else they would be reused by the
  edited code, which never computed them)."""
  from fedjax_personal.run import reproduce

  source = tmp_path / 'module.py'
  source.write_text('a = 1\n')
  monkeypatch.setattr(
    reproduce, 'source_files', lambda: [('module.py', str(source))]
  )
  reproduce.code_fingerprint.cache_clear()
  try:
    loaded = reproduce.code_fingerprint()
    source.write_text('a = 2\n')  # edited while the job runs
    assert reproduce.code_fingerprint() == loaded
    reproduce.code_fingerprint.cache_clear()  # a new process reads the edit
    assert reproduce.code_fingerprint() != loaded
  finally:
    reproduce.code_fingerprint.cache_clear()


@pytest.mark.slow
def test_fedprox_figure_is_written(tmp_path):
  """FedProx's Figure 1 at 90% stragglers, two rounds: its three methods'
  training loss in the table and the figure."""
  r = script(
    'reproduce_fedprox.py',
    f'--output_dir={tmp_path}',
    '--trials=1',
    '--rounds=2',
    '--eval_every=1',
    '--num_clients=6',
    '--cohort_size=3',
    '--tables=1',
    '--stragglers=0.9',
    cwd=tmp_path,
    timeout=600,
  )
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  md = open(tmp_path / 'fedprox_cpu.md').read()
  assert '| 90% stragglers |' in md and md.count('±') >= 3
  res = json.load(open(tmp_path / 'fedprox_cpu.json'))['results']['figure1'][
    '90% stragglers'
  ]
  assert set(res) == {'fedavg', 'fedprox_mu0', 'fedprox_mu1'}
  assert os.path.exists(tmp_path / 'figure1_loss.png')
