"""Federated Shakespeare (Caldas et al., LEAF; 715 speaking roles) from
FedJAX's SQLite files (``shakespeare_{train,test}.sqlite``), in either
publisher's windows (``WINDOWS``) and ids (90 classes each; the same 86
characters in the same order):

- ``fedjax`` (``fedjax/datasets/shakespeare.py``): FedJAX's ids (PAD 0,
  BOS 1, EOS 2, character i -> 3 + i, OOV 89); a client's snippets joined
  with BOS/EOS into one character sequence cut into x/y pairs of
  ``seq_len``; padded targets carry no loss (``IGNORE``).
- ``tff`` (TFF's and Reddi et al.'s, google-research/federated
  ``shakespeare_dataset.py``): TFF's ids (PAD 0, character i -> 1 + i, OOV
  87, BOS 88, EOS 89: ``TFF_IDS``), so a TFF/Keras model's weights apply
  as they are; each snippet alone, ``[BOS] chars [EOS]``,
  padded with PAD to a multiple of ``seq_len + 1``, cut into rows of
  ``seq_len + 1``, x = a row but its last, y = a row but its first: BOS is
  never a target; PAD targets count in the loss (Keras' unmasked
  cross-entropy there) and not in the accuracy (its
  ``MaskedCategoricalAccuracy(masked_tokens=[pad])``: ``PAD_UNSCORED``);
  training shuffles snippets, a snippet's rows together
  (``ShakespeareOptions.row_group_start``), as its code shuffles snippets
  before cutting them.
"""

import dataclasses
import functools
from typing import List

import numpy as np

from fedjax_personal.datasets import (
  sources,
  sqlite_federated_data,
  store_federated_data,
)
from fedjax_personal.datasets.natural_data import (
  BOS,
  EOS,
  IGNORE,
  PAD,
  NaturalData,
  fedjax_splits,
)
from fedjax_personal.datasets.options import TextOptions
from fedjax_personal.hparams import hparam

__all__ = [
  'load_data',
  'load_split',
  'OOV',
  'PAD_UNSCORED',
  'preprocess_client',
  'read_clients',
  'SHAKESPEARE_CLASSES',
  'SHAKESPEARE_OOV',
  'shakespeare_sequences',
  'SHAKESPEARE_VOCAB',
  'ShakespeareOptions',
  'SPLITS',
  'TABLE',
  'TFF_IDS',
  'tff_sequences',
  'VOCAB_SIZE',
]


# FedJAX's Shakespeare table (fedjax/datasets/shakespeare.py): byte vocab[i]
# has label 3 + i; 0 PAD, 1 BOS, 2 EOS, 89 OOV.
SHAKESPEARE_VOCAB = (
  b'dhlptx@DHLPTX '
  b'$(,048cgkoswCGKOSW[_#\'/37;?bfjnrvzBFJNRVZ"&*.26:\naeimquyAEIMQUY]'
  b'!%)-159\r'
)
SHAKESPEARE_OOV = 3 + len(SHAKESPEARE_VOCAB)
SHAKESPEARE_CLASSES = SHAKESPEARE_OOV + 1
_SHAKESPEARE_TABLE = np.full(256, SHAKESPEARE_OOV, np.int32)
for _i, _c in enumerate(SHAKESPEARE_VOCAB):
  _SHAKESPEARE_TABLE[_c] = 3 + _i


