"""Populations at full size: the host layout's memory and speed.

Generates once, into --work_dir, a population with a published data set's
statistics, written through the population store's writer as the loaders of
the field's files write it (``core.population.store.StoreWriter``), then trains FedAvg
on it for a few rounds in a fresh process per layout and prints, per layout:
peak host RSS (VmHWM of the training process), device bytes after the rounds (live JAX arrays), seconds per
round (rounds after the first), time to the end of the first round,
compiled round shapes, and what the padded (device) layout would need.

Shapes:
  stackoverflow: Stack Overflow next-word prediction (Reddi et al., "Adaptive
    Federated Optimization", arXiv 2003.00295): 342,477 users; sentences per
    user log-normal with mean ~400 and standard deviation ~1,300; 20-token
    sentences of uniformly drawn ids of the 10,004-id vocabulary (uint16 in
    the store, a tenth as many test sentences). Model: Reddi et al.'s LSTM
    reduced to embedding 32 / LSTM 64 / projection 32 (``--full_model`` for
    96 / 670 / 96), batch 16, one local epoch, at most --max_client_examples
    sentences per client (TFF caps at 1,000; the default here is 256).
  emnist: federated EMNIST-62: 3,400 writers, examples per writer
    log-normal with mean ~200 and std ~110 (a long tail), 28x28x1 float32;
    the project's small CNN, batch 20, one epoch.

Usage:
  python benchmarks/populations.py --shape=stackoverflow --num_clients=342477 \
      --cohort_size=50 --rounds=3 --work_dir=/tmp/so
"""

import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from typing import Optional, Tuple

import numpy as np

from fedjax_personal.errors import ConfigError
from fedjax_personal.hparams import Declared, hparam
from fedjax_personal.run import script_entry

VOCAB = 10004
SEQ = 20
SHAPES = {
  'stackoverflow': dict(clients=342477, mean=400.0, std=1300.0, test_share=0.1),
  'emnist': dict(clients=3400, mean=200.0, std=110.0, test_share=0.1),
}
GB = 1 << 30


@dataclasses.dataclass(frozen=True)
class PopulationSettings(Declared):
  """The benchmark's settings (its flags)."""

  shape: str = hparam(
    'stackoverflow', 'Which population.', choices=('stackoverflow', 'emnist')
  )
  num_clients: Optional[int] = hparam(
    None, "Clients (default: the data set's: 342,477 / 3,400).", minimum=1
  )
  cohort_size: int = hparam(50, 'Clients per round.', minimum=1)
  rounds: int = hparam(3, 'Rounds per layout.', minimum=1)
  work_dir: Optional[str] = hparam(
    None, 'Where the generated population store goes (kept, reused).'
  )
  layouts: Tuple[str, ...] = hparam(
    ('host', 'device'),
    'Layouts to run; device only where the '
    'padded population takes at most a quarter of the available '
    'memory.',
  )
  max_client_examples: int = hparam(
    256, 'Cap on training examples per client.', minimum=1
  )
  full_model: bool = hparam(
    False, "Stack Overflow: Reddi et al.'s LSTM at full size."
  )
  seed: int = hparam(0, 'Seed of the population and of training.')
  algorithm: str = hparam(
    'fedavg',
    "What trains: FedAvg, or one whose client rows (SCAFFOLD's "
    "control variates, personal models, FedAlt's personal adapters) the "
    'host layout keeps on the host.',
    choices=('fedavg', 'scaffold', 'ditto', 'local', 'fedalt'),
  )
  adapter_dim: int = hparam(
    16,
    "FedAlt: the personal residual adapters' width (the model gains "
    'one adapter per layer; the personal part is the adapters).',
  )
  checkpoint_every: int = hparam(
    0,
    'Also save a checkpoint (Orbax, rows in files as deltas) '
    'every this many rounds, timed and sized, and time a restore.',
  )
  client_state: str = hparam(
    'memory',
    'Host layout: client rows in host memory or in files '
    'under --work_dir/client_rows (made on first use).',
    choices=('memory', 'disk'),
  )
  output: Optional[str] = hparam(None, 'Also write the results as JSON here.')
  dry_run: bool = hparam(
    False, 'Check the flags and the work folder, then stop.'
  )
  train_layout: Optional[str] = hparam(
    None, '(internal) train one layout and print JSON.'
  )

  def check(self) -> None:
    if not self.work_dir:
      raise ConfigError(
        'work_dir',
        'give a folder for the generated population (kept and reused)',
      )
    if self.cohort_size > (self.num_clients or SHAPES[self.shape]['clients']):
      raise ConfigError(
        'cohort_size', f'must be at most the {self.num_clients} clients'
      )
    for layout in self.layouts:
      if layout not in ('host', 'device'):
        raise ConfigError(
          'layouts', f'unknown layout {layout!r}; choose host, device'
        )


