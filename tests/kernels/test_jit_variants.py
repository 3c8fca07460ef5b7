"""Kernel specialisations of a run of steps (bench/jit_variants.py, on the CPU, nothing
executed): after the first steps of each kind, no step needs a new compile. Before the
step-varying ints and index pointers were left unspecialised, 26 of the 33 specialisations of
the simulate preset's 24 steps were first needed after step 0 (each a compile of seconds on a
GPU), which is what made ``cpplan simulate --backend nccl`` 9x slower than gloo."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from cpplan.sim.simulate import SimOptions

_PATH = Path(__file__).resolve().parents[2] / "bench" / "jit_variants.py"


@pytest.fixture(scope="module")
def jv():
    from triton.runtime.interpreter import InterpretedFunction

    from cpplan.runtime.kernels.triton import indexer_logits_jit

    if not isinstance(indexer_logits_jit.logits_kernel, InterpretedFunction):
        pytest.skip("counts launches through the Triton interpreter (TRITON_INTERPRET=1, no CUDA)")
    spec = importlib.util.spec_from_file_location("jit_variants", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("pw", [(2, 2), (1, 2), (2, 1)])
def test_no_kernel_specialisation_is_first_needed_after_step_one(jv, pw):
    plans = jv.record_steps(SimOptions(pcp=pw[0], dcp=pw[1]), 24)
    firsts = jv.count(plans).first_steps()
    late = {name: steps for name, steps in firsts.items() if max(steps) > 1}
    assert firsts and not late, late


def test_the_count_sees_step_varying_specialisations(jv):
    """The recorder is sharp: with every int and pointer specialised again, later steps do need
    new variants (the launch keys really vary with the step)."""
    plans = jv.record_steps(SimOptions(pcp=2, dcp=2), 24)
    firsts = jv.count(plans, respect_do_not_specialize=False).first_steps()
    assert sum(1 for steps in firsts.values() for s in steps if s > 1) >= 10


@pytest.mark.parametrize("pw", [(2, 2), (1, 2), (2, 1), (1, 1)])
@pytest.mark.parametrize("kv", ["fp8_ds_mla", "bf16"])
def test_after_warmup_no_step_needs_a_new_specialisation(jv, pw, kv):
    """cpplan.warmup's synthetic steps compile every variant the simulate preset's 40 steps
    (decode-only steps padded to graph sizes included) need: nothing is left for the steps."""
    opts = SimOptions(pcp=pw[0], dcp=pw[1], kv_cache_dtype=kv, graphs=True)
    firsts = jv.count(jv.record_steps(opts, 40), warm=True).first_steps()
    by_steps = {name: steps for name, steps in firsts.items() if max(steps) >= 0}
    assert firsts and not by_steps, by_steps
