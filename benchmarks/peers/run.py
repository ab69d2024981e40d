"""FedJAX 0.0.17 against this project on the same FedJAX-format files.

Writes the files once (``make_files.py``: EMNIST-shaped writers with the
field's long tail; by FedJAX's own SQLite writer when --fedjax_python has
FedJAX), then, for each row, runs FedJAX's FedAvg (``fedjax_side.py``, in
FedJAX's venv) and this project's CLI (``scripts/run_experiment.py``) with the
same model, cohort, batch, one local epoch, learning rates and rounds,
alternating the two --repeats times (interleaved: drift on the machine hits
both). Per run: seconds per round (median of the rounds after the first),
accuracy after the rounds (FedJAX: its pooled ``evaluate_model`` over every
test client; the project: ``accuracy_weighted``, the same pooled figure),
peak RSS (the child's ``ru_maxrss`` from ``wait4``). The table reports the
medians over repeats, the speed ratio and the share of this CPU's fp32 peak
(measured at start: a 2048x2048 matmul) that the round's training FLOPs
(the matmuls and convolutions of one SGD step, ``bounds.py``, per example x
the cohort's real examples) reach. A row FedJAX cannot run is reported
with its error and the project's side alone.

FedJAX's venv (its own, apart from this project's):
  python3 -m venv ~/fedjax-venv && ~/fedjax-venv/bin/pip install jax==0.4.30 \\
      jaxlib==0.4.30 dm-haiku==0.0.12 optax==0.2.2 'numpy<2' fedjax==0.0.17

Usage:
  python benchmarks/peers/run.py --fedjax_python=~/fedjax-venv/bin/python \\
      --work_dir=/tmp/peers --rows=mlp:10,mlp:50,mlp:500,cnn:50 --output=peers.json
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# row -> (data set, this project's model, its initialisation): FedJAX's dense
# and conv EMNIST models; its Stack Overflow LSTM (Reddi et al.'s 96 / 670 / 96
# with FedJAX's tanh and loss) and Shakespeare LSTM as FedJAX builds them.
TASKS = {
  'mlp': ('emnist', 'mlp', 'flax'),
  'cnn': ('emnist', 'reddi_emnist_cnn', 'flax'),
  'lstm': ('stackoverflow', 'fedjax_lstm_lm', 'haiku'),
  'shakespeare': ('shakespeare', 'fedjax_char_lstm', 'haiku'),
}
TEST_FILE = {
  'emnist': 'federated_emnist_test.sqlite',
  'stackoverflow': 'stackoverflow_test.sqlite',
  'shakespeare': 'shakespeare_test.sqlite',
}


class ChildFailed(Exception):
  """A side's process failed: its exit status and the end of its stderr."""


def run_child(cmd, env=None):
  """(stdout, seconds) of a command; raises ``ChildFailed``. Each side runs
  in a wrapper that prints its own peak RSS (``_wrapped``)."""
  start = time.perf_counter()
  proc = subprocess.Popen(
    cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
  )
  out, err = proc.communicate()
  if proc.returncode:
    last = (err.strip().splitlines() or [''])[-1][-300:]
    raise ChildFailed(
      f'{os.path.basename(cmd[0])} exited {proc.returncode}: {last}'
    )
  return out, time.perf_counter() - start


def _wrapped(python, argv):
  """``python -c`` that runs ``argv`` as a script and prints its VmHWM last."""
  code = (
    'import runpy, sys, atexit\n'
    'def _hwm():\n'
    '  for l in open("/proc/self/status"):\n'
    '    if l.startswith("VmHWM:"): print("PEAK_RSS", int(l.split()[1]) * '
    '1024, flush=True)\n'
    'atexit.register(_hwm)\n'
    f'sys.argv = {argv!r}\n'
    'runpy.run_path(sys.argv[0], run_name="__main__")\n'
  )
  return [python, '-c', code]


def peak_of(out):
  for line in out.splitlines()[::-1]:
    if line.startswith('PEAK_RSS'):
      return int(line.split()[1])
  return None


def init_file(a, model, seed):
  """Where ``--same_init`` keeps FedJAX's initial parameters of a row and
  seed."""
  os.makedirs(os.path.join(a.work_dir, 'init'), exist_ok=True)
  return os.path.join(a.work_dir, 'init', f'{model}_{seed}.npz')