script_entry.define_settings_flags(PopulationSettings)


def sizes(rng, n, mean, std):
  """Log-normal sizes with this mean and standard deviation, at least 1."""
  s2 = np.log1p((std / mean) ** 2)
  mu = np.log(mean) - s2 / 2
  return np.maximum(1, np.round(rng.lognormal(mu, np.sqrt(s2), n))).astype(
    np.int64
  )


def peak_rss_bytes() -> int:
  """This process's peak RSS: VmHWM of /proc/self/status (ru_maxrss would
  keep the parent's peak across fork and exec, generation's included)."""
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith('VmHWM:'):
        return int(line.split()[1]) * 1024
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def identity(cfg):
  n = cfg.num_clients or SHAPES[cfg.shape]['clients']
  return {
    'generator': 'benchmarks/populations.py',
    'shape': cfg.shape,
    'num_clients': n,
    'seed': cfg.seed,
    **SHAPES[cfg.shape],
  }


def generate(cfg, folder):
  """Writes the population client by client (chunks of clients drawn at
  once)."""
  from fedjax_personal.core.population.store import StoreWriter

  ident = identity(cfg)
  rng = np.random.default_rng(cfg.seed)
  n = ident['num_clients']
  train_n = sizes(rng, n, ident['mean'], ident['std'])
  test_n = rng.binomial(train_n, ident['test_share'])
  writer = StoreWriter(folder, ident)
  start = time.perf_counter()
  chunk = 4096
  try:
    for c0 in range(0, n, chunk):
      tr, te = train_n[c0 : c0 + chunk], test_n[c0 : c0 + chunk]
      total = int(tr.sum() + te.sum())
      if cfg.shape == 'stackoverflow':
        x = rng.integers(3, VOCAB, (total, SEQ), dtype=np.uint16)
        y = np.empty((total, SEQ), np.int16)
        y[:, :-1] = x[:, 1:]
        y[:, -1] = 2  # EOS
      else:
        x = rng.random((total, 28, 28, 1), dtype=np.float32)
        y = rng.integers(0, 62, total).astype(np.int16)
      at = 0
      for a, b in zip(tr, te):
        writer.add(
          (x[at : at + a], y[at : at + a]),
          None,
          (x[at + a : at + a + b], y[at + a : at + a + b]),
        )
        at += a + b
      if c0 // chunk % 10 == 0:
        print(
          f'  generated {min(c0 + chunk, n):,} / {n:,} clients '
          f'({time.perf_counter() - start:.0f} s)',
          flush=True,
        )
    classes = VOCAB if cfg.shape == 'stackoverflow' else 62
    store = writer.close(f'{cfg.shape}-shaped ({n:,} clients)', classes)
  except BaseException:
    writer.abort()
    raise
  print(
    f'  store written in {time.perf_counter() - start:.0f} s: '
    f'{store.nbytes() / GB:.2f} GB',
    flush=True,
  )
  return store


def open_or_generate(cfg):
  from fedjax_personal.core.population import store as store_lib

  folder = os.path.join(cfg.work_dir, 'store')
  if store_lib.is_store(folder):
    return store_lib.open_store(folder, identity(cfg))
  return generate(cfg, folder)


