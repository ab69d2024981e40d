"""Initial parameters from a file (``--init_weights``).

Four formats:

- ``.npz``: one array per parameter, keyed by its Flax path joined with '/'
  (``conv_0/kernel``, ``lstm_0/cell/hi/bias``), as ``save_npz`` writes it.
- ``.npz`` of a Keras model's weights in Keras's own order and shapes, as
  ``np.savez(path, *keras_model.get_weights())`` writes them (keys
  ``arr_0``, ``arr_1``, ...: a TFF / Keras model, e.g. Reddi et al.'s
  Shakespeare and Stack Overflow LSTMs). Matched to the model's layers in
  order: ``Embedding`` [V, d] as is; ``Dense`` / ``Conv2D`` kernel (and
  bias) as is (Keras's [in, out] and HWIO are Flax's); ``LSTM`` kernel
  [in, 4H], recurrent kernel [H, 4H] and bias [4H], gates i, f, c, o, split
  into each gate's kernels and bias.
- ``.npz`` of a Haiku parameter dict (FedJAX's models' ``params``), each
  array keyed ``<module>/<name>`` (``embed/embeddings``, ``lstm/linear/w``,
  ``linear_1/b``, ``conv2_d/w``; inside a module of its own, that module's
  name first: ``conv_dropout_module/conv2_d/w``, FedJAX's EMNIST CNN), as
  ``np.savez(path, **{f'{m}/{n}': v for m, d in params.items() for n, v in
  d.items()})`` writes it. Matched by kind
  and index (``embed``; ``lstm``, ``lstm_1``, ..; ``conv2_d``, ``conv2_d_1``,
  ..; ``linear``, ``linear_1``, ..) to the model's embedding, LSTM,
  convolution and dense layers in their order: ``w`` / ``b`` /
  ``embeddings`` as they are (Haiku's [in, out] and HWIO are Flax's); an
  ``hk.LSTM``'s one kernel over [x, h] (gates i, g, f, o) split into each
  gate's input and recurrent kernels, its bias with the forget gate's +1 (which
  ``hk.LSTM`` adds in its update) added in.
- ``.pt`` / ``.pth``: a PyTorch ``state_dict`` (or a dict holding one under
  ``state_dict`` / ``model_state_dict``), read with ``torch.load(...,
  weights_only=True)``. Its layers are matched to the model's by order (the
  model's layers in the order its forward pass creates them, the state
  dict's in its own order) and converted: ``Linear`` weights [out, in] ->
  kernels [in, out]; ``Conv2d`` weights OIHW -> HWIO; ``Embedding`` as is;
  ``LSTM`` layers (``weight_ih_l{k}``, ``weight_hh_l{k}``, ``bias_ih_l{k}``,
  ``bias_hh_l{k}``, gates i, f, g, o) -> the kernels of each gate and one bias
  b_ih + b_hh. The first dense layer after the convolutions also has its
  input features reordered: PyTorch flattens (C, H, W), these models
  (H, W, C). A ``BatchNorm2d`` (``weight``, ``bias``, ``running_mean``,
  ``running_var``; ``num_batches_tracked`` dropped) gives a batch norm's
  ``scale`` and ``bias`` and its ``batch_stats`` ``mean`` and ``var``
  (``resnet18_bn``).

Any mismatch (a missing or extra layer, another shape) is a ``ConfigError``
naming ``--init_weights`` and the first layer that differs.
"""

import os
import re
import zipfile
from typing import Any, Dict, List, NoReturn, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal.errors import ConfigError
from fedjax_personal.models.initializers import GATES

__all__ = ['load', 'save_npz']


FLAG = 'init_weights'


def _fail(path, message) -> NoReturn:
  raise ConfigError(FLAG, f'{path}: {message}')


def flat_params(params, prefix='') -> Dict[str, np.ndarray]:
  """{'a/b/kernel': array} in the pytree's own (creation) order."""
  out = {}
  for k, v in params.items():
    name = f'{prefix}{k}'
    if isinstance(v, dict):
      out.update(flat_params(v, name + '/'))
    else:
      out[name] = v
  return out


