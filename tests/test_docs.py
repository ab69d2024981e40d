"""Every command shown in README.md and BUILD.md runs: the fenced ``bash``
blocks' commands are extracted and run with ``--dry_run`` (each script
checks every flag, loads its data and builds what it would run, then stops)
or, for the README's Python example, at a tiny size. Install and test
commands are checked against what they name (extras, files, markers): CI
runs the README's own install and test commands (``.ci/run``). The docs'
size limits and headings are checked too."""

import configparser
import functools
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = (
  'README.md',
  'BUILD.md',
  'docs/populations.md',
  'docs/add_a_data_set.md',
  'docs/models.md',
  'docs/from_fedjax.md',
  'benchmarks/speed/README.md',
  'benchmarks/reproductions/README.md',
)


def fenced(path, lang):
  """The ``lang`` fenced blocks of a Markdown file."""
  text = open(os.path.join(ROOT, path)).read()
  return re.findall(r'```' + lang + r'\n(.*?)```', text, flags=re.S)


def commands():
  """(file, command) for every command line of the docs' bash blocks
  (continuations joined, comments dropped)."""
  out = []
  for doc in DOCS:
    for block in fenced(doc, 'bash'):
      for line in block.replace('\\\n', ' ').splitlines():
        line = line.split(' #')[0].strip()
        if line and not line.startswith('#'):
          out.append((doc, line))
  return out


def _parts(cmd):
  env = {}
  cmd = cmd.rstrip('&').strip()
  words = shlex.split(cmd)
  while words and re.fullmatch(r'[A-Z_]+=\S*', words[0]):
    k, v = words.pop(0).split('=', 1)
    env[k] = v
  return env, words


def _extras():
  cfg = configparser.ConfigParser()
  cfg.read(os.path.join(ROOT, 'setup.cfg'))
  return set(cfg['options.extras_require'])


def check_install(words):
  for w in words:
    m = re.match(r'\.\[(.*)\]$', w)
    if m:
      assert set(m.group(1).split(',')) <= _extras(), w
    if w.endswith('.txt'):
      assert os.path.isfile(os.path.join(ROOT, w)), w
    if w.startswith('torch=='):
      continue


def check_pytest(words):
  for w in words:
    if w.startswith('tests/'):
      assert os.path.isfile(os.path.join(ROOT, w)), w
  rest = words[3:]  # after 'python -m pytest'
  if '-m' in rest:
    assert rest[rest.index('-m') + 1] in ('slow', 'not slow', 'needs_data')


def run_script(env, words):
  """A script's command with --dry_run, in a subprocess."""
  script = words[1]
  assert os.path.isfile(os.path.join(ROOT, script)), script
  args = [
    w
    for w in words[2:]
    if not w.startswith(
      ('--coordinator_address', '--num_processes', '--process_id')
    )
  ]
  launch = [w for w in words[2:] if w not in args]
  # several processes: the launch settings are valid; one process dry-runs
  if launch:
    from fedjax_personal.run import distributed

    flags = dict(w[2:].split('=', 1) for w in launch)
    got = distributed.DistributedSettings(
      coordinator_address=flags.get('coordinator_address'),
      num_processes=int(flags['num_processes'])
      if 'num_processes' in flags
      else None,
      process_id=int(flags['process_id']) if 'process_id' in flags else None,
    ).launch()
    assert got is not None
  # the suite never downloads: the files, made, in --data_dir
  if '--download' in args:
    args = [a for a in args if a != '--download'] + [
      f'--data_dir={_made_data(args)}'
    ]
  # one process dry-runs them all
  if script == MAIN_SCRIPT and not env and not launch:
    code, err = _main_dry_runs().get(tuple(args), (None, 'not batched'))
    assert code == 0, f'{" ".join(words)}\n{err[-3000:]}'
    return
  dry = ['--dry_run'] * ('--dry_run' not in args)
  r = subprocess.run(
    [sys.executable, script, *args, *dry],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, **env, 'JAX_PLATFORMS': 'cpu'},
  )
  assert r.returncode == 0, f'{" ".join(words)}\n{r.stderr[-3000:]}'


MAIN_SCRIPT = 'scripts/run_experiment.py'


