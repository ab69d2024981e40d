"""The least time a peer row's round can take on this machine, and how near the project comes.

For each row (model, batch, cohort) of the peer benchmark (``run.py``), one
local SGD step of the row's model at the row's batch is traced as the
project's client update runs it (loss, gradient, update), and its jaxpr is
walked: every matmul (``dot_general``) and convolution, a scan's body
counted once per step of the scan, is timed alone at its own shapes (in a
compiled loop on each core at once: the blocked executor's threads each run
a client on one core, and two cores that share one physical core, its
caches or its memory show it), and summed with the step's floor (a bare
compiled step that reads and writes every parameter once: the update's
memory traffic and the loop's overhead). The round's bound, over cohorts drawn uniformly from the
row's files, is ``max(the cohort's steps / cores, its longest client's
steps) x (the step's matmul time + its floor)``: the cores always busy on
nothing but the step's matmuls at the rate this machine shows for them. With
``--peers`` (``run.py --output``'s JSON) each row's medians are set against
the bound (the fraction of the bound reached: bound / median).

    XLA_FLAGS=--xla_cpu_multi_thread_eigen=false python benchmarks/peers/bounds.py \\
        --work_dir=/tmp/peers --rows=mlp:10,cnn:50,lstm:10,shakespeare:10,transformer:10 \\
        --peers=peers.json --project=transformer_10.json

The rows: ``mlp``, ``cnn`` (EMNIST-shaped writers, batch 20), ``lstm`` (Stack
Overflow-shaped users, FedJAX's LSTM, 20 tokens), ``shakespeare`` (roles'
80-character windows, FedJAX's two-layer LSTM), ``transformer`` (the
partial-personalization seed's ``transformer_lm`` on the Stack Overflow rows);
the files are those ``run.py`` writes in ``--work_dir``.
"""

import argparse
import json
import os
import platform
import sqlite3
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from fedjax_personal.models import create_model  # noqa: E402

# row -> (files, project model, classes, one input's shape and dtype)
ROWS = {
  'mlp': ('emnist', 'mlp', 62, (28, 28, 1), np.float32),
  'cnn': ('emnist', 'reddi_emnist_cnn', 62, (28, 28, 1), np.float32),
  'lstm': ('stackoverflow', 'fedjax_lstm_lm', 10004, (20,), np.int32),
  'shakespeare': ('shakespeare', 'fedjax_char_lstm', 90, (80,), np.int32),
  'transformer': ('stackoverflow', 'transformer_lm', 10004, (20,), np.int32),
}


def client_examples(work_dir, files):
  """Training examples per client of the files in ``work_dir/files``: the
  Shakespeare roles' 80-character windows (``make_files.py`` lists them),
  the other files' ``num_examples``."""
  folder = os.path.join(work_dir, files)
  if files == 'shakespeare':
    return np.loadtxt(
      os.path.join(folder, 'shakespeare_train.windows'), dtype=np.int64
    )
  name = (
    'federated_emnist_train.sqlite'
    if files == 'emnist'
    else 'stackoverflow_train.sqlite'
  )
  with sqlite3.connect(os.path.join(folder, name)) as conn:
    return np.array(
      [r[0] for r in conn.execute('SELECT num_examples FROM federated_data')]
    )


def sgd_step(row, batch):
  """(step(params, x, y) -> params, params, x, y) of the row's model."""
  _, name, classes, shape, dtype = ROWS[row]
  rng = np.random.default_rng(0)
  if dtype == np.int32:
    x = rng.integers(0, classes, (batch,) + shape).astype(np.int32)
    y = rng.integers(0, classes, (batch,) + shape).astype(np.int32)
  else:
    x = rng.random((batch,) + shape).astype(np.float32)
    y = rng.integers(0, classes, batch).astype(np.int32)
  model = create_model(name, classes, x[:1])
  params = model.init(jax.random.key(0))

  def step(p, xb, yb):
    loss = lambda q: optax.softmax_cross_entropy_with_integer_labels(
      model.apply(q, xb), yb
    ).mean()
    return jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(loss)(p))

  return step, params, jnp.asarray(x), jnp.asarray(y)


