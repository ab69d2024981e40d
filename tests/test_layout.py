"""The package's layers: no import cycle between its modules (counting
imports inside functions too), every module importable alone in a fresh
process, and the layers' direction, bottom up: errors and hparams; models
(the pure model pair and its layers); core (the engine); config (the
settings); algorithms and datasets, FedJAX's data API above the data sets;
run (loop, outputs, CLI). A layer
imports only the layers below it."""

import ast
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Source folders and the import name they are installed under (setup.cfg).
FOLDERS = {
  'fedjax_personal': 'fedjax_personal',
  'algorithms': 'fedjax_personal.algorithms',
  'datasets': 'fedjax_personal.datasets',
}


def modules():
  """{module name: path} of every module of the package."""
  out = {}
  for folder, name in FOLDERS.items():
    for base, _, files in os.walk(os.path.join(ROOT, folder)):
      if '__pycache__' in base:
        continue
      rel = os.path.relpath(base, os.path.join(ROOT, folder))
      pkg = name if rel == '.' else name + '.' + rel.replace(os.sep, '.')
      for f in files:
        if f.endswith('.py'):
          mod = pkg if f == '__init__.py' else f'{pkg}.{f[:-3]}'
          out[mod] = os.path.join(base, f)
  return out


def _source(node, mod, is_pkg):
  """The absolute module an ``ImportFrom`` names (relative ones resolved)."""
  if node.level:
    base = mod.split('.')
    base = base[: len(base) - node.level + (1 if is_pkg else 0)]
    return '.'.join(base + ([node.module] if node.module else []))
  return node.module or ''


def reexports(known):
  """{package: {name: the module it comes from}}: the names each package's
  ``__init__`` imports at module level (what ``from package import name``
  reaches)."""
  out = {}
  for m, p in known.items():
    if p.endswith('__init__.py'):
      names = {}
      for node in ast.parse(open(p).read()).body:
        if isinstance(node, ast.ImportFrom):
          src = _source(node, m, True)
          for a in node.names:
            names[a.asname or a.name] = (
              f'{src}.{a.name}' if f'{src}.{a.name}' in known else src
            )
      out[m] = names
  return out


def resolve(src, name, known, exported):
  """The module ``from src import name`` depends on: the submodule
  ``src.name``, else the module a package re-exports ``name`` from
  (followed through packages), else ``src`` itself."""
  seen = set()
  while (
    f'{src}.{name}' not in known
    and name in exported.get(src, {})
    and src not in seen
  ):
    seen.add(src)
    target = exported[src][name]
    if target == src:
      break
    src = target
    if not known.get(src, '').endswith('__init__.py'):
      return src
  if f'{src}.{name}' in known:
    return f'{src}.{name}'
  return _known_prefix(src, known)


def _known_prefix(name, known):
  """The longest dotted prefix of ``name`` that is a package module ('':
  none)."""
  while name and name not in known:
    name = name.rpartition('.')[0]
  return name


