"""Data sets read whole into memory: MNIST (embedded), scikit-learn's
digits, Tiny Shakespeare by speaking role, and FedProx's synthetic data.

Files are found by ``local_files.find_file`` (--data_dir, $FEDJAX_PERSONAL_DATA,
the package, the cache).
"""

import dataclasses
import gzip
import re
import zlib
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from fedjax_personal.datasets import local_files, sources
from fedjax_personal.datasets.local_files import PACKAGE_DATA, find_file  # noqa: F401 (re-exported)
from fedjax_personal.datasets.options import DataOptions
from fedjax_personal.errors import ConfigError, DataError
from fedjax_personal.hparams import hparam

__all__ = [
  'check_labels',
  'load_digits',
  'load_mnist',
  'load_tinyshakespeare',
  'MNIST_MD5',
  'parse_shakespeare_roles',
  'read_idx',
  'synthetic',
  'SyntheticOptions',
]


_IDX_DTYPES: Dict[int, Any] = {
  0x08: np.uint8,
  0x09: np.int8,
  0x0B: '>i2',
  0x0C: '>i4',
  0x0D: '>f4',
  0x0E: '>f8',
}


def read_idx(path) -> np.ndarray:
  """Reads an IDX file (optionally gzipped), the format of the MNIST release.

  Args:
    path: the file.

  Returns:
    The array.

  Raises:
    DataError naming the file: unreadable gzip, bad magic, unknown dtype,
    or a size that does not match the header.
  """
  opener = gzip.open if str(path).endswith('.gz') else open
  try:
    with opener(path, 'rb') as f:
      raw = f.read()
  except (OSError, EOFError, zlib.error) as e:
    raise DataError(f'{path}: unreadable ({type(e).__name__}: {e})') from None
  if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
    raise DataError(f'{path}: not an IDX file (bad magic number)')
  ndim = raw[3]
  if len(raw) < 4 + 4 * ndim:
    raise DataError(f'{path}: truncated IDX header')
  shape = tuple(
    int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], 'big') for i in range(ndim)
  )
  dtype = np.dtype(_IDX_DTYPES[raw[2]])
  expected = int(np.prod(shape)) * dtype.itemsize
  if len(raw) - 4 - 4 * ndim != expected:
    raise DataError(
      f'{path}: header says {shape} values, the file holds '
      f'{(len(raw) - 4 - 4 * ndim) // dtype.itemsize}'
    )
  return np.frombuffer(raw, dtype=dtype, offset=4 + 4 * ndim).reshape(shape)


def check_labels(
  path, labels: np.ndarray, num_images: int, num_classes: int
) -> None:
  """One label per image, each in [0, num_classes).

  Args:
    path: the labels' file (named in errors).
    labels: the labels.
    num_images: the images they label.
    num_classes: the classes.

  Returns:
    None.
  """
  if len(labels) != num_images:
    raise DataError(f'{path}: {len(labels)} labels for {num_images} images')
  if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
    raise DataError(
      f'{path}: labels outside [0, {num_classes}) '
      f'(min {labels.min()}, max {labels.max()})'
    )


#: MD5 of the MNIST release's files (LeCun et al.), checked whenever they are
#: read.
MNIST_MD5 = {
  't10k-images-idx3-ubyte.gz': '9fb629c4189551a2d022fa330f9573f3',
  't10k-labels-idx1-ubyte.gz': 'ec29112dd5afa0611ce80d1b7f02629c',
}


def checked_file(relpath, md5: str, data_dir: Optional[str] = None):
  """``find_file`` plus an MD5 check of the file's bytes.

  Raises:
    DataError naming the file when its checksum differs.
  """
  path = find_file(relpath, data_dir)
  local_files.check_digest(path, md5=md5)
  return path


def load_mnist(
  data_dir: Optional[str] = None,
) -> Tuple[np.ndarray, np.ndarray, int]:
  """MNIST 10k test split (embedded in the package): uint8 [10000, 28, 28, 1].

  Args:
    data_dir: a folder holding ``mnist_t10k/`` (None: the package's copy).

  Returns:
    ``(x, y, 10)``.
  """
  x = read_idx(
    checked_file(
      'mnist_t10k/t10k-images-idx3-ubyte.gz',
      MNIST_MD5['t10k-images-idx3-ubyte.gz'],
      data_dir,
    )
  )
  labels = checked_file(
    'mnist_t10k/t10k-labels-idx1-ubyte.gz',
    MNIST_MD5['t10k-labels-idx1-ubyte.gz'],
    data_dir,
  )
  y = read_idx(labels)
  check_labels(labels, y, len(x), 10)
  return x[..., None], y.astype(np.int32), 10


