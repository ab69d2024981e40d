"""Which parameters are personal: splitting a model into (shared u, personal v).

Partial personalization (Pillutla et al., ICML 2022): the model on client i is
(u, v_i), u shared and averaged by the server, v_i personal and never uploaded.
A ``ParamSplit`` names the personal leaves of a Flax parameter tree by a
predicate over their '/'-joined paths (e.g. 'conv_0/kernel', 'output/bias').
Presets:
  * 'input': the model's input layer, the first of 'embed', 'stem', 'conv_0',
    'hidden_0', 'dense_0' present (personal input layer, Liang et al.; the
    seed's transformer: word and position embeddings, its ResNet: the first
    convolution and its norm);
  * 'output': the 'output' module (FedRep / FedPer: personal head);
  * 'adapter': every module whose name contains 'adapter' (residual adapters,
    see ``models``' ``adapter_dim``) and every norm layer named 'norm*' (the
    partial-personalization seed's adapter part keeps the norms personal);
  * 'norm': every batch-normalization layer, its scale, bias and running
    statistics (FedBN, Li et al., ICLR 2021, arXiv 2102.07623: BatchNorm
    stays on the client);
  * 'block:<i>': the module 'block_<i>' (a transformer block, a ResNet stage:
    the seed's 'tr_layer' / 'res_layer' with ``--layers_to_finetune i``);
  * 'all_but_output': everything except the head (LG-FedAvg: local
    representation, global head);
  * 'all': the whole model (full personalization);
  * 'split:<regex>[,<regex>...]': any subset, by regular expressions matched
    against the paths.

Parameters are split into two flat dicts {path: array} so that the shared
part can be uploaded and averaged alone, and merged back for the forward pass.
A model with batch statistics (``models.Model.collections``) is split by the
module paths under its ``params``; a module's statistics go with it.
"""

import dataclasses
import re
from typing import Any, Callable, Dict, NamedTuple

PyTree = Any

from flax import traverse_util

__all__ = ['flatten', 'make_split', 'ParamSplit', 'unflatten']


PRESETS = (
  'input',
  'output',
  'adapter',
  'norm',
  'all_but_output',
  'all',
  'block:<i>',
)
# names used by ``models``
INPUT_LAYERS = (
  'embed',
  'stem',
  'conv_0',
  'hidden_0',
  'dense_0',
)


def flatten(params: PyTree) -> Dict[str, object]:
  """A parameter tree as ``{'a/b/c': leaf}`` (Flax's ``flatten_dict``).

  Args:
    params: a parameter tree.

  Returns:
    ``{'a/b/c': leaf}``.
  """
  return traverse_util.flatten_dict(params, sep='/')


def unflatten(flat: Dict[str, object]):
  """The tree of a ``flatten``ed dict.

  Args:
    flat: ``{'a/b/c': leaf}``.

  Returns:
    The tree.
  """
  return traverse_util.unflatten_dict(flat, sep='/')


class SharedAndPersonal(NamedTuple):
  """A model's leaves in two flat dicts (``ParamSplit.split``)."""

  shared: Dict[str, object]
  personal: Dict[str, object]


@dataclasses.dataclass(frozen=True)
class ParamSplit:
  """Which leaves of a model are personal, and how to split and merge them.

  Attributes:
    name: description (the preset or 'split:...').
    is_personal: predicate over a leaf's path.
  """

  name: str
  is_personal: Callable[[str], bool]

  def split(self, params: PyTree) -> SharedAndPersonal:
    """The shared and the personal leaves of a parameter tree."""
    flat = flatten(params)
    shared = {k: v for k, v in flat.items() if not self.is_personal(k)}
    personal = {k: v for k, v in flat.items() if self.is_personal(k)}
    return SharedAndPersonal(shared, personal)

  def merge(self, shared: PyTree, personal: PyTree) -> PyTree:
    """The full parameter tree from the two parts."""
    return unflatten({**shared, **personal})

  def check(self, params: PyTree) -> None:
    """Raises if the split leaves nothing personal or nothing shared."""
    shared, personal = self.split(params)
    paths = sorted(flatten(params))
    if not personal:
      raise ValueError(
        f'personal part {self.name!r} matches no parameter; paths are {paths}'
      )
    if not shared and self.name != 'all':
      raise ValueError(
        f'personal part {self.name!r} matches every parameter; nothing is '
        f'shared'
      )


