"""The published files of each data set: name, canonical URL and checksum.

File names and URLs are those FedJAX (``fedjax/datasets/*.py``), TensorFlow
Federated and the CIFAR and char-rnn pages publish; checksums are the
releases' where they are known (CIFAR's MD5 from its page, TFF's CIFAR-100
SHA-256 and size from FedJAX's loader, Tiny Shakespeare's MD5 of
Karpathy's file). ``fetch`` finds a data set's files (see ``local_files``)
or, on request, downloads them into the cache (``download_file``).

A download is written under a temporary name beside its destination and
renamed only once it is complete and its size and checksum (where the
release's are known) match: an interrupted, cut or corrupt download is never
used and leaves nothing behind. Failures are one ``DownloadError`` line
naming the data set, the URL and where to put the file by hand.
"""

import dataclasses
import hashlib
import http.client
import lzma
import os
import pathlib
import shutil
import sys
import tarfile
import urllib.error
import urllib.request
import zipfile
from typing import Dict, List, Optional, Set, Tuple

from tqdm import tqdm

from fedjax_personal.datasets import local_files
from fedjax_personal.errors import DataError

__all__ = [
  'decompress',
  'download_file',
  'DownloadError',
  'extract_member',
  'fetch',
  'fetch_gldv2_images',
  'FILES',
  'GLDV2_BUNDLE',
  'GLDV2_MD5_URL',
  'GLDV2_SHARD_URL',
  'GLDV2_SHARDS',
  'how_to_get',
  'log',
  'manual_instructions',
  'RemoteFile',
]


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
  'emnist': tuple(
    _fedjax('emnist', f'federated_emnist_{s}.sqlite') for s in ('train', 'test')
  ),
  'emnist_digits': tuple(
    _fedjax('emnist', f'federated_emnist_digitsonly_{s}.sqlite')
    for s in ('train', 'test')
  ),
  'shakespeare': tuple(
    _fedjax('shakespeare', f'shakespeare_{s}.sqlite') for s in ('train', 'test')
  ),
  'stackoverflow': tuple(
    _fedjax('stackoverflow', f'stackoverflow_{s}.sqlite')
    for s in ('train', 'held_out', 'test')
  )
  + (_fedjax('stackoverflow', 'stackoverflow.word_count'),),
  'cifar100': (
    RemoteFile(
      'cifar100.sqlite.lzma',
      'https://storage.googleapis.com/tff-datasets-public/cifar100.sqlite.lzma',
      sha256='23d3916c9caa33395737ee560cc7cb77bbd05fc7b73647ee7be3a7e764172939',
      size=153019920,
      decompressed='cifar100.sqlite',
    ),
  ),
  'cifar100_python': (
    RemoteFile(
      'cifar-100-python.tar.gz',
      'https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz',
      md5='eb9058c3a382ffc7106e4002c42a8d85',
      size=169001437,
    ),
  ),
  'cifar10': (
    RemoteFile(
      'cifar-10-python.tar.gz',
      'https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz',
      md5='c58f30108f718f92721af3b95e74349a',
      size=170498071,
    ),
  ),
  # TFF's federated split of Google Landmarks v2 (the seed's gldv2_utils.py).
  'gldv2': (
    RemoteFile(
      'landmarks-user-160k.zip',
      'http://storage.googleapis.com/gresearch/federated-vision-datasets/'
      'landmarks-user-160k.zip',
      md5='53c36bd7d5fc12f927af2820b7e4a57c',
    ),
  ),
  'tinyshakespeare': (
    RemoteFile(
      'input.txt',
      'https://raw.githubusercontent.com/karpathy/char-rnn/master/data/'
      'tinyshakespeare/input.txt',
      md5='6fb458f1232090904fb40fe944165e91',
      size=1115394,
    ),
  ),
}

GLDV2_BUNDLE = 'landmarks-user-160k.zip'
#: GLDv2's training images, in shards (TFF's loader reads all of them).
GLDV2_SHARD_URL = (
  'https://s3.amazonaws.com/google-landmark/train/images_{:03d}.tar'
)
#: Each shard's published MD5 (TFF's gldv2.py fetches it and checks the shard).
GLDV2_MD5_URL = (
  'https://s3.amazonaws.com/google-landmark/md5sum/train/md5.images_{:03d}.txt'
)
GLDV2_SHARDS = 500

