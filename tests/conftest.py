import os

from absl import flags
import pytest

# Tests run on whatever CPU there is; keep XLA from grabbing every thread
# oddly and never touch the network.
os.environ.setdefault('TFDS_DISABLE_GCS', '1')

# Tests read data only from the clone, the package and what they write: a
# cache of their own (never ~/.cache/fedjax_personal), and real data sets only
# in tests marked needs_data, through $FEDJAX_PERSONAL_DATA.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

os.environ['FEDJAX_PERSONAL_CACHE'] = tempfile.mkdtemp(prefix='fedjax_personal_test_cache_')
# Removed when the session ends (each run's cache, up to 30 MB, stayed in
# the temporary folder).
atexit.register(shutil.rmtree, os.environ['FEDJAX_PERSONAL_CACHE'], True)

# Most of a test's time is XLA compiling small programs: LLVM's cheaper
# optimisation compiles them faster (tests/test_engine.py: 86 s -> 53 s on 2
# cores) and keeps IEEE semantics (XLA:CPU uses no fast math).
# Runs that compile other programs for the same sums (rows in files against
# rows in memory) then differ in their last bits where at the default they
# happened to agree: those tests compare to 1e-6, as BUILD.md states. The
# scripts the tests start inherit it; a user's own XLA_FLAGS win (XLA_FLAGS=
# runs the suite at XLA's default).
os.environ.setdefault('XLA_FLAGS', '--xla_backend_optimization_level=0 '
                                   '--xla_llvm_disable_expensive_passes=true')

# file (or alternatives) -> the data set whose --download gets it
_DOWNLOAD = {'tinyshakespeare.txt': 'tinyshakespeare', 'input.txt': 'tinyshakespeare',
             'cifar-10-python.tar.gz': 'cifar10'}