def train(cfg, layout):
  """One layout in this process: FedAvg rounds; returns the figures."""
  t0 = time.perf_counter()
  import jax

  import fedjax_personal as fp
  from fedjax_personal import algorithms
  from fedjax_personal.config import TrainingConfig
  from fedjax_personal.core.engine import RoundRunner
  from fedjax_personal.core.population.placement import HostData
  from fedjax_personal.core.sampling import CohortSampler
  from fedjax_personal.models import architectures

  store = open_or_generate(cfg)
  cap = cfg.max_client_examples
  population = store.population(cap)
  adapters = cfg.adapter_dim if cfg.algorithm == 'fedalt' else 0
  if cfg.shape == 'stackoverflow':
    dims = (96, 670, 96) if cfg.full_model else (32, 64, 32)
    module = architectures.CharLSTM(
      VOCAB,
      embed_dim=dims[0],
      hidden=dims[1],
      num_layers=1,
      projection=dims[2],
      adapter_dim=adapters,
    )
    training = TrainingConfig(client_lr=0.3, batch_size=16)
  else:
    module = fp.models.CNN(62, adapter_dim=adapters)
    training = TrainingConfig(client_lr=0.05, batch_size=20)
  model = fp.models.from_flax(cfg.shape, module, population.sample_x)
  if layout == 'host':
    rows_folder = None
    if cfg.client_state == 'disk':
      import shutil

      rows_folder = os.path.join(cfg.work_dir, 'client_rows')
      shutil.rmtree(rows_folder, ignore_errors=True)
    data = HostData(store, cap, rows_folder=rows_folder)
  else:
    data = jax.device_put(store.padded(cap))
  alg = algorithms.build(
    cfg.algorithm,
    model,
    population,
    training=training,
    **({'personal_part': 'adapter'} if adapters else {}),
  )
  sampler = CohortSampler(store.num_clients, cohort_size=cfg.cohort_size)
  runner = RoundRunner(
    alg, data, sampler, fp.create_executor('auto', model, population.sample_x)
  )
  key = jax.random.key(cfg.seed)
  state = runner.init(key)
  seconds, first, saves = [], None, []
  ckpt = Checkpoints(cfg, layout) if cfg.checkpoint_every else None
  for t in range(cfg.rounds):
    start = time.perf_counter()
    state, metrics = runner.round(
      state,
      jax.random.fold_in(key, t),
      t,
      donate=True,
      next_key=jax.random.fold_in(key, t + 1),
    )
    loss = float(metrics['train_loss'])
    seconds.append(time.perf_counter() - start)
    if first is None:
      first = time.perf_counter() - t0
    if ckpt is not None and (t + 1) % cfg.checkpoint_every == 0:
      before_save = peak_rss_bytes()
      saves.append(
        {
          **ckpt.save(t + 1, state),
          'peak_rss_before_gb': before_save / GB,
          'peak_rss_after_gb': peak_rss_bytes() / GB,
        }
      )
  jax.block_until_ready(state)
  rounds_peak = peak_rss_bytes()
  restored = (
    ckpt.restore(lambda: runner.init(key)) if ckpt is not None and saves else {}
  )
  live = sum(a.nbytes for a in jax.live_arrays())
  shapes = len(runner.feed.shapes) if layout == 'host' else 1
  rows = alg.client_rows
  from fedjax_personal.core.population import rows_in_files

  rows_gb = (
    0.0
    if rows is None
    else sum(
      a.nbytes for a in jax.tree.leaves(rows.get(runner.whole_state(state)))
    )
    / GB
  )
  disk_gb = (
    rows_in_files.disk_bytes(state.rows) / GB if hasattr(state, 'rows') else 0.0
  )
  return {
    'shape': cfg.shape,
    'algorithm': cfg.algorithm,
    'layout': layout,
    'client_rows_gb': rows_gb,
    'client_state': cfg.client_state,
    'rows_on_disk_gb': disk_gb,
    'num_clients': store.num_clients,
    'cohort_size': cfg.cohort_size,
    'rounds': cfg.rounds,
    'cap': cap,
    'executor': runner.executor.describe(),
    'peak_rss_gb': peak_rss_bytes() / GB,
    'peak_rss_rounds_gb': rounds_peak / GB,
    'device_bytes_gb': live / GB,
    'seconds_per_round': float(np.mean(seconds[1:]))
    if len(seconds) > 1
    else seconds[0],
    'first_round_s': first,
    'compiled_shapes': shapes,
    'padded_gb': store.padded_nbytes(cap) / GB,
    'padded_uncapped_gb': store.padded_nbytes() / GB,
    'store_gb': store.nbytes() / GB,
    'last_train_loss': loss,
    **({'checkpoints': saves, **restored} if saves else {}),
  }


class Checkpoints:
  """Timed checkpoints of the state into
  --work_dir/checkpoints_<layout>_<algorithm>
  (client rows in files as deltas of the rows changed): seconds, bytes
  written per save, the folder's size; and the time of a restore."""

  def __init__(self, cfg, layout):
    import shutil

    from fedjax_personal.run import checkpointing

    self.lib = checkpointing
    self.folder = os.path.join(
      cfg.work_dir, f'checkpoints_{layout}_{cfg.algorithm}'
    )
    shutil.rmtree(self.folder, ignore_errors=True)
    self.mngr = checkpointing.manager(self.folder)
    self.manifest = None

  def save(self, t, state):
    before = folder_bytes(self.folder)
    start = time.perf_counter()
    self.manifest = self.lib.save(
      self.mngr, t, state, [[{'round': t}]], None, self.manifest
    )
    return {
      'round': t,
      'seconds': time.perf_counter() - start,
      'written_gb': max(0, folder_bytes(self.folder) - before) / GB,
      'folder_gb': folder_bytes(self.folder) / GB,
    }

  def restore(self, init):
    start = time.perf_counter()
    _, step, _ = self.lib.restore_latest(self.folder, init())
    return {
      'restore_seconds': time.perf_counter() - start,
      'restored_round': step,
    }


