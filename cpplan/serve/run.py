"""``cpplan generate`` as a function: load and check everything in this process, then serve
(in this process at P = W = 1, else on a spawned :class:`~cpplan.sim.launch.World` of
max(P, W) ranks: gloo on CPU, NCCL with one GPU a rank on CUDA); ``--check`` is
:mod:`cpplan.serve.check`.

Every input check (the model's dims and weights, the prompts, the topology, the block budget)
happens in :func:`prepare`, before a rank starts or a byte of output is written.
"""

from __future__ import annotations

import dataclasses
import time

from cpplan.schemas.errors import ConfigError
from cpplan.serve.blocks import BlockBook
from cpplan.serve.engine import GenerateJob, activation_dtype, model_dtype, serve_local, serve_rank
from cpplan.serve.prompts import Prompt, builtin_prompts, check_prompts, load_tokenizer, read_prompts

MAX_SPAWNED = 64


@dataclasses.dataclass
class Prepared:
    job: GenerateJob
    model: object  # the transformers model, in this process
    prompts: list[Prompt]
    tokenizer: object | None
    load_s: float


def prepare(*, model: str, prompts_path: str | None, max_new_tokens: int, seed: int,
            pcp: int = 1, dcp: int = 1, interleave: int = 1, kv_cache_dtype="fp8_ds_mla",
            max_num_batched_tokens: int = 256, max_num_seqs: int = 64,
            num_blocks: int | None = None, max_model_len: int | None = None,
            device: str = "cpu", dtype: str = "auto", temperature: float = 0.0, top_p: float = 1.0,
            keep_logits: bool = False, progress: bool = True, warmup: bool = False,
            timeout_s: float = 60.0, cuda_graphs: bool = False) -> Prepared:
    """Load the model (ConfigError for dims that do not fit, a missing transformers, missing
    or truncated weights), read and check the prompts, derive the config (a bad topology is
    a ConfigError) and the KV blocks per rank (default: the ``max_num_seqs`` largest requests
    at once, so no preemption). ``cuda_graphs``: decode-only steps padded to graph sizes and,
    on CUDA, replayed as captured graphs."""
    from cpplan.models import load_model, parallel_config

    _check_device(device, pcp, dcp)
    if max(pcp, dcp) > MAX_SPAWNED:
        raise ConfigError(f"--pcp {pcp} --dcp {dcp} spawns {max(pcp, dcp)} processes; "
                          f"expected at most {MAX_SPAWNED}")
    t0 = time.monotonic()
    m = load_model(model, seed=seed, dtype=model_dtype(device, dtype), device=device)
    load_s = time.monotonic() - t0
    mml = max_model_len or m.config.max_position_embeddings
    config = parallel_config(m, pcp=pcp, dcp=dcp, interleave=interleave,
                             kv_cache_dtype=kv_cache_dtype, max_model_len=mml, device=device,
                             activation_dtype=activation_dtype(device, dtype))
    tokenizer = load_tokenizer(model)
    if prompts_path is None:
        prompts = builtin_prompts(m.config.vocab_size, max_new_tokens, seed)
        source = "the built-in prompts"
    else:
        prompts = read_prompts(prompts_path, max_new_tokens=max_new_tokens, tokenizer=tokenizer)
        source = prompts_path
    check_prompts(prompts, vocab_size=m.config.vocab_size, max_model_len=mml, source=source)
    book = BlockBook(2, config.block_size, config.dcp_size, config.interleave_size)
    if num_blocks is None:  # the max_num_seqs largest requests at once: no preemption
        need = sorted((book.blocks_for(len(p.token_ids) + p.max_new_tokens) for p in prompts),
                      reverse=True)
        num_blocks = 1 + sum(need[:max_num_seqs])
    if max_num_batched_tokens < 1 or max_num_seqs < 1:
        raise ConfigError(f"--max-num-batched-tokens {max_num_batched_tokens}, --max-num-seqs "
                          f"{max_num_seqs}: expected both >= 1")
    job = GenerateJob(model=model, seed=seed, prompts=tuple(p.token_ids for p in prompts),
                      max_new_tokens=tuple(p.max_new_tokens for p in prompts), pcp=pcp,
                      dcp=dcp, interleave=interleave, kv_cache_dtype=kv_cache_dtype,
                      max_model_len=mml, max_num_batched_tokens=max_num_batched_tokens,
                      max_num_seqs=max_num_seqs, num_blocks=num_blocks, device=device,
                      dtype=dtype,
                      temperature=temperature, top_p=top_p, keep_logits=keep_logits,
                      progress=progress, timeout_s=timeout_s, warmup=warmup,
                      cuda_graphs=cuda_graphs)
    _check_blocks(job, config, [p.id for p in prompts])
    return Prepared(job, m, prompts, tokenizer, load_s)


