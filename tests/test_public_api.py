"""Every public function and class of the package (the core, the
algorithms, the data sets: a name without a leading underscore, defined in
its module) has a docstring of its own, not an inherited one nor the
signature a dataclass writes."""

import dataclasses
import importlib
import inspect
import pkgutil

import fedjax_personal
import fedjax_personal.algorithms
import fedjax_personal.datasets


def _modules():
  names = set()
  for pkg in (fedjax_personal, fedjax_personal.algorithms, fedjax_personal.datasets):
    names.add(pkg.__name__)
    names.update(m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'))
  return sorted(names)


def _documented(obj) -> bool:
  doc = obj.__dict__.get('__doc__') if inspect.isclass(obj) else obj.__doc__
  if not doc or not doc.strip():
    return False
  return not (inspect.isclass(obj) and dataclasses.is_dataclass(obj)
              and doc.startswith(obj.__name__ + '('))


def test_every_public_function_and_class_has_a_docstring():
  missing, seen = [], 0
  for name in _modules():
    module = importlib.import_module(name)
    for attr, obj in vars(module).items():
      if attr.startswith('_') or not (inspect.isfunction(obj) or inspect.isclass(obj)):
        continue
      if getattr(obj, '__module__', None) != name:
        continue  # imported from elsewhere: checked where it is defined
      seen += 1
      if not _documented(obj):
        missing.append(f'{name}.{attr}')
  assert seen > 300
  assert not missing, f'{len(missing)} public names without a docstring: {missing}'


def test_every_module_declares_its_public_names():
  """``__all__`` in every module: the names a user may rely on (the others
  are the module's own helpers), each of them there."""
  missing, unknown = [], []
  for name in _modules():
    module = importlib.import_module(name)
    if not isinstance(getattr(module, '__all__', None), (list, tuple)):
      missing.append(name)
      continue
    unknown += [f'{name}.{a}' for a in module.__all__ if not hasattr(module, a)]
  assert not missing, f'modules without __all__: {missing}'
  assert not unknown, f'__all__ names that do not exist: {unknown}'


#: What a user meets first: the package's face, the registry, the data
#: sets (FedJAX's load_data, the readers), the loop; and the toolbox of a
#: new algorithm (docs/add_an_algorithm.md): settings, aggregation, local
#: training, stacked per-client state, data, batching, sampling, executors;
#: the run's settings, identity and faults.
FACE = ('fedjax_personal', 'fedjax_personal.algorithms', 'fedjax_personal.datasets',
        'fedjax_personal.datasets.federated', 'fedjax_personal.datasets.natural',
        'fedjax_personal.datasets.emnist', 'fedjax_personal.datasets.shakespeare',
        'fedjax_personal.datasets.stackoverflow', 'fedjax_personal.datasets.cifar100',
        'fedjax_personal.datasets.gldv2', 'fedjax_personal.datasets.leaf',
        'fedjax_personal.run.experiment', 'fedjax_personal.config',
        'fedjax_personal.core.aggregation', 'fedjax_personal.core.training',
        'fedjax_personal.core.algorithm', 'fedjax_personal.core.tree_util',
        'fedjax_personal.core.client_state', 'fedjax_personal.core.batching',
        'fedjax_personal.core.sampling', 'fedjax_personal.core.data',
        'fedjax_personal.core.executors', 'fedjax_personal.models',
        'fedjax_personal.run.faults', 'fedjax_personal.run.run_identity',
        'fedjax_personal.run.settings')


def _algorithm_modules():
  return [m for m in _modules() if m.startswith('fedjax_personal.algorithms.')]


def _dataset_modules():
  return [m for m in _modules() if m.startswith('fedjax_personal.datasets.')]


def test_the_faces_functions_say_their_arguments_and_results():
  """Every function of the face's ``__all__`` (and of every algorithm's and
  data set's module) has Google-style ``Args:`` (when it takes any) and ``Returns:``
  (or ``Yields:``) sections. An algorithm's ``build`` and ``check`` follow
  one contract, written once in ``AlgorithmSpec.build`` / ``check``."""
  bad = set()
  for name in FACE + tuple(_algorithm_modules()) + tuple(_dataset_modules()):
    module = importlib.import_module(name)
    for attr in module.__all__:
      obj = getattr(module, attr)
      if not inspect.isfunction(obj):
        continue
      if name in _algorithm_modules() and attr in ('build', 'check'):
        continue
      doc = obj.__doc__ or ''
      takes = [p for p in inspect.signature(obj).parameters if p not in ('self', 'cls')]
      if (takes and 'Args:' not in doc) or not ('Returns:' in doc or 'Yields:' in doc):
        bad.add(f'{obj.__module__}.{obj.__name__}')
  assert not bad, sorted(bad)


def _public_use(code: str):
  """Names ``code`` takes from this package that are not in the ``__all__``
  of the module it takes them from (imports and ``alias.name`` chains)."""
  import re
  aliases, bad = {}, []
  for m in re.finditer(r'^import (fedjax_personal[\w.]*) as (\w+)', code, re.M):
    aliases[m.group(2)] = m.group(1)
  for m in re.finditer(r'^from (fedjax_personal[\w.]*) import ([\w, ]+)', code, re.M):
    module = importlib.import_module(m.group(1))
    for n in (x.strip() for x in m.group(2).split(',')):
      sub = f'{m.group(1)}.{n}'
      try:
        importlib.import_module(sub)
        aliases[n] = sub  # a submodule
      except ImportError:
        if n not in module.__all__:
          bad.append(sub)
  for m in re.finditer(r'\b(\w+)((?:\.\w+)+)', code):
    if m.group(1) not in aliases:
      continue
    obj = importlib.import_module(aliases[m.group(1)])
    for part in m.group(2).strip('.').split('.'):
      if not inspect.ismodule(obj):
        break  # a function's or class's attributes are its own
      if part not in obj.__all__:
        bad.append(f'{obj.__name__}.{part}')
        break
      obj = getattr(obj, part)
  return sorted(set(bad))


def test_the_readme_and_the_notebook_use_only_public_names():
  import json
  import os
  import re
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  readme = open(os.path.join(root, 'README.md')).read()
  code = '\n'.join(re.findall(r'```python\n(.*?)```', readme, flags=re.S))
  notebook = json.load(open(os.path.join(root, 'notebooks', 'quickstart.ipynb')))
  code += '\n' + '\n'.join(''.join(c['source']) for c in notebook['cells']
                           if c['cell_type'] == 'code')
  assert 'fedjax_personal' in code
  assert _public_use(code) == []
  assert _public_use('import fedjax_personal as fp\nfp.core.engine._row') != []
