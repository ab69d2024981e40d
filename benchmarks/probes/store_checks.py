"""What the population store's checks cost (``core.population.store``: a CRC32 per
1 MiB block of every file, checked the first time a read touches it, or
all at once with ``--verify_store``).

On a store folder (e.g. the one ``benchmarks/populations.py`` writes into
``--work_dir``/store, or a cached ``stores/<data set>-<digest>``), in fresh
processes: opening (the small files checked), the full check, and the
gather of random cohorts with their blocks checked on first touch against
the same gathers once every block was checked (page cache warm in both).

  python benchmarks/probes/store_checks.py --store=/tmp/populations/store --cohort_size=50
"""

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, time
import numpy as np
from fedjax_personal.core.population import store as store_lib
from fedjax_personal.core.population.clients import SPLITS
folder, cohort, rounds, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
t = time.perf_counter()
store = store_lib.open_store(folder)
opened = time.perf_counter() - t
out = {'open_s': opened, 'gb': store.nbytes() / 1e9, 'clients': store.num_clients}
if mode == 'verify':
  t = time.perf_counter()
  for s in SPLITS:
    for a in store.arrays[s][:2]:
      if isinstance(a, store_lib.FileArray):
        a.verify()
  out['verify_s'] = time.perf_counter() - t
else:
  rng = np.random.default_rng(0)
  cohorts = [rng.choice(store.num_clients, cohort, replace=False) for _ in range(rounds)]
  length = int(store.counts['train'].max())
  def gathers():
    times = []
    for idx in cohorts:
      t = time.perf_counter()
      store.gather_packed('train', idx, min(length, 1024))
      times.append(time.perf_counter() - t)
    return times
  if mode == 'checked':  # every block checked first: reads without checks
    for s in SPLITS:
      for a in store.arrays[s][:2]:
        if isinstance(a, store_lib.FileArray):
          a.verify()
  out['gather_s'] = gathers()
print(json.dumps(out))
"""


def child(store, cohort, rounds, mode):
  r = subprocess.run(
    [sys.executable, '-c', CHILD, store, str(cohort), str(rounds), mode],
    capture_output=True,
    text=True,
    check=True,
  )
  return json.loads(r.stdout.strip().splitlines()[-1])


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--store', required=True, help='A population store folder.')
  p.add_argument('--cohort_size', type=int, default=50)
  p.add_argument('--rounds', type=int, default=20)
  p.add_argument('--dry_run', action='store_true', help='Print the plan only.')
  a = p.parse_args()
  if a.dry_run:
    print(
      f'would time open, full check and {a.rounds} cohorts of {a.cohort_size} '
      f'of {a.store}'
    )
    return
  # also warms the page cache
  verify = child(a.store, a.cohort_size, a.rounds, 'verify')
  print(
    f'{verify["clients"]:,} clients, {verify["gb"]:.2f} GB: open '
    f'{verify["open_s"]:.3f} s, '
    f'full check {verify["verify_s"]:.2f} s '
    f'({verify["gb"] / verify["verify_s"]:.2f} GB/s)'
  )
  cold = child(a.store, a.cohort_size, a.rounds, 'lazy')
  warm = child(a.store, a.cohort_size, a.rounds, 'checked')
  c, w = cold['gather_s'], warm['gather_s']
  print(
    f'cohort gathers of {a.cohort_size} (median of {a.rounds}): blocks checked '
    f'on first '
    f'touch {1e3 * sorted(c)[len(c) // 2]:.1f} ms, blocks already checked '
    f'{1e3 * sorted(w)[len(w) // 2]:.1f} ms; first {1e3 * c[0]:.1f} / '
    f'{1e3 * w[0]:.1f} ms'
  )


if __name__ == '__main__':
  main()
