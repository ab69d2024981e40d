#!/usr/bin/env python
"""The accelerator check: one command, about 8 minutes on one GPU.

On whatever device JAX finds, section by section, each in a process of its
own (a section that fails or runs out of time is reported and the next one
runs; every process shares the GPU with ``XLA_PYTHON_CLIENT_PREALLOCATE=false``):

  device       the device, the versions (jax, jaxlib, flax, optax, torch), the
               float32 / TF32 / bfloat16 matmul rates and the memory
               bandwidth, measured now (the "% of peak" figures use them);
  populations  an EMNIST-shaped population (3,400 writers, 24-1,067 examples,
               ``benchmarks/populations.py``'s generator), the McMahan CNN,
               FedAvg: cohorts 50 and 500 in the device and host layouts at
               float32, cohort 500 at TF32, in blocks by work, with XLA's
               convolutions, and in the host layout without the prefetch of
               the next cohort;
  models       MLP, LeNet-5 and the CIFAR CNN, 1,000 and 10,000 clients, K=5
               (``scripts/benchmark.py``'s round), LeNet-5 with XLA's
               convolutions and at TF32;
  torch        the PyTorch per-client loop (``scripts/torch_loop.py``) on the
               same rounds at 1,000 clients (10,000: 10x that, estimated);
  main_job     README command 1's job, its table beside the README's;
  sweep        8 seeds of FedAvg as one program against 8 separate runs;
  tests        ``pytest -m "accelerator and not slow"``: the tests whose numbers
               depend on the backend (precision, convolutions, sharding, memory
               plans, donation, executors' equality).

Then the whole as one table (and ``--output`` JSON). It needs jax (with
its GPU or TPU plugin), flax, optax, chex, orbax and, for the PyTorch rows,
torch; not tensorflow-datasets or dp-accounting. ``--smoke`` runs every
section at toy sizes (on a CPU, in the test suite: the check cannot rot).

  python benchmarks/accelerator.py --output=accelerator.json        # ~8 min on an H100/H200
  python benchmarks/accelerator.py --smoke                          # ~1 min on 2 CPU cores
  python benchmarks/accelerator.py --sections=device,populations    # some sections
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = (
  'device',
  'populations',
  'models',
  'torch',
  'main_job',
  'tests',
  'sweep',
)
#: Seconds a section may take (full size); the whole stops starting sections
#: past --budget.
SECTION_SECONDS = {
  'device': 60,
  'populations': 170,
  'models': 150,
  'torch': 90,
  'main_job': 90,
  'tests': 170,
  'sweep': 60,
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument(
    '--sections',
    default=','.join(SECTIONS),
    help='comma-separated, of ' + ', '.join(SECTIONS),
  )
  p.add_argument(
    '--smoke', action='store_true', help='every section at toy sizes (CPU, CI)'
  )
  p.add_argument('--output', help='write the rows as JSON here')
  p.add_argument(
    '--budget',
    type=float,
    default=560.0,
    help='seconds for the whole; sections that would start past it are skipped',
  )
  p.add_argument(
    '--work_dir',
    help='where the generated population goes (default: a temporary folder)',
  )
  p.add_argument(
    '--population_configs',
    help="instead of the populations section's own: "
    'layout:cohort:executor:block:precision:conv:prefetch;... (block 0: none, '
    'prefetch 0/1), e.g. device:500:blocked:100:float32:auto:1',
  )
  p.add_argument(
    '--model_grid',
    help="instead of the models section's own: "
    'model:clients:conv:precision;..., e.g. cnn_cifar:1000:auto:float32',
  )
  p.add_argument(
    '--dry_run', action='store_true', help='print what would run, run nothing'
  )
  p.add_argument('--worker', help=argparse.SUPPRESS)
  return p.parse_args(argv)


# -- the orchestrator
# -----------------------------------------------------------


def run_worker(args):
  os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  import accelerator_sections as sections

  section = args.worker
  if section == 'populations':
    sections.populations_section(
      args.smoke, args.work_dir, args.population_configs
    )
  elif section == 'models':
    sections.models_section(args.smoke, args.model_grid)
  elif section == 'main_job':
    sections.main_job_section(args.smoke, args.work_dir)
  else:
    {
      'device': sections.device_section,
      'torch': sections.torch_section,
      'sweep': sections.sweep_section,
      'tests': sections.tests_section,
    }[section](args.smoke)


def run_section(section, args, timeout, log):
  """Runs one section's worker; its rows (an 'error' row when it failed or
  ran out of time)."""
  cmd = [
    sys.executable,
    os.path.abspath(__file__),
    f'--worker={section}',
    f'--work_dir={args.work_dir}',
  ] + (['--smoke'] if args.smoke else [])
  cmd += [
    f'--{k}={v}'
    for k, v in (
      ('population_configs', args.population_configs),
      ('model_grid', args.model_grid),
    )
    if v
  ]
  env = {
    **os.environ,
    'XLA_PYTHON_CLIENT_PREALLOCATE': 'false',
    'PYTHONUNBUFFERED': '1',
  }
  rows, t = [], time.perf_counter()
  proc = subprocess.Popen(
    cmd,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env=env,
    cwd=ROOT,
  )
  import threading

  timer = threading.Timer(timeout, proc.kill)
  timer.start()
  try:
    for line in proc.stdout:
      log.write(line)
      log.flush()
      if line.startswith('ROW '):
        rows.append(json.loads(line[4:]))
      else:
        print('  ' + line.rstrip(), flush=True)
    proc.wait()
  finally:
    timer.cancel()
  seconds = time.perf_counter() - t
  if proc.returncode:
    why = (
      f'stopped after {timeout:.0f} s'
      if seconds >= timeout - 1
      else f'exit {proc.returncode}'
    )
    print(f'  {section}: {why}', flush=True)
    rows.append({'section': section, 'error': why})
  return rows, seconds


def report(rows):
  """The summary table: each timed round against the measured peaks and the
  PyTorch loop."""
  dev = next(
    (r for r in rows if r['section'] == 'device' and 'peak_flops' in r), None
  )
  peaks = dev['peak_flops'] if dev else {}
  torch = {
    r['model']: r['round_s']
    for r in rows
    if r['section'] == 'torch' and 'round_s' in r
  }
  torch_n = {
    r['model']: r['clients']
    for r in rows
    if r['section'] == 'torch' and 'round_s' in r
  }
  lines = []
  if dev:
    lines.append(
      f'{dev["devices"]} x {dev["device"]} ({dev["backend"]}); jax '
      f'{dev["versions"].get("jax")}, torch {dev["versions"].get("torch")}; '
      f'peaks '
      + ', '.join(f'{k} {v / 1e12:.1f}' for k, v in peaks.items())
      + ' TFLOP/s'
    )

  def pct(r):
    if not peaks or not r.get('flops_per_round'):
      return ''
    rate = r['flops_per_round'] / r['round_s']
    return (
      f'{100 * rate / peaks["float32"]:5.1f}% fp32 / '
      f'{100 * rate / peaks["tf32"]:5.1f}% tf32 peak'
    )

  lines.append('round (s)    what')
  for r in rows:
    if r.get('error'):
      lines.append(
        f'  error      {r["section"]} '
        f'{r.get("label") or r.get("model") or ""}: '
        f'{r["error"][:160]}'
      )
      continue
    if r['section'] == 'models':
      base = torch.get(r['model'])
      scale = r['clients'] / torch_n[r['model']] if base else 1
      vs = (
        (
          f', {base * scale / r["round_s"]:,.0f}x the torch loop'
          + ('' if scale == 1 else ' (estimated from its 1,000)')
        )
        if base
        else ''
      )
      lines.append(
        f'  {r["round_s"]:9.4f}  {r["model"]} {r["clients"]:,} clients, conv '
        f'{r["conv_impl"]}, {r["precision"]}: {pct(r)}{vs}'
      )
    elif r['section'] == 'populations':
      lines.append(
        f'  {r["round_s"]:9.4f}  EMNIST-shaped {r["label"]}: {pct(r)}'
      )
    elif r['section'] == 'torch':
      lines.append(
        f'  {r["round_s"]:9.4f}  torch loop {r["model"]} {r["clients"]:,} '
        f'clients '
        f'({r["device"]})'
      )
    elif r['section'] == 'sweep':
      lines.append(
        f'  {r["one_program_round_s"]:9.4f}  {r["seeds"]} seeds in one '
        f'program, '
        f'{r["speedup"]:.2f}x {r["seeds"]} separate runs'
      )
    elif r['section'] == 'main_job':
      lines.append(
        f'  main job {r["wall_s"]:.0f} s, largest difference from the README '
        f'{r["largest_difference"]} points'
      )
    elif r['section'] == 'tests':
      lines.append(f'  tests: {r["summary"]}')
  pops = {
    (r['layout'], r['cohort']): r['round_s']
    for r in rows
    if r['section'] == 'populations'
    and 'round_s' in r
    and r['precision'] == 'float32'
    and r['conv_impl'] == 'auto'
    and r['prefetch']
    and 'blocked' not in r['label']
  }
  for layout in ('device', 'host'):
    c = sorted(k[1] for k in pops if k[0] == layout)
    if len(c) == 2:
      lines.append(
        f'  cohort {c[1]} / cohort {c[0]} ({layout}): '
        f'{pops[(layout, c[1])] / pops[(layout, c[0])]:.1f}x'
      )
  return '\n'.join(lines)


def main():
  args = parse_args()
  if args.worker:
    run_worker(args)
    return
  sections = [s.strip() for s in args.sections.split(',') if s.strip()]
  unknown = [s for s in sections if s not in SECTIONS]
  if unknown:
    print(
      f'error: --sections: unknown {unknown}; choose from {list(SECTIONS)}',
      file=sys.stderr,
    )
    sys.exit(2)
  for spec, fields in ((args.population_configs, 7), (args.model_grid, 4)):
    if spec and any(len(x.split(':')) != fields for x in spec.split(';')):
      print(
        f'error: {spec!r}: each configuration has {fields} fields separated by '
        f'":"',
        file=sys.stderr,
      )
      sys.exit(2)
  if args.dry_run:
    print(
      f'sections: {sections}; '
      + ('smoke sizes' if args.smoke else 'full sizes')
      + f'; budget {args.budget:.0f} s; nothing run'
    )
    return
  if not args.work_dir:
    args.work_dir = tempfile.mkdtemp(prefix='fedjax_personal_accelerator_')
  os.makedirs(args.work_dir, exist_ok=True)
  if args.output:
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
  start = time.perf_counter()
  log_path = (
    os.path.splitext(args.output)[0] + '.log'
    if args.output
    else os.path.join(args.work_dir, 'accelerator.log')
  )
  rows = []
  with open(log_path, 'w') as log:
    for section in sections:
      left = args.budget - (time.perf_counter() - start)
      cap = SECTION_SECONDS[section] * (3 if args.smoke else 1)
      if left < min(cap, 30):
        print(
          f'{section}: skipped ({left:.0f} s of the --budget left)', flush=True
        )
        rows.append({'section': section, 'error': 'skipped: out of --budget'})
        continue
      print(f'== {section}', flush=True)
      got, seconds = run_section(
        section, args, min(cap, left) if not args.smoke else cap, log
      )
      rows += got
      print(f'   ({seconds:.0f} s)', flush=True)
      # written after every section: a cut-off run keeps what it measured
      if args.output:
        with open(args.output, 'w') as f:
          json.dump({'rows': rows, 'smoke': args.smoke}, f, indent=1)
  print(
    f'\nAccelerator check ({time.perf_counter() - start:.0f} s'
    + (', smoke sizes' if args.smoke else '')
    + ')'
  )
  print(report(rows))
  failed = [r for r in rows if r.get('error')]
  if args.smoke and failed:  # in the suite every section must run
    sys.exit(1)


if __name__ == '__main__':
  main()
