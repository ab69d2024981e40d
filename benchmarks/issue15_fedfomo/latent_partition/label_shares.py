"""Each client's training label shares in the DP table's latent partition
(CIFAR-10, 600 images per client, 15 clients, 5 latent distributions), k-means
on the pixels vs on a centrally trained LeNet-5's features (the paper's recipe).

  python benchmarks/issue15_fedfomo/latent_partition/label_shares.py
"""
import numpy as np

from fedjax_personal.datasets import DataConfig, load_federated

NAMES = ('plane', 'car', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse', 'ship', 'truck')
for feats in ('pixels', 'embedding'):
  d = load_federated(DataConfig(dataset='cifar10', partition='latent_clusters', num_groups=5,
                                latent_features=feats, num_clients=15, test_fraction=0.2,
                                val_fraction=0.2, max_examples=9000, seed=0))
  print(f'{feats}: label skew {d.label_skew():.2f} (sum_c |p_i(c) - p(c)|, mean over clients)')
  print('client group n_train ' + ' '.join(f'{c:>5}' for c in NAMES))
  y, n, g = (np.asarray(a) for a in (d.train.y, d.train.num_examples, d.groups))
  for i in range(d.num_clients):
    share = np.bincount(y[i][:n[i]], minlength=10) / n[i]
    print(f'{i:6d} {g[i]:5d} {n[i]:7d} ' + ' '.join(f'{s:5.2f}' for s in share))
  print()
