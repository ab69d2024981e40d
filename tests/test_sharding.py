import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
  'grid',
  [
    pytest.param([], id='ci'),
    pytest.param(['full'], id='full', marks=pytest.mark.slow),
  ],
)
@pytest.mark.slow_variants('ci')
def test_eight_cpu_devices_equal_one_device(grid):
  env = dict(
    os.environ,
    XLA_FLAGS='--xla_force_host_platform_device_count=8',
    JAX_PLATFORMS='cpu',
  )
  here = os.path.dirname(os.path.abspath(__file__))
  r = subprocess.run(
    [sys.executable, os.path.join(here, 'sharding_check.py')] + grid,
    cwd=here,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert r.returncode == 0 and 'SHARDING OK 8' in r.stdout, (
    r.stdout[-2000:] + r.stderr[-4000:]
  )
