"""Loading a federated data set from its ``DataConfig``: a pool (MNIST,
CIFAR, TFDS) partitioned into clients, or a natural data set's own clients
(read from its files client by client into a population store, or built in
memory), padded for the device layout or stored for the host layout.
"""

import dataclasses
import hashlib
import json
import os
import sys
from typing import Callable, Optional

import numpy as np

from fedjax_personal import user_reads
from fedjax_personal.core.data import (
  FederatedData,
  client_splits,
  pad_clients,
  split_client_examples,
)
from fedjax_personal.core.population import store as store_lib
from fedjax_personal.core.population.clients import FORMAT, PopulationStore
from fedjax_personal.datasets import (
  embedding,
  local_files,
  partition,
  registry,
)
from fedjax_personal.datasets.config import (
  DataConfig,
  in_memory_clients,
  is_natural,
  streams_to_store,
)
from fedjax_personal.datasets.natural_data import NaturalData, client_id
from fedjax_personal.datasets.partition import Partition
from fedjax_personal.errors import ConfigError, DataError

__all__ = [
  'chosen_clients',
  'load_federated',
  'load_pool',
  'load_store',
  'make_partition',
  'READS_FILE',
  'pooled_clients',
  'PooledClients',
]


def load_pool(cfg: DataConfig):
  """(x, y, num_classes) pool of a non-natural data set.

  Args:
    cfg: the data set (``DataConfig``).

  Returns:
    ``(x, y, num_classes)``.
  """
  pool = registry.pool_of(cfg.dataset)
  if pool is None or pool.kind != 'pool':
    pools = [n for n, p in registry.POOLS.items() if p.kind == 'pool']
    raise ConfigError(
      'dataset',
      f'{cfg.dataset!r} is not a pool to partition; choose one of '
      f'{", ".join(pools)}, tfds:<name>',
    )
  x, y, c = pool(
    name=cfg.dataset,
    options=cfg.options,
    data_dir=cfg.data_dir,
    download=cfg.download,
    max_examples=cfg.max_examples,
  )
  if cfg.max_examples is not None and cfg.max_examples < len(y):
    keep = np.random.default_rng(cfg.seed + 7).permutation(len(y))[
      : cfg.max_examples
    ]
    x, y = x[np.sort(keep)], y[np.sort(keep)]
  return x, y, c


def make_partition(
  cfg: DataConfig, x, y, num_classes, rng, n: int
) -> Partition:
  """The partition named by ``cfg.partition`` of a pool (x, y) into ``n``
  clients.

  Args:
    cfg: the data set (its partition's settings).
    x: the pool's inputs.
    y: its labels.
    num_classes: its classes.
    rng: the partition's generator.
    n: the clients (``cfg.num_clients``, given).

  Returns:
    The ``Partition``.
  """
  p = cfg.partition
  if p == 'natural':
    raise ConfigError(
      'partition',
      "partition 'natural' is only for "
      f'{sorted(registry.LOADERS) + in_memory_clients()} and '
      f'{registry.LEAF_PREFIX}<name>',
    )
  base = None
  if p in ('rotation', 'label_permutation'):
    base = (
      partition.dirichlet(y, n, cfg.alpha, rng)
      if cfg.group_base == 'dirichlet'
      else partition.iid(y, n, rng)
    )
  if p == 'iid':
    return partition.iid(y, n, rng)
  if p == 'dirichlet':
    return partition.dirichlet(y, n, cfg.alpha, rng)
  if p == 'pathological':
    return partition.pathological(y, n, cfg.classes_per_client, rng)
  if p == 'quantity_skew':
    return partition.quantity_skew(y, n, cfg.alpha, rng)
  if p == 'rotation':
    if x.ndim != 4 or x.shape[1] != x.shape[2]:
      raise ConfigError(
        'partition',
        f'rotation needs square images, dataset {cfg.dataset} has shape '
        f'{x.shape[1:]}',
      )
    return partition.rotation_groups(y, n, rng, cfg.num_groups, base)
  if p == 'label_permutation':
    return partition.label_permutation_groups(
      y, n, num_classes, rng, cfg.num_groups, base
    )
  if p in ('sparse_classes', 'sparse_classes_permuted'):
    return partition.sparse_classes(
      y,
      n,
      num_classes,
      cfg.classes_per_client,
      rng,
      cfg.examples_per_client,
      permute=p.endswith('permuted'),
    )
  if cfg.latent_features == 'embedding':
    x = embedding.semantic_features(x, y, num_classes, cfg.seed)
  return partition.latent_clusters(x, n, cfg.num_groups, rng)


