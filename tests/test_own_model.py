"""A user's own model through the command, as docs/add_a_model.md prints it:
its file by ``--import``, ``--model=my_cnn`` under FedAvg, FedBN and Ditto;
the same numbers on every executor and in the host layout, after an
interrupted run's ``--resume``, and for two evaluations of one state; its
dropout option changes the training; a changed model file refuses
``--resume``; a builder that fails or does not fit the data is one line."""

import json
import os
import re
import shlex

import pytest
from helpers import main_in_one_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, 'docs', 'add_a_model.md')


def _doc_blocks(lang):
  return re.findall(r'```' + lang + r'\n(.*?)```', open(DOC).read(), flags=re.S)


@pytest.fixture(scope='module')
def user_folder(tmp_path_factory):
  folder = tmp_path_factory.mktemp('user')
  (python,) = _doc_blocks('python')
  (folder / 'my_cnn.py').write_text(python)
  return folder


def _records(folder, alg):
  strip = lambda r: {k: v for k, v in r.items() if 'seconds' not in k}
  return [strip(json.loads(l)) for l in open(folder / alg / 'metrics.jsonl')]


def _summary(folder):
  return json.load(open(folder / 'summary.json'))


@pytest.mark.slow
def test_the_docs_commands_run_as_printed(user_folder):
  (bash,) = _doc_blocks('bash')
  lines = [shlex.split(l) for l in bash.strip().splitlines()]
  runs = []
  for i, words in enumerate(lines):
    assert words[:2] == ['python', 'scripts/run_experiment.py'], words
    runs.append(
      words[2:] + ['--progress=false', f'--output_dir={user_folder}/doc{i}']
    )
  results = main_in_one_process(runs, cwd=str(user_folder))
  for (code, err), words in zip(results, lines):
    assert code == 0, (words, err)
  for alg in ('fedavg', 'fedbn', 'ditto'):
    assert _records(user_folder / 'doc0', alg)[-1]['accuracy_mean'] > 0.3, alg


RUN = [
  '--import=my_cnn.py',
  '--model=my_cnn',
  '--algorithm=fedavg,fedbn,ditto',
  '--dataset=digits',
  '--num_clients=4',
  '--eval_every=1',
  '--progress=false',
]
SCORES = ('accuracy', 'loss', 'train')


def _same(got, want, tol):
  """Rounds of two runs' records whose scores differ by more than ``tol``
  (relative)."""
  assert len(got) == len(want)
  return [
    (g['round'], k, g.get(k), w.get(k))
    for g, w in zip(got, want)
    for k in w
    if k.startswith(SCORES)
    and abs(g.get(k) - w.get(k)) > tol * max(1.0, abs(w.get(k)))
  ]


@pytest.fixture(scope='module')
def whole(user_folder):
  """The uninterrupted run (the default executor) every other is compared
  with."""
  [(code, err)] = main_in_one_process(
    [
      [
        *RUN,
        '--rounds=2',
        '--checkpoint_every=1',
        f'--output_dir={user_folder}/whole',
      ]
    ],
    cwd=str(user_folder),
  )
  assert code == 0, err
  return user_folder / 'whole'


def _compare(user_folder, whole, runs):
  """Runs ``[(name, args, tolerance)]`` (one after another; a name twice: the
  same folder) and compares each algorithm's records with the whole run's."""
  results = main_in_one_process(
    [args + [f'--output_dir={user_folder}/{name}'] for name, args, _ in runs],
    cwd=str(user_folder),
  )
  for (code, err), (name, _, _) in zip(results, runs):
    assert code == 0, (name, err)
  for alg in ('fedavg', 'fedbn', 'ditto'):
    want = _records(whole, alg)
    for name, _, tol in runs:
      if tol is not None:
        diff = _same(_records(user_folder / name, alg), want, tol)
        assert not diff, (alg, name, diff[:5])


@pytest.mark.slow
def test_resume_vmap_and_its_dropout_option(user_folder, whole):
  """An interrupted run's --resume (the same program: to the bit) and the
  vmap executor (the cohort's convolutions as one grouped convolution, the
  same sums in another order) give the whole run's numbers; a dropout rate
  of 0 trains otherwise; the run identity names the model."""
  _compare(
    user_folder,
    whole,
    [
      # stopped after round 1
      (
        'resumed',
        [*RUN, '--rounds=1', '--checkpoint_every=1'],
        None,
      ),
      (
        'resumed',
        [*RUN, '--rounds=2', '--checkpoint_every=1', '--resume'],
        0.0,
      ),
      ('vmap', [*RUN, '--rounds=2', '--executor=vmap'], 1e-5),
      ('no_dropout', [*RUN, '--rounds=2', '--my_cnn_dropout=0'], None),
    ],
  )
  for alg in ('fedavg', 'fedbn', 'ditto'):
    plain = _records(user_folder / 'no_dropout', alg)
    assert plain[-1]['train_loss'] != _records(whole, alg)[-1]['train_loss'], (
      alg
    )
  identity = json.load(open(whole / 'identity.json'))
  assert 'my_cnn' in json.dumps(identity)


@pytest.mark.slow
def test_sequential_blocked_and_host_layout(user_folder, whole):
  """The other executors and the host layout (their evaluation in other
  chunks: float reassociation only)."""
  _compare(
    user_folder,
    whole,
    [
      ('seq', [*RUN, '--rounds=2', '--executor=sequential'], 1e-6),
      (
        'blocked',
        [*RUN, '--rounds=2', '--executor=blocked', '--block_size=2'],
        1e-6,
      ),
      ('host', [*RUN, '--rounds=2', '--layout=host'], 1e-6),
    ],
  )


@pytest.mark.slow
def test_a_changed_model_file_refuses_resume_and_a_broken_one_is_one_line(
  user_folder,
):
  folder = user_folder / 'changed'
  folder.mkdir()
  source = (user_folder / 'my_cnn.py').read_text()
  (folder / 'my_cnn.py').write_text(source)
  args = [a for a in RUN if not a.startswith('--algorithm')] + [
    '--algorithm=fedavg',
    '--checkpoint_every=1',
    f'--output_dir={folder}/run',
  ]
  edit = (
    f'open({str(folder / "my_cnn.py")!r}, "w").write('
    f'{source.replace("nn.Dense(64)", "nn.Dense(32)")!r})'
  )
  broken = source.replace(
    'return MyCNN(num_classes, dropout)',
    'return MyCNN(num_classes, dropout, missing=1)',
  )
  (folder / 'broken.py').write_text(
    broken.replace("'my_cnn'", "'my_broken_cnn'")
  )
  results = main_in_one_process(
    [
      [*args, '--rounds=1'],
      edit,
      [*args, '--rounds=2', '--resume'],
      [
        '--import=broken.py',
        '--model=my_broken_cnn',
        '--algorithm=fedavg',
        '--dataset=digits',
        '--rounds=1',
        f'--output_dir={folder}/broken',
      ],
    ],
    cwd=str(folder),
  )
  (code0, err0), (code1, err1), (code2, err2) = results
  assert code0 == 0, err0
  assert code1 == 2 and 'Traceback' not in err1 and 'import' in err1, err1
  lines = [l for l in err2.splitlines() if l.startswith('error:')]
  assert code2 == 2 and 'Traceback' not in err2 and len(lines) == 1, err2
  assert 'broken.py:' in lines[0] and 'missing' in lines[0], lines
