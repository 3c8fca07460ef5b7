"""The golden scenarios: named (config, step) pairs covering the planner's cases (issue 4).

``python -m tests.golden.regen`` writes each as ``<name>.step.json`` + ``<name>.config.json``
into tests/golden/v<SCHEMA_VERSION>/ together with the compiled ``<name>.msgpack`` and its
``<name>.inspect.json``. The committed JSON inputs are the source of truth for the test; this
module only creates them.
"""

from __future__ import annotations

import numpy as np

from cpplan.schemas import ParallelConfig, StepInput


def _cfg(p, w, i=1, **kw) -> ParallelConfig:
    kw.setdefault("max_model_len", 200_000)
    return ParallelConfig(pcp_size=p, dcp_size=w, interleave_size=i, **kw)


def _step(step_id, reqs, sampled=None) -> StepInput:
    """reqs: (c, q, is_prefilling) tuples; req_ids are r0, r1, ...; sampled: per request (or
    None: the step names no sampled rows)."""
    return StepInput.build(step_id, [f"r{k}" for k in range(len(reqs))],
                           [r[0] for r in reqs], [r[1] for r in reqs], [r[2] for r in reqs],
                           sampled)


def _mixed(seed: int, n: int, max_ctx: int = 128_000, prefill_frac: float = 0.1):
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        if rng.random() < prefill_frac or k % 10 == 3:  # at least one prefill in ten
            chunked = rng.random() < 0.3
            out.append((int(rng.integers(1, 60_000)) if chunked else 0,
                        int(rng.integers(1, 16_384)), True))
        else:
            out.append((int(rng.integers(1, max_ctx)), 1, False))
    return out


