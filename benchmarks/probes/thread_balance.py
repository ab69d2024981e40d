"""Do the blocked executor's host threads finish together? Each thread's blocks, steps and seconds.

The blocked executor on a CPU lays a cohort's clients out in blocks by their
real steps and gives each host thread the same number of steps (longest
first, ``client_blocks``); each thread's blocks are one compiled call. This
probe runs ``scripts/run_experiment.py`` in this process with the given
flags and times each thread's call of every round: if the threads' seconds
a step differ, a round waits for the slower one (the cores ran at
different speeds, or a thread's clients cost more than their steps).

    python benchmarks/probes/thread_balance.py --skip=5 -- \\
      --dataset=emnist --data_dir=/tmp/peers/emnist --model=mlp --cohort_size=10 \\
      --batch_size=20 --client_lr=0.1 --rounds=40 --eval_every=0 --progress=false \\
      --output_dir=/tmp/balance --overwrite --plots=off
"""

import argparse
import os
import runpy
import sys
import time

import numpy as np

from fedjax_personal.core import executors

ROOT = os.path.dirname(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
# per round: {'steps': [per thread], 'ms': [per thread], 'round_ms': ...}
ROUNDS = []


def _hook():
  """Wraps the layout (each thread's steps) and the threads' calls (their
  ms)."""
  layout = executors.client_blocks

  def client_blocks(steps, active, bs, parts=1):
    pos, ok, limit, count = layout(steps, active, bs, parts)
    ROUNDS.append(
      {'steps': [int(limit[t][: count[t]].sum()) for t in range(parts)]}
    )
    return pos, ok, limit, count

  executors.client_blocks = client_blocks
  on_threads = executors.BlockedExecutor._on_threads

  def timed_on_threads(self, call, parts, signature):
    ms = [0.0] * parts

    def timed(t):
      start = time.perf_counter()
      out = call(t)
      ms[t] = (time.perf_counter() - start) * 1e3
      return out

    start = time.perf_counter()
    out = on_threads(self, timed, parts, signature)
    if ROUNDS and 'ms' not in ROUNDS[-1]:
      ROUNDS[-1].update(ms=ms, round_ms=(time.perf_counter() - start) * 1e3)
    return out

  executors.BlockedExecutor._on_threads = timed_on_threads


def report(skip: int):
  rounds = [r for r in ROUNDS[skip:] if 'ms' in r and len(r['ms']) > 1]
  if not rounds:
    sys.exit(
      'no threaded rounds: run a blocked executor with more than one thread'
    )
  for r in rounds:
    per = [f'{m / max(s, 1):.3f}' for m, s in zip(r['ms'], r['steps'])]
    print(
      f'steps {r["steps"]}, ms {[round(m, 1) for m in r["ms"]]}, ms a step '
      f'{per}'
    )
  ratio = [
    max(m / max(s, 1) for m, s in zip(r['ms'], r['steps']))
    / min(m / max(s, 1) for m, s in zip(r['ms'], r['steps']))
    for r in rounds
  ]
  waited = [1 - np.mean(r['ms']) / max(r['ms']) for r in rounds]
  steps = [max(r['steps']) for r in rounds]
  print(
    f"{len(rounds)} rounds (after {skip}): the slower thread's ms a step / the "
    f"faster's: "
    f'median {np.median(ratio):.2f} (max {max(ratio):.2f}); steps of the '
    f'longer thread / '
    f'the shorter: median '
    f'{np.median([max(r["steps"]) / max(min(r["steps"]), 1) for r in rounds]):.2f}; '
    f"a round's threads idle while waiting for the slower one: median "
    f'{np.median(waited):.0%} '
    f"of its time; the longer thread's ms a step: median "
    f'{np.median([r["round_ms"] / s for r, s in zip(rounds, steps)]):.3f}; the '
    f'threaded part of '
    f'a round: median {np.median([r["round_ms"] for r in rounds]):.1f} ms'
  )


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument(
    '--skip', type=int, default=5, help='Rounds left out (the first compiles).'
  )
  p.add_argument(
    'flags', nargs=argparse.REMAINDER, help='-- then run_experiment.py flags.'
  )
  a = p.parse_args()
  flags = a.flags[1:] if a.flags[:1] == ['--'] else a.flags
  _hook()
  script = os.path.join(ROOT, 'scripts', 'run_experiment.py')
  sys.argv = [script] + flags
  try:
    runpy.run_path(script, run_name='__main__')
  except SystemExit as e:
    if e.code:
      raise
  report(a.skip)


if __name__ == '__main__':
  main()
