"""Stack Overflow's words: the vocabulary read from FedJAX's word counts,
sentences as word ids, and FedJAX's tokenizers (``DefaultWordTokenizer``,
``StackoverflowTokenizer``) in NumPy.
"""

from typing import Dict, List, Optional

import numpy as np

from fedjax_personal.datasets import (
  sources,
)
from fedjax_personal.datasets.fingerprint import fingerprint64
from fedjax_personal.datasets.natural_data import (
  BOS,
  EOS,
  IGNORE,
  PAD,
)
from fedjax_personal.errors import DataError

#: How posts become rows (``--stackoverflow_rows``).
STACKOVERFLOW_ROWS = ('fedjax', 'tff')

__all__ = [
  'default_vocab',
  'DefaultWordTokenizer',
  'read_word_count',
  'STACKOVERFLOW_ROWS',
  'StackoverflowTokenizer',
  'tokenize_sentences',
  'word_ids',
]


def read_word_count(path, vocab_size: Optional[int]) -> List[str]:
  """The most frequent words of ``stackoverflow.word_count``.

  Args:
    path: the file (one ``word count`` per line, most frequent first).
    vocab_size: how many words (None: every word, as FedJAX's
      ``itertools.islice(f, None)``).

  Returns:
    The words, most frequent first.
  """
  words: List[str] = []
  try:
    with open(path, encoding='utf-8') as f:
      for line in f:
        if len(words) == vocab_size:
          break
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
          raise DataError(
            f'{path}: line {len(words) + 1} is not "word count": '
            f'{line.strip()!r}'
          )
        words.append(parts[0])
  except UnicodeDecodeError as e:
    raise DataError(f'{path}: not UTF-8 text ({e.reason})') from None
  if vocab_size is not None and len(words) < vocab_size:
    raise DataError(
      f'{path}: {len(words)} words, the vocabulary needs {vocab_size}'
    )
  return words


def word_ids(words) -> Dict[bytes, int]:
  """The ids of a vocabulary's words (3.. in order), keyed by their UTF-8
  bytes, as ``tokenize_sentences`` looks them up.

  Args:
    words: the words (str or bytes), most frequent first.

  Returns:
    ``{word bytes: id}``.
  """
  return {
    (w.encode('utf-8') if isinstance(w, str) else bytes(w)): i + 3
    for i, w in enumerate(words)
  }


def tokenize_sentences(
  sentences,
  vocab: Dict[bytes, int],
  seq_len: int,
  pad_target: int = IGNORE,
  rows: str = 'fedjax',
  num_oov_buckets: int = 1,
):
  """Stack Overflow's rows: ids 0 PAD, 1 BOS, 2 EOS, 3.. the vocabulary,
  len(vocab) + 3 OOV; x = ids[:-1], y = ids[1:] of ``[BOS] words [EOS]``,
  truncated or padded to ``seq_len``. Words are split at every single
  space, as TensorFlow's ``tf.strings.split(sep=' ')`` (two spaces delimit
  an empty word, OOV), and looked up as bytes.

  ``rows='fedjax'`` is FedJAX's tokenizer with one OOV bucket: padded inputs
  PAD, padded targets ``pad_target``. ``rows='tff'`` is
  google-research/federated's ``stackoverflow_dataset.build_to_ids_fn`` and
  ``batch_and_split``: the words truncated to ``seq_len``, EOS appended
  when fewer, ``[BOS]`` before, padded with PAD to ``seq_len + 1``; so the
  input after the last word is EOS, and every target past it PAD, in the
  loss (its ``SparseCategoricalCrossentropy`` on the Keras model's output,
  whose PAD inputs repeat the last real output: ``mask_pad`` of
  ``reddi_char_lstm`` and ``lstm_lm``), never in the accuracy or the
  tokens.

  Args:
    sentences: a user's posts (bytes or str).
    vocab: word bytes -> id (3..): ``word_ids``.
    seq_len: tokens per row.
    pad_target: the id of a padded target with ``rows='fedjax'``
      (``IGNORE``: no loss; FedJAX: PAD).
    rows: ``'fedjax'`` or ``'tff'`` (``STACKOVERFLOW_ROWS``).
    num_oov_buckets: OOV ids after the vocabulary; a word outside it gets
      ``len(vocab) + 3 + fingerprint64(word) % num_oov_buckets``, as
      TensorFlow's ``StaticVocabularyTable`` hashes it (FedJAX's tokenizer).

  Returns:
    ``(x, y)`` int32 [posts, seq_len].
  """
  if rows not in STACKOVERFLOW_ROWS:
    raise ValueError(f'rows must be one of {STACKOVERFLOW_ROWS}, got {rows!r}')
  oov = len(vocab) + 3
  x = np.full((len(sentences), seq_len), PAD, np.int32)
  y = np.full(
    (len(sentences), seq_len), pad_target if rows == 'fedjax' else PAD, np.int32
  )
  for i, s in enumerate(sentences):
    text = s if isinstance(s, bytes) else str(s).encode('utf-8')
    words = [
      vocab.get(w, oov)
      if num_oov_buckets == 1
      else vocab.get(w, oov + fingerprint64(w) % num_oov_buckets)
      for w in text.split(b' ')
    ]
    if rows == 'tff':
      ids = [BOS] + words[:seq_len] + ([EOS] if len(words) < seq_len else [])
      ids += [PAD] * (seq_len + 1 - len(ids))
    else:
      ids = [BOS] + words + [EOS]
    n = min(len(ids) - 1, seq_len)
    x[i, :n], y[i, :n] = ids[:n], ids[1 : n + 1]
  return x, y