@functools.lru_cache(maxsize=None)
def _main_dry_runs():
  """{args: (exit status, stderr)} of every documented command of the main
  script that needs no environment of its own, run in one child process."""
  batch = []
  for _, cmd in commands():
    for part in cmd.split('&&'):
      env, words = _parts(part.strip())
      if (
        words[:2] == ['python', MAIN_SCRIPT]
        and not env
        and not any(
          w.startswith(
            ('--coordinator_address', '--num_processes', '--process_id')
          )
          for w in words
        )
      ):
        args = words[2:]
        if '--download' in args:
          args = [a for a in args if a != '--download'] + [
            f'--data_dir={_made_data(args)}'
          ]
        batch.append(args)
  from helpers import main_in_one_process

  results = main_in_one_process(
    [a + ['--dry_run'] * ('--dry_run' not in a) for a in batch], cwd=ROOT
  )
  return dict(zip(map(tuple, batch), results))


def _made_data(args):
  return _made_data_for(tuple(args))


@functools.lru_cache(maxsize=None)
def _made_data_for(args):
  """A folder with made files of the command's --dataset (FedJAX EMNIST:
  as many small writers as --num_clients asks for)."""
  import tempfile

  import made_files
  import numpy as np

  flags = dict(
    a[2:].split('=', 1) for a in args if a.startswith('--') and '=' in a
  )
  assert flags.get('dataset') == 'emnist', (
    f'teach _made_data the files of {flags.get("dataset")}'
  )
  folder = tempfile.mkdtemp(prefix='made_data_')
  n = int(flags.get('num_clients', 3))
  import pathlib

  made_files.write_emnist(
    pathlib.Path(folder), np.random.default_rng(0), [4] * n, [2] * n
  )
  return folder


@pytest.mark.parametrize(
  'doc,cmd', commands(), ids=lambda x: x[:80] if isinstance(x, str) else x
)
def test_documented_command_runs(doc, cmd):
  for part in cmd.split('&&'):
    env, words = _parts(part.strip())
    if words[:4] == ['python', '-m', 'pip', 'install'] or words[:2] == [
      'pip',
      'install',
    ]:
      check_install(words)
    elif words[:3] == ['python', '-m', 'pytest']:
      check_pytest(words)
    elif words[:2] == ['bash', '.ci/run']:
      assert os.access(os.path.join(ROOT, '.ci', 'run'), os.X_OK)
    elif words[0] == 'python' and words[1].startswith(
      ('scripts/', 'benchmarks/')
    ):
      run_script(env, words)
    else:
      pytest.fail(
        f'{doc}: no check for the command {cmd!r}; teach tests/test_docs.py'
      )


def test_readme_python_example_runs(tmp_path):
  """The README's Python, with EMNIST made in FedJAX's format in place of
  ~/data, an MLP in place of the CNN and 2 rounds in place of 20."""
  import made_files
  import numpy as np

  made_files.write_emnist(
    tmp_path, np.random.default_rng(0), [4, 6, 3, 5], [1, 2, 1, 1]
  )
  (code,) = fenced('README.md', 'python')
  assert "cache_dir='~/data'" in code and "create_model('cnn'" in code
  code = code.replace('num_rounds=20', 'num_rounds=2').replace(
    'eval_every=5', 'eval_every=2'
  )
  code = code.replace("cache_dir='~/data'", f'cache_dir={str(tmp_path)!r}')
  code = code.replace("create_model('cnn'", "create_model('mlp'")
  namespace = {}
  exec(compile(code, 'README.md', 'exec'), namespace)
  assert 0 <= namespace['history'][-1]['accuracy_worst'] <= 1
  assert namespace['store'].num_clients == 4 and namespace['batch'][
    'x'
  ].shape == (20, 28, 28, 1)
  # f0003_03's 5 images, padded to 20
  assert namespace['batch']['__mask__'].sum() == 5


@pytest.fixture
def flags_added_removed():
  """Flags a test's registrations define are removed after it (the
  registries are restored by monkeypatch): later tests see the command's."""
  from absl import flags

  defined = set(flags.FLAGS)
  yield
  flags.FLAGS.unparse_flags()
  for name in set(flags.FLAGS) - defined:
    delattr(flags.FLAGS, name)


