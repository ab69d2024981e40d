"""``hparam``: a setting declared once, as a dataclass field with its default,
help line and valid range. Below every other layer but ``errors``: the
algorithms' and training settings (``config``), the data set's
(``datasets.DataConfig``), the model's, the engine's, the process's and the
run's settings are all declared with it, and the command's flags are
generated from the declarations (``run/experiment_flags.py``).

One declaration serves three readers: the flag (its name, type, default and
help), the range check (``validate``, whose refusal names the flag), and the
docs (``--helpfull``).
"""

import dataclasses
import functools
import math
import re
import typing
from typing import Any, Callable, Dict, Optional, Tuple

import jax

from fedjax_personal.errors import ConfigError, SettingError

__all__ = [
  'as_flag_error',
  'check_name',
  'value_text',
  'claim_flags',
  'FLAG_CLASSES',
  'Declared',
  'field_types',
  'fill_from_run',
  'require_filled',
  'fill_options',
  'flag_fields',
  'flag_name',
  'hparam',
  'is_list',
  'validate',
]


def hparam(
  default,
  help: str,
  *,
  choices: Optional[Tuple] = None,
  minimum=None,
  maximum=None,
  open_min: bool = False,
  open_max: bool = False,
  sweep: bool = False,
  flag: Optional[str] = None,
  refusal: Optional[str] = None,
  command: bool = True,
  repeatable: bool = False,
  of_run: Optional[Callable[[Any], Any]] = None,
):
  """A documented setting: a dataclass field carrying its flag's metadata.

  Args:
    default: its default (the only place it is written).
    help: one line for ``--helpfull`` and the docs.
    choices: allowed values of a string setting (its flag is an enum).
    minimum: lower numeric bound (closed unless ``open_min``); None values
      (when the default is None) are allowed.
    maximum: upper numeric bound (closed unless ``open_max``).
    open_min: the lower bound itself is refused.
    open_max: the upper bound itself is refused.
    sweep: may be swept inside one compiled program (``--sweep``): the
      builder only uses it arithmetically.
    flag: the flag's name where it is not ``<prefix>_<field>`` (the data
      set's ``seed`` is ``--data_seed``: ``--seed`` is the run's).
    refusal: the wording of an out-of-range refusal (default: ``must be
      >= 1`` or ``must be in (0, 1]``).
    command: False for a setting of the library alone, with no flag (one the
      command could only ignore).
    repeatable: a tuple setting whose flag may be given several times, each
      adding values (``--import=a.py --import=b.py``), not a comma list.
    of_run: for a setting whose default is None: ``experiment -> value``,
      what the command sets it to from the run's own settings when the flag
      is not given (FedPHP's schedule spans the run's ``--rounds``;
      ``fill_from_run``), so the run's record holds the value it used.

  Returns:
    A ``dataclasses.field`` carrying the metadata.
  """
  return dataclasses.field(
    default=default,
    metadata=dict(
      help=help,
      choices=choices,
      minimum=minimum,
      maximum=maximum,
      open_min=open_min,
      open_max=open_max,
      sweep=sweep,
      flag=flag,
      refusal=refusal,
      command=command,
      repeatable=repeatable,
      of_run=of_run,
    ),
  )


def fill_from_run(settings, run):
  """``settings`` with each None field that declares ``of_run`` (``hparam``)
  set to ``of_run(run)``.

  Args:
    settings: a settings dataclass instance.
    run: what ``of_run`` reads (the command's ``ExperimentSettings``).

  Returns:
    The settings, filled.
  """
  fills = {
    f.name: f.metadata['of_run'](run)
    for f in dataclasses.fields(settings)
    if f.metadata.get('of_run') is not None
    and getattr(settings, f.name) is None
  }
  return dataclasses.replace(settings, **fills) if fills else settings


def require_filled(settings, name: str) -> Any:
  """The field ``name`` of ``settings``, refused naming its flag while None:
  a setting the command fills from the run (``of_run``) that a caller from
  Python left out.

  Args:
    settings: a settings dataclass instance.
    name: the field that must hold a value.

  Returns:
    Its value.

  Raises:
    ConfigError naming the flag.
  """
  value = getattr(settings, name)
  if value is None:
    field = {f.name: f for f in dataclasses.fields(settings)}[name]
    raise ConfigError(
      flag_name(type(settings), name),
      f'give it (the command sets it from the run): {field.metadata["help"]}',
    )
  return value