def _sub_jaxprs(eqn):
  for v in eqn.params.values():
    for sub in v if isinstance(v, (list, tuple)) else [v]:
      inner = getattr(sub, 'jaxpr', sub)
      if hasattr(inner, 'eqns'):
        yield inner


def matmuls(jaxpr, times=1, out=None):
  """{(primitive, shapes, params): (count, flops)} of the jaxpr's matmuls
  and convolutions, a scan's body ``length`` times."""
  out = {} if out is None else out
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in ('dot_general', 'conv_general_dilated'):
      shapes = tuple(
        (tuple(v.aval.shape), str(v.aval.dtype)) for v in eqn.invars
      )
      key = (
        name,
        shapes,
        tuple(sorted((k, repr(v)) for k, v in eqn.params.items())),
      )
      count, flops, e = out.get(key, (0, 0, eqn))
      out[key] = (count + times, flops + times * _flops(eqn), e)
      continue
    inner_times = times * (eqn.params.get('length', 1) if name == 'scan' else 1)
    for sub in _sub_jaxprs(eqn):
      matmuls(sub, inner_times, out)
  return out


def _flops(eqn):
  lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
  out = eqn.outvars[0].aval.shape
  if eqn.primitive.name == 'dot_general':
    (lc, _), _ = eqn.params['dimension_numbers']
    return 2 * int(np.prod(out)) * int(np.prod([lhs[d] for d in lc]))
  spec = eqn.params['dimension_numbers']
  kernel_spatial = [rhs[d] for d in spec.rhs_spec[2:]]
  in_per_group = rhs[spec.rhs_spec[1]]
  return (
    2 * int(np.prod(out)) * int(np.prod(kernel_spatial)) * int(in_per_group)
  )


def _loop_seconds(body, init, threads=1, reps=5, length=20):
  """Seconds of one iteration of ``body`` in a compiled scan while
  ``threads`` host threads run the scan at once (as the blocked executor's
  threads run their clients: cores that share a physical core, caches or
  memory show it here); the median over ``reps``."""
  run = jax.jit(
    lambda c: jax.lax.scan(
      lambda c, _: (body(c), None), c, None, length=length
    )[0]
  )
  jax.block_until_ready(run(init))
  times = []
  for _ in range(reps):
    start = threading.Barrier(threads + 1)

    def one():
      start.wait()
      jax.block_until_ready(run(init))

    pool = [threading.Thread(target=one) for _ in range(threads)]
    for t in pool:
      t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in pool:
      t.join()
    times.append(time.perf_counter() - t0)
  return float(np.median(times)) / length


def op_seconds(eqn, threads=1):
  """One matmul or convolution alone, at its shapes and parameters, on
  each of ``threads`` threads at once."""
  rng = np.random.default_rng(1)
  args = [
    jnp.asarray(rng.standard_normal(v.aval.shape).astype(v.aval.dtype) * 0.1)
    for v in eqn.invars
  ]

  def body(c):
    out = eqn.primitive.bind(args[0] + c, *args[1:], **eqn.params)
    return c + 0.0 * out.reshape(-1)[0]  # the next product waits for this one

  def bare(c):  # the loop and the dependency alone, taken off
    return c + 0.0 * (args[0] + c).reshape(-1)[0]

  zero = jnp.zeros((), args[0].dtype)
  return max(
    0.0, _loop_seconds(body, zero, threads) - _loop_seconds(bare, zero, threads)
  )


def floor_seconds(params, threads=1):
  """A bare compiled step: every parameter read and written once."""
  return _loop_seconds(
    lambda p: jax.tree.map(lambda a: a * 0.999 + 1e-6, p), params, threads
  )