def fedjax_run(a, model, cohort, seed):
  argv = [
    os.path.join(HERE, 'fedjax_side.py'),
    f'--data_dir={a.work_dir}/{TASKS[model][0]}',
    f'--model={model}',
    f'--cohort_size={cohort}',
    f'--rounds={a.rounds}',
    f'--batch_size={a.batch_size}',
    f'--client_lr={a.client_lr}',
    f'--seed={seed}',
  ]
  if a.same_init:
    argv.append(f'--save_init={init_file(a, model, seed)}')
  out, wall = run_child(_wrapped(a.fedjax_python, argv))
  rec = json.loads(next(l for l in out.splitlines() if l.startswith('{')))
  return {
    's_per_round': rec['s_per_round'],
    'accuracy': rec['accuracy'],
    'test_loss': rec.get('loss'),
    'peak_rss': peak_of(out),
    'process_s': wall,
    'train_s': float(sum(rec['seconds'])),
    'mean_after_first_s': float(np.mean(rec['seconds'][1:])),
  }


def project_run(a, model, cohort, seed, extra=()):
  out_dir = os.path.join(a.work_dir, 'runs', f'{model}_{cohort}')
  dataset, name, init = TASKS[model]
  # FedJAX's own first weights (--same_init), else the model's initialisation
  # convention.
  start = (
    f'--init_weights={init_file(a, model, seed)}'
    if a.same_init
    else f'--model_init={init}'
  )
  # Stack Overflow accuracy as FedJAX's side reports it (accuracy_in_vocab).
  task = (
    ['--vocab_size=10000', '--stackoverflow_accuracy=fedjax_in_vocab']
    if dataset == 'stackoverflow'
    else []
  )
  argv = [
    os.path.join(ROOT, 'scripts', 'run_experiment.py'),
    f'--dataset={dataset}',
    f'--data_dir={a.work_dir}/{dataset}',
    f'--model={name}',
    start,
    '--algorithm=fedavg',
    *task,
    f'--cohort_size={cohort}',
    f'--batch_size={a.batch_size}',
    f'--client_lr={a.client_lr}',
    f'--rounds={a.rounds}',
    '--eval_every=0',
    '--progress=false',
    f'--seed={seed}',
    f'--compilation_cache={os.path.join(a.work_dir, "xla") if a.warm_cache else "off"}',
    f'--output_dir={out_dir}',
    '--overwrite',
    *extra,
  ]
  env = dict(
    os.environ, FEDJAX_PERSONAL_CACHE=os.path.join(a.work_dir, 'cache')
  )
  out, wall = run_child(_wrapped(sys.executable, argv), env)
  with open(os.path.join(out_dir, 'fedavg', 'summary.json')) as f:
    s = json.load(f)
  header = [
    l
    for l in out.splitlines()
    if l.startswith(
      ('layout:', 'executor:', 'shape plan:', 'compilation cache:')
    )
  ]
  return {
    's_per_round': s['round_seconds_median'],
    'accuracy': s['accuracy_weighted'],
    'test_loss': s.get('loss_weighted'),
    'peak_rss': peak_of(out),
    'header': header,
    'process_s': wall,
    'train_s': s['train_seconds'],
    'first_round_s': s.get('first_round_seconds'),
    'compile_s': s.get('compile_seconds'),
    'mean_after_first_s': (s['train_seconds'] - s['first_round_seconds'])
    / (a.rounds - 1),
  }


def fp32_peak():
  """FLOP/s of a 2048x2048 float32 matmul on this machine (JAX, all cores)."""
  import jax
  import jax.numpy as jnp

  x = jnp.ones((2048, 2048), jnp.float32)
  f = jax.jit(lambda a: a @ a)
  f(x).block_until_ready()
  best = float('inf')
  for _ in range(5):
    t = time.perf_counter()
    f(x).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return 2 * 2048**3 / best


def train_flops_per_round(model, cohort, mean_examples, batch):
  """The FLOPs of the matmuls and convolutions of one SGD step at ``batch``
  (``bounds.py``: a scan's body once per step) per example, x the cohort's
  expected real examples (one epoch)."""
  import bounds
  import jax

  step, params, x, y = bounds.sgd_step(model, batch)
  found = bounds.matmuls(jax.make_jaxpr(step)(params, x, y).jaxpr)
  return sum(f for _, f, _ in found.values()) / batch * cohort * mean_examples