def _nest(flat: dict) -> dict:
  """{'a/b/kernel': v} -> {'a': {'b': {'kernel': v}}}, in ``flat``'s order."""
  out: Dict[str, Any] = {}
  for name, v in flat.items():
    node = out
    *path, leaf = name.split('/')
    for p in path:
      node = node.setdefault(p, {})
    node[leaf] = v
  return out


def _unflatten(flat: Dict[str, np.ndarray]) -> dict:
  return _nest({name: jnp.asarray(v, jnp.float32) for name, v in flat.items()})


def save_npz(path: str, params) -> None:
  """Writes ``params`` as an ``.npz`` that ``load`` reads back.

  Args:
    path: the file.
    params: the parameters.

  Returns:
    None.
  """
  arrays: Dict[str, Any] = {
    k: np.asarray(v) for k, v in flat_params(params).items()
  }
  np.savez(path, **arrays)


def _template(model, sample_x) -> Tuple[dict, Optional[tuple]]:
  """The model's parameters (values irrelevant) in creation order, and the
  NHWC shape its convolutional part flattens (None without one)."""
  x = jax.ShapeDtypeStruct(
    (1,) + tuple(np.shape(sample_x))[1:], jnp.asarray(sample_x).dtype
  )
  # Shapes only (no initialisation or forward pass to run: seconds for an
  # 11M-parameter ResNet op by op).
  # eval_shape's output dicts are key-sorted; the layers' creation order (which
  # PyTorch state dicts are matched against) is read while tracing.
  order: List[str] = []

  def init(x):
    variables = model.module.init(jax.random.key(0), x, **model.evaluate_kwargs)
    params = (
      variables['params']
      if not model.collections
      else {c: variables[c] for c in ('params',) + tuple(model.collections)}
    )
    order.extend(flat_params(params))
    return params

  shapes = flat_params(jax.eval_shape(init, x))
  params = _nest({name: shapes[name] for name in order})
  _, state = jax.eval_shape(
    lambda p, x: model.module.apply(
      model.variables(p), x, mutable=['intermediates'], **model.evaluate_kwargs
    ),
    params,
    x,
  )
  sown = state.get('intermediates', {}).get('flatten_input')
  return params, (tuple(sown[0].shape[1:]) if sown else None)


def load(path: str, model, sample_x) -> dict:
  """Initial parameters for ``model`` (a ``Model`` built by ``create_model``)
  read from ``path`` (.npz: Flax paths, Keras's or Haiku's weights; or a
  PyTorch state dict).

  Args:
    path: a ``.npz`` or a PyTorch state dict.
    model: the ``Model``.
    sample_x: one input batch.

  Returns:
    The parameters.

  Raises:
    ConfigError: a missing, unreadable or corrupt file, an unknown format,
      or weights of another model (naming the first mismatching layer).
  """
  if not os.path.isfile(path):
    _fail(path, 'no such file')
  template, flat_shape = _template(model, sample_x)
  ext = os.path.splitext(path)[1].lower()
  if ext == '.npz':
    got = _read_npz(path)
    if got and all(re.fullmatch(r'arr_\d+', k) for k in got):
      missing = [f'arr_{i}' for i in range(len(got)) if f'arr_{i}' not in got]
      if missing:
        _fail(
          path,
          f'holds Keras weights {sorted(got, key=lambda k: int(k[4:]))[:4]}... '
          f'without '
          f'{missing[0]}: np.savez(path, *model.get_weights()) numbers every '
          f'weight from 0',
        )
      return _from_keras(
        path, [got[f'arr_{i}'] for i in range(len(got))], template
      )
    if got and all(
      '/' in k and k.rsplit('/', 1)[1] in _HAIKU_LEAVES for k in got
    ):
      return _from_haiku(path, got, template)
    return _from_npz(path, template, got)
  if ext in ('.pt', '.pth'):
    return _from_torch(path, template, flat_shape)
  _fail(
    path,
    f'unknown format {ext!r}: give a .npz (Flax parameter paths as keys, a '
    f'Keras '
    "model's get_weights() saved by np.savez, or a Haiku parameter dict as "
    'module/name keys) '
    'or a PyTorch state dict (.pt or .pth)',
  )


