"""notebooks/quickstart.ipynb executes top to bottom (its code cells, in order;
shell lines such as '!pip install' are skipped). Slow (30 s on 2 cores): run
with  python -m pytest -m slow tests/test_notebook.py"""

import json
import os

import matplotlib
import pytest

NOTEBOOK = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  'notebooks',
  'quickstart.ipynb',
)


@pytest.mark.slow
def test_quickstart_notebook_runs():
  matplotlib.use('Agg')
  nb = json.load(open(NOTEBOOK))
  namespace = {}
  for cell in nb['cells']:
    if cell['cell_type'] != 'code':
      continue
    src = ''.join(cell['source'])
    src = '\n'.join(
      l for l in src.splitlines() if not l.lstrip().startswith(('!', '%'))
    )
    exec(compile(src, 'quickstart.ipynb', 'exec'), namespace)
  summaries = namespace['summaries']
  assert set(summaries) == {'fedavg', 'local', 'fedalt', 'ditto'}
  for s in summaries.values():
    assert 0 <= s['accuracy_worst'] <= s['accuracy_mean'] <= 1
  # The sharded cell: 1,000 clients over every local device (one on this CPU).
  assert namespace['sharded'].describe().startswith('sharded(')
  assert 0 <= namespace['history'][-1]['accuracy_mean'] <= 1
