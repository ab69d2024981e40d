"""The run_experiment CLI: outputs of a small run, and bad input."""

import ast
import functools
import glob
import json
import os
import subprocess
import sys

import pytest
from absl import flags
from helpers import main_in_one_process, parse_flags

from fedjax_personal.run import experiment_entry, experiment_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'scripts', 'run_experiment.py')


parse = parse_flags


@pytest.mark.slow
def test_small_comparison_writes_outputs(tmp_path, capsys):
  parse(
    '--algorithm=fedavg,local,fedavg_ft',
    '--dataset=digits',
    '--model=mlp',
    '--num_clients=5',
    '--rounds=3',
    '--eval_every=2',
    '--progress=false',
    '--max_examples=500',
    '--plots=wait',
    f'--output_dir={tmp_path}',
    '--paper_metric=weighted',
  )
  summaries = experiment_entry.main_job()
  out = capsys.readouterr().out
  assert 'fedavg_ft' in out and 'worst' in out and 'mean' in out
  # The paper's metric named in the header and carried by summary.json; each
  # averaging algorithm's client weights named once.
  assert "the paper's metric: the weighted column, the accuracy pooled" in out
  assert 'client weights: fedavg num_examples, fedavg_ft num_examples' in out
  written = json.loads((tmp_path / 'fedavg' / 'summary.json').read_text())
  assert written['paper_metric'] == {
    'column': 'weighted',
    'key': 'accuracy_weighted',
    'value': written['accuracy_weighted'],
  }
  assert written['identity']['weighting'] == 'num_examples'
  for alg in ('fedavg', 'local', 'fedavg_ft'):
    lines = (tmp_path / alg / 'metrics.jsonl').read_text().splitlines()
    assert [json.loads(l)['round'] for l in lines] == [2, 3]
    rec = json.loads(lines[-1])
    assert len(rec['per_client_accuracy']) == 5 and 'bytes_up' in rec
    summary = json.loads((tmp_path / alg / 'summary.json').read_text())
    assert (
      summary['algorithm'] == alg
      and 0 <= summary['accuracy_worst'] <= summary['accuracy_mean']
    )
  assert summaries['local']['total_bytes_up'] == 0
  assert (tmp_path / 'accuracy.png').stat().st_size > 1000
  assert (tmp_path / 'client_accuracy_hist.png').stat().st_size > 1000


def test_same_flags_and_seed_give_same_numbers(tmp_path):
  args = [
    '--algorithm=fedavg',
    '--dataset=digits',
    '--model=logreg',
    '--num_clients=4',
    '--rounds=2',
    '--progress=false',
    '--max_examples=300',
    '--cohort_size=2',
  ]
  parse(*args, f'--output_dir={tmp_path}/a')
  a = experiment_entry.main_job()
  parse(*args, f'--output_dir={tmp_path}/b')
  b = experiment_entry.main_job()
  assert (
    a['fedavg']['per_client_accuracy'] == b['fedavg']['per_client_accuracy']
  )
  assert a['fedavg']['loss_weighted'] == b['fedavg']['loss_weighted']


@pytest.mark.parametrize(
  'args,flag',
  [
    (['--algorithm=fedbogus'], '--algorithm'),
    (['--model=resnet1000'], '--model'),
    (['--dataset=imagenet'], '--dataset'),
    (['--partition=weird'], '--partition'),
    (['--num_clients=5', '--cohort_size=6'], '--cohort_size'),
    (['--alpha=0'], '--alpha'),
    (['--alpha=-0.5'], '--alpha'),
    (['--num_clients=0'], '--num_clients'),
    (['--participation=1.5'], '--participation'),
    (['--cohort_size=2', '--participation=0.5'], '--participation'),
    (['--client_lr=-1'], '--client_lr'),
  ],
)
def test_bad_flags_name_the_flag(args, flag):
  parse(*args, '--progress=false')
  with pytest.raises(experiment_entry.UsageError, match=flag):
    experiment_entry.main_job()


def test_more_clients_than_examples():
  parse('--dataset=digits', '--num_clients=5000', '--progress=false')
  with pytest.raises(ValueError, match='num_clients'):
    experiment_entry.main_job()


