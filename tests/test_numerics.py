"""A run's arithmetic as settings: the matmul precision and the convolution
implementation are chosen, applied, recorded and refused on resume."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import main_in_one_process

from fedjax_personal import numerics
from fedjax_personal.errors import ConfigError
from fedjax_personal.models import layers


def test_importing_the_package_leaves_jax_alone(tmp_path):
  """A library leaves its host alone: in a fresh process, importing the
  package (and its algorithms, data sets and command) changes no JAX
  setting, adds no import hook and writes no file; the command line opens
  the compilation cache, and a library user opts in with one call."""
  code = (
    'import sys, jax; p = jax.config.jax_default_matmul_precision; '
    'hooks = list(sys.meta_path); '
    'import fedjax_personal, fedjax_personal.algorithms, '
    'fedjax_personal.datasets; '
    'from fedjax_personal.run import experiment_entry; '
    'assert jax.config.jax_default_matmul_precision == p, '
    'jax.config.jax_default_matmul_precision; '
    'assert jax.config.jax_compilation_cache_dir is None; '
    'assert not jax.config.jax_enable_compilation_cache or '
    'jax.config.jax_compilation_cache_dir is None; '
    'assert [h for h in sys.meta_path if h not in hooks and "fedjax" in '
    'type(h).__module__] == []'
  )
  opt_in = (
    '; fedjax_personal.compilation.enable(); '
    'assert jax.config.jax_compilation_cache_dir == '
    'fedjax_personal.compilation.default_dir()'
  )
  home = tmp_path / 'home'
  home.mkdir()
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in ('JAX_COMPILATION_CACHE_DIR', 'JAX_DEFAULT_MATMUL_PRECISION')
  }
  env.update(
    HOME=str(home),
    FEDJAX_PERSONAL_CACHE=str(tmp_path / 'cache'),
    JAX_PLATFORMS='cpu',
  )
  r = subprocess.run(
    [sys.executable, '-c', code],
    capture_output=True,
    text=True,
    env=env,
    timeout=300,
    cwd=tmp_path,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  # nothing written
  assert not (tmp_path / 'cache').exists() and not list(home.iterdir())
  r = subprocess.run(
    [sys.executable, '-c', code + opt_in],
    capture_output=True,
    text=True,
    env=env,
    timeout=300,
    cwd=tmp_path,
  )
  assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize(
  'name, jax_value, recorded',
  [
    ('float32', 'highest', 'float32'),
    ('highest', 'highest', 'float32'),
    ('tf32', 'tensorfloat32', 'tf32'),
    ('bf16x3', 'BF16_BF16_F32_X3', 'bf16x3'),
    ('bf16', 'bfloat16', 'bf16'),
    ('default', 'default', 'default'),
    ('high', 'high', 'high'),
  ],
)
def test_names_map_to_jax_and_back(name, jax_value, recorded):
  assert numerics.MATMUL_PRECISIONS[name] == jax_value
  assert numerics.canonical(name) == numerics.canonical(jax_value) == recorded
  if recorded not in numerics.CPU_PRECISIONS and jax.default_backend() == 'cpu':
    # XLA:CPU computes float32 whatever the setting (and rejects bf16x3):
    # refused
    with pytest.raises(
      ConfigError, match='--matmul_precision: .*XLA:CPU computes float32'
    ):
      numerics.check_precision(name)
    return
  assert numerics.check_precision(name) == recorded


def test_an_unknown_precision_names_the_flag():
  with pytest.raises(ConfigError, match='--matmul_precision'):
    numerics.canonical('fp19')


def _dot_precisions(text):
  return set(
    re.findall(r'stablehlo\.dot_general.*precision = \[(\w+), (\w+)\]', text)
  )


@pytest.mark.parametrize(
  'asked, want', [(None, 'HIGHEST'), ('default', 'DEFAULT')]
)
def test_the_engine_traces_at_its_precision_whatever_jax_is_set_to(asked, want):
  """The round the engine compiles carries the run's precision in every
  matmul (float32 by default) while JAX's own setting says otherwise, and
  JAX's setting is left as it was."""
  import fedjax_personal as fp
  from fedjax_personal import algorithms
  from fedjax_personal.datasets import DataConfig, load_federated

  data = fp.data.to_device(
    load_federated(DataConfig(dataset='digits', num_clients=4))
  )
  model = fp.create_model('mlp', data.num_classes, data.train.x[0, :1])
  alg = algorithms.build('fedavg', model, data, batch_size=8, local_steps=2)
  kw = {} if asked is None else {'matmul_precision': asked}
  before = jax.config.jax_default_matmul_precision
  with jax.default_matmul_precision('bfloat16'):
    runner = fp.RoundRunner(
      alg,
      data,
      fp.CohortSampler(4, cohort_size=2),
      fp.create_executor('vmap', model, data.train.x[0, :1]),
      **kw,
    )
    state = runner.init(jax.random.key(0))
    text = runner.lowered(state, jax.random.key(1)).as_text()
  assert jax.config.jax_default_matmul_precision == before
  assert _dot_precisions(text) == {(want, want)}, _dot_precisions(text)


