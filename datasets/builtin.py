"""The built-in data sets' registry entries, entered when the package is
imported: each natural data set's module holds its readers and options; the
pools (read whole, partitioned by --partition) and the clients made in memory
(Synthetic, Tiny Shakespeare) are entries of their own.
"""

import functools

from fedjax_personal.datasets import (
  cifar,
  cifar100,
  emnist,
  gldv2,
  in_memory,
  leaf,
  registry,
  shakespeare,
  stackoverflow,
  tfds_loader,
)
from fedjax_personal.datasets.options import TextOptions

__all__ = ['register_all']


def register_all() -> None:
  """Enters every built-in data set into ``registry`` (the package does, once,
  when imported).

  Returns:
    None.
  """
  Pool = registry.Pool
  registry.register_builtin('mnist', pool=Pool(in_memory.load_mnist))
  registry.register_builtin('digits', pool=Pool(in_memory.load_digits))
  registry.register_builtin(
    'cifar10', pool=Pool(functools.partial(cifar.load, 'cifar10'))
  )
  registry.register_builtin('emnist', emnist.read_clients, emnist.EmnistOptions)
  registry.register_builtin(
    'emnist_digits',
    functools.partial(emnist.read_clients, only_digits=True),
    emnist.EmnistOptions,
  )
  registry.register_builtin(
    'shakespeare', shakespeare.read_clients, shakespeare.ShakespeareOptions
  )
  registry.register_builtin(
    'stackoverflow',
    stackoverflow.read_clients,
    stackoverflow.StackOverflowOptions,
  )
  registry.register_builtin(
    'stackoverflow_held_out',
    stackoverflow.read_held_out,
    stackoverflow.StackOverflowOptions,
  )
  registry.register_builtin(  # its clients (natural), else the archive's pool
    'cifar100',
    cifar100.read_clients,
    cifar100.Cifar100Options,
    pool=Pool(functools.partial(cifar.load, 'cifar100_python')),
  )
  registry.register_builtin('gldv2', gldv2.read_clients, gldv2.Gldv2Options)
  registry.register_builtin(
    'synthetic',
    options=in_memory.SyntheticOptions,
    pool=Pool(in_memory.synthetic_clients, kind='clients'),
  )
  registry.register_builtin(
    'tinyshakespeare',
    options=TextOptions,
    pool=Pool(in_memory.tinyshakespeare_clients, kind='clients'),
  )
  registry.register_builtin(
    'tfds:tiny_shakespeare',
    options=TextOptions,
    pool=Pool(tfds_loader.tiny_shakespeare_clients, kind='clients'),
  )
  registry.TFDS_POOL.append(Pool(tfds_loader.tfds_pool))
  registry.LEAF_READER.append(leaf.read_clients)


register_all()
