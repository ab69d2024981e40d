"""Google Landmarks v2 as the partial-personalization seed reads it (Pillutla
et al., arXiv 2204.03809, ``pfl/data/gldv2.py``): TFF's federated split over
JPEG files, users with at least 50 images, each user's images half train and
half test, resized once into the population store; made files in the
published layout, and the download of the split bundle and image shards
against a loopback server."""

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import zipfile

import made_files
import numpy as np
import pytest
from test_downloads import _Server

from fedjax_personal.datasets import (
  DataConfig,
  gldv2,
  load_store,
  local_files,
  registry,
  sources,
)
from fedjax_personal.errors import DataError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cache(tmp_path, monkeypatch):
  monkeypatch.setenv('FEDJAX_PERSONAL_CACHE', str(tmp_path / 'cache'))
  monkeypatch.delenv('FEDJAX_PERSONAL_DATA', raising=False)
  return tmp_path / 'cache'


def _by_user(rows):
  users = {}
  for u, i, c in rows:
    users.setdefault(u, []).append((i, c))
  return users


def test_the_seeds_users_halves_and_images(tmp_path, cache, monkeypatch):
  """Users with >= 50 images in numeric order; each split half and half
  (train rounded up) by a shuffle fixed per user, capped per split; images
  resized to image_size as uint8 RGB; labels as the file has them."""
  # user 1 has 49 images: not one of the seed's users; user 10 sorts after 2.
  sizes = [51, 49, 50] + [0] * 7 + [53]
  rows = made_files.write_gldv2(tmp_path, np.random.default_rng(0), sizes)
  users = _by_user(rows)
  monkeypatch.setattr(gldv2, 'GLDV2_MAX_PER_SPLIT', 26)
  nat = registry.load('gldv2', data_dir=str(tmp_path), image_size=8)
  assert (nat.num_clients, nat.total_clients, nat.num_classes) == (3, 3, 2028)
  got = list(nat.stream())
  assert [u for u, _, _ in got] == ['0', '2', '10']
  for u, (x, y), (xt, yt) in got:
    n = len(users[u])
    assert (len(y), len(yt)) == (min((n + 1) // 2, 26), min(n // 2, 26))
    assert (
      x.dtype == np.uint8 and x.shape[1:] == (8, 8, 3) and y.dtype == np.int32
    )
    tr, te = gldv2.gldv2_halves(u, n)
    assert not set(tr) & set(te)
    for rows_, (xs, ys) in ((tr, (x, y)), (te, (xt, yt))):
      ids = [users[u][i][0] for i in rows_]
      assert ys.tolist() == [users[u][i][1] for i in rows_]
      from PIL import Image

      with Image.open(tmp_path / 'gldv2' / 'images' / f'{ids[0]}.jpg') as im:
        want = np.asarray(im.convert('RGB').resize((8, 8), Image.BILINEAR))
      np.testing.assert_array_equal(xs[0], want)
  # The split belongs to the data: the same whatever else is asked.
  again = registry.load(
    'gldv2', num_clients=2, data_dir=str(tmp_path), image_size=8
  )
  assert again.num_clients == 2 and again.total_clients == 3
  for (u, a, b), (v, c, d) in zip(again.stream(), got):
    assert u == v and np.array_equal(a[1], c[1]) and np.array_equal(b[1], d[1])


def test_the_store_holds_the_images_at_their_size(tmp_path, cache):
  made_files.write_gldv2(tmp_path, np.random.default_rng(1), [50, 51])
  stores = [
    load_store(
      DataConfig(
        dataset='gldv2',
        partition='natural',
        num_clients=None,
        data_dir=str(tmp_path),
        options=gldv2.Gldv2Options(image_size=s),
      )
    )
    for s in (8, 12)
  ]
  assert [s.x_spec() for s in stores] == [
    ((8, 8, 3), np.uint8),
    ((12, 12, 3), np.uint8),
  ]
  assert len(os.listdir(cache / 'stores')) == 2  # one store per image size
  assert stores[0].num_clients == 2 and stores[0].num_classes == 2028


@pytest.mark.parametrize(
  'damage,words',
  [
    (
      'missing_image',
      'not found (1 of the 101 images of the chosen users are missing)',
    ),
    (
      'bad_column',
      "not GLDv2's federated split (ValueError: no column 'class'",
    ),
    ('bad_class', 'class 2028 outside [0, 2028)'),
    ('bad_image', 'not a readable image'),
  ],
)
def test_damaged_files_are_one_line(tmp_path, cache, damage, words):
  rows = made_files.write_gldv2(tmp_path, np.random.default_rng(2), [50, 51])
  csv_path = tmp_path / 'gldv2' / 'federated_train.csv'
  image = tmp_path / 'gldv2' / 'images' / f'{rows[3][1]}.jpg'
  if damage == 'missing_image':
    image.unlink()
  elif damage == 'bad_column':
    csv_path.write_text(csv_path.read_text().replace(',class', ',label'))
  elif damage == 'bad_class':
    csv_path.write_text(
      csv_path.read_text().rstrip('\n') + f'\n0,{rows[0][1]},2028\n'
    )
  else:
    image.write_bytes(b'not a jpeg')
  with pytest.raises(DataError) as e:
    list(registry.load('gldv2', data_dir=str(tmp_path), image_size=8).stream())
  assert words in str(e.value) and '\n' not in str(e.value)


def test_no_images_names_the_folder_and_how_to_get_them(tmp_path, cache):
  made_files.write_gldv2(tmp_path, np.random.default_rng(3), [50])
  import shutil

  shutil.rmtree(tmp_path / 'gldv2' / 'images')
  with pytest.raises(local_files.MissingDataError) as e:
    registry.load('gldv2', data_dir=str(tmp_path))
  assert str(e.value).startswith('gldv2/images/: not found in ')
  assert 'gldv2/images/<image_id>.jpg' in str(e.value) and '--download' in str(
    e.value
  )


def _bundle(rows) -> bytes:
  """TFF's split bundle: landmarks-user-160k/{federated_train,test}.csv in a
  ZIP."""
  buf = io.BytesIO()
  with zipfile.ZipFile(buf, 'w') as z:
    z.writestr(
      'landmarks-user-160k/federated_train.csv',
      'user_id,image_id,class\n'
      + ''.join(f'{u},{i},{c}\n' for u, i, c in rows),
    )
    z.writestr('landmarks-user-160k/test.csv', 'image_id,class\n')
  return buf.getvalue()


def _shard(image_ids, rng) -> bytes:
  """A GLDv2 training shard: JPEGs under the id's first three characters."""
  buf = io.BytesIO()
  with tarfile.open(fileobj=buf, mode='w') as tar:
    for i in image_ids:
      jpeg = io.BytesIO()
      from PIL import Image

      Image.fromarray(rng.integers(0, 256, (10, 10, 3), dtype=np.uint8)).save(
        jpeg, 'JPEG'
      )
      info = tarfile.TarInfo(f'{i[0]}/{i[1]}/{i[2]}/{i}.jpg')
      info.size = len(jpeg.getvalue())
      tar.addfile(info, io.BytesIO(jpeg.getvalue()))
  return buf.getvalue()


def test_download_of_the_split_bundle_and_image_shards(
  tmp_path, cache, monkeypatch
):
  """--download fetches TFF's split bundle and GLDv2's shards one at a time,
  keeping the images of the seed's users (a user below 50 images is not
  fetched) and deleting each shard; a second load reads the cache only."""
  rng = np.random.default_rng(4)
  rows = made_files.gldv2_rows([50, 20, 51], rng)
  ids = [i for _, i, _ in rows]
  shards = [_shard(ids[::2], rng), _shard(ids[1::2], rng)]
  md5 = lambda b, name: (
    200,
    f'{hashlib.md5(b).hexdigest()}  {name}\n'.encode(),
    None,
  )
  # wrong at first
  routes = {
    '/bundle.zip': (200, _bundle(rows), None),
    '/images_000.tar': (200, shards[0], None),
    '/images_001.tar': (200, shards[1], None),
    '/md5.images_000.txt': md5(shards[0], 'images_000.tar'),
    '/md5.images_001.txt': md5(shards[1] + b'x', 'images_001.tar'),
  }
  with _Server(routes) as server:
    monkeypatch.setitem(
      sources.FILES,
      'gldv2',
      (sources.RemoteFile(sources.GLDV2_BUNDLE, f'{server.url}/bundle.zip'),),
    )
    monkeypatch.setattr(
      sources, 'GLDV2_SHARD_URL', server.url + '/images_{:03d}.tar'
    )
    monkeypatch.setattr(
      sources, 'GLDV2_MD5_URL', server.url + '/md5.images_{:03d}.txt'
    )
    monkeypatch.setattr(sources, 'GLDV2_SHARDS', 3)  # the third is never needed
    with pytest.raises(
      DataError, match=r"images_001.tar: md5 .* differs from the release's"
    ):
      # shard 0 kept, shard 1 refused
      registry.load('gldv2', download=True, image_size=8)
    routes['/md5.images_001.txt'] = md5(shards[1], 'images_001.tar')
    server.hits.clear()
    nat = registry.load('gldv2', download=True, image_size=8)
    assert [u for u, _, _ in nat.stream()] == ['0', '2']
    assert server.hits == ['/md5.images_001.txt', '/images_001.tar']
    images = cache / 'gldv2' / 'images'
    kept = sorted(p[:-4] for p in os.listdir(images) if p.endswith('.jpg'))
    assert kept == sorted(i for u, i, _ in rows if u != '1')
    assert (images / '.shards_done').read_text().split() == ['0', '1']
    assert not [p for p in os.listdir(cache) if p.endswith('.tar')]
    # extracted once, in a folder named by the bundle's content (another bundle:
    # its own)
    assert (
      len(list((cache / 'extracted').glob('*/gldv2/federated_train.csv'))) == 1
    )
    registry.load('gldv2', download=True, image_size=8)
    assert len(server.hits) == 2


@pytest.mark.slow
def test_image_size_is_refused_for_other_data_sets():
  r = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, 'scripts', 'run_experiment.py'),
      '--dataset=digits',
      '--image_size=32',
      '--dry_run',
    ],
    capture_output=True,
    text=True,
    timeout=120,
  )
  errors = [l for l in r.stderr.splitlines() if l.startswith('error:')]
  assert (
    r.returncode == 2 and len(errors) == 1 and '--image_size' in errors[0]
  ), r.stderr


def test_no_split_file_names_it_and_the_download(tmp_path, cache):
  with pytest.raises(local_files.MissingDataError) as e:
    registry.load('gldv2', data_dir=str(tmp_path))
  assert str(e.value).startswith(
    "gldv2/federated_train.csv (or TFF's landmarks-user-160k.zip that holds "
    'it): not found in '
  )
  assert '--dataset=gldv2 --download' in str(e.value)