def _check_config(cfg: DataConfig) -> None:
  local_files.check_data_dir(cfg.data_dir)
  if is_natural(cfg.dataset, cfg.partition) and cfg.partition not in (
    'natural',
    'dirichlet',
  ):
    # dirichlet is the flag default
    raise ConfigError(
      'partition',
      f'dataset {cfg.dataset} has a natural partition; use --partition=natural',
    )


@dataclasses.dataclass
class PooledClients:
  """A data set built in memory, client by client.

  A partitioned pool, Tiny Shakespeare, Synthetic, CIFAR-100 split per
  client; unpadded: ``padded()`` for the device layout, ``store()`` for the
  host layout.

  Attributes:
    splits: ``{split: ([x_i], [y_i])}`` (``core.data.client_splits``).
    groups: int32 [N] known groups, or None.
    num_classes, name: as FederatedData's.
    x_spec: (shape, dtype) of one input example; y_shape: of one target.
  """

  splits: dict
  groups: Optional[np.ndarray]
  num_classes: int
  name: str
  x_spec: tuple
  y_shape: tuple = ()

  def _groups(self):
    n = len(self.splits['train'][0])
    return (
      -np.ones(n, np.int32)
      if self.groups is None
      else np.asarray(self.groups, np.int32)
    )

  def padded(self) -> FederatedData:
    x_shape, x_dtype = self.x_spec
    out = {
      k: pad_clients(xs, ys, x_shape, x_dtype, self.y_shape, np.int32)
      for k, (xs, ys) in self.splits.items()
    }
    return FederatedData(
      train=out['train'],
      val=out['val'],
      test=out['test'],
      groups=self._groups(),
      num_classes=self.num_classes,
      name=self.name,
    )

  def store(self) -> PopulationStore:
    return PopulationStore.from_clients(
      self.splits,
      self._groups(),
      self.num_classes,
      self.name,
      self.x_spec,
      self.y_shape,
    )


def load_federated(cfg: DataConfig) -> FederatedData:
  """Builds the FederatedData described by ``cfg`` (numpy leaves, every
  client padded to the largest: the device layout).

  Args:
    cfg: the data set (``DataConfig``).

  Returns:
    The ``FederatedData`` (host numpy; ``core.data.to_device`` puts it on the
    device).

  Raises:
    ConfigError / DataError (MissingDataError) naming the flag or file.
  """
  _check_config(cfg)
  if streams_to_store(cfg):
    return load_store(cfg).padded()
  return pooled_clients(cfg).padded()


