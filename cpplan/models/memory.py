"""How much memory the reference forward of :mod:`cpplan.models.reference` takes over one
sequence, and how many query rows it computes at once so that it fits the memory free.

The reference is the model's transformers forward over a whole request (prompt + generated
tokens, S of them, no cache), so the keys of every layer span the whole sequence. Two kinds of
memory:

- *per query row*, O(S) each: one query's attention scores over every key (``[H, S]`` float32,
  about three live copies: scores, masked, softmax) or one query's indexer logits (``[Hi, S]``
  float64, two copies, then its scores, sort values and indices). Transformers' own eager
  attention holds every row at once (``[H, S, S]``: 512 GiB at 32k tokens and 128 heads), so
  the reference computes rows in *chunks* (:func:`query_rows`), memory O(chunk x S);
- *fixed*, O(S) in all: the hidden states, every head's expanded keys and values, the
  indexer's queries, the top-k lists, the logits of the positions compared; and the weights.

The figures are upper estimates from the config's dims (:func:`reference_bytes`); the chunk
takes a share of the memory free now (:func:`free_bytes`: ``torch.cuda.mem_get_info`` on
CUDA, ``MemAvailable`` of /proc/meminfo or ``sysconf`` on the CPU), so allocator slack and
what the estimate misses fit beside it. Where not even one row fits, :func:`check_fits` says
so in one :class:`~cpplan.schemas.errors.ConfigError` line with the numbers.
"""

from __future__ import annotations

import dataclasses
import os

from cpplan.schemas.errors import ConfigError

# of the free memory, the share the reference plans to use (the rest: allocator slack and
# short-lived copies the estimate leaves out)
USABLE_SHARE = 0.8
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class ReferenceBytes:
    """Estimated bytes of the reference forward over ``num_tokens`` tokens: ``fixed`` however
    it is chunked (activations and logits, not the weights), ``per_row`` for each query row
    computed at once."""

    num_tokens: int
    fixed: int
    per_row: int

    def for_rows(self, rows: int) -> int:
        return self.fixed + self.per_row * rows


def reference_bytes(config, num_tokens: int, num_logits: int | None = None) -> ReferenceBytes:
    """The estimate (module docstring) from a transformers config's dims, for one sequence of
    ``num_tokens`` tokens and the logits of ``num_logits`` positions (default all)."""
    s = int(num_tokens)
    heads, index_heads = config.num_attention_heads, config.index_n_heads
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    v = config.v_head_dim
    mlp = max(config.intermediate_size,
              getattr(config, "moe_intermediate_size", 0) * getattr(config, "num_experts_per_tok", 1))
    per_token_f32 = (12 * config.hidden_size + 3 * mlp
                     + heads * (3 * qk + config.qk_nope_head_dim + 3 * v)  # q, k, v, output
                     + 3 * (config.kv_lora_rank + config.qk_rope_head_dim) + 2 * config.q_lora_rank
                     + 3 * index_heads * config.index_head_dim  # the indexer's queries
                     + 2 * config.index_topk)  # top-k lists (GLM-5 keeps the previous one)
    logits = (s if num_logits is None else num_logits) * config.vocab_size * 4 * 2
    per_row = max(16 * index_heads, 12 * heads) * s + 64 * s
    return ReferenceBytes(s, 4 * s * per_token_f32 + logits, per_row)


def weight_bytes(config, dtype) -> int:
    """Bytes of the weights of a model of ``config`` in ``dtype`` (counted on the meta device:
    nothing is allocated)."""
    import copy

    import torch

    from cpplan.models.loading import family_classes

    _, model_cls = family_classes(config.model_type)
    with torch.device("meta"):
        model = model_cls(copy.deepcopy(config))
    return sum(p.numel() for p in model.parameters()) * torch.empty((), dtype=dtype).element_size()


def free_bytes(device) -> int:
    """Bytes free for new tensors on ``device`` now: ``torch.cuda.mem_get_info`` on CUDA
    (plus what torch's allocator caches unused), the kernel's estimate of available memory
    on the CPU."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return _host_available()


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def query_rows(need: ReferenceBytes, budget: int) -> int:
    """Query rows to compute at once within ``budget`` bytes (at most every row, at least
    0: then not even one fits)."""
    room = int(budget * USABLE_SHARE) - need.fixed
    return max(0, min(need.num_tokens, room // max(1, need.per_row)))


def check_fits(need: ReferenceBytes, budget: int, *, weights: int = 0, what: str) -> int:
    """The rows per chunk (:func:`query_rows`) of ``need`` with ``weights`` bytes still to
    load into ``budget``; ConfigError (one line, the numbers) where not one row fits."""
    rows = query_rows(need, budget - weights)
    if rows >= 1:
        return rows
    want = weights + need.for_rows(1)
    raise ConfigError(
        f"--check: the reference forward over {what} ({need.num_tokens:,} tokens) needs about "
        f"{want / GIB:.1f} GiB (weights {weights / GIB:.1f}, activations "
        f"{need.fixed / GIB:.1f}, {need.per_row / 2**20:.1f} MiB a query row) of which it plans "
        f"{USABLE_SHARE:.0%} of the free memory, {budget / GIB:.1f} GiB free; expected a "
        "shorter request, a larger device or no --check")
