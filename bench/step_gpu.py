"""One prefill-heavy step through the real StepExecutor, timed per layer and per phase.

    python bench/step_gpu.py [--json]                     # one GPU: P = W = 1, full model dims
    torchrun --standalone --nproc-per-node 4 bench/step_gpu.py --pcp 4 --dcp 4   # NCCL, 4 GPUs
    python bench/step_gpu.py --prompt 0 --context 65536:131072   # decode-only, long context
    python bench/step_gpu.py --prompt 0 --graphs          # decode-only: eager vs CUDA-graph replay
    python bench/step_gpu.py --prompt 0 --graphs --trace 5   # + device time per kernel
    torchrun --standalone --nproc-per-node 2 bench/step_gpu.py --pcp 2 --dcp 2 --prompt 0 --merge both
    python bench/step_gpu.py --tiny                       # CPU smoke run at toy sizes
    torchrun --standalone --nproc-per-node 2 bench/step_gpu.py --tiny --pcp 2 --dcp 2   # gloo

The work (issue 7): one prompt of ``--prompt`` tokens (32k, nothing cached) plus ``--decodes``
decodes (64) whose contexts are a few thousand tokens, at full model dims (128 heads, topk 2048,
576/512, fp8_ds_mla, indexer 64 x 128, bf16 activations) over ``--layers`` layers (4), with the
default kernels of the device (Triton on CUDA). Caches and inputs are random (timing only; the
oracle comparison is ``cpplan simulate``'s job), each rank fills its own shard; the queries are
the same on every rank, as a replicated decode row's are.

How the phases are timed. A plain step (``bind``, per layer ``insert`` + ``attend``,
``restore``, ``finish``; the executor and kernels untouched) is timed with two device events
around it: that is the step time. Then the same step is run again ``--repeat`` times through a
timing-only instrumented path that changes no step code: the executor gets a wrapped kernel set
(it takes ``kernels`` as a value), and for the duration of the run the named collectives of
``cpplan.runtime.collectives`` and the two key-rectangle helpers the executor imports are
replaced by wrappers. Each wrapper runs the original and then records a device event labelled
with its phase; the interval that ends at an event belongs to that phase, so glue work that
queues before an op (a staging ``index_select`` before a gather, the LSE weights before
``decode_out``) counts in that op's phase, and what follows the last op of ``attend`` (the
copy of the output rows) is "other". Phases: insert (``insert()``: quantise + ``kv_insert``
/ ``indexer_k_insert`` + cache writes), gather (``indexer_k_gather`` / ``kv_gather`` and their
staging), indexer (key rectangles + scores + top-k), attention (remap / local-slot filter +
sparse MLA), merge (``topk_candidates`` + re-selection, ``decode_lse``, ``decode_out``).
Events do not synchronise, so the instrumented step runs as the plain one does; both totals are
printed. On the CPU the marks are ``perf_counter`` readings (gloo collectives are synchronous).

With ``--graphs`` the config gets CUDA-graph sizes (powers of two up to 512), so a decode-only
step is graph-replayable (docs/design.md §5.6): the plain step is timed both eagerly and through
``runtime.graphs.StepGraphs`` (the per-layer ``insert`` + ``attend`` replayed; its inputs copied
into the graph's buffers every step, as an engine without static buffers would), same plan, same
run. The phase table is the eager step's (a replay has no per-op marks). Each timed step starts
from an idle device (so its time includes the host's bind); on CUDA the same steps are also
timed back to back, as an engine's loop runs them (the host binds step i + 1 while the device
runs step i), and the host time of each call (bind, the layers, restore, finish) is printed.

The verify cost next to it: the plan digest on the host (encode + xxh3-128), and with more
than one rank the digest exchange (``--digest-exchange``: the shared-memory board where the
ranks share a host, else the gloo all-gather), awaited, measured alone after a barrier (in a
step it starts at bind and is awaited before the first collective).
Several ranks: every figure is the maximum over ranks (a step ends with its slowest rank).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from cpplan.api import Groups, LayerCache, ParallelConfig, StepExecutor, StepInput, compile
from cpplan.runtime import collectives as coll
from cpplan.runtime.graphs import StepGraphs
from cpplan.runtime.kernels import get_kernels
from cpplan.runtime.kernels.dispatch import KernelBackendError
from cpplan.runtime.verify import DigestCheck
from cpplan.schemas.codec import digest
from cpplan.schemas.config import indexer_sources_from_types
from cpplan.schemas.errors import ConfigError
from cpplan.sim.allocator import BlockAllocator
from cpplan.sim.launch import join_torchrun, leave_torchrun, torchrun_env

COMPACT_CHOICES = {"auto": "auto", "on": True, "off": False}  # --dcp-compact -> StepExecutor
PHASES = ("insert", "gather", "indexer", "attention", "merge", "other")
KERNEL_PHASE = {"quantize_fp8_ds_mla": "insert", "quantize_indexer_k": "insert",
                "indexer_topk_prefill": "indexer", "indexer_topk_decode": "indexer",
                "merge_topk_candidates": "merge",
                "merge_local_slots": "merge", "filter_local_slots": "attention",
                "remap_to_gathered": "attention", "sparse_mla_attention": "attention",
                "sparse_mla_overflow": "attention"}
COLLECTIVE_PHASE = {"kv_insert": "insert", "indexer_k_insert": "insert",
                    "indexer_k_gather": "gather", "kv_gather": "gather",
                    "topk_candidates": "merge", "decode_lse": "merge", "decode_out": "merge",
                    "restore": "restore"}
FULL = dict(num_heads=128, topk=2048, index_num_heads=64, hidden_size=7168,
            activation_dtype="bfloat16", prompt=32768, decodes=64, context=(2048, 6144),
            layers=4)
TINY = dict(num_heads=8, topk=64, index_num_heads=4, hidden_size=512,
            activation_dtype="float32", prompt=256, decodes=8, context=(64, 192), layers=2)
GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


# ----------------------------------------------------------------------------- clocks
class Clock:
    """Marks on the device's timeline: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class PhaseLog:
    """Labelled marks; the interval that ends at a mark belongs to that mark's (layer, phase)."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.layer, self.marks = clock, None, []

    def point(self, phase: str) -> None:
        self.marks.append((self.layer, phase, self.clock.mark()))

    def table(self, num_layers: int) -> tuple[np.ndarray, dict]:
        """(ms [layers, PHASES], step-level ms {bind, restore}) after a sync."""
        per_layer = np.zeros((num_layers, len(PHASES)))
        step = {"bind": 0.0, "restore": 0.0}
        for (_, _, a), (layer, phase, b) in zip(self.marks, self.marks[1:]):
            ms = self.clock.ms(a, b)
            if layer is None:
                step[phase] = step.get(phase, 0.0) + ms
            else:
                per_layer[layer, PHASES.index(phase)] += ms
        return per_layer, step


class _NoLog:
    layer = None

    def point(self, phase: str) -> None:
        pass


def _after(fn, log, phase: str):
    def timed(*args, **kwargs):
        result = fn(*args, **kwargs)
        log.point(phase)
        return result
    return timed


@contextlib.contextmanager
def instrumented(ex: StepExecutor, log: PhaseLog):
    """Timing-only: wrapped kernels on ``ex`` and wrapped collectives in their module;
    everything is put back on exit."""
    saved_kernels = ex.kernels
    ex.kernels = dataclasses.replace(ex.kernels, **{
        op: _after(getattr(ex.kernels, op), log, ph) for op, ph in KERNEL_PHASE.items()})
    patched = [(coll, name, ph) for name, ph in COLLECTIVE_PHASE.items()]
    originals = [(mod, name, getattr(mod, name)) for mod, name, _ in patched]
    try:
        for mod, name, ph in patched:
            setattr(mod, name, _after(getattr(mod, name), log, ph))
        yield
    finally:
        ex.kernels = saved_kernels
        for mod, name, fn in originals:
            setattr(mod, name, fn)


# ----------------------------------------------------------------------------- the work
def build_config(args, dims: dict, world_pcp: int, world_dcp: int) -> ParallelConfig:
    extent = max(args.prompt, dims["context"][1] + 1)
    mml = -(-extent // 1024) * 1024
    graphs = GRAPH_SIZES if args.graphs else ()
    pattern = getattr(args, "indexer_pattern", None)
    sources = (indexer_sources_from_types((pattern * args.layers)[: args.layers]) if pattern
               else ())
    return ParallelConfig(cudagraph_token_sizes=graphs, pcp_size=world_pcp, dcp_size=world_dcp,
                          interleave_size=args.interleave, indexer_sources=sources,
                          kv_cache_dtype="fp8_ds_mla", num_layers=args.layers,
                          num_heads=dims["num_heads"], topk=dims["topk"],
                          index_num_heads=dims["index_num_heads"],
                          hidden_size=dims["hidden_size"],
                          activation_dtype=dims["activation_dtype"], max_model_len=mml)


def build_step(args, dims: dict) -> StepInput:
    """``--decodes`` decodes (contexts spread over the range), then one uncached prompt
    (none with ``--prompt 0``: a decode-only step)."""
    lo, hi = dims["context"]
    n = args.decodes
    ctx = lo + (np.arange(n, dtype=np.int64) * 1543) % max(hi - lo, 1)
    if args.context_order == "random":  # a batch's rows in no particular order of length
        ctx = np.random.default_rng(11).permutation(ctx)
    prompts = [args.prompt] if args.prompt > 0 else []
    ids = [f"d{i}" for i in range(n)] + ["prompt"] * len(prompts)
    c = np.concatenate([ctx, np.zeros(len(prompts), np.int64)])
    q = np.concatenate([np.ones(n, dtype=np.int64), np.asarray(prompts, np.int64)])
    return StepInput.build(0, ids, c, q, np.arange(n + len(prompts)) >= n)


@dataclasses.dataclass
class Rank:
    """One rank's bench state: executor, caches (random), tables and inputs of the step."""

    groups: Groups
    config: ParallelConfig
    plan: object
    ex: StepExecutor
    tables: np.ndarray
    caches: list
    x: dict
    attention: dict = dataclasses.field(default_factory=dict)  # pass -> plan of the last step
    graphs: StepGraphs | None = None  # --graphs: replays graph-replayable steps
    merge_kernels: object = None  # --merge both: the kernel set with the torch decode merge
    trace: int = 0  # --trace: steps profiled for the per-kernel table
    timeline: str | None = None  # --timeline: Chrome trace of the eager profiled steps


