"""A data set's own options: what a data set owns beside ``DataConfig``.

Each data set with options of its own declares them in its module as a
frozen dataclass of ``hparam`` fields deriving from ``DataOptions`` (its
defaults, ranges and help), and registers it with the data set's name
(``registry.register(name, read_clients, options=...)``). ``DataConfig``
carries the instance of its data set's class (``DataConfig.options``); the
command's flags are generated from every registered class's fields, and an
option given for a data set whose class does not declare it is refused
(``config.check_given``), so the run holds no branch on a data set's name.

A reader (``read_clients``) receives the options its signature names
(``reader_kwargs``); those it receives key its population store. What the
run does with an option beyond reading the files (how the model scores a
target, how inputs are transformed, the header's lines) is a method of the
class, ``DataOptions``'s no-op by default.
"""

import dataclasses
from typing import ClassVar, List, Optional, Tuple

from fedjax_personal.hparams import Declared, hparam

__all__ = ['DataOptions', 'NoOptions', 'TextOptions']


@dataclasses.dataclass(frozen=True)
class DataOptions(Declared):
  """The base of a data set's options; its hooks do nothing.

  Attributes:
    held_out_choice: ``(flag, value)`` of the option that gives the data
      set held-out test clients and the value that does not (a personal
      model cannot be evaluated on clients that never trained), or None.
  """

  held_out_choice: ClassVar[Optional[Tuple[str, str]]] = None

  def reader_kwargs(self) -> dict:
    """The options as a reader takes them (by field name).

    Returns:
      ``{field: value}``.
    """
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  def store_key(self, passed: dict) -> dict:
    """What of the options ``passed`` to the reader keys its population
    store: all of them unless the data set knows one does not change what
    it reads (a store made with another value is never reused).

    Args:
      passed: ``{name: value}`` the reader received.

    Returns:
      ``{name: value}``.
    """
    return dict(passed)

  def check_given(self, cfg, given) -> None:
    """Refuses options that cannot apply to ``cfg`` (the whole
    ``DataConfig``: its partition, say) in one line naming the flag.

    Args:
      cfg: the ``DataConfig`` holding these options.
      given: the names of the flags the command gave.

    Returns:
      None.
    """
    del cfg, given

  def files_split_test(self) -> bool:
    """Whether a natural data set's files give its test split (else each
    client's examples are split with ``--test_fraction``).

    Returns:
      bool.
    """
    return True

  def describe(self) -> List[str]:
    """Lines the run's header prints about these options.

    Returns:
      The lines.
    """
    return []

  def row_group_start(self) -> Optional[int]:
    """The input id that starts a group of a client's rows that training
    shuffles as one, in order (``core.batching.row_groups``: TFF's
    Shakespeare snippets), or None: rows one by one.

    Returns:
      The id, or None.
    """
    return None

  def scored(self, model, num_classes: int):
    """The model scoring the targets as the data set's publisher does
    (next-word accuracies), and one line saying how, or ``(model, None)``.

    Args:
      model: the ``models.Model``.
      num_classes: the data set's classes.

    Returns:
      ``(model, line or None)``.
    """
    del num_classes
    return model, None

  def input_transform(self):
    """The ``models.inputs.InputTransform`` the model sees its inputs
    through, or None.

    Returns:
      The transform, or None.
    """
    return None


@dataclasses.dataclass(frozen=True)
class NoOptions(DataOptions):
  """A data set without options of its own."""


@dataclasses.dataclass(frozen=True)
class TextOptions(DataOptions):
  """A data set whose rows are windows of tokens."""

  #: Tokens per row when ``seq_len`` is not given.
  DEFAULT_SEQ_LEN: ClassVar[int] = 80
  seq_len: Optional[int] = hparam(
    None,
    "Text data sets: the rows' length in tokens (default: "
    "the data set's; 80 characters, 20 words for stackoverflow).",
    minimum=1,
    maximum=1 << 20,
  )

  @property
  def sequence_length(self) -> int:
    """``seq_len``, or the data set's default."""
    return self.seq_len or self.DEFAULT_SEQ_LEN

  def reader_kwargs(self) -> dict:
    return {**super().reader_kwargs(), 'seq_len': self.sequence_length}
