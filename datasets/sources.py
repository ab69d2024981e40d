"""The published files of each data set: name, canonical URL and checksum.

File names and URLs are those FedJAX (``fedjax/datasets/*.py``), TensorFlow
Federated and the CIFAR and char-rnn pages publish; checksums are the
releases' where they are known (CIFAR's MD5 from its page, TFF's CIFAR-100
SHA-256 and size from FedJAX's loader, Tiny Shakespeare's MD5 of
Karpathy's file). ``fetch`` finds a data set's files (see ``files``) or, on
request, downloads them into the cache.
"""

import dataclasses
import lzma
import pathlib
import shutil
from typing import Dict, List, Optional, Tuple

from fedjax_personal.datasets import downloads, files
from fedjax_personal.errors import DataError

_FEDJAX = 'https://storage.googleapis.com/gresearch/fedjax'


@dataclasses.dataclass(frozen=True)
class RemoteFile:
  """One published file.

  Attributes:
    name: its published file name (looked up in --data_dir under this name).
    url: where it is published.
    sha256, md5, size: the release's checksum and size where known.
    decompressed: for an ``.lzma`` file, the name of its decompressed copy
      (kept in the cache; a copy saved by hand is used too).
  """
  name: str
  url: str
  sha256: Optional[str] = None
  md5: Optional[str] = None
  size: Optional[int] = None
  decompressed: Optional[str] = None


def _fedjax(folder: str, name: str) -> RemoteFile:
  return RemoteFile(name, f'{_FEDJAX}/{folder}/{name}')


#: data set -> its files, in the order they are read.
FILES: Dict[str, Tuple[RemoteFile, ...]] = {
    'emnist': tuple(_fedjax('emnist', f'federated_emnist_{s}.sqlite') for s in ('train', 'test')),
    'emnist_digits': tuple(_fedjax('emnist', f'federated_emnist_digitsonly_{s}.sqlite')
                           for s in ('train', 'test')),
    'shakespeare': tuple(_fedjax('shakespeare', f'shakespeare_{s}.sqlite') for s in ('train', 'test')),
    'stackoverflow': tuple(_fedjax('stackoverflow', f'stackoverflow_{s}.sqlite')
                           for s in ('train', 'held_out', 'test'))
                     + (_fedjax('stackoverflow', 'stackoverflow.word_count'),),
    'cifar100': (RemoteFile('cifar100.sqlite.lzma',
                            'https://storage.googleapis.com/tff-datasets-public/cifar100.sqlite.lzma',
                            sha256='23d3916c9caa33395737ee560cc7cb77bbd05fc7b73647ee7be3a7e764172939',
                            size=153019920, decompressed='cifar100.sqlite'),),
    'cifar100_python': (RemoteFile('cifar-100-python.tar.gz',
                                   'https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz',
                                   md5='eb9058c3a382ffc7106e4002c42a8d85', size=169001437),),
    'cifar10': (RemoteFile('cifar-10-python.tar.gz',
                           'https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz',
                           md5='c58f30108f718f92721af3b95e74349a', size=170498071),),
    'tinyshakespeare': (RemoteFile(
        'input.txt', 'https://raw.githubusercontent.com/karpathy/char-rnn/master/data/'
        'tinyshakespeare/input.txt', md5='6fb458f1232090904fb40fe944165e91', size=1115394),),
}

#: Other names a file is accepted under (a local copy saved differently).
ALIASES = {'input.txt': ('tinyshakespeare/input.txt', 'tinyshakespeare.txt')}


def downloadable(dataset: str) -> bool:
  return dataset in FILES


def how_to_get(dataset: str) -> str:
  """The next command for a missing file of ``dataset``."""
  if downloadable(dataset):
    return (f'get it with: python scripts/run_experiment.py --dataset={dataset} --download '
            '(or save it by hand in --data_dir)')
  return manual_instructions(dataset)


def manual_instructions(dataset: str) -> str:
  """How to get the files of a data set that has no download."""
  if dataset.startswith('leaf:'):
    name = dataset[5:]
    return (f"LEAF publishes no ready files: build them with LEAF's own scripts "
            f'(github.com/TalwalkarLab/leaf, data/{name}/preprocess.sh) and put its '
            f'data/{name}/data/train and test folders under --data_dir as leaf/{name}/train '
            f'and leaf/{name}/test')
  return 'put it in --data_dir or $FEDJAX_PERSONAL_DATA'


def _names(f: RemoteFile) -> List[str]:
  return [f.name] + list(ALIASES.get(f.name, ()))


def fetch(dataset: str, data_dir: Optional[str] = None, download: bool = False,
          which: Optional[List[str]] = None, progress: bool = True) -> Dict[str, pathlib.Path]:
  """Paths of a data set's files, downloaded into the cache when asked.

  Args:
    dataset: a key of FILES.
    data_dir: --data_dir (searched first; must exist).
    download: fetch files found nowhere from their URL (else a missing file
      is a one-line MissingDataError naming the --download command).
    which: only these file names (default: all of the data set's files).
    progress: show a progress bar while downloading.

  Returns:
    {published name: path}; an ``.lzma`` file maps to its decompressed copy.

  Raises:
    MissingDataError, DataError (checksum, size, cut connection, offline).
  """
  out = {}
  for f in FILES[dataset]:
    if which is not None and f.name not in which:
      continue
    if f.decompressed:
      done = files.locate(f.decompressed, data_dir)
      if done is not None:
        out[f.name] = done
        continue
    path = files.locate(_names(f), data_dir)
    if path is None:
      if not download:
        files.find_file(f.name, data_dir, how_to_get(dataset))  # raises, naming --download
      path = downloads.download(f, files.cache_dir(), dataset, progress=progress)
    elif f.md5 or f.sha256:
      files.check_digest(path, f.md5, f.sha256)
    out[f.name] = decompress(path, f) if f.decompressed else path
  return out


def decompress(path: pathlib.Path, f: RemoteFile) -> pathlib.Path:
  """The decompressed copy of an ``.lzma`` file, made once in the cache."""
  dest = files.cache_dir() / f.decompressed
  if dest.is_file():
    return dest
  downloads.log(f'decompressing {path} to {dest}')

  def write(tmp):
    try:
      with lzma.open(path, 'rb') as src, open(tmp, 'wb') as out:
        shutil.copyfileobj(src, out, 1 << 20)
    except (lzma.LZMAError, EOFError) as e:
      raise DataError(f'{path}: not a complete LZMA file ({e}); delete it and download it '
                      'again (--download)') from None
  return files.write_atomically(dest, write)