def load_digits() -> Tuple[np.ndarray, np.ndarray, int]:
  """scikit-learn's 1,797 8x8 digits, float32 in [0, 1], [N, 8, 8, 1].

  Returns:
    ``(x, y, 10)``.
  """
  from sklearn.datasets import load_digits as _ld

  d = _ld()
  return (
    (d.images / 16.0).astype(np.float32)[..., None],
    d.target.astype(np.int32),
    10,
  )


def parse_shakespeare_roles(text: str) -> Dict[str, str]:
  """Speeches grouped by speaking role.

  The text is a sequence of blocks separated by blank lines; a block's first
  line, ending in ':', names the role (verse lines may also end in ':', so
  only a block's first line is read as a role).

  Args:
    text: the play's text.

  Returns:
    ``{role: speech}``.
  """
  roles: Dict[str, List[str]] = {}
  for block in re.split(r'\n\s*\n', text):
    lines = block.strip('\n').split('\n')
    if len(lines) < 2 or not lines[0].endswith(':'):
      continue
    roles.setdefault(lines[0][:-1].strip(), []).append('\n'.join(lines[1:]))
  return {r: '\n'.join(s) for r, s in roles.items()}


def shakespeare_vocab(text: str) -> str:
  """Tiny Shakespeare's character vocabulary: the text's characters, sorted."""
  return ''.join(sorted(set(text)))


def load_tinyshakespeare(
  num_clients: int,
  seq_len: int = 80,
  min_chars: int = 1000,
  max_sequences: Optional[int] = None,
  data_dir: Optional[str] = None,
  text: Optional[str] = None,
  download: bool = False,
):
  """Tiny Shakespeare (Karpathy's ``input.txt``) split by speaking role.

  Each role with at least ``min_chars`` characters of speech is a client
  (the ``num_clients`` longest are kept); its speech is cut into consecutive
  windows of ``seq_len + 1`` characters: x = window[:-1], y = window[1:]
  (next-character prediction, as LEAF's Shakespeare).

  Args:
    num_clients: roles kept (the longest).
    seq_len: characters per row.
    min_chars: the least speech a role needs.
    max_sequences: rows per role at most (None: all).
    data_dir: where ``input.txt`` is.
    text: the text itself (None: read the file).

  Returns:
    (client_x, client_y, vocab): per-client int32 arrays [n_i, seq_len].
  """
  if text is None:
    # MD5 checked
    path = sources.fetch('tinyshakespeare', data_dir, download)['input.txt']
    try:
      text = path.read_bytes().decode('utf-8')
    except UnicodeDecodeError as e:
      # unreachable after the checksum; kept for other files
      raise DataError(
        f'{path}: not UTF-8 text ({e.reason} at byte {e.start})'
      ) from None
  vocab = shakespeare_vocab(text)
  lookup = {ch: i for i, ch in enumerate(vocab)}
  roles = parse_shakespeare_roles(text)
  eligible = sorted(
    (r for r, s in roles.items() if len(s) >= min_chars),
    key=lambda r: (-len(roles[r]), r),
  )
  if num_clients > len(eligible):
    raise ConfigError(
      'num_clients',
      f'shakespeare has {len(eligible)} roles with >= {min_chars} characters; '
      f'num_clients={num_clients} is too many',
    )
  xs, ys = [], []
  for r in eligible[:num_clients]:
    ids = np.array([lookup[ch] for ch in roles[r]], np.int32)
    n = (len(ids) - 1) // seq_len
    if max_sequences:
      n = min(n, max_sequences)
    w = ids[: n * seq_len + 1]
    xs.append(np.stack([w[k * seq_len : (k + 1) * seq_len] for k in range(n)]))
    ys.append(
      np.stack([w[k * seq_len + 1 : (k + 1) * seq_len + 1] for k in range(n)])
    )
  return xs, ys, vocab


