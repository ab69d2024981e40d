"""The downloader against a real socket: a bounded HTTP server on 127.0.0.1
that stops by itself. Success and cache reuse, checksum mismatch, a
connection cut mid-file, 404, a truncated archive, offline; nothing partial
is ever left or used."""

import dataclasses
import hashlib
import http.server
import os
import subprocess
import sys
import threading

import made_files
import numpy as np
import pytest

from fedjax_personal.datasets import DataConfig, load_federated, sources
from fedjax_personal.datasets.sources import DownloadError
from fedjax_personal.errors import DataError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Server:
  """Serves ``routes`` {path: (status, body, cut_after)} on 127.0.0.1 for at
  most ``max_requests`` requests or ``seconds``, whichever comes first."""

  def __init__(self, routes, max_requests=20, seconds=60):
    self.routes, self.hits = routes, []
    outer = self

    class Handler(http.server.BaseHTTPRequestHandler):
      def do_GET(self):
        outer.hits.append(self.path)
        status, body, cut = outer.routes.get(
          self.path, (404, b'not found', None)
        )
        self.send_response(status)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body if cut is None else body[:cut])
        if cut is not None:
          self.wfile.flush()
          self.connection.close()

      def log_message(self, *args):
        pass

    self.httpd = http.server.HTTPServer(('127.0.0.1', 0), Handler)
    self.httpd.timeout = 1
    self.url = f'http://127.0.0.1:{self.httpd.server_port}'
    self._max, self._stop = max_requests, threading.Event()
    self._thread = threading.Thread(target=self._serve, daemon=True)
    self._timer = threading.Timer(seconds, self._stop.set)

  def _serve(self):
    while not self._stop.is_set() and len(self.hits) < self._max:
      self.httpd.handle_request()

  def __enter__(self):
    self._timer.start()
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._timer.cancel()
    self._thread.join(5)
    self.httpd.server_close()


@pytest.fixture
def cache(tmp_path, monkeypatch):
  monkeypatch.setenv('FEDJAX_PERSONAL_CACHE', str(tmp_path / 'cache'))
  monkeypatch.delenv('FEDJAX_PERSONAL_DATA', raising=False)
  return tmp_path / 'cache'


def _serve_emnist(tmp_path, server, monkeypatch, checksum=True, **override):
  """EMNIST's two files served at the server; FILES points there (with the
  served files' true SHA-256 unless overridden)."""
  made = tmp_path / 'made'
  made.mkdir(exist_ok=True)
  made_files.write_emnist(made, np.random.default_rng(0), [4, 3], [2, 2])
  files = []
  for f in sources.FILES['emnist']:
    body = (made / f.name).read_bytes()
    server.routes[f'/{f.name}'] = override.get(f.name, (200, body, None))
    files.append(
      dataclasses.replace(
        f,
        url=f'{server.url}/{f.name}',
        sha256=hashlib.sha256(body).hexdigest() if checksum else None,
      )
    )
  monkeypatch.setitem(sources.FILES, 'emnist', tuple(files))


def _leftovers(folder):
  return [p.name for p in folder.iterdir()] if folder.exists() else []


def test_download_then_cache_reuse(tmp_path, cache, monkeypatch):
  with _Server({}) as server:
    _serve_emnist(tmp_path, server, monkeypatch)
    cfg = DataConfig(
      dataset='emnist', partition='natural', num_clients=None, download=True
    )
    d = load_federated(cfg)
    assert d.num_clients == 2 and len(server.hits) == 2
    # The files and the population store read from them (``stores/``).
    # (and the digests of the files' contents the store is keyed by).
    assert sorted(_leftovers(cache)) == [
      'digests',
      'federated_emnist_test.sqlite',
      'federated_emnist_train.sqlite',
      'stores',
    ]
    again = load_federated(cfg)  # found in the cache: no request
    assert len(server.hits) == 2
    np.testing.assert_array_equal(again.train.x, d.train.x)


