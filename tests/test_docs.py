"""Every command shown in README.md and BUILD.md runs: the fenced ``bash``
blocks' commands are extracted and run with ``--dry_run`` (each script
checks every flag, loads its data and builds what it would run, then stops)
or, for the README's Python example, at a tiny size. Install and test
commands are checked against what they name (extras, files, markers): CI
runs the README's own install and test commands (``.ci/run``). The docs'
size limits and headings are checked too."""

import configparser
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ('README.md', 'BUILD.md')


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
    m = re.match(r"\.\[(.*)\]$", w)
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
  args = [w for w in words[2:] if not w.startswith(('--coordinator_address', '--num_processes',
                                                     '--process_id'))]
  launch = [w for w in words[2:] if w not in args]
  if launch:  # several processes: the launch settings are valid; one process dry-runs
    from fedjax_personal.run import distributed
    flags = dict(w[2:].split('=', 1) for w in launch)
    got = distributed.settings(flags.get('coordinator_address'),
                               int(flags['num_processes']) if 'num_processes' in flags else None,
                               int(flags['process_id']) if 'process_id' in flags else None)
    assert got is not None
  if '--download' in args:  # the suite never downloads: the files, made, in --data_dir
    args = [a for a in args if a != '--download'] + [f'--data_dir={_made_data(args)}']
  r = subprocess.run([sys.executable, script, *args, '--dry_run'], cwd=ROOT, capture_output=True,
                     text=True, timeout=300,
                     env={**os.environ, **env, 'JAX_PLATFORMS': 'cpu'})
  assert r.returncode == 0, f'{" ".join(words)}\n{r.stderr[-3000:]}'


def _made_data(args):
  """A folder with made files of the command's --dataset (FedJAX EMNIST:
  as many small writers as --num_clients asks for)."""
  import tempfile
  import numpy as np
  import made_files
  flags = dict(a[2:].split('=', 1) for a in args if a.startswith('--') and '=' in a)
  assert flags.get('dataset') == 'emnist', f'teach _made_data the files of {flags.get("dataset")}'
  folder = tempfile.mkdtemp(prefix='made_data_')
  n = int(flags.get('num_clients', 3))
  import pathlib
  made_files.write_emnist(pathlib.Path(folder), np.random.default_rng(0), [4] * n, [2] * n)
  return folder


@pytest.mark.parametrize('doc,cmd', commands(), ids=lambda x: x[:80] if isinstance(x, str) else x)
def test_documented_command_runs(doc, cmd):
  for part in cmd.split('&&'):
    env, words = _parts(part.strip())
    if words[:4] == ['python', '-m', 'pip', 'install'] or words[:2] == ['pip', 'install']:
      check_install(words)
    elif words[:3] == ['python', '-m', 'pytest']:
      check_pytest(words)
    elif words[:2] == ['bash', '.ci/run']:
      assert os.access(os.path.join(ROOT, '.ci', 'run'), os.X_OK)
    elif words[0] == 'python' and words[1].startswith(('scripts/', 'benchmarks/')):
      run_script(env, words)
    else:
      pytest.fail(f'{doc}: no check for the command {cmd!r}; teach tests/test_docs.py')


def test_readme_python_example_runs():
  (code,) = fenced('README.md', 'python')
  code = code.replace('num_rounds=20', 'num_rounds=2').replace('eval_every=5', 'eval_every=2')
  namespace = {}
  exec(compile(code, 'README.md', 'exec'), namespace)
  assert 0 <= namespace['history'][-1]['accuracy_worst'] <= 1


def test_add_an_algorithm_tutorial_runs_as_printed(tmp_path, monkeypatch, capsys):
  """docs/add_an_algorithm.md's file and script, exactly as printed: the
  script registers the algorithm, which then runs through the CLI beside
  FedAvg. With rate 0 it is FedAvg; with rate 0.5 the rounds count only the
  clients that uploaded (num_active, bytes_up) and every sampled one in
  num_sampled."""
  from fedjax_personal import algorithms
  from fedjax_personal.run import cli
  from helpers import parse_flags
  module, script = fenced('docs/add_an_algorithm.md', 'python')
  (tmp_path / 'fedavg_dropout.py').write_text(module)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.delitem(sys.modules, 'fedavg_dropout', raising=False)
  monkeypatch.setattr(algorithms, 'REGISTRY', dict(algorithms.REGISTRY))
  exec(compile(script, 'docs/add_an_algorithm.md', 'exec'), {'__name__': 'my_script'})
  common = ('--dataset=digits', '--num_clients=8', '--cohort_size=4', '--model=logreg',
            '--rounds=3', '--eval_every=1', '--progress=false')
  parse_flags('--algorithm=fedavg,fedavg_dropout', '--dropout_rate=0', *common,
              f'--output_dir={tmp_path}/zero')
  out = cli.main_job()
  assert out['fedavg_dropout']['accuracy_mean'] == out['fedavg']['accuracy_mean']
  assert out['fedavg_dropout']['total_bytes_up'] == out['fedavg']['total_bytes_up']
  parse_flags('--algorithm=fedavg_dropout', '--dropout_rate=0.5', *common,
              f'--output_dir={tmp_path}/half')
  cli.main_job()
  records = [json.loads(l) for l in open(tmp_path / 'half' / 'fedavg_dropout' / 'metrics.jsonl')]
  rounds = [r for r in records if 'num_sampled' in r]
  assert len(rounds) == 3 and all(r['num_sampled'] == 4 for r in rounds)
  assert sum(r['num_active'] for r in rounds) < 12  # 0.5 ** 12: this seed drops someone
  per_client = out['fedavg']['total_bytes_up'] / 12
  assert all(r['bytes_up'] == r['num_active'] * per_client for r in rounds)
  parse_flags('--algorithm=fedavg_dropout', '--dropout_rate=1', *common)
  with pytest.raises(cli.ConfigError, match='dropout_rate'):
    cli.main_job()


def test_docs_are_guides_within_their_size():
  """Prose within its size; table rows (a data set, an algorithm, a
  measurement) are not counted, so adding one breaks nothing."""
  for doc, most in (('README.md', 200), ('BUILD.md', 900)):
    lines = open(os.path.join(ROOT, doc)).read().splitlines()
    prose = [l for l in lines if not l.lstrip().startswith('|')]
    assert len(prose) < most, f'{doc}: {len(prose)} lines besides its tables, keep under {most}'


def test_nothing_is_named_after_a_work_item():
  bad = []
  for base, dirs, files in os.walk(ROOT):
    dirs[:] = [d for d in dirs if not d.startswith('.') and d not in ('runs', '__pycache__')
               and not d.endswith('.egg-info')]
    for name in dirs + files:
      if re.search(r'issue_?\d', name, re.I):
        bad.append(os.path.relpath(os.path.join(base, name), ROOT))
  for doc in DOCS + ('docs/history.md', 'benchmarks/README.md'):
    for line in open(os.path.join(ROOT, doc)):
      if line.startswith('#') and re.search(r'\bissues? \d', line, re.I):
        bad.append(f'{doc}: {line.strip()}')
  assert not bad, bad
