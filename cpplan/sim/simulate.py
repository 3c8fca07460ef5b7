"""``cpplan simulate``'s per-rank body: the mini serving loop over a real torch.distributed world
(ranks spawned by ``cpplan simulate`` itself, or the ranks of a torchrun world).

Every rank runs the same deterministic scheduler, compiles each step, binds it (digest check),
runs the reference layers through the embedding API, restores, and checks its share of the
requests (index % world == rank) against the single-device oracle. Results are summed over the
control group at the end. A rank can be made to diverge at one step (``Inject``) to show the
digest check stopping every rank before any data collective; for tests a rank can also be made
to die, hang or stop (``kill``) or to fail locally in bind, insert or attend (``fail``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
import traceback

import msgspec
import torch
import torch.distributed as dist

from cpplan.api import Groups, LayerCache, StepExecutor, StepGraphs, record_plan
from cpplan.api import compile as compile_plan
from cpplan.schemas.config import ParallelConfig, indexer_sources_from_types
from cpplan.schemas.errors import ConfigError, CpplanError, OutputError, StepInputError
from cpplan.schemas.files import write_atomic
from cpplan.schemas.step import StepInput
from cpplan.sim import coords
from cpplan.sim.allocator import BlockAllocator
from cpplan.sim.model import request_keys_on, run_step, step_layers
from cpplan.sim.oracle import max_abs_error, oracle_step
from cpplan.sim.scheduler import MiniScheduler, preset_requests
from cpplan.warmup import warmup

INJECT_KINDS = ("reorder", "q+1", "drop", "config", "step-id")
KILL_KINDS = ("exit", "hang", "stop")  # die / stay alive and silent / SIGSTOP itself
# where a rank raises locally; "skip-attend": it leaves out the step's attend calls (an engine
# bug), so its next collective is not the plan's next: caught before it is issued
FAIL_KINDS = ("bind", "insert", "attend", "restore", "skip-attend")
# float32 on CPU: ranks and oracle select the same keys (exact integer indexer scores) and read
# the same dequantised rows; what differs is the summation order (einsum blocking, the LSE merge
# over W partial softmaxes), a few float32 ulps of outputs bounded by 1: 1e-7 measured.
TOLERANCE = 2e-5


@dataclasses.dataclass(frozen=True)
class Inject:
    step: int
    rank: int
    kind: str = "q+1"


@dataclasses.dataclass(frozen=True)
class SimOptions:
    pcp: int = 2
    dcp: int = 2
    interleave: int = 1
    kv_cache_dtype: str = "fp8_ds_mla"
    steps: int = 24
    seed: int = 0
    layers: int = 2
    backend: str = "gloo"
    verify: str = "every"
    verify_every: int = 4
    digest_exchange: str = "auto"  # runtime/exchange.py: "auto", "shm" or "gloo"
    dcp_compact: bool | int | str = "auto"  # StepExecutor(dcp_compact=): W > 1 decode over packed slots
    record: str | None = None
    inject: Inject | None = None
    timeout_s: float = 30.0
    progress: bool = True
    max_model_len: int = 512
    kill: Inject | None = None  # fault injection for tests: that rank exits at that step
    # (kind "hang": it first stalls, alive with its connections open, for 2x the timeout;
    # "stop": it sends itself SIGSTOP)
    fail: Inject | None = None  # that rank raises locally at that step (kind: FAIL_KINDS)
    graphs: bool = False  # CUDA-graph sizes GRAPH_SIZES; on CUDA, StepGraphs replays
    # per layer "F" (full indexer) or "S" (reuses the previous full layer's top-k), repeated
    # over the layers; None: every layer full
    indexer_pattern: str | None = None
    sm_scale: float = coords.SIM_SM_SCALE  # the model's softmax scale (executor and oracle)
    sampled_rows: bool = False  # steps name their sampled rows; restore_sampled is checked
    warmup: bool = False  # cpplan.warmup.warmup before the first step (every kernel compiled)


# The small preset (docs/design.md §7.3): real 576/512 dims and formats, few heads, topk below
# contexts, the minimum workspace (several gather chunks per step).
PRESET = dict(block_size=64, num_heads=8, topk=64, index_num_heads=4, index_head_dim=128,
              activation_dtype="float32")
TOKEN_BUDGET, MAX_RUNNING, KV_TOKEN_BUDGET = 128, 10, 1100
GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # --graphs: up to the token budget


def preset_config(opts: SimOptions) -> ParallelConfig:
    sources = (() if not opts.indexer_pattern else indexer_sources_from_types(
        (opts.indexer_pattern * opts.layers)[: opts.layers]))
    return ParallelConfig(pcp_size=opts.pcp, dcp_size=opts.dcp, interleave_size=opts.interleave,
                          indexer_sources=sources,
                          kv_cache_dtype=opts.kv_cache_dtype, num_layers=opts.layers,
                          hidden_size=opts.layers * PRESET["num_heads"] * 512,
                          max_model_len=opts.max_model_len,
                          cudagraph_token_sizes=GRAPH_SIZES if opts.graphs else (), **PRESET)


def perturb(step: StepInput, config: ParallelConfig, kind: str):
    """One rank's wrong view of a step (``--inject-divergence``)."""
    c, q = step.num_computed_tokens.np(), step.num_scheduled_tokens.np().copy()
    pre, ids = step.is_prefilling.np(), list(step.req_ids)
    if kind == "reorder":
        order = list(range(len(ids)))[::-1]
        return StepInput.build(step.step_id, [ids[i] for i in order], c[order], q[order],
                               pre[order].astype(bool)), config
    if kind == "q+1":
        q[0] += 1
        return StepInput.build(step.step_id, ids, c, q, pre.astype(bool)), config
    if kind == "drop":
        return StepInput.build(step.step_id, ids[:-1], c[:-1], q[:-1],
                               pre[:-1].astype(bool)), config
    if kind == "config":
        return step, msgspec.structs.replace(
            config, gather_workspace_tokens=config.gather_workspace_tokens + 1)
    if kind == "step-id":
        return msgspec.structs.replace(step, step_id=step.step_id + 1), config
    raise StepInputError(f"divergence kind must be one of {INJECT_KINDS}: got {kind!r}")