def folder_bytes(folder) -> int:
  """Bytes a folder takes on disk (sparse files by their blocks)."""
  total = 0
  for root, _, files in os.walk(folder):
    for f in files:
      try:
        total += os.lstat(os.path.join(root, f)).st_blocks * 512
      except FileNotFoundError:
        pass
  return total


def main(cfg: PopulationSettings):
  if cfg.train_layout:
    print(json.dumps(train(cfg, cfg.train_layout)))
    return
  from fedjax_personal.core.population import store as store_lib

  folder = os.path.join(cfg.work_dir, 'store')
  if store_lib.is_store(folder):
    # another population there: one line, exit 2
    store_lib.open_store(folder, identity(cfg))
  if cfg.dry_run:
    print(f'dry run: {identity(cfg)} into {folder}')
    return
  os.makedirs(cfg.work_dir, exist_ok=True)
  from fedjax_personal.core.population.placement import (
    DEVICE_DATA_SHARE,
    host_available_bytes,
  )

  store = open_or_generate(cfg)
  padded = store.padded_nbytes(cfg.max_client_examples)
  print(
    f'{store.name}: {store.num_clients:,} clients, store '
    f'{store.nbytes() / GB:.2f} GB; '
    f'padded to the widest client: {store.padded_nbytes() / GB:,.1f} GB, '
    f'capped at '
    f'{cfg.max_client_examples}: {padded / GB:.2f} GB',
    flush=True,
  )
  del store
  results = []
  for layout in cfg.layouts:
    avail = host_available_bytes()
    if (
      layout == 'device'
      and avail is not None
      and padded > DEVICE_DATA_SHARE * avail
    ):
      print(
        f'device layout skipped: the padded population ({padded / GB:.1f} GB) '
        f'exceeds '
        f'{DEVICE_DATA_SHARE:.0%} of the available {avail / GB:.1f} GB',
        flush=True,
      )
      continue
    cmd = [sys.executable, __file__, f'--train_layout={layout}'] + [
      a for a in sys.argv[1:] if not a.startswith('--train_layout')
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
      print(
        f'{layout}: failed (exit {out.returncode}): '
        f'{out.stderr.strip().splitlines()[-1:]}'
      )
      continue
    r = json.loads(out.stdout.strip().splitlines()[-1])
    results.append(r)
    where = (
      f', {r["rows_on_disk_gb"]:.2f} GB of them written to disk'
      if r['client_state'] == 'disk' and layout == 'host'
      else ''
    )
    print(
      f'{layout:6s} {r["algorithm"]} (client rows {r["client_rows_gb"]:.2f} '
      f'GB{where}) peak RSS '
      f'{r["peak_rss_gb"]:.2f} GB, device bytes '
      f'{r["device_bytes_gb"]:.3f} GB, {r["seconds_per_round"]:.2f} s/round, '
      f'first round '
      f'done at {r["first_round_s"]:.1f} s, compiled shapes '
      f'{r["compiled_shapes"]}, '
      f'{r["executor"]}',
      flush=True,
    )
    for c in r.get('checkpoints', []):
      print(
        f'       checkpoint after round {c["round"]}: {c["seconds"]:.2f} s, '
        f'{c["written_gb"]:.3f} GB written, folder {c["folder_gb"]:.3f} GB, '
        f'peak RSS '
        f'{c["peak_rss_before_gb"]:.2f} GB before it, '
        f'{c["peak_rss_after_gb"]:.2f} GB after',
        flush=True,
      )
    if 'restore_seconds' in r:
      print(
        f'       restore of round {r["restored_round"]}: '
        f'{r["restore_seconds"]:.2f} s; peak '
        f'RSS {r["peak_rss_rounds_gb"]:.2f} GB before it',
        flush=True,
      )
  if cfg.output:
    with open(cfg.output, 'w') as f:
      json.dump(results, f, indent=1)


if __name__ == '__main__':
  script_entry.run_script(main, settings=PopulationSettings)