def _read_npz(path) -> Dict[str, np.ndarray]:
  try:
    with np.load(path, allow_pickle=False) as f:
      return {k: f[k] for k in f.files}
  except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
    _fail(path, f'not a readable .npz ({type(e).__name__}: {e})')
  return {}


def _from_npz(path, template, got) -> dict:
  want = flat_params(template)
  for name, a in want.items():
    if name not in got:
      _fail(
        path,
        f"has no array for the model's layer {name} {list(a.shape)} (it holds "
        f'{sorted(got)[:6]}{"..." if len(got) > 6 else ""})',
      )
    if tuple(got[name].shape) != tuple(a.shape):
      _fail(
        path,
        f'layer {name} is {list(got[name].shape)} in the file, {list(a.shape)} '
        f'in '
        'the model',
      )
  extra = [k for k in got if k not in want]
  if extra:
    _fail(
      path,
      f'holds {extra[0]} {list(got[extra[0]].shape)}, which the model does not '
      f'have',
    )
  return _unflatten({k: got[k] for k in want})


# -- Keras weights (get_weights order)
# -------------------------------------------


def _keras_layer(flayer, arrays) -> Tuple[int, Dict[str, np.ndarray]]:
  """How many of ``arrays`` (Keras's next weights) the Flax layer takes, and
  them in its layout; (0, {}) when they do not fit."""

  def fits(a, shape):
    return a is not None and tuple(np.shape(a)) == tuple(shape)

  first: Any = arrays[0] if arrays else None
  # an LSTM cell: kernel [in, 4H], recurrent [H, 4H], bias [4H]
  if 'ii' in flayer:
    h, d_in = flayer['hi']['kernel'].shape[0], flayer['ii']['kernel'].shape[0]
    if len(arrays) < 3 or not (
      fits(arrays[0], (d_in, 4 * h))
      and fits(arrays[1], (h, 4 * h))
      and fits(arrays[2], (4 * h,))
    ):
      return 0, {}
    out = {}
    for g, gate in enumerate(GATES):
      cols = slice(g * h, (g + 1) * h)
      out[f'i{gate}/kernel'] = arrays[0][:, cols]
      out[f'h{gate}/kernel'] = arrays[1][:, cols]
      out[f'h{gate}/bias'] = arrays[2][cols]
    return 3, out
  if 'embedding' in flayer:
    return (
      (1, {'embedding': first})
      if fits(first, flayer['embedding'].shape)
      else (0, {})
    )
  if 'kernel' not in flayer or not fits(first, flayer['kernel'].shape):
    return 0, {}
  if 'bias' not in flayer:
    return 1, {'kernel': first}
  if len(arrays) < 2 or not fits(arrays[1], flayer['bias'].shape):
    return 0, {}
  return 2, {'kernel': first, 'bias': arrays[1]}


def _from_keras(path, arrays, template) -> dict:
  flayers = _flax_layers(template)
  flat, at = {}, 0
  for i, (fname, flayer) in enumerate(flayers):
    took, conv = _keras_layer(flayer, arrays[at:])
    if not took:
      held = [list(np.shape(a)) for a in arrays[at : at + 3]]
      _fail(
        path,
        f"Keras weights: the model's layer {i + 1}, {fname} {_shape(flayer)}, "
        f'does '
        f"not fit the file's next weights (arr_{at}.. {held})",
      )
    flat.update({f'{fname}/{k}': v for k, v in conv.items()})
    at += took
  if at < len(arrays):
    _fail(
      path,
      f'Keras weights: {len(arrays)} arrays, the model takes {at}: arr_{at} '
      f'{list(np.shape(arrays[at]))} has no counterpart',
    )
  return _unflatten({k: flat[k] for k in flat_params(template)})


# -- Haiku parameters (FedJAX's models)
# ---------------------------------------------