def preset_scheduler(config: ParallelConfig, opts: SimOptions) -> MiniScheduler:
    """The preset workload's scheduler (every rank runs its own: deterministic)."""
    return MiniScheduler(preset_requests(config.pcp_size, config.max_model_len, num_long=4),
                         token_budget=TOKEN_BUDGET, max_running=MAX_RUNNING,
                         kv_token_budget=KV_TOKEN_BUDGET, name_sampled=opts.sampled_rows)


def check_inject(config: ParallelConfig, opts: SimOptions) -> None:
    """``--inject-divergence`` checked before any rank starts, on a dry run of the scheduler
    (no model): ConfigError unless the workload reaches its STEP and its KIND changes that
    step (reordering a one-request step changes nothing)."""
    inj = opts.inject
    if inj is None:
        return
    sched = preset_scheduler(config, opts)
    for step_id in range(min(opts.steps, inj.step + 1)):
        step = sched.schedule(step_id)
        if step is None:
            raise ConfigError(f"--inject-divergence {inj.step}:{inj.rank}:{inj.kind}: the "
                              f"workload ends after {step_id} steps, so nothing would be "
                              f"injected; expected a STEP below {step_id}")
        if step_id == inj.step and perturb(step, config, inj.kind) == (step, config):
            raise ConfigError(f"--inject-divergence {inj.step}:{inj.rank}:{inj.kind}: step "
                              f"{inj.step} has {step.num_requests} request(s), so "
                              f"'{inj.kind}' changes nothing; expected a step it perturbs "
                              "(another STEP or KIND)")
        sched.complete()


def rank_main(ctx, opts: SimOptions) -> dict:
    """The body run on every rank; returns this rank's record (errors included, typed)."""
    config = preset_config(opts)
    device = (torch.device("cuda", ctx.local_rank) if opts.backend == "nccl"
              else torch.device("cpu"))
    groups = Groups.build(config, device=device, control_timeout_s=opts.timeout_s,
                          store=ctx.store)
    sim = _RankSim(config, groups, opts)
    try:
        sim.run()
        return sim.summary()
    except Exception as exc:  # noqa: BLE001 - every rank reports in one typed record
        return {"rank": ctx.rank, "error": exc, "step": sim.step, "ledger": sim.ledger_len,
                "elapsed_s": time.monotonic() - sim.t_bind,
                "tb": "" if isinstance(exc, CpplanError) else traceback.format_exc()}


