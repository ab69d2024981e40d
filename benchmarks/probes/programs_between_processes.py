"""What a warm process still pays to get a compiled client loop, and what
``jax.export`` (keeping the traced, lowered program between processes) saves.

The program: the MLP 784-200-200-62 of the EMNIST peer rows, a block of 4
clients vectorized (``vmap``), each running its SGD steps in a
``lax.while_loop``, as the engine's block loop does. Each measurement is a
fresh Python process with JAX's persistent compilation cache already holding
the executable (a second run of the same experiment):

* ``jit``: trace, lower, then the cache's executable (``jit(f).lower(...).compile()``);
* ``export``: the program saved by ``jax.export`` in an earlier process,
  deserialized, then ``jit(exported.call).lower(...).compile()``, which the
  cache also serves.

Needs the ``flatbuffers`` package for ``jax.export`` (not a dependency of
the project).

  python benchmarks/probes/programs_between_processes.py [--repeats=3] [--work_dir=/tmp/probe]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import collections, json, sys, time
mode, work = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
import jax, jax.numpy as jnp
from jax import export, monitoring
import flax.linen as nn, optax
jax.config.update('jax_compilation_cache_dir', work + '/xla')
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
events = collections.defaultdict(float)
monitoring.register_event_duration_secs_listener(
    lambda e, d, **kw: events.__setitem__(e.split('/')[-1], events[e.split('/')[-1]] + d))

class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(200)(x)); x = nn.relu(nn.Dense(200)(x)); return nn.Dense(62)(x)
m, opt = MLP(), optax.sgd(0.1)
params = m.init(jax.random.key(0), jnp.zeros((1, 784)))
def loss(p, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(m.apply(p, x), y).mean()
def client(p, xs, ys, n):
  def body(c):
    i, p, s = c
    u, s = opt.update(jax.grad(loss)(p, xs[i], ys[i]), s, p)
    return i + 1, optax.apply_updates(p, u), s
  return jax.lax.while_loop(lambda c: c[0] < n, body, (0, p, opt.init(p)))[1]
def block(p, xs, ys, n):
  return jax.vmap(client, in_axes=(None, 0, 0, 0))(p, xs, ys, n)
args = (params, jnp.zeros((4, 42, 20, 784)), jnp.zeros((4, 42, 20), jnp.int32), jnp.full((4,), 42))
jax.block_until_ready(args)
events.clear()
start = time.perf_counter()
if mode == 'save':
  open(work + '/block.bin', 'wb').write(export.export(jax.jit(block))(*args).serialize())
  compiled = jax.jit(block).lower(*args).compile()
elif mode == 'jit':
  compiled = jax.jit(block).lower(*args).compile()
else:
  exp = export.deserialize(bytearray(open(work + '/block.bin', 'rb').read()))
  compiled = jax.jit(exp.call).lower(*args).compile()
seconds = time.perf_counter() - start
jax.block_until_ready(compiled(*args))
print(json.dumps({'mode': mode, 'seconds': seconds, **{k: v for k, v in events.items()}}))
"""


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--repeats', type=int, default=3)
  p.add_argument(
    '--work_dir',
    default=None,
    help='Cache and saved program (default: a new temporary folder).',
  )
  a = p.parse_args()
  work = a.work_dir or tempfile.mkdtemp(prefix='programs_between_processes_')
  os.makedirs(work, exist_ok=True)

  def child(mode):
    out = subprocess.run(
      [sys.executable, '-c', CHILD, mode, work], capture_output=True, text=True
    )
    if out.returncode:
      sys.exit(f'{mode}: failed: {out.stderr.strip().splitlines()[-1:]}')
    return json.loads(out.stdout.strip().splitlines()[-1])

  child('save')  # fills the cache with the jit form's executable
  for mode in ('export', 'jit'):  # and with the exported form's
    child(mode)
  rows = {'jit': [], 'export': []}
  for _ in range(a.repeats):  # interleaved
    for mode in ('jit', 'export'):
      rows[mode].append(child(mode))
  print(
    'form     seconds to a compiled program (each repeat)   trace   lower   '
    'cache load'
  )
  for mode, rs in rows.items():
    mean = lambda k: sum(r.get(k, 0.0) for r in rs) / len(rs)
    each = ', '.join('%.3f' % r['seconds'] for r in rs)
    print(
      f'{mode:8s} {each:44s} '
      f'{mean("jaxpr_trace_duration"):.3f}   '
      f'{mean("jaxpr_to_mlir_module_duration"):.3f}   '
      f'{mean("cache_retrieval_time_sec"):.3f}'
    )


if __name__ == '__main__':
  main()
