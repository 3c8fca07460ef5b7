"""Suite-wide test setup.

Hypothesis: the derandomized "ci" profile (deadline=None: numba JIT and CI load make wall-time
deadlines flaky) is loaded by default; ``HYPOTHESIS_PROFILE=dev`` explores fresh random examples.
The planner's kernels are JIT-compiled once per session (docs/design.md §7.7, Hypothesis with numba).

The quick lane, ``python -m pytest -q -m "not slow"``: the tests listed in :data:`SLOW` are
marked ``slow`` here, by node id (tests/kernels, tests/serve, tests/models and
tests/cli/test_generate.py included, whose files other owners keep), unless :data:`QUICK` keeps
them as their area's fast representative. Slow are the tests that spawn processes (a rank, a
torchrun world, a ``cpplan`` interpreter: about 1 s to 4 s of CPU each to start) and the long
ones (by measured duration, ``--durations``). In the quick lane, properties written with
``tests.lane.examples`` run on fewer examples.
"""

import fnmatch
import os
import warnings

import pytest
from hypothesis import HealthCheck, settings

from tests import lane

# On a failure Hypothesis writes a patch through libcst, whose import emits a DeprecationWarning
# (mypy_extensions.TypedDict) that "warnings are errors" turns into a pytest INTERNALERROR that
# hides the falsifying example. Import it once here, where the warning is expected.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        import hypothesis.extra._patching  # noqa: F401
    except ImportError:
        pass

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# node-id patterns (fnmatch) marked slow, by why
SLOW = (
    # spawned worlds: one process per rank, torchrun
    "tests/dist/*",
    "tests/cli/test_cli_simulate.py::test_simulate_json_record_replay_inspect",
    "tests/cli/test_cli_simulate.py::test_simulate_with_graph_sizes_*",
    "tests/cli/test_cli_simulate.py::test_simulate_shared_layers_*",
    "tests/cli/test_cli_simulate.py::test_simulate_divergence_*",
    "tests/cli/test_cli_simulate.py::test_simulate_injection_*",
    "tests/cli/test_cli_simulate.py::test_simulate_record_write_failure_*",
    "tests/cli/test_generate.py::*",
    "tests/cli/test_generate_progress.py::test_per_step_lines_only_with_verbose*",
    # a real `cpplan` process per case (the in-process tests check the same refusals)
    "tests/cli/test_cli.py::*",
    "tests/cli/test_closed_streams.py::*",
    "tests/cli/test_cli_simulate.py::test_replay_bad_input",
    "tests/cli/test_cli_simulate.py::test_simulate_and_replay_help_have_examples",
    "tests/cli/test_cli_simulate.py::test_simulate_bad_input_exit_2_in_a_real_process",
    "tests/cli/test_bounded_memory.py::test_replay_refuses_oversized_plans_up_front*",
    "tests/cli/test_hostile_cli.py::test_broken_pipe_is_quiet*",
    "tests/cli/test_hostile_cli.py::test_sigterm_mid_write_*",
    "tests/cli/test_hostile_cli.py::test_fifo_does_not_hang_a_real_process",
    "tests/planner/test_planner_determinism.py::test_subprocess_reproduces_digests",
    "tests/schemas/test_determinism.py::test_bytes_and_digests_identical_across_hash_seeds",
    # long: whole steps through every rank, the serving engine, the model forward, a draw
    "tests/sim/test_replay.py::*",
    "tests/runtime/test_shared_and_sampled.py::test_shared_layers_match_the_oracle_*",
    "tests/runtime/test_shared_and_sampled.py::test_sampled_rows_equal_the_full_restores_rows*",
    "tests/runtime/test_shared_and_sampled.py::test_shared_layer_equals_recomputing_*",
    "tests/runtime/test_prefill_keys.py::test_gathered_prefill_keys_match_the_oracle*",
    "tests/runtime/test_model_api.py::test_attention_uses_the_models_scale*",
    "tests/runtime/test_faults_units.py::test_transport_error_prefers_the_announced_*",  # waits
    "tests/serve/test_engine.py::*",
    "tests/models/test_forward.py::*",
    "tests/models/test_loading.py::*",
    "tests/models/test_reference.py::*",
    "tests/cli/test_hostile_cli.py::test_draw_writes_atomically_on_a_full_disk",
    # kernels under Triton's interpreter: a few representatives below stay quick
    "tests/kernels/test_triton_kernels.py::*",
    "tests/kernels/test_indexer_tiled.py::*",
    "tests/kernels/test_flashmla.py::*",
    "tests/kernels/test_jit_variants.py::*",
    "tests/kernels/test_attention_plan.py::test_explicit_plans_run_as_given*",
    "tests/kernels/test_layout.py::test_every_module_imports_alone",  # a process per module
    # the CUDA row top-k built for the host: a compile a variant (1-3 s) and CTAs of up to 1024
    # threads (tests/kernels/test_row_topk.py); the one-pass half of the host cases
    "tests/kernels/test_row_topk.py::test_row_topk_on_the_host_in_the_gpu_shape*",
    "tests/kernels/test_row_topk.py::test_row_topk_one_pass_*on_the_host*",
    "tests/kernels/test_row_topk.py::test_row_topk_sorts_on_the_host*",
    "tests/kernels/test_row_topk.py::test_row_topk_rank_pairs_on_the_host*",
    "tests/kernels/test_row_topk.py::test_row_topk_refinement_on_the_host*",
    "tests/kernels/test_row_topk.py::test_row_topk_on_the_host_equals_reference[[]*-one-pass[]]",
    "tests/kernels/test_row_topk.py::test_build_compiles_and_caches",
    "tests/kernels/test_row_topk.py::test_row_topk_with_os_threads_equals_reference*",
    "tests/kernels/test_host_emulation.py::*",
    "tests/kernels/test_ws_logits.py::test_last_wave_split_ends_soonest*",
)
# the fast representative of an area that SLOW would otherwise leave out of the quick lane
QUICK = (
    "tests/cli/test_cli.py::test_plan_prints_digest_and_is_byte_stable",
    "tests/cli/test_cli.py::test_inspect_json_keys_and_golden[[]mixed_p4w4[]]",
    "tests/cli/test_cli.py::test_bad_input_is_one_line_exit_2[[]*",  # in-process
    "tests/cli/test_generate.py::test_bad_prompts_are_one_line*",
    "tests/sim/test_replay.py::test_replay_matches_oracle[[]fp8_ds_mla-pwi3[]]",
    "tests/serve/test_engine.py::test_a_job_the_engine_was_not_built_for_is_refused*",
    "tests/kernels/test_triton_kernels.py::test_lse_merge*",
    "tests/kernels/test_triton_kernels.py::test_pack_bit_identical*",
    "tests/kernels/test_triton_kernels.py::test_dequantize_fp8_ds_mla_exact*",
    "tests/kernels/test_triton_kernels.py::test_dispatch_table*",
    "tests/kernels/test_indexer_tiled.py::test_zero_queries*",
    "tests/kernels/test_flashmla.py::test_flashmla_indices*",
    "tests/kernels/test_flashmla.py::test_pad_heads_zero_rows*",
    "tests/kernels/test_row_topk.py::test_row_topk_on_the_host_in_the_gpu_shape[[]default[]]",
)


def pytest_configure(config):
    """The quick lane is a mark expression that leaves the slow tests out (``-m "not slow"``);
    set before the test modules are imported, which read it through tests.lane.examples."""
    lane.QUICK = "not slow" in (config.getoption("markexpr") or "")


def pytest_collection_modifyitems(config, items):
    for item in items:
        node = item.nodeid
        if any(fnmatch.fnmatchcase(node, p) for p in SLOW) and not any(
                fnmatch.fnmatchcase(node, p) for p in QUICK):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def _planner_kernels_compiled():
    """JIT the planner once per session, before any test times itself."""
    from cpplan.planner import compile_planner_kernels

    compile_planner_kernels()


@pytest.fixture
def full_disk(monkeypatch):
    """Every file written through ``os.fdopen`` fails with ENOSPC (a full disk), as the atomic
    writer sees it; closing still works."""
    import errno

    real = os.fdopen

    class FullDisk:
        def __init__(self, fd, mode):
            self.handle = real(fd, mode)

        def __enter__(self):
            return self

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __exit__(self, *exc):
            self.handle.close()

    monkeypatch.setattr(os, "fdopen", FullDisk)