def pooled_clients(cfg: DataConfig) -> PooledClients:
  """The clients of a data set built in memory (not read client by client
  from its files: ``streams_to_store`` is False), unpadded.

  Args:
    cfg: the data set (``DataConfig``).

  Returns:
    The ``PooledClients``: ``padded()`` for the device layout, ``store()`` for
      the host layout.
  """
  _check_config(cfg)
  rng = np.random.default_rng(cfg.seed)
  if is_natural(cfg.dataset, cfg.partition):
    pool = registry.pool_of(cfg.dataset)
    if pool is not None and pool.kind == 'clients':
      return _clients_in_memory(cfg, pool, rng)
    nat = registry.load(
      cfg.dataset,
      cfg.num_clients,
      cfg.data_dir,
      cfg.download,
      **_reader_options(cfg),
    )
    return _split_pool(
      [x for x, _ in nat.train],
      [y for _, y in nat.train],
      nat.num_classes,
      cfg,
      rng,
      _natural_name(cfg, nat),
    )
  if cfg.num_clients is None:
    raise ConfigError(
      'num_clients', f'give --num_clients for {cfg.dataset}/{cfg.partition}'
    )
  x, y, num_classes = load_pool(cfg)
  if cfg.num_clients > len(y):
    raise ConfigError(
      'num_clients',
      f'num_clients={cfg.num_clients} exceeds the {len(y)} examples of '
      f'{cfg.dataset}',
    )
  part = make_partition(cfg, x, y, num_classes, rng, cfg.num_clients)
  splits = client_splits(
    x,
    y,
    part.client_indices,
    rng,
    cfg.test_fraction,
    cfg.val_fraction,
    part.client_transform,
  )
  return PooledClients(
    splits,
    part.groups,
    part.num_classes or num_classes,
    f'{cfg.dataset}/{cfg.partition}',
    (x.shape[1:], x.dtype),
    y.shape[1:],
  )


def load_store(
  cfg: DataConfig,
  verify: bool = False,
  should_stop=lambda: False,
  rebuild: bool = False,
) -> PopulationStore:
  """The population store of ``cfg`` (unpadded clients, see
  ``core.population.store``). A natural data set read from its files is written
  once, client by client, into the cache (``stores/``), keyed by what it holds
  (the options and the SHA-256 of each source file its reader names,
  ``local_files.content_digest``; a reader that names none, by the SHA-256 of
  what it returns, ``content_digest``); any other data set is built in memory
  (``load_federated``) and stored there.

  A cached store that fails its checks (``core.population.store``: checksums,
    sizes),
  was written by another version of the format or by other loader code
  (``registry.loader_code``), or ``rebuild`` asks, is rebuilt from the source
  files, one line on stderr saying so. Leftovers of builds killed midway are
  removed.

  Args:
    cfg: the data set.
    verify: check every block of the store now (``--verify_store``), not
      as its rows are first read.
    should_stop: asked between clients while a store is built; True stops
      the build (``KeyboardInterrupt``, nothing of it kept).
    rebuild: rebuild the cached store from its files (``--rebuild_store``).

  Returns:
    The ``PopulationStore``.
  """
  _check_config(cfg)
  if not streams_to_store(cfg):  # built in memory, stored without padding
    return pooled_clients(cfg).store()
  options = _reader_options(cfg)
  with user_reads.recording() as opened:
    nat = registry.load(
      cfg.dataset, cfg.num_clients, cfg.data_dir, cfg.download, **options
    )
  return _store_of(cfg, nat, options, opened, verify, should_stop, rebuild)


#: A store's record of the files its reader read without naming them.
READS_FILE = 'reads.json'


def _unnamed_reads_changed(folder) -> Optional[str]:
  """The first file a store's reader read unnamed (``READS_FILE``) that
  changed or went since, or environment variable it read that has another
  value now, or None."""
  try:
    with open(folder / READS_FILE) as f:
      reads = json.load(f)
  except (OSError, ValueError):
    return None
  if isinstance(reads, list):  # written before variables were recorded
    reads = {'files': reads, 'env': []}
  for path, digest in reads.get('files', []):
    if not os.path.isfile(path) or local_files.content_digest(path) != digest:
      return path
  now = user_reads.Reads(
    env={k: os.environ.get(k) for k, _ in reads.get('env', [])}
  )
  for (name, was), (_, value) in zip(reads.get('env', []), now.record()['env']):
    if was != value:
      return f'${name}'
  return None


