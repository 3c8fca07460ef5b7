"""How many Triton kernel variants a run of steps compiles, counted on the CPU.

    python bench/jit_variants.py [--steps 24] [--pcp 2 --dcp 2] [--graphs] [--no-fix] [--warmup]

Triton compiles one binary per *specialisation* of a kernel: its constexpr values, the launch
options, each tensor's dtype and 16-byte alignment, and each int argument's class (== 1, a
multiple of 16, other); an argument listed in ``do_not_specialize`` keeps only its type. A GPU run pays one
compile (1-10 s each for the select and attention kernels) per new specialisation, per process.
This counts them without a GPU and without executing a kernel: the steps of ``cpplan simulate``'s
preset (recorded on the CPU first) go through every rank's StepExecutor with the Triton set,
whose launches are intercepted (``TRITON_INTERPRET=1``; each launch records its key and returns
at once: the executor never reads device values, so the launch sequence is the real one). The
device is described as an H200 (132 SMs, sm_90) to the launch-size arithmetic; the Gluon decode
is left out (the Triton heads kernels take its place). ``--no-fix`` counts with the step-varying
int arguments specialised again (what the kernels did before ``do_not_specialize`` covered them).

Prints, per kernel: launches, distinct specialisations, and the first step that needed each.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import inspect
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from cpplan.api import compile as compile_plan  # noqa: E402
from cpplan.runtime.executor import LayerCache, StepExecutor  # noqa: E402
from cpplan.runtime.kernels import attention_plan  # noqa: E402
from cpplan.runtime.kernels.triton import (  # noqa: E402
    TRITON,  # noqa: E402
    indexer_select,
    indexer_tiled,
)
from cpplan.runtime.kernels.triton import plan as tplan
from cpplan.schemas.names import Group  # noqa: E402
from cpplan.sim.allocator import BlockAllocator  # noqa: E402
from cpplan.sim.scheduler import MiniScheduler, preset_requests  # noqa: E402
from cpplan.sim.simulate import (  # noqa: E402
    KV_TOKEN_BUDGET,
    MAX_RUNNING,
    TOKEN_BUDGET,
    SimOptions,
    preset_config,
)
from cpplan.warmup import warmup  # noqa: E402

H200 = attention_plan.DeviceSpec(kind="cuda", sm_count=132, capability=(9, 0))


class Recorder:
    """Intercepts every interpreted launch: its specialisation key, nothing executed."""

    def __init__(self, respect_do_not_specialize: bool) -> None:
        self.respect = respect_do_not_specialize
        self.keys: dict = collections.defaultdict(dict)  # kernel -> key -> first step
        self.launches: collections.Counter = collections.Counter()
        self.step = -1

    def key(self, fn: InterpretedFunction, args, kwargs) -> tuple:
        params = inspect.signature(fn.fn).parameters
        constexpr = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
        dns = set(fn.kwargs.get("do_not_specialize", ()) or ()) if self.respect else set()
        dns = {fn.arg_names[d] if isinstance(d, int) else d for d in dns}
        values = dict(zip(fn.arg_names, args))
        values.update({k: v for k, v in kwargs.items() if k in params})
        parts = []
        for name in fn.arg_names:
            v = values.get(name, params[name].default)
            if name in constexpr or isinstance(v, (bool, str)) or v is None:
                parts.append(v)
            elif isinstance(v, int):
                parts.append("int" if name in dns else 1 if v == 1 else 16 if v % 16 == 0
                             else "int")
            elif isinstance(v, torch.Tensor):  # unspecialised: no alignment class either
                parts.append((str(v.dtype), None if name in dns else v.data_ptr() % 16 == 0))
            else:
                parts.append(type(v).__name__)
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in params))
        return tuple(parts) + options

    @contextlib.contextmanager
    def installed(self):
        """Launches intercepted, the device described as an H200; all put back on exit."""
        recorder = self

        def run(fn, *args, grid=None, warmup=False, **kwargs):
            name = fn.fn.__name__
            recorder.launches[name] += 1
            recorder.keys[name].setdefault(recorder.key(fn, args, kwargs), recorder.step)

        saved = (InterpretedFunction.run, tplan.device_spec, tplan.gluon_available,
                 indexer_tiled._num_sms, indexer_select._num_sms)
        InterpretedFunction.run = run
        tplan.device_spec = lambda device: H200
        tplan.gluon_available = lambda: False
        indexer_tiled._num_sms = indexer_select._num_sms = lambda device: H200.sm_count
        try:
            yield self
        finally:
            (InterpretedFunction.run, tplan.device_spec, tplan.gluon_available,
             indexer_tiled._num_sms, indexer_select._num_sms) = saved

    def first_steps(self) -> dict:
        """kernel -> sorted first steps of its specialisations."""
        return {name: sorted(keys.values()) for name, keys in self.keys.items()}


def count(plans: list, respect_do_not_specialize: bool = True, warm: bool = False) -> Recorder:
    """The specialisations rank 0 needs for ``plans`` (ranks differ only in a constant);
    ``warm``: ``cpplan.warmup.warmup`` first (its launches count as step -1)."""
    rec = Recorder(respect_do_not_specialize)
    with rec.installed():
        run_rank(plans, 0, rec, warm)
    return rec


def record_steps(opts: SimOptions, steps: int) -> list:
    """The preset's global steps (the mini scheduler alone: the plans decide the launches)."""
    cfg = preset_config(opts)
    sched = MiniScheduler(preset_requests(cfg.pcp_size, cfg.max_model_len, num_long=4),
                          token_budget=TOKEN_BUDGET, max_running=MAX_RUNNING,
                          kv_token_budget=KV_TOKEN_BUDGET)
    plans = []
    for step_id in range(steps):
        step = sched.schedule(step_id)
        if step is None:
            break
        plans.append(compile_plan(cfg, step))
        sched.complete()
    return plans


