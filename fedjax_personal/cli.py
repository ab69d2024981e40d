"""Flags and the main job of ``scripts/run_experiment.py``.

Kept in the package so that scripts stay thin and tests can drive it.
"""

import json
import os
import sys
from typing import Dict

from absl import flags
import jax
import numpy as np

from fedjax_personal import algorithms as algorithms_lib
from fedjax_personal import datasets as datasets_lib
from fedjax_personal import checkpointing, experiment, reporting
from fedjax_personal.data import to_device
from fedjax_personal.engine import RoundRunner
from fedjax_personal.executors import EXECUTOR_NAMES, create_executor
from fedjax_personal.models import MODELS, create_model
from fedjax_personal.sampling import CohortSampler

FLAGS = flags.FLAGS

# Default job: FedAvg vs Local vs FedAvg + fine-tuning on real MNIST digits
# (the 10k MNIST files embedded in the package), 20 clients, Dirichlet 0.4.
flags.DEFINE_list('algorithm', ['fedavg', 'local', 'fedavg_ft'],
                  'Algorithm(s) to run; several give a comparison table. One of: '
                  + ', '.join(sorted(algorithms_lib.ALGORITHMS)))
flags.DEFINE_string('model', 'lenet5', 'Model: ' + ', '.join(sorted(MODELS)))
flags.DEFINE_string('dataset', 'mnist', 'Data set: ' + ', '.join(datasets_lib.DATASETS))
flags.DEFINE_string('partition', 'dirichlet', 'Partition: ' + ', '.join(datasets_lib.PARTITIONS))
flags.DEFINE_float('alpha', 0.4, 'Dirichlet concentration (label skew) / quantity-skew beta.')
flags.DEFINE_integer('classes_per_client', 2, 'Classes per client (pathological, sparse_classes).')
flags.DEFINE_integer('num_groups', 4, 'Groups (rotation, label_permutation, latent_clusters).')
flags.DEFINE_string('group_base', 'iid', "Partition inside groups: 'iid' or 'dirichlet'.")
flags.DEFINE_integer('examples_per_client', None, 'sparse_classes: examples per device.')
flags.DEFINE_integer('max_examples', None, 'Use at most this many examples of the pool.')
flags.DEFINE_float('test_fraction', 0.2, 'Per-client test share.')
flags.DEFINE_float('val_fraction', 0.0, 'Per-client validation share.')
flags.DEFINE_integer('num_clients', 20, 'Number of clients N.')
flags.DEFINE_integer('cohort_size', None, 'Clients per round (default: all).')
flags.DEFINE_float('participation', None, 'Instead of cohort_size: each client active with this '
                   'probability per round (FedDyn scheme).')
flags.DEFINE_integer('rounds', 30, 'Communication rounds.')
flags.DEFINE_integer('local_epochs', 1, 'Local epochs per round (E).')
flags.DEFINE_integer('local_steps', None, 'Local steps per round (K); overrides local_epochs.')
flags.DEFINE_integer('batch_size', 32, 'Local batch size (0: full local batch).')
flags.DEFINE_float('client_lr', 0.05, 'Client learning rate.')
flags.DEFINE_float('client_momentum', 0.0, 'Client SGD momentum.')
flags.DEFINE_string('server_optimizer', 'sgd', "Server optimizer: 'sgd' or 'adam'.")
flags.DEFINE_float('server_lr', 1.0, 'Server learning rate.')
flags.DEFINE_float('server_momentum', 0.0, 'Server momentum (FedAvgM).')
flags.DEFINE_string('weighting', 'num_examples', "Aggregation weights: 'num_examples' or 'uniform'.")
flags.DEFINE_float('prox_mu', 0.01, 'FedProx mu.')
flags.DEFINE_integer('finetune_steps', 0, 'Evaluation fine-tuning steps (0: none; fedavg_ft: 5).')
flags.DEFINE_float('finetune_lr', None, 'Fine-tuning learning rate (default: client_lr).')
flags.DEFINE_float('feddyn_alpha', None, 'FedDyn alpha (default 0.01; 0.1 for pfeddyn_proto).')
flags.DEFINE_bool('adaptive_alpha', False, 'FedDyn: alpha_i = alpha * mean(n) / n_i (authors\' code).')
flags.DEFINE_float('max_grad_norm', 0.0, 'FedDyn: clip the data-term gradient (0: no clipping; '
                   'authors\' code: 10).')
