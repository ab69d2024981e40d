import os

import pytest
from absl import flags

# Tests run on whatever CPU there is; keep XLA from grabbing every thread
# oddly and never touch the network.
os.environ.setdefault('TFDS_DISABLE_GCS', '1')

# Tests read data only from the clone, the package and what they write: a
# cache of their own (never ~/.cache/fedjax_personal), and real data sets only
# in tests marked needs_data, through $FEDJAX_PERSONAL_DATA.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

os.environ['FEDJAX_PERSONAL_CACHE'] = tempfile.mkdtemp(
  prefix='fedjax_personal_test_cache_'
)
# Removed when the session ends (each run's cache, up to 30 MB, stayed in
# the temporary folder).
atexit.register(shutil.rmtree, os.environ['FEDJAX_PERSONAL_CACHE'], True)

# Most of a test's time is XLA compiling small programs: LLVM's cheaper
# optimisation compiles them faster (tests/test_engine.py: 86 s -> 53 s on 2
# cores) and keeps IEEE semantics (XLA:CPU uses no fast math).
# Runs that compile other programs for the same sums (rows in files against
# rows in memory) then differ in their last bits where at the default they
# happened to agree: those tests compare to 1e-6, as BUILD.md states. The
# scripts the tests start inherit it; a user's own XLA_FLAGS win (XLA_FLAGS=
# runs the suite at XLA's default).
os.environ.setdefault(
  'XLA_FLAGS',
  '--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true',
)

# file (or alternatives) -> the data set whose --download gets it
_DOWNLOAD = {
  'tinyshakespeare.txt': 'tinyshakespeare',
  'input.txt': 'tinyshakespeare',
  'cifar-10-python.tar.gz': 'cifar10',
}


def _slow_in_ci(item) -> bool:
  """Whether a test runs only with -m slow: marked ``slow`` on itself, or a
  variant its ``ci_variants(...)`` marker leaves out (CI runs one of each
  code path of a parametrized check) or its ``slow_variants(...)`` names."""
  variant = item.callspec.id if hasattr(item, 'callspec') else None
  keep = item.get_closest_marker('ci_variants')
  if keep is not None and variant not in keep.args:
    return True
  drop = item.get_closest_marker('slow_variants')
  return drop is not None and variant in drop.args


# Modules whose numbers depend on the backend (precision, convolutions,
# sharding, memory plans, donation, executors' equality with a per-client
# loop): marked accelerator, the tests benchmarks/accelerator.py runs on a GPU.
ACCELERATOR_MODULES = {
  'test_engine.py',
  'test_numerics.py',
  'test_models.py',
  'test_sharding.py',
  'test_memory.py',
  'test_usercentric.py',
  'test_personalization.py',
  'test_scale.py',
  'test_layout.py',
}


@pytest.hookimpl(tryfirst=True)  # before -m "not slow" deselects
def pytest_collection_modifyitems(config, items):
  """The variants a test's ``ci_variants`` marker leaves out (or its
  ``slow_variants`` names) are marked slow, those of
  ``ACCELERATOR_MODULES`` accelerator. Tests marked
  ``needs_data(file, ...)`` (a file, or a tuple of alternative names) skip,
  naming the file and how to get it, unless $FEDJAX_PERSONAL_DATA holds it."""
  folder = os.environ.get('FEDJAX_PERSONAL_DATA')
  for item in items:
    if _slow_in_ci(item):
      item.add_marker(pytest.mark.slow)
    if item.nodeid.split('tests/', 1)[-1].split('::')[0] in ACCELERATOR_MODULES:
      item.add_marker(pytest.mark.accelerator)
    marker = item.get_closest_marker('needs_data')
    if marker is None:
      continue
    for want in marker.args:
      names = (want,) if isinstance(want, str) else tuple(want)
      if folder and any(os.path.isfile(os.path.join(folder, n)) for n in names):
        continue
      get = next(
        (
          f'python scripts/run_experiment.py --dataset={_DOWNLOAD[n]} '
          f'--download '
          'saves it in ~/.cache/fedjax_personal'
          for n in names
          if n in _DOWNLOAD
        ),
        'no download: a local copy only',
      )
      item.add_marker(
        pytest.mark.skip(
          reason=f'needs {" or ".join(names)}: set FEDJAX_PERSONAL_DATA to a folder holding it '
          f'({get})'
        )
      )
      break


@pytest.fixture(autouse=True)
def _reset_flags():
  """Flags parsed by a test (helpers.parse_flags) do not leak into the next."""
  yield
  flags.FLAGS.unparse_flags()


# One persistent XLA compilation cache for the whole test session (and the
# scripts it starts as subprocesses, through the environment): many tests
# compile the same programs (same model, data shapes and algorithm in new
# closures), which then compile once (measured: test_engine and
# test_personalization 241 s instead of 296 s on 2 cores).
import jax  # noqa: E402

# the session's own, removed at its end
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  os.environ['JAX_COMPILATION_CACHE_DIR'] = tempfile.mkdtemp(
    prefix='fedjax_personal_xla_cache_'
  )
  atexit.register(shutil.rmtree, os.environ['JAX_COMPILATION_CACHE_DIR'], True)
_CACHE = os.environ['JAX_COMPILATION_CACHE_DIR']
jax.config.update('jax_compilation_cache_dir', _CACHE)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
# The tests' own reference computations (outside the engine, which sets its
# own precision) at float32 on every card, as the engine's default: the
# suite asks this of JAX, the package does not.
jax.config.update('jax_default_matmul_precision', 'highest')


@pytest.fixture
def made_not_released(monkeypatch):
  """Made files have the published names, not the releases' bytes: drop the
  releases' checksums and sizes (test_formats checks those on their own)."""
  import dataclasses

  from fedjax_personal.datasets import sources

  monkeypatch.setattr(
    sources,
    'FILES',
    {
      k: tuple(
        dataclasses.replace(f, md5=None, sha256=None, size=None) for f in v
      )
      for k, v in sources.FILES.items()
    },
  )


@pytest.fixture()
def algorithm_registry():
  """The algorithm registry (``algorithms/registry.py``) as it is, restored in
  place when the test ends: what a test registers is gone after it, and
  every module that holds the registry sees the same dict."""
  from fedjax_personal.algorithms import registry

  saved = dict(registry.REGISTRY), dict(registry.OWNERS)
  yield registry.REGISTRY
  for held, kept in zip((registry.REGISTRY, registry.OWNERS), saved):
    held.clear()
    held.update(kept)