def setup_rank(args, dims: dict, groups: Groups) -> Rank:
    cfg, dev = groups.config, groups.device
    plan = compile(cfg, build_step(args, dims))
    per_req = -(-cfg.shard_rows(cfg.max_model_len) // cfg.block_size)
    alloc = BlockAllocator(1 + plan.num_requests * per_req, cfg.block_size, cfg.dcp_size,
                           groups.dcp_rank, cfg.interleave_size)
    for rid, extent in zip(plan.req_ids, plan.extent()):
        alloc.ensure(rid, int(extent))
    num_blocks = 1 + sum(len(b) for b in alloc.blocks.values())
    tables = alloc.table(plan.req_ids, per_req)
    if args.fragmented:  # a long-running server's cache: each request's blocks scattered
        perm = np.concatenate([[0], 1 + np.random.default_rng(7).permutation(num_blocks - 1)])
        tables = perm[tables].astype(tables.dtype)  # 0 (reserved / unused) stays 0
    kernels = with_indexer_tiles(get_kernels(dev.type, args.kernels), args.indexer_tiles)
    merge_kernels = None
    if args.merge != "kernel":  # the torch merge (two sorts, unfused LSE scaling) to compare
        from cpplan.runtime.kernels import reference as ref

        merge_kernels = dataclasses.replace(
            kernels, merge_topk_candidates=ref.merge_topk_candidates,
            merge_local_slots=ref.merge_local_slots, lse_scale=ref.lse_scale)
        if args.merge == "sort":
            kernels = merge_kernels
    ex = StepExecutor.from_groups(cfg, groups, sm_scale=576 ** -0.5, verify="every", kernels=kernels,
                                  digest_exchange=args.digest_exchange,
                                  max_tokens=plan.padded_num_tokens,
                                  max_requests=plan.num_requests,
                                  dcp_compact=COMPACT_CHOICES[args.dcp_compact])
    gen = torch.Generator(device=dev).manual_seed(1000 + groups.rank)
    caches = [_random_cache(cfg, num_blocks, dev, kernels, gen) for _ in range(cfg.num_layers)]
    act, t = coll.ACT_DTYPES[cfg.activation_dtype], plan.padded_num_tokens
    # the queries from one seed on every rank: a decode row is replicated on every rank
    # (docs/design.md §3.6), so its DCP ranks score their shards with the same query (drawn
    # per rank, a row's merged top-k came mostly from the rank whose query scored higher)
    shared = torch.Generator(device=dev).manual_seed(999)

    def rnd(*shape, dtype=torch.float32, g=gen):
        return torch.randn(*shape, generator=g, device=dev, dtype=dtype)

    x = {"q": rnd(t, cfg.num_heads, cfg.qk_head_dim, dtype=act, g=shared),
         "kv": rnd(t, cfg.qk_head_dim), "index_k": rnd(t, cfg.index_head_dim),
         "index_q": rnd(t, cfg.index_num_heads, cfg.index_head_dim, dtype=act, g=shared),
         "index_w": rnd(t, cfg.index_num_heads, g=shared).abs(),
         "hidden": torch.zeros(t, cfg.hidden_size, dtype=act, device=dev)}
    rank = Rank(groups, cfg, plan, ex, tables, caches, x)
    if args.merge == "both":
        rank.merge_kernels = merge_kernels
    rank.trace = args.trace
    rank.timeline = args.timeline and (args.timeline if groups.rank == 0
                                       else f"{args.timeline}.{groups.rank}")
    if args.graphs:
        rank.graphs = StepGraphs(ex, lambda bound, *xs: layers_body(rank, bound, *xs))
    return rank


def layers_body(r: Rank, bound, kv, index_k, q, index_q, index_w, log=None):
    """Every layer's insert + attend (the graphs' body); returns the last layer's output."""
    out = None
    for layer, cache in enumerate(r.caches):
        if log is not None:
            log.layer = layer
        full = r.ex.config.indexer_source(layer) == layer  # a shared layer: no index inputs
        r.ex.insert(bound, cache, kv, index_k if full else None)
        if log is not None:
            log.point("insert")
        out = r.ex.attend(bound, cache, q, index_q if full else None,
                          index_w if full else None)
        if log is not None:
            log.point("other")
    return out


def with_indexer_tiles(kernels, tiles: dict):
    """The kernel set with the tiled indexer launched under ``IndexerTiles(**tiles)``
    (--indexer-tiles; the set unchanged when empty or when its indexer is not the tiled one)."""
    from cpplan.runtime.kernels.triton import indexer_tiled

    if not tiles:
        return kernels
    if kernels.indexer_topk_decode is not indexer_tiled.indexer_topk_decode:
        raise ConfigError(f"--indexer-tiles applies to the Triton kernel set's tiled indexer: "
                          f"got kernels {kernels.name}")
    t = indexer_tiled.IndexerTiles(**tiles)
    return dataclasses.replace(
        kernels, name=f"{kernels.name} (indexer tiles {tiles})",
        indexer_topk_decode=functools.partial(indexer_tiled.indexer_topk_decode, tiles=t),
        indexer_topk_prefill=functools.partial(indexer_tiled.indexer_topk_prefill, tiles=t))


def _indexer_tiles(text: str) -> dict:
    """``--indexer-tiles split_rows=0,programs_per_sm=4`` -> {field: value of its type}."""
    from cpplan.runtime.kernels.triton.indexer_tiled import IndexerTiles

    kinds = {f.name: type(f.default) for f in dataclasses.fields(IndexerTiles)}
    out = {}
    for item in filter(None, text.split(",")):
        name, eq, value = item.partition("=")
        if not eq or name not in kinds:
            raise argparse.ArgumentTypeError(
                f"expected FIELD=VALUE with FIELD one of IndexerTiles' fields: got {item!r}")
        kind = kinds[name]
        try:
            out[name] = bool(int(value)) if kind is bool else kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} expects {kind.__name__}: got {value!r}") from None
    return out