flags.DEFINE_float('lr_decay', 1.0, 'Client learning rate times this every round (FedDyn family).')
flags.DEFINE_float('weight_decay', 0.0, 'Client weight decay (FedDyn family; authors: 1e-3).')
flags.DEFINE_enum('feddyn_eval', 'server', ['server', 'active_mean', 'all_clients_mean'],
                  'Which FedDyn model is evaluated.')
flags.DEFINE_integer('maml_inner_steps', 5, 'pfeddyn_maml inner SGD steps.')
flags.DEFINE_float('maml_inner_lr', 1e-2, 'pfeddyn_maml inner learning rate.')
flags.DEFINE_float('target_accuracy', None, 'Report the first evaluated round whose mean '
                   'accuracy reaches this (use --eval_every=1 for exact rounds).')
flags.DEFINE_string('personal_part', 'output', "fedalt/fedsim personal parameters: input, output, "
                    "adapter, all_but_output, all, or split:<regex>,...")
flags.DEFINE_integer('adapter_dim', 0, 'Add residual adapters of this width to the model '
                     '(for --personal_part=adapter).')
flags.DEFINE_float('personal_lr', None, 'Learning rate of personal parameters (default client_lr).')
flags.DEFINE_integer('personal_epochs', None, 'FedAlt/FedRep personal phase (epochs, or steps '
                     'with --local_steps).')
flags.DEFINE_integer('personal_finetune_epochs', 0, 'fedalt/fedsim: fine-tune the personal part '
                     'for this many epochs before evaluation.')
flags.DEFINE_float('perfedavg_alpha', 0.01, 'Per-FedAvg inner step alpha (beta = --client_lr).')
flags.DEFINE_float('hf_delta', 1e-3, 'Per-FedAvg finite-difference delta (perfedavg_hf_fd).')
flags.DEFINE_float('pfedme_lambda', 15.0, 'pFedMe lambda.')
flags.DEFINE_float('pfedme_personal_lr', 0.01, 'pFedMe inner learning rate.')
flags.DEFINE_integer('pfedme_inner_steps', 5, 'pFedMe inner steps K.')
flags.DEFINE_float('pfedme_beta', 1.0, 'pFedMe server mixing beta.')
flags.DEFINE_float('ditto_lambda', 0.1, 'Ditto lambda.')
flags.DEFINE_float('apfl_alpha', 0.25, 'APFL mixing weight alpha.')
flags.DEFINE_integer('num_streams', 0, 'usercentric: downlink streams m_t (0: silhouette choice; '
                     '>= num_clients: one per client).')
flags.DEFINE_integer('sigma_batches', 2, 'usercentric: K batches for sigma_i^2.')
flags.DEFINE_integer('sigma_batch_size', 0, 'usercentric: size of those batches (0: K equal parts '
                     'of the local data, the authors\' reading; ~32 mixes usefully under label shift).')
flags.DEFINE_integer('uc_warmup_rounds', 0, 'usercentric: FedAvg rounds before W is computed.')
flags.DEFINE_integer('uc_recompute_every', 0, 'usercentric: recompute W every this many rounds.')
flags.DEFINE_integer('fomo_candidates', 5, 'FedFomo: models downloaded per round (M).')
flags.DEFINE_float('fomo_eps', 0.3, 'FedFomo: initial exploration probability.')
flags.DEFINE_float('fomo_eps_decay', 0.05, 'FedFomo: eps decrease per round.')
flags.DEFINE_bool('fomo_leave_one_out', False, 'FedFomo: score candidates through model averages.')
flags.DEFINE_float('dp_clip_norm', 0.0, 'DP-SGD per-example clip norm (FedFomo; 0: no DP).')
flags.DEFINE_float('dp_noise_multiplier', 0.0, 'DP-SGD noise multiplier.')
flags.DEFINE_float('cfl_eps1', 0.4, 'CFL: split when the mean update norm is below this...')
flags.DEFINE_float('cfl_eps2', 1.6, '...and the largest client update norm above this.')
flags.DEFINE_integer('cfl_warmup_rounds', 5, 'CFL: no split before this round.')
flags.DEFINE_float('cfl_ratio', 0.0, 'CFL: if > 0, split when the mean update norm < ratio * the '
                   'largest (scale-free; replaces cfl_eps1).')