def test_model_that_does_not_fit_the_data():
  parse('--model=lenet5', '--dataset=digits', '--progress=false')
  with pytest.raises(ValueError, match='model'):
    experiment_entry.main_job()


def test_oracle_without_groups():
  parse(
    '--algorithm=oracle',
    '--dataset=digits',
    '--partition=dirichlet',
    '--model=mlp',
    '--progress=false',
  )
  with pytest.raises(ValueError, match='partition'):
    experiment_entry.main_job()


#: Command lines the main script refuses: exit status 2, one line naming this.
EXIT_2 = [
  (['--algorithm=nope'], '--algorithm'),
  (
    ['--dataset=tfds:mnist', f'--data_dir={os.path.join(ROOT, "tests")}'],
    'not prepared',
  ),
  (
    ['--data_dir=/nonexistent/dir'],
    '/nonexistent/dir: --data_dir is not a folder',
  ),
  (['--seed=-1'], '--seed: must be >= 0'),
  (['--data_seed=-2'], '--data_seed: must be >= 0'),
  (['--target_accuracy=2'], '--target_accuracy: is a fraction in (0, 1]'),
  (['--num_groups=0'], '--num_groups: must be >= 1'),
  (
    ['--dataset=digits', f'--data_dir={ROOT}'],
    '--data_dir: does nothing: dataset digits',
  ),
  (['--dataset=digits', '--download'], '--download: does nothing'),
  (
    ['--dataset=emnist', '--test_fraction=0.3'],
    '--test_fraction: does nothing: emnist has its own',
  ),
  (
    ['--dataset=shakespeare', f'--data_dir={ROOT}'],
    'shakespeare_train.sqlite: not found in',
  ),
  (['--num_clients=20', '--cohort_size=30'], '--cohort_size'),
  (
    ['--algorithm=feddyn', '--server_lr=0.5'],
    '--server_lr: does nothing for feddyn',
  ),
  (['--algorithm=fedsgd', '--client_momentum=0.9'], '--client_momentum'),
  (['--client_lr=fast'], 'client_lr'),
  (['--nonexistent_flag=1'], 'nonexistent_flag'),
  (
    [
      '--algorithm=fedalt',
      '--partial_personal_part=split:(',
      '--dataset=digits',
      '--model=mlp',
    ],
    'invalid regular expression',
  ),
  (['--model_init=jax'], '--model_init'),
  (
    ['--init_weights=/nonexistent/w.npz'],
    '--init_weights: /nonexistent/w.npz: no such file',
  ),
  # not weights
  (
    [f'--init_weights={os.path.join(ROOT, "setup.cfg")}'],
    'unknown format',
  ),
  (['--test_fraction=1.5'], '--test_fraction: must be in (0, 1), got 1.5'),
  (['--distributed_timeout=0'], '--distributed_timeout: must be >= 1, got 0'),
  (
    ['--seq_len=5'],
    '--seq_len: an option of --dataset=shakespeare/stackoverflow/'
    'tinyshakespeare/tfds:tiny_shakespeare, not of --dataset=mnist',
  ),
  (
    ['--synthetic_beta=2'],
    '--synthetic_beta: an option of --dataset=synthetic, not of '
    '--dataset=mnist',
  ),
  (
    ['--dataset=shakespeare', '--seq_len=99999999999'],
    '--seq_len: must be in [1, 1048576]',
  ),
  (
    ['--dataset=synthetic', '--synthetic_beta=1e308'],
    '--synthetic_beta: must be in [0, ',
  ),
  (
    ['--vocab_size=100'],
    '--vocab_size: an option of --dataset=stackoverflow, not of '
    '--dataset=mnist',
  ),
  (
    [
      '--cifar100_test=tff_clients',
      '--dataset=cifar100',
      '--partition=dirichlet',
    ],
    "--cifar100_test: chooses the natural CIFAR-100's test clients; "
    '--partition=dirichlet',
  ),
]


