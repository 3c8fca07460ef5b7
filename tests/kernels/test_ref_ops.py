"""Reference attention, merge, index maps and indexer against naive per-token, per-key loops."""

import math

import pytest
import torch

from cpplan.runtime.kernels import reference as ref
from tests.kernels.caches import block_planar

NO_KEY = ref.NO_KEY


def _naive_attention(q, kv_rows, indices, sm_scale):
    """kv_rows: [N, 576] float64 (already dequantised). Loops over tokens, heads and keys."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, 512, dtype=torch.float64)
    lse = torch.full((T, H), -math.inf, dtype=torch.float64)
    for t in range(T):
        keys = [int(i) for i in indices[t] if i >= 0]
        for h in range(H):
            if not keys:
                continue
            s = [float(q[t, h].double() @ kv_rows[i]) * sm_scale for i in keys]
            m = max(s)
            den = sum(math.exp(x - m) for x in s)
            lse[t, h] = m + math.log(den)
            for x, i in zip(s, keys):
                out[t, h] += math.exp(x - m) / den * kv_rows[i, :512]
    return out, lse


def _indices(T, topk, N, seed, invalid_rows=(0,)):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, N, (T, topk), generator=g, dtype=torch.int32)
    idx[torch.rand(T, topk, generator=g) < 0.3] = NO_KEY
    for r in invalid_rows:
        idx[r] = NO_KEY
    idx[-1, 0] = N - 1  # the end of the buffer
    return idx


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.float64])
def test_attention_matches_naive(kv_format, qdtype):
    g = torch.Generator().manual_seed(5)
    T, H, N, topk = 4, 3, 40, 7
    q = torch.randn(T, H, 576, generator=g).to(qdtype)
    kv = torch.randn(N, 576, generator=g)
    idx = _indices(T, topk, N, 6)
    if kv_format == "fp8_ds_mla":
        buf, rows = ref.quantize_fp8_ds_mla(kv), ref.dequantize_fp8_ds_mla(ref.quantize_fp8_ds_mla(kv))
    else:
        buf, rows = kv, kv
    out, lse = ref.sparse_mla_attention(q, buf, idx, 0.05, kv_format)
    want_o, want_l = _naive_attention(q, rows.double(), idx, 0.05)
    assert out.dtype == qdtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_l, rtol=1e-5, atol=1e-5)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()


def test_attention_paged_cache_view():
    g = torch.Generator().manual_seed(7)
    cache = ref.quantize_fp8_ds_mla(torch.randn(3 * 64, 576, generator=g)).reshape(3, 64, 656)
    q = torch.randn(2, 2, 576, generator=g)
    idx = torch.tensor([[0, 191, -1], [64, 65, 128]], dtype=torch.int32)
    a = ref.sparse_mla_attention(q, cache, idx, 0.1, "fp8_ds_mla")
    b = ref.sparse_mla_attention(q, cache.reshape(-1, 656), idx, 0.1, "fp8_ds_mla")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_lse_merge_matches_attention_over_union():
    g = torch.Generator().manual_seed(8)
    T, H, N = 3, 2, 30
    q = torch.randn(T, H, 576, generator=g, dtype=torch.float64)
    kv = torch.randn(N, 576, generator=g, dtype=torch.float64)
    idx = _indices(T, 12, N, 9)
    parts = [ref.sparse_mla_attention(q, kv, torch.where(torch.arange(12) % 3 == r, idx, NO_KEY),
                                      0.07) for r in range(3)]
    out, lse = ref.lse_merge(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    want_o, want_l = ref.sparse_mla_attention(q, kv, idx, 0.07)
    # lse travels as float32, so the weights carry its rounding (~6e-8 relative)
    torch.testing.assert_close(out, want_o, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_l)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()


def _owner_local(t, W, I):
    return (t // I) % W, (t // (W * I)) * I + t % I


@pytest.mark.parametrize("W,I", [(1, 1), (2, 1), (4, 2), (3, 4)])
def test_remap_matches_design_example_and_loop(W, I):
    g = torch.Generator().manual_seed(10)
    ids = torch.randint(-1, 300, (5, 9), generator=g)
    pcu = torch.tensor([0, 7, 7, 40, 3])
    PT = 200
    rows = ref.remap_to_gathered(ids, pcu, PT, W, I)
    assert rows.dtype == torch.int32
    for j in range(5):
        for k in range(9):
            t = int(ids[j, k])
            o, l = _owner_local(t, W, I)
            assert int(rows[j, k]) == (NO_KEY if t < 0 else o * PT + int(pcu[j]) + l)


def test_remap_design_worked_example():
    # docs/design.md §3.5: P = W = 2, I = 1, extents [164, 3], pad [82, 2], PT 84, pcu [0, 82]
    r0 = ref.remap_to_gathered(torch.arange(6)[None], torch.tensor([0]), 84, 2, 1)
    assert r0.tolist() == [[0, 84, 1, 85, 2, 86]]
    r1 = ref.remap_to_gathered(torch.arange(3)[None], torch.tensor([82]), 84, 2, 1)
    assert r1.tolist() == [[82, 166, 83]]
    gathered = torch.arange(168 * 2, dtype=torch.uint8).reshape(168, 2)
    dein = torch.tensor([0, 84, 1, 85])
    assert torch.equal(ref.deinterleave_index_select(gathered, dein), gathered[[0, 84, 1, 85]])


@pytest.mark.parametrize("W,rank,I", [(1, 0, 1), (2, 1, 1), (4, 2, 2), (2, 0, 64)])
def test_filter_local_slots_loop(W, rank, I):
    g = torch.Generator().manual_seed(11)
    B = 64
    ids = torch.randint(-1, 1000, (4, 16), generator=g)
    bt = torch.randint(0, 50, (4, 20), generator=g, dtype=torch.int32)
    slots = ref.filter_local_slots(ids, bt, B, W, rank, I)
    for j in range(4):
        for k in range(16):
            t = int(ids[j, k])
            o, l = _owner_local(t, W, I)
            want = int(bt[j, l // B]) * B + l % B if t >= 0 and o == rank else NO_KEY
            assert int(slots[j, k]) == want


def test_indexer_scores_loop():
    g = torch.Generator().manual_seed(12)
    T, Hi, N, L = 3, 4, 20, 6
    q = torch.randint(-3, 4, (T, Hi, 128), generator=g).float()
    w = torch.randint(-2, 3, (T, Hi), generator=g).float()
    kp = ref.quantize_indexer_k(torch.randint(-4, 5, (N, 128), generator=g).float())
    kd = ref.dequantize_indexer_k(kp).double()
    rows = torch.randint(-1, N, (T, L), generator=g)
    s = ref.indexer_scores(q, w, kp, rows)
    assert s.dtype == torch.float64
    for j in range(T):
        for c in range(L):
            r = int(rows[j, c])
            want = -math.inf if r < 0 else sum(
                float(w[j, h]) * max(0.0, float(q[j, h].double() @ kd[r])) for h in range(Hi))
            assert float(s[j, c]) == want


def test_topk_reference_order_ties_by_id():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 9.0]], dtype=torch.float64)
    ids = torch.tensor([[5, 9, 2, 7, 4, -1]])
    s, i = ref.topk_reference_order(scores, ids, 4)
    assert i.tolist() == [[2, 4, 9, 7]] and s.tolist() == [[3.0, 3.0, 3.0, 2.0]]
    s, i = ref.topk_reference_order(scores, ids, 8)
    assert i.tolist() == [[2, 4, 9, 7, 5, -1, -1, -1]]
    assert torch.isneginf(s[0, 5:]).all()


def test_topk_random_against_sorted_python():
    g = torch.Generator().manual_seed(13)
    scores = torch.randint(0, 5, (6, 40), generator=g).double()
    ids = torch.randperm(40, generator=g)[None].repeat(6, 1)
    ids[:, ::7] = NO_KEY
    _, i = ref.topk_reference_order(scores, ids, 10)
    for j in range(6):
        cand = sorted((-float(scores[j, c]), int(ids[j, c])) for c in range(40) if ids[j, c] >= 0)
        assert i[j].tolist() == [c[1] for c in cand[:10]]


def test_indexer_prefill_and_decode_helpers():
    g = torch.Generator().manual_seed(14)
    W, I, PT, Hi = 2, 2, 16, 2
    q = torch.randint(-2, 3, (3, Hi, 128), generator=g).float()
    w = torch.ones(3, Hi)
    k = ref.quantize_indexer_k(torch.randint(-2, 3, (W * PT, 128), generator=g).float())
    key_len = torch.tensor([5, 0, 11])
    pcu = torch.tensor([0, 0, 6])
    _, ids = ref.indexer_topk_prefill(q, w, k, key_len, pcu, PT, W, I, 4)
    for j in range(3):
        keys = range(int(key_len[j]))
        sc = {t: float(ref.indexer_scores(q[j:j + 1], w[j:j + 1], k,
                                          ref.remap_to_gathered(torch.tensor([[t]]), pcu[j:j + 1],
                                                                PT, W, I))[0, 0]) for t in keys}
        want = sorted(keys, key=lambda t: (-sc[t], t))[:4]
        assert ids[j].tolist() == want + [NO_KEY] * (4 - len(want))
    # decode: local indices map to slots and global ids
    bt = torch.tensor([[3, 1], [0, 2], [1, 0]], dtype=torch.int32)
    slots, gids = ref.decode_key_slots(torch.tensor([2, 0, 70]), bt, 64, W, 1, I)
    assert slots[0, :2].tolist() == [192, 193] and gids[0, :2].tolist() == [2, 3]
    assert (slots[1] == NO_KEY).all() and slots[2, 64].item() == 0 and gids[2, 64].item() == 130
    _, id_dec = ref.indexer_topk_decode(q, w, block_planar(k, 8), torch.tensor([2, 0, 3]), bt, 8,
                                        W, 1, I, 2)
    assert id_dec[1].tolist() == [NO_KEY, NO_KEY]