flags.DEFINE_integer('seed', 0, 'Seed of data partition, model init and training.')
flags.DEFINE_integer('eval_every', 5, 'Evaluate every this many rounds (0: at the end only).')
flags.DEFINE_string('output_dir', None, 'Where to write metrics (default runs/<job name>).')
flags.DEFINE_enum('executor', 'auto', list(EXECUTOR_NAMES), 'How client work runs.')
flags.DEFINE_integer('block_size', None, 'Clients per block for the blocked executor.')
flags.DEFINE_string('data_dir', None, 'Directory with data files (default: embedded, ../shared/data).')
flags.DEFINE_bool('progress', True, 'Show a progress bar.')
flags.DEFINE_integer('checkpoint_every', 0, 'Save an Orbax checkpoint of the full state every this '
                     'many rounds (0: never) under <output_dir>/<algorithm>/checkpoints.')
flags.DEFINE_bool('resume', False, 'Continue each algorithm from its latest checkpoint.')
flags.DEFINE_integer('sweep_seeds', 0, 'Run seeds seed..seed+S-1 as one vmapped program (0: off).')
flags.DEFINE_string('sweep', '', "Hyperparameters swept in the same program, e.g. "
                    "'client_lr:0.01,0.03,0.1;prox_mu:0,0.1' (cross product with the seeds).")


class UsageError(ValueError):
  """Bad flag value; the message names the flag."""


def _check(cond, flag, msg):
  if not cond:
    raise UsageError(f'--{flag}: {msg}')


