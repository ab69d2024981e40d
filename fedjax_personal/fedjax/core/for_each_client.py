"""FedJAX's ``for_each_client``: work written once per client (``init``,
``step`` per batch, ``final``) and run over many clients by a backend.

Backends: ``'jit'`` (FedJAX's default: one client after another, each step a
jitted call), ``'debug'`` (no jit, errors naming the stage and client),
``'pmap'`` (clients in blocks over the local devices), ``'threads'``, this
project's (clients on the host's cores at once, each as ``'jit'`` runs it:
the same values, in order), and ``'vmap'``, this project's: the clients in
blocks of up to ``block_size`` (default 32) stacked on a leading axis, a
block's batches run as one ``lax.scan`` of the vmapped step (a client
without a batch at a step is masked: its state does not change), so a block
costs one dispatch rather than one per client and batch; a smaller last
batch takes one more vmapped call. The outputs are
FedJAX's (float rounding apart: the same operations, batched). It pays where
dispatch, not arithmetic, bounds a step (small models, accelerators); a
convolution-bound step on a CPU runs at the arithmetic's speed either way,
and faster with ``'threads'`` where one client does not fill the cores
(``benchmarks/peers/fedjax_emnist_fed_avg_cpu.md``).
"""

import abc
import collections
import concurrent.futures
import contextlib
import functools
import os
import threading
from typing import (
  Any,
  Callable,
  Iterable,
  Iterator,
  List,
  Optional,
  Sequence,
  Tuple,
  Union,
)

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal.fedjax.core.typing import BatchExample, PyTree

__all__ = [
  'ForEachClientBackend',
  'ForEachClientDebugBackend',
  'ForEachClientError',
  'ForEachClientJitBackend',
  'ForEachClientPmapBackend',
  'ForEachClientThreadsBackend',
  'ForEachClientVmapBackend',
  'for_each_client',
  'for_each_client_backend',
  'get_for_each_client_backend',
  'set_for_each_client_backend',
]

SharedInput = PyTree
ClientInput = PyTree
ClientStepState = PyTree
ClientStepResult = PyTree
ClientOutput = PyTree
ClientInit = Callable[[SharedInput, ClientInput], ClientStepState]
ClientStep = Callable[
  [ClientStepState, BatchExample], Tuple[ClientStepState, ClientStepResult]
]
ClientFinal = Callable[[SharedInput, ClientStepState], ClientOutput]
ClientId = Any
Clients = Iterable[Tuple[ClientId, Iterable[BatchExample], ClientInput]]
ForEachClient = Callable[
  [SharedInput, Clients],
  Iterator[Tuple[ClientId, ClientOutput, List[ClientStepResult]]],
]


class ForEachClientBackend(abc.ABC):
  """Turns (init, step, final) into a function over clients."""

  @abc.abstractmethod
  def __call__(
    self,
    client_init: ClientInit,
    client_step: ClientStep,
    client_final: ClientFinal,
  ) -> ForEachClient:
    """``(shared_input, clients) -> iterator of (client id, output, step
    results)``."""


class ForEachClientJitBackend(ForEachClientBackend):
  """One client after another; init, each step and final jitted."""

  def __call__(self, client_init, client_step, client_final):
    @jax.jit
    def init(shared_input, client_input):
      return jax.tree.map(jnp.copy, client_init(shared_input, client_input))

    step = jax.jit(client_step, donate_argnums=0)
    final = jax.jit(client_final, donate_argnums=1)

    def run(shared_input, clients):
      for client_id, batches, client_input in clients:
        state, results = init(shared_input, client_input), []
        for batch in batches:
          state, result = step(state, batch)
          results.append(result)
        yield client_id, final(shared_input, state), results

    return run


class ForEachClientError(Exception):
  """An error inside a client's work (debug backend).

  The stage and, in ``context``, the client and its inputs.

  Attributes:
    base: the error raised.
    stage: 'client_init', 'client_step' or 'client_final'.
    context: the client id and what the stage was given.
  """

  def __init__(self, base: Exception, stage: str, **context):
    super().__init__()
    self.base = base
    self.stage = stage
    self.context = context

  def __str__(self):
    return (
      f'Stage: {self.stage}. Base error is {type(self.base).__name__}: '
      f'{self.base}.\nSee the `context` field of this exception for '
      'additional context.'
    )