def _random_cache(cfg, num_blocks: int, dev, kernels, gen, chunk: int = 1 << 16) -> LayerCache:
    cache = LayerCache.empty(cfg, num_blocks, dev)
    for s0 in range(0, cache.kv.shape[0], chunk):
        s1 = min(s0 + chunk, cache.kv.shape[0])
        kv = torch.randn(s1 - s0, cfg.qk_head_dim, generator=gen, device=dev)
        cache.kv[s0:s1] = kernels.quantize_fp8_ds_mla(kv)
        k = torch.randn(s1 - s0, cfg.index_head_dim, generator=gen, device=dev)
        kernels.pack_indexer_k_into(cache.index_k, torch.arange(s0, s1, device=dev), k)
    return cache


def run_step(r: Rank, log, graphs: StepGraphs | None = None, host: dict | None = None) -> float:
    """One step exactly as an engine runs it (embedding API); ``log`` marks phase ends;
    ``graphs``: the per-layer work goes through it (replayed when the step has a graph key);
    ``host``: receives the host time of each call (ms: bind, layers, restore, finish).
    Returns the host time of ``bind`` in ms."""
    ex, x = r.ex, r.x
    t0 = time.perf_counter()
    bound = ex.bind(r.plan, r.tables)
    t1 = time.perf_counter()
    log.point("bind")
    inputs = (x["kv"], x["index_k"], x["q"], x["index_q"], x["index_w"])
    if graphs is not None:
        graphs.run(bound, *inputs)
    else:
        layers_body(r, bound, *inputs, log=log)
    t2 = time.perf_counter()
    log.layer = None
    ex.restore(bound, x["hidden"])
    t3 = time.perf_counter()
    ex.finish(bound)
    t4 = time.perf_counter()
    log.point("restore")
    r.attention = {k: p.describe() for k, p in bound.attention.items()}
    if host is not None:
        for key, a, b in (("bind", t0, t1), ("layers", t1, t2), ("restore", t2, t3),
                          ("finish", t3, t4)):
            host.setdefault(key, []).append((b - a) * 1e3)
    return (t1 - t0) * 1e3


