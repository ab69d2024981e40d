"""A model's body and head: the representation before the classifier and the
classifier, from one forward pass.

Personalized FL methods that work on the representation (FedRoD's two heads,
FedBABU's frozen head, prototypes, logit calibration) split a model as
PFLlib's ``BaseHeadSplit`` does (TsingZ0/PFLlib, ``system/main.py``: the head
is the model's last ``fc``, the body everything before it). Here the split is
found in the Linen module itself, the trace ``from_flax`` makes anyway: the
head is the last module with parameters of its own whose call returns the
model's output (a ``Dense`` output layer), unless the model names another
(``models.register(..., head=...)``). A forward pass then gives the head's
input (the features) and the logits at once (``capture_features``): one pass,
not the second one a ``features`` method would cost.
"""

import contextlib
import dataclasses
from typing import Any, Iterator, List, NamedTuple, Optional, Tuple

import flax.linen as nn
import jax

PyTree = Any  # the models layer sits below core (core.tree_util.PyTree)

__all__ = [
  'BodyAndHead',
  'capture_features',
  'find_head',
  'HeadSplit',
  'module_calls',
]


class BodyAndHead(NamedTuple):
  """A model's parameters in two parts (``HeadSplit.split``).

  Attributes:
    body: everything but the head (with the batch statistics, if any).
    head: the head's parameters.
  """

  body: PyTree
  head: PyTree


@dataclasses.dataclass(frozen=True)
class HeadSplit:
  """Where a model's head is: its module's path and the module itself.

  Attributes:
    path: the head module's names from the root (``('output',)``, or
      ``('block', 'fc')`` for a nested one); its parameters are the subtree
      at this path of the model's ``params``.
    module: the head module, unbound: ``module.apply({'params': head}, f)``
      maps features to logits.
    feature_shape: the shape of one example's features (the head's input
      without its batch axis), e.g. ``(512,)``.
  """

  path: Tuple[str, ...]
  module: nn.Module
  feature_shape: Tuple[int, ...] = ()

  def logits(self, head_params: PyTree, features: jax.Array) -> Any:
    """The head applied to features: ``[B, ..., D] -> [B, ..., C]``.

    Args:
      head_params: the head's parameters (``split``'s second part).
      features: the representation the body gave.

    Returns:
      The logits.
    """
    return self.module.apply({'params': head_params}, features)

  def split(self, params: PyTree) -> 'BodyAndHead':
    """``(body, head)`` of a model's parameters: the head's subtree, and
    the rest (a model with batch statistics keeps them in the body).

    Args:
      params: the model's parameters (or its variables, with collections).

    Returns:
      The ``BodyAndHead``; ``merge(body, head)`` gives ``params`` back.
    """
    tree = params['params'] if _has_collections(params) else params
    head = _get(tree, self.path)
    body_tree = _without(tree, self.path)
    if _has_collections(params):
      return BodyAndHead({**params, 'params': body_tree}, head)
    return BodyAndHead(body_tree, head)

  def merge(self, body: PyTree, head: PyTree) -> PyTree:
    """The model's parameters from ``split``'s two parts.

    Args:
      body: the body's parameters.
      head: the head's parameters.

    Returns:
      The parameter pytree.
    """
    if _has_collections(body):
      return {**body, 'params': _with(body['params'], self.path, head)}
    return _with(body, self.path, head)


def _has_collections(params) -> bool:
  return isinstance(params, dict) and 'params' in params


def _get(tree, path):
  for name in path:
    tree = tree[name]
  return tree


def _without(tree, path):
  if len(path) == 1:
    return {k: v for k, v in tree.items() if k != path[0]}
  return {**tree, path[0]: _without(tree[path[0]], path[1:])}


def _with(tree, path, value):
  if len(path) == 1:
    return {**tree, path[0]: value}
  return {**tree, path[0]: _with(tree.get(path[0], {}), path[1:], value)}


@dataclasses.dataclass(frozen=True)
class ModuleCall:
  """One module call seen in a trace.

  Its path, the unbound module, the
  shape of its output, and whether it took one input alone (a head maps
  features to logits; a tied decoder also takes the embedding)."""

  path: Tuple[str, ...]
  module: nn.Module
  output_shape: Optional[tuple]
  one_input: bool
  input_shape: tuple = ()


def module_calls(calls: List[ModuleCall]):
  """A Flax method interceptor appending every ``__call__`` of a submodule
  to ``calls`` in the order they return (``find_head`` reads them).

  Args:
    calls: the list the ``ModuleCall`` records are appended to.

  Returns:
    The interceptor (``nn.intercept_methods``).
  """

  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    module = context.module
    if context.method_name == '__call__' and module.path:
      calls.append(
        ModuleCall(
          tuple(module.path),
          module.clone(parent=None),
          getattr(out, 'shape', None),
          len(args) == 1 and not kwargs,
          tuple(getattr(args[0], 'shape', ())) if args else (),
        )
      )
    return out

  return interceptor


def find_head(
  calls: List[ModuleCall],
  params: PyTree,
  output_shape: tuple,
  named: Optional[str] = None,
) -> Optional[HeadSplit]:
  """The model's head among the module calls of one forward pass: the one
  ``named`` ('/'-joined path), else the last module holding parameters of
  its own (arrays, not submodules) whose output has the model's output
  shape; None when there is none (a tied decoder, an output that is not a
  module's).

  Args:
    calls: ``module_calls``' record of the pass.
    params: the model's ``params`` (shapes are enough).
    output_shape: the model's output shape in that pass.
    named: the head's path a model declares, or None.

  Returns:
    The ``HeadSplit``, or None.

  Raises:
    ValueError: ``named`` is not a module with parameters of the model.
  """
  if named is not None:
    path = tuple(p for p in named.split('/') if p)
    found = [
      c for c in calls if c.path == path and c.one_input and _owns(params, path)
    ]
    if not found:
      owners = sorted(
        '/'.join(c.path) for c in calls if c.one_input and _owns(params, c.path)
      )
      raise ValueError(
        f'head {named!r} is not a module with parameters of the model '
        f'called on one input (such modules: {owners})'
      )
    return HeadSplit(path, found[-1].module, found[-1].input_shape[1:])
  for call in reversed(calls):
    if _owns(params, call.path):
      if call.one_input and call.output_shape == tuple(output_shape):
        return HeadSplit(call.path, call.module, call.input_shape[1:])
      return None
  return None


def _owns(params, path) -> bool:
  """Whether ``params`` has, at ``path``, a module whose own leaves are
  arrays (a layer, not a container of layers)."""
  try:
    sub = _get(params, path)
  except (KeyError, TypeError):
    return False
  return (
    isinstance(sub, dict)
    and bool(sub)
    and all(not isinstance(v, dict) for v in sub.values())
  )


@contextlib.contextmanager
def capture_features(head: HeadSplit) -> Iterator[List[Any]]:
  """Within it, every forward pass of the model appends the head's input
  (the features) to the yielded list: the logits and the features of one
  pass. Trace-time only, so it works under ``jit``, ``vmap`` and ``grad``.

  Args:
    head: the model's ``HeadSplit``.

  Yields:
    The list the features are appended to.
  """
  seen: List[Any] = []

  def interceptor(next_fun, args, kwargs, context):
    if context.method_name == '__call__' and tuple(context.module.path) == (
      head.path
    ):
      seen.append(args[0])
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(interceptor):
    yield seen