class ForEachClientDebugBackend(ForEachClientBackend):
  """One client after another without jit; an error names its stage."""

  def __call__(self, client_init, client_step, client_final):
    def staged(stage, fn, *args, **context):
      try:
        return fn(*args)
      except Exception as e:
        raise ForEachClientError(e, stage=stage, **context) from e

    def run(shared_input, clients):
      with jax.disable_jit():
        for client_id, batches, client_input in clients:
          state = staged(
            'client_init',
            client_init,
            shared_input,
            client_input,
            client_id=client_id,
            client_init=client_init,
            shared_input=shared_input,
            client_input=client_input,
          )
          results = []
          for batch in batches:
            state, result = staged(
              'client_step',
              client_step,
              state,
              batch,
              client_id=client_id,
              client_step=client_step,
              state=state,
              batch=batch,
            )
            results.append(result)
          output = staged(
            'client_final',
            client_final,
            shared_input,
            state,
            client_id=client_id,
            client_final=client_final,
            shared_input=shared_input,
            state=state,
          )
          yield client_id, output, results

    return run


def _blocks(clients: Clients, block_size: int):
  """The clients, most batches first, in blocks of ``block_size``: (ids,
  real, batch lists, inputs), short blocks padded with clients of no
  batches and zero inputs (FedJAX's blocking)."""
  listed = [(cid, list(batches), ci) for cid, batches, ci in clients]
  listed.sort(key=lambda c: len(c[1]), reverse=True)
  for start in range(0, len(listed), block_size):
    block = listed[start : start + block_size]
    real = [True] * len(block)
    if len(block) < block_size:
      pad = jax.tree.map(jnp.zeros_like, block[0][2])
      block += [(None, [], pad)] * (block_size - len(block))
      real += [False] * (block_size - len(real))
    yield (
      [c[0] for c in block],
      real,
      [c[1] for c in block],
      [c[2] for c in block],
    )


class ForEachClientPmapBackend(ForEachClientBackend):
  """FedJAX's ``for_each_client`` over the local devices.

  Clients in blocks of the local devices, one client per device
  (``jax.pmap``); a device whose client has no batch left is masked."""

  def __init__(self, devices: Optional[Sequence[Any]] = None):
    self._devices = devices

  def __call__(self, client_init, client_step, client_final):
    devices = list(self._devices or jax.local_devices())
    p_init = jax.pmap(client_init, devices=devices)

    @functools.partial(jax.pmap, donate_argnums=0, devices=devices)
    def p_step(state, batch, mask):
      new, result = client_step(state, batch)
      new = jax.tree.map(functools.partial(jnp.where, mask), new, state)
      result = jax.tree.map(lambda x: jnp.where(mask, x, 0), result)
      return new, result

    p_final = jax.pmap(client_final, donate_argnums=1, devices=devices)

    def run(shared_input, clients):
      n = len(devices)
      shared = jax.tree.map(
        lambda x: jnp.broadcast_to(x, (n,) + jnp.shape(x)), shared_input
      )
      for ids, real, batches, inputs in _blocks(clients, n):
        state = p_init(shared, _stack(inputs))
        zero = (
          jax.tree.map(np.zeros_like, batches[0][0]) if batches[0] else None
        )
        step_results = []
        for j in range(len(batches[0])):
          mask = [j < len(b) for b in batches]
          stacked = [b[j] if m else zero for b, m in zip(batches, mask)]
          state, result = p_step(state, _stack(stacked), jnp.asarray(mask))
          step_results.append(result)
        outputs = p_final(shared, state)
        for i, cid in enumerate(ids):
          if real[i]:
            out, res = jax.tree.map(
              lambda x, i=i: jax.device_put(x[i], devices[0]),
              (outputs, step_results),
            )
            yield cid, out, res[: len(batches[i])]

    return run


