"""Global batches as vLLM 0.32's model runner hands them to ``PCPManager.partition_batch``.

A batch is a dict of columns (numpy, one entry a request): ``req_ids``, ``c`` (computed
tokens), ``q`` (scheduled tokens), ``prefill_len`` and ``idx`` (the request's persistent state
slot, vLLM's ``idx_mapping``). A decode sits past its prompt (``prefill_len <= c``, q = 1); a
prefill chunk inside it (``c + q <= prefill_len``). :func:`input_batch` builds vLLM's own
``InputBatch`` of it (needs vLLM); :func:`step_of` the StepInput cpplan compiles, built here
from the columns (not through cpplan.vllm, whose ``step_input`` is under test).
"""

from __future__ import annotations

import numpy as np

MAX_REQS = 64  # the persistent state slots (idx_mapping draws from them)


def columns(req_ids, c, q, prefill_len, idx=None) -> dict:
    n = len(req_ids)
    idx = np.arange(n) if idx is None else idx
    return {"req_ids": list(req_ids), "c": np.asarray(c, np.int32), "q": np.asarray(q, np.int32),
            "prefill_len": np.asarray(prefill_len, np.int32), "idx": np.asarray(idx, np.intp)}


def random_batch(rng: np.random.Generator, *, max_reqs: int = 24, max_context: int = 3000,
                 max_chunk: int = 600, decode_share: float | None = None) -> dict:
    """A random global batch: decodes and prefill chunks in random order, short and long,
    fresh (c = 0) and continued prefills, one-token prefills; a permutation of state slots."""
    n = int(rng.integers(1, max_reqs + 1))
    share = rng.random() if decode_share is None else decode_share
    decode = rng.random(n) < share
    c = np.where(decode, rng.integers(1, max_context, n), 0)
    continued = ~decode & (rng.random(n) < 0.5)
    c = np.where(continued, rng.integers(1, max_context, n), c)
    # prefill chunk lengths: often short (replicated under DCP, 2P chunks with empties at
    # W = 1), sometimes long
    short = rng.random(n) < 0.4
    q = np.where(short, rng.integers(1, 17, n), rng.integers(1, max_chunk + 1, n))
    q = np.where(decode, 1, q)
    tail = rng.integers(0, 64, n) * (rng.random(n) < 0.5)
    prefill_len = np.where(decode, rng.integers(1, np.maximum(c, 1) + 1), c + q + tail)
    idx = rng.permutation(MAX_REQS)[:n] if n <= MAX_REQS else np.arange(n)
    return columns([f"r{i}" for i in range(n)], c, q, prefill_len, idx)


def decode_batch(rng: np.random.Generator, *, max_reqs: int = 24,
                 max_context: int = 3000) -> dict:
    """Decodes only (the steps a FULL CUDA graph runs)."""
    return random_batch(rng, max_reqs=max_reqs, max_context=max_context, decode_share=1.0)


def hand_batches() -> dict[str, dict]:
    """The corners named in issue 64: a rank with no rows (fewer decodes than ranks, shard
    mode), replicated-only steps, one-token prefills, empty KV shards (contexts shorter than
    the DCP world), the issue's own 4-request batch."""
    return {
        "issue64": columns(["p100", "p3", "d40", "d17"], [0, 0, 40, 17], [100, 3, 1, 1],
                           [100, 3, 40, 17]),
        "one_decode": columns(["d"], [9], [1], [5]),
        "decodes_fewer_than_ranks": columns(["a", "b", "c"], [5, 70, 3], [1, 1, 1],
                                            [5, 2, 3]),
        "replicated_only": columns(["a", "b", "c"], [10, 4, 0], [1, 1, 3], [10, 4, 8]),
        "one_token_prefills": columns(["a", "b", "c"], [0, 5, 2], [1, 1, 1], [4, 9, 3]),
        "one_token_fresh": columns(["a"], [0], [1], [1]),
        "empty_kv_shards": columns(["a", "b", "c"], [0, 1, 0], [1, 1, 2], [1, 1, 2]),
        "tiny_context_decodes": columns(["a", "b"], [1, 2], [1, 1], [1, 1]),
        "long_single_prefill": columns(["a"], [0], [1500], [1600]),
        "prefills_only": columns(["a", "b"], [0, 300], [257, 31], [257, 400]),
    }


def step_of(cols: dict, step_id: int = 0):
    """cpplan's StepInput of the batch: one entry a request, prefilling where c < prefill_len."""
    from cpplan.schemas import StepInput

    return StepInput.build(step_id, cols["req_ids"], cols["c"], cols["q"],
                           cols["c"] < cols["prefill_len"])


def input_batch(cols: dict):
    """vLLM's global InputBatch of the columns, as its runner's prepare_inputs leaves it on the
    CPU (the fields partition_batch and the attention builders read)."""
    import torch
    from vllm.v1.worker.gpu.input_batch import InputBatch

    c, q, pl, idx = cols["c"], cols["q"], cols["prefill_len"], cols["idx"]
    n = len(q)
    qsl = np.zeros(n + 1, np.int32)
    np.cumsum(q, out=qsl[1:])
    total = int(qsl[-1])
    positions = np.concatenate([np.arange(c[i], c[i] + q[i]) for i in range(n)])
    computed_prefill = np.minimum(c, pl)
    pre = computed_prefill < pl
    return InputBatch(
        req_ids=list(cols["req_ids"]), num_reqs=n, num_reqs_after_padding=n,
        idx_mapping=torch.from_numpy(idx.astype(np.int64)), idx_mapping_np=idx,
        expanded_idx_mapping=torch.from_numpy(idx.astype(np.int64)),
        expanded_local_pos=torch.zeros(n, dtype=torch.int32), num_scheduled_tokens=q,
        num_tokens=total, num_tokens_after_padding=total, num_draft_tokens=0,
        num_draft_tokens_per_req=None, query_start_loc=torch.from_numpy(qsl),
        query_start_loc_np=qsl, seq_lens=torch.from_numpy(c + q),
        seq_lens_cpu_upper_bound=torch.from_numpy(c + q), dcp_local_seq_lens=None,
        num_computed_tokens_np=c, prefill_len_np=pl,
        num_computed_prefill_tokens_np=computed_prefill, is_prefilling_np=pre,
        has_prefill=bool(pre.any()), decode_graph_eligible=not bool(pre.any()),
        input_ids=torch.arange(total, dtype=torch.int32),
        positions=torch.from_numpy(positions.astype(np.int64)),
        is_padding=torch.zeros(total, dtype=torch.bool),
        logits_indices=torch.from_numpy((qsl[1:] - 1).astype(np.int64)),
        cu_num_logits=torch.arange(n + 1, dtype=torch.int32),
        cu_num_logits_np=np.arange(n + 1, dtype=np.int32), has_structured_output_reqs=False,
        prompt_lens=None)