#: Other names a file is accepted under (a local copy saved differently).
ALIASES = {'input.txt': ('tinyshakespeare/input.txt', 'tinyshakespeare.txt')}


def downloadable(dataset: str) -> bool:
  """Whether ``dataset`` has published files with URLs (``FILES``)."""
  return dataset in FILES


def how_to_get(dataset: str) -> str:
  """The next command for a missing file of ``dataset``.

  Args:
    dataset: a ``--dataset`` name.

  Returns:
    The command.
  """
  if downloadable(dataset):
    return (
      f'get it with: python scripts/run_experiment.py --dataset={dataset} '
      f'--download '
      '(or save it by hand in --data_dir)'
    )
  return manual_instructions(dataset)


def manual_instructions(dataset: str) -> str:
  """How to get the files of a data set that has no download.

  Args:
    dataset: a ``--dataset`` name.

  Returns:
    The instructions.
  """
  if dataset.startswith('leaf:'):
    name = dataset[5:]
    return (
      f"LEAF publishes no ready files: build them with LEAF's own scripts "
      f'(github.com/TalwalkarLab/leaf, data/{name}/preprocess.sh) and put its '
      f'data/{name}/data/train and test folders under --data_dir as '
      f'leaf/{name}/train '
      f'and leaf/{name}/test'
    )
  if dataset == 'gldv2':
    return (
      "put GLDv2's training JPEGs that federated_train.csv lists in one "
      'folder, '
      'gldv2/images/<image_id>.jpg, under --data_dir (from '
      f'{GLDV2_SHARD_URL.format(0)} ... images_{GLDV2_SHARDS - 1:03d}.tar), or '
      'fetch them with --download (about 500 GB of shards, read one at a time)'
    )
  return 'put it in --data_dir or $FEDJAX_PERSONAL_DATA'


def _names(f: RemoteFile) -> List[str]:
  return [f.name] + list(ALIASES.get(f.name, ()))


def fetch(
  dataset: str,
  data_dir: Optional[str] = None,
  download: bool = False,
  which: Optional[List[str]] = None,
  progress: bool = True,
) -> Dict[str, pathlib.Path]:
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
    # a decompressed copy kept beside the user's files (not the cache's)
    if f.decompressed:
      done = local_files.locate(f.decompressed, data_dir, cache=False)
      if done is not None:
        out[f.name] = done
        continue
    path = local_files.locate(_names(f), data_dir)
    if path is None:
      if not download:
        # raises, naming --download
        local_files.find_file(f.name, data_dir, how_to_get(dataset))
      path = download_file(
        f, local_files.cache_dir(), dataset, progress=progress
      )
    elif f.md5 or f.sha256:
      local_files.check_digest(path, f.md5, f.sha256)
    out[f.name] = decompress(path, f) if f.decompressed else path
  return out


def decompress(path: pathlib.Path, f: RemoteFile) -> pathlib.Path:
  """The decompressed copy of an ``.lzma`` file, made once in the cache
  (``local_files.derived_dir``).

  Args:
    path: the ``.lzma`` file.
    f: its ``RemoteFile`` (the decompressed name).

  Returns:
    The decompressed file's path.
  """
  if not f.decompressed:
    raise ValueError(f'{f.name} has no decompressed copy')
  dest = local_files.derived_dir('decompressed', path) / f.decompressed
  if dest.is_file():
    return dest
  log(f'decompressing {path} to {dest}')

  def write(tmp):
    try:
      with lzma.open(path, 'rb') as src, open(tmp, 'wb') as out:
        shutil.copyfileobj(src, out, 1 << 20)
    except (lzma.LZMAError, EOFError) as e:
      raise DataError(
        f'{path}: not a complete LZMA file ({e}); delete it and download it '
        'again (--download)'
      ) from None

  try:
    return local_files.write_atomically(dest, write)
  except BaseException:
    # nothing of a failed copy is kept
    for folder in (
      dest.parent,
      dest.parent.parent,
    ):
      try:
        folder.rmdir()
      except OSError:  # not empty: other copies
        break
    raise


