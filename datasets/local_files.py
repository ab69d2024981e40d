"""Where data files are found, cached and checked.

A data file is looked up, in order, in ``--data_dir`` (which must exist), the
directory named by ``$FEDJAX_PERSONAL_DATA``, the package's embedded data (MNIST
10k), FedJAX's own download folder (``~/.cache/fedjax``: a FedJAX user's files,
read as they are), and the cache folder (``$FEDJAX_PERSONAL_CACHE``, by default
``~/.cache/fedjax_personal``) where ``--download`` saves files and decoded
copies are kept. Each published file is found under its published name, so a
file saved by hand in ``--data_dir`` is used as it is.
"""

import hashlib
import os
import pathlib
import sys
from typing import List, Optional, Sequence, Union

from fedjax_personal.errors import DataError

__all__ = [
  'cache_dir',
  'check_data_dir',
  'check_digest',
  'content_digest',
  'derived_dir',
  'digest',
  'reads_of',
  'find_file',
  'locate',
  'MissingDataError',
  'not_found',
  'fedjax_cache_dir',
  'PACKAGE_DATA',
  'search_dirs',
  'sha256_file',
  'write_atomically',
]


PACKAGE_DATA = pathlib.Path(__file__).parent / 'data'


class MissingDataError(DataError, FileNotFoundError):
  """A data file found in none of the search places (exit status 2)."""


def cache_dir(create: bool = True) -> pathlib.Path:
  """The cache folder: downloads and decoded copies
  (``$FEDJAX_PERSONAL_CACHE``).

  Args:
    create: make the folder when missing.

  Returns:
    The folder.
  """
  d = pathlib.Path(
    os.environ.get('FEDJAX_PERSONAL_CACHE') or '~/.cache/fedjax_personal'
  ).expanduser()
  if create:
    try:
      d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise DataError(
        f'{d}: cannot create the cache folder ({e.strerror}); set '
        'FEDJAX_PERSONAL_CACHE to a writable folder'
      ) from None
  return d


def fedjax_cache_dir() -> pathlib.Path:
  """FedJAX's own download folder (its ``downloads.default_cache_dir``:
  ``~/.cache/fedjax``, ``/tmp/.cache/fedjax`` on Colab), where a FedJAX
  user's files already are; searched, never written.

  Returns:
    The folder.
  """
  base = '/tmp' if 'google.colab' in sys.modules else os.path.expanduser('~')
  return pathlib.Path(base) / '.cache' / 'fedjax'


def check_data_dir(data_dir: Optional[str]) -> None:
  """``--data_dir`` must name an existing folder (a typo is never ignored).

  Args:
    data_dir: ``--data_dir`` (None: not given).

  Returns:
    None.
  """
  if data_dir and not pathlib.Path(data_dir).expanduser().is_dir():
    raise DataError(
      f'{data_dir}: --data_dir is not a folder (no such directory)'
    )


def search_dirs(data_dir: Optional[str] = None) -> List[pathlib.Path]:
  """The folders searched for data files, in order.

  Args:
    data_dir: ``--data_dir`` (first when given).

  Returns:
    The folders.
  """
  check_data_dir(data_dir)
  dirs = []
  if data_dir:
    dirs.append(pathlib.Path(data_dir).expanduser())
  if os.environ.get('FEDJAX_PERSONAL_DATA'):
    dirs.append(pathlib.Path(os.environ['FEDJAX_PERSONAL_DATA']).expanduser())
  return dirs + [PACKAGE_DATA, fedjax_cache_dir(), cache_dir(create=False)]


def locate(
  names: Union[str, Sequence[str]],
  data_dir: Optional[str] = None,
  cache: bool = True,
) -> Optional[pathlib.Path]:
  """The first of ``names`` (relative paths) found in the search folders
  (the cache last, or not at all with ``cache=False``: a copy the user keeps,
  never one the cache made from a source), or None.

  Args:
    names: relative paths, tried in order.
    data_dir: ``--data_dir``, searched first.
    cache: search the cache too.

  Returns:
    The path, or None.
  """
  names = [names] if isinstance(names, str) else list(names)
  dirs = search_dirs(data_dir)
  for d in dirs if cache else dirs[:-1]:
    for name in names:
      if (d / name).is_file():
        return d / name
  return None


def find_file(
  names: Union[str, Sequence[str]],
  data_dir: Optional[str] = None,
  hint: str = 'put it in --data_dir or $FEDJAX_PERSONAL_DATA',
) -> pathlib.Path:
  """Path of a data file (the first of ``names`` found).

  Args:
    names: the file's published name(s), relative paths.
    data_dir: ``--data_dir``, searched first.
    hint: the next command a missing file's error names.

  Returns:
    The path.

  Raises:
    MissingDataError naming the file, the folders searched and ``hint`` (the
    command that gets it: ``sources.how_to_get``).
  """
  path = locate(names, data_dir)
  if path is not None:
    return path
  raise not_found(names if isinstance(names, str) else names[0], data_dir, hint)


