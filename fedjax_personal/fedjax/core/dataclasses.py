"""``fedjax.dataclass``: a frozen dataclass that is a JAX pytree (FedJAX's
``fedjax.core.dataclasses``).

A field declared ``dataclasses.field(metadata={'pytree_node': False})`` is
static (part of the tree's structure, not a leaf), as in FedJAX and Flax.
"""

import dataclasses
from typing import dataclass_transform

import jax

__all__ = ['dataclass']


@dataclass_transform(frozen_default=True)
def dataclass(cls):
  """Makes ``cls`` a frozen dataclass registered as a pytree, with a
  ``replace(**updates)`` method.

  Args:
    cls: the class (its annotated fields become the dataclass's).

  Returns:
    The dataclass.
  """
  data_cls = dataclasses.dataclass(frozen=True)(cls)
  fields = dataclasses.fields(data_cls)
  data = [f.name for f in fields if f.metadata.get('pytree_node', True)]
  meta = [f.name for f in fields if not f.metadata.get('pytree_node', True)]

  def replace(self, **updates):
    """A copy with ``updates`` (field name -> value)."""
    return dataclasses.replace(self, **updates)

  data_cls.replace = replace  # type: ignore[attr-defined]
  jax.tree_util.register_dataclass(data_cls, data_fields=data, meta_fields=meta)
  return data_cls