def test_a_data_set_and_an_algorithm_added_by_the_docs_run_through_the_cli(
  tmp_path, monkeypatch, flags_added_removed, algorithm_registry
):
  """docs/add_a_data_set.md's data set of its own files (FedJAX SQLite, no URL)
  and docs/add_an_algorithm.md's algorithm, registered by their snippets exactly
  as printed, run through the CLI: with rate 0 the algorithm is FedAvg; with
  rate 0.5 the rounds count only the clients that uploaded (num_active,
  bytes_up) and every sampled one in num_sampled; summary.json names the worst
  clients by id; a rate of 1, --download and a missing file are one line
  each."""
  import made_files
  import numpy as np
  from helpers import parse_flags

  from fedjax_personal.datasets import registry
  from fedjax_personal.run import experiment_entry

  _, data_module = fenced('docs/add_a_data_set.md', 'python')
  # the first: test_plugins; the fourth: the features' snippet
  _, alg_module, script = fenced('docs/add_an_algorithm.md', 'python')[:3]
  (tmp_path / 'my_writers.py').write_text(data_module)
  (tmp_path / 'fedavg_dropout.py').write_text(alg_module)
  monkeypatch.syspath_prepend(str(tmp_path))
  for m in ('my_writers', 'fedavg_dropout'):
    monkeypatch.delitem(sys.modules, m, raising=False)
  monkeypatch.setattr(registry, 'LOADERS', dict(registry.LOADERS))
  monkeypatch.setattr(registry, 'OPTIONS', dict(registry.OPTIONS))
  exec(
    compile('import my_writers\n' + script, 'docs', 'exec'),
    {'__name__': 'my_script'},
  )
  data = tmp_path / 'data'
  data.mkdir()
  rng = np.random.default_rng(1)
  for split, sizes in (
    ('train', [7, 3, 12, 5, 6, 4, 9, 8]),
    ('test', [2, 2, 3, 1, 2, 2, 1, 3]),
  ):
    made_files.write_fedjax_sqlite(
      data / f'my_writers_{split}.sqlite', made_files.emnist_clients(rng, sizes)
    )
  common = (
    '--dataset=my_writers',
    '--model=logreg',
    '--rounds=3',
    '--cohort_size=4',
    '--eval_every=1',
    '--progress=false',
  )
  parse_flags(
    '--algorithm=fedavg,fedavg_dropout',
    '--dropout_rate=0',
    *common,
    f'--data_dir={data}',
    f'--output_dir={tmp_path}/zero',
  )
  out = experiment_entry.main_job()
  assert (
    out['fedavg_dropout']['accuracy_mean'] == out['fedavg']['accuracy_mean']
  )
  assert (
    out['fedavg_dropout']['total_bytes_up'] == out['fedavg']['total_bytes_up']
  )
  assert out['fedavg']['num_eval_clients'] == 8
  assert out['fedavg']['worst_clients'][0]['client_id'].startswith('f000')
  parse_flags(
    '--algorithm=fedavg_dropout',
    '--dropout_rate=0.5',
    *common,
    f'--data_dir={data}',
    f'--output_dir={tmp_path}/half',
  )
  experiment_entry.main_job()
  records = [
    json.loads(l)
    for l in open(tmp_path / 'half' / 'fedavg_dropout' / 'metrics.jsonl')
  ]
  rounds = [r for r in records if 'num_sampled' in r]
  assert len(rounds) == 3 and all(r['num_sampled'] == 4 for r in rounds)
  # 0.5 ** 12: this seed drops someone
  assert sum(r['num_active'] for r in rounds) < 12
  per_client = out['fedavg']['total_bytes_up'] / 12
  assert all(r['bytes_up'] == r['num_active'] * per_client for r in rounds)
  for bad, why in (
    ('--dropout_rate=1', 'dropout_rate'),
    ('--download', 'my_writers has no URL'),
  ):
    parse_flags(
      '--algorithm=fedavg_dropout', *common, f'--data_dir={data}', bad
    )
    with pytest.raises(experiment_entry.ConfigError, match=why):
      experiment_entry.main_job()
  parse_flags('--algorithm=fedavg_dropout', *common, f'--data_dir={tmp_path}')
  with pytest.raises(Exception, match='my_writers_train.sqlite: not found'):
    experiment_entry.main_job()


def test_docs_are_guides_within_their_size():
  """The README and BUILD.md within their size, tables included: the
  detail belongs in the modules' docstrings and docs/."""
  for doc, most in (('README.md', 200), ('BUILD.md', 600)):
    lines = open(os.path.join(ROOT, doc)).read().splitlines()
    assert len(lines) < most, (
      f'{doc}: {len(lines)} lines, keep under {most} (move detail to docs/)'
    )