# ----------------------------------------------------------------------------- measuring
def _barrier(r: Rank, clock: Clock) -> None:
    clock.sync()
    if r.groups.control is not None:
        dist.barrier(group=r.groups.control)


def time_steps(r: Rank, repeat: int, graphs: StepGraphs | None = None) -> dict:
    """Plain steps: device-event time bind..finish and host wall time (medians, ms), each
    step started from an idle device (synchronised, ranks at a barrier); the host time of
    each call of the step (medians, ms); and, on CUDA, ``repeat`` steps back to back (no
    synchronisation between them, as an engine's loop runs them: the host binds and
    launches step i + 1 while the device runs step i): the device time from the first
    bind to the last finish over the steps."""
    clock = Clock(r.groups.device)
    gpu, wall, host = [], [], {}
    for _ in range(repeat):
        _barrier(r, clock)
        t0 = time.perf_counter()
        a = clock.mark()
        run_step(r, _NoLog(), graphs, host)
        b = clock.mark()
        clock.sync()
        wall.append((time.perf_counter() - t0) * 1e3)
        gpu.append(clock.ms(a, b))
    out = {"step_ms": statistics.median(gpu), "step_wall_ms": statistics.median(wall),
           "bind_host_ms": statistics.median(host["bind"])}
    out.update({f"host_{k}_ms": statistics.median(v) for k, v in host.items()})
    if r.groups.device.type == "cuda":
        _barrier(r, clock)
        a = clock.mark()
        for _ in range(repeat):
            run_step(r, _NoLog(), graphs)
        b = clock.mark()
        clock.sync()
        out["back_to_back_ms"] = clock.ms(a, b) / repeat
    return out


