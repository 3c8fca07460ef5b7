"""vLLM 0.32's own answer for one global batch: its ``PCPManager.partition_batch`` on every PCP
rank, and what its DSA indexer and FlashMLA-sparse builders derive on the host from that rank's
local batch. The reference of tests/with_vllm/test_differential.py (needs vLLM).

Everything vLLM computes here is vLLM's code, called as its model runner calls it. Where a
builder as a whole cannot run on the CPU (the indexer's ``build`` launches a Triton kernel;
FlashMLA-sparse pins host memory), its host steps are called in the builder's order with the
builder's arguments (read from vllm/v1/attention/backends/mla/indexer.py ``build`` and
flashmla_sparse.py ``_build_fp8_separate_prefill_decode``, which runs itself with
``pin_memory`` dropped and its decode kernel's metadata stubbed: neither changes a host
value read here).
"""

from __future__ import annotations

import contextlib
import types

import numpy as np

MAX_NUM_TOKENS = 1 << 15
LOCAL_FIELDS = (  # vLLM's InputBatch fields partition_batch sets, then its private arrays
    "req_ids", "num_reqs", "num_reqs_after_padding", "idx_mapping_np", "num_scheduled_tokens",
    "num_tokens", "num_tokens_after_padding", "query_start_loc_np", "positions", "seq_lens",
    "seq_lens_cpu_upper_bound", "num_computed_tokens_np", "is_prefilling_np", "has_prefill",
    "logits_indices", "cu_num_logits_np", "dcp_local_seq_lens_cpu_upper_bound",
)
PRIVATE = ("hidden_restore_idx", "padded_gather_idx", "gathered_kv_write_mask",
           "local_gather_idx")
_FLASHMLA_THRESHOLDS = {16: 128, 32: 128, 64: 256, 128: 256}  # flashmla_sparse.py, not SM100


def _np(value):
    """A host copy (vLLM's local tensors are views of buffers the next step overwrites)."""
    if value is None or isinstance(value, (bool, int, np.integer)):
        return value
    if hasattr(value, "numpy"):
        return value.detach().cpu().numpy().copy()
    if isinstance(value, list):
        return list(value)
    return np.array(value, copy=True)


class Managers:
    """One PCPManager a (topology, PCP rank), made once and reused (as vLLM's runner does)."""

    def __init__(self) -> None:
        self._made: dict = {}

    def get(self, p: int, rank: int, w: int, interleave: int, shard: bool):
        import torch
        from vllm.v1.worker.gpu.pcp_manager import PCPManager

        key = (p, rank, w, interleave, shard)
        if key not in self._made:
            self._made[key] = PCPManager(p, rank, torch.device("cpu"), shard,
                                         max_num_reqs=MAX_NUM_TOKENS // 2,
                                         max_num_tokens=MAX_NUM_TOKENS, dcp_world_size=w,
                                         dcp_rank=0, cp_interleave=interleave)
        return self._made[key]


def descriptor(mode: str, num_tokens: int = 0, num_reqs: int | None = None):
    """vLLM's BatchExecutionDescriptor: ``mode`` NONE, PIECEWISE or FULL."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    return BatchExecutionDescriptor(cg_mode=getattr(CUDAGraphMode, mode), num_tokens=num_tokens,
                                    num_reqs=num_reqs)


def tokens_for_dispatch(managers: Managers, cols, p, w, interleave, shard) -> int:
    """vLLM's own largest rank-local token count (what its graph dispatcher pads)."""
    mgr = managers.get(p, 0, w, interleave, shard)
    pre = np.minimum(cols["c"], cols["prefill_len"]) < cols["prefill_len"]
    return int(mgr.get_num_tokens_for_dispatch(cols["q"], pre))


def partition(managers: Managers, batch, p, rank, w, interleave, shard, desc) -> tuple:
    """(the local InputBatch's fields and the private arrays, as host copies; the local
    InputBatch itself, for the builders)."""
    mgr = managers.get(p, rank, w, interleave, shard)
    local = mgr.partition_batch(batch, desc)
    out = {k: _np(getattr(local, k)) for k in LOCAL_FIELDS}
    out.update({k: _np(getattr(mgr, "_" + k)) for k in PRIVATE})
    return out, local


def global_fields(batch) -> dict:
    """P == 1: vLLM runs no PCP manager; the runner's own global batch is what attention sees."""
    out = {k: _np(getattr(batch, k)) for k in LOCAL_FIELDS}
    out.update(dict.fromkeys(PRIVATE))
    return out


