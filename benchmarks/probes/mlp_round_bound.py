"""How fast can a cohort's MLP round be on this CPU? The bound beside the peers' medians.

The peer benchmark (``benchmarks/peers/run.py``) compares median rounds of
FedAvg on EMNIST-shaped writers (the 784-200-200-62 MLP, batch 20, one
epoch). This probe times the round's unit of work, one local SGD step of
that MLP at batch 20, in a scan of steps on one core, on every core at
once (as the blocked executor's threads run their clients, each on one core:
``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false``), and from the store's example counts draws cohorts
uniformly without replacement: a cohort's round cannot take less than
``max(its steps / cores, its longest client's steps) x the step's time``
(the cores in perfect use, no server step, nothing else). The median of
that bound over drawn cohorts, against the median rounds of a peers JSON,
is the largest speed-up over FedJAX that this step allows.

    XLA_FLAGS=--xla_cpu_multi_thread_eigen=false python benchmarks/probes/mlp_round_bound.py \\
      --train=/tmp/peers/emnist/federated_emnist_train.sqlite \\
      --peers=benchmarks/speed/peers/mlp_10_50.json
"""

import argparse
import json
import sqlite3
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_personal.models import create_model

STEPS = 50


def step_seconds(batch: int, threads: int, reps: int = 7) -> float:
  """Median seconds of one SGD step of the MLP at ``batch`` in a scan, with
  ``threads`` host threads each running its own scan at once (as the
  blocked executor's threads run their clients): the mean of their medians."""
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.rand(STEPS, batch, 28, 28, 1).astype(np.float32))
  y = jnp.asarray(rng.randint(0, 62, (STEPS, batch)))
  model = create_model('mlp', 62, np.asarray(x[0]))
  params = model.init(jax.random.key(0))

  def loss(p, xb, yb):
    return optax.softmax_cross_entropy_with_integer_labels(
      model.apply(p, xb), yb
    ).mean()

  @jax.jit
  def run(p, xs, ys):
    def body(p, b):
      g = jax.grad(loss)(p, *b)
      return jax.tree.map(lambda a, d: a - 0.1 * d, p, g), None

    return jax.lax.scan(body, p, (xs, ys))[0]

  jax.block_until_ready(run(params, x, y))
  start = threading.Barrier(threads)
  medians = [None] * threads

  def timed(i):
    start.wait()
    times = []
    for _ in range(reps):
      t = time.perf_counter()
      jax.block_until_ready(run(params, x, y))
      times.append(time.perf_counter() - t)
    medians[i] = float(np.median(times)) / STEPS

  workers = [threading.Thread(target=timed, args=(i,)) for i in range(threads)]
  for w in workers:
    w.start()
  for w in workers:
    w.join()
  return float(np.mean(medians))


def matmul_gflops(n: int = 1024) -> float:
  a = jnp.ones((n, n), jnp.float32)
  f = jax.jit(lambda a: a @ a)
  f(a).block_until_ready()
  best = min(_timed(f, a) for _ in range(5))
  return 2 * n**3 / best / 1e9


def _timed(f, a):
  t = time.perf_counter()
  f(a).block_until_ready()
  return time.perf_counter() - t


def round_bounds(steps, cohort: int, cores: int, draws: int, seed: int = 0):
  """Per drawn cohort: max(its steps / cores, its longest client's steps)."""
  rng = np.random.RandomState(seed)
  out = np.empty(draws)
  for i in range(draws):
    s = steps[rng.choice(len(steps), cohort, replace=False)]
    out[i] = max(s.sum() / cores, s.max())
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument(
    '--train', required=True, help="FedJAX EMNIST train SQLite (peers' files)."
  )
  p.add_argument(
    '--peers', nargs='*', default=[], help='Peers JSON files (run.py --output).'
  )
  p.add_argument('--batch', type=int, default=20)
  p.add_argument(
    '--cores',
    type=int,
    default=2,
    help='Cores of the machine the peers ran on.',
  )
  p.add_argument('--cohorts', default='10,50')
  p.add_argument('--draws', type=int, default=2000)
  a = p.parse_args()
  with sqlite3.connect(a.train) as conn:
    n = np.array(
      [r[0] for r in conn.execute('SELECT num_examples FROM federated_data')]
    )
  # the project's steps: the last batch padded to a full one
  steps = -(-n // a.batch)
  t_step = step_seconds(a.batch, a.cores)
  print(
    f'{len(n)} writers, {n.min()}-{n.max()} examples (mean {n.mean():.1f}); '
    f'batch {a.batch}: '
    f'{steps.mean():.2f} steps a writer, '
    f'{100 * (steps.sum() * a.batch / n.sum() - 1):.1f}% of their '
    f'examples padding'
  )
  print(
    f'one MLP step at batch {a.batch} in a scan, {a.cores} at once: '
    f'{t_step * 1e3:.3f} ms; 1024^2 matmul '
    f"{matmul_gflops():.0f} GFLOP/s (this process's cores); JAX "
    f'{jax.__version__}'
  )
  medians = {}
  for path in a.peers:
    with open(path) as f:
      for row in json.load(f)['rows']:
        sides = {
          k: v['s_per_round']
          for k, v in row.items()
          if isinstance(v, dict) and 's_per_round' in v
        }
        medians.setdefault(row['cohort'], []).append(
          (path.rsplit('/', 1)[-1], sides)
        )
  for c in map(int, a.cohorts.split(',')):
    b = round_bounds(steps, c, a.cores, a.draws)
    bound = float(np.median(b)) * t_step
    print(
      f'cohort {c}: bound on {a.cores} cores, median over {a.draws} cohorts: '
      f'{bound * 1e3:.1f} ms ({np.median(b):.0f} steps a core)'
    )
    for name, sides in medians.get(c, []):
      fj = sides.pop('fedjax')
      others = ', '.join(
        f'{k} {v * 1e3:.1f} ms ({bound / v:.0%} of the bound)'
        for k, v in sides.items()
      )
      print(
        f'  {name}: FedJAX {fj * 1e3:.1f} ms: at most {fj / bound:.2f}x; '
        f'{others}'
      )


if __name__ == '__main__':
  main()