def time_phases(r: Rank, repeat: int) -> tuple[np.ndarray, dict]:
    """Instrumented steps: medians over repeats of ms [layers, PHASES] and {bind, restore}."""
    clock = Clock(r.groups.device)
    tables, steps = [], []
    for _ in range(repeat):
        _barrier(r, clock)
        log = PhaseLog(clock)
        log.point("start")
        with instrumented(r.ex, log):
            run_step(r, log)
        clock.sync()
        per_layer, step = log.table(r.config.num_layers)
        tables.append(per_layer)
        steps.append(step)
    med = {k: statistics.median(s[k] for s in steps) for k in ("bind", "restore")}
    return np.median(np.stack(tables), axis=0), med


def time_merge_kernels(r: Rank, repeat: int) -> dict:
    """Plain steps (and, with --graphs, replays from fresh captures) with the torch decode
    merge swapped in; the kernel set is put back afterwards."""
    clock, saved = Clock(r.groups.device), r.ex.kernels
    r.ex.kernels = r.merge_kernels
    try:
        run_step(r, _NoLog())
        clock.sync()
        out = {f"merge_kernel_{k}": v for k, v in time_steps(r, repeat).items()}
        if r.graphs is not None:
            graphs = StepGraphs(r.ex, r.graphs.body)
            run_step(r, _NoLog(), graphs)
            clock.sync()
            out.update({f"merge_kernel_graph_{k}": v
                        for k, v in time_steps(r, repeat, graphs).items()})
    finally:
        r.ex.kernels = saved
    return out


def bind_parts(r: Rank, repeat: int) -> dict:
    """Host time of each part of ``bind`` alone (medians over max(50, repeat) calls, us): the
    block-table check, the host tables (written into the next arena, after its wait), the
    arena's commit (the H2D copy's launch and its event) and the digest (the exchange is timed
    in verify_costs)."""
    from cpplan.runtime.executor import DUMMY_SLOT
    from cpplan.runtime.segments import build_tables
    from cpplan.runtime.tables import TABLE_NAMES

    ex, plan, n = r.ex, r.plan, max(50, repeat)
    bt, _ = ex._check_bind(plan, r.tables, None)
    host = build_tables(plan, ex.pcp_rank, ex.dcp_rank, bt, DUMMY_SLOT)
    parts = {"check": lambda: ex._check_bind(plan, r.tables, None),
             "tables": lambda: build_tables(plan, ex.pcp_rank, ex.dcp_rank, bt, DUMMY_SLOT,
                                            out=ex.arena.acquire()),
             "pack": lambda: ex.arena.commit(TABLE_NAMES, host.sizes),
             "digest": lambda: digest(plan)}
    out = {}
    for name, fn in parts.items():
        t = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            t.append((time.perf_counter() - t0) * 1e6)
        out[f"bind_{name}_us"] = statistics.median(t)
    Clock(r.groups.device).sync()
    return out


def verify_costs(r: Rank, repeat: int) -> dict:
    """Host digest (encode + xxh3-128) in µs; the control-group exchange in ms (None at
    world 1: there is no one to compare with)."""
    t = []
    for _ in range(max(20, repeat)):
        t0 = time.perf_counter()
        digest(r.plan)
        t.append((time.perf_counter() - t0) * 1e6)
    out = {"digest_us": statistics.median(t), "exchange_ms": None}
    if r.groups.control is None:
        return out
    check, ex = DigestCheck(r.groups, "every", exchange=r.ex.check.exchange.kind), []
    for _ in range(max(10, repeat)):
        dist.barrier(group=r.groups.control)
        t0 = time.perf_counter()
        check.start(r.plan).wait()
        ex.append((time.perf_counter() - t0) * 1e3)
    check.close()
    out["exchange_ms"] = statistics.median(ex)
    return out