def validate_flags():
  """Checks flag values that can be checked before loading data."""
  for a in FLAGS.algorithm:
    _check(a in algorithms_lib.ALGORITHMS, 'algorithm',
           f'unknown algorithm {a!r}; choose from {sorted(algorithms_lib.ALGORITHMS)}')
  _check(FLAGS.algorithm, 'algorithm', 'give at least one algorithm')
  _check(FLAGS.model in MODELS, 'model', f'unknown model {FLAGS.model!r}; choose from {sorted(MODELS)}')
  _check(FLAGS.dataset in datasets_lib.DATASETS, 'dataset',
         f'unknown dataset {FLAGS.dataset!r}; choose from {list(datasets_lib.DATASETS)}')
  _check(FLAGS.partition in datasets_lib.PARTITIONS, 'partition',
         f'unknown partition {FLAGS.partition!r}; choose from {list(datasets_lib.PARTITIONS)}')
  _check(FLAGS.num_clients >= 1, 'num_clients', f'must be >= 1, got {FLAGS.num_clients}')
  _check(FLAGS.alpha > 0, 'alpha', f'must be > 0, got {FLAGS.alpha}')
  _check(FLAGS.rounds >= 1, 'rounds', f'must be >= 1, got {FLAGS.rounds}')
  _check(FLAGS.batch_size >= 0, 'batch_size', f'must be >= 0, got {FLAGS.batch_size}')
  _check(FLAGS.client_lr > 0, 'client_lr', f'must be > 0, got {FLAGS.client_lr}')
  _check(FLAGS.local_epochs >= 0, 'local_epochs', f'must be >= 0, got {FLAGS.local_epochs}')
  _check(FLAGS.local_steps is None or FLAGS.local_steps >= 0, 'local_steps',
         f'must be >= 0, got {FLAGS.local_steps}')
  _check(FLAGS.cohort_size is None or FLAGS.participation is None, 'participation',
         'give either --cohort_size or --participation, not both')
  if FLAGS.cohort_size is not None:
    _check(1 <= FLAGS.cohort_size <= FLAGS.num_clients, 'cohort_size',
           f'must be in [1, num_clients={FLAGS.num_clients}], got {FLAGS.cohort_size}')
  if FLAGS.participation is not None:
    _check(0 < FLAGS.participation <= 1, 'participation',
           f'must be in (0, 1], got {FLAGS.participation}')
  _check(FLAGS.sweep_seeds >= 0, 'sweep_seeds', f'must be >= 0, got {FLAGS.sweep_seeds}')
  if FLAGS.sweep:
    from fedjax_personal import sweep
    try:
      swept = sweep.parse_sweep(FLAGS.sweep)
    except ValueError as e:
      raise UsageError(str(e)) from None
    _check(min(swept.get('client_lr', [1.0])) > 0, 'sweep', 'client_lr values must be > 0')
  _check(FLAGS.checkpoint_every >= 0, 'checkpoint_every',
         f'must be >= 0, got {FLAGS.checkpoint_every}')
  _check(FLAGS.eval_every >= 0, 'eval_every', f'must be >= 0, got {FLAGS.eval_every}')
  _check(FLAGS.block_size is None or FLAGS.block_size >= 1, 'block_size',
         f'must be >= 1, got {FLAGS.block_size}')
  _check(0 <= FLAGS.test_fraction < 1, 'test_fraction', f'must be in [0, 1), got {FLAGS.test_fraction}')
  _check(0 <= FLAGS.val_fraction < 1, 'val_fraction', f'must be in [0, 1), got {FLAGS.val_fraction}')
  _check(FLAGS.server_optimizer in ('sgd', 'adam'), 'server_optimizer',
         f"must be 'sgd' or 'adam', got {FLAGS.server_optimizer!r}")
  _check(FLAGS.feddyn_alpha is None or FLAGS.feddyn_alpha > 0, 'feddyn_alpha',
         f'must be > 0, got {FLAGS.feddyn_alpha}')
  _check(FLAGS.max_grad_norm >= 0, 'max_grad_norm', f'must be >= 0, got {FLAGS.max_grad_norm}')
  _check(FLAGS.num_streams >= 0, 'num_streams', f'must be >= 0, got {FLAGS.num_streams}')
  _check(FLAGS.sigma_batches >= 1, 'sigma_batches', f'must be >= 1, got {FLAGS.sigma_batches}')
  _check(0 <= FLAGS.apfl_alpha <= 1, 'apfl_alpha', f'must be in [0, 1], got {FLAGS.apfl_alpha}')
  _check(0 < FLAGS.lr_decay <= 1, 'lr_decay', f'must be in (0, 1], got {FLAGS.lr_decay}')
  _check(FLAGS.weighting in ('num_examples', 'uniform'), 'weighting',
         f"must be 'num_examples' or 'uniform', got {FLAGS.weighting!r}")


def data_config() -> datasets_lib.DataConfig:
  return datasets_lib.DataConfig(
      dataset=FLAGS.dataset, partition=FLAGS.partition, num_clients=FLAGS.num_clients,
      seed=FLAGS.seed, alpha=FLAGS.alpha, classes_per_client=FLAGS.classes_per_client,
      num_groups=FLAGS.num_groups, group_base=FLAGS.group_base,
      examples_per_client=FLAGS.examples_per_client, test_fraction=FLAGS.test_fraction,
      val_fraction=FLAGS.val_fraction, max_examples=FLAGS.max_examples, data_dir=FLAGS.data_dir)


