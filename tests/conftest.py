import os

from absl import flags
import pytest

# Tests run on whatever CPU there is; keep XLA from grabbing every thread
# oddly and never touch the network.
os.environ.setdefault('TFDS_DISABLE_GCS', '1')


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
import tempfile  # noqa: E402

import jax  # noqa: E402

_CACHE = os.environ.setdefault('JAX_COMPILATION_CACHE_DIR',
                               tempfile.mkdtemp(prefix='fedjax_personal_xla_cache_'))
jax.config.update('jax_compilation_cache_dir', _CACHE)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