#: JAX's settings a ``with`` block sets for its own thread only (each a
#: public ``jax.<name>`` context manager: ``jax.threefry_partitionable``,
#: ``jax.default_matmul_precision``, ``jax.enable_x64``, ...).
_THREAD_SETTINGS = tuple(
  name
  for name, value in sorted(vars(jax).items())
  if isinstance(value, type(jax.threefry_partitionable))
)


def _jit_disabled() -> bool:
  """Whether this thread runs under ``jax.disable_jit()``."""
  return bool(getattr(jax.config, 'jax_disable_jit'))


def _in_callers_settings(fn: Callable) -> Callable:
  """``fn``, run in another thread under the JAX settings of the thread that
  calls this: a ``with jax.threefry_partitionable(False):`` (or a matmul
  precision, ``jax.disable_jit()``, ...) around a round holds for its
  clients' threads too, so they draw and compute what one thread would."""
  wanted = {name: getattr(jax, name).value for name in _THREAD_SETTINGS}
  no_jit = _jit_disabled()

  def run(*args):
    with contextlib.ExitStack() as stack:
      for name, value in wanted.items():
        state = getattr(jax, name)
        if state.value != value:
          stack.enter_context(state(value))
      if no_jit and not _jit_disabled():
        stack.enter_context(jax.disable_jit())
      return fn(*args)

  return run


class ForEachClientThreadsBackend(ForEachClientBackend):
  """Clients on several host threads at once, outputs in the clients' order.

  ``threads`` clients run at once, each as the jit backend runs one (init,
  each step and final jitted). A jitted call releases Python's lock while
  it runs, so the threads' steps run side by side: on a CPU whose cores one
  step does not fill (a small batch's convolutions), several clients' steps
  use them. At most
  ``2 * threads`` clients are taken ahead of the one being yielded, so a
  round's clients and their states are not all held at once. The outputs
  are the jit backend's, bit for bit (each client's calls are the same):
  the clients' threads run under the JAX settings (``with
  jax.threefry_partitionable(False):``, a matmul precision, ...) of the
  thread that reads the outputs, as it reads the first.

  Args:
    threads: the clients run at once; default the host's processors.
  """

  def __init__(self, threads: Optional[int] = None):
    threads = threads or os.cpu_count() or 1
    if threads < 1:
      raise ValueError(f'threads must be at least 1, got {threads}')
    self._threads = threads

  def __call__(self, client_init, client_step, client_final):
    one_by_one = ForEachClientJitBackend()(
      client_init, client_step, client_final
    )

    def one(shared_input, client):
      return next(one_by_one(shared_input, [client]))

    def run(shared_input, clients):
      pool = concurrent.futures.ThreadPoolExecutor(self._threads)
      pending: collections.deque = collections.deque()
      work = _in_callers_settings(one)
      try:
        for client in clients:
          pending.append(pool.submit(work, shared_input, client))
          if len(pending) > 2 * self._threads:
            yield pending.popleft().result()
        while pending:
          yield pending.popleft().result()
      finally:
        pool.shutdown(wait=True, cancel_futures=True)

    return run


def _stack(trees):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _shape_of(batch) -> tuple:
  return tuple(
    (k, np.shape(v), np.asarray(v).dtype.str) for k, v in sorted(batch.items())
  )


def _host_stack(trees):
  return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)