def _store_of(
  cfg: DataConfig,
  nat: NaturalData,
  options: dict,
  opened: user_reads.Reads,
  verify: bool,
  should_stop: Optional[Callable[[], bool]],
  rebuild: bool,
) -> PopulationStore:
  """``load_store``'s natural data set: its cached store, or one written from
  ``nat`` (the files its reader opened, ``opened``, named or not, recorded
  beside it: one that changes rebuilds it)."""
  identity = {
    'dataset': cfg.dataset,
    'num_clients': nat.num_clients,
    'num_classes': int(nat.num_classes),
    **({'eval_only': nat.eval_only} if nat.eval_only else {}),
    'options': cfg.options.store_key(options),
    'val_fraction': cfg.val_fraction,
    'seed': cfg.seed if cfg.val_fraction else None,
    'files': [
      (os.path.basename(f), local_files.content_digest(f)) for f in nat.files
    ],
  }
  if not nat.files:  # a reader that names no file: what it returns is the key
    with user_reads.recording() as more:
      identity['content'] = content_digest(nat)
    opened.update(more)
  digest = hashlib.sha256(
    json.dumps(identity, sort_keys=True).encode()
  ).hexdigest()[:8]
  folder = (
    local_files.cache_dir()
    / 'stores'
    / f'{cfg.dataset.replace(":", "_")}-{digest}'
  )
  store_lib.remove_leftovers(folder.parent)  # builds killed midway
  code = registry.loader_code(cfg.dataset)
  if store_lib.is_store(folder):
    written = store_lib.store_format(folder)
    made_by = store_lib.store_identity(folder).get('loader_code')
    if rebuild:
      why = 'rebuilding it as --rebuild_store asks'
    elif written != FORMAT:
      why = f'written in format {written!r}, this version reads {FORMAT!r}'
    elif made_by != code:
      why = (
        f'written by other loader code '
        f'({made_by or "before loaders were recorded"}, '
        f'this is {code})'
      )
    elif (changed := _unnamed_reads_changed(folder)) is not None:
      why = f'its reader also read {changed}, which changed since'
    else:
      try:
        return store_lib.open_store(
          folder, {**identity, 'loader_code': code}, verify=verify
        )
      except store_lib.StoreDamaged as e:
        why = e.what
    source = (
      f'from {", ".join(map(str, nat.files))}'
      if nat.files
      else 'from what its reader returns'
    )
    print(
      f'{folder}: {why}; rebuilding it {source}', file=sys.stderr, flush=True
    )
  writer = store_lib.StoreWriter(folder, {**identity, 'loader_code': code})
  try:
    with user_reads.recording() as more:
      _write_natural(nat, cfg, writer, should_stop)
    store = writer.close(
      _natural_name(cfg, nat), nat.num_classes, nat.eval_only
    )
  except BaseException:
    writer.abort()
    raise
  opened.update(more)
  reads = {
    'files': local_files.reads_of(opened.files, nat.files),
    'env': opened.record()['env'],
  }

  def write(path):
    with open(path, 'w') as f:
      json.dump(reads, f)

  local_files.write_atomically(folder / READS_FILE, write)
  return store


def content_digest(nat: NaturalData) -> str:
  """SHA-256 (16 hex digits) of every client a reader returns: ids, and
  each split's arrays (dtype, shape, bytes). The key of the store of a
  reader that names no file (``NaturalData.files`` empty, e.g. arrays it
  loads itself): read every run, so a changed source always gives a new
  store, never a stale one.

  Args:
    nat: the reader's clients.

  Returns:
    16 hex digits.
  """
  h = hashlib.sha256()
  for cid, *parts in nat.stream():
    h.update(repr(client_id(cid)).encode())
    for part in parts:
      for a in part if part is not None else ():
        a = np.ascontiguousarray(a)
        h.update(f'{a.dtype.str}{a.shape}'.encode())
        h.update(a.tobytes())
  return h.hexdigest()[:16]


