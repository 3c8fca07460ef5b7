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
simulate``'s ranks report them). An exception that is not one of cpplan's own (the model's
modules, the loop itself) becomes a :class:`RunError` naming the rank, the step and the layer
or phase it was raised in; after ``bind`` the rank first refuses the step, so its peers raise
``PeerFailedError`` naming it at once instead of waiting out a timeout.

Stopping: a request ends at its first stop token (``stop_token_ids``: the model's
end-of-sequence ids and the request's own, the token kept) or at its ``max_new_tokens``. The
tokens are the same on every rank (greedy over identical logits, or per-request generators
seeded alike), so every rank finishes the same requests in the same step and schedules the
same next step; the digest check of that step would name a rank that did not.
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


class RunError(CpplanError, RuntimeError):
    """An exception that is not one of cpplan's own, raised inside a rank's work (loading the
    model, a layer's modules, sampling) or by ``--check``'s reference: one line naming where
    (``rank``, the step, the layer or phase) and the exception's type and first line."""

    exit_code = 5

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):  # keep the rank through pickling (the ranks' pipes)
        return type(self), (str(self), self.rank)

    @classmethod
    def wrap(cls, exc: BaseException, where: str, rank: int | None = None) -> CpplanError:
        """``exc`` as one line raised ``where``; cpplan's own errors are kept as they are."""
        if isinstance(exc, CpplanError):
            return exc
        text = str(exc).strip().splitlines()
        first = " ".join(text[0].split())[:300] if text else ""
        return cls(f"{where}: {type(exc).__name__}" + (f": {first}" if first else ""), rank)


@dataclasses.dataclass(frozen=True)
class GenerateJob:
    """Everything a rank needs (picklable). ``prompts``: per request its token ids;
    ``max_new_tokens`` per request; ``num_blocks`` KV blocks per rank (block 0 reserved)."""

    model: str
    seed: int
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: tuple[int, ...]
    # per request the token ids that end it once generated (the model's eos and its own);
    # empty: none for any request
    stop_token_ids: tuple[tuple[int, ...], ...] = ()
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
    # (step, rank, layer) where that rank's layer's MLP raises a RuntimeError (tests)
    fail: tuple[int, int, int] | None = None
    progress: bool = True  # False: nothing on stderr per step (--quiet)
    verbose: bool = False  # one stderr line per step (else one live line on a terminal)
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


def live_line(reqs, finished: int, seconds: float, *, end: bool = False, out=None) -> str:
    """The one progress line of a terminal, rewritten in place (carriage return, cut to the
    terminal's width so it never wraps): requests done, new tokens per second, and the time
    left at that rate for every request's remaining ``max_new_tokens`` (an upper bound: a
    request may stop early). Returns the line; ``end`` closes it with a newline."""
    import shutil

    new = sum(len(r.output) for r in reqs)
    left = sum(max(0, r.max_new_tokens - len(r.output)) for r in reqs if r.finish_step < 0)
    rate = new / seconds if seconds > 0 else 0.0
    eta = f"ETA {left / rate:.0f} s" if rate > 0 and not end else ("done" if end else "ETA -")
    line = f"{finished}/{len(reqs)} requests done, {new} tokens, {rate:.1f} tokens/s, {eta}"
    width = shutil.get_terminal_size((80, 24)).columns - 1
    out = sys.stderr if out is None else out
    out.write("\r" + line[:width].ljust(width) + ("\n" if end else ""))
    out.flush()
    return line


def serve_rank(ctx, job: GenerateJob) -> dict:
    """A spawned rank's body (``World.run``): Groups over the world, then :func:`serve`.
    ``job.device`` "cuda" means GPU ``ctx.local_rank`` (an NCCL world)."""
    where = "loading the model"
    try:
        from cpplan.api import Groups
        from cpplan.models import load_model

        device = f"cuda:{ctx.local_rank}" if job.device == "cuda" else job.device
        model = load_model(job.model, seed=job.seed,
                           dtype=model_dtype(job.device, job.dtype), device=device)
        where = "building the process groups"
        config = _config(model, job)
        groups = Groups.build(config, device=device, control_timeout_s=job.timeout_s,
                              store=ctx.store)
        where = "building the engine"
        engine = RankEngine(model, config, job, groups=groups, rank=ctx.rank)
        return engine.serve(job)
    except Exception as exc:  # noqa: BLE001 - every rank reports in one typed record
        return _error(ctx.rank, RunError.wrap(exc, where, ctx.rank), exc)


