"""The coordinate generator (cpplan/sim/coords.py): the CPU's fused numba loop gives the same
bits as the torch integer ops that other devices run, as a per-element Python reference of the
hash, and as the values every recorded run and figure was made with (a digest)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from cpplan.sim import coords

M = 2**31 - 1


def _mix_py(x: int) -> int:
    x = (x * 1103515245 + 12345) % M
    x ^= x >> 11
    x = (x * 1664525 + 1013904223) % M
    x ^= x >> 7
    return (x * 69069 + 1) % M


def _raw_py(seed, layer, kind, key, pos, j):
    head = (seed * 1_000_003 + layer * 10_007 + kind * 101) % M
    base = _mix_py(_mix_py((key + head) % M) ^ (pos % M))
    return _mix_py(_mix_py(base ^ (j * 40503 % M)))


def _coordinates():
    keys = torch.from_numpy(coords.request_keys(["a", "b", "req-7", "x" * 40])).repeat_interleave(5)
    pos = torch.tensor([0, 1, 63, 64, 2**31 - 2] * 4, dtype=torch.int64)
    return keys, pos


# (mod, offset, divisor) of q / kv, of indexer q / K, of indexer weights
MAPS = [(255, -127, 128.0), (7, -3, 1.0), (3, 1, 1.0)]


@pytest.mark.parametrize("seed,layer", [(0, 0), (3, 1), (2**40 + 7, 61)])
@pytest.mark.parametrize("m", MAPS, ids=["uniform", "index", "weight"])
def test_cpu_values_equal_the_torch_ops_and_the_python_hash(seed, layer, m):
    keys, pos = _coordinates()
    mod, offset, divisor = m
    width = 1000
    for kind in range(5):
        got = coords._values(seed, layer, kind, keys, pos, width, mod, offset, divisor)
        raw = coords._raw(seed, layer, kind, keys, pos, width)  # the other devices' torch ops
        assert got.dtype == torch.float32 and got.shape == (keys.shape[0], width)
        assert torch.equal(got, ((raw % mod) + offset).to(torch.float32) / divisor)
        for i in range(0, keys.shape[0], 3):
            for j in (0, 1, 575, width - 1):
                want = _raw_py(seed, layer, kind, int(keys[i]), int(pos[i]), j)
                assert int(raw[i, j]) == want
                assert float(got[i, j]) == ((want % mod) + offset) / divisor


def test_no_tokens():
    none = torch.zeros(0, dtype=torch.int64)
    x = coords.layer_inputs(0, 0, none, none, num_heads=8, index_heads=4)
    assert x["q"].shape == (0, 8, 576) and x["index_w"].shape == (0, 4)


def test_values_are_those_of_every_recorded_run():
    """A digest of layer_inputs and key_inputs as the torch-only generator made them (before
    the fused CPU loop): the inputs of every recorded run, oracle and figure are unchanged."""
    keys, pos = _coordinates()
    h = hashlib.sha256()
    for seed, layer in ((0, 0), (3, 1), (2**40 + 7, 61)):
        x = coords.layer_inputs(seed, layer, keys, pos, num_heads=8, index_heads=4)
        for name in ("q", "kv", "index_q", "index_w", "index_k"):
            h.update(x[name].numpy().tobytes())
        for t in coords.key_inputs(seed, layer, keys, pos):
            h.update(t.numpy().tobytes())
    assert h.hexdigest() == "0f8a31982d972f7c74b7e84e086703cecc886df34f4cd0c9c7a69225f36077df"