def test_nothing_is_named_after_a_work_item():
  bad = []
  for base, dirs, files in os.walk(ROOT):
    dirs[:] = [
      d
      for d in dirs
      if not d.startswith('.')
      and d not in ('runs', '__pycache__')
      and not d.endswith('.egg-info')
    ]
    for name in dirs + files:
      if re.search(r'issue_?\d', name, re.I):
        bad.append(os.path.relpath(os.path.join(base, name), ROOT))
  for doc in DOCS + ('benchmarks/README.md',):
    for line in open(os.path.join(ROOT, doc)):
      if line.startswith('#') and re.search(r'\bissues? \d', line, re.I):
        bad.append(f'{doc}: {line.strip()}')
  assert not bad, bad


def test_the_extension_reference_is_made_from_the_docstrings():
  """docs/extension_reference.md is what tests/extension_reference.py makes
  of today's docstrings (regenerate it with the command its header shows)."""
  import extension_reference

  with open(os.path.join(ROOT, 'docs', 'extension_reference.md')) as f:
    assert f.read() == extension_reference.page(), (
      'docs/extension_reference.md is stale: python '
      'tests/extension_reference.py > '
      'docs/extension_reference.md'
    )


def test_the_architecture_map_names_every_module():
  """docs/architecture.md's map names every module of the package's
  folders, and every folder it draws exists."""
  text = open(os.path.join(ROOT, 'docs', 'architecture.md')).read()
  section = text[text.index('## The map') :]
  (drawing,) = re.findall(
    r'```\n(fedjax_personal/\n.*?)```', section, flags=re.S
  )[:1]
  words = set(re.findall(r'\w+', drawing))
  missing = []
  for folder in ('fedjax_personal', 'algorithms', 'datasets'):
    for base, dirs, files in os.walk(os.path.join(ROOT, folder)):
      dirs[:] = [d for d in dirs if d not in ('__pycache__', 'data')]
      rel = os.path.relpath(base, ROOT)
      if rel != folder and os.path.basename(base) not in words:
        missing.append(rel)
      if folder == 'algorithms':
        continue  # one file per algorithm, drawn as such
      missing += [
        os.path.join(rel, f)
        for f in files
        if f.endswith('.py') and f != '__init__.py' and f[:-3] not in words
      ]
  assert not missing, (
    f"modules docs/architecture.md's map does not name: "
    f"{missing}; add each to its folder's line there (or keep a module of "
    'your own outside the package: --import=my_file.py)'
  )
  for folder in re.findall(r'^\s*(\w+)/', drawing, flags=re.M):
    assert any(
      os.path.isdir(os.path.join(ROOT, *p, folder))
      for p in [(), ('fedjax_personal',), ('fedjax_personal', 'core')]
    ), folder


def test_the_features_snippet_of_add_an_algorithm_runs_as_printed():
  """docs/add_an_algorithm.md's algorithm reading the features and the
  head, as printed: with weight 0 it is FedAvg; a positive weight changes
  the round; a model without a head is refused naming --model."""
  import optax
  from helpers import digits_data, max_diff, run_rounds

  from fedjax_personal import models
  from fedjax_personal.algorithms import fedavg
  from fedjax_personal.core.batching import Batching
  from fedjax_personal.errors import ConfigError

  code = fenced('docs/add_an_algorithm.md', 'python')[3]
  scope = {'__name__': 'feature_penalty_doc'}
  exec(compile(code, 'docs/add_an_algorithm.md', 'exec'), scope)
  data = digits_data(num_clients=3, max_examples=20)
  model = models.create_model('mlp', data.num_classes, data.train.x[0, :1])
  batching = Batching(batch_size=8, num_epochs=1)
  make = scope['fedavg_feature_penalty']
  _, zero = run_rounds(make(model, 3, optax.sgd(0.1), batching, 0.0), data, 1)
  _, plain = run_rounds(
    fedavg.fedavg(model, 3, optax.sgd(0.1), batching), data, 1
  )
  _, some = run_rounds(make(model, 3, optax.sgd(0.1), batching, 0.1), data, 1)
  assert max_diff(zero.params, plain.params) < 1e-6
  assert max_diff(some.params, plain.params) > 1e-4
  headless = models.Model('headless', model.init, model.apply)
  with pytest.raises(ConfigError, match='--model'):
    make(headless, 3, optax.sgd(0.1), batching, 0.1)