def make_split(spec: str, params: PyTree) -> ParamSplit:
  """Builds a ParamSplit from a preset name or 'split:<regex>,...'.

  Args:
    spec: one of PRESETS or 'split:<regex>[,<regex>...]'.
    params: an example parameter tree (to find the first / last modules).

  Returns:
    The ``ParamSplit``.
  """
  variables = _is_variables(params)
  if variables:  # a model with batch statistics: its 'params' name the modules
    stats = flatten({c: v for c, v in params.items() if c != 'params'})
    params = params['params']
  # (pytree dict keys come sorted: order says nothing)
  top = list(params.keys())
  if spec == 'norm':
    normed = (
      {k.split('/', 1)[1].rsplit('/', 1)[0] for k in stats}
      if variables
      else set()
    )
    if not normed:
      raise ValueError(
        "personal part 'norm': the model has no batch normalization (no "
        'batch_stats collection: nn.BatchNorm)'
      )
    pred = lambda p: p.rsplit('/', 1)[0] in normed
  elif spec == 'input':
    first = next((n for n in INPUT_LAYERS if n in top), None)
    if first is None:
      raise ValueError(
        f"personal part 'input': no input layer among {top} "
        f'(expected one of {list(INPUT_LAYERS)})'
      )
    pred = lambda p: p.split('/')[0] == first
  elif spec == 'output':
    head = 'output' if 'output' in top else top[-1]
    pred = lambda p: p.split('/')[0] == head
  elif spec == 'all_but_output':
    head = 'output' if 'output' in top else top[-1]
    pred = lambda p: p.split('/')[0] != head
  elif spec == 'adapter':
    if not any('adapter' in p for p in flatten(params)):
      raise ValueError(
        "personal part 'adapter': the model has no adapters (its adapter_dim "
        'is 0)'
      )
    pred = lambda p: any(
      'adapter' in part or part.startswith('norm') for part in p.split('/')
    )
  elif spec.startswith('block:'):
    block = f'block_{spec[len("block:") :]}'
    if block not in top:
      raise ValueError(
        f'personal part {spec!r}: the model has no {block} '
        f'(its blocks: {[n for n in top if n.startswith("block_")] or "none"})'
      )
    pred = lambda p: p.split('/')[0] == block
  elif spec == 'all':
    pred = lambda p: True
  elif spec.startswith('split:'):
    try:
      patterns = [re.compile(r) for r in spec[len('split:') :].split(',') if r]
    except re.error as e:
      raise ValueError(
        f'personal part {spec!r}: invalid regular expression ({e})'
      ) from None
    if not patterns:
      raise ValueError(
        "personal part 'split:' needs at least one regular expression"
      )
    pred = lambda p: any(r.search(p) for r in patterns)
  else:
    raise ValueError(
      f'unknown personal part {spec!r}; choose one of {list(PRESETS)} '
      "or 'split:<regex>,...'"
    )
  # a path inside a collection names its module after the collection
  if variables:
    module_pred = pred
    pred = lambda p: module_pred(p.split('/', 1)[1])
    params = {'params': params, **unflatten(stats)}
  s = ParamSplit(spec, pred)
  s.check(params)
  return s


def _is_variables(params: PyTree) -> bool:
  """Whether ``params`` is a stateful model's variables (``{'params': ...,
  'batch_stats': ...}``, ``models.Model.collections``), not Flax's
  ``params`` alone."""
  return (
    isinstance(params, dict)
    and 'params' in params
    and len(params) > 1
    and all(isinstance(v, dict) for v in params.values())
  )
