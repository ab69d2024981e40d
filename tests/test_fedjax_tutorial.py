"""FedJAX's dataset tutorial and ``emnist_fed_avg.py``'s data code with
``fedjax`` replaced by ``fedjax_personal.fedjax`` and nothing else: every
cell gives what FedJAX 0.0.17 gave on the same made files
(``tests/data/fedjax_tutorial_reference.npz``, recorded in FedJAX's venv by
``benchmarks/peers/fedjax_tutorial_reference.py``): ids, sizes, arrays,
batch counts, sampled clients and their keys, and the same errors."""

import os

import helpers
import made_files
import numpy as np

import fedjax_personal.fedjax as fedjax

REFERENCE = os.path.join(
  os.path.dirname(__file__), 'data', 'fedjax_tutorial_reference.npz'
)


def test_tutorial_cells_give_fedjaxs_results(tmp_path, made_not_released):
  ref = helpers.script_module(
    'benchmarks', 'peers', 'fedjax_tutorial_reference.py'
  )
  made_files.fedjax_reference_files(tmp_path)
  ours = ref.run_cells(fedjax, str(tmp_path))
  theirs = dict(np.load(REFERENCE))
  assert sorted(ours) == sorted(theirs), sorted(set(ours) ^ set(theirs))
  for k, want in theirs.items():
    got = np.asarray(ours[k])
    assert got.shape == want.shape, (k, got.shape, want.shape)
    if want.dtype.kind in 'SU':
      assert got.astype(want.dtype).tolist() == want.tolist(), k
    else:
      assert got.dtype == want.dtype, (k, got.dtype, want.dtype)
      np.testing.assert_array_equal(got, want, err_msg=k)


def test_fedjax_names_and_module_paths():
  """FedJAX's import forms work: top-level names, ``core`` modules, data
  set modules; the project's data objects are FedJAX ``FederatedData``."""
  import fedjax_personal.fedjax.core.client_samplers as samplers  # noqa: F401
  from fedjax_personal.fedjax.core import client_datasets, federated_data
  from fedjax_personal.fedjax.datasets import (
    cifar100,
    emnist,
    shakespeare,
    stackoverflow,
  )

  assert fedjax.ClientDataset is client_datasets.ClientDataset
  assert fedjax.RepeatableIterator is federated_data.RepeatableIterator
  for m in (emnist, shakespeare, stackoverflow, cifar100):
    assert (
      m.cite().startswith('@')
      and callable(m.load_data)
      and callable(m.load_split)
    )
  fd = fedjax.InMemoryFederatedData({b'a': {'x': np.zeros(2)}})
  assert isinstance(fd, fedjax.FederatedData)
  assert isinstance(fd.subset([b'a']), fedjax.FederatedData)