_HAIKU_LEAVES = {'w', 'b', 'embeddings'}
_HAIKU_MODULE = re.compile(
  r'^(embed|lstm|conv2_d|linear)(?:_(\d+))?(/linear)?$'
)
_HAIKU_KIND = {
  'embed': 'embedding',
  'lstm': 'LSTM',
  'conv2_d': 'convolution',
  'linear': 'dense',
}


def _kind(flayer) -> str:
  """A Flax layer's kind, named as ``_HAIKU_KIND`` names Haiku's."""
  if 'embedding' in flayer:
    return 'embedding'
  if 'ii' in flayer:
    return 'LSTM'
  return 'convolution' if np.ndim(flayer.get('kernel')) == 4 else 'dense'


def _haiku_layers(
  path, got
) -> Dict[str, List[Tuple[str, Dict[str, np.ndarray]]]]:
  """The file's modules by kind, each kind's in index order."""
  modules: Dict[str, Dict[str, np.ndarray]] = {}
  for key, a in got.items():
    module, leaf = key.rsplit('/', 1)
    modules.setdefault(module, {})[leaf] = a
  by_kind: Dict[str, list] = {}
  for module, leaves in modules.items():
    # inside a module of the user's own (hk.Module subclasses nest their names)
    inner = module
    m = _HAIKU_MODULE.fullmatch(inner)
    while m is None and '/' in inner:
      inner = inner.split('/', 1)[1]
      m = _HAIKU_MODULE.fullmatch(inner)
    if m is None or (m.group(3) is not None) != (m.group(1) == 'lstm'):
      _fail(
        path,
        f'Haiku parameters: module {module!r} is none of embed, lstm*/linear, '
        'conv2_d*, linear*',
      )
    by_kind.setdefault(_HAIKU_KIND[m.group(1)], []).append(
      (int(m.group(2) or 0), module, leaves)
    )
  return {
    k: [(name, leaves) for _, name, leaves in sorted(v)]
    for k, v in by_kind.items()
  }


def _haiku_layer(flayer, leaves) -> Optional[Dict[str, np.ndarray]]:
  """One Haiku module in the layout of the Flax layer (None if it does not
  fit)."""
  if 'ii' in flayer:
    h, d_in = flayer['hi']['kernel'].shape[0], flayer['ii']['kernel'].shape[0]
    w, b = leaves.get('w'), leaves.get('b')
    if (
      w is None
      or b is None
      or w.shape != (d_in + h, 4 * h)
      or b.shape != (4 * h,)
    ):
      return None
    out = {}
    for gate in GATES:
      at = 'igfo'.index(gate)  # Haiku's columns: i, g, f, o
      cols = slice(at * h, (at + 1) * h)
      out[f'i{gate}/kernel'] = w[:d_in, cols]
      out[f'h{gate}/kernel'] = w[d_in:, cols]
      out[f'h{gate}/bias'] = b[cols] + (1.0 if gate == 'f' else 0.0)
    return out
  names = {'embedding': 'embeddings', 'kernel': 'w', 'bias': 'b'}
  if set(leaves) != {names[k] for k in flayer}:
    return None
  out = {k: leaves[names[k]] for k in flayer}
  return (
    out
    if all(np.shape(out[k]) == np.shape(flayer[k]) for k in flayer)
    else None
  )


def _from_haiku(path, got, template) -> dict:
  theirs = _haiku_layers(path, got)
  ours: Dict[str, list] = {}
  for fname, flayer in _flax_layers(template):
    ours.setdefault(_kind(flayer), []).append((fname, flayer))
  flat = {}
  for kind in sorted(set(ours) | set(theirs)):
    mine, held = ours.get(kind, []), theirs.get(kind, [])
    if len(mine) != len(held):
      _fail(
        path,
        f'Haiku parameters: {len(held)} {kind} layer(s) in the file '
        f'({[n for n, _ in held]}), {len(mine)} in the model '
        f'({[n for n, _ in mine]})',
      )
    for (fname, flayer), (hname, leaves) in zip(mine, held):
      conv = _haiku_layer(flayer, leaves)
      if conv is None:
        _fail(
          path,
          f'Haiku parameters: {hname} {_shape(leaves)} does not fit the '
          f"model's "
          f'{fname} {_shape(flayer)}',
        )
      flat.update(
        {f'{fname}/{k}': np.asarray(v, np.float32) for k, v in conv.items()}
      )
  return _unflatten({k: flat[k] for k in flat_params(template)})


