"""TensorBoard summaries of a run, written without TensorFlow: every
evaluated round's scalar metrics (as FedJAX's ``training.Logger`` writes
them) in ``<output_dir>/tensorboard/<algorithm>`` (a sweep's or trials'
configurations in folders of their own beneath), so that ``tensorboard
--logdir=<output_dir>/tensorboard`` shows the algorithms side by side.

The files are TensorFlow's event files: a TFRecord stream (each record its
length, the masked CRC-32C of the length, the bytes, their masked CRC-32C)
of ``Event`` protocol buffers (``wall_time``, ``step``, a ``file_version``
first, then ``Summary`` values of ``tag`` and ``simple_value``), encoded
here field by field.
"""

import glob
import math
import os
import socket
import struct
import time
from typing import Dict, List, Optional

from fedjax_personal.hparams import value_text
from fedjax_personal.run.experiment import Callback

__all__ = ['EventFile', 'TensorBoardWriter', 'masked_crc32c', 'scalar_event']

_CRC_TABLE: List[int] = []


def _crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78)."""
  if not _CRC_TABLE:
    for i in range(256):
      c = i
      for _ in range(8):
        c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
      _CRC_TABLE.append(c)
  crc = 0xFFFFFFFF
  for b in data:
    crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  """TFRecord's checksum: the CRC-32C rotated right by 15 bits plus a constant.

  Args:
    data: the bytes.

  Returns:
    The masked checksum (uint32).
  """
  crc = _crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
  out = bytearray()
  while True:
    byte, n = n & 0x7F, n >> 7
    out.append(byte | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
  """A length-delimited field (wire type 2)."""
  return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def scalar_event(
  step: int, values: Dict[str, float], wall_time: float
) -> bytes:
  """An ``Event`` holding a ``Summary`` of scalars.

  Args:
    step: the round.
    values: ``{tag: value}``.
    wall_time: seconds since the epoch.

  Returns:
    The serialized ``Event``.
  """
  summary = b''.join(
    _field(1, _field(1, tag.encode()) + b'\x15' + struct.pack('<f', value))
    for tag, value in values.items()
  )
  return (
    b'\x09'
    + struct.pack('<d', wall_time)
    + b'\x10'
    + _varint(step)
    + _field(5, summary)
  )


class EventFile:
  """One TensorBoard event file, written as records are added (flushed)."""

  def __init__(self, folder: str):
    os.makedirs(folder, exist_ok=True)
    self.path = os.path.join(
      folder,
      f'events.out.tfevents.{int(time.time())}.'
      f'{socket.gethostname()}.{os.getpid()}',
    )
    self._file = open(self.path, 'wb')
    version = (
      b'\x09' + struct.pack('<d', time.time()) + _field(3, b'brain.Event:2')
    )
    self._record(version)

  def _record(self, data: bytes) -> None:
    length = struct.pack('<Q', len(data))
    self._file.write(
      length
      + struct.pack('<I', masked_crc32c(length))
      + data
      + struct.pack('<I', masked_crc32c(data))
    )
    self._file.flush()

  def scalars(
    self, step: int, values: Dict[str, float], wall_time: Optional[float] = None
  ) -> None:
    """Adds one round's scalars.

    Args:
      step: the round.
      values: ``{tag: value}``.
      wall_time: seconds since the epoch (default: now).

    Returns:
      None.
    """
    if values:
      self._record(
        scalar_event(
          step, values, time.time() if wall_time is None else wall_time
        )
      )

  def close(self) -> None:
    """Closes the file.

    Returns:
      None.
    """
    self._file.close()


def _scalars(record: dict) -> Dict[str, float]:
  """The finite numbers of a round's record, by name (lists and labels out)."""
  return {
    k: float(v)
    for k, v in record.items()
    if k != 'round'
    and isinstance(v, (int, float))
    and not isinstance(v, bool)
    and math.isfinite(v)
  }


def _config_folder(record: dict) -> str:
  config = record.get('config')
  if not config:
    return ''
  return '_'.join(f'{k}={value_text(v)}' for k, v in config.items())


class TensorBoardWriter(Callback):
  """Writes a run's scalars as TensorBoard events.

  Writes every evaluated round's scalars of one algorithm (each
  configuration of a sweep in a folder of its own); a resumed run's earlier
  rounds are written again into fresh files, never twice."""

  def __init__(self, folder: str, histories: Optional[List[List[dict]]] = None):
    self.folder = folder
    self.histories = histories or []
    self.files: Dict[str, EventFile] = {}

  def _write(self, record: dict) -> None:
    values = _scalars(record)
    if 'round' not in record or not any(
      k.startswith('accuracy') for k in values
    ):
      return  # not an evaluated round
    sub = _config_folder(record)
    if sub not in self.files:
      self.files[sub] = EventFile(
        os.path.join(self.folder, sub) if sub else self.folder
      )
    self.files[sub].scalars(int(record['round']), values)

  def on_start(self, runs, state):
    for old in glob.glob(
      os.path.join(self.folder, '**', 'events.out.tfevents.*'), recursive=True
    ):
      os.remove(old)
    for history in self.histories:
      for record in history:
        self._write(record)

  def on_round_end(self, round_num, records, state):
    for record in records:
      self._write(record)

  def on_end(self, histories, state):
    for f in self.files.values():
      f.close()
