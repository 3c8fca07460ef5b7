"""The block-planar indexer K cache built the plain way, as the tests' own reference of the
layout (docs/design.md §4.3): block b's bytes are its B keys' 128 fp8 values, key after key,
then their B float32 scales."""

from __future__ import annotations

import torch


def block_planar(packed: torch.Tensor, block: int) -> torch.Tensor:
    """Packed key rows ``[S, 132]`` (row s = slot s; S a multiple of block) -> the cache
    ``[S // block, block * 132]`` uint8 holding them."""
    S = packed.shape[0]
    assert S % block == 0 and packed.shape[1] == 132
    k = packed.view(S // block, block, 132)
    return torch.cat([k[:, :, :128].reshape(S // block, block * 128),
                      k[:, :, 128:].reshape(S // block, block * 4)], dim=1)