class _RankSim:
    def __init__(self, config: ParallelConfig, groups: Groups, opts: SimOptions) -> None:
        self.config, self.groups, self.opts = config, groups, opts
        self.rank = groups.rank
        mml = config.max_model_len
        self.blocks_per_req = -(-config.shard_rows(mml) // config.block_size)
        num_blocks = 1 + MAX_RUNNING * self.blocks_per_req
        self.executor = StepExecutor.from_groups(
            config, groups, sm_scale=opts.sm_scale, verify=opts.verify,
            verify_every=opts.verify_every,
            digest_exchange=opts.digest_exchange, dcp_compact=opts.dcp_compact,
            max_tokens=TOKEN_BUDGET + MAX_RUNNING, max_requests=MAX_RUNNING)
        self.alloc = BlockAllocator(num_blocks, config.block_size, config.dcp_size,
                                    groups.dcp_rank, config.interleave_size)
        self.caches = [LayerCache.empty(config, num_blocks, groups.device)
                       for _ in range(config.num_layers)]
        self.sched = preset_scheduler(config, opts)
        self.graphs = StepGraphs(self.executor, self._layers) if opts.graphs else None
        if opts.warmup:  # collective, like a step: every rank does it here
            warmup(self.executor)
        self.step = -1
        self.injected = False  # --inject-divergence's step was reached
        self.ledger_len = 0
        self.t_bind = time.monotonic()
        self.stats = dict(steps=0, tokens=0, collectives=0, max_abs_err=0.0, chunks=0,
                          preempted=0, finished=0, graph_steps=0)

    def _layers(self, bound, request_keys):
        """StepGraphs' body: the model's per-layer work on this rank's caches."""
        return step_layers(self.executor, bound, self.caches, self.opts.seed, request_keys)

    def run(self) -> None:
        for step_id in range(self.opts.steps):
            self.step = step_id
            step = self.sched.schedule(step_id)
            if step is None:
                break
            for rid in self.sched.preempted:
                self.alloc.release(rid)
            self.stats["preempted"] += len(self.sched.preempted)
            self._one_step(step)
            for rid in self.sched.complete():
                self.alloc.release(rid)
                self.stats["finished"] += 1
        inj = self.opts.inject
        if inj is not None and not self.injected:  # every rank alike: the same schedule
            raise ConfigError(f"--inject-divergence {inj.step}:{inj.rank}:{inj.kind}: the "
                              f"workload ended after {self.stats['steps']} steps, so nothing "
                              f"was injected; expected a STEP below {self.stats['steps']}")

    def _one_step(self, step: StepInput) -> None:
        config, inj, kill = self.config, self.opts.inject, self.opts.kill
        if kill is not None and kill.step == step.step_id and kill.rank == self.rank:
            _die(kill.kind, self.opts.timeout_s)
        if inj is not None and inj.step == step.step_id:
            self.injected = True
            if inj.rank == self.rank:
                wrong, config = perturb(step, config, inj.kind)
                if wrong == step and config == self.config:  # e.g. reordering one request
                    self.executor.refuse(compile_plan(config, step), ConfigError(
                        f"--inject-divergence {inj.step}:{inj.rank}:{inj.kind}: step "
                        f"{inj.step} has {step.num_requests} request(s), so '{inj.kind}' "
                        "changes nothing; expected a step it perturbs (another STEP or KIND)"))
                step = wrong
        fail = self.opts.fail
        fail = fail.kind if fail and (fail.step, fail.rank) == (step.step_id, self.rank) else None
        plan = compile_plan(config, step)
        for rid, extent in zip(plan.req_ids, plan.extent()):
            self.alloc.ensure(rid, int(extent))
        tables = self.alloc.table(plan.req_ids, self.blocks_per_req)
        if fail == "bind":  # an out-of-range block on this rank only
            tables[0, 0] = self.alloc.num_blocks
        self.ledger_len = 0
        self.t_bind = time.monotonic()
        keys = request_keys_on(plan, self.groups.device)
        if self.rank == 0:  # recorded before it runs: a step that fails is on disk too
            try:
                self._record(plan)
            except OutputError as exc:  # the peers hear of it at once, not after a timeout
                self.executor.refuse(plan, exc)
        bound = self.executor.bind(plan, tables, self.alloc.num_blocks)
        executor = _Malformed(self.executor, fail) if fail else self.executor
        try:
            restored = run_step(executor, bound, self.caches, self.opts.seed, keys,
                                graphs=None if fail else self.graphs)
        finally:
            self.ledger_len = len(bound.ledger)
        world = self.groups.world_size
        mine = [i for i in range(plan.num_requests) if i % world == self.rank]
        expected = oracle_step(plan, self.opts.seed, mine, device=self.groups.device,
                               sm_scale=self.opts.sm_scale)
        err = max_abs_error(plan, restored, expected)
        s = self.stats
        s["steps"] += 1
        s["tokens"] += int(plan.num_scheduled_tokens.np().sum())
        s["collectives"] += len(bound.ledger)
        s["max_abs_err"] = max(s["max_abs_err"], err)
        s["chunks"] += len(plan.gather_chunks)
        s["graph_steps"] += int(plan.graph_replayable)
        if self.rank == 0:
            if self.opts.progress:
                sys.stderr.write(
                    f"step {plan.step_id:3d}/{self.opts.steps}: {plan.num_requests:2d} requests "
                    f"({plan.num_decode_rows} decode), {s['tokens'] - 0:5d} tokens so far, "
                    f"{len(plan.gather_chunks)} gather chunks, {len(bound.ledger):3d} "
                    f"collectives, err {err:.1e}\n")

    def _record(self, plan) -> None:
        if not self.opts.record:
            return
        record_plan(plan, self.opts.record)
        meta = {"seed": self.opts.seed, "preset": "small", "layers": self.config.num_layers,
                "pcp": self.opts.pcp, "dcp": self.opts.dcp, "interleave": self.opts.interleave,
                "kv_cache_dtype": self.opts.kv_cache_dtype, "sm_scale": self.opts.sm_scale}
        write_atomic(os.path.join(self.opts.record, "replay.json"),
                     json.dumps(meta, indent=1).encode())

    def summary(self) -> dict:
        """Sum counts / max the error over every rank (control group); a rank gone by then is
        a RankLostError, not the transport's error."""
        s = self.stats
        replayed = sum(c.replays for c in self.graphs.captured.values()) if self.graphs else 0
        mine = torch.tensor([s["tokens"], s["collectives"], s["max_abs_err"], s["steps"],
                             self.executor.check.passed, s["chunks"], s["preempted"],
                             s["finished"], s["graph_steps"], replayed], dtype=torch.float64)
        g = self.groups
        parts = [torch.empty_like(mine) for _ in range(g.control_size)]
        if g.control is not None:
            try:
                dist.all_gather(parts, mine, group=g.control)
            except RuntimeError as exc:
                board = self.executor.faults
                raise board.lost_error(board.seq, self.step, "final summary",
                                       g.control_timeout_s, exc) from None
        else:
            parts = [mine]
        allr = torch.stack(parts)
        return {"rank": self.rank, "steps": int(allr[0, 3]), "tokens": int(allr[0, 0]),
                "max_abs_err": float(allr[:, 2].max()), "collectives": int(allr[:, 1].sum()),
                "digest_checks": int(allr[0, 4]), "gather_chunks": int(allr[0, 5]),
                "preempted": int(allr[0, 6]), "finished": int(allr[0, 7]),
                "graph_steps": int(allr[0, 8]), "replayed": int(allr[0, 9]),
                "digest_exchange": getattr(self.executor.check.exchange, "kind", None)}


def _die(kind: str, timeout_s: float) -> None:
    """Fault injection: this rank is lost without a word (the others must name it)."""
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if kind == "hang":  # alive but silent: only the control timeout can tell
        time.sleep(2 * timeout_s)
    os._exit(17)


class _Malformed:
    """Fault injection: the rank's executor with one entry point fed a malformed tensor, so
    the step raises locally there (what a bug in an engine's own code looks like)."""

    def __init__(self, executor: StepExecutor, where: str) -> None:
        self.executor, self.where = executor, where

    def __getattr__(self, name: str):
        return getattr(self.executor, name)

    def insert(self, bound, cache, kv_new, index_k_new) -> None:
        if self.where == "insert":
            kv_new = kv_new[:, :100]
        self.executor.insert(bound, cache, kv_new, index_k_new)

    def restore(self, bound, hidden):
        if self.where == "restore":
            hidden = hidden[:, :10]
        return self.executor.restore(bound, hidden)

    def restore_sampled(self, bound, hidden):
        if self.where == "restore":
            hidden = hidden[:, :10]
        return self.executor.restore_sampled(bound, hidden)

    def attend(self, bound, cache, q, index_q, index_w):
        if self.where == "skip-attend":
            return q.new_zeros(q.shape[0], q.shape[1], 512)
        if self.where == "attend":
            q = q[:, :, :100]
        return self.executor.attend(bound, cache, q, index_q, index_w)
