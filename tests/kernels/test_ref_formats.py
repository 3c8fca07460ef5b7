"""Reference fp8 formats against a per-value naive quantiser written from docs/design.md §4."""

import math
import struct

import numpy as np
import pytest
import torch

from cpplan.runtime.kernels import reference as ref
from tests.kernels.caches import block_planar


def _naive_scale(amax: float) -> float:
    # float32 arithmetic of the spec formula, checked to be exact for these inputs by frexp below
    a = max(amax, 2.0**-126)
    m, e = math.frexp(a)
    exp = e - 9 + (1 if m > 0.875 else 0)
    assert 2.0 ** (exp - 1) < a / 448 <= 2.0**exp
    return 2.0**exp


def _fp8(x: float) -> int:
    return int(torch.tensor([x], dtype=torch.float64).to(torch.float8_e4m3fn).view(torch.uint8)[0])


def _naive_pack_row(row: np.ndarray) -> bytes:
    out = bytearray()
    scales = []
    for g in range(4):
        vals = row[g * 128 : (g + 1) * 128].astype(np.float32)
        s = _naive_scale(float(np.abs(vals).max()))
        scales.append(s)
        out += bytes(_fp8(float(v) / s) for v in vals)
    for s in scales:
        out += struct.pack("<f", s)
    rope = torch.tensor(row[512:], dtype=torch.float32).to(torch.bfloat16).view(torch.int16)
    for r in rope.tolist():
        out += struct.pack("<h", r)
    return bytes(out)


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 576, generator=g) * torch.logspace(-3, 3, n)[:, None]
    x[0] = 0.0  # all-zero groups: scale floor 2**-126 -> 2**-135 (subnormal) scale
    x[1, :128] = 448.0  # amax exactly 448 -> scale 1
    x[1, 128:256] = 448.0 * 2**-20
    x[2, :128] = 1e-30  # tiny values: subnormal scale, exact round trip through float64
    return x


def test_fp8_ds_mla_bytes_match_naive():
    x = _rows(6, 0)
    packed = ref.quantize_fp8_ds_mla(x)
    assert packed.shape == (6, 656) and packed.dtype == torch.uint8
    for i in range(6):
        assert bytes(packed[i].tolist()) == _naive_pack_row(x[i].numpy()), f"row {i}"


def test_fp8_ds_mla_dequant_exact_and_close():
    x = _rows(16, 1)
    packed = ref.quantize_fp8_ds_mla(x)
    deq = ref.dequantize_fp8_ds_mla(packed)
    # dequantisation is exact: fp8 value times its power-of-two scale, computed in float64
    vals = packed[:, :512].view(torch.float8_e4m3fn).double().reshape(16, 4, 128)
    scale = packed[:, 512:528].contiguous().view(torch.float32).double().reshape(16, 4, 1)
    assert torch.equal(deq[:, :512].double(), (vals * scale).reshape(16, 512))
    # fp8 e4m3 has 3 mantissa bits: relative error <= 2**-4 of the group's scale range
    lat, latd = x[:, :512].reshape(16, 4, 128), deq[:, :512].reshape(16, 4, 128)
    bound = lat.abs().amax(-1, keepdim=True) * 2**-4 + 1e-37
    assert ((lat - latd).abs() <= bound).all()
    assert torch.equal(deq[:, 512:], x[:, 512:].to(torch.bfloat16).float())


def test_indexer_k_bytes_and_roundtrip():
    g = torch.Generator().manual_seed(2)
    k = torch.randn(5, 128, generator=g) * 3
    packed = ref.quantize_indexer_k(k)
    assert packed.shape == (5, 132)
    for i in range(5):
        s = _naive_scale(float(k[i].abs().max()))
        want = bytes(_fp8(float(v) / s) for v in k[i]) + struct.pack("<f", s)
        assert bytes(packed[i].tolist()) == want
    deq = ref.dequantize_indexer_k(packed).double()
    want = packed[:, :128].view(torch.float8_e4m3fn).double() * packed[:, 128:].contiguous().view(torch.float32).double()
    assert torch.equal(deq, want)