# ------------------------------------------------------------------ the DSA builders' host side
def attention_view(local, full: bool) -> types.SimpleNamespace:
    """The CommonAttentionMetadata fields the builders read, as model_states/default.py
    ``prepare_attn`` and attn_utils.py ``build_attn_metadata`` make them from the local batch
    (FULL graphs: the padded request and token counts; eager and PIECEWISE: the real ones)."""
    import torch

    num_reqs = local.num_reqs_after_padding if full else local.num_reqs
    num_tokens = local.num_tokens_after_padding if full else local.num_tokens
    max_query_len = local.max_query_len
    if max_query_len is None:
        max_query_len = int(local.num_scheduled_tokens.max())
    dcp_ub = local.dcp_local_seq_lens_cpu_upper_bound
    return types.SimpleNamespace(
        num_reqs=num_reqs, num_actual_tokens=num_tokens, max_query_len=max_query_len,
        query_start_loc_cpu=torch.from_numpy(local.query_start_loc_np[: num_reqs + 1]),
        seq_lens=local.seq_lens[:num_reqs],
        seq_lens_cpu_upper_bound=local.seq_lens_cpu_upper_bound[:num_reqs],
        dcp_local_seq_lens_cpu_upper_bound=None if dcp_ub is None else dcp_ub[:num_reqs],
        is_prefilling=torch.from_numpy(local.is_prefilling_np), req_idx=local.idx_mapping_np,
        block_table_tensor=torch.zeros((num_reqs, 1), dtype=torch.int32),
        max_logits_per_req=None)