def extract_member(
  archive: pathlib.Path, suffix: str, dest: pathlib.Path
) -> pathlib.Path:
  """The member of a ZIP archive whose name ends with ``suffix``, copied once
  to ``dest`` (e.g. ``federated_train.csv`` of TFF's GLDv2 bundle).

  Args:
    archive: the ZIP file.
    suffix: the member's name ends with it.
    dest: where the copy goes.

  Returns:
    ``dest``.
  """
  if dest.is_file():
    return dest

  def write(tmp):
    try:
      with zipfile.ZipFile(archive) as z:
        names = [n for n in z.namelist() if n.endswith(suffix)]
        if not names:
          raise DataError(
            f'{archive}: holds no {suffix} (it holds {z.namelist()[:4]})'
          )
        with z.open(names[0]) as src, open(tmp, 'wb') as out:
          shutil.copyfileobj(src, out, 1 << 20)
    except (zipfile.BadZipFile, EOFError, OSError) as e:
      raise DataError(
        f'{archive}: not a complete ZIP archive ({e}); delete it and download '
        f'it '
        'again (--download)'
      ) from None

  return local_files.write_atomically(dest, write)


def _gldv2_md5(shard: int) -> str:
  """Shard ``shard``'s MD5 as GLDv2 publishes it (``md5.images_NNN.txt``:
  the hex digest, then the file name), fetched as TFF's loader does."""
  url = GLDV2_MD5_URL.format(shard)
  path = download_file(
    RemoteFile(os.path.basename(url), url),
    local_files.cache_dir(),
    'gldv2',
    progress=False,
  )
  try:
    words = path.read_text(errors='replace').split()
  finally:
    path.unlink(missing_ok=True)
  if (
    not words
    or len(words[0]) != 32
    or any(c not in '0123456789abcdef' for c in words[0].lower())
  ):
    raise DataError(
      f'gldv2: {url} holds no MD5 ({" ".join(words[:2])[:60]!r}); the shard is '
      f'not '
      'fetched unchecked: run --download again later'
    )
  return words[0].lower()


def fetch_gldv2_images(
  wanted: Set[str], folder: pathlib.Path, progress: bool = True
) -> None:
  """Downloads GLDv2's training shards one at a time, keeps the JPEGs in
  ``wanted`` (image ids) as ``folder/<id>.jpg`` and deletes each shard; stops
  once every wanted image is there. A shard whose images are kept is noted in
  ``folder/.shards_done``, so an interrupted download continues where it
  stopped.

  Args:
    wanted: the image ids needed.
    folder: where the JPEGs go.
    progress: print progress lines.

  Returns:
    None.
  """
  folder.mkdir(parents=True, exist_ok=True)
  done_file = folder / '.shards_done'
  done = set(done_file.read_text().split()) if done_file.is_file() else set()
  missing = {i for i in wanted if not (folder / f'{i}.jpg').is_file()}
  for s in range(GLDV2_SHARDS):
    if not missing:
      return
    if str(s) in done:
      continue
    url = GLDV2_SHARD_URL.format(s)
    shard = download_file(
      RemoteFile(os.path.basename(url), url, md5=_gldv2_md5(s)),
      local_files.cache_dir(),
      'gldv2',
      progress=progress,
    )
    try:
      with tarfile.open(shard) as tar:
        for member in tar:
          image_id = os.path.basename(member.name)[: -len('.jpg')]
          if (
            member.isfile()
            and member.name.endswith('.jpg')
            and image_id in missing
          ):
            src = tar.extractfile(member)
            if src is None:
              continue
            data = src.read()
            local_files.write_atomically(
              folder / f'{image_id}.jpg', lambda tmp: tmp.write_bytes(data)
            )
            missing.discard(image_id)
    except (tarfile.TarError, EOFError) as e:
      raise DataError(
        f'{shard}: not a complete tar archive ({e}); delete it and run '
        f'--download '
        'again'
      ) from None
    finally:
      shard.unlink(missing_ok=True)
    with open(done_file, 'a') as f:
      f.write(f'{s}\n')
  if missing:
    raise DataError(
      f'gldv2: {len(missing):,} images that federated_train.csv lists are in '
      f'none '
      f'of the {GLDV2_SHARDS} shards (e.g. {sorted(missing)[0]})'
    )


