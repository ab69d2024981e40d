"""Downloads of published data files: progress, checksum, atomic rename.

A file is written under a temporary name beside its destination and renamed
only once it is complete and its size and checksum (where the release's are
known) match: an interrupted, cut or corrupt download is never used and
leaves nothing behind. Failures are one ``DownloadError`` line naming the data
set, the URL and where to put the file by hand.
"""

import hashlib
import http.client
import pathlib
import sys
import urllib.error
import urllib.request

from fedjax_personal.datasets import files
from fedjax_personal.errors import DataError

__all__ = ['download', 'DownloadError', 'log']


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


def download(remote, dest_dir: pathlib.Path, dataset: str, progress: bool = True,
             timeout: float = TIMEOUT) -> pathlib.Path:
  """Fetches ``remote`` (a sources.RemoteFile) into ``dest_dir/remote.name``.

  Args:
    remote: the file's ``sources.RemoteFile``.
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
  by_hand = (f'without network, save {remote.url} as {remote.name} in --data_dir '
             f'(or $FEDJAX_PERSONAL_DATA) by hand')
  log(f'downloading {dataset}: {remote.url} -> {dest}')

  def write(tmp):
    try:
      _fetch(remote, tmp, progress, timeout)
    except DownloadError as e:
      raise DownloadError(f'{dataset}: {e}; nothing was kept; {by_hand}') from None
    except urllib.error.HTTPError as e:
      raise DownloadError(f'{dataset}: {remote.url} answered HTTP {e.code} ({e.reason}); nothing '
                          f'was kept; {by_hand}') from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
      reason = getattr(e, 'reason', None) or e
      raise DownloadError(f'{dataset}: download of {remote.url} failed ({reason}); nothing was '
                          f'kept; {by_hand}') from None
  return files.write_atomically(dest, write)


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
    raise DownloadError(f'{remote.url}: connection cut after {written} of {announced} bytes')
  if remote.size and written != remote.size:
    raise DownloadError(f'{remote.url}: {written} bytes, the release has {remote.size}')
  for name, want, got in (('md5', remote.md5, md5), ('sha256', remote.sha256, sha)):
    if want and got.hexdigest() != want:
      raise DownloadError(f"{remote.url}: {name} {got.hexdigest()} differs from the release's "
                          f'{want}')


def _bar(total, name, enabled):
  from tqdm import tqdm
  return tqdm(total=total, unit='B', unit_scale=True, desc=name, disable=not enabled,
              file=sys.stderr, leave=False)