def test_indexer_q_quantisation_matches_naive():
    """One power-of-two scale per (token, head) from the head's amax, values rounded to e4m3,
    the scale folded into the head weight (so ReLU(q8 . k) * w8 = ReLU(q . k) * w up to the
    rounding of q)."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 5, 128, generator=g) * torch.logspace(-4, 4, 5)[None, :, None]
    q[0, 0] = 0.0
    q[1, 1, :3] = 448.0
    w = torch.randn(3, 5, generator=g)
    q8, w8 = ref.quantize_indexer_q(q, w)
    assert q8.dtype == torch.float8_e4m3fn and w8.dtype == torch.float32
    for t in range(3):
        for h in range(5):
            s = _naive_scale(float(q[t, h].abs().max()))
            want = bytes(_fp8(float(v) / s) for v in q[t, h])
            assert bytes(q8[t, h].view(torch.uint8).tolist()) == want
            assert float(w8[t, h]) == float(np.float32(float(w[t, h]) * s))
    # dequantised, each value is within half an e4m3 step: 2**-4 relative, or 2**-10 * scale
    # where e4m3 is subnormal
    scale = (w8.double() / w.double())[..., None]
    err = (q8.double() * scale - q.double()).abs()
    assert (err <= torch.maximum(q.double().abs() * 2**-4, scale * 2**-10)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_quantize_input_dtypes_agree(dtype):
    x = _rows(4, 3).to(torch.bfloat16)  # representable in every dtype
    assert torch.equal(ref.quantize_fp8_ds_mla(x.to(dtype)), ref.quantize_fp8_ds_mla(x.float()))


def test_pack_into_skips_negative_slots():
    cache = torch.full((10, 656), 7, dtype=torch.uint8)
    kv = _rows(3, 4)
    ref.pack_fp8_ds_mla_into(cache, torch.tensor([9, -1, 0]), kv)
    packed = ref.quantize_fp8_ds_mla(kv)
    assert torch.equal(cache[9], packed[0]) and torch.equal(cache[0], packed[2])
    assert (cache[1:9] == 7).all()
    kc = torch.zeros(2, 2 * 132, dtype=torch.uint8)  # 2 blocks of 2 slots
    ref.pack_indexer_k_into(kc, torch.tensor([-1, 3]), torch.ones(2, 128))
    want = torch.zeros(4, 132, dtype=torch.uint8)
    want[3] = ref.quantize_indexer_k(torch.ones(1, 128))[0]
    assert torch.equal(kc, block_planar(want, 2))


@pytest.mark.parametrize("slots", [[-1, -2], [-1, 4, -3, 0], [0, -1]])
def test_pack_into_writes_kept_rows_only_without_a_sync(slots):
    """The sync-free skip (skipped rows repeat a kept row's write, or rewrite slot 0 with its
    own bytes): every kept slot holds its row, every other slot is unchanged, slot 0 included,
    against a plain loop over the kept rows."""
    g = torch.Generator().manual_seed(len(slots))
    packed = torch.randint(0, 256, (6, 132), generator=g, dtype=torch.uint8)
    k = torch.randn(len(slots), 128, generator=g)
    want = packed.clone()
    rows = ref.quantize_indexer_k(k)
    for i, s in enumerate(slots):
        if s >= 0:
            want[s] = rows[i]
    cache = block_planar(packed, 3)
    ref.pack_indexer_k_into(cache, torch.tensor(slots), k)
    assert torch.equal(cache, block_planar(want, 3))


def test_indexer_k_cache_is_block_planar():
    """gather / scatter of packed rows against the layout built the plain way: block b holds
    its B keys' 128 fp8 values, key after key, then their B float32 scales; the planes view
    the cache itself."""
    g = torch.Generator().manual_seed(5)
    B, nb = 4, 3
    packed = ref.quantize_indexer_k(torch.randn(nb * B, 128, generator=g))
    cache = block_planar(packed, B)
    slots = torch.tensor([11, 0, 5, 4, 7])
    assert torch.equal(ref.gather_indexer_k(cache, slots), packed[slots])
    values, scales = ref.indexer_k_planes(cache)
    assert values.data_ptr() == cache.data_ptr() and torch.equal(values[2, 3], packed[11, :128])
    assert torch.equal(scales[1, 1], packed[5, 128:])
    new = ref.quantize_indexer_k(torch.randn(3, 128, generator=g))
    ref.scatter_indexer_k(cache, torch.tensor([6, 1, 9]), new)
    packed[[6, 1, 9]] = new
    assert torch.equal(cache, block_planar(packed, B))


def test_quantisers_take_zero_rows():
    """A rank with no token of a kind (a W = 1 rank with prefills only has no decode query)
    quantises zero rows: empty results of the right shapes, not a reshape error."""
    q8, w8 = ref.quantize_indexer_q(torch.zeros(0, 4, 128), torch.zeros(0, 4))
    assert q8.shape == (0, 4, 128) and q8.dtype == torch.float8_e4m3fn and w8.shape == (0, 4)
    assert ref.quantize_indexer_k(torch.zeros(0, 128)).shape == (0, ref.INDEXER_K_BYTES)
    assert ref.quantize_fp8_ds_mla(torch.zeros(0, 576)).shape == (0, 656)
