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