def measure(r: Rank, repeat: int) -> dict:
    clock = Clock(r.groups.device)
    run_step(r, _NoLog())  # warm-up: Triton compiles, allocator settles
    clock.sync()
    if r.groups.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    steps = time_steps(r, repeat)
    if r.graphs is not None:
        run_step(r, _NoLog(), r.graphs)  # the key's first step: eager, then captured
        clock.sync()
        graph = time_steps(r, repeat, r.graphs)
        steps.update({f"graph_{k}": v for k, v in graph.items()})
        steps["graph_captured"] = r.graphs.captured != {}
    if r.merge_kernels is not None:  # --merge both: the same step with the torch merge
        steps.update(time_merge_kernels(r, repeat))
    per_layer, step_level = time_phases(r, repeat)
    if r.trace and r.groups.device.type == "cuda":
        steps["trace"] = {"eager": trace_kernels(r, r.trace, timeline=r.timeline)}
        replayed = r.timeline and f"{r.timeline}.replayed"
        if r.graphs is not None:
            steps["trace"]["replayed"] = trace_kernels(r, r.trace, r.graphs, timeline=replayed)
        if r.timeline:
            from common import device_idle  # bench/common.py, beside this script

            for key, path in (("eager", r.timeline), ("replayed", replayed)):
                if key == "eager" or r.graphs is not None:
                    with open(path) as f:
                        steps.setdefault("timeline", {})[key] = device_idle(json.load(f))
    res = {**steps, **verify_costs(r, repeat), **bind_parts(r, repeat), "per_layer_ms": per_layer,
           "bind_ms": step_level["bind"], "restore_ms": step_level["restore"],
           "instrumented_ms": float(per_layer.sum()) + sum(step_level.values())}
    if r.groups.device.type == "cuda":
        res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return res


def trace_kernels(r: Rank, steps: int, graphs: StepGraphs | None = None, *,
                  timeline: str | None = None) -> list[tuple]:
    """Device time per kernel name over ``steps`` steps: rows (name, launches per step, us per
    step), largest first (``common.kernel_device_times``)."""
    from common import kernel_device_times  # bench/common.py, beside this script

    return kernel_device_times(lambda: run_step(r, _NoLog(), graphs), steps, timeline)


def max_over_ranks(r: Rank, res: dict) -> dict:
    """Every figure, maximum over ranks (gloo control group); unchanged at world 1."""
    if r.groups.control is None:
        return res
    keys = sorted(k for k, v in res.items() if isinstance(v, float))
    flat = np.concatenate([[res[k] for k in keys], res["per_layer_ms"].ravel()])
    mine = torch.from_numpy(flat.astype(np.float64))
    parts = [torch.empty_like(mine) for _ in range(r.groups.control_size)]
    dist.all_gather(parts, mine, group=r.groups.control)
    top = torch.stack(parts).amax(dim=0).numpy()
    out = dict(res, **{k: float(top[i]) for i, k in enumerate(keys)})
    out["per_layer_ms"] = top[len(keys):].reshape(res["per_layer_ms"].shape)
    return out


# ----------------------------------------------------------------------------- driver
def _context_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        lo_i, hi_i = int(lo), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI token counts: got {text!r}") from None
    if not sep or not 1 <= lo_i < hi_i:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 1 <= LO < HI: got {text!r}")
    return lo_i, hi_i


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pcp", type=int, default=1)
    ap.add_argument("--dcp", type=int, default=1)
    ap.add_argument("--interleave", type=int, default=1)
    ap.add_argument("--prompt", type=int,
                    help="prompt tokens (default 32768; --tiny 256; 0: a decode-only step)")
    ap.add_argument("--context", type=_context_range,
                    help="decode contexts LO:HI tokens (default 2048:6144; --tiny 64:192)")
    ap.add_argument("--decodes", type=int, help="decode requests (default 64; --tiny 8)")
    ap.add_argument("--layers", type=int, help="layers (default 4; --tiny 2)")
    ap.add_argument("--repeat", type=int, default=3, help="timed steps per measurement")
    ap.add_argument("--kernels", choices=("reference", "triton", "flashmla"),
                    help="kernel backend (default: the device's, Triton on CUDA)")
    ap.add_argument("--merge", choices=("sort", "kernel", "both"), default="kernel",
                    help="the W > 1 decode merge: the kernel set's (Triton: a merge of the "
                         "sorted lists, one fused LSE scaling), torch's (two sorts, unfused "
                         "scaling), or both timed in the same run")
    ap.add_argument("--indexer-tiles", type=_indexer_tiles, default={}, metavar="F=V,...",
                    help="launch the tiled indexer with these IndexerTiles fields, e.g. "
                         "split_rows=0 (Triton kernel set only)")
    ap.add_argument("--digest-exchange", choices=("auto", "shm", "gloo"), default="auto",
                    help="how the ranks' plan digests meet (runtime/exchange.py)")
    ap.add_argument("--dcp-compact", choices=("auto", "on", "off"), default="auto",
                    help="W > 1: decode attention over each rank's slots packed into a narrower "
                         "index plus an overflow pass (StepExecutor dcp_compact; auto: where "
                         "interleave_size == 1)")
    ap.add_argument("--context-order", choices=("spread", "random"), default="spread",
                    help="the decodes' contexts: spread (a rising sawtooth over the range, the "
                         "default) or the same contexts in a random order")
    ap.add_argument("--fragmented", action="store_true",
                    help="scatter the allocated cache blocks (a random permutation of the block "
                         "ids), as in a long-running server; default: each request's blocks "
                         "in a row")
    ap.add_argument("--graphs", action="store_true",
                    help="CUDA-graph sizes in the config; time the step eager and replayed")
    ap.add_argument("--trace", type=int, default=0, metavar="STEPS",
                    help="CUDA: profile STEPS eager steps (and, with --graphs, STEPS replays) "
                         "and print device time per kernel name and step (rank 0's)")
    ap.add_argument("--timeline", metavar="FILE",
                    help="CUDA, with --trace: also write the profiled eager steps' host and "
                         "device activity as a Chrome trace (rank r > 0 writes FILE.r; with "
                         "--graphs the replayed steps' to FILE.replayed) and print the "
                         "device's idle time")
    ap.add_argument("--indexer-pattern", metavar="FS..",
                    help="per layer F (own indexer) or S (reuses the previous full layer's "
                         "top-k, GLM-5's shared layers), repeated over the layers")
    ap.add_argument("--tiny", action="store_true", help="toy sizes (runs on a CPU)")
    ap.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    args = ap.parse_args(argv)
    dims = dict(TINY if args.tiny else FULL)
    if args.context is not None:
        dims["context"] = args.context
    args.context = dims["context"]
    if args.timeline and not args.trace:
        ap.error("--timeline needs --trace STEPS (the steps it records)")
    if args.prompt is not None and args.prompt < 0:
        ap.error(f"--prompt must be >= 0: got {args.prompt}")
    for name in ("prompt", "decodes", "layers"):
        if getattr(args, name) is None:
            setattr(args, name, dims[name])
    return args, dims