@dataclasses.dataclass(frozen=True)
class SyntheticOptions(DataOptions):
  """Synthetic(alpha, beta)'s options (Li et al., FedProx)."""

  synthetic_alpha: float = hparam(
    1.0,
    "synthetic: Synthetic(alpha, beta)'s model "
    'heterogeneity alpha (Li et al., FedProx). As in their '
    'generator, u_k ~ N(0, alpha) shifts every entry of W_k and '
    "b_k alike, hence every class's logit alike: no label "
    'changes, so the command has no flag for it.',
    minimum=0,
    maximum=1e4,
    command=False,
  )
  synthetic_beta: float = hparam(
    1.0,
    "synthetic: Synthetic(alpha, beta)'s data heterogeneity beta.",
    minimum=0,
    maximum=1e4,
  )
  synthetic_max_examples: int = hparam(
    1000,
    "synthetic: a client's examples at most (of its "
    "lognormal(4, 2) + 50); 0: no cap, as FedProx's "
    'generator.',
    minimum=0,
  )


def synthetic(
  num_clients: int,
  alpha: float,
  beta: float,
  rng: np.random.Generator,
  dim: int = 60,
  num_classes: int = 10,
  iid: bool = False,
  max_examples: int = 1000,
):
  """Synthetic(alpha, beta) of Li et al. (FedProx, MLSys 2020).

  Client k: u_k ~ N(0, alpha), W_k ~ N(u_k, 1) [C x d], b_k ~ N(u_k, 1);
  B_k ~ N(0, beta), v_k ~ N(B_k, 1) [d]; x ~ N(v_k, Sigma) with
  Sigma_jj = j^-1.2; y = argmax(W_k x + b_k). Sizes n_k = lognormal(4, 2) + 50
  (capped at ``max_examples``, 1,000 by default, to bound padding; 0: no cap,
  as litian96/FedProx's ``generate_synthetic.py``). ``iid`` uses one shared
  W, b, v.

  Args:
    num_clients: clients.
    alpha: model heterogeneity.
    beta: data heterogeneity.
    rng: the generator.
    dim: d, the features.
    num_classes: C.
    iid: one shared W, b, v.
    max_examples: the sizes' cap (0: none).

  Returns:
    (client_x float32 [n_k, d], client_y int32 [n_k]) lists.
  """
  for name, value in (('synthetic_alpha', alpha), ('synthetic_beta', beta)):
    if value < 0:
      raise ConfigError(name, f'must be >= 0, got {value}')
  sizes = rng.lognormal(4, 2, num_clients).astype(int) + 50
  sizes = np.minimum(sizes, max_examples) if max_examples else sizes
  sigma = np.diag(np.arange(1, dim + 1, dtype=np.float64) ** -1.2)
  w_glob, b_glob = (
    rng.normal(0, 1, (num_classes, dim)),
    rng.normal(0, 1, num_classes),
  )
  xs, ys = [], []
  for k in range(num_clients):
    if iid:
      w, b, v = w_glob, b_glob, np.zeros(dim)
    else:
      u = rng.normal(0, np.sqrt(alpha))
      w, b = rng.normal(u, 1, (num_classes, dim)), rng.normal(u, 1, num_classes)
      v = rng.normal(rng.normal(0, np.sqrt(beta)), 1, dim)
    x = rng.multivariate_normal(v, sigma, sizes[k])
    xs.append(x.astype(np.float32))
    ys.append(np.argmax(x @ w.T + b, axis=1).astype(np.int32))
  return xs, ys


def synthetic_clients(num_clients: int, rng: np.random.Generator, options):
  """FedProx's Synthetic(alpha, beta) clients (``synthetic``) from the data
  set's options: the ``Pool`` reader of ``--dataset=synthetic``.

  Args:
    num_clients: the clients.
    rng: the generator that draws them.
    options: its ``SyntheticOptions``.

  Returns:
    ``([x_i], [y_i], 10)``.
  """
  xs, ys = synthetic(
    num_clients,
    options.synthetic_alpha,
    options.synthetic_beta,
    rng,
    max_examples=options.synthetic_max_examples,
  )
  return xs, ys, 10


def tinyshakespeare_clients(
  num_clients: int,
  options,
  data_dir: Optional[str] = None,
  download: bool = False,
  text: Optional[str] = None,
):
  """Tiny Shakespeare's roles as clients (``load_tinyshakespeare``) at the
  options' sequence length: the ``Pool`` reader of
  ``--dataset=tinyshakespeare``.

  Args:
    num_clients: the clients.
    options: its ``TextOptions``.
    data_dir: where ``input.txt`` is.
    download: fetch it when missing.
    text: the text itself (TFDS's), instead of the file.

  Returns:
    ``([x_i], [y_i], the vocabulary's size)``.
  """
  xs, ys, vocab = load_tinyshakespeare(
    num_clients,
    options.sequence_length,
    data_dir=data_dir,
    text=text,
    download=download,
  )
  return xs, ys, len(vocab)