class ForEachClientVmapBackend(ForEachClientBackend):
  """Clients in blocks of up to ``block_size`` on one device, stacked.

  A block's clients run together: ``client_init`` vmapped; then their
  batches of the first batch's shape, ``chunk`` steps a dispatch (a
  ``lax.scan`` of the vmapped ``client_step`` over the clients that still
  have steps, their number rounded up to a power of two: a client costs its
  own steps, not the block's longest, and few programs compile; a client
  past its last batch is masked: its state stays); then each remaining step
  (a smaller last batch) one vmapped call; then ``client_final`` vmapped. A
  block is the clients given, up to ``block_size`` (a last, shorter block
  padded with clients of no batches); clients whose inputs differ in shape
  run in separate blocks.

  Args:
    block_size: the most clients run together (memory: a block's states
      live on the device together); default 32.
    chunk: steps a dispatch; default 8.
  """

  def __init__(self, block_size: int = 32, chunk: int = 8):
    if block_size < 1 or chunk < 1:
      raise ValueError(
        f'block_size and chunk must be at least 1, got {block_size}, {chunk}'
      )
    self._block_size = block_size
    self._chunk = chunk

  def __call__(self, client_init, client_step, client_final):
    chunk = self._chunk

    def masked_step(state, batch, mask):
      new, result = client_step(state, batch)
      new = jax.tree.map(functools.partial(jnp.where, mask), new, state)
      return new, result

    @functools.lru_cache(maxsize=None)
    def compiled(size: int):
      # axis_size: a client input or state may hold no array (None inputs)
      return (
        jax.jit(jax.vmap(client_init, in_axes=(None, 0), axis_size=size)),
        jax.jit(jax.vmap(masked_step, axis_size=size), donate_argnums=0),
        jax.jit(
          jax.vmap(client_final, in_axes=(None, 0), axis_size=size),
          donate_argnums=1,
        ),
      )

    @functools.lru_cache(maxsize=None)
    def chunk_of(active: int):
      # ``chunk`` steps of the ``active`` clients at ``idx``, one dispatch
      v_step = jax.vmap(masked_step, axis_size=active)

      def run_chunk(state, idx, batches, masks):
        sub = jax.tree.map(lambda x: x[idx], state)
        sub, out = jax.lax.scan(
          lambda s, xs: v_step(s, *xs), sub, (batches, masks)
        )
        return jax.tree.map(lambda x, y: x.at[idx].set(y), state, sub), out

      return jax.jit(run_chunk, donate_argnums=0)

    def run(shared_input, clients):
      # clients whose inputs differ in shape (APFL's fresh and trained
      # coefficients) cannot stack: each shape runs as its own group
      groups: dict = {}
      for client in clients:
        leaves, tree = jax.tree.flatten(client[2])
        key = (tree, tuple(np.shape(x) for x in leaves))
        groups.setdefault(key, []).append(client)
      for group in groups.values():
        yield from run_group(shared_input, group)

    def run_group(shared_input, clients):
      size = max(1, min(self._block_size, len(clients)))
      v_init, v_step, v_final = compiled(size)
      for ids, real, batches, inputs in _blocks(clients, size):
        state = v_init(shared_input, _stack(inputs))
        results: List[List[Any]] = [[] for _ in ids]
        # each client's leading batches of the first batch's shape
        main = _shape_of(batches[0][0]) if batches[0] else None
        lead = np.zeros(len(ids), int)
        for i, b in enumerate(batches):
          while lead[i] < len(b) and _shape_of(b[lead[i]]) == main:
            lead[i] += 1
        zero = jax.tree.map(np.zeros_like, batches[0][0]) if main else None
        for t0 in range(0, int(lead.max(initial=0)), chunk):
          # the clients with steps left, padded to a power of two (at most
          # the block) with clients that have none: few programs compile
          busy = np.flatnonzero(lead > t0)
          width = min(len(ids), 1 << int(len(busy) - 1).bit_length())
          idle = np.flatnonzero(lead <= t0)[: width - len(busy)]
          idx = np.concatenate([busy, idle])
          masks = (t0 + np.arange(chunk))[:, None] < lead[idx][None, :]
          stacked = _host_stack(
            [
              _host_stack([batches[i][t] if t < lead[i] else zero for i in idx])
              for t in range(t0, t0 + chunk)
            ]
          )
          state, out = chunk_of(width)(state, idx, stacked, masks)
          for p, i in enumerate(idx):
            for t in range(t0, min(t0 + chunk, int(lead[i]))):
              results[i].append(jax.tree.map(lambda x: x[t - t0, p], out))
        # the rest (a smaller last batch), one vmapped call a step and shape
        for j in range(max(len(b) - n for b, n in zip(batches, lead))):
          by_shape: dict = {}
          for i, (b, n) in enumerate(zip(batches, lead)):
            if n + j < len(b):
              by_shape.setdefault(_shape_of(b[n + j]), []).append(i)
          for members in by_shape.values():
            first = batches[members[0]][lead[members[0]] + j]
            pad = jax.tree.map(np.zeros_like, first)
            stacked = _host_stack(
              [
                b[n + j] if i in members else pad
                for i, (b, n) in enumerate(zip(batches, lead))
              ]
            )
            mask = np.isin(np.arange(len(ids)), members)
            state, out = v_step(state, stacked, mask)
            for i in members:
              results[i].append(jax.tree.map(lambda x, i=i: x[i], out))
        outputs = v_final(shared_input, state)
        for i, cid in enumerate(ids):
          if real[i]:
            yield cid, jax.tree.map(lambda x, i=i: x[i], outputs), results[i]

    return run