# -- PyTorch state dicts
# ---------------------------------------------------------

_LSTM_KEY = re.compile(r'^(.*)\.(weight|bias)_(ih|hh)_l(\d+)$')


def _torch_layers(state) -> List[Tuple[str, Dict[str, np.ndarray]]]:
  """The state dict's layers in order: (name, {'weight': ..., 'bias': ...})
  or, for one LSTM layer, (name, {'weight_ih', 'weight_hh', 'bias_ih',
  'bias_hh'})."""
  layers: Dict[str, Dict[str, np.ndarray]] = {}
  for key, value in state.items():
    a = np.asarray(
      value.detach().cpu().numpy() if hasattr(value, 'detach') else value,
      np.float32,
    )
    m = _LSTM_KEY.match(key)
    if m:
      layers.setdefault(f'{m.group(1)} (LSTM layer {m.group(4)})', {})[
        f'{m.group(2)}_{m.group(3)}'
      ] = a
    elif '.' in key:
      prefix, leaf = key.rsplit('.', 1)
      layers.setdefault(prefix, {})[leaf] = a
    else:
      layers.setdefault(key, {})['weight'] = a
  return list(layers.items())


def _flax_layers(params, prefix='') -> List[Tuple[str, dict]]:
  """The model's layers in creation order: nodes whose children are arrays
  (dense, conv, embedding), and LSTM cells (children ``ii`` .. ``ho``)."""
  out = []
  for k, v in params.items():
    name = f'{prefix}{k}'
    if not isinstance(v, dict):
      continue
    if all(not isinstance(c, dict) for c in v.values()):
      out.append((name, v))
    elif set(v) == {f'{a}{g}' for a in 'ih' for g in GATES}:
      out.append((name, v))
    else:
      out.extend(_flax_layers(v, name + '/'))
  return out


def _shape(d):
  return {k: list(np.shape(a)) for k, a in d.items()}


def _convert(
  flayer, tlayer, flat_shape, after_conv
) -> Optional[Dict[str, np.ndarray]]:
  """One torch layer in the Flax layout of ``flayer`` (None if it does not
  fit)."""
  if 'ii' in flayer:  # an LSTM cell
    if set(tlayer) != {'weight_ih', 'weight_hh', 'bias_ih', 'bias_hh'}:
      return None
    h = flayer['hi']['kernel'].shape[0]
    w_ih, w_hh = tlayer['weight_ih'], tlayer['weight_hh']
    if w_ih.shape != (4 * h, flayer['ii']['kernel'].shape[0]) or w_hh.shape != (
      4 * h,
      h,
    ):
      return None
    bias = tlayer['bias_ih'] + tlayer['bias_hh']
    out = {}
    for g, gate in enumerate(GATES):
      rows = slice(g * h, (g + 1) * h)
      out[f'i{gate}/kernel'] = w_ih[rows].T
      out[f'h{gate}/kernel'] = w_hh[rows].T
      out[f'h{gate}/bias'] = bias[rows]
    return out
  if 'mean' in flayer:  # a batch norm: its parameters and running statistics
    names = {
      'scale': 'weight',
      'bias': 'bias',
      'mean': 'running_mean',
      'var': 'running_var',
    }
    if set(tlayer) - set(names.values()) - {'num_batches_tracked'} or any(
      np.shape(tlayer.get(t)) != np.shape(flayer[f]) for f, t in names.items()
    ):
      return None
    return {f: tlayer[t] for f, t in names.items()}
  if 'embedding' in flayer:
    w = tlayer.get('weight')
    if set(tlayer) != {'weight'} or w.shape != flayer['embedding'].shape:
      return None
    return {'embedding': w}
  if set(tlayer) - {'weight', 'bias'} or 'weight' not in tlayer:
    return None
  kernel_shape = flayer['kernel'].shape
  w = tlayer['weight']
  if len(kernel_shape) == 4 and w.ndim == 4:
    k = w.transpose(2, 3, 1, 0)  # OIHW -> HWIO
  elif len(kernel_shape) == 2 and w.ndim == 2:
    k = w.T
    if (
      after_conv
      and flat_shape is not None
      and w.shape[1] == int(np.prod(flat_shape))
    ):
      hh, ww, cc = flat_shape
      k = (
        w.reshape(w.shape[0], cc, hh, ww)
        .transpose(2, 3, 1, 0)
        .reshape(-1, w.shape[0])
      )
  else:
    return None
  out = {'kernel': k}
  if 'bias' in flayer:
    if 'bias' not in tlayer:
      return None
    out['bias'] = tlayer['bias']
  elif 'bias' in tlayer:
    return None
  if any(
    tuple(np.shape(v)) != tuple(np.shape(_get(flayer, n)))
    for n, v in out.items()
  ):
    return None
  return out