def make_groups(args, dims: dict):
    """(Groups, joined torchrun?) for P x W: torchrun's world, or this process alone."""
    world = max(args.pcp, args.dcp)
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        raise ConfigError("full model dims need a GPU: on a CPU run with --tiny")
    if not cuda and args.merge == "both":
        raise ConfigError("--merge both compares the Triton merge with torch's: it needs a GPU "
                          "(on a CPU both are the reference)")
    if not cuda and dims["activation_dtype"] == "bfloat16":
        dims["activation_dtype"] = "float32"
    env = torchrun_env()
    if env is None and world > 1:
        raise ConfigError(f"P = {args.pcp}, W = {args.dcp} needs {world} ranks: torchrun "
                          f"--standalone --nproc-per-node {world} bench/step_gpu.py ...")
    if env is not None and env.world_size != world:
        raise ConfigError(f"torchrun's world has {env.world_size} rank(s): --pcp {args.pcp} "
                          f"--dcp {args.dcp} needs {world}")
    config = build_config(args, dims, args.pcp, args.dcp)
    if env is None:
        dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
        return Groups(config=config, rank=0, world_size=1, pcp_rank=0, dcp_rank=0, pcp=None,
                      dcp=None, control=None, device=dev), False
    join_torchrun("nccl" if cuda else "gloo", timeout_s=600.0)
    return Groups.build(config), True


def _host_line(label: str, res: dict, prefix: str) -> str:
    """The host time of each call of a step, and the step's period back to back."""
    calls = ", ".join(f"{k} {res[f'{prefix}host_{k}_ms']:.3f}"
                      for k in ("bind", "layers", "restore", "finish")
                      if f"{prefix}host_{k}_ms" in res)
    b2b = res.get(f"{prefix}back_to_back_ms")
    return (f"{label}: host ms per call: {calls}"
            + (f"; back to back (no sync between steps) {b2b:.2f} ms a step" if b2b else "")
            + "\n")


