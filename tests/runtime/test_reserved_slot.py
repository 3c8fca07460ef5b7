"""Garbage in the reserved slot never reaches a live row.

Padded tokens write their KV into slot 0 (block 0, reserved), and a row with fewer keys than
topk has missing (-1) top-k slots. An engine may pad its inputs with ``torch.empty`` and
allocate its caches uninitialised, so slot 0 can hold NaN or inf. The reference is the same
step with finite pads and a zeroed slot 0: every real row's output must equal it bit for bit
(a missing slot is never read: a zero weight would not cancel NaN, 0 * NaN = NaN).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from cpplan.api import LayerCache, ParallelConfig, StepExecutor, StepInput, compile
from cpplan.runtime.kernels import get_kernels

CUDA = torch.cuda.is_available()
FLASHMLA = CUDA and importlib.util.find_spec("flash_mla") is not None


def _config(device: str, kv: str) -> ParallelConfig:
    if device == "cpu":
        return ParallelConfig(num_heads=8, topk=64, index_num_heads=4, max_model_len=2048,
                              num_layers=1, activation_dtype="float32", hidden_size=4096,
                              kv_cache_dtype=kv, cudagraph_token_sizes=(16,))
    # full heads and topk: the shapes FlashMLA's kernels take
    return ParallelConfig(num_heads=128, topk=2048, index_num_heads=64, max_model_len=8192,
                          num_layers=1, activation_dtype="bfloat16", hidden_size=4096,
                          kv_cache_dtype=kv, cudagraph_token_sizes=(16,))


def _run(device, kernels, kv, poison: bool):
    """Three decodes (contexts 100, 0, 5: fewer keys than topk), padded to 16 tokens."""
    cfg = _config(device, kv)
    plan = compile(cfg, StepInput.build(1, ["a", "b", "c"], [100, 0, 5], [1, 1, 1],
                                        [False] * 3))
    n, t = 3, plan.padded_num_tokens
    assert t == 16
    bt = np.arange(1, 1 + 3 * 8).reshape(3, 8)
    ex = StepExecutor(cfg, sm_scale=576 ** -0.5, pcp_rank=0, dcp_rank=0, comm=None, device=device, kernels=kernels,
                      max_tokens=t, max_requests=4)
    g = torch.Generator().manual_seed(0)
    act = torch.float32 if cfg.activation_dtype == "float32" else torch.bfloat16

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device)

    kv_new, ik_new = rnd(t, 576), rnd(t, 128)
    q = rnd(t, cfg.num_heads, 576).to(act)
    iq, iw = rnd(t, cfg.index_num_heads, 128).to(act), rnd(t, cfg.index_num_heads).abs()
    cache = LayerCache.empty(cfg, 32, device)
    if poison:
        kv_new[n:], ik_new[n:] = float("nan"), float("inf")
        cache.kv[: cfg.block_size] = 0xFF  # every field of the reserved block NaN
        cache.index_k[0] = 0xFF
    b = ex.bind(plan, bt)
    ex.insert(b, cache, kv_new, ik_new)
    out = ex.attend(b, cache, q, iq, iw)
    ex.finish(b)
    return out[:n]


def _check(device, backend, kv):
    kernels = get_kernels(device, backend)
    clean = _run(device, kernels, kv, poison=False)
    dirty = _run(device, kernels, kv, poison=True)
    assert torch.isfinite(clean).all()
    assert torch.equal(dirty, clean)


@pytest.mark.parametrize("kv", ["fp8_ds_mla", "bf16"])
def test_reserved_slot_garbage_cpu(kv):
    _check("cpu", "reference", kv)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("backend", ["reference", "triton",
                                     pytest.param("flashmla", marks=pytest.mark.skipif(
                                         not FLASHMLA, reason="needs flash_mla"))])
@pytest.mark.parametrize("kv", ["fp8_ds_mla", "bf16"])
def test_reserved_slot_garbage_cuda(backend, kv):
    _check("cuda", backend, kv)
