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


def test_the_docs_commands_run_as_printed(user_folder):
  (bash,) = _doc_blocks('bash')
  lines = [shlex.split(l) for l in bash.strip().splitlines()]
  runs = []
  for i, words in enumerate(lines):
    assert words[:2] == ['python', 'scripts/run_experiment.py'], words
    runs.append(words[2:] + ['--progress=false', f'--output_dir={user_folder}/doc{i}'])
  results = main_in_one_process(runs, cwd=str(user_folder))
  for (code, err), words in zip(results, lines):
    assert code == 0, (words, err)
  for alg in ('fedavg', 'fedbn', 'ditto'):
    assert _records(user_folder / 'doc0', alg)[-1]['accuracy_mean'] > 0.3, alg


RUN = ['--import=my_cnn.py', '--model=my_cnn', '--algorithm=fedavg,fedbn,ditto',
       '--dataset=digits', '--num_clients=6', '--eval_every=1', '--progress=false']


def test_executors_layouts_resume_and_options(user_folder):
  out = lambda name: f'--output_dir={user_folder}/{name}'
  runs = [
      [*RUN, '--rounds=3', '--checkpoint_every=1', out('whole')],  # the default executor
      [*RUN, '--rounds=3', '--executor=sequential', out('seq')],
      [*RUN, '--rounds=3', '--executor=blocked', '--block_size=2', out('blocked')],
      [*RUN, '--rounds=3', '--executor=vmap', out('vmap')],
      [*RUN, '--rounds=3', '--layout=host', out('host')],
      [*RUN, '--rounds=1', '--checkpoint_every=1', out('resumed')],  # stopped after round 1
      [*RUN, '--rounds=3', '--checkpoint_every=1', '--resume', out('resumed')],
      [*RUN, '--rounds=3', '--my_cnn_dropout=0', '--executor=vmap', out('no_dropout')],
  ]
  results = main_in_one_process(runs, cwd=str(user_folder))
  for (code, err), args in zip(results, runs):
    assert code == 0, (args, err)
  for alg in ('fedavg', 'fedbn', 'ditto'):
    want = _records(user_folder / 'whole', alg)
    # vmap runs the cohort's convolutions as one grouped convolution and the others
    # their evaluation in other chunks: the same sums in another order (float
    # reassociation); the resumed run is the same program as the whole one, to the bit.
    for other, tol in (('seq', 1e-6), ('blocked', 1e-6), ('vmap', 1e-5), ('host', 1e-6),
                       ('resumed', 0)):
      got = _records(user_folder / other, alg)
      diff = [(g['round'], k, g.get(k), w.get(k)) for g, w in zip(got, want) for k in w
              if k.startswith(('accuracy', 'loss', 'train'))
              and abs(g.get(k) - w.get(k)) > tol * max(1.0, abs(w.get(k)))]
      assert len(got) == len(want) and not diff, (alg, other, diff[:5])
    plain = _records(user_folder / 'no_dropout', alg)
    assert plain[-1]['train_loss'] != want[-1]['train_loss'], alg
  identity = json.load(open(user_folder / 'whole' / 'identity.json'))
  assert 'my_cnn' in json.dumps(identity)


def test_a_changed_model_file_refuses_resume_and_a_broken_one_is_one_line(user_folder):
  folder = user_folder / 'changed'
  folder.mkdir()
  source = (user_folder / 'my_cnn.py').read_text()
  (folder / 'my_cnn.py').write_text(source)
  args = [*RUN, '--algorithm=fedavg', '--rounds=1', '--checkpoint_every=1',
          f'--output_dir={folder}/run']
  edit = (f'open({str(folder / "my_cnn.py")!r}, "w").write('
          f'{source.replace("nn.Dense(64)", "nn.Dense(32)")!r})')
  broken = source.replace('return MyCNN(num_classes, dropout)',
                          'return MyCNN(num_classes, dropout, missing=1)')
  (folder / 'broken.py').write_text(broken.replace("'my_cnn'", "'my_broken_cnn'"))
  results = main_in_one_process([
      args, edit, [*args[:-1], '--rounds=2', '--resume', f'--output_dir={folder}/run'],
      ['--import=broken.py', '--model=my_broken_cnn', '--algorithm=fedavg', '--dataset=digits',
       '--rounds=1', f'--output_dir={folder}/broken'],
  ], cwd=str(folder))
  (code0, err0), (code1, err1), (code2, err2) = results
  assert code0 == 0, err0
  assert code1 == 2 and 'Traceback' not in err1 and 'import' in err1, err1
  lines = [l for l in err2.splitlines() if l.startswith('error:')]
  assert code2 == 2 and 'Traceback' not in err2 and len(lines) == 1, err2
  assert 'broken.py:' in lines[0] and 'missing' in lines[0], lines