def report(args, r: Rank, res: dict, stream) -> dict:
    cfg, g = r.config, r.groups
    dev = torch.cuda.get_device_name(g.device) if g.device.type == "cuda" else "cpu"
    backend = dist.get_backend() if dist.is_initialized() else "none (world 1)"
    per = res["per_layer_ms"]
    w = stream.write
    w(f"bench/step_gpu.py: P={cfg.pcp_size} W={cfg.dcp_size} I={cfg.interleave_size}, "
      f"{g.world_size} rank(s), {backend}, {dev}, kernels {r.ex.kernels.name}, torch "
      f"{torch.__version__}\n")
    lo, hi = args.context
    prompt = f"1 prompt of {args.prompt} tokens" if args.prompt else "no prompt"
    w(f"work: {prompt} + {args.decodes} decodes of {lo}..{hi - 1} context; T per rank "
      f"{r.plan.padded_num_tokens}; {cfg.num_layers} layers; H {cfg.num_heads}, topk {cfg.topk}, "
      f"indexer {cfg.index_num_heads}x{cfg.index_head_dim}, {cfg.kv_cache_dtype}, "
      f"{cfg.activation_dtype}; medians of {args.repeat}, max over ranks\n\n")
    w("| layer | " + " | ".join(f"{p} ms" for p in PHASES) + " | layer ms |\n")
    w("|---:|" + "---:|" * (len(PHASES) + 1) + "\n")
    for k, row in enumerate(per):
        w(f"| {k} | " + " | ".join(f"{v:.2f}" for v in row) + f" | {row.sum():.2f} |\n")
    mean = per.mean(axis=0)
    w("| mean | " + " | ".join(f"{v:.2f}" for v in mean) + f" | {mean.sum():.2f} |\n\n")
    if "graph_step_ms" in res:
        how = "replayed" if res["graph_captured"] else "not replayed: no graph key, or no CUDA"
        w(f"step through StepGraphs ({how}, device events bind..finish): "
          f"{res['graph_step_ms']:.2f} ms; host wall {res['graph_step_wall_ms']:.2f} ms; "
          f"eager / graph {res['step_ms'] / res['graph_step_ms']:.2f}x\n")
        w(_host_line("  replayed", res, "graph_"))
    if "merge_kernel_step_ms" in res:
        w(f"the same step with the torch decode merge (--merge both): "
          f"{res['merge_kernel_step_ms']:.2f} ms eager (kernel set's: {res['step_ms']:.2f})")
        if "merge_kernel_graph_step_ms" in res:
            w(f"; {res['merge_kernel_graph_step_ms']:.2f} ms replayed (kernel set's: "
              f"{res['graph_step_ms']:.2f})")
        w("\n")
    exch = res["exchange_ms"]
    w(f"step (plain, device events bind..finish): {res['step_ms']:.2f} ms; host wall "
      f"{res['step_wall_ms']:.2f} ms; instrumented {res['instrumented_ms']:.2f} ms "
      f"(bind {res['bind_ms']:.2f}, restore+finish {res['restore_ms']:.2f})\n")
    w(_host_line("  plain", res, ""))
    w(f"verify: digest on host {res['digest_us']:.1f} us; exchange "
      + (f"{exch:.3f} ms" if exch is not None else "none (world 1)")
      + f"; bind on host {res['bind_host_ms']:.3f} ms (alone, us: check "
      f"{res['bind_check_us']:.0f}, tables into the arena {res['bind_tables_us']:.0f}, H2D "
      f"{res['bind_pack_us']:.0f}, digest {res['bind_digest_us']:.0f})\n")
    if "peak_gib" in res:
        w(f"peak device memory {res['peak_gib']:.1f} GiB\n")
    for name, plan in r.attention.items():
        w(f"attention {name}: {plan}\n")
    for how, t in res.get("timeline", {}).items():
        path = r.timeline if how == "eager" else f"{r.timeline}.{how}"
        w(f"\ntimeline {path} ({how}, {args.trace} steps): device busy {t['busy_ms']:.2f} of "
          f"{t['span_ms']:.2f} ms, idle {t['idle_ms']:.2f} ms, of which "
          f"{t['idle_before_long_ms']:.2f} before the first kernel of 1 ms or more\n")
    for how, rows in res.get("trace", {}).items():
        total = sum(us for _, _, us in rows)
        w(f"\nkernels of a step ({how}, rank 0, torch.profiler device time): {total:.1f} us\n")
        w("| kernel | per step | us per step |\n|---|---:|---:|\n")
        for name, n, us in rows[:30]:
            w(f"| {name[:90]} | {n:.0f} | {us:.1f} |\n")
    return {"attention": r.attention, "pcp": cfg.pcp_size, "dcp": cfg.dcp_size, "world": g.world_size,
            "backend": backend, "device": dev, "kernels": r.ex.kernels.name,
            "prompt": args.prompt, "decodes": args.decodes, "layers": cfg.num_layers,
            "tokens_per_rank": r.plan.padded_num_tokens, "repeat": args.repeat,
            "phases": list(PHASES), "per_layer_ms": per.round(4).tolist(),
            **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()
               if k != "per_layer_ms"}}


def main(argv=None) -> int:
    args, dims = parse_args(argv)
    try:
        groups, joined = make_groups(args, dims)
    except ConfigError as exc:
        sys.stderr.write(f"bench/step_gpu.py: error: {exc}\n")
        return 2
    try:
        try:
            r = setup_rank(args, dims, groups)
        except (ConfigError, KernelBackendError) as exc:  # the same arguments on every rank
            sys.stderr.write(f"bench/step_gpu.py: error: {exc}\n")
            return 2
        res = max_over_ranks(r, measure(r, args.repeat))
        if groups.rank == 0:
            summary = report(args, r, res, sys.stderr if args.json else sys.stdout)
            if args.json:
                print(json.dumps(summary))
        # the executor and any captured graphs (which hold NCCL work) go before the groups do,
        # as in cpplan simulate's workers (the two-rank bench once did not exit after its report)
        del r
        gc.collect()
        if groups.device.type == "cuda":
            torch.cuda.synchronize()
    finally:
        if joined:
            leave_torchrun()
    return 0


if __name__ == "__main__":
    sys.exit(main())
