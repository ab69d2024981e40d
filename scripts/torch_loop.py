"""The PyTorch per-client loop: the baseline of scripts/benchmark.py.

The usual way to simulate FL in PyTorch, in its fastest practice: one model
object and one optimizer for the whole run; per client, the global
parameters are copied into the model in place, the client runs its K local
SGD steps on random batches of its own data (tensors made once, before the
timing), and its parameters are added in place to a weighted running sum.
The models have the shapes of fedjax_personal.models (PyTorch's NCHW layout).

Needs the optional ``bench`` extra (``pip install -e '.[bench]'``); the
benchmark skips these rows with a note when torch is absent.
"""

import time

import numpy as np


def available() -> bool:
  try:
    import torch  # noqa: F401
  except ImportError:
    return False
  return True


def device():
  """CUDA when the installed torch has a GPU, else the CPU."""
  import torch

  return torch.device('cuda' if torch.cuda.is_available() else 'cpu')


def make_model(name: str, in_shape, num_classes: int = 10):
  """The PyTorch twin of ``fedjax_personal.models.create_model(name)``."""
  from torch import nn

  h, w, c = in_shape
  if name == 'mlp':
    return nn.Sequential(
      nn.Flatten(),
      nn.Linear(h * w * c, 200),
      nn.ReLU(),
      nn.Linear(200, 200),
      nn.ReLU(),
      nn.Linear(200, num_classes),
    )
  if name == 'lenet5':
    # conv 6@5x5 SAME, pool, conv 16@5x5 VALID, pool: 28 -> 14 -> 10 -> 5.
    side = ((h // 2) - 4) // 2
    return nn.Sequential(
      nn.Conv2d(c, 6, 5, padding=2),
      nn.ReLU(),
      nn.MaxPool2d(2),
      nn.Conv2d(6, 16, 5),
      nn.ReLU(),
      nn.MaxPool2d(2),
      nn.Flatten(),
      nn.Linear(16 * side * side, 120),
      nn.ReLU(),
      nn.Linear(120, 84),
      nn.ReLU(),
      nn.Linear(84, num_classes),
    )
  if name in ('cnn', 'cnn_cifar'):
    feats, dense = (
      ((32, 64), (512,)) if name == 'cnn' else ((64, 64), (384, 192))
    )
    layers, cin = [], c
    for f in feats:
      layers += [nn.Conv2d(cin, f, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2)]
      cin = f
    layers.append(nn.Flatten())
    din = cin * (h // 4) * (w // 4)
    for d in dense:
      layers += [nn.Linear(din, d), nn.ReLU()]
      din = d
    layers.append(nn.Linear(din, num_classes))
    return nn.Sequential(*layers)
  raise ValueError(f'no PyTorch twin for model {name!r}')


def round_runner(
  model_name, x, y, num_examples, batch_size, local_steps, lr, seed=0
):
  """Returns ``run_round() -> None``: one FedAvg round over all clients.

  Args:
    x: uint8 [N, M, H, W, C] client examples (padded); y: int [N, M];
    num_examples: int [N] real examples per client.
  """
  import torch

  from fedjax_personal.core import host

  # the same allocator setting as the JAX rows (fair to both)
  host.tune_allocator()
  torch.manual_seed(seed)
  dev = device()
  n = len(num_examples)
  xs = [
    torch.from_numpy(
      np.ascontiguousarray(x[i, : num_examples[i]].transpose(0, 3, 1, 2))
    )
    .float()
    .div_(255.0)
    .to(dev)
    for i in range(n)
  ]
  ys = [
    torch.from_numpy(y[i, : num_examples[i]].astype(np.int64)).to(dev)
    for i in range(n)
  ]
  weights = np.asarray(num_examples, np.float64) / np.sum(num_examples)
  model = make_model(model_name, x.shape[2:]).to(dev)
  params = list(model.parameters())
  global_params = [p.detach().clone() for p in params]
  acc = [torch.zeros_like(p) for p in params]
  opt = torch.optim.SGD(params, lr=lr)
  loss_fn = torch.nn.CrossEntropyLoss()
  gen = torch.Generator().manual_seed(seed)

  def run_round():
    for a in acc:
      a.zero_()
    for i in range(n):
      with torch.no_grad():
        for p, g in zip(params, global_params):
          p.copy_(g)
      for _ in range(local_steps):
        idx = torch.randint(
          0,
          int(num_examples[i]),
          (min(batch_size, int(num_examples[i])),),
          generator=gen,
        ).to(dev)
        opt.zero_grad(set_to_none=False)
        loss_fn(model(xs[i][idx]), ys[i][idx]).backward()
        opt.step()
      with torch.no_grad():
        for a, p in zip(acc, params):
          a.add_(p, alpha=float(weights[i]))
    with torch.no_grad():
      for g, a in zip(global_params, acc):
        g.copy_(a)
    if dev.type == 'cuda':
      torch.cuda.synchronize()

  return run_round


def time_rounds(run_round, rounds):
  """Per-round seconds: the first (warm-up) and the median of ``rounds``
  more."""
  times = []
  for _ in range(rounds + 1):
    t = time.perf_counter()
    run_round()
    times.append(time.perf_counter() - t)
  steady = sorted(times[1:])[len(times[1:]) // 2]
  return times[0], steady
