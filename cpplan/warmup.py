"""Warm-up before serving: compile every kernel variant the config's steps need, up front.

Triton compiles a kernel per specialisation the first time a launch needs it: seconds per
variant on a GPU, which a serving engine would otherwise pay inside its first steps (and every
rank of a world in turn). The kernels' step-varying ints and table pointers are unspecialised
(``bench/jit_variants.py``), so the variants a config needs depend only on the *kinds* of work:
decode passes of one token and of several, a prefill long enough that its fp8 KV is dequantised
once, a short prefill whose rows are read in the kernel, gathered chunks, the DCP merge. The
steps below produce each kind for the executor's config, on scratch caches of a few blocks and
random inputs, through the executor's own calls (so the collectives of those steps run too:
every rank must call :func:`warmup` at the same point). tests/kernels/test_jit_variants.py
counts, on the CPU, that the simulate preset's steps need no new variant after it.
"""

from __future__ import annotations

import numpy as np
import torch

from cpplan.planner.compile import compile as compile_plan
from cpplan.runtime.collectives import ACT_DTYPES
from cpplan.runtime.executor import LayerCache, StepExecutor
from cpplan.schemas.config import ParallelConfig
from cpplan.schemas.errors import StepInputError, UsageError
from cpplan.schemas.step import StepInput

# Decode rows of at least this many keys on a rank take other indexer variants (the Triton
# set's balanced logits launch, ``IndexerTiles.decode_balanced_keys``; the filter path of the
# long-row select): where ``max_model_len`` allows such rows, a warm-up step has two of them.
LONG_DECODE_KEYS = 16384


def warmup_steps(config: ParallelConfig, max_tokens: int, max_requests: int) -> list[StepInput]:
    """The synthetic global steps (see the module docstring), sized to fit ``max_tokens`` per
    rank (and the largest graph size within it), ``max_requests`` and ``max_model_len``: one
    decode; several decodes (the largest graph size that fits, else 8); one long prompt (about
    4 x topk tokens per rank: dequantise-once attention); one decode with a short prompt (rows
    read in the kernel); where ``max_model_len`` exceeds ``LONG_DECODE_KEYS``, two decodes of
    ``LONG_DECODE_KEYS`` keys a rank (or as many as it allows). Steps of two or more requests
    are left out when ``max_requests`` is 1 (no step of that executor has them)."""
    p_size, mml = config.pcp_size, config.max_model_len
    ctx = max(1, min(mml - 1, 2 * config.topk))
    fits = [g for g in config.cudagraph_token_sizes if g <= max_tokens]
    if len(fits) < len(config.cudagraph_token_sizes) and fits:
        max_tokens = fits[-1]  # a count padded to a larger graph size would not fit
    many = max(2, min(fits[-1] if fits else 8, max_tokens, max_requests))
    long = max(2 * p_size, min(mml, p_size * max_tokens // 2, 4 * config.topk * p_size))
    short = min(mml, 2 * p_size * config.dcp_size)
    steps = [([ctx], [1], [False]), ([0], [long], [True])]
    if max_requests >= 2:
        steps += [([ctx] * many, [1] * many, [False] * many), ([ctx, 0], [1, short], [False, True])]
        if mml - 1 > LONG_DECODE_KEYS:
            far = min(mml - 1, LONG_DECODE_KEYS * config.dcp_size)
            steps.append(([far] * 2, [1, 1], [False, False]))
    out = []
    for i, (c, q, pre) in enumerate(steps):
        ids = [f"cpplan-warmup-{i}-{j}" for j in range(len(c))]
        out.append(StepInput.build(-(i + 1) & (2**63 - 1), ids, c, q, pre))
    return out


def warmup(executor: StepExecutor, *, seed: int = 0) -> int:
    """Run :func:`warmup_steps` through ``executor`` on scratch caches (never the engine's);
    returns the number of steps run (a step that does not fit a very small executor or
    max_model_len is left out: no step of that shape could run on it). Collective: call it
    on every rank at the same time."""
    if not isinstance(executor, StepExecutor):
        raise UsageError(f"warmup: got {type(executor).__name__}; expected a StepExecutor")
    cfg = executor.config
    gen = torch.Generator(device=executor.device).manual_seed(seed)
    done = 0
    for step in warmup_steps(cfg, executor.max_tokens, executor.max_requests):
        try:
            step.validate(cfg)
        except StepInputError:  # longer than max_model_len allows: no real step has it either
            continue
        plan = compile_plan(cfg, step)
        if plan.padded_num_tokens > executor.max_tokens:  # tiny executors: the same on each rank
            continue
        tables, num_blocks = _scratch_tables(plan, executor.dcp_rank)
        cache = LayerCache.empty(cfg, num_blocks, executor.device)
        bound = executor.bind(plan, tables, num_blocks)
        t, act = plan.padded_num_tokens, ACT_DTYPES[cfg.activation_dtype]

        def rnd(*shape, dtype=torch.float32):
            return torch.randn(*shape, generator=gen, device=executor.device).to(dtype)

        for _ in range(cfg.num_layers):  # the ledger expects every layer's collectives
            executor.insert(bound, cache, rnd(t, cfg.qk_head_dim), rnd(t, cfg.index_head_dim))
            executor.attend(bound, cache, rnd(t, cfg.num_heads, cfg.qk_head_dim, dtype=act),
                            rnd(t, cfg.index_num_heads, cfg.index_head_dim, dtype=act),
                            rnd(t, cfg.index_num_heads).abs())
        executor.restore(bound, torch.zeros(t, cfg.hidden_size, dtype=act,
                                            device=executor.device))
        executor.finish(bound)
        done += 1
    return done


def _scratch_tables(plan, dcp_rank: int) -> tuple[np.ndarray, int]:
    """Block tables over fresh blocks 1.. for this rank's shard of every request of ``plan``."""
    bs = plan.config.block_size
    need = -(-plan.dcp_local_lens.np()[:, dcp_rank].astype(np.int64) // bs)
    width = max(1, int(need.max()) if need.size else 1)
    tables = np.zeros((plan.num_requests, width), np.int64)
    nxt = 1
    for i, n in enumerate(need.tolist()):
        tables[i, :n] = np.arange(nxt, nxt + n)
        nxt += n
    return tables, nxt
