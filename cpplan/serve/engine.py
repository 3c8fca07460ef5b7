"""One rank's serving loop of ``cpplan generate`` (docs/design.md §4.5): the model through
cpplan's runtime, every rank running the same deterministic :class:`~cpplan.serve.scheduler.
Scheduler` on the same global facts.

Per step (every rank): ``schedule`` -> ``compile`` -> ``bind`` (this rank's block table from
the shared :class:`~cpplan.serve.blocks.BlockBook`; digest check across ranks) ->
:class:`~cpplan.models.RankForward`'s layers (with ``cuda_graphs``, a decode-only step is
padded to a graph size and, on CUDA, replayed as a captured graph) -> its head (logits
``[num_sampled, vocab]``, identical on every rank) -> ``finish`` -> sample (greedy, or
temperature / top-p from per-request generators seeded alike on every rank) -> ``complete``.
So every rank appends the same tokens.

:func:`serve_rank` is the job function of a spawned rank (``World.run(serve_rank, job)``);
:func:`serve_local` runs P = W = 1 in this process; a :class:`RankEngine` serves one
workload after another on the same executor, caches and graphs. All return :func:`serve`'s
dict, or a rank's failure as ``{"rank", "error": exception, "tb", ...}`` (as ``cpplan
simulate``'s ranks report them).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import traceback

import torch

from cpplan.schemas.errors import CpplanError
from cpplan.serve.blocks import BlockBook
from cpplan.serve.scheduler import Request, Scheduler


@dataclasses.dataclass(frozen=True)
class GenerateJob:
    """Everything a rank needs (picklable). ``prompts``: per request its token ids;
    ``max_new_tokens`` per request; ``num_blocks`` KV blocks per rank (block 0 reserved)."""

    model: str
    seed: int
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: tuple[int, ...]
    pcp: int = 1
    dcp: int = 1
    interleave: int = 1
    kv_cache_dtype: str = "fp8_ds_mla"
    max_model_len: int = 4096
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 64
    num_blocks: int = 256
    device: str = "cpu"
    dtype: str = "auto"  # activations and weights: auto (float32 on CPU, bfloat16 on CUDA)
    temperature: float = 0.0
    top_p: float = 1.0
    keep_logits: bool = False  # return each sampled row's logits (for --check)
    warmup: bool = False  # cpplan.warmup before the clock starts (kernels compiled)
    # decode-only steps padded to graph_sizes(max_num_seqs) and, on CUDA, replayed as graphs
    cuda_graphs: bool = False
    # fault injection for tests: (step, rank) where that rank's process exits without a word
    kill: tuple[int, int] | None = None
    progress: bool = True
    timeout_s: float = 60.0


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def activation_dtype(device: str, dtype: str = "auto") -> str:
    """``dtype``, or for "auto" float32 on CPU and bfloat16 on CUDA (parallel_config's)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


def model_dtype(device: str, dtype: str = "auto") -> torch.dtype:
    """The weights' dtype: the activations' (the model's modules run on them)."""
    return DTYPES[activation_dtype(device, dtype)]


def serve_rank(ctx, job: GenerateJob) -> dict:
    """A spawned rank's body (``World.run``): Groups over the world, then :func:`serve`.
    ``job.device`` "cuda" means GPU ``ctx.local_rank`` (an NCCL world)."""
    try:
        from cpplan.api import Groups
        from cpplan.models import load_model

        device = f"cuda:{ctx.local_rank}" if job.device == "cuda" else job.device
        model = load_model(job.model, seed=job.seed,
                           dtype=model_dtype(job.device, job.dtype), device=device)
        config = _config(model, job)
        groups = Groups.build(config, device=device, control_timeout_s=job.timeout_s,
                              store=ctx.store)
        return serve(model, config, job, groups=groups, rank=ctx.rank)
    except Exception as exc:  # noqa: BLE001 - every rank reports in one typed record
        return _error(ctx.rank, exc)


def serve_local(model, job: GenerateJob, engine: RankEngine | None = None) -> dict:
    """P = W = 1 in this process (no torch.distributed), ``model`` already loaded; ``engine``:
    one from :func:`local_engine` to reuse (its graphs, caches and compiled kernels). cpplan's
    typed errors are raised (one line from the CLI); any other is reported like a rank's."""
    try:
        engine = engine or local_engine(model, job)
        return engine.serve(job)
    except CpplanError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported like a rank's
        return _error(0, exc)


def local_engine(model, job: GenerateJob) -> RankEngine:
    """A :class:`RankEngine` for P = W = 1 in this process (no torch.distributed)."""
    return RankEngine(model, _config(model, job), job, groups=None, rank=0)


def _config(model, job: GenerateJob):
    from cpplan.models import parallel_config

    return parallel_config(model, pcp=job.pcp, dcp=job.dcp, interleave=job.interleave,
                           kv_cache_dtype=job.kv_cache_dtype, max_model_len=job.max_model_len,
                           device=job.device,
                           activation_dtype=activation_dtype(job.device, job.dtype),
                           cudagraph_token_sizes=(graph_sizes(job.max_num_seqs)
                                                  if job.cuda_graphs else ()))


def _error(rank: int, exc: BaseException) -> dict:
    return {"rank": rank, "error": exc, "step": -1, "ledger": 0, "elapsed_s": 0.0,
            "tb": "" if isinstance(exc, CpplanError) else traceback.format_exc()}


class Sampler:
    """Greedy (``temperature`` 0) or temperature / top-p sampling with one generator per
    request seeded from (seed, request index): the same draws on every rank."""

    def __init__(self, job: GenerateJob) -> None:
        self.t, self.top_p, self.seed = job.temperature, job.top_p, job.seed
        self.gens: dict[int, torch.Generator] = {}

    def batch(self, indices: list[int], logits: torch.Tensor) -> list[int]:
        """``logits`` ``[n, vocab]`` of requests ``indices`` -> their token ids: greedy in one
        argmax and one host read for the step (not one a row), else row by row."""
        if self.t <= 0:
            return logits.argmax(dim=-1).tolist()
        return [self(i, row) for i, row in zip(indices, logits)]

    def __call__(self, index: int, logits: torch.Tensor) -> int:
        """``logits`` ``[vocab]`` -> a token id."""
        if self.t <= 0:
            return int(logits.argmax())
        gen = self.gens.get(index)
        if gen is None:
            gen = self.gens[index] = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        probs = torch.softmax(logits.double().cpu() / self.t, dim=-1)
        if self.top_p < 1.0:
            p, order = torch.sort(probs, descending=True, stable=True)
            keep = (p.cumsum(0) - p) < self.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], p[keep])
        return int(torch.multinomial(probs, 1, generator=gen))


