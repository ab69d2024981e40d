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
  for pkg in (
    fedjax_personal,
    fedjax_personal.algorithms,
    fedjax_personal.datasets,
  ):
    names.add(pkg.__name__)
    names.update(
      m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.')
    )
  return sorted(names)


def _documented(obj) -> bool:
  doc = obj.__dict__.get('__doc__') if inspect.isclass(obj) else obj.__doc__
  if not doc or not doc.strip():
    return False
  return not (
    inspect.isclass(obj)
    and dataclasses.is_dataclass(obj)
    and doc.startswith(obj.__name__ + '(')
  )


def test_every_public_function_and_class_has_a_docstring():
  missing, seen = [], 0
  for name in _modules():
    module = importlib.import_module(name)
    for attr, obj in vars(module).items():
      if attr.startswith('_') or not (
        inspect.isfunction(obj) or inspect.isclass(obj)
      ):
        continue
      if getattr(obj, '__module__', None) != name:
        continue  # imported from elsewhere: checked where it is defined
      seen += 1
      if not _documented(obj):
        missing.append(f'{name}.{attr}')
  assert seen > 300
  assert not missing, (
    f'{len(missing)} public names without a docstring: {missing}'
  )


def test_every_class_docstring_opens_with_a_summary_line():
  """Every class of the package, ``algorithms/`` and ``datasets/`` (private
  and nested ones too) opens its docstring with a one-line summary ending in
  a period, then a blank line before anything more (Google's style)."""
  import ast
  import os

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  bad, seen = [], 0
  for top in ('fedjax_personal', 'algorithms', 'datasets'):
    for folder, _, files in os.walk(os.path.join(root, top)):
      for f in files:
        if not f.endswith('.py'):
          continue
        path = os.path.join(folder, f)
        with open(path) as fh:
          tree = ast.parse(fh.read())
        for node in ast.walk(tree):
          if not isinstance(node, ast.ClassDef):
            continue
          seen += 1
          doc = ast.get_docstring(node, clean=False) or ''
          lines = doc.split('\n')
          if not lines[0].strip().endswith('.') or (
            len(lines) > 1 and lines[1].strip()
          ):
            bad.append(f'{os.path.relpath(path, root)}:{node.name}')
  assert seen > 300
  assert not bad, f'classes without a one-line summary: {bad}'


def test_every_module_declares_its_public_names():
  """``__all__`` in every module: the names a user may rely on (the others
  are the module's own helpers), each of them there."""
  missing, unknown, foreign = [], [], []
  for name in _modules():
    module = importlib.import_module(name)
    if not isinstance(getattr(module, '__all__', None), (list, tuple)):
      missing.append(name)
      continue
    unknown += [f'{name}.{a}' for a in module.__all__ if not hasattr(module, a)]
    foreign += [
      f'{name}.{a}'
      for a in module.__all__
      if hasattr(module, a) and _foreign(a, getattr(module, a))
    ]
  assert not missing, (
    f'modules without __all__ (the names users may rely on; the rest are its '
    f'helpers): {missing}'
  )
  assert not unknown, f'__all__ names that do not exist: {unknown}'
  assert not foreign, (
    f'__all__ names of other packages (os, np, typing...): {foreign}'
  )


def _foreign(name: str, obj) -> bool:
  """Another package's module or typing name (what a module imports, not what
  it offers; a type alias of its own, ``PyTree = Any``, is its own)."""
  import typing

  if inspect.ismodule(obj):
    return not obj.__name__.startswith('fedjax_personal')
  return getattr(typing, name, None) is obj


def test_every_public_function_says_its_arguments_and_results():
  """Every function of every module's ``__all__`` has Google-style
  ``Args:`` (when it takes any) and ``Returns:`` (or ``Yields:``)
  sections, each ``Args:`` entry naming one of its parameters. An
  algorithm's ``build`` and ``check`` follow one contract, written once in
  ``AlgorithmSpec``'s attributes."""
  import re

  bad, wrong, seen = set(), set(), 0
  for name in _modules():
    module = importlib.import_module(name)
    for attr in module.__all__:
      obj = getattr(module, attr)
      if not inspect.isfunction(obj) or obj.__module__ != name:
        # classes have their docstring test; re-exports are checked where
        # defined
        continue
      if name.startswith('fedjax_personal.algorithms.') and attr in (
        'build',
        'check',
      ):
        continue
      seen += 1
      doc = obj.__doc__ or ''
      params = [
        p for p in inspect.signature(obj).parameters if p not in ('self', 'cls')
      ]
      if (params and 'Args:' not in doc) or not (
        'Returns:' in doc or 'Yields:' in doc
      ):
        bad.add(f'{name}.{attr}')
      if 'Args:' in doc:
        section = re.split(
          r'\n\s*(?:Returns|Yields|Raises):', doc.split('Args:')[1]
        )[0]
        named = re.findall(r'^ {4}(\w+)(?:, \w+)*:', section, re.M)
        if set(named) - set(inspect.signature(obj).parameters):
          wrong.add(
            f'{name}.{attr}: '
            f'{sorted(set(named) - set(inspect.signature(obj).parameters))}'
          )
  assert seen > 300
  assert not bad, (
    f'public functions without Google-style Args: / Returns: sections (see any '
    f'module of the package): {sorted(bad)}'
  )
  assert not wrong, f'Args: entries that name no parameter: {sorted(wrong)}'


def _public_use(code: str):
  """Names ``code`` takes from this package that are not in the ``__all__``
  of the module it takes them from (imports and ``alias.name`` chains)."""
  import re

  aliases, bad = {}, []
  for m in re.finditer(r'^import (fedjax_personal[\w.]*) as (\w+)', code, re.M):
    aliases[m.group(2)] = m.group(1)
  for m in re.finditer(
    r'^from (fedjax_personal[\w.]*) import ([\w, ]+)', code, re.M
  ):
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
  notebook = json.load(
    open(os.path.join(root, 'notebooks', 'quickstart.ipynb'))
  )
  code += '\n' + '\n'.join(
    ''.join(c['source']) for c in notebook['cells'] if c['cell_type'] == 'code'
  )
  assert 'fedjax_personal' in code
  assert _public_use(code) == []
  assert _public_use('import fedjax_personal as fp\nfp.core.engine._row') != []