def default_vocab(
  default_vocab_size: Optional[int] = 10000,
  cache_dir=None,
  download: bool = True,
) -> List[str]:
  """FedJAX's ``default_vocab``: the ``default_vocab_size`` most frequent
  words of ``stackoverflow.word_count`` (found in ``cache_dir``, else
  where the data set's files are looked up; FedJAX reads it from its bucket).

  Args:
    default_vocab_size: the words kept (None: every word).
    cache_dir: where the file is.
    download: fetch it when found nowhere.

  Returns:
    The words, most frequent first.
  """
  path = sources.fetch(
    'stackoverflow', cache_dir, download, which=['stackoverflow.word_count']
  )['stackoverflow.word_count']
  return read_word_count(path, default_vocab_size)


class DefaultWordTokenizer:
  """FedJAX's word tokenizer, in NumPy.

  FedJAX's ``DefaultWordTokenizer`` in NumPy (FedJAX's needs
  TensorFlow): ids PAD 0, BOS 1, EOS 2, ``vocab[i]`` 3 + i, the OOV buckets
  after them (a word's bucket TensorFlow's hash of it, ``fingerprint64``);
  words split at every single space.

  Args:
    vocab: the words (no special tokens).
    num_oov_buckets: OOV ids (at least 1).
  """

  PAD, BOS, EOS = PAD, BOS, EOS

  def __init__(self, vocab: List[str], num_oov_buckets: int = 1):
    if num_oov_buckets < 1:
      raise ValueError(f'num_oov_buckets must be >= 1, got {num_oov_buckets}')
    self._vocab = word_ids(vocab)
    self._buckets = int(num_oov_buckets)

  def create_token_to_ids_fn(self, max_length: int):
    """``tokens [N] bytes -> (x, y)`` int32 [N, max_length], padded and
    truncated with PAD (FedJAX's ``token_to_ids``)."""
    return lambda tokens: tokenize_sentences(
      list(tokens),
      self._vocab,
      max_length,
      pad_target=PAD,
      num_oov_buckets=self._buckets,
    )

  def as_preprocess_batch(self, max_length: int):
    """A ``preprocess_batch`` function: ``tokens`` -> ``x``, ``y`` (and
    ``domain_id`` kept), FedJAX's.

    Args:
      max_length: tokens per row (padded or truncated to it).

    Returns:
      ``examples -> examples``.
    """
    token_to_ids = self.create_token_to_ids_fn(max_length)

    def preprocess_batch(examples):
      x, y = token_to_ids(examples['tokens'])
      result = {'x': x, 'y': y}
      if 'domain_id' in examples:
        result['domain_id'] = examples['domain_id']
      return result

    return preprocess_batch


class StackoverflowTokenizer(DefaultWordTokenizer):
  """FedJAX's Stack Overflow tokenizer.

  FedJAX's ``StackoverflowTokenizer``: ``DefaultWordTokenizer`` of
  ``vocab``, or of the ``default_vocab_size`` most frequent words
  (``default_vocab``, read from ``cache_dir``).

  Args:
    vocab: the words (None: ``default_vocab(default_vocab_size)``).
    default_vocab_size: the words of the default vocabulary.
    num_oov_buckets: OOV ids (TensorFlow's hash of a word picks its bucket).
    cache_dir: where ``stackoverflow.word_count`` is (this project's).
  """

  def __init__(
    self,
    vocab: Optional[List[str]] = None,
    default_vocab_size: Optional[int] = 10000,
    num_oov_buckets: int = 1,
    *,
    cache_dir=None,
  ):
    if vocab is None:
      vocab = default_vocab(default_vocab_size, cache_dir)
    super().__init__(vocab, num_oov_buckets)