def not_found(
  what: str, data_dir: Optional[str], hint: str
) -> MissingDataError:
  """The one-line error for ``what`` found in none of the search folders.

  Args:
    what: the file(s) looked for.
    data_dir: ``--data_dir``.
    hint: the next command.

  Returns:
    The ``MissingDataError``.
  """
  return MissingDataError(
    f'{what}: not found in '
    + ', '.join(str(d) for d in search_dirs(data_dir))
    + f'; {hint}'
  )


def digest(path, algorithm: str = 'sha256', chunk: int = 1 << 20) -> str:
  """Hex digest of a file, read in chunks.

  Args:
    path: the file.
    algorithm: a ``hashlib`` name.
    chunk: bytes read at a time.

  Returns:
    The hex digest.
  """
  h = hashlib.new(algorithm)
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(chunk), b''):
      h.update(block)
  return h.hexdigest()


def sha256_file(path) -> str:
  """The SHA-256 of a file's content (hex).

  Args:
    path: the file.

  Returns:
    64 hex digits.
  """
  return digest(path, 'sha256')


def content_digest(path) -> str:
  """The SHA-256 of a file's bytes, computed once per version of the file.

  A version is the file's path, inode, size, modification and status-change
  times: the change time moves with every write, also one that keeps the
  size and sets the modification time back, so an edited file is hashed
  again, and an unchanged one is not (the digest is kept in the cache's
  ``digests/``). Stores are keyed by it: what a source holds, not its name.
  A folder (GLDv2's images) stands for its files: the digest of their
  names, sizes and times (each file's change time included).

  Args:
    path: a file or folder.

  Returns:
    64 hex digits.
  """
  if os.path.isdir(path):
    h = hashlib.sha256()
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
      st = entry.stat()
      h.update(
        f'{entry.name}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}\n'.encode()
      )
    return h.hexdigest()
  st = os.stat(path)
  version = (
    f'{os.path.realpath(path)}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|'
    f'{st.st_ctime_ns}'
  )
  kept_at = (
    cache_dir() / 'digests' / hashlib.sha256(version.encode()).hexdigest()[:32]
  )
  try:
    kept = kept_at.read_text().split()
    if len(kept) == 2 and kept[1] == version.replace(' ', '%20'):
      return kept[0]
  except OSError:
    pass
  got = sha256_file(path)
  try:
    write_atomically(
      kept_at,
      lambda tmp: tmp.write_text(f'{got} {version.replace(" ", "%20")}\n'),
    )
  except OSError:  # a read-only cache: hashed again next time
    pass
  return got


def derived_dir(kind: str, source) -> pathlib.Path:
  """The cache's folder for what is made from ``source`` (``kind``: a
  decompressed copy, an extracted member), named by the source's content
  (``content_digest``): another file of the same name never gets this one's
  copy. Made if missing.

  Args:
    kind: what is made (names the folder).
    source: the file it is made from.

  Returns:
    The folder.
  """
  folder = cache_dir() / kind / content_digest(source)[:16]
  folder.mkdir(parents=True, exist_ok=True)
  return folder


def check_digest(
  path, md5: Optional[str] = None, sha256: Optional[str] = None
) -> None:
  """Raises DataError naming the file when its checksum differs from the
  release's.

  Args:
    path: the file.
    md5: the release's MD5 (None: not checked).
    sha256: the release's SHA-256 (None: not checked).

  Returns:
    None.
  """
  for algorithm, want in (('md5', md5), ('sha256', sha256)):
    if want:
      got = digest(path, algorithm)
      if got != want:
        raise DataError(
          f"{path}: {algorithm} {got} differs from the release's {want} "
          f'(corrupted, '
          'truncated or not the original file)'
        )


def write_atomically(dest: pathlib.Path, write) -> pathlib.Path:
  """Calls ``write(tmp_path)`` and renames the result to ``dest`` only when it
  finished: a reader never sees a partial file, and nothing is left behind
  when ``write`` fails.

  Args:
    dest: the final path.
    write: ``write(tmp_path)`` writes the file.

  Returns:
    ``dest``.
  """
  dest.parent.mkdir(parents=True, exist_ok=True)
  tmp = dest.with_name(f'.{dest.name}.{os.getpid()}.partial')
  try:
    write(tmp)
    os.replace(tmp, dest)
  finally:
    if tmp.exists():
      tmp.unlink()
  return dest


def reads_of(paths, named=()) -> List[List[str]]:
  """``[[path, content digest]]`` of the data files among ``paths`` (not
  Python's or a package's sources, not this library's cache, not the
  system's), less those in ``named`` (the reader's own ``files``).

  Args:
    paths: absolute paths (``user_reads.recording``).
    named: the files the reader named.

  Returns:
    Sorted pairs.
  """
  skip = {os.path.abspath(os.fspath(p)) for p in named}
  roots = tuple(
    {
      sys.prefix,
      sys.base_prefix,
      os.path.abspath(str(cache_dir(create=False))),
      '/proc',
      '/sys',
      '/dev',
      '/etc',
      '/usr',
    }
  )
  out = []
  for p in sorted(paths):
    if (
      p in skip
      or p.startswith(roots)
      or p.endswith(('.py', '.pyc', '.so'))
      or not os.path.isfile(p)
    ):
      continue
    out.append([p, content_digest(p)])
  return out
