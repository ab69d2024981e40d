import os

from absl import flags
import pytest

# Tests run on whatever CPU there is; keep XLA from grabbing every thread
# oddly and never touch the network.
os.environ.setdefault('TFDS_DISABLE_GCS', '1')

# Tests read data only from the clone, the package and what they write: a
# cache of their own (never ~/.cache/fedjax_personal), and real data sets only
# in tests marked needs_data, through $FEDJAX_PERSONAL_DATA.
import tempfile  # noqa: E402

os.environ['FEDJAX_PERSONAL_CACHE'] = tempfile.mkdtemp(prefix='fedjax_personal_test_cache_')

# file (or alternatives) -> the data set whose --download gets it
_DOWNLOAD = {'tinyshakespeare.txt': 'tinyshakespeare', 'input.txt': 'tinyshakespeare',
             'cifar-10-python.tar.gz': 'cifar10'}


def pytest_collection_modifyitems(config, items):
  """Tests marked ``needs_data(file, ...)`` (a file, or a tuple of
  alternative names) skip, naming the file and how to get it, unless
  $FEDJAX_PERSONAL_DATA holds it."""
  folder = os.environ.get('FEDJAX_PERSONAL_DATA')
  for item in items:
    marker = item.get_closest_marker('needs_data')
    if marker is None:
      continue
    for want in marker.args:
      names = (want,) if isinstance(want, str) else tuple(want)
      if folder and any(os.path.isfile(os.path.join(folder, n)) for n in names):
        continue
      get = next((f'python scripts/run_experiment.py --dataset={_DOWNLOAD[n]} --download '
                  'saves it in ~/.cache/fedjax_personal' for n in names if n in _DOWNLOAD),
                 'no download: a local copy only')
      item.add_marker(pytest.mark.skip(
          reason=f'needs {" or ".join(names)}: set FEDJAX_PERSONAL_DATA to a folder holding it '
                 f'({get})'))
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

_CACHE = os.environ.setdefault('JAX_COMPILATION_CACHE_DIR',
                               tempfile.mkdtemp(prefix='fedjax_personal_xla_cache_'))
jax.config.update('jax_compilation_cache_dir', _CACHE)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)


@pytest.fixture
def made_not_released(monkeypatch):
  """Made files have the published names, not the releases' bytes: drop the
  releases' checksums and sizes (test_formats checks those on their own)."""
  import dataclasses
  from fedjax_personal.datasets import sources
  monkeypatch.setattr(sources, 'FILES', {
      k: tuple(dataclasses.replace(f, md5=None, sha256=None, size=None) for f in v)
      for k, v in sources.FILES.items()})
