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