def hparams() -> algorithms_lib.HParams:
  steps = FLAGS.local_steps
  return algorithms_lib.HParams(
      client_lr=FLAGS.client_lr, client_momentum=FLAGS.client_momentum,
      server_optimizer=FLAGS.server_optimizer, server_lr=FLAGS.server_lr,
      server_momentum=FLAGS.server_momentum, batch_size=FLAGS.batch_size or None,
      local_epochs=None if steps is not None else FLAGS.local_epochs, local_steps=steps,
      weighting=FLAGS.weighting, prox_mu=FLAGS.prox_mu, finetune_steps=FLAGS.finetune_steps,
      finetune_lr=FLAGS.finetune_lr, feddyn_alpha=FLAGS.feddyn_alpha,
      adaptive_alpha=FLAGS.adaptive_alpha, max_grad_norm=FLAGS.max_grad_norm,
      lr_decay=FLAGS.lr_decay, weight_decay=FLAGS.weight_decay, feddyn_eval=FLAGS.feddyn_eval,
      maml_inner_steps=FLAGS.maml_inner_steps, maml_inner_lr=FLAGS.maml_inner_lr,
      personal_part=FLAGS.personal_part, personal_lr=FLAGS.personal_lr,
      personal_epochs=FLAGS.personal_epochs,
      personal_finetune_epochs=FLAGS.personal_finetune_epochs,
      perfedavg_alpha=FLAGS.perfedavg_alpha, hf_delta=FLAGS.hf_delta,
      pfedme_lambda=FLAGS.pfedme_lambda, pfedme_personal_lr=FLAGS.pfedme_personal_lr,
      pfedme_inner_steps=FLAGS.pfedme_inner_steps, pfedme_beta=FLAGS.pfedme_beta,
      ditto_lambda=FLAGS.ditto_lambda, apfl_alpha=FLAGS.apfl_alpha,
      num_streams=FLAGS.num_streams, sigma_batches=FLAGS.sigma_batches,
      sigma_batch_size=FLAGS.sigma_batch_size, uc_warmup_rounds=FLAGS.uc_warmup_rounds,
      uc_recompute_every=FLAGS.uc_recompute_every, fomo_candidates=FLAGS.fomo_candidates,
      fomo_eps=FLAGS.fomo_eps, fomo_eps_decay=FLAGS.fomo_eps_decay,
      fomo_leave_one_out=FLAGS.fomo_leave_one_out, dp_clip_norm=FLAGS.dp_clip_norm,
      dp_noise_multiplier=FLAGS.dp_noise_multiplier, cfl_eps1=FLAGS.cfl_eps1,
      cfl_eps2=FLAGS.cfl_eps2, cfl_warmup_rounds=FLAGS.cfl_warmup_rounds,
      cfl_ratio=FLAGS.cfl_ratio)


def sampler_for(num_clients: int) -> CohortSampler:
  if FLAGS.participation is not None:
    return CohortSampler(num_clients, participation=FLAGS.participation)
  return CohortSampler(num_clients, cohort_size=FLAGS.cohort_size or num_clients)