def reference_model(prep: Prepared):
    """The model ``--check`` compares with: the served one where it is float32, else a
    float32 copy of its weights as served (bf16 on CUDA: the same rounded weights, so only
    the activations' precision differs)."""
    import copy

    import torch

    if next(prep.model.parameters()).dtype == torch.float32:
        return prep.model
    return copy.deepcopy(prep.model).float()


def _check_device(device: str, pcp: int, dcp: int) -> None:
    """cuda: one GPU per rank (P = W = 1 in this process, else an NCCL world of spawned
    ranks, one GPU each)."""
    if device == "cpu":
        return
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have == 0:
        raise ConfigError(f"--device {device}: got no CUDA device here; expected one (or "
                          "--device cpu)")
    if max(pcp, dcp) > have:
        raise ConfigError(f"--device {device} takes one GPU per rank: --pcp {pcp} --dcp {dcp} "
                          f"needs {max(pcp, dcp)}, got {have} (or --device cpu: gloo ranks)")


def _check_blocks(job: GenerateJob, config, ids: list[str]) -> None:
    """Every request must fit an empty rank (else it could never run)."""
    book = BlockBook(job.num_blocks, config.block_size, config.dcp_size, config.interleave_size)
    if job.num_blocks < 2:
        raise ConfigError(f"--num-blocks: got {job.num_blocks}; expected >= 2 (block 0 is "
                          "reserved)")
    for rid, p, n in zip(ids, job.prompts, job.max_new_tokens):
        if not book.capacity_ok(len(p) + n):
            raise ConfigError(f"--num-blocks {job.num_blocks}: request {rid!r} ({len(p)} + {n} "
                              f"tokens) needs {book.blocks_for(len(p) + n)} blocks of "
                              f"{config.block_size} on one rank; expected at most "
                              f"{job.num_blocks - 1} (block 0 is reserved)")


def serve(prep: Prepared, world=None) -> list:
    """Run the job; returns one result per rank (``RankResult``-like: ``.rank``, ``.value``,
    ``.error``, ``.lost``, ``.tb``). ``world``: a started World of max(P, W) ranks to reuse
    (default: start one for this run, or none at P = W = 1)."""
    from cpplan.sim.launch import PRELOAD, RankResult, World

    job = prep.job
    backend = "nccl" if job.device == "cuda" else "gloo"
    size = max(job.pcp, job.dcp)
    if size == 1 and world is None:
        return [RankResult(0, value=serve_local(prep.model, job))]
    if world is not None:
        if world.world_size != size:
            raise ConfigError(f"world of {world.world_size} ranks; expected {size}")
        return world.run(serve_rank, job, timeout_s=3600.0, settle_s=job.timeout_s)
    w = World(size, backend=backend, timeout_s=max(job.timeout_s * 4, 60.0),
              preload=(*PRELOAD, "cpplan.serve.engine", "cpplan.models"))
    try:
        return w.run(serve_rank, job, timeout_s=3600.0, settle_s=job.timeout_s)
    finally:
        w.close()
