"""FedJAX 0.0.17's federated data API on made EMNIST files: the reference
``tests/test_fedjax_api.py`` compares this project's ``emnist.load_data``
with (runs in FedJAX's venv; writes one ``.npz``).

  python benchmarks/peers/fedjax_api_reference.py --data_dir=DIR --out=tests/data/fedjax_api_reference.npz

``DIR`` holds ``federated_emnist_{train,test}.sqlite`` made by
``tests/made_files.write_emnist(DIR, numpy.random.default_rng(0), [5, 9, 3, 7], [2, 1, 3, 2])``
(the test makes the same files). Recorded, for FedJAX's ``load_data``:
client ids and sizes of both splits; of the train split's first clients,
``all_examples`` (the third client's images whole, the others' and the batches' as each
row's sum), ``batch``, ``padded_batch`` and ``shuffle_repeat_batch``
under several settings; the first ids of ``shuffled_clients``; ``slice``.
"""

import argparse

import numpy as np

# (name, method, keyword arguments): each client's batches under it.
BATCHINGS = [
    ('batch4', 'batch', dict(batch_size=4)),
    ('batch4_drop', 'batch', dict(batch_size=4, drop_remainder=True)),
    ('padded4', 'padded_batch', dict(batch_size=4)),
    ('padded8_b3', 'padded_batch', dict(batch_size=8, num_batch_size_buckets=3)),
    ('srb3_e2_s7', 'shuffle_repeat_batch', dict(batch_size=3, num_epochs=2, seed=7)),
    ('srb4_drop_s1', 'shuffle_repeat_batch', dict(batch_size=4, drop_remainder=True, seed=1)),
    ('srb2_steps5_s0', 'shuffle_repeat_batch', dict(batch_size=2, num_epochs=None, num_steps=5,
                                                    seed=0)),
    ('srb3_noshuffle', 'shuffle_repeat_batch', dict(batch_size=3, num_epochs=1, skip_shuffle=True)),
]


def _row_sums(x):
  """Images as each row's sum in float64 (the file stays small; a row out
  of place or a pixel changed shows)."""
  return x.reshape(len(x), -1).astype(np.float64).sum(1)


def record(train, test) -> dict:
  """The arrays recorded of a ``(train, test)`` pair of FedJAX's federated
  data API, FedJAX's own or this project's (``tests/test_fedjax_api.py``
  records its own with this function and compares)."""
  out = {}
  for name, fd in (('train', train), ('test', test)):
    out[f'{name}/ids'] = np.array(list(fd.client_ids()))
    out[f'{name}/sizes'] = np.array([s for _, s in fd.client_sizes()])
    out[f'{name}/num_clients'] = np.array(fd.num_clients())
  for i, cid in enumerate(list(train.client_ids())[:3]):
    client = train.get_client(cid)
    for k, v in client.all_examples().items():
      out[f'client{i}/all/{k}'] = v if i == 2 or k != 'x' else _row_sums(v)
    for name, method, kwargs in BATCHINGS:
      for j, batch in enumerate(getattr(client, method)(**kwargs)):
        for k, v in batch.items():
          out[f'client{i}/{name}/{j}/{k}'] = _row_sums(v) if k == 'x' else v
  shuffled = train.shuffled_clients(buffer_size=2, seed=3)
  out['shuffled_ids'] = np.array([next(shuffled)[0] for _ in range(10)])
  ids = list(train.client_ids())
  out['slice_ids'] = np.array(list(train.slice(ids[1], ids[3]).client_ids()))
  return out


def main():
  import fedjax  # FedJAX's venv only: record() serves this project's tests without it
  p = argparse.ArgumentParser()
  p.add_argument('--data_dir', required=True)
  p.add_argument('--out', required=True)
  a = p.parse_args()
  out = record(*fedjax.datasets.emnist.load_data(only_digits=False, cache_dir=a.data_dir))
  np.savez(a.out, **out)
  print(f'wrote {len(out)} arrays to {a.out}')


if __name__ == '__main__':
  main()