def _x(ratio):
  return '-' if ratio is None else f'{ratio:.2f}'


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument(
    '--fedjax_python', required=True, help="FedJAX's venv's python."
  )
  p.add_argument(
    '--work_dir', required=True, help='Files, cache and runs (kept, reused).'
  )
  p.add_argument(
    '--rows',
    default='mlp:10,mlp:50,mlp:500,cnn:50',
    help='model:cohort pairs (model mlp, cnn: EMNIST; lstm: Stack Overflow; '
    'shakespeare: Shakespeare).',
  )
  p.add_argument('--rounds', type=int, default=31)
  p.add_argument('--repeats', type=int, default=3)
  p.add_argument('--batch_size', type=int, default=20)
  p.add_argument('--client_lr', type=float, default=0.1)
  p.add_argument('--seed', type=int, default=0)
  p.add_argument(
    '--seed_per_repeat',
    action='store_true',
    help='Repeat r runs seed --seed + r '
    "on both sides (the model's init, the cohorts; FedJAX's shuffles are "
    'unseeded '
    "in every run, its default): the accuracy's mean and std over seeds.",
  )
  p.add_argument(
    '--num_clients', type=int, default=3400, help='EMNIST-shaped writers.'
  )
  p.add_argument(
    '--so_clients', type=int, default=3000, help='Stack Overflow-shaped users.'
  )
  p.add_argument(
    '--shakespeare_clients',
    type=int,
    default=715,
    help='Shakespeare-shaped speaking roles.',
  )
  p.add_argument(
    '--project_flags',
    default='',
    help='Extra flags of the project runs, '
    "';'-separated per variant, e.g. '--executor=sequential;--executor=auto'.",
  )
  p.add_argument(
    '--warm_cache',
    action='store_true',
    help="The project's runs share a "
    'persistent compilation cache in --work_dir/xla (the first repeat fills '
    'it); '
    'by default each run compiles from nothing (--compilation_cache=off).',
  )
  p.add_argument(
    '--same_init',
    action='store_true',
    help="Both sides start from FedJAX's "
    "initial parameters of the seed (FedJAX's side saves them, the project "
    'reads '
    'them with --init_weights).',
  )
  p.add_argument(
    '--project_only',
    action='store_true',
    help="The project's variants alone "
    "(FedJAX's side not run; no ratios): comparing executors or flags.",
  )
  p.add_argument('--output', default=None)
  p.add_argument(
    '--dry_run', action='store_true', help='Check the rows and print the plan.'
  )
  a = p.parse_args()
  a.fedjax_python = os.path.expanduser(a.fedjax_python)
  if a.same_init and a.project_only:
    p.error(
      "--same_init takes the initial parameters from FedJAX's side: drop "
      '--project_only'
    )
  for row in a.rows.split(','):
    model, _, cohort = row.partition(':')
    if model not in TASKS or not cohort.isdigit():
      p.error(
        f'--rows: {row!r} is not model:cohort with model in {sorted(TASKS)}'
      )
  if a.dry_run:
    found = os.path.exists(a.fedjax_python)
    print(
      f'dry run: rows {a.rows}, {a.rounds} rounds, {a.repeats} repeats, '
      f'project variants '
      f'{a.project_flags or "default"}; FedJAX python {a.fedjax_python} '
      f'({"found" if found else "not found: install FedJAX in its own venv first"})'
    )
    return
  has_fedjax = (
    subprocess.run(
      [a.fedjax_python, '-c', 'import fedjax'], capture_output=True
    ).returncode
    == 0
  )
  counts = {}
  for dataset in sorted({TASKS[r.split(':')[0]][0] for r in a.rows.split(',')}):
    folder = os.path.join(a.work_dir, dataset)
    if not os.path.exists(os.path.join(folder, TEST_FILE[dataset])):
      n = {
        'emnist': a.num_clients,
        'stackoverflow': a.so_clients,
        'shakespeare': a.shakespeare_clients,
      }[dataset]
      subprocess.run(
        [
          a.fedjax_python if has_fedjax else sys.executable,
          os.path.join(HERE, 'make_files.py'),
          f'--shape={dataset}',
          f'--num_clients={n}',
          f'--folder={folder}',
          f'--writer={"fedjax" if has_fedjax else "plain"}',
        ],
        check=True,
      )
    import bounds  # the project's JAX: after the dry run

    counts[dataset] = bounds.client_examples(a.work_dir, dataset)
  peak = fp32_peak()
  variants = (
    [v.split() for v in a.project_flags.split(';')] if a.project_flags else [[]]
  )
  rows = []
  for row in a.rows.split(','):
    model, cohort = row.split(':')
    cohort = int(cohort)
    flops = train_flops_per_round(
      model, cohort, counts[TASKS[model][0]].mean(), a.batch_size
    )
    runs, failed = {'fedjax': []}, None
    for rep in range(a.repeats):
      seed = a.seed + rep if a.seed_per_repeat else a.seed
      try:
        if failed is None and not a.project_only:
          runs['fedjax'].append(fedjax_run(a, model, cohort, seed))
      except ChildFailed as e:
        # FedJAX could not run the row: the project's side alone
        failed = str(e)
        print(f'{row}: {failed}', flush=True)
      for v in variants:
        runs.setdefault(' '.join(v) or 'default', []).append(
          project_run(a, model, cohort, seed, v)
        )
      print(
        f'{row} repeat {rep + 1}: '
        + ', '.join(
          f'{k} {r[-1]["s_per_round"]:.4f} s' for k, r in runs.items() if r
        ),
        flush=True,
      )
    med = lambda rs, k: float(np.median([r[k] for r in rs]))
    # FedJAX's side over this one (None where FedJAX failed the row: no NaN in
    # the JSON).
    ratio = lambda k, rs: (
      (med(runs['fedjax'], k) / med(rs, k)) if runs['fedjax'] else None
    )
    out = {
      'model': model,
      'cohort': cohort,
      'train_gflop_per_round': flops / 1e9,
      'runs': runs,
      'fedjax_failed': failed,
    }
    for k, rs in runs.items():
      if not rs:
        continue
      s = med(rs, 's_per_round')
      inverse = lambda k: None if ratio(k, rs) is None else 1 / ratio(k, rs)
      out[k] = {
        's_per_round': s,
        'speedup_vs_fedjax': ratio('s_per_round', rs),
        'accuracy': med(rs, 'accuracy'),
        'accuracy_mean': float(np.mean([r['accuracy'] for r in rs])),
        'accuracy_std': float(np.std([r['accuracy'] for r in rs])),
        'peak_rss_gb': med(rs, 'peak_rss') / 2**30,
        'pct_fp32_peak': 100 * flops / s / peak,
        'header': rs[-1].get('header'),
        'process_s': med(rs, 'process_s'),
        'train_s': med(rs, 'train_s'),
        'mean_after_first_s': med(rs, 'mean_after_first_s'),
        'process_vs_fedjax': inverse('process_s'),
        'train_vs_fedjax': inverse('train_s'),
      }
    rows.append(out)
  shapes = '; '.join(
    f'{d}-shaped: {len(c)} clients, {c.min()}-{c.max()} examples (median '
    f'{int(np.median(c))})'
    for d, c in counts.items()
  )
  print(
    f'\nfp32 peak (2048^2 matmul): {peak / 1e9:.0f} GFLOP/s; {shapes}; FedAvg, '
    f'batch '
    f'{a.batch_size}, 1 epoch, lr {a.client_lr}, {a.rounds} rounds, '
    f'{a.repeats} interleaved '
    'repeats (medians)'
  )
  print(
    '| model | cohort | side | s/round | x FedJAX | mean rounds 2..R / median '
    '| training s '
    '(x FedJAX) | whole process s (x FedJAX) | accuracy (mean +- std) | peak '
    'RSS GB | '
    '% fp32 peak |'
  )
  print('|---|---|---|---|---|---|---|---|---|---|---|')
  for r in rows:
    if r['fedjax_failed']:
      print(
        f'| {r["model"]} | {r["cohort"]} | fedjax | failed: '
        f'{r["fedjax_failed"]} |'
      )
    for k in r['runs']:
      if k not in r:
        continue
      v = r[k]
      print(
        f'| {r["model"]} | {r["cohort"]} | {k} | {v["s_per_round"]:.4f} | '
        f'{_x(v["speedup_vs_fedjax"])} | '
        f'{v["mean_after_first_s"] / v["s_per_round"]:.2f} | '
        f'{v["train_s"]:.2f} ({_x(v["train_vs_fedjax"])}) | '
        f'{v["process_s"]:.1f} ({_x(v["process_vs_fedjax"])}) | '
        f'{100 * v["accuracy"]:.1f}% '
        f'({100 * v["accuracy_mean"]:.1f} +- {100 * v["accuracy_std"]:.1f}) | '
        f'{v["peak_rss_gb"]:.2f} | {v["pct_fp32_peak"]:.0f}% |'
      )
  if a.output:
    with open(a.output, 'w') as f:
      json.dump(
        {'fp32_peak_gflops': peak / 1e9, 'rows': rows, 'args': vars(a)},
        f,
        indent=1,
      )


if __name__ == '__main__':
  main()