def indexer(cam, p, w, interleave, max_model_len, factor, logits_mb, spec_tokens=0,
            require_uniform=True) -> dict:
    """DeepseekV32IndexerMetadataBuilder.build's host steps (compress ratio 1): the split, the
    prefill chunk specs and, under PCP + DCP, each chunk's PCPGlobalChunkPlan."""
    import torch
    from vllm.v1.attention.backends.mla import indexer as ix
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens, split_decodes_and_prefills

    use_pcp = p > 1
    builder = types.SimpleNamespace(
        dcp_world_size=w, max_prefill_buffer_size=max_model_len * (576 * 2 // 132) * factor,
        _split_indexer_prefill_chunks=ix.DeepseekV32IndexerMetadataBuilder.
        _split_indexer_prefill_chunks)
    out = {"indexer_num_decodes": 0, "indexer_num_prefills": 0, "indexer_num_decode_tokens": 0,
           "indexer_num_prefill_tokens": 0, "indexer_chunk_specs": np.zeros((0, 4), np.int64)}
    plans = []
    if cam.num_actual_tokens:
        nd, npre, ndt, npt = split_decodes_and_prefills(
            cam, decode_threshold=1 + spec_tokens, require_uniform=require_uniform,
            treat_short_extends_as_decodes=not use_pcp)
        out.update(indexer_num_decodes=nd, indexer_num_prefills=npre,
                   indexer_num_decode_tokens=ndt, indexer_num_prefill_tokens=npt)
        if npre:
            qsl = cam.query_start_loc_cpu
            prefill_q = torch.diff(qsl[nd: nd + npre + 1])
            logits = logits_mb * 1024 * 1024
            seq_cpu = cam.seq_lens_cpu_upper_bound
            if use_pcp and w > 1:
                req_idx = cam.req_idx
                shard_cpu = cam.dcp_local_seq_lens_cpu_upper_bound
                if shard_cpu is None:
                    shard_cpu = get_dcp_local_seq_lens(seq_cpu, w, 0, interleave)
                shard = shard_cpu.numpy()
                specs = ix.DeepseekV32IndexerMetadataBuilder._split_pcp_dcp_prefill_chunks(
                    builder, req_idx[nd:], shard[nd:], prefill_q, logits, request_offset=nd)
                for rs, _ in specs:
                    plans.append(ix.build_pcp_global_chunk_plan(
                        req_idx[rs], shard[rs], w, torch.device("cpu"), interleave))
            else:
                specs = ix.DeepseekV32IndexerMetadataBuilder._split_indexer_prefill_chunks(
                    seq_cpu[nd:], prefill_q, builder.max_prefill_buffer_size, logits,
                    request_offset=nd)
            out["indexer_chunk_specs"] = np.array(
                [(rs.start, rs.stop, qs.start, qs.stop) for rs, qs in specs],
                dtype=np.int64).reshape(-1, 4)
    for key in ("row_start_cu", "global_cu", "padded_local_cu", "padded_local_total", "total",
                "deinterleave_idx"):
        out["pcp_" + key] = (tuple(_np(getattr(pl, key)) for pl in plans)
                             if use_pcp and w > 1 else None)
    return out


@contextlib.contextmanager
def _unpinned():
    """torch.zeros without pin_memory (the CPU has no pinned memory; values are the same)."""
    import torch

    zeros = torch.zeros

    def plain(*args, pin_memory=False, **kwargs):
        return zeros(*args, **kwargs)

    torch.zeros = plain
    try:
        yield
    finally:
        torch.zeros = zeros


def flashmla(cam, p, w, interleave, num_heads, max_model_len, factor, spec_tokens=0) -> dict:
    """FlashMLA-sparse's split (SparseMLACommonMetadataBuilder.build) and its own
    ``_build_fp8_separate_prefill_decode``, run on a stand-in builder holding what it reads."""
    import torch
    from vllm.v1.attention.backends.mla import flashmla_sparse as fs
    from vllm.v1.attention.backends.utils import split_decodes_and_prefills

    use_pcp = p > 1
    threshold = _FLASHMLA_THRESHOLDS.get(num_heads, 256)
    if spec_tokens:
        threshold = max(threshold, 1 + spec_tokens)
    if w > 1 and interleave != 1:
        threshold = 1
    out = dict.fromkeys(("row_bounds", "shard_rows", "workspace_starts",
                         "workspace_chunk_bounds", "workspace_chunk_tokens",
                         "workspace_chunk_rows", "prefill_request_id"))
    out.update(flashmla_num_decodes=0, flashmla_num_prefills=0, flashmla_num_decode_tokens=0,
               flashmla_num_prefill_tokens=0)
    if cam.num_actual_tokens == 0:
        return out
    nd, npre, ndt, _ = split_decodes_and_prefills(
        cam, decode_threshold=threshold, treat_short_extends_as_decodes=not use_pcp,
        require_uniform=True)
    vllm_config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(max_model_len=max_model_len),
        attention_config=types.SimpleNamespace(sparse_mla_prefill_workspace_factor=factor))
    builder = types.SimpleNamespace(
        vllm_config=vllm_config, device=torch.device("cpu"),
        pcp_dcp_kv_gather=use_pcp and w > 1, dcp_world_size=w,
        cp_kv_cache_interleave_size=interleave,
        _build_fp8_mixed_decode_prefill=lambda: None,
        dummy_block_table=torch.zeros((MAX_NUM_TOKENS, 1), dtype=torch.int32),
        max_model_len_tensor=torch.zeros(MAX_NUM_TOKENS, dtype=torch.int32))
    metadata = types.SimpleNamespace(num_decodes=nd, num_prefills=npre, num_decode_tokens=ndt)
    real_get_mla_metadata = fs.get_mla_metadata
    fs.get_mla_metadata = lambda *a, **k: (None, None)
    try:
        with _unpinned():
            fp8 = fs.FlashMLASparseMetadataBuilder._build_fp8_separate_prefill_decode(
                builder, cam, metadata)
    finally:
        fs.get_mla_metadata = real_get_mla_metadata
    out.update(flashmla_num_decodes=fp8.num_decodes, flashmla_num_prefills=fp8.num_prefills,
               flashmla_num_decode_tokens=fp8.num_decode_tokens,
               flashmla_num_prefill_tokens=fp8.num_prefill_tokens)
    if fp8.prefill is None:
        return out
    pre, chunks = fp8.prefill, fp8.prefill.chunks
    out["prefill_request_id"] = _np(pre.request_ids)
    out["workspace_starts"] = _np(pre.workspace_starts)
    out["workspace_chunk_bounds"] = np.array(
        [(ch.req_start_idx, ch.req_start_idx + len(ch.workspace_starts)) for ch in chunks],
        dtype=np.int64).reshape(-1, 2)
    out["workspace_chunk_tokens"] = np.array(
        [(ch.tokens_slice.start, ch.tokens_slice.stop) for ch in chunks],
        dtype=np.int64).reshape(-1, 2)
    out["workspace_chunk_rows"] = np.array([int(ch.chunk_tot_seqlen) for ch in chunks],
                                           dtype=np.int64)
    # the entries: one a prefill row, or (PCP + DCP) one a request with its shard rows, as
    # gathered_prefill_shards returns them to the builder
    if use_pcp and w > 1:
        from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

        shard_cpu = cam.dcp_local_seq_lens_cpu_upper_bound
        if shard_cpu is None:
            shard_cpu = get_dcp_local_seq_lens(cam.seq_lens_cpu_upper_bound, w, 0, interleave)
        bounds, rows = fs.gathered_prefill_shards(cam.req_idx[nd:], shard_cpu[nd:].numpy())
        out["row_bounds"], out["shard_rows"] = bounds.astype(np.int64), rows.astype(np.int64)
    else:
        out["row_bounds"] = np.arange(npre + 1, dtype=np.int64)
    return out


def dcp_local_seq_lens(local, w, dcp_rank, interleave) -> np.ndarray | None:
    """This DCP rank's share of each (padded) row's seq_lens: get_dcp_local_seq_lens, the
    host form of what prepare_dcp_local_seq_lens writes."""
    if w == 1:
        return None
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    seq = local.seq_lens[: local.num_reqs_after_padding]
    return _np(get_dcp_local_seq_lens(seq, w, dcp_rank, interleave))