@functools.lru_cache(maxsize=None)
def _exit_2_results():
  """The refusals of ``EXIT_2`` by the script's ``main``, run one after
  another in one child process (a Python start and JAX import once)."""
  return main_in_one_process(
    [['--progress=false'] + a for a in (args for args, _ in EXIT_2)], cwd=ROOT
  )


@pytest.mark.parametrize(
  'case', range(len(EXIT_2)), ids=lambda i: EXIT_2[i][1][:40]
)
def test_main_exits_2_with_one_line(case):
  code, stderr = _exit_2_results()[case]
  needle = EXIT_2[case][1]
  assert code == 2, stderr
  err = [l for l in stderr.splitlines() if l.startswith('error:')]
  assert len(err) == 1 and needle in err[0], stderr
  assert 'Traceback' not in stderr


@pytest.mark.parametrize('args,needle', [EXIT_2[0], EXIT_2[15]])
def test_script_exits_2_with_one_line(args, needle):
  """As the process a user starts: a setting and a flag absl refuses."""
  r = subprocess.run(
    [sys.executable, SCRIPT, '--progress=false'] + args,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 2, r.stderr
  err = [l for l in r.stderr.splitlines() if l.startswith('error:')]
  assert len(err) == 1 and needle in err[0], r.stderr
  assert 'Traceback' not in r.stderr


@pytest.mark.slow
def test_weights_of_another_model_name_the_layer(tmp_path):
  import jax.numpy as jnp

  from fedjax_personal import models
  from fedjax_personal.models import weights

  lenet = models.create_model('lenet5', 10, jnp.zeros((1, 28, 28, 1)))
  path = str(tmp_path / 'lenet5.npz')
  weights.save_npz(path, lenet.init(__import__('jax').random.key(0)))
  r = subprocess.run(
    [
      sys.executable,
      SCRIPT,
      '--progress=false',
      '--algorithm=fedavg',
      '--model=mlp',
      f'--init_weights={path}',
      f'--output_dir={tmp_path}/out',
    ],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
  )
  err = [l for l in r.stderr.splitlines() if l.startswith('error:')]
  assert r.returncode == 2 and len(err) == 1 and 'hidden_0/kernel' in err[0], (
    r.stderr
  )
  assert not os.path.exists(tmp_path / 'out')


def test_sweep_flags(tmp_path, capsys):
  parse(
    '--algorithm=fedavg',
    '--dataset=digits',
    '--model=logreg',
    '--num_clients=4',
    '--rounds=2',
    '--progress=false',
    '--max_examples=300',
    '--sweep_seeds=2',
    '--sweep=client_lr:0.05,0.1',
    f'--output_dir={tmp_path}',
  )
  results = experiment_entry.main_job()
  assert len(results) == 4 and 'fedavg seed=1 client_lr=0.1' in results
  assert (tmp_path / 'sweep.json').exists()
  parse('--sweep=batch_size:1,2', '--progress=false')
  with pytest.raises(experiment_entry.UsageError, match='--sweep'):
    experiment_entry.main_job()


@pytest.mark.slow
def test_fedfomo_writes_affinity_heat_maps(tmp_path):
  parse(
    '--algorithm=fedfomo',
    '--dataset=digits',
    '--model=logreg',
    '--num_clients=5',
    '--rounds=3',
    '--eval_every=1',
    '--val_fraction=0.2',
    '--fedfomo_candidates=2',
    '--progress=false',
    '--max_examples=300',
    f'--output_dir={tmp_path}',
  )
  experiment_entry.main_job()
  assert (tmp_path / 'fedfomo' / 'affinity.png').stat().st_size > 1000


def test_fedfomo_needs_a_validation_split():
  """A validation split is held out by default only when an algorithm needs
  one; an explicit --val_fraction=0 with FedFomo is refused."""
  parse('--algorithm=fedavg', '--dataset=digits')
  assert experiment_entry.read_flags().data.val_fraction == 0.0
  parse('--algorithm=fedavg,fedfomo', '--dataset=digits')
  assert (
    experiment_entry.read_flags().data.val_fraction
    == experiment_flags.DEFAULT_VAL_FRACTION
    == 0.1
  )
  parse(
    '--algorithm=fedfomo',
    '--dataset=digits',
    '--model=logreg',
    '--progress=false',
    '--val_fraction=0',
  )
  with pytest.raises(ValueError, match='val_fraction'):
    experiment_entry.main_job()


@pytest.mark.parametrize(
  'flagfile', sorted(os.listdir(os.path.join(ROOT, 'scripts', 'configs')))
)
def test_every_flagfile_is_accepted(flagfile):
  parse(f'--flagfile={os.path.join(ROOT, "scripts", "configs", flagfile)}')
  settings = experiment_entry.read_flags()
  assert [a.name for a in settings.algorithms] == flags.FLAGS.algorithm


@pytest.mark.parametrize('alg', ['usercentric', 'cfl'])
@pytest.mark.slow_variants('usercentric')
def test_cli_sweep_of_seeds_equals_single_runs_for_pre_round_algorithms(
  tmp_path, alg
):
  """--sweep_seeds=2 of user-centric (W recomputed every round) and CFL
  (split test from round 2) gives each seed the records of its single run
  (--seed=s on the same partition), W diagnostics and splits included."""
  own = {
    'usercentric': (
      '--usercentric_recompute_every=1',
      '--usercentric_sigma_batch_size=8',
    ),
    'cfl': ('--cfl_warmup_rounds=1', '--cfl_eps1=10', '--cfl_eps2=0'),
  }[alg]
  common = (
    f'--algorithm={alg}',
    '--dataset=digits',
    '--partition=dirichlet',
    '--model=logreg',
    '--num_clients=4',
    '--rounds=3',
    '--eval_every=2',
    '--progress=false',
    '--max_examples=200',
    '--data_seed=0',
  ) + own
  parse(*common, '--sweep_seeds=2', f'--output_dir={tmp_path}/sweep')
  swept = experiment_entry.main_job()
  seed = 1  # the non-default seed (seed 0 is also the sweep's partition seed)
  parse(*common, f'--seed={seed}', f'--output_dir={tmp_path}/s{seed}')
  single = experiment_entry.main_job()
  got, want = swept[f'{alg} seed={seed}'], single[alg]
  for k in (
    'accuracy_mean',
    'accuracy_worst',
    'loss_weighted',
    'total_bytes_down_broadcast',
  ):
    assert got[k] == pytest.approx(want[k], rel=1e-5), (alg, seed, k)
  lines = [
    json.loads(l) for l in open(tmp_path / 'sweep' / alg / 'metrics.jsonl')
  ]
  mine = [l for l in lines if l['config']['seed'] == seed]
  ref = [
    json.loads(l) for l in open(tmp_path / f's{seed}' / alg / 'metrics.jsonl')
  ]
  # W every round; CFL's test from 2
  assert (
    [l['round'] for l in mine]
    == [l['round'] for l in ref]
    == ([1, 2, 3] if alg == 'usercentric' else [2, 3])
  )
  for a, b in zip(mine, ref):
    for k in (
      'w_effective_neighbours_mean',
      'num_streams',
      'cfl_splits',
      'num_clusters',
      'train_loss',
    ):
      assert (k in a) == (k in b), (alg, k)
      if k in a:  # never approx(None): pytest >= 9.2 refuses it
        assert a[k] == pytest.approx(b[k], rel=1e-5), (alg, k)


@pytest.mark.slow
def test_sweep_marks_a_diverged_configuration_and_exits_3_when_all_diverge(
  tmp_path, capsys
):
  common = (
    '--algorithm=fedavg',
    '--dataset=digits',
    '--model=logreg',
    '--num_clients=4',
    '--rounds=2',
    '--progress=false',
    '--max_examples=200',
    '--eval_every=1',
  )
  parse(*common, '--sweep=client_lr:0.05,1e38', f'--output_dir={tmp_path}/a')
  results = experiment_entry.main_job()
  ok, bad = (
    results['fedavg seed=0 client_lr=0.05'],
    results['fedavg seed=0 client_lr=1e+38'],
  )
  assert (
    not ok.get('diverged') and bad['diverged'] and bad['diverged_at_round'] == 1
  )
  assert 'diverged at round 1' in capsys.readouterr().out
  lines = [
    json.loads(l) for l in open(tmp_path / 'a' / 'fedavg' / 'metrics.jsonl')
  ]
  assert [
    l['config']['client_lr'] for l in lines if l.get('diverged')
  ] == pytest.approx([1e38] * 2)
  parse(*common, '--sweep=client_lr:1e38,2e38', f'--output_dir={tmp_path}/b')
  with pytest.raises(
    experiment_entry.experiment.DivergenceError,
    match='all 2 configurations diverged',
  ):
    experiment_entry.main_job()


@pytest.mark.parametrize(
  'model,executor', [('logreg', 'blocked'), ('mlp', 'sequential')]
)
@pytest.mark.slow_variants('mlp-sequential')
def test_trials_equal_single_runs_and_report_mean_and_std(
  tmp_path, model, executor
):
  """--trials=3: one vmapped program (blocked) or one run after another
  (sequential); each trial equals the single run with its seed on the same
  partition, and the table's row is their mean ± sample std."""
  import numpy as np

  common = (
    '--algorithm=fedavg',
    '--dataset=digits',
    f'--model={model}',
    '--num_clients=4',
    '--rounds=2',
    '--eval_every=1',
    '--progress=false',
    '--max_examples=160',
    f'--executor={executor}',
    '--data_seed=0',
    '--stat_window=2',
  )
  parse(*common, '--trials=3', f'--output_dir={tmp_path}/t')
  row = experiment_entry.main_job()['fedavg']
  singles = []
  for seed in range(3):
    parse(*common, f'--seed={seed}', f'--output_dir={tmp_path}/s{seed}')
    singles.append(experiment_entry.main_job()['fedavg'])
  assert row['trials'] == 3
  for k in ('accuracy_mean', 'accuracy_worst', 'accuracy_mean_window'):
    vals = [s[k] for s in singles]
    assert row[k] == pytest.approx(np.mean(vals), rel=1e-5, abs=1e-7), k
    assert row[f'{k}_std'] == pytest.approx(
      np.std(vals, ddof=1), rel=1e-4, abs=1e-6
    ), k
  saved = json.load(open(tmp_path / 't' / 'comparison.json'))['fedavg']
  assert len(saved['per_trial']) == 3 and saved['trials'] == 3


def test_trials_table_header_names_an_integer_window():
  """Aggregated rows carry stat_window as a mean (a float): the header still
  reads @last5."""
  from fedjax_personal.run import reporting

  rows = {
    'fedavg': reporting.aggregate_trials(
      [
        {
          'accuracy_mean': 0.5,
          'accuracy_worst': 0.25,
          'accuracy_mean_window': 0.5,
          'accuracy_worst_window': 0.25,
          'stat_window': 5,
        },
        {
          'accuracy_mean': 0.7,
          'accuracy_worst': 0.35,
          'accuracy_mean_window': 0.6,
          'accuracy_worst_window': 0.3,
          'stat_window': 5,
        },
      ]
    )
  }
  table = reporting.format_table(rows)
  assert 'mean@last5 ' in table and '@last5.0' not in table, table
  assert '60.00±14.14' in table, table


@pytest.mark.parametrize(
  'script',
  sorted(
    os.path.basename(p)
    for p in glob.glob(
      os.path.join(os.path.dirname(__file__), '..', 'scripts', '*.py')
    )
  ),
)
def test_help_prints_the_docstring_as_written(script):
  """absl's usage() applies `doc % argv0` to __main__'s docstring: a bare '%'
  (e.g. "10% active") would print the script's path inside the help text."""
  path = os.path.join(os.path.dirname(__file__), '..', 'scripts', script)
  with open(path) as f:
    doc = ast.get_docstring(ast.parse(f.read()), clean=False) or ''
  n = doc.count('%') - 2 * doc.count('%%')
  try:
    shown = doc % (('<argv0>',) * n)
  except (OverflowError, TypeError, ValueError):
    shown = doc  # absl prints the docstring as is, '%%' included
  assert shown == doc.replace('%%', '%'), script
