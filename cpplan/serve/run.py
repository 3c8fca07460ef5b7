"""``cpplan generate`` as a function: load and check everything in this process, then serve
(in this process at P = W = 1, else on a spawned :class:`~cpplan.sim.launch.World` of
max(P, W) ranks: gloo on CPU, NCCL with one GPU a rank on CUDA); ``--check`` is
:mod:`cpplan.serve.check`.

Every input check (the model's dims and gate, ``max_model_len``, the topology, the prompts, the
block budget) happens in :func:`prepare` from the model's config alone, before its weights
are read (on a real checkpoint that takes minutes), a rank starts or a byte of output is
written; the weights' own checks (missing, truncated) follow as they load.
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
    eos_token_ids: tuple[int, ...] = ()  # the model's, as served (none with --ignore-eos)


def prepare(*, model: str, prompts_path: str | None, max_new_tokens: int, seed: int,
            pcp: int = 1, dcp: int = 1, interleave: int = 1, kv_cache_dtype="fp8_ds_mla",
            max_num_batched_tokens: int = 256, max_num_seqs: int = 64,
            num_blocks: int | None = None, max_model_len: int | None = None,
            allow_long_max_model_len: bool = False, ignore_eos: bool = False,
            device: str = "cpu", dtype: str = "auto", temperature: float = 0.0, top_p: float = 1.0,
            keep_logits: bool = False, progress: bool = True, verbose: bool = False,
            warmup: bool = False,
            timeout_s: float = 60.0, cuda_graphs: bool = False, before_load=None) -> Prepared:
    """Check every input from the model's config alone (ConfigError: dims or an MoE gate its
    modules cannot run, a missing transformers, a ``max_model_len`` above the model's
    ``max_position_embeddings`` without ``allow_long_max_model_len``, a bad topology, the
    prompts, the KV blocks per rank: default the ``max_num_seqs`` largest requests at once,
    so no preemption), call ``before_load(config, prompts)`` (e.g. ``--check``'s memory
    check), then load the weights (missing or truncated: ConfigError). Each request stops at
    the model's end-of-sequence ids (none with ``ignore_eos``) and its own stop ids.
    ``cuda_graphs``: decode-only steps padded to graph sizes and, on CUDA, replayed as
    captured graphs."""
    from cpplan.models import parallel_config
    from cpplan.models.loading import eos_token_ids, load_model, model_config

    _check_device(device, pcp, dcp)
    if max(pcp, dcp) > MAX_SPAWNED:
        raise ConfigError(f"--pcp {pcp} --dcp {dcp} spawns {max(pcp, dcp)} processes; "
                          f"expected at most {MAX_SPAWNED}")
    if max_num_batched_tokens < 1 or max_num_seqs < 1:
        raise ConfigError(f"--max-num-batched-tokens {max_num_batched_tokens}, --max-num-seqs "
                          f"{max_num_seqs}: expected both >= 1")
    cfg = model_config(model)
    mml = _max_model_len(cfg, max_model_len, allow_long_max_model_len)
    config = parallel_config(cfg, pcp=pcp, dcp=dcp, interleave=interleave,
                             kv_cache_dtype=kv_cache_dtype, max_model_len=mml, device=device,
                             activation_dtype=activation_dtype(device, dtype))
    tokenizer = load_tokenizer(model)
    if prompts_path is None:
        prompts = builtin_prompts(cfg.vocab_size, max_new_tokens, seed)
        source = "the built-in prompts"
    else:
        prompts = read_prompts(prompts_path, max_new_tokens=max_new_tokens, tokenizer=tokenizer)
        source = prompts_path
    check_prompts(prompts, vocab_size=cfg.vocab_size, max_model_len=mml, source=source)
    if num_blocks is None:  # the max_num_seqs largest requests at once: no preemption
        book = BlockBook(2, config.block_size, config.dcp_size, config.interleave_size)
        need = sorted((book.blocks_for(len(p.token_ids) + p.max_new_tokens) for p in prompts),
                      reverse=True)
        num_blocks = 1 + sum(need[:max_num_seqs])
    eos = () if ignore_eos else eos_token_ids(model, cfg)
    stops = tuple(tuple(dict.fromkeys((*eos, *p.stop_token_ids))) for p in prompts)
    job = GenerateJob(model=model, seed=seed, prompts=tuple(p.token_ids for p in prompts),
                      max_new_tokens=tuple(p.max_new_tokens for p in prompts),
                      stop_token_ids=stops, pcp=pcp,
                      dcp=dcp, interleave=interleave, kv_cache_dtype=kv_cache_dtype,
                      max_model_len=mml, max_num_batched_tokens=max_num_batched_tokens,
                      max_num_seqs=max_num_seqs, num_blocks=num_blocks, device=device,
                      dtype=dtype,
                      temperature=temperature, top_p=top_p, keep_logits=keep_logits,
                      progress=progress, verbose=verbose, timeout_s=timeout_s, warmup=warmup,
                      cuda_graphs=cuda_graphs)
    _check_blocks(job, config, [p.id for p in prompts])
    if before_load is not None:
        before_load(cfg, prompts)
    t0 = time.monotonic()
    m = load_model(model, seed=seed, dtype=model_dtype(device, dtype), device=device)
    return Prepared(job, m, prompts, tokenizer, time.monotonic() - t0, eos)


def _max_model_len(cfg, max_model_len: int | None, allow_long: bool) -> int:
    """``max_model_len`` (default the model's ``max_position_embeddings``); above that only
    with ``allow_long`` (positions past the model's range: its RoPE was not trained there)."""
    limit = cfg.max_position_embeddings
    if max_model_len is None:
        return limit
    if max_model_len > limit and not allow_long:
        raise ConfigError(f"--max-model-len {max_model_len} is above the model's "
                          f"max_position_embeddings {limit}; expected at most {limit} (or "
                          "--allow-long-max-model-len to serve positions the model was not "
                          "trained for)")
    return max_model_len


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