def main_job() -> Dict[str, dict]:
  """Runs every algorithm of --algorithm on the same data; writes outputs and
  prints the comparison table. Returns {algorithm: final summary}."""
  validate_flags()
  data = datasets_lib.load_federated(data_config())
  _check(int(np.asarray(data.train.num_examples).sum()) > 0, 'num_clients',
         'no client has training data')
  print(data.describe())
  data = to_device(data)
  sample_x = data.train.x[0, :1]
  _check(FLAGS.adapter_dim >= 0, 'adapter_dim', f'must be >= 0, got {FLAGS.adapter_dim}')
  model = create_model(FLAGS.model, data.num_classes, sample_x, FLAGS.adapter_dim)
  executor = create_executor(FLAGS.executor, model, sample_x, FLAGS.block_size)
  name = FLAGS.output_dir or os.path.join(
      'runs', f'{FLAGS.dataset}_{FLAGS.partition}_{FLAGS.model}_n{FLAGS.num_clients}_seed{FLAGS.seed}')
  print(f'executor: {executor.describe()} on {jax.default_backend()}; outputs in {name}')
  hp = hparams()
  if FLAGS.sweep_seeds or FLAGS.sweep:
    return sweep_job(hp, model, data, sample_x, name)
  histories, summaries = {}, {}
  for alg_name in FLAGS.algorithm:
    alg = algorithms_lib.build(alg_name, hp, model, data)
    runner = RoundRunner(alg, data, sampler_for(data.num_clients), executor)
    out_dir = os.path.join(name, alg_name)
    ckpt_dir = os.path.join(out_dir, 'checkpoints')
    state, start, history = None, 0, []
    if FLAGS.resume:
      restored = checkpointing.restore_latest(ckpt_dir, runner.init(jax.random.key(0)))
      if restored is not None:
        state, start, history = restored
        print(f'{alg_name}: resuming after round {start} from {ckpt_dir}')
    callbacks = [reporting.MetricsWriter(out_dir, history)]
    if FLAGS.checkpoint_every or FLAGS.resume:
      callbacks.append(checkpointing.Checkpointer(ckpt_dir, FLAGS.checkpoint_every, history))
    if alg_name == 'fedfomo':
      callbacks.append(reporting.AffinityRecorder(os.path.join(out_dir, 'affinity.png')))
    if FLAGS.progress:
      callbacks.append(reporting.Progress(FLAGS.rounds - start, alg_name))
    _, history = experiment.run(runner, FLAGS.rounds, seed=FLAGS.seed,
                                eval_every=FLAGS.eval_every, callbacks=callbacks, state=state,
                                start_round=start, history=history)
    histories[alg_name] = history
    summaries[alg_name] = reporting.final_summary(history)
    reporting.write_summary(out_dir, {**summaries[alg_name], 'algorithm': alg_name,
                                      'flags': FLAGS.flag_values_dict()})
    if FLAGS.target_accuracy is not None:
      summaries[alg_name]['rounds_to_target'] = experiment.rounds_to_target(
          history, FLAGS.target_accuracy)
    s = summaries[alg_name]
    print(f"{alg_name}: mean {s['accuracy_mean']:.4f} worst {s['accuracy_worst']:.4f} "
          f"({s['train_seconds']:.1f} s of rounds)")
  reporting.plot_runs(histories, name)
  with open(os.path.join(name, 'comparison.json'), 'w') as f:
    json.dump({k: {kk: v for kk, v in s.items() if kk != 'per_client_accuracy'}
               for k, s in summaries.items()}, f, indent=1)
  print()
  print(f'{data.name}, {FLAGS.model}, {FLAGS.rounds} rounds: per-client test accuracy')
  print(reporting.format_table(summaries))
  return summaries


def sweep_job(hp, model, data, sample_x, name):
  """Every algorithm of --algorithm over the sweep's configurations, each
  sweep one compiled program; prints one row per configuration."""
  from fedjax_personal import sweep
  values = sweep.parse_sweep(FLAGS.sweep)
  seeds = list(range(FLAGS.seed, FLAGS.seed + max(FLAGS.sweep_seeds, 1)))
  cfgs = sweep.configs(seeds, values)
  executor = create_executor(FLAGS.executor, model, sample_x, FLAGS.block_size)
  if not executor.fused:
    executor = create_executor('blocked', block_size=FLAGS.block_size)
  print(f'sweep of {len(cfgs)} configurations per algorithm, executor {executor.describe()}')
  results = {}
  for alg_name in FLAGS.algorithm:
    build = lambda hv: algorithms_lib.build(
        alg_name, algorithms_lib.HParams(**{**hp.__dict__, **hv}), model, data)
    runner = sweep.SweepRunner(build, cfgs, data, sampler_for(data.num_clients), executor)
    histories = runner.run(FLAGS.rounds, FLAGS.eval_every)
    for (seed, hv), hist in zip(cfgs, histories):
      label = f'{alg_name} seed={seed}' + ''.join(f' {k}={v:g}' for k, v in hv.items())
      results[label] = reporting.final_summary(hist)
  os.makedirs(name, exist_ok=True)
  with open(os.path.join(name, 'sweep.json'), 'w') as f:
    json.dump({k: {kk: v for kk, v in s.items() if kk != 'per_client_accuracy'}
               for k, s in results.items()}, f, indent=1)
  width = max(len(k) for k in results) + 2
  print(f"{'configuration':<{width}}{'mean':>9}{'worst':>9}")
  for label, s in results.items():
    print(f"{label:<{width}}{100 * s['accuracy_mean']:>8.2f}%{100 * s['accuracy_worst']:>8.2f}%")
  return results


def main(argv):
  if len(argv) > 1:
    print(f'error: unexpected arguments {argv[1:]}', file=sys.stderr)
    sys.exit(2)
  try:
    main_job()
  except (UsageError, ValueError, FileNotFoundError) as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  except experiment.DivergenceError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(3)