def bound_row(row, batch, cohort, counts, cores, draws=2000):
  step, params, x, y = sgd_step(row, batch)
  found = matmuls(jax.make_jaxpr(step)(params, x, y).jaxpr)
  dot_s = sum(count * op_seconds(e, cores) for count, _, e in found.values())
  flops = sum(f for _, f, _ in found.values())
  floor = floor_seconds(params, cores)
  steps = -(-counts // batch)  # one epoch
  rng = np.random.default_rng(0)
  per_round = []
  for _ in range(draws):
    s = steps[rng.choice(len(steps), cohort, replace=False)]
    per_round.append(max(s.sum() / cores, s.max()) * (dot_s + floor))
  return {
    'row': f'{row}:{cohort}',
    'batch': batch,
    'step_gflop': flops / 1e9,
    'step_matmul_ms': 1e3 * dot_s,
    'step_floor_ms': 1e3 * floor,
    'rate_gflops': flops / dot_s / 1e9 if dot_s else None,
    'matmul_shapes': len(found),
    'bound_s': float(np.median(per_round)),
    'steps_per_client': float(steps.mean()),
  }


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument(
    '--work_dir', required=True, help="run.py's --work_dir (its files)."
  )
  p.add_argument(
    '--rows',
    default='mlp:10,cnn:50,lstm:10,lstm:50,shakespeare:10,transformer:10',
  )
  p.add_argument('--batch_size', type=int, default=20)
  p.add_argument('--cores', type=int, default=os.cpu_count())
  p.add_argument(
    '--peers',
    default=None,
    help="run.py --output JSONs (','-separated): their "
    'medians against the bounds.',
  )
  p.add_argument(
    '--project',
    default=None,
    help='JSON {row: project median s/round} of rows '
    'without a FedJAX side (the transformer).',
  )
  p.add_argument('--output', default=None)
  p.add_argument(
    '--dry_run', action='store_true', help='Check the rows and print the plan.'
  )
  a = p.parse_args()
  for spec in a.rows.split(','):
    row, _, cohort = spec.partition(':')
    if row not in ROWS or not cohort.isdigit():
      p.error(f'--rows: {spec!r} is not row:cohort with row in {sorted(ROWS)}')
  if a.dry_run:
    print(
      f'dry run: rows {a.rows}, batch {a.batch_size}, {a.cores} cores; files '
      f'in {a.work_dir}; '
      f'medians from {a.peers or "none"}, {a.project or "none"}'
    )
    return
  medians = {}
  for path in filter(None, (a.peers or '').split(',')):
    with open(path) as f:
      for r in json.load(f)['rows']:
        medians[f'{r["model"]}:{r["cohort"]}'] = {
          k: v['s_per_round']
          for k, v in r.items()
          if isinstance(v, dict) and 's_per_round' in v
        }
  if a.project:
    with open(a.project) as f:
      for k, v in json.load(f).items():
        medians.setdefault(k, {})['default'] = v
  cpu = next(
    (
      l.split(':', 1)[1].strip()
      for l in open('/proc/cpuinfo')
      if l.startswith('model name')
    ),
    platform.processor(),
  )
  print(
    f'# {cpu}, {a.cores} cores, JAX {jax.__version__}, XLA_FLAGS='
    f'{os.environ.get("XLA_FLAGS", "")!r}; batch {a.batch_size}, one epoch, '
    f'median over '
    'drawn cohorts'
  )
  print(
    '| row | step GFLOP | step matmuls ms (GFLOP/s) | step floor ms | steps a '
    'client | bound '
    's/round | medians s/round (fraction of the bound) |'
  )
  print('|---|---|---|---|---|---|---|')
  out = []
  for spec in a.rows.split(','):
    row, cohort = spec.split(':')
    counts = client_examples(a.work_dir, ROWS[row][0])
    r = bound_row(row, a.batch_size, int(cohort), counts, a.cores)
    r['medians'] = medians.get(spec, {})
    out.append(r)
    got = (
      ', '.join(
        f'{k} {s:.3f} ({100 * r["bound_s"] / s:.0f}%)'
        for k, s in r['medians'].items()
      )
      or '-'
    )
    rate = '-' if r['rate_gflops'] is None else f'{r["rate_gflops"]:.0f}'
    print(
      f'| {spec} | {r["step_gflop"]:.3f} | {r["step_matmul_ms"]:.2f} ({rate}) '
      f'| {r["step_floor_ms"]:.3f} | {r["steps_per_client"]:.2f} | '
      f'{r["bound_s"]:.3f} | {got} |',
      flush=True,
    )
  if a.output:
    with open(a.output, 'w') as f:
      json.dump({'cpu': cpu, 'cores': a.cores, 'rows': out}, f, indent=1)


if __name__ == '__main__':
  main()