@functools.lru_cache(maxsize=None)
def field_types(cls: type) -> dict:
  """{field name: its base type} (``Optional[float]`` -> float).

  Args:
    cls: a settings dataclass.

  Returns:
    ``{field name: type}``.
  """
  hints = typing.get_type_hints(cls)
  out = {}
  for f in dataclasses.fields(cls):
    t = hints[f.name]
    args = [a for a in typing.get_args(t) if a is not type(None)]
    out[f.name] = args[0] if typing.get_origin(t) is typing.Union else t
  return out


def is_list(t) -> bool:
  """Whether a field type is a list of values (``Tuple[str, ...]``: a comma list
  flag).

  Args:
    t: a type from ``field_types``.

  Returns:
    True for a tuple or list type.
  """
  return typing.get_origin(t) in (tuple, list)


def as_flag_error(e: SettingError) -> ConfigError:
  """``e`` said by its flag, as a command's entry says it: a ``ConfigError``
  as it is; a ``SettingError`` of a settings class's field as that field's
  flag (``flag_name``), of a name of its own as that name.

  Args:
    e: the error.

  Returns:
    The ``ConfigError`` naming the flag.
  """
  if isinstance(e, ConfigError):
    return e
  name = e.setting
  if e.owner is not None and name in getattr(
    e.owner, '__dataclass_fields__', {}
  ):
    name = flag_name(e.owner, name)
  out = ConfigError(name, e.message)
  out.__cause__ = e
  return out


def flag_name(cls, field: str) -> str:
  """The flag of a settings class's ``field``: its declared ``flag``, else
  ``<prefix>_<field>`` (no prefix: the field).

  Args:
    cls: a settings dataclass (its ``prefix``, if any).
    field: one of its fields.

  Returns:
    The flag's name.
  """
  meta = cls.__dataclass_fields__[field].metadata
  if meta.get('flag'):
    return meta['flag']
  prefix = getattr(cls, 'prefix', None)
  return f'{prefix}_{field}' if prefix else field


def flag_fields(cls) -> list:
  """The fields of a settings class that the command has a flag for (all
  but those declared ``command=False``).

  Args:
    cls: a settings dataclass.

  Returns:
    Its ``dataclasses.Field`` s with a flag.
  """
  return [f for f in dataclasses.fields(cls) if f.metadata.get('command', True)]


def _interval(meta) -> str:
  lo, hi = meta['minimum'], meta['maximum']
  if hi is None:
    return f'{">" if meta["open_min"] else ">="} {lo}'
  if lo is None:
    return f'{"<" if meta["open_max"] else "<="} {hi}'
  return f'in {"(" if meta["open_min"] else "["}{lo}, {hi}{")" if meta["open_max"] else "]"}'


def _is_traced(v) -> bool:
  """A value traced by JAX (a hyperparameter swept inside ``jax.vmap``):
  checked before it was swept (the CLI validates sweep values)."""
  return isinstance(v, jax.core.Tracer)


def validate(cfg) -> None:
  """Checks every field of a settings dataclass against its declaration:
  finite floats, one of its ``choices``, within its bounds. None values and
  traced ones are skipped.

  Args:
    cfg: a settings dataclass instance (``hparam`` fields).

  Returns:
    None.

  Raises:
    ConfigError naming the flag: ``--client_lr: must be > 0, got -1``.
  """
  cls: type = type(cfg)
  types = field_types(cls)
  for f in dataclasses.fields(cfg):
    v, meta, name = (
      getattr(cfg, f.name),
      f.metadata,
      flag_name(type(cfg), f.name),
    )
    if v is None or _is_traced(v) or is_list(types[f.name]):
      continue
    if types[f.name] is float and not math.isfinite(float(v)):
      raise ConfigError(name, f'must be finite, got {v}')
    if meta.get('choices') and v not in meta['choices']:
      raise ConfigError(
        name, f'must be one of {list(meta["choices"])}, got {v!r}'
      )
    lo, hi = meta.get('minimum'), meta.get('maximum')
    if (lo is not None and (v < lo or (meta['open_min'] and v == lo))) or (
      hi is not None and (v > hi or (meta['open_max'] and v == hi))
    ):
      raise ConfigError(
        name, f'{meta.get("refusal") or "must be " + _interval(meta)}, got {v}'
      )