def imports_of(path, mod, known, exported=None):
  """The package modules ``mod`` imports (module level and inside
  functions), a name taken from a package resolved to the module that
  package's ``__init__`` has it from: a module importing ``datasets``
  itself depends on everything the package's ``__init__`` imports."""
  exported = reexports(known) if exported is None else exported
  tree = ast.parse(open(path).read())
  is_pkg = path.endswith('__init__.py')
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [_known_prefix(a.name, known) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      src = _source(node, mod, is_pkg)
      targets = [resolve(src, a.name, known, exported) for a in node.names]
    else:
      continue
    out.update(t for t in targets if t and t != mod)
  return out


def graph():
  known = modules()
  exported = reexports(known)
  return {m: imports_of(p, m, known, exported) for m, p in known.items()}


def find_cycle(g):
  """One cycle of the graph as a list of modules, or None."""
  state, stack = {}, []

  def visit(m):
    state[m] = 1
    stack.append(m)
    for n in sorted(g[m]):
      if state.get(n) == 1:
        return stack[stack.index(n) :] + [n]
      if state.get(n) is None:
        found = visit(n)
        if found:
          return found
    stack.pop()
    state[m] = 2
    return None

  for m in sorted(g):
    if state.get(m) is None:
      found = visit(m)
      if found:
        return found
  return None


def test_no_import_cycle():
  """No cycle, counting a package's ``__init__`` as importing what it
  imports (a submodule that needs its own package back is a cycle)."""
  cycle = find_cycle(graph())
  assert cycle is None, 'import cycle: ' + ' -> '.join(cycle)


def test_a_cycle_through_a_package_init_is_seen(tmp_path):
  """``from pkg import name`` follows the re-export to its module, and a
  module importing the package depends on what the package imports."""
  pkg = tmp_path / 'pkg'
  pkg.mkdir()
  (pkg / '__init__.py').write_text('from pkg.b import thing\n')
  (pkg / 'a.py').write_text('import pkg\n')
  (pkg / 'b.py').write_text('from pkg import a\nthing = 1\n')
  (pkg / 'c.py').write_text('from pkg import thing\n')
  known = {
    'pkg': str(pkg / '__init__.py'),
    'pkg.a': str(pkg / 'a.py'),
    'pkg.b': str(pkg / 'b.py'),
    'pkg.c': str(pkg / 'c.py'),
  }
  exported = reexports(known)
  g = {m: imports_of(p, m, known, exported) for m, p in known.items()}
  assert g['pkg.c'] == {'pkg.b'}
  assert find_cycle(g) in (
    ['pkg', 'pkg.b', 'pkg.a', 'pkg'],
    ['pkg.a', 'pkg', 'pkg.b', 'pkg.a'],
  )


#: The only imports inside functions: optional or heavy dependencies,
#: loaded when a run uses them ({module imported: the modules allowed to}).
LAZY_IMPORTS = {
  'torch': {'fedjax_personal.models.weights'},
  'tensorflow_datasets': {'fedjax_personal.datasets.tfds_loader'},
  'matplotlib': {'fedjax_personal.run.plots'},
  'matplotlib.pyplot': {'fedjax_personal.run.plots'},
  'sklearn.cluster': {'fedjax_personal.datasets.partition'},
  'sklearn.datasets': {'fedjax_personal.datasets.in_memory'},
  'dp_accounting': {'fedjax_personal.core.privacy'},
  # defines absl flags of its own when imported: not a command's
  'orbax.checkpoint': {'fedjax_personal.run.checkpointing'},
}


def test_imports_inside_functions_are_optional_heavy_dependencies():
  """At most 15 imports inside functions, each of an optional heavy
  dependency (``LAZY_IMPORTS``): never one that breaks an import cycle."""
  found = []
  for m, path in modules().items():
    for fn in ast.walk(ast.parse(open(path).read())):
      if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for node in ast.walk(fn):
          if isinstance(node, ast.Import):
            found += [(m, a.name) for a in node.names]
          elif isinstance(node, ast.ImportFrom):
            found.append((m, node.module))
  found = sorted(set(found))
  assert len(found) <= 15, found
  bad = [(m, name) for m, name in found if m not in LAZY_IMPORTS.get(name, ())]
  assert not bad, bad


def test_find_cycle_finds_one():
  assert find_cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == [
    'a',
    'b',
    'c',
    'a',
  ]
  assert find_cycle({'a': {'b'}, 'b': set()}) is None


@pytest.mark.parametrize(
  'lower,upper',
  [
    (
      'fedjax_personal.core',
      (
        'fedjax_personal.run',
        'fedjax_personal.algorithms',
        'fedjax_personal.datasets',
        'fedjax_personal.config',
      ),
    ),
    (
      'fedjax_personal.models',
      (
        'fedjax_personal.run',
        'fedjax_personal.algorithms',
        'fedjax_personal.core',
        'fedjax_personal.datasets',
        'fedjax_personal.config',
      ),
    ),
    (
      'fedjax_personal.hparams',
      tuple(
        f'fedjax_personal.{n}'
        for n in (  # errors alone below
          'core',
          'models',
          'config',
          'algorithms',
          'datasets',
          'run',
          'numerics',
          'compilation',
          'checkout',
        )
      ),
    ),
    (
      'fedjax_personal.algorithms',
      ('fedjax_personal.run', 'fedjax_personal.datasets'),
    ),
    (
      'fedjax_personal.datasets',
      (
        'fedjax_personal.run',
        'fedjax_personal.algorithms',
        'fedjax_personal.fedjax',
      ),
    ),
    # FedJAX's data API sits above the data sets, beside the algorithms.
    (
      'fedjax_personal.fedjax',
      ('fedjax_personal.run', 'fedjax_personal.algorithms'),
    ),
    ('fedjax_personal.errors', ('fedjax_personal.',)),
  ],
)
def test_layers_import_downwards_only(lower, upper):
  bad = [
    (m, n)
    for m, deps in graph().items()
    if m == lower or m.startswith(lower + '.')
    for n in deps
    if n.startswith(upper)
  ]
  assert not bad, bad


@pytest.mark.slow
def test_every_module_imports_alone():
  """Each module imported first in a fresh interpreter (one process for all,
  each import in a clean module table)."""
  mods = sorted(m for m in modules() if not m.endswith('__main__'))
  code = (
    'import importlib, sys\n'
    'base = set(sys.modules)\n'
    'bad = []\n'
    f'for m in {mods!r}:\n'
    '  for k in [k for k in sys.modules if k not in base and '
    'k.startswith("fedjax_personal")]:\n'
    '    del sys.modules[k]\n'
    # the flags a module defines: defined again by its next import
    '  from absl import flags\n'
    '  for f in list(flags.FLAGS):\n'
    '    if (flags.FLAGS.find_module_defining_flag(f) or '
    '"").startswith("fedjax_personal"):\n'
    '      delattr(flags.FLAGS, f)\n'
    '  try:\n'
    '    importlib.import_module(m)\n'
    '  except Exception as e:\n'
    '    bad.append(f"{m}: {type(e).__name__}: {e}")\n'
    'print("\\n".join(bad))\n'
    'sys.exit(1 if bad else 0)\n'
  )
  r = subprocess.run(
    [sys.executable, '-c', code],
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
  )
  assert r.returncode == 0, r.stdout + r.stderr[-2000:]


def test_a_second_checkout_never_mixes_with_the_installed_one(tmp_path):
  """Run from another checkout (its folder first on sys.path), every part
  of fedjax_personal comes from that checkout, not the mapped subpackages
  from the installed one; an import that already mixed them is refused in
  one line naming both folders."""
  import shutil
  import subprocess
  import sys

  from fedjax_personal import checkout

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  second = tmp_path / 'second'
  for folder in ('fedjax_personal', 'algorithms', 'datasets'):
    shutil.copytree(
      os.path.join(root, folder),
      second / folder,
      ignore=shutil.ignore_patterns('__pycache__', '*.egg-info', 'data'),
    )
  shutil.copy(os.path.join(root, 'setup.cfg'), second / 'setup.cfg')
  code = (
    'import fedjax_personal, fedjax_personal.datasets.registry as n, '
    'fedjax_personal.algorithms.fedavg as a; print(fedjax_personal.__file__); '
    'print(n.__file__); print(a.__file__)'
  )
  r = subprocess.run(
    [sys.executable, '-c', code],
    cwd=second,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  files = r.stdout.split()
  assert len(files) == 3 and all(f.startswith(str(second)) for f in files), (
    files
  )
  import fedjax_personal.datasets  # noqa: F401  (from this checkout)

  with pytest.raises(ImportError, match='two checkouts mixed'):
    checkout.use_this_checkout(str(second / 'fedjax_personal'))
  assert (
    checkout.checkout_root(str(tmp_path / 'site-packages' / 'fedjax_personal'))
    is None
  )


def test_host_memory_honours_the_address_space_and_cgroup_limits(
  monkeypatch, tmp_path
):
  """The memory plans read what this process may still allocate: the least
  of MemAvailable, the address space ulimit -v leaves and the cgroup's
  limit less its use."""
  import resource

  from fedjax_personal.core.population import placement

  free = placement._meminfo('MemAvailable')
  vm = placement._meminfo('VmSize', '/proc/self/status')
  monkeypatch.setattr(
    resource,
    'getrlimit',
    lambda which: (vm + (1 << 30), resource.RLIM_INFINITY),
  )
  left = placement.host_available_bytes()
  # about 1 GB of address space left
  assert left <= (1 << 30) + (64 << 20) and left < free
  monkeypatch.undo()
  group = tmp_path / 'cg'
  group.mkdir()
  (group / 'memory.max').write_text('3000000000\n')
  (group / 'memory.current').write_text('1000000000\n')
  monkeypatch.setattr(
    'builtins.open', _opening({'/proc/self/cgroup': '0::/cg\n'}, open)
  )
  assert placement._cgroup_left(str(tmp_path)) == 2_000_000_000
  (group / 'memory.max').write_text('max\n')
  assert placement._cgroup_left(str(tmp_path)) is None


def _opening(texts, real_open):
  import io

  def fake(path, *args, **kwargs):
    if path in texts:
      return io.StringIO(texts[path])
    return real_open(path, *args, **kwargs)

  return fake


def test_flags_are_read_by_the_entry_alone():
  """The command's settings are read once, by the entry (``run/experiment_entry.py``'s
  ``read_flags``), into a ``Settings`` passed down: no other library module
  reads an absl flag's value (declaring flags is not reading them)."""
  import re

  reads = re.compile(r'\bFLAGS\s*(\.\s*\w|\[)|\bFLAGS\s*\(')
  found = {}
  for name, path in modules().items():
    code = [l.split('#')[0] for l in open(path).read().splitlines()]
    hits = [l.strip() for l in code if reads.search(l)]
    if hits:
      found[name] = hits
  # parsing argv
  assert set(found) <= {'fedjax_personal.run.script_entry'}, found
  entry = open(modules()['fedjax_personal.run.experiment_entry']).read()
  assert entry.count('read(FLAGS)') == 1


def test_no_message_under_core_names_a_flag():
  """The engine does not know the command line: no string under ``core/``
  but docstrings and comments names a ``--flag`` (its errors name settings
  and values; the entry turns a setting into its flag)."""
  core = os.path.join(ROOT, 'fedjax_personal', 'core')
  bad = []
  for base, _, files in os.walk(core):
    for f in files:
      if not f.endswith('.py'):
        continue
      path = os.path.join(base, f)
      tree = ast.parse(open(path).read())
      docs = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(
          n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)
        )
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
      }
      for n in ast.walk(tree):
        if (
          isinstance(n, ast.Constant)
          and isinstance(n.value, str)
          and id(n) not in docs
          and re.search(r'(^|[\s(\'"=])--[a-z]', n.value)
        ):
          bad.append(
            f'{os.path.relpath(path, ROOT)}:{n.lineno}: {n.value[:60]!r}'
          )
  assert not bad, bad


def code_lines(source: str) -> int:
  """Lines that hold code: not blank, not only a comment, not only closing
  brackets (a docstring counts as its lines)."""
  import io
  import tokenize

  held = set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type in (
      tokenize.COMMENT,
      tokenize.NL,
      tokenize.NEWLINE,
      tokenize.INDENT,
      tokenize.DEDENT,
      tokenize.ENDMARKER,
    ):
      continue
    if tok.type == tokenize.OP and tok.string in ')]}':
      continue
    held.update(range(tok.start[0], tok.end[0] + 1))
  return len(held)


def test_no_module_holds_more_than_600_lines_of_code():
  assert code_lines('x = f(\n  1,  # one\n)\n\n# c\n') == 2
  big = {}
  for top in ('fedjax_personal', 'algorithms', 'datasets', 'scripts'):
    for folder, _, files in os.walk(os.path.join(ROOT, top)):
      for f in files:
        if f.endswith('.py'):
          path = os.path.join(folder, f)
          with open(path) as fh:
            n = code_lines(fh.read())
          if n > 600:
            big[os.path.relpath(path, ROOT)] = n
  assert not big, f'modules over 600 lines of code (split them by job): {big}'