def serve_local(model, job: GenerateJob, engine: RankEngine | None = None) -> dict:
    """P = W = 1 in this process (no torch.distributed), ``model`` already loaded; ``engine``:
    one from :func:`local_engine` to reuse (its graphs, caches and compiled kernels). cpplan's
    typed errors are raised (one line from the CLI); any other is reported like a rank's."""
    try:
        engine = engine or local_engine(model, job)
        return engine.serve(job)
    except RunError as exc:
        return _error(0, exc)
    except CpplanError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported like a rank's
        return _error(0, RunError.wrap(exc, "building the engine", 0), exc)


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


def _error(rank: int, exc: BaseException, cause: BaseException | None = None) -> dict:
    """A rank's failure record; ``tb`` the traceback of the untyped ``cause`` (shown with
    CPPLAN_TRACEBACK=1), or of ``exc`` where it is untyped."""
    cause = getattr(exc, "__cause__", None) or cause
    if cause is None and not isinstance(exc, CpplanError):
        cause = exc
    tb = "".join(traceback.format_exception(cause)) if cause is not None else ""
    return {"rank": rank, "error": exc, "step": -1, "ledger": 0, "elapsed_s": 0.0, "tb": tb}


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
        (input order), "finish_reasons" ("stop" / "length" per request), "first_steps" /
        "finish_steps" (the step that first scheduled / finished each request), "preemptions"
        (per request), "ttft_s",
        "tpot_s", "logits" ([n_new, vocab] float32 per request, with keep_logits), "steps",
        "tokens", "collectives" (this rank's), "digest_checks", "preempted", "graph_steps",
        "captures", "seconds"}``. ``job`` must match the engine's :data:`ENGINE_FIELDS`
        (UsageError otherwise). An untyped exception is raised as a :class:`RunError`
        naming the rank, the step and the phase or layer."""
        self._check_job(job)
        config = self.config
        book = BlockBook(job.num_blocks, config.block_size, config.dcp_size,
                         config.interleave_size)
        stops = job.stop_token_ids or ((),) * len(job.prompts)
        reqs = [Request(i, list(p), n, stop=frozenset(st))
                for i, (p, n, st) in enumerate(zip(job.prompts, job.max_new_tokens, stops))]
        sched = Scheduler(reqs, book, max_num_batched_tokens=job.max_num_batched_tokens,
                          max_num_seqs=job.max_num_seqs)
        if job.warmup and not self.warmed:  # collective, like a step: every rank at once
            from cpplan.api import warmup

            self._phase(lambda: warmup(self.ex), "warmup")
            self.warmed = True
        run = _Run(self, job, sched, book)
        while sched.has_work:
            if job.kill is not None and job.kill == (run.step_id, self.rank):
                os._exit(17)
            run.step()
        return run.result()

    def _phase(self, fn, where: str, bound=None):
        """``fn()``; an untyped exception as a RunError naming this rank and ``where`` (and,
        for a step's phase, the forward's layer), the step refused first where it is bound
        so that the peers are told at once."""
        try:
            return fn()
        except CpplanError:
            raise
        except Exception as exc:  # noqa: BLE001 - one line naming where
            if where.endswith("(forward)"):
                where = where.replace("(forward)", self.forward.where)
            err = RunError.wrap(exc, where, self.rank)
            if bound is not None and not bound.finished:
                try:
                    self.ex.refuse(bound, err)
                except BaseException:  # noqa: BLE001 - refuse raises err again by design
                    pass
            raise err from exc

    def _check_job(self, job: GenerateJob) -> None:
        from cpplan.schemas.errors import UsageError

        for name in ENGINE_FIELDS:
            got, want = getattr(job, name), getattr(self.job, name)
            if got != want:
                raise UsageError(f"RankEngine.serve: job {name} is {got!r}; expected the "
                                 f"engine's {want!r} (build another engine for it)")


class _Run:
    """One workload's loop state on one rank (:meth:`RankEngine.serve`)."""

    def __init__(self, engine: RankEngine, job: GenerateJob, sched: Scheduler,
                 book: BlockBook) -> None:
        ex = engine.ex
        self.engine, self.job, self.sched, self.book = engine, job, sched, book
        self.width = book.blocks_for(engine.config.max_model_len)
        self.sample = Sampler(job)
        self.reqs = list(sched.waiting)
        n = len(self.reqs)
        self.keep = job.keep_logits and engine.rank == 0  # rank 0's: the same on every rank
        self.first, self.last = [0.0] * n, [0.0] * n
        self.logits_kept: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self.stats = dict(steps=0, tokens=0, collectives=0, mixed_steps=0, max_batch=0,
                          graph_steps=0)
        self.checks0 = ex.check.passed if ex.check is not None else 0
        self.captures0 = len(engine.graphs.captured) if engine.graphs is not None else 0
        self.step_id = 0
        self.t0 = time.monotonic()

    def step(self) -> None:
        """Schedule, compile, bind, forward, sample and complete one step."""
        from cpplan.api import compile as compile_plan
        from cpplan.models import rank_token_ids, sampled_requests

        e, sched, stats, at = self.engine, self.sched, self.stats, f"step {self.step_id}"
        ex = e.ex
        step = e._phase(lambda: sched.schedule(self.step_id), f"{at} (scheduling)")
        plan = e._phase(lambda: compile_plan(e.config, step), f"{at} (compile)")
        bound = ex.bind(plan, self.book.table(e.dcp_rank, plan.req_ids, self.width),
                        self.job.num_blocks)
        token_ids = rank_token_ids(bound, [r.tokens for r, _ in sched.scheduled])

        def forward():
            if self.job.fail is not None and self.job.fail[:2] == (self.step_id, e.rank):
                _inject_failure(e.model, self.job.fail[2])
            if e.graphs is not None:
                hidden = e.graphs.run(bound, token_ids)
                stats["graph_steps"] += int(bound.meta.graph_key is not None)
            else:
                hidden = e._layers(bound, token_ids)
            return e.forward.head(ex, bound, hidden)

        logits = e._phase(forward, f"{at}, (forward)", bound)  # "step 3, layer 1 (moe)"
        ex.finish(bound)
        reqs_now = [sched.scheduled[k][0] for k in sampled_requests(plan).tolist()]
        tokens = e._phase(lambda: self.sample.batch([r.index for r in reqs_now], logits),
                          f"{at} (sampling)")
        now = time.monotonic() - self.t0  # the tokens are on the host: the step's work is done
        out = {}
        for r, row, token in zip(reqs_now, logits, tokens):
            out[r.index] = token
            if self.keep:
                self.logits_kept[r.index].append(row.float().cpu())
            if not r.output:
                self.first[r.index] = now
            self.last[r.index] = now
        q = [c for _, c in sched.scheduled]
        stats["steps"] += 1
        stats["tokens"] += sum(q)
        stats["collectives"] += len(bound.ledger)
        stats["mixed_steps"] += int(1 in q and any(c > 1 for c in q))
        stats["max_batch"] = max(stats["max_batch"], len(q))
        done = sched.complete(out)
        if self.job.progress and e.rank == 0:
            n = len(self.reqs)
            finished = n - len(sched.waiting) - len(sched.running)
            if self.job.verbose:
                sys.stderr.write(f"step {self.step_id:4d}: {len(q):3d} requests ({q.count(1)} "
                                 f"decode), {sum(q):5d} tokens, {len(bound.ledger):3d} "
                                 f"collectives, {finished}/{n} done"
                                 f"{' +' + str(len(done)) if done else ''}\n")
            elif sys.stderr.isatty():
                live_line(self.reqs, finished, time.monotonic() - self.t0,
                          end=finished == n)
        self.step_id += 1

    def result(self) -> dict:
        """:meth:`RankEngine.serve`'s dict (collective over the control group, if any)."""
        e, reqs, ex, first, last = self.engine, self.reqs, self.engine.ex, self.first, self.last
        seconds = time.monotonic() - self.t0
        tpot = [(last[i] - first[i]) / (len(r.output) - 1) if len(r.output) > 1 else 0.0
                for i, r in enumerate(reqs)]
        captures = len(e.graphs.captured) - self.captures0 if e.graphs is not None else 0
        result = dict(rank=e.rank, outputs=[r.output for r in reqs],
                      finish_reasons=[r.finish_reason for r in reqs],
                      first_steps=[r.first_step for r in reqs],
                      finish_steps=[r.finish_step for r in reqs],
                      preemptions=[r.preemptions for r in reqs], ttft_s=first, tpot_s=tpot,
                      preempted=self.sched.preempted, seconds=seconds, captures=captures,
                      digest_checks=(ex.check.passed - self.checks0) if ex.check is not None
                      else 0, **self.stats)
        groups = e.groups
        if groups is not None and groups.control is not None:
            result.update(_world_facts(groups, self.stats["collectives"], result["outputs"]))
        if self.keep:
            result["logits"] = [torch.stack(x) if x else torch.zeros(0)
                                for x in self.logits_kept]
        return result


def _inject_failure(model, layer: int) -> None:
    """Layer ``layer``'s MLP raises once, on its next call (GenerateJob.fail)."""
    def hook(module, args):
        handle.remove()
        raise RuntimeError("injected failure (GenerateJob.fail)")

    handle = model.model.layers[layer].mlp.register_forward_pre_hook(hook)


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