def _get(layer, name):
  node = layer
  for p in name.split('/'):
    node = node[p]
  return node


def _from_torch(path, template, flat_shape) -> dict:
  try:
    import torch
  except ImportError:
    _fail(
      path,
      'reading a PyTorch state dict needs torch (pip install torch), or save '
      'the '
      'weights as .npz',
    )
  try:
    state = torch.load(path, map_location='cpu', weights_only=True)
  except Exception as e:  # torch raises many types for a damaged file
    _fail(path, f'not a readable PyTorch state dict ({type(e).__name__})')
  for k in ('state_dict', 'model_state_dict'):
    if isinstance(state, dict) and isinstance(state.get(k), dict):
      state = state[k]
  if not isinstance(state, dict) or not state:
    _fail(path, 'holds no state dict (a dict of parameter tensors)')
  tlayers = _torch_layers(state)
  stats = {}
  # a model with batch statistics
  if 'batch_stats' in template and 'params' in template:
    stats = dict(_flax_layers(template['batch_stats']))
    flayers = [
      (n, {**leaves, **stats.get(n, {})})
      for n, leaves in _flax_layers(template['params'])
    ]
  else:
    flayers = _flax_layers(template)
  flat = {}
  seen_conv = False
  first_dense_after_conv = True
  for i, (fname, flayer) in enumerate(flayers):
    if i >= len(tlayers):
      _fail(
        path,
        f"has {len(tlayers)} layers; the model's layer {i + 1}, {fname} "
        f'{_shape(flayer)}, has no counterpart',
      )
    tname, tlayer = tlayers[i]
    after_conv = (
      seen_conv
      and first_dense_after_conv
      and 'kernel' in flayer
      and np.ndim(flayer['kernel']) == 2
    )
    conv = _convert(flayer, tlayer, flat_shape, after_conv)
    if conv is None:
      _fail(
        path,
        f'layer {i + 1} differs: {tname} {_shape(tlayer)} in the file, {fname} '
        f'{_shape(flayer)} in the model',
      )
    if 'kernel' in flayer and np.ndim(flayer['kernel']) == 4:
      seen_conv = True
    elif after_conv:
      first_dense_after_conv = False
    if stats:
      flat.update(
        {
          f'{"batch_stats" if k in ("mean", "var") else "params"}/{fname}/{k}': v
          for k, v in conv.items()
        }
      )
    else:
      flat.update({f'{fname}/{k}': v for k, v in conv.items()})
  if len(tlayers) > len(flayers):
    tname, tlayer = tlayers[len(flayers)]
    _fail(
      path,
      f'has {len(tlayers)} layers, the model {len(flayers)}: {tname} '
      f'{_shape(tlayer)} has no counterpart',
    )
  return _unflatten({k: flat[k] for k in flat_params(template)})