def _reader_options(cfg: DataConfig) -> dict:
  """The options ``cfg``'s reader takes (its options' fields and ``seed``,
  those its signature names; ``leaf:<name>`` takes none)."""
  if cfg.dataset.startswith(registry.LEAF_PREFIX):
    return {}
  return registry.reader_options(
    cfg.dataset, {**cfg.options.reader_kwargs(), 'seed': cfg.seed}
  )


def _natural_name(cfg: DataConfig, nat: NaturalData) -> str:
  n = nat.num_clients - nat.eval_only
  return (
    f'{cfg.dataset}/natural'
    + (
      f' (first {n} of {nat.total_clients:,} clients)'
      if n < nat.total_clients
      else ''
    )
    + (f' + {nat.eval_only} held-out test clients' if nat.eval_only else '')
  )


def _write_natural(
  nat: NaturalData, cfg: DataConfig, writer, should_stop=lambda: False
) -> None:
  """Writes a natural data set's clients with the files' own test split; a
  validation split (--val_fraction) is drawn from each client's training
  examples (in the file's order within each part)."""
  rng = np.random.default_rng(cfg.seed)
  for (
    cid,
    (x, y),
    test,
    *given_val,
  ) in nat.stream():
    # a reader may give a client's validation
    if should_stop():
      raise KeyboardInterrupt
    tr, va, _ = split_client_examples(len(x), rng, 0.0, cfg.val_fraction)
    tr, va = np.sort(tr), np.sort(va)
    val = (
      (x[va], y[va])
      if not given_val or not len(given_val[0][0])
      else given_val[0]
    )
    writer.add((x[tr], y[tr]), val, test, client_id=client_id(cid))


def _clients_in_memory(cfg: DataConfig, pool, rng) -> PooledClients:
  """The clients a ``Pool`` of ``kind='clients'`` makes (Tiny Shakespeare by
  role, FedProx's Synthetic): each client's examples split with
  --test_fraction / --val_fraction."""
  xs, ys, num_classes = pool(
    name=cfg.dataset,
    options=cfg.options,
    data_dir=cfg.data_dir,
    download=cfg.download,
    max_examples=cfg.max_examples,
    num_clients=cfg.num_clients or 20,
    rng=rng,
  )
  return _split_pool(xs, ys, num_classes, cfg, rng, f'{cfg.dataset}/natural')


def _split_pool(xs, ys, num_classes, cfg, rng, name) -> PooledClients:
  x, y = np.concatenate(xs), np.concatenate(ys)
  offs = np.cumsum([0] + [len(a) for a in xs])
  splits = client_splits(
    x,
    y,
    [np.arange(offs[i], offs[i + 1]) for i in range(len(xs))],
    rng,
    cfg.test_fraction,
    cfg.val_fraction,
  )
  return PooledClients(
    splits, None, num_classes, name, (x.shape[1:], x.dtype), y.shape[1:]
  )


def chosen_clients(store, path: str):
  """The clients listed in ``path`` (--client_ids: one id per line, blank
  lines and # comments skipped) as a view of ``store``.

  Args:
    store: a ``PopulationStore``.
    path: the file of ids.

  Returns:
    The view (a ``PopulationStore``).

  Raises:
    ConfigError naming --client_ids.
  """
  try:
    with open(path, encoding='utf-8-sig') as f:
      # a byte order mark is not part of an id
      ids = [line.strip() for line in f]
  except (OSError, UnicodeDecodeError) as e:
    raise ConfigError(
      'client_ids', f'{path}: {getattr(e, "strerror", None) or e}'
    ) from None
  ids = [c for c in ids if c and not c.startswith('#')]
  if not ids:
    raise ConfigError('client_ids', f'{path} lists no client id')
  try:
    return store.subset(ids, f'from {os.path.basename(path)}')
  except DataError as e:
    raise ConfigError('client_ids', f'{path}: {e}') from None