# Checks whose subject another CI test covers (the same path on another
# executor, algorithm or fault), run with the slow ones to keep CI's run
# within its time (python -m pytest -m slow runs them).
SLOW_IN_CI = {
    'test_usercentric.py::test_collaboration_round_and_streams_in_a_run',
    'test_usercentric.py::test_identity_mixing_is_local_and_fedavg_rows_are_fedavg',
    'test_personalization.py::test_perfedavg_default_is_the_plain_mean_of_returned_models',
    'test_personalization.py::test_perfedavg_fo_and_hf_differ_and_coincide_at_alpha_zero',
    'test_reproduce.py::test_scales_resolve_to_the_documented_sizes',
    'test_reproduce.py::test_a_diverged_trial_is_reported_not_fatal',
    'test_models.py::test_pooling_has_forward_and_reverse_derivatives_of_the_strided_form',
    'test_engine.py::test_oracle_is_fedavg_within_each_group',
    'test_faults.py::test_default_folder_names_algorithm_and_configuration',
    'test_interruptions.py::test_two_runs_racing_for_one_folder',
    'test_privacy.py::test_fedfomo_dp_records_epsilon_every_round',
    'test_debiasing.py::test_pfeddyn_heads_run_on_permuted_sparse_classes[finetune]',
    'test_cli.py::test_trials_equal_single_runs_and_report_mean_and_std[mlp-sequential]',
    'test_sweep.py::test_sweep_equals_single_runs_for_every_algorithm[fedfomo]',
    'test_checkpoint.py::test_cli_resume',
    'test_engine.py::test_finetune_evaluation_uses_training_data',  # test_populations' covers it
    'test_engine.py::test_local_trains_each_client_alone',
    'test_reproduce.py::test_finished_trials_are_reused_only_by_the_same_cell',
    'test_cli.py::test_cli_sweep_of_seeds_equals_single_runs_for_pre_round_algorithms[usercentric]',
    'test_cli.py::test_weights_of_another_model_name_the_layer',
    'test_privacy.py::test_fedavg_dp_without_noise_and_a_loose_clip_is_fedavg',
    'test_memory.py::test_auto_picks_blocks_from_the_free_memory',
    # sharding_check.py asserts the sharded user-centric round compiles once too
    'test_usercentric.py::test_collaboration_round_is_inside_the_one_compiled_round',
    'test_personalization.py::test_ditto_large_lambda_gives_the_global_model',
    'test_personalization.py::test_apfl_alpha_zero_is_global_and_one_is_local',
    'test_interruptions.py::test_disk_full_while_checkpointing_then_resume',
    'test_sweep.py::test_sweep_over_seeds_and_learning_rates_equals_separate_runs[host]',
    'test_models.py::test_models_agree_across_conv_implementations[cnn_cifar-shape1]',
    'test_populations.py::test_cli_cifar100_held_out_test_clients[device]',
    'test_populations.py::test_cli_host_layout_sweep_of_seeds_equals_a_single_seed',
    'test_populations.py::test_host_layout_equals_device_layout[fedavg-0.3-reset]',
    'test_scale.py::test_round_memory_is_bounded_by_state_and_one_output',
    'test_faults.py::test_output_folder_of_another_configuration_is_refused',
    'test_cli.py::test_fedfomo_writes_affinity_heat_maps',
    'test_fednova_qffl.py::test_fednova_with_equal_steps_is_fedavg',
    'test_benchmark.py::test_peer_benchmark_files_train_here[emnist-flags0]',
    # the accelerator check's sections at toy sizes (about 2 minutes); CI runs its --dry_run
    'test_accelerator_check.py::test_accelerator_check_runs_every_section',
    # heavy-tailed cohorts in CI: test_populations' host layout on the CPU's executor
    'test_engine.py::test_heavy_tailed_cohort_matches_plain_per_client_loop[0.5-blocked_threads]',
    'test_engine.py::test_heavy_tailed_cohort_matches_plain_per_client_loop[0.5-sequential]',
    'test_engine.py::test_heavy_tailed_cohort_matches_plain_per_client_loop[0.5-vmap]',
    # resume in the host layout in CI: test_row_checkpoints; import cycles: test_layout's static check
    'test_populations.py::test_cli_host_layout_resumes_to_the_same_numbers',
    'test_layout.py::test_every_module_imports_alone',
    # the sharded executor in CI: test_distributed's two processes of one device each
    'test_sharding.py::test_eight_cpu_devices_equal_one_device[ci]',
    # host sweeps in CI: test_host_sweep_shares_a_cohort_gather_per_seed_and_round
    'test_populations.py::test_cli_host_layout_sweep_equals_separate_runs',
    # a full disk in CI: test_interruptions' metrics; rows in files resumed: the placements test
    'test_row_checkpoints.py::test_a_full_disk_while_writing_rows_is_one_line_and_resume_loses_nothing',
    'test_row_checkpoints.py::test_cli_trials_with_rows_in_files_resume_in_memory_equal_one_whole_run',
    'test_client_rows_on_disk.py::test_cli_client_state_disk_equals_memory_and_auto_moves_rows_to_files',
    # other partitions' draws, test_distributed's incomplete launch settings, test_fedjax_api's
    # clients by id, the executors' heavy-tailed equality cover these subjects in CI
    'test_partition.py::test_dirichlet_10000_clients_tiny_alpha_draws_once_per_class',
    'test_distributed.py::test_processes_with_other_flags_stop_before_writing',
    'test_populations.py::test_clients_by_id_in_python_and_the_cli',
    'test_scale.py::test_results_do_not_depend_on_block_size[4]',
    # held-out test clients in CI: test_formats' TFF CIFAR-100 check
    'test_populations.py::test_cli_cifar100_held_out_test_clients[host]',
    # a resume with other settings refused in CI: test_input_pipelines' (the run identity's check)
    'test_faults.py::test_resume_refuses_another_configuration',
    'test_numerics.py::test_the_run_records_its_numerics_and_refuses_another_on_resume',
    # Ctrl-C in CI: a reproduce script's one line; a resume's numbers: test_checkpoint's
    'test_interruptions.py::test_signal_stops_after_the_round_and_resume_equals_uninterrupted[2-130-interrupted]',
    # the CLI's compilation cache (the suite itself runs on one: conftest)
    'test_time_to_result.py::test_cache_gives_the_same_numbers_and_damaged_entries_are_compiled_again',
    # evaluation against a plain loop in CI: every executor test evaluates after its rounds
    'test_engine.py::test_evaluation_in_test_length_groups_matches_plain_loop[vmap]',
    'test_clustering.py::test_silhouette_choice_matches_sklearn_loop',
    'test_clustering.py::test_kmeans_on_blobs_and_padding',
    'test_models.py::test_strided_and_explicitly_padded_convolutions_equal_lax_conv[CNHW]',
    'test_personalization.py::test_fedalt_and_fedsim_differ_and_match_across_executors',
    'test_partition.py::test_semantic_features_cluster_by_class_better_than_pixels',
    'test_fedfomo_cfl.py::test_fedfomo_in_group_share_of_positive_weight',
    'test_gldv2.py::test_image_size_is_refused_for_other_data_sets',
}


