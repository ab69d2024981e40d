"""Probe: a cohort gathered from the population store (flat arrays read by
row slices) against the same clients as array_record records (one record
per client, what grain's ArrayRecordDataSource serves).

  pip install -e '.[probes]'   # array_record
  python benchmarks/probes/store_formats.py --work_dir=/tmp/probe
"""

import os
import sys
import time

import numpy as np

try:
  from array_record.python import array_record_module
except ImportError:  # declared by the [probes] extra
  sys.exit("error: this probe needs array_record: pip install -e '.[probes]'")

from fedjax_personal.core.population.store import StoreWriter

N, COHORT, CAP, SEQ, REPEAT = 4000, 50, 256, 20, 200


def rss_mb():
  for line in open('/proc/self/status'):
    if line.startswith('VmRSS'):
      return int(line.split()[1]) / 1024


def main(work):
  os.makedirs(work, exist_ok=True)
  rng = np.random.default_rng(0)
  s2 = np.log1p((1300 / 400) ** 2)
  sizes = np.maximum(
    1, np.round(rng.lognormal(np.log(400) - s2 / 2, np.sqrt(s2), N))
  ).astype(int)
  writer = StoreWriter(os.path.join(work, 'store'), {'probe': 1})
  ar = array_record_module.ArrayRecordWriter(
    os.path.join(work, 'clients.array_record'), 'group_size:1'
  )
  for n in sizes:
    x = rng.integers(3, 10004, (n, SEQ), dtype=np.uint16)
    y = x.astype(np.int16)
    writer.add((x, y))
    ar.write(np.int64(n).tobytes() + x.tobytes() + y.tobytes())
  ar.close()
  store = writer.close('probe', 10004)
  reader = array_record_module.ArrayRecordReader(
    os.path.join(work, 'clients.array_record')
  )
  cohorts = [
    np.sort(rng.choice(N, COHORT, replace=False)) for _ in range(REPEAT)
  ]

  def from_records(idx):
    xp = np.zeros((COHORT, CAP, SEQ), np.uint16)
    yp = np.zeros((COHORT, CAP, SEQ), np.int32)
    for j, rec in enumerate(reader.read([int(i) for i in idx])):
      n = int(np.frombuffer(rec[:8], np.int64)[0])
      x = np.frombuffer(rec[8 : 8 + n * SEQ * 2], np.uint16).reshape(n, SEQ)
      y = np.frombuffer(rec[8 + n * SEQ * 2 :], np.int16).reshape(n, SEQ)
      k = min(n, CAP)
      xp[j, :k], yp[j, :k] = x[:k], y[:k]
    return xp, yp

  for name, fn in (
    ('store (pread row slices)', lambda i: store.gather('train', i, CAP, CAP)),
    ('array_record (a record per client)', from_records),
  ):
    before = rss_mb()
    fn(cohorts[0])
    start = time.perf_counter()
    for idx in cohorts:
      fn(idx)
    ms = (time.perf_counter() - start) / REPEAT * 1e3
    print(
      f'{name:38s} {ms:7.2f} ms per cohort of {COHORT} (cap {CAP}), RSS '
      f'+{rss_mb() - before:.0f} MB'
    )


if __name__ == '__main__':
  main(
    sys.argv[1].split('=', 1)[1] if len(sys.argv) > 1 else '/tmp/store_probe'
  )