def shakespeare_sequences(snippets, seq_len: int):
  """FedJAX's preprocessing of one client: snippets joined as
  ``BOS s_1 EOS BOS s_2 EOS ...`` and cut into x/y rows of ``seq_len``
  (y = x shifted by one; padded target positions IGNORE).

  Args:
    snippets: a client's snippets (bytes or str).
    seq_len: characters per row.

  Returns:
    ``(x, y)`` int32 [rows, seq_len].
  """
  ids: List[int] = []
  for s in snippets:
    ids += (
      [BOS]
      + _SHAKESPEARE_TABLE[np.frombuffer(bytes(s), np.uint8)].tolist()
      + [EOS]
    )
  joined = np.asarray(ids, np.int32)
  if len(joined) < 2:
    return np.zeros((0, seq_len), np.int32), np.zeros((0, seq_len), np.int32)
  rows = -(-(len(joined) - 1) // seq_len)
  x = np.full(rows * seq_len, PAD, np.int32)
  y = np.full(rows * seq_len, IGNORE, np.int32)
  x[: len(joined) - 1], y[: len(joined) - 1] = joined[:-1], joined[1:]
  return x.reshape(rows, seq_len), y.reshape(rows, seq_len)


#: TFF's Shakespeare ids (``shakespeare_dataset.get_special_tokens``): PAD 0,
#: the vocabulary's character i -> 1 + i, OOV 87, BOS 88, EOS 89.
TFF_IDS = {
  'pad': 0,
  'oov': len(SHAKESPEARE_VOCAB) + 1,
  'bos': len(SHAKESPEARE_VOCAB) + 2,
  'eos': len(SHAKESPEARE_VOCAB) + 3,
}
_TFF_TABLE = np.full(256, TFF_IDS['oov'], np.int32)
for _i, _c in enumerate(SHAKESPEARE_VOCAB):
  _TFF_TABLE[_c] = 1 + _i


def tff_sequences(snippets, seq_len: int):
  """TFF's (Reddi et al.'s) preprocessing of one client (module doc), in
  TFF's ids (``TFF_IDS``): each snippet ``[BOS] chars [EOS]`` padded with
  PAD to rows of ``seq_len + 1``, x = row[:-1], y = row[1:].

  Args:
    snippets: a client's snippets (bytes or str).
    seq_len: characters per row.

  Returns:
    ``(x, y)`` int32 [rows, seq_len].
  """
  split = seq_len + 1
  xs, ys = [], []
  for s in snippets:
    tokens = np.concatenate(
      [
        [TFF_IDS['bos']],
        _TFF_TABLE[np.frombuffer(bytes(s), np.uint8)],
        [TFF_IDS['eos']],
      ]
    ).astype(np.int32)
    tokens = np.concatenate(
      [tokens, np.full((-len(tokens)) % split, TFF_IDS['pad'], np.int32)]
    )
    rows = tokens.reshape(-1, split)
    xs.append(rows[:, :-1])
    ys.append(rows[:, 1:])
  if not xs:
    return np.zeros((0, seq_len), np.int32), np.zeros((0, seq_len), np.int32)
  return np.concatenate(xs), np.concatenate(ys)


WINDOWS = {'fedjax': shakespeare_sequences, 'tff': tff_sequences}
#: The targets the accuracy leaves out, per windows (their loss counts them).
PAD_UNSCORED = {'fedjax': (), 'tff': (PAD,)}


@dataclasses.dataclass(frozen=True)
class ShakespeareOptions(TextOptions):
  """Shakespeare's options: its rows' length and whose windows."""

  windows: str = hparam(
    'fedjax',
    'shakespeare: how snippets become x/y windows. fedjax: a '
    "client's snippets joined with BOS/EOS and cut into --seq_len (FedJAX's "
    'load_data); tff: each snippet padded to a multiple of seq_len + 1 and cut '
    'into 80/80 pairs, BOS never a target, PAD targets in the loss but not in '
    "the accuracy, a snippet's rows shuffled together (TFF, Reddi et al.).",
    choices=('fedjax', 'tff'),
    flag='shakespeare_windows',
  )

  def row_group_start(self):
    # TFF shuffles snippets (buffer 50) before cutting them into rows: a
    # snippet's rows, the first starting with BOS, stay together.
    return TFF_IDS['bos'] if self.windows == 'tff' else None

  def scored(self, model, num_classes):
    if self.windows != 'tff':
      return model, None
    model = model.scoring_only_words(
      PAD_UNSCORED['tff'],
      top_k=0,
      definition='TFF windows: accuracy over the targets but PAD (PAD targets in the loss)',
    )
    return model, f'windows: tff, {model.accuracy_definition}'


def read_clients(
  num_clients=None,
  data_dir=None,
  download=False,
  seq_len: int = 80,
  windows: str = 'fedjax',
) -> NaturalData:
  """Federated Shakespeare (715 speaking roles), FedJAX's files, in
  ``windows`` (``WINDOWS``: FedJAX's or TFF's).

  Args:
    num_clients: the first N roles (None: all).
    data_dir: where the files are.
    download: fetch missing files.
    seq_len: characters per row.
    windows: ``'fedjax'`` or ``'tff'``.

  Returns:
    The speaking roles as a ``NaturalData``.
  """
  if windows not in WINDOWS:
    raise ValueError(f'windows must be one of {list(WINDOWS)}, got {windows!r}')
  paths = list(sources.fetch('shakespeare', data_dir, download).values())
  cut = WINDOWS[windows]
  out = fedjax_splits(
    'shakespeare',
    paths[0],
    paths[1],
    num_clients,
    lambda ex: cut(ex['snippets'], seq_len),
  )
  out.num_classes = SHAKESPEARE_CLASSES
  return out


#: FedJAX's names for the ids (``fedjax.datasets.shakespeare``).
TABLE, VOCAB_SIZE, OOV = (
  _SHAKESPEARE_TABLE,
  SHAKESPEARE_CLASSES,
  SHAKESPEARE_OOV,
)
SPLITS = ('train', 'test')


def preprocess_client(
  client_id, examples, sequence_length: int, windows: str = 'fedjax'
):
  """FedJAX's ``preprocess_client``: a client's ``snippets`` as x/y rows of
  ``sequence_length`` ids (``windows``: FedJAX's by default), padded
  targets PAD (0), as FedJAX has them.

  Args:
    client_id: not used.
    examples: ``{'snippets': [N] bytes}``.
    sequence_length: ids per row.
    windows: ``WINDOWS``.

  Returns:
    ``{'x', 'y'}`` int32 [M, sequence_length].
  """
  del client_id
  x, y = WINDOWS[windows](examples['snippets'], sequence_length)
  return {'x': x, 'y': np.where(y == IGNORE, PAD, y).astype(np.int32)}


def load_split(
  split: str,
  mode: str = 'sqlite',
  cache_dir=None,
  *,
  num_clients=None,
  download: bool = True,
  data_dir=None,
):
  """FedJAX's ``shakespeare.load_split``: one file's speaking roles, raw
  (``snippets`` [N] bytes), in the file's order.

  Args:
    split: ``'train'`` or ``'test'``.
    mode, cache_dir, num_clients, download, data_dir: as ``load_data``
      (``num_clients``: the file's first N clients).

  Returns:
    A ``sqlite_federated_data.SQLiteFederatedData``.
  """
  if split not in SPLITS:
    raise ValueError(f'Invalid split={split!r}')
  cfg = store_federated_data.data_config(
    'shakespeare', mode, cache_dir, num_clients, download, data_dir
  )
  return sqlite_federated_data.open_split(cfg, f'shakespeare_{split}.sqlite')


def load_data(
  sequence_length: int = 80,
  mode: str = 'sqlite',
  cache_dir=None,
  *,
  num_clients=None,
  download: bool = True,
  windows: str = 'fedjax',
  data_dir=None,
  seq_len=None,
):
  """FedJAX's ``shakespeare.load_data``: the train and test files' speaking
  roles, each in its file's order, their snippets as x/y rows of
  ``sequence_length`` ids (``preprocess_client``). ``client_sizes`` count
  snippets, as the files (and FedJAX) do; ``.store`` of a view is the
  population store the command line trains on, those roles alone.

  Args:
    sequence_length: ids per row (``seq_len`` is the same).
    mode: ``'sqlite'``.
    cache_dir: where the files are (``data_dir`` is the same).
    num_clients: the first N roles of each file (None: all 715).
    download: fetch missing files (FedJAX always does).
    windows: ``WINDOWS`` (FedJAX's by default).
    data_dir: the same as ``cache_dir``.
    seq_len: the same as ``sequence_length``.

  Returns:
    ``(train, test)`` ``sqlite_federated_data.SQLiteFederatedData``.
  """
  if windows not in WINDOWS:
    raise ValueError(f'windows must be one of {list(WINDOWS)}, got {windows!r}')
  length = seq_len or sequence_length
  cfg = store_federated_data.data_config(
    'shakespeare',
    mode,
    cache_dir,
    num_clients,
    download,
    data_dir,
    seq_len=length,
    shakespeare_windows=windows,
  )
  preprocess = functools.partial(
    preprocess_client, sequence_length=length, windows=windows
  )
  return tuple(
    sqlite_federated_data.open_split(
      cfg, f'shakespeare_{split}.sqlite', [preprocess]
    )
    for split in SPLITS
  )