def test_the_class_means_snippet_of_add_an_algorithm_runs_as_printed():
  """docs/add_an_algorithm.md's algorithm uploading per-class mean logits,
  as printed: the server's table holds the classes the clients trained on,
  the round moves the table and no model, and the penalty's weight changes
  the clients' models."""
  import jax
  import numpy as np
  import optax
  from helpers import digits_data, max_diff, run_rounds

  from fedjax_personal import models
  from fedjax_personal.core.batching import Batching

  code = fenced('docs/add_an_algorithm.md', 'python')[4]
  scope = {'__name__': 'class_means_doc'}
  exec(compile(code, 'docs/add_an_algorithm.md', 'exec'), scope)
  data = digits_data(num_clients=3, max_examples=20)
  k = data.num_classes
  model = models.create_model('mlp', k, data.train.x[0, :1])
  batching = Batching(batch_size=8, num_epochs=1)
  make = scope['logit_means']
  alg = make(model, 3, k, optax.sgd(0.1), batching, 0.5)
  runner, state = run_rounds(alg, data, 1)
  state, metrics = runner.round(state, jax.random.key(1), 1)
  labels = set()
  for i in range(3):
    n = int(data.train.num_examples[i])
    labels |= set(np.asarray(data.train.y[i][:n]).tolist())
  assert set(np.flatnonzero(np.asarray(state.present))) == labels
  assert float(metrics['bytes_up']) == 3 * k * (k * 4 + 1)
  _, none = run_rounds(
    make(model, 3, k, optax.sgd(0.1), batching, 0.0), data, 2
  )
  assert max_diff(state.models, none.models) > 1e-4


def test_the_cyclic_training_snippet_of_add_an_algorithm_runs_as_printed():
  """docs/add_an_algorithm.md's chained algorithm, as printed: the round's
  clients train one model in turn, each from the model the client before
  it trained (a plain loop of full-batch steps over the cohort in order)."""
  import jax
  import optax
  from helpers import digits_data, max_diff

  from fedjax_personal import models
  from fedjax_personal.core.batching import Batching
  from fedjax_personal.core.engine import RoundRunner
  from fedjax_personal.core.executors import VmapExecutor
  from fedjax_personal.core.losses import Batch, batch_loss
  from fedjax_personal.core.sampling import CohortSampler

  code = fenced('docs/add_an_algorithm.md', 'python')[5]
  scope = {'__name__': 'cyclic_doc'}
  exec(compile(code, 'docs/add_an_algorithm.md', 'exec'), scope)
  data = digits_data(num_clients=3, max_examples=20)
  model = models.create_model('mlp', data.num_classes, data.train.x[0, :1])
  alg = scope['cyclic_training'](model, 3, optax.sgd(0.1), Batching(64, 2))
  sampler = CohortSampler(3, cohort_size=3)
  runner = RoundRunner(alg, data, sampler, VmapExecutor())
  state = runner.init(jax.random.key(0))
  want = state
  state, metrics = runner.round(state, jax.random.key(1), 0)
  grad = jax.grad(lambda p, b: batch_loss(model, p, b)[0])
  for i in range(3):  # the cohort of every client, in id order
    n = int(data.train.num_examples[i])
    batch = Batch(
      data.train.x[i, :n], data.train.y[i, :n], jax.numpy.ones(n, bool)
    )
    for _ in range(2):
      want = jax.tree.map(lambda p, g: p - 0.1 * g, want, grad(want, batch))
  assert max_diff(state, want) < 1e-5
  assert float(metrics['num_active']) == 3


def test_the_fedjax_script_of_from_fedjax_runs_as_printed(capsys):
  """docs/from_fedjax.md's FedJAX script, as printed: three rounds of
  FedJAX's fed_avg under the vmap backend, then FedJAX's evaluation."""
  (code,) = fenced('docs/from_fedjax.md', 'python')
  exec(compile(code, 'docs/from_fedjax.md', 'exec'), {'__name__': 'doc'})
  printed = capsys.readouterr().out
  assert "'accuracy'" in printed and "'loss'" in printed