def scenarios() -> dict[str, tuple[ParallelConfig, StepInput]]:
    s: dict[str, tuple[ParallelConfig, StepInput]] = {}
    decodes = [(c, 1, False) for c in (5, 64, 1000, 4097, 65_536, 127_999)]
    s["decode_only_p2w2"] = (_cfg(2, 2), _step(1, decodes))
    s["decode_only_p4w4_i16"] = (_cfg(4, 4, 16), _step(2, decodes))
    s["decode_only_p1w1"] = (_cfg(1, 1), _step(3, decodes))
    s["decode_spec_tokens_p2w2"] = (_cfg(2, 2), _step(4, [(100, 3, False), (900, 2, False)]))
    s["single_decode_p4w4"] = (_cfg(4, 4), _step(5, [(31, 1, False)]))
    s["empty_step_p2w2"] = (_cfg(2, 2), _step(6, []))
    s["prefill_only_long_p2w2"] = (_cfg(2, 2), _step(7, [(0, 32_768, True)]))
    s["prefill_only_many_p4w4"] = (_cfg(4, 4), _step(8, [(0, q, True) for q in
                                                         (100, 2_000, 5_000, 64, 17)]))
    s["mixed_p2w2"] = (_cfg(2, 2), _step(9, _mixed(9, 24)))
    s["mixed_p4w4"] = (_cfg(4, 4), _step(10, _mixed(10, 40)))
    s["mixed_p4w4_i16"] = (_cfg(4, 4, 16), _step(11, _mixed(11, 40)))
    s["mixed_p4w4_i64"] = (_cfg(4, 4, 64), _step(12, _mixed(12, 40)))
    s["mixed_p3w3_i2"] = (_cfg(3, 3, 2), _step(13, _mixed(13, 30)))
    s["two_token_prefill_p2w2"] = (_cfg(2, 2), _step(14, [(50, 1, False), (0, 2, True)]))
    s["two_token_prefill_p4w4"] = (_cfg(4, 4), _step(15, [(50, 1, False), (0, 2, True)]))
    s["replicated_set_p2w2"] = (_cfg(2, 2), _step(16, [(0, q, True) for q in
                                                       (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)]))
    s["replicated_short_p4w4"] = (_cfg(4, 4), _step(17, [(0, q, True) for q in
                                                         (1, 7, 8, 9, 15, 16, 17, 49, 57)]))
    for p in (2, 4):
        sk = 2 * p * 5
        for label, q in (("eq", sk), ("minus1", sk - 1), ("plus1", sk + 1)):
            s[f"q_s_times_k_{label}_p{p}w{p}"] = (_cfg(p, p),
                                                  _step(18, [(7, 1, False), (0, q, True)]))
    s["chunked_prefill_long_ctx_p4w4"] = (
        _cfg(4, 4), _step(19, [(100_000, 2_048, True), (20, 1, False), (150_000, 1, False)]))
    s["chunked_prefill_long_ctx_p2w1"] = (_cfg(2, 1), _step(20, [(100_000, 2_048, True)]))
    # workspace of exactly 2 * shard_rows(1000) = 1000 rows; two prefills of extent 500 fill it
    s["exactly_fill_workspace_p2w2"] = (
        _cfg(2, 2, max_model_len=1000),
        _step(21, [(0, 500, True), (0, 500, True), (0, 500, True)]))
    s["small_workspace_many_chunks_p2w2"] = (
        _cfg(2, 2, max_model_len=4096), _step(22, [(0, q, True) for q in
                                                    (4096, 100, 3000, 1200, 900, 5, 2048)]))
    s["requests_300_p2w2"] = (_cfg(2, 2), _step(23, _mixed(23, 300)))
    s["requests_300_p8w8_i64"] = (_cfg(8, 8, 64), _step(24, _mixed(24, 300)))
    s["p8w8_i64_mixed"] = (_cfg(8, 8, 64), _step(25, _mixed(25, 50, prefill_frac=0.3)))
    s["p8w8_i1_prefill"] = (_cfg(8, 8), _step(26, [(0, 10_000, True), (0, 128, True),
                                                   (0, 127, True)]))
    s["w1_zero_length_rows_p2"] = (_cfg(2, 1), _step(27, [(10, 1, False), (0, 1, True),
                                                          (0, 2, True), (0, 3, True)]))
    s["w1_zero_length_rows_p4"] = (_cfg(4, 1), _step(28, [(0, q, True) for q in (1, 5, 7, 9)]))
    s["w1_mixed_p4"] = (_cfg(4, 1), _step(29, _mixed(29, 30)))
    s["p1w2_dcp_only"] = (_cfg(1, 2), _step(30, _mixed(30, 20, prefill_frac=0.3)))
    s["p1w4_i64_dcp_only"] = (_cfg(1, 4, 64), _step(31, _mixed(31, 20, prefill_frac=0.3)))
    s["p1w1_prefill"] = (_cfg(1, 1), _step(32, [(0, 300, True), (5, 1, False)]))
    s["p1w1_mixed"] = (_cfg(1, 1), _step(33, _mixed(33, 20, prefill_frac=0.3)))
    graphs = (8, 16, 32, 64, 128, 256, 512)
    s["cudagraph_fits_p2w2"] = (_cfg(2, 2, cudagraph_token_sizes=graphs),
                                _step(34, [(100, 1, False)] * 1 + [(0, 40, True)]))
    s["cudagraph_exact_p2w2"] = (_cfg(2, 2, cudagraph_token_sizes=graphs),
                                 _step(35, [(100, 1, False), (0, 60, True)]))
    s["cudagraph_above_largest_eager_p2w2"] = (_cfg(2, 2, cudagraph_token_sizes=graphs),
                                               _step(36, [(0, 4_000, True)]))
    s["cudagraph_decode_only_p4w4"] = (_cfg(4, 4, cudagraph_token_sizes=graphs),
                                       _step(37, decodes))
    s["eager_uneven_ranks_p2w1"] = (_cfg(2, 1), _step(38, [(0, 5, True), (0, 9, True)]))
    s["bf16_cache_mixed_p2w2"] = (_cfg(2, 2, kv_cache_dtype="bf16"), _step(39, _mixed(39, 20)))
    s["prefill_of_one_token_p4w4"] = (_cfg(4, 4), _step(40, [(0, 1, True), (70, 1, True)]))
    s["max_model_len_extent_p2w2"] = (_cfg(2, 2, max_model_len=8192),
                                      _step(41, [(8000, 192, True), (8191, 1, False)]))
    s["decodes_interleaved_in_input_p2w2"] = (
        _cfg(2, 2), _step(42, [(0, 40, True), (9, 1, False), (0, 3, True), (70, 1, False)]))
    # schema 2: shared-indexer layers (GLM-5's pattern) and sampled rows
    glm = (0, 0, 2, 2, 4, 4, 4, 7)
    mixed = [(300, 1, False), (0, 40, True), (20, 2, True), (900, 1, False), (0, 5, True)]
    s["shared_indexer_p2w2"] = (_cfg(2, 2, num_layers=8, indexer_sources=glm),
                                _step(40, mixed))
    s["shared_indexer_p1w2"] = (_cfg(1, 2, num_layers=8, indexer_sources=glm),
                                _step(41, mixed))
    s["shared_indexer_p2w1"] = (_cfg(2, 1, num_layers=8, indexer_sources=glm),
                                _step(42, mixed))
    sampled = [True, False, True, True, True]
    s["sampled_rows_p2w2"] = (_cfg(2, 2), _step(43, mixed, sampled))
    s["sampled_rows_p4w1"] = (_cfg(4, 1), _step(44, [(0, 3, True), (0, 9, True), (5, 1, False),
                                                     (0, 70, True)], [True] * 4))
    s["sampled_none_p2w2"] = (_cfg(2, 2), _step(45, mixed, [False] * 5))
    s["sampled_rows_p1w1"] = (_cfg(1, 1), _step(46, mixed, sampled))
    s["sampled_shared_p4w4_i16"] = (_cfg(4, 4, 16, num_layers=8, indexer_sources=glm),
                                    _step(47, _mixed(47, 30),
                                          [k % 3 != 1 for k in range(30)]))
    # schema 3: vLLM's decode ownership (P > 1, W == 1): each decode on one rank in turn
    owned = dict(shard_decode_requests=True)
    vllm_batch = [(0, 100, True), (40, 1, False), (0, 3, True), (17, 1, False)]
    s["owned_decodes_vllm_batch_p2"] = (_cfg(2, 1, **owned), _step(48, vllm_batch))
    s["owned_decodes_only_p4"] = (_cfg(4, 1, **owned), _step(49, decodes))
    s["owned_decodes_fewer_than_ranks_p8"] = (_cfg(8, 1, **owned),
                                              _step(50, [(5, 1, False), (0, 9, True),
                                                         (64, 2, False)]))
    s["owned_decodes_mixed_p4"] = (_cfg(4, 1, **owned), _step(51, _mixed(51, 30)))
    s["owned_decodes_sampled_p2"] = (_cfg(2, 1, **owned),
                                     _step(52, vllm_batch, [True, True, False, True]))
    s["owned_decodes_graph_sizes_p2"] = (_cfg(2, 1, cudagraph_token_sizes=(8, 16, 64), **owned),
                                         _step(53, decodes))
    s["owned_decodes_shared_indexer_p2"] = (_cfg(2, 1, num_layers=8, indexer_sources=glm,
                                                 **owned), _step(54, mixed))
    return s