# Parametrized checks whose variants run the same code on other values: CI
# runs the variants named here, the others are marked slow (the whole matrix:
# python -m pytest -m slow). Chosen to keep one of each code path: the
# executors auto picks (blocked_threads on a CPU, vmap on a GPU), rows in
# files and in memory, each reproduce script's flag checking.
CI_VARIANTS = {
    # rows read and written in place: Ditto (pFedMe and APFL share its code; Local
    # runs with -m slow)
    'test_rows_in_place.py::test_rows_in_place_equal_rows_written_after': {'ditto'},
    # client_momentum: FedAvg, one algorithm of each kind of client state
    'test_config.py::test_no_silent_setting': {
        'fedavg-client_momentum', 'scaffold-client_momentum', 'ditto-client_momentum',
        'fedalt-client_momentum', 'pfedme-client_momentum', 'feddyn-client_momentum'},
    'test_reproduce.py::test_bad_flags_exit_2_naming_the_flag': {
        'reproduce_user_centric.py-args0---methods', 'reproduce_debiasing.py-args4---tables',
        'reproduce_debiasing.py-args8---personal_methods', 'reproduce_fedfomo.py-args10---settings',
        'reproduce_fedfomo.py-args12---dp_sigmas'},
    'test_clustering.py::test_kmeans_inertia_no_worse_than_sklearn_on_w': {'3'},
    'test_engine.py::test_round_compiles_once_per_run': {'blocked_threads', 'vmap'},
    'test_engine.py::test_padded_client_gets_what_it_gets_alone': {'vmap', 'sequential'},
    # against a per-client loop: the vmapped round (a GPU's); the CPU's executor: test_populations'
    'test_engine.py::test_round_matches_plain_per_client_loop': {'fedavg-vmap', 'fedprox-vmap'},
    # rows in files equal rows in memory: Ditto's personal models
    'test_client_rows_on_disk.py::test_rows_on_disk_equal_rows_in_memory': {'ditto-None-False'},
    'test_seed_models.py::test_resnet_equals_the_seeds_pytorch_code': {'resnet18_gn-shape0-62-True'},
    'test_personalization.py::test_partial_presets': {'adapter'},
    'test_personalization.py::test_partial_shared_is_weighted_average_and_nothing_personal_is_uploaded':
        {'alt'},
    'test_personalization.py::test_partial_personal_leaves_change_only_in_own_state': {'sim'},
    'test_row_checkpoints.py::test_resume_equals_uninterrupted_in_either_placement':
        {'files-files'},
    'test_model_init.py::test_fedavg_round_equals_a_pytorch_loop_from_the_same_weights': {'0.9'},
    'test_model_init.py::test_reference_cnns_equal_their_pytorch_code':
        {'reddi_emnist_cnn', 'feddyn_cnn'},
    'test_seed_tasks.py::test_task_flagfile_builds_on_made_files': {
        'partial_emnist_resnet', 'reddi_shakespeare_lstm', 'reddi_stackoverflow_lstm',
        'reddi_cifar100_resnet'},
    'test_fednova_qffl.py::test_qffl_round_by_hand': {'2.0'},
    'test_models.py::test_conv_as_matmul_equals_lax_conv': {
        f'shape1-kernel1-{p}-{l}' for p in ('SAME', 'VALID')
        for l in ('NHWC-0', 'NHWC-1', 'CNHW-0', 'CNHW-1', 'CNHW-10000')},
}


