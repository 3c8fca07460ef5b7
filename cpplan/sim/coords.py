"""Model inputs generated from coordinates (seed, layer, request, position): docs/design.md §7.2.

Every rank, the single-device oracle and a replay regenerate any token's q, KV and indexer
inputs without communication, on any device: the generator is integer arithmetic (a hash kept
below 2**31 so every product fits int64), identical on CPU and CUDA.

Values: q and KV are multiples of 1/128 in [-1, 1); indexer q and K are integers in [-3, 3] and
indexer weights integers in [1, 3], so indexer scores are exact integers (exact top-k, with many
ties that exercise the id tie-break).

On the CPU the same hash and value maps run fused in one numba loop (:func:`_values_kernel`:
no int64 temporaries, a constant modulus); elsewhere (CUDA, inside a CUDA graph) as torch
integer ops (:func:`_raw`). Both give the same bits (tests/sim/test_coords.py).
"""

from __future__ import annotations

import zlib

import numpy as np
import torch
from numba import njit

# The synthetic model's softmax scale (the executor takes the model's own: here 1/sqrt(576),
# the scale every simulator figure and golden run was made with); `simulate --sm-scale` overrides it
SIM_SM_SCALE = 576 ** -0.5

_M = 2**31 - 1
_A, _B, _C = 1103515245, 1664525, 69069
KIND_Q, KIND_KV, KIND_INDEX_Q, KIND_INDEX_W, KIND_INDEX_K = range(5)


def request_key(req_id: str) -> int:
    """A stable integer per request id (no Python hash: it is seeded per process)."""
    return zlib.crc32(req_id.encode()) % _M


def request_keys(req_ids) -> np.ndarray:
    return np.array([request_key(r) for r in req_ids], dtype=np.int64)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x * _A + 12345) % _M
    x = x ^ (x >> 11)
    x = (x * _B + 1013904223) % _M
    x = x ^ (x >> 7)
    return (x * _C + 1) % _M


def _raw(seed: int, layer: int, kind: int, keys: torch.Tensor, pos: torch.Tensor,
         width: int) -> torch.Tensor:
    """int64 ``[n, width]`` in [0, 2**31 - 1) from coordinates ``keys [n]``, ``pos [n]``."""
    head = (seed * 1_000_003 + layer * 10_007 + kind * 101) % _M
    base = _mix(_mix((keys.long() + head) % _M) ^ pos.long() % _M)
    elem = torch.arange(width, device=keys.device, dtype=torch.int64)
    return _mix(_mix(base[:, None] ^ (elem[None, :] * 40503 % _M)))


@njit(cache=True, nogil=True, inline="always")
def _mix_one(x):
    """:func:`_mix` of one int64 in [0, 2**31 - 1)."""
    x = (x * _A + 12345) % _M
    x = x ^ (x >> 11)
    x = (x * _B + 1013904223) % _M
    x = x ^ (x >> 7)
    return (x * _C + 1) % _M


@njit(cache=True, nogil=True)
def _values_kernel(head, keys, pos, mod, offset, divisor, out):
    """``out[i, j] = float32((raw[i, j] % mod) + offset) / divisor``, ``raw`` as :func:`_raw`
    computes it from ``head``, ``keys [n]``, ``pos [n]`` (int64), for ``out`` float32 ``[n, width]``."""
    div = np.float32(divisor)
    for i in range(out.shape[0]):
        base = _mix_one(_mix_one((keys[i] + head) % _M) ^ (pos[i] % _M))
        for j in range(out.shape[1]):
            v = _mix_one(_mix_one(base ^ (j * 40503 % _M)))
            out[i, j] = np.float32(v % mod + offset) / div


def _values(seed: int, layer: int, kind: int, keys: torch.Tensor, pos: torch.Tensor,
            width: int, mod: int, offset: int, divisor: float = 1.0) -> torch.Tensor:
    """float32 ``[n, width]``: ``float32((raw % mod) + offset) / divisor`` of
    ``raw = _raw(seed, layer, kind, keys, pos, width)``; on the CPU by :func:`_values_kernel`
    (the same bits), elsewhere by torch ops."""
    if keys.device.type != "cpu":
        x = ((_raw(seed, layer, kind, keys, pos, width) % mod) + offset).to(torch.float32)
        return x / divisor if divisor != 1.0 else x
    head = (seed * 1_000_003 + layer * 10_007 + kind * 101) % _M
    out = np.empty((keys.shape[0], width), dtype=np.float32)
    _values_kernel(head, np.ascontiguousarray(keys.long().numpy()),
                   np.ascontiguousarray(pos.long().numpy()), mod, offset, divisor, out)
    return torch.from_numpy(out)


def layer_inputs(seed: int, layer: int, keys: torch.Tensor, pos: torch.Tensor, *,
                 num_heads: int, index_heads: int, qk_dim: int = 576,
                 index_dim: int = 128) -> dict:
    """All of a layer's inputs for tokens ``(keys [n], pos [n])`` (int64 tensors, any device):
    q ``[n, H, 576]``, kv ``[n, 576]``, index_q ``[n, Hi, 128]``, index_w ``[n, Hi]``,
    index_k ``[n, 128]``, all float32 on the keys' device."""
    n = keys.shape[0]
    return {
        "q": _values(seed, layer, KIND_Q, keys, pos, num_heads * qk_dim, 255, -127, 128.0).view(
            n, num_heads, qk_dim),
        "kv": _values(seed, layer, KIND_KV, keys, pos, qk_dim, 255, -127, 128.0),
        "index_q": _values(seed, layer, KIND_INDEX_Q, keys, pos, index_heads * index_dim, 7,
                           -3).view(n, index_heads, index_dim),
        "index_w": _values(seed, layer, KIND_INDEX_W, keys, pos, index_heads, 3, 1),
        "index_k": _values(seed, layer, KIND_INDEX_K, keys, pos, index_dim, 7, -3),
    }


def key_inputs(seed: int, layer: int, keys: torch.Tensor, pos: torch.Tensor,
               qk_dim: int = 576, index_dim: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Only the cached parts (kv ``[n, 576]``, index_k ``[n, 128]``), for history and oracle."""
    kv = _values(seed, layer, KIND_KV, keys, pos, qk_dim, 255, -127, 128.0)
    k = _values(seed, layer, KIND_INDEX_K, keys, pos, index_dim, 7, -3)
    return kv, k