def serve(model, config, job: GenerateJob, *, groups, rank: int) -> dict:
    """The serving loop on one rank, on an engine built for this job (:class:`RankEngine`)."""
    return RankEngine(model, config, job, groups=groups, rank=rank).serve(job)


# GenerateJob fields a RankEngine is built for (its executor, caches and graphs); the others
# describe one workload and may change between RankEngine.serve calls
ENGINE_FIELDS = ("model", "pcp", "dcp", "interleave", "kv_cache_dtype", "max_model_len",
                 "max_num_batched_tokens", "max_num_seqs", "num_blocks", "device", "dtype",
                 "cuda_graphs", "timeout_s")


def graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """CUDA-graph token sizes of a decode-only step: powers of two below ``max_num_seqs``,
    then ``max_num_seqs`` (a decode step of n requests is padded to the first size >= n)."""
    sizes = [1 << k for k in range(max_num_seqs.bit_length()) if (1 << k) < max_num_seqs]
    return tuple(sizes + [max_num_seqs])


class RankEngine:
    """One rank's serving state, built once and reused by every :meth:`serve` call: the
    executor, one KV cache per layer, the model's :class:`~cpplan.models.RankForward` and,
    with ``job.cuda_graphs``, the :class:`~cpplan.runtime.graphs.StepGraphs` that replay
    decode-only steps (captured on the first step of each graph key, docs/design.md §5.6).

    A long-lived engine is what a server is: graphs captured by one workload are replayed
    by the next (the caches stay the same objects; each workload's block book starts empty,
    and a step reads only the blocks its own requests wrote)."""

    def __init__(self, model, config, job: GenerateJob, *, groups, rank: int) -> None:
        from cpplan.api import LayerCache, StepExecutor, StepGraphs
        from cpplan.models import RankForward, model_spec

        self.model, self.config, self.job, self.groups, self.rank = (model, config, job,
                                                                    groups, rank)
        spec = model_spec(model)
        sizes = dict(max_tokens=job.max_num_batched_tokens + job.max_num_seqs,
                     max_requests=job.max_num_seqs)
        if groups is None:
            self.ex = StepExecutor.local(config, sm_scale=spec.sm_scale, device=job.device,
                                         **sizes)
            self.dcp_rank, device = 0, torch.device(job.device)
        else:
            self.ex = StepExecutor.from_groups(config, groups, sm_scale=spec.sm_scale, **sizes)
            self.dcp_rank, device = groups.dcp_rank, groups.device
        self.caches = [LayerCache.empty(config, job.num_blocks, device)
                       for _ in range(config.num_layers)]
        self.forward = RankForward(model, spec)
        self.graphs = StepGraphs(self.ex, self._layers) if job.cuda_graphs else None
        self.warmed = False

    def _layers(self, bound, token_ids: torch.Tensor) -> torch.Tensor:
        """A step's per-layer work (StepGraphs' body): the rank's hidden rows ``[T, hidden]``;
        a graph-keyed step's in capturable form (the same step eager, captured and replayed)."""
        return self.forward.hidden_states(self.ex, bound, self.caches, token_ids,
                                          capturable=bound.meta.graph_key is not None)

    def serve(self, job: GenerateJob) -> dict:
        """Serve ``job``'s requests to the end. Returns ``{"rank", "outputs": [[ids]...]
        (input order), "ttft_s", "tpot_s", "logits" ([n_new, vocab] float32 per request,
        with keep_logits), "steps", "tokens", "collectives" (this rank's), "digest_checks",
        "preempted", "graph_steps", "captures", "seconds"}``. ``job`` must match the
        engine's :data:`ENGINE_FIELDS` (UsageError otherwise)."""
        from cpplan.api import compile as compile_plan
        from cpplan.models import rank_token_ids, sampled_requests

        self._check_job(job)
        ex, config, rank = self.ex, self.config, self.rank
        book = BlockBook(job.num_blocks, config.block_size, config.dcp_size,
                         config.interleave_size)
        width = book.blocks_for(config.max_model_len)
        reqs = [Request(i, list(p), n) for i, (p, n) in enumerate(zip(job.prompts,
                                                                       job.max_new_tokens))]
        sched = Scheduler(reqs, book, max_num_batched_tokens=job.max_num_batched_tokens,
                          max_num_seqs=job.max_num_seqs)
        sample = Sampler(job)
        if job.warmup and not self.warmed:  # collective, like a step: every rank at once
            from cpplan.api import warmup

            warmup(ex)
            self.warmed = True
        checks0 = ex.check.passed if ex.check is not None else 0
        captures0 = len(self.graphs.captured) if self.graphs is not None else 0
        n, keep = len(reqs), job.keep_logits and rank == 0  # rank 0's: the same on every rank
        first, last = [0.0] * n, [0.0] * n
        logits_kept: list[list[torch.Tensor]] = [[] for _ in range(n)]
        stats = dict(steps=0, tokens=0, collectives=0, mixed_steps=0, max_batch=0,
                     graph_steps=0)
        t0 = time.monotonic()
        step_id = 0
        while sched.has_work:
            if job.kill is not None and job.kill == (step_id, rank):
                os._exit(17)
            step = sched.schedule(step_id)
            plan = compile_plan(config, step)
            bound = ex.bind(plan, book.table(self.dcp_rank, plan.req_ids, width),
                            job.num_blocks)
            token_ids = rank_token_ids(bound, [r.tokens for r, _ in sched.scheduled])
            if self.graphs is not None:
                hidden = self.graphs.run(bound, token_ids)
                stats["graph_steps"] += int(bound.meta.graph_key is not None)
            else:
                hidden = self._layers(bound, token_ids)
            logits = self.forward.head(ex, bound, hidden)
            ex.finish(bound)
            rows = sampled_requests(plan).tolist()
            out = {}
            reqs_now = [sched.scheduled[k][0] for k in rows]
            tokens = sample.batch([r.index for r in reqs_now], logits)
            now = time.monotonic() - t0  # the tokens are on the host: the step's work is done
            for r, row, token in zip(reqs_now, logits, tokens):
                out[r.index] = token
                if keep:
                    logits_kept[r.index].append(row.float().cpu())
                if not r.output:
                    first[r.index] = now
                last[r.index] = now
            q = [c for _, c in sched.scheduled]
            stats["steps"] += 1
            stats["tokens"] += sum(q)
            stats["collectives"] += len(bound.ledger)
            stats["mixed_steps"] += int(1 in q and any(c > 1 for c in q))
            stats["max_batch"] = max(stats["max_batch"], len(q))
            done = sched.complete(out)
            if job.progress and rank == 0:
                finished = n - len(sched.waiting) - len(sched.running)
                sys.stderr.write(f"step {step_id:4d}: {len(q):3d} requests ({q.count(1)} "
                                 f"decode), {sum(q):5d} tokens, {len(bound.ledger):3d} "
                                 f"collectives, {finished}/{n} done"
                                 f"{' +' + str(len(done)) if done else ''}\n")
            step_id += 1
        seconds = time.monotonic() - t0
        tpot = [(last[i] - first[i]) / (len(r.output) - 1) if len(r.output) > 1 else 0.0
                for i, r in enumerate(reqs)]
        captures = len(self.graphs.captured) - captures0 if self.graphs is not None else 0
        result = dict(rank=rank, outputs=[r.output for r in reqs], ttft_s=first, tpot_s=tpot,
                      preempted=sched.preempted, seconds=seconds, captures=captures,
                      digest_checks=(ex.check.passed - checks0) if ex.check is not None else 0,
                      **stats)
        groups = self.groups
        if groups is not None and groups.control is not None:
            result.update(_world_facts(groups, stats["collectives"], result["outputs"]))
        if keep:
            result["logits"] = [torch.stack(x) if x else torch.zeros(0) for x in logits_kept]
        return result

    def _check_job(self, job: GenerateJob) -> None:
        from cpplan.schemas.errors import UsageError

        for name in ENGINE_FIELDS:
            got, want = getattr(job, name), getattr(self.job, name)
            if got != want:
                raise UsageError(f"RankEngine.serve: job {name} is {got!r}; expected the "
                                 f"engine's {want!r} (build another engine for it)")


def _world_facts(groups, collectives: int, outputs) -> dict:
    """Over the control group (collective): the collectives of every rank summed, and whether
    every rank generated the same tokens (a digest of them compared)."""
    import json

    import torch.distributed as dist
    import xxhash

    digest = xxhash.xxh3_64_intdigest(json.dumps(outputs).encode()) & (2**63 - 1)
    mine = torch.tensor([collectives, digest], dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(groups.control_size)]
    dist.all_gather(parts, mine, group=groups.control)
    return {"collectives_world": sum(int(p[0]) for p in parts),
            "outputs_agree": all(int(p[1]) == digest for p in parts)}