def _slow_in_ci(nodeid: str) -> bool:
  """Whether a test (its id below tests/) runs only with -m slow."""
  if nodeid in SLOW_IN_CI:
    return True
  name, _, variant = nodeid.partition('[')
  return name in CI_VARIANTS and variant.rstrip(']') not in CI_VARIANTS[name]


# Modules whose numbers depend on the backend (precision, convolutions,
# sharding, memory plans, donation, executors' equality with a per-client
# loop): marked accelerator, the tests benchmarks/accelerator.py runs on a GPU.
ACCELERATOR_MODULES = {
    'test_engine.py', 'test_numerics.py', 'test_models.py', 'test_sharding.py', 'test_memory.py',
    'test_usercentric.py', 'test_personalization.py', 'test_scale.py', 'test_layout.py',
}


@pytest.hookimpl(tryfirst=True)  # before -m "not slow" deselects
def pytest_collection_modifyitems(config, items):
  """Tests in ``SLOW_IN_CI`` and the variants ``CI_VARIANTS`` leaves out are
  marked slow, those of
  ``ACCELERATOR_MODULES`` accelerator. Tests marked
  ``needs_data(file, ...)`` (a file, or a tuple of alternative names) skip,
  naming the file and how to get it, unless $FEDJAX_PERSONAL_DATA holds it."""
  folder = os.environ.get('FEDJAX_PERSONAL_DATA')
  for item in items:
    if _slow_in_ci(item.nodeid.split('tests/', 1)[-1]):
      item.add_marker(pytest.mark.slow)
    if item.nodeid.split('tests/', 1)[-1].split('::')[0] in ACCELERATOR_MODULES:
      item.add_marker(pytest.mark.accelerator)
    marker = item.get_closest_marker('needs_data')
    if marker is None:
      continue
    for want in marker.args:
      names = (want,) if isinstance(want, str) else tuple(want)
      if folder and any(os.path.isfile(os.path.join(folder, n)) for n in names):
        continue
      get = next((f'python scripts/run_experiment.py --dataset={_DOWNLOAD[n]} --download '
                  'saves it in ~/.cache/fedjax_personal' for n in names if n in _DOWNLOAD),
                 'no download: a local copy only')
      item.add_marker(pytest.mark.skip(
          reason=f'needs {" or ".join(names)}: set FEDJAX_PERSONAL_DATA to a folder holding it '
                 f'({get})'))
      break


@pytest.fixture(autouse=True)
def _reset_flags():
  """Flags parsed by a test (helpers.parse_flags) do not leak into the next."""
  yield
  flags.FLAGS.unparse_flags()

# One persistent XLA compilation cache for the whole test session (and the
# scripts it starts as subprocesses, through the environment): many tests
# compile the same programs (same model, data shapes and algorithm in new
# closures), which then compile once (measured: test_engine and
# test_personalization 241 s instead of 296 s on 2 cores).
import jax  # noqa: E402

if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:  # the session's own, removed at its end
  os.environ['JAX_COMPILATION_CACHE_DIR'] = tempfile.mkdtemp(prefix='fedjax_personal_xla_cache_')
  atexit.register(shutil.rmtree, os.environ['JAX_COMPILATION_CACHE_DIR'], True)
_CACHE = os.environ['JAX_COMPILATION_CACHE_DIR']
jax.config.update('jax_compilation_cache_dir', _CACHE)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
# The tests' own reference computations (outside the engine, which sets its
# own precision) at float32 on every card, as the engine's default: the
# suite asks this of JAX, the package does not.
jax.config.update('jax_default_matmul_precision', 'highest')


@pytest.fixture
def made_not_released(monkeypatch):
  """Made files have the published names, not the releases' bytes: drop the
  releases' checksums and sizes (test_formats checks those on their own)."""
  import dataclasses
  from fedjax_personal.datasets import sources
  monkeypatch.setattr(sources, 'FILES', {
      k: tuple(dataclasses.replace(f, md5=None, sha256=None, size=None) for f in v)
      for k, v in sources.FILES.items()})