def test_float32_precision_gives_float32_products():
  """The setting reaches compiled code: at float32 a matmul equals the
  float64 product to float32 rounding (on a GPU, TF32 products are off by
  about 1e-3 relative; on a CPU every setting computes float32)."""
  a = jax.random.normal(jax.random.key(0), (256, 256), jnp.float32)
  got = np.asarray(
    jax.jit(numerics.scoped(lambda a: a @ a, 'float32'))(a), np.float64
  )
  want = np.asarray(a, np.float64) @ np.asarray(a, np.float64)
  assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-5


def test_auto_convolutions_are_matmuls_on_an_accelerator(monkeypatch):
  """``auto``: tiled on a CPU; matmul on a GPU or TPU (a convolution vmapped
  over clients is a grouped convolution there: benchmarks/speed/README.md, "On a
  GPU")."""
  assert layers.resolve_conv_impl('auto') == (
    'tiled' if jax.default_backend() == 'cpu' else 'matmul'
  )
  for backend in ('gpu', 'tpu'):
    monkeypatch.setattr(jax, 'default_backend', lambda b=backend: b)
    assert layers.resolve_conv_impl('auto') == 'matmul'
    assert layers.conv_layout('auto') == 'CNHW'
  assert layers.resolve_conv_impl('xla') == 'xla'


def _cli(tmp_path, *extra):
  given = {e.split('=')[0] for e in extra}
  return [
    a
    for a in [
      '--algorithm=fedavg',
      '--model=lenet5',
      '--num_clients=4',
      '--rounds=2',
      '--max_examples=200',
      '--eval_every=1',
      '--checkpoint_every=1',
      '--noprogress',
      f'--output_dir={tmp_path}/run',
    ]
    if a.split('=')[0] not in given
  ] + list(extra)


@pytest.mark.slow
def test_the_run_records_its_numerics_and_refuses_another_on_resume(tmp_path):
  got = main_in_one_process(
    [
      _cli(tmp_path, '--conv_impl=matmul'),
      _cli(
        tmp_path,
        '--conv_impl=matmul',
        '--resume',
        '--rounds=3',
        '--matmul_precision=default',
      ),
      _cli(tmp_path, '--resume', '--rounds=3', '--conv_impl=xla'),
      # the same process after another precision's job: its own precision,
      # float32 again
      [
        '--algorithm=fedavg',
        '--num_clients=4',
        '--rounds=1',
        '--max_examples=200',
        '--noprogress',
        f'--output_dir={tmp_path}/after',
      ],
    ]
  )
  assert [code for code, _ in got] == [0, 2, 2, 0], got
  summary = json.load(open(tmp_path / 'run' / 'fedavg' / 'summary.json'))
  assert summary['numerics'] == {
    'matmul_precision': 'float32',
    'conv_impl': 'matmul',
  }
  ident = json.load(open(tmp_path / 'run' / 'fedavg' / 'identity.json'))
  assert ident['numerics'] == summary['numerics']
  assert "matmul_precision: 'float32' -> 'default'" in got[1][1]
  assert "conv_impl: 'matmul' -> 'xla'" in got[2][1]
  after = json.load(open(tmp_path / 'after' / 'fedavg' / 'summary.json'))
  # an MLP: no convolution
  assert after['numerics'] == {'matmul_precision': 'float32'}


@pytest.mark.slow
def test_a_host_layout_run_records_the_convolution_of_its_pooled_forward_passes(
  tmp_path,
):
  """Under ``auto`` on a CPU the host layout's pooled evaluation convolves
  with XLA's convolution (``Model.forward_only``): recorded beside the
  training's, in the identity and the summary."""
  got = main_in_one_process([_cli(tmp_path, '--layout=host', '--rounds=1')])
  assert [code for code, _ in got] == [0], got
  ident = json.load(open(tmp_path / 'run' / 'fedavg' / 'identity.json'))
  if jax.default_backend() == 'cpu':
    assert ident['numerics'] == {
      'matmul_precision': 'float32',
      'conv_impl': 'tiled',
      'forward_conv_impl': 'xla',
    }
  summary = json.load(open(tmp_path / 'run' / 'fedavg' / 'summary.json'))
  assert summary['numerics'] == ident['numerics']


def test_a_reduced_precision_on_a_cpu_is_refused(tmp_path):
  got = main_in_one_process(
    [_cli(tmp_path, '--matmul_precision=tf32', '--dry_run')]
  )
  assert got[0][0] == 2
  assert '--matmul_precision: tf32: XLA:CPU computes float32' in got[0][1]


def test_conv_impl_of_a_model_without_convolutions_is_refused(tmp_path):
  got = main_in_one_process(
    [
      [
        '--algorithm=fedavg',
        '--model=mlp',
        '--conv_impl=xla',
        '--dry_run',
        '--num_clients=4',
        f'--output_dir={tmp_path}',
      ]
    ]
  )
  assert got[0][0] == 2
  assert (
    '--conv_impl: does nothing: --model=mlp has no convolution' in got[0][1]
  )