class ShapesOnly:
    """A transport that moves nothing: one rank alone, its peers' data left as allocated (the
    launches depend on shapes only)."""

    def __init__(self, cfg) -> None:
        self.sizes = {Group.PCP: cfg.pcp_size, Group.DCP: cfg.dcp_size}

    def size(self, group) -> int:
        return self.sizes[Group(group)]

    def all_gather(self, group, out, inp, watch=None) -> None:
        pass

    def all_reduce_sum(self, group, tensor, watch=None) -> None:
        pass


def run_rank(plans: list, rank: int, rec: Recorder, warm: bool = False) -> None:
    """Every plan through rank ``rank``'s executor (Triton set, launches intercepted)."""
    cfg = plans[0].config
    pcp_rank, dcp_rank = (rank if cfg.pcp_size > 1 else 0), (rank if cfg.dcp_size > 1 else 0)
    ex = StepExecutor(cfg, sm_scale=576 ** -0.5, pcp_rank=pcp_rank, dcp_rank=dcp_rank, comm=ShapesOnly(cfg), device="cpu",
                      kernels=TRITON, max_tokens=TOKEN_BUDGET + MAX_RUNNING,
                      max_requests=MAX_RUNNING, debug=False)
    per_req = -(-cfg.shard_rows(cfg.max_model_len) // cfg.block_size)
    alloc = BlockAllocator(1 + 64 * per_req, cfg.block_size, cfg.dcp_size, dcp_rank,
                           cfg.interleave_size)
    caches = [LayerCache.empty(cfg, alloc.num_blocks, "cpu") for _ in range(cfg.num_layers)]
    act = torch.float32
    if warm:
        rec.step = -1
        warmup(ex)
    for plan in plans:
        rec.step = plan.step_id
        for rid, extent in zip(plan.req_ids, plan.extent()):
            alloc.ensure(rid, int(extent))
        bound = ex.bind(plan, alloc.table(plan.req_ids, per_req))
        n = plan.padded_num_tokens
        for cache in caches:
            ex.insert(bound, cache, torch.zeros(n, 576), torch.zeros(n, 128))
            ex.attend(bound, cache, torch.zeros(n, cfg.num_heads, 576, dtype=act),
                      torch.zeros(n, cfg.index_num_heads, 128, dtype=act),
                      torch.zeros(n, cfg.index_num_heads))
        ex.restore(bound, torch.zeros(n, cfg.hidden_size, dtype=act))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--pcp", type=int, default=2)
    ap.add_argument("--dcp", type=int, default=2)
    ap.add_argument("--graphs", action="store_true", help="the config's CUDA-graph sizes on")
    ap.add_argument("--kv-cache-dtype", choices=("fp8_ds_mla", "bf16"), default="fp8_ds_mla")
    ap.add_argument("--no-fix", action="store_true", help="specialise every int argument")
    ap.add_argument("--warmup", action="store_true", help="cpplan.warmup.warmup first (step -1)")
    a = ap.parse_args(argv)
    opts = SimOptions(pcp=a.pcp, dcp=a.dcp, graphs=a.graphs, kv_cache_dtype=a.kv_cache_dtype)
    plans = record_steps(opts, a.steps)
    rec = count(plans, respect_do_not_specialize=not a.no_fix, warm=a.warmup)
    print(f"# {len(plans)} steps of the simulate preset, P={a.pcp} W={a.dcp}"
          f"{' graphs' if a.graphs else ''}; do_not_specialize "
          f"{'ignored (--no-fix)' if a.no_fix else 'respected'}")
    print("| kernel | launches | specialisations | first needed at steps |")
    print("|---|---:|---:|---|")
    total = 0
    for name, firsts in sorted(rec.first_steps().items()):
        total += len(firsts)
        print(f"| {name} | {rec.launches[name]} | {len(firsts)} | {firsts} |")
    firsts = [s for steps in rec.first_steps().values() for s in steps]
    print(f"| total | {sum(rec.launches.values())} | {total} | "
          f"{sum(s >= 0 for s in firsts)} by the steps, {sum(s > 0 for s in firsts)} after "
          "step 0 |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
