"""Where a ResNet-18 GN round's time went on a CPU: XLA:CPU's convolution
inside a loop of local steps.

One SGD step of the partial-personalization seed's EMNIST ResNet-18 GN
(``resnet18_gn``, adapters of width 8, a batch of 10 28x28 images), compiled
alone and inside ``lax.scan`` (as a client's local steps run), with each
``--conv_impl``. FLOPs: XLA's count of the step with XLA's convolution; % of
peak against a 2048x2048 float32 matmul timed in the same process.

  python benchmarks/probes/conv_in_a_loop.py [--model=resnet18_gn] [--steps=3]
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_personal.hparams import Declared, hparam
from fedjax_personal.models import create_model
from fedjax_personal.run import script_entry


@dataclasses.dataclass(frozen=True)
class ProbeSettings(Declared):
  """The probe's settings (its flags)."""

  model: str = hparam(
    'resnet18_gn', 'Model (a convolutional one of models.MODELS).'
  )
  batch: int = hparam(10, 'Examples per step.')
  size: int = hparam(28, 'Image height and width.')
  channels: int = hparam(1, 'Image channels.')
  steps: int = hparam(3, 'Local steps in the loop.')


script_entry.define_settings_flags(ProbeSettings)


def _timed(fn, *args):
  compiled = jax.jit(fn).lower(*args).compile()
  jax.block_until_ready(compiled(*args))
  t = time.perf_counter()
  jax.block_until_ready(compiled(*args))
  return time.perf_counter() - t, compiled


def main(cfg: ProbeSettings):
  rng = np.random.RandomState(0)
  shape = (cfg.steps, cfg.batch, cfg.size, cfg.size, cfg.channels)
  xs = jnp.asarray(rng.rand(*shape), jnp.float32)
  ys = jnp.asarray(rng.randint(0, 62, shape[:2]))
  a = jnp.ones((2048, 2048))
  mm = jax.jit(lambda a: a @ a)
  peak = 2 * 2048**3 / min(_timed(mm, a)[0] for _ in range(3)) / 1e9
  flops = None
  for impl in ('xla', 'tiled', 'matmul'):
    model = create_model(
      cfg.model, 62, np.asarray(xs[0, :1]), 8, conv_impl=impl
    )
    params = model.init(jax.random.key(0))

    def loss(p, x, y):
      logits = model.apply(p, x)
      return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(cfg.batch), y])

    def sgd(p, x, y):
      return jax.tree.map(lambda v, g: v - 0.01 * g, p, jax.grad(loss)(p, x, y))

    def loop(p, xs, ys):
      return jax.lax.scan(lambda p, b: (sgd(p, *b), None), p, (xs, ys))[0]

    alone, compiled = _timed(sgd, params, xs[0], ys[0])
    if flops is None:
      cost = compiled.cost_analysis()
      flops = (cost[0] if isinstance(cost, list) else cost)['flops']
    looped = _timed(loop, params, xs, ys)[0] / cfg.steps
    print(
      f'{cfg.model} conv_impl={impl}: a step alone {alone * 1e3:.0f} ms '
      f'({flops / alone / 1e9 / peak:.0%} of peak), in a loop '
      f'{looped * 1e3:.0f} ms/step '
      f'({flops / looped / 1e9 / peak:.0%} of peak)'
    )
  print(
    f'{flops / 1e9:.2f} GFLOP a step; float32 matmul peak {peak:.0f} GFLOP/s; '
    f'JAX {jax.__version__}, {jax.default_backend()}'
  )


if __name__ == '__main__':
  script_entry.run_script(main, settings=ProbeSettings)