# -- downloads
# ------------------------------------------------------------------

#: Seconds without a byte before a download is given up.
TIMEOUT = 60


class DownloadError(DataError):
  """A download that failed or delivered a wrong file (exit status 2)."""


def log(text: str) -> None:
  """A line on stderr, flushed (download progress).

  Args:
    text: the line.

  Returns:
    None.
  """
  print(text, file=sys.stderr, flush=True)


def download_file(
  remote,
  dest_dir: pathlib.Path,
  dataset: str,
  progress: bool = True,
  timeout: float = TIMEOUT,
) -> pathlib.Path:
  """Fetches ``remote`` (a ``RemoteFile``) into ``dest_dir/remote.name``.

  Args:
    remote: the file's ``RemoteFile``.
    dest_dir: the folder it goes to.
    dataset: the data set (named in messages).
    progress: print progress lines.
    timeout: seconds to wait for the server.

  Returns:
    The path of the complete, checked file.

  Raises:
    DownloadError: offline, refused (HTTP error), cut mid-file, or a size or
      checksum that differs from the release's.
  """
  dest = pathlib.Path(dest_dir) / remote.name
  by_hand = (
    f'without network, save {remote.url} as {remote.name} in --data_dir '
    f'(or $FEDJAX_PERSONAL_DATA) by hand'
  )
  log(f'downloading {dataset}: {remote.url} -> {dest}')

  def write(tmp):
    try:
      _fetch(remote, tmp, progress, timeout)
    except DownloadError as e:
      raise DownloadError(
        f'{dataset}: {e}; nothing was kept; {by_hand}'
      ) from None
    except urllib.error.HTTPError as e:
      raise DownloadError(
        f'{dataset}: {remote.url} answered HTTP {e.code} ({e.reason}); nothing '
        f'was kept; {by_hand}'
      ) from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
      reason = getattr(e, 'reason', None) or e
      raise DownloadError(
        f'{dataset}: download of {remote.url} failed ({reason}); nothing was '
        f'kept; {by_hand}'
      ) from None

  return local_files.write_atomically(dest, write)


def _fetch(remote, tmp: pathlib.Path, progress: bool, timeout: float) -> None:
  """Streams the URL into ``tmp``, then checks its length and checksums."""
  md5, sha = hashlib.md5(), hashlib.sha256()
  with urllib.request.urlopen(remote.url, timeout=timeout) as r:
    announced = r.headers.get('Content-Length')
    total = int(announced) if announced else remote.size
    bar = _bar(total, remote.name, progress)
    written = 0
    try:
      with open(tmp, 'wb') as out:
        while True:
          block = r.read(1 << 20)
          if not block:
            break
          out.write(block)
          md5.update(block)
          sha.update(block)
          written += len(block)
          bar.update(len(block))
    finally:
      bar.close()
  if announced and written != int(announced):
    raise DownloadError(
      f'{remote.url}: connection cut after {written} of {announced} bytes'
    )
  if remote.size and written != remote.size:
    raise DownloadError(
      f'{remote.url}: {written} bytes, the release has {remote.size}'
    )
  for name, want, got in (
    ('md5', remote.md5, md5),
    ('sha256', remote.sha256, sha),
  ):
    if want and got.hexdigest() != want:
      raise DownloadError(
        f"{remote.url}: {name} {got.hexdigest()} differs from the release's "
        f'{want}'
      )


def _bar(total, name, enabled):
  return tqdm(
    total=total,
    unit='B',
    unit_scale=True,
    desc=name,
    disable=not enabled,
    file=sys.stderr,
    leave=False,
  )