@pytest.mark.parametrize(
  'case,needle',
  [
    ('checksum', "sha256 [0-9a-f]+ differs from the release's"),
    ('cut', r'connection cut|IncompleteRead|failed \('),
    ('404', 'answered HTTP 404'),
  ],
)
def test_failed_download_keeps_nothing(
  tmp_path, cache, monkeypatch, case, needle
):
  name = 'federated_emnist_train.sqlite'
  with _Server({}) as server:
    _serve_emnist(tmp_path, server, monkeypatch)
    body = server.routes[f'/{name}'][1]
    server.routes[f'/{name}'] = {
      'checksum': (200, body[:-10] + b'x' * 10, None),
      'cut': (200, body, len(body) // 2),
      '404': (404, b'gone', None),
    }[case]
    with pytest.raises(DownloadError, match=needle) as e:
      load_federated(
        DataConfig(dataset='emnist', partition='natural', download=True)
      )
  msg = str(e.value)
  assert msg.startswith('emnist: ') and 'nothing was kept' in msg
  assert f'save {server.url}/{name} as {name} in --data_dir' in msg
  assert _leftovers(cache) == []  # no partial file, nothing renamed into place


def test_offline_is_one_line_naming_url_and_place(cache, monkeypatch):
  closed = dataclasses.replace(
    sources.FILES['tinyshakespeare'][0], url='http://127.0.0.1:9/input.txt'
  )
  monkeypatch.setitem(sources.FILES, 'tinyshakespeare', (closed,))
  with pytest.raises(DownloadError) as e:
    load_federated(
      DataConfig(
        dataset='tinyshakespeare',
        partition='natural',
        num_clients=2,
        download=True,
      )
    )
  assert (
    'tinyshakespeare: download of http://127.0.0.1:9/input.txt failed'
    in str(e.value)
  )
  assert 'save http://127.0.0.1:9/input.txt as input.txt in --data_dir' in str(
    e.value
  )
  assert _leftovers(cache) == []


def test_truncated_archive_without_checksum_is_refused(
  tmp_path, cache, monkeypatch
):
  """A complete transfer of a truncated file (no release checksum to catch
  it) is refused when read: one line naming the file and the fix."""
  made_files.write_cifar_archive(
    tmp_path / 'c.tar.gz', np.random.default_rng(1), 10, 5
  )
  body = (tmp_path / 'c.tar.gz').read_bytes()
  with _Server(
    {'/cifar-10-python.tar.gz': (200, body[: len(body) // 2], None)}
  ) as server:
    remote = sources.RemoteFile(
      'cifar-10-python.tar.gz', f'{server.url}/cifar-10-python.tar.gz'
    )
    monkeypatch.setitem(sources.FILES, 'cifar10', (remote,))
    with pytest.raises(
      DataError, match='not a complete CIFAR python archive.*download it again'
    ):
      load_federated(
        DataConfig(dataset='cifar10', num_clients=2, download=True)
      )


def test_truncated_lzma_leaves_no_decompressed_copy(
  tmp_path, cache, monkeypatch
):
  made_files.write_tff_cifar100(
    tmp_path / 'raw.sqlite', np.random.default_rng(2), [3], [2]
  )
  made_files.lzma_file(
    tmp_path / 'raw.sqlite', tmp_path / 'cifar100.sqlite.lzma'
  )
  body = (tmp_path / 'cifar100.sqlite.lzma').read_bytes()[:-200]
  with _Server({'/cifar100.sqlite.lzma': (200, body, None)}) as server:
    remote = dataclasses.replace(
      sources.FILES['cifar100'][0],
      url=f'{server.url}/cifar100.sqlite.lzma',
      sha256=None,
      size=None,
    )
    monkeypatch.setitem(sources.FILES, 'cifar100', (remote,))
    with pytest.raises(DataError, match='not a complete LZMA file'):
      load_federated(
        DataConfig(dataset='cifar100', partition='natural', download=True)
      )
  # no cifar100.sqlite, no partial (digests/: the file's content digest, kept)
  assert [n for n in _leftovers(cache) if n != 'digests'] == [
    'cifar100.sqlite.lzma'
  ]


def test_cli_download_and_missing_file_are_one_line(tmp_path):
  """From the command line: a missing file names itself and the --download
  command; a failed download names the data set and URL; exit 2, no
  traceback."""
  env = dict(os.environ, FEDJAX_PERSONAL_CACHE=str(tmp_path / 'cache'))
  env.pop('FEDJAX_PERSONAL_DATA', None)
  cmd = [
    sys.executable,
    os.path.join(ROOT, 'scripts', 'run_experiment.py'),
    '--algorithm=fedavg',
    '--dataset=emnist',
    f'--data_dir={tmp_path}',
    '--dry_run',
  ]
  r = subprocess.run(
    cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
  )
  assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr[-2000:]
  assert 'federated_emnist_train.sqlite: not found in' in r.stderr
  assert '--dataset=emnist --download' in r.stderr
  r = subprocess.run(
    cmd[:-2] + ['--data_dir=/nonexistent', '--dry_run'],
    capture_output=True,
    text=True,
    env=env,
    cwd=tmp_path,
    timeout=300,
  )
  assert r.returncode == 2 and 'Traceback' not in r.stderr
  assert '/nonexistent: --data_dir is not a folder' in r.stderr