class Declared:
  """The base of a settings dataclass.

  Its fields are checked against their
  declarations when an instance is made (``validate``), so a setting is
  checked once, where it is declared. A class whose fields depend on each
  other adds a ``check()`` (called after ``validate``).

  Raises:
    ConfigError naming the flag of the first field out of its range.
  """

  def __post_init__(self):
    validate(self)
    check = getattr(self, 'check', None)
    if check is not None:
      check()


def fill_options(settings, flag: str, cls) -> None:
  """Sets ``settings.options`` (a frozen settings class holding the own
  options of what its field ``flag`` names: a data set's, a model's) to
  ``cls()`` when None; options of another class are refused.

  Args:
    settings: the settings instance (its ``options`` and ``flag`` fields).
    flag: the field naming the thing (``dataset``, ``model``).
    cls: that thing's options class.

  Returns:
    None.

  Raises:
    ConfigError naming ``flag``.
  """
  if settings.options is None:
    object.__setattr__(settings, 'options', cls())
  elif type(settings.options) is not cls:
    raise ConfigError(
      flag,
      f'{type(settings.options).__name__} are not the options of '
      f'{getattr(settings, flag)} ({cls.__name__})',
    )


#: The settings classes whose fields are a command's flags, with what each
#: is (``claim_flags``): the run's, the shared training settings, and every
#: algorithm's, data set's and model's own options as they are registered.
FLAG_CLASSES: Dict[type, str] = {}


def claim_flags(cls, what: str) -> None:
  """Claims the flags of settings class ``cls`` for ``what``: a flag that
  another claimed class declares already is refused (its value would
  silently be the other's). A field inherited from a claimed class is the
  same flag, not a second one; ``what`` claiming again (a re-run notebook
  cell) replaces its earlier class.

  Args:
    cls: a settings dataclass (or None: nothing to claim).
    what: what it is, as a refusal names it (``an option of --model=mine``).

  Returns:
    None.

  Raises:
    ValueError naming the flag, what holds it already, and the class.
  """
  if cls is None or not dataclasses.is_dataclass(cls):
    return
  for old in [c for c, w in FLAG_CLASSES.items() if w == what and c is not cls]:
    del FLAG_CLASSES[old]
  taken: Dict[str, Tuple[dataclasses.Field, str]] = {}
  for other, owner in FLAG_CLASSES.items():
    if other is not cls:
      for f in flag_fields(other):
        taken.setdefault(flag_name(other, f.name), (f, owner))
  for f in flag_fields(cls):
    flag = flag_name(cls, f.name)
    got = taken.get(flag)
    if got is not None and got[0] is not f:
      raise ValueError(
        f'{what}: its flag --{flag} is already {got[1]}; give '
        f'{cls.__name__} another prefix (or rename the field)'
      )
  FLAG_CLASSES[cls] = what


_NAME = re.compile(r'[A-Za-z_][A-Za-z0-9_]*')


def check_name(kind: str, name) -> None:
  """Refuses a registered name that is not a plain identifier: it becomes
  a flag's value, a folder of the output and a key of stores, so a ``/``,
  ``..``, a comma or an empty name would reach other folders or other
  entries.

  Args:
    kind: what is registered (``model``, ``data set``, ``algorithm``).
    name: its name.

  Returns:
    None.

  Raises:
    ValueError naming the name.
  """
  if not isinstance(name, str) or not _NAME.fullmatch(name):
    raise ValueError(
      f'{kind} name {name!r}: must be a plain identifier (letters, digits '
      'and _, not starting with a digit)'
    )


def value_text(value) -> str:
  """A setting's value as a label writes it (a sweep's table row, its
  TensorBoard folder): ``%g`` when that reads back as the value, else the
  exact ``repr`` (0.1 and 0.1000001 keep distinct labels).

  Args:
    value: a number (or anything else: ``str``).

  Returns:
    The text.
  """
  if isinstance(value, float):
    short = f'{value:g}'
    return short if float(short) == value else repr(value)
  return str(value)
