"""Every third-party module the code imports is declared in setup.cfg: a
module imported by the package itself in ``install_requires``, one imported
only by optional paths (scripts' PyTorch rows, ``--init_weights`` of a
``.pt``, preparing TFDS data) in an extra."""

import ast
import configparser
import importlib.metadata
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIRS = ('fedjax_personal', 'algorithms', 'datasets')
SCRIPT_DIRS = ('scripts', 'benchmarks')
# This package, the tests' helpers, and the scripts' own modules that other
# scripts import by path (scripts/torch_loop.py, benchmarks/populations.py...).
OWN = {'fedjax_personal', 'helpers', 'made_files'} | {
  f[:-3]
  for d in SCRIPT_DIRS
  for _, _, files in os.walk(os.path.join(ROOT, d))
  for f in files
  if f.endswith('.py')
}
# The peer's code runs in its own environment (benchmarks/peers: FedJAX 0.0.17
# with its JAX, installed by benchmarks/peers/run.py), never in this package's.
# flcore, utils: PFLlib's system/ folder, which
# benchmarks/peers/pfllib_reference.py puts on the path (PFLlib is not a
# distribution).
PEER = {'fedjax', 'haiku', 'flcore', 'utils'}  # haiku: FedJAX's models' library
# Modules whose distribution may be absent from the test environment (an
# extra's), by their import name.
OPTIONAL = {
  'torch': 'torch',
  'tensorflow': 'tensorflow-cpu',
  'array_record': 'array-record',
}


def _norm(name: str) -> str:
  return re.sub(r'[-_.]+', '-', name).lower()


def _requirements(lines: str):
  out = set()
  for line in lines.splitlines():
    line = line.split('#')[0].strip()
    if line:
      out.add(_norm(re.split(r'[<>=!~;\[ ]', line)[0]))
  return out


def declared():
  cfg = configparser.ConfigParser()
  cfg.read(os.path.join(ROOT, 'setup.cfg'))
  required = _requirements(cfg['options']['install_requires'])
  extras = set()
  for _, lines in cfg['options.extras_require'].items():
    extras |= _requirements(lines)
  return required, extras


def imports(dirs):
  """{top-level module: [file, ...]} of every import in ``dirs``, with
  whether any import of it is at module level (not inside a function)."""
  found = {}
  for d in dirs:
    for base, _, files in os.walk(os.path.join(ROOT, d)):
      for f in files:
        if not f.endswith('.py'):
          continue
        path = os.path.join(base, f)
        tree = ast.parse(open(path).read())
        top = set(id(n) for n in tree.body)
        for node in ast.walk(tree):
          if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
          elif (
            isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
          ):
            names = [node.module]
          else:
            continue
          for n in names:
            mod = n.split('.')[0]
            if mod in sys.stdlib_module_names or mod in OWN or mod in PEER:
              continue
            found.setdefault(mod, []).append(
              (os.path.relpath(path, ROOT), id(node) in top)
            )
  return found


def distributions(module: str):
  if module in OPTIONAL:
    return {_norm(OPTIONAL[module])}
  dists = importlib.metadata.packages_distributions().get(module)
  assert dists, f'{module}: imported but no installed distribution provides it'
  return {_norm(d) for d in dists}


def test_every_imported_module_is_declared():
  required, extras = declared()
  missing = []
  for mod, where in sorted(imports(PACKAGE_DIRS + SCRIPT_DIRS).items()):
    dists = distributions(mod)
    in_package_top = any(
      top and not f.startswith(SCRIPT_DIRS) for f, top in where
    )
    ok = dists & required if in_package_top else dists & (required | extras)
    if not ok:
      missing.append(f'{mod} ({sorted(dists)}; {where[0][0]})')
  assert not missing, 'not declared in setup.cfg: ' + ', '.join(missing)


def test_declared_requirements_have_lower_bounds():
  cfg = configparser.ConfigParser()
  cfg.read(os.path.join(ROOT, 'setup.cfg'))
  for line in cfg['options']['install_requires'].splitlines():
    line = line.split('#')[0].strip()
    if line:
      assert '>=' in line, (
        f'{line}: give the oldest release the code works with'
      )


def test_constraints_pin_every_requirement():
  required, _ = declared()
  pins = {}
  for line in open(os.path.join(ROOT, 'constraints.txt')):
    line = line.split('#')[0].strip()
    if '==' in line:
      name, version = line.split('==')
      pins[_norm(name)] = version
  assert required <= set(pins), sorted(required - set(pins))
