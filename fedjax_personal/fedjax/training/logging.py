"""FedJAX's ``Logger`` (``fedjax.training.logging``): each metric logged at
INFO with absl; with a ``root_dir``, also appended to
``<root_dir>/<writer name>/metrics.tsv`` (round, metric, value) where FedJAX
writes TensorBoard summaries (this package does not use TensorFlow)."""

import json
import os
from typing import Any, Optional

import numpy as np
from absl import logging

__all__ = ['Logger']


class Logger:
  """Logs metrics to absl and to TSV files.

  Logs ``(writer, metric, value, round)``: absl INFO, and a TSV file per
  writer under ``root_dir`` when one is given."""

  def __init__(self, root_dir: Optional[str] = None):
    self._root_dir = root_dir

  def log(
    self, writer_name: str, metric_name: str, metric_value: Any, round_num: int
  ) -> None:
    """Records one value (a vector as a JSON list).

    Args:
      writer_name: the writer ('.' for the experiment's own figures).
      metric_name: the metric.
      metric_value: its value.
      round_num: the round.
    """
    logging.info(
      'round %d %s: %s = %s', round_num, writer_name, metric_name, metric_value
    )
    if self._root_dir is None:
      return
    folder = os.path.join(self._root_dir, writer_name)
    os.makedirs(folder, exist_ok=True)
    value = np.asarray(metric_value)
    text = json.dumps(value.tolist()) if value.ndim else repr(value.item())
    with open(os.path.join(folder, 'metrics.tsv'), 'a') as f:
      f.write(f'{round_num}\t{metric_name}\t{text}\n')