class _BackendChoice(threading.local):
  """The current thread's backend (FedJAX's default: jit)."""

  def __init__(self):
    super().__init__()
    self.backend: Optional[ForEachClientBackend] = None

  def get(self) -> ForEachClientBackend:
    if self.backend is None:
      self.backend = ForEachClientJitBackend()
    return self.backend


_CHOICE = _BackendChoice()
_NAMED = {
  'debug': ForEachClientDebugBackend,
  'jit': ForEachClientJitBackend,
  'pmap': ForEachClientPmapBackend,
  'threads': ForEachClientThreadsBackend,
  'vmap': ForEachClientVmapBackend,
}


def get_for_each_client_backend() -> ForEachClientBackend:
  """The current thread's ``for_each_client`` backend.

  Returns:
    The backend (FedJAX's default: jit).
  """
  return _CHOICE.get()


def set_for_each_client_backend(
  backend: Union[ForEachClientBackend, str, None],
):
  """Sets the current thread's backend.

  Args:
    backend: a ``ForEachClientBackend``, one of 'debug', 'jit', 'pmap',
      'threads', 'vmap', or None (the default, jit).

  Returns:
    None.
  """
  if backend is None or isinstance(backend, ForEachClientBackend):
    _CHOICE.backend = backend
  elif backend in _NAMED:
    _CHOICE.backend = _NAMED[backend]()
  else:
    raise ValueError(
      f'Unsupported backend {backend!r}; known: {", ".join(sorted(_NAMED))}'
    )


@contextlib.contextmanager
def for_each_client_backend(backend: Union[ForEachClientBackend, str, None]):
  """Within the ``with`` block, the current thread uses ``backend``.

  Args:
    backend: as ``set_for_each_client_backend``.

  Yields:
    Nothing; the previous backend is restored on leaving.
  """
  old = _CHOICE.backend
  try:
    set_for_each_client_backend(backend)
    yield
  finally:
    set_for_each_client_backend(old)


def for_each_client(
  client_init: ClientInit,
  client_step: Callable,
  client_final: ClientFinal = lambda _, s: s,
  with_step_result: bool = False,
):
  """A function running the work over clients with the current backend.

  Args:
    client_init: ``(shared_input, client_input) -> state``.
    client_step: ``(state, batch) -> state`` (or ``(state, step result)``
      with ``with_step_result``).
    client_final: ``(shared_input, state) -> output``.
    with_step_result: whether ``client_step`` returns a step result too.

  Returns:
    ``(shared_input, clients) -> iterator of (client id, output)`` (with
    ``with_step_result``: ``(client id, output, step results)``); clients
    are ``(client id, batches, client input)``.
  """
  backend = get_for_each_client_backend()
  if with_step_result:
    return backend(client_init, client_step, client_final)

  def step_with_result(state, batch):
    return client_step(state, batch), ()

  func = backend(client_init, step_with_result, client_final)

  def run(shared_input, clients):
    for client_id, output, _ in func(shared_input, clients):
      yield client_id, output

  return run
