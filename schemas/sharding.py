"""DCP sharding of a request's KV (docs/design.md §3.4), in one place for planner, plans and runtime.

KV token ``t`` lives on DCP rank ``owner(t) = (t // I) % W`` at local index
``local(t) = (t // (W * I)) * I + t % I``. numpy (any int array or scalar); the torch kernels
carry their own copy of the two lines, on device tensors.
"""

from __future__ import annotations

import numpy as np


def owner(token, dcp_size: int, interleave_size: int):
    """DCP rank holding KV token(s) ``token``."""
    return (token // interleave_size) % dcp_size


def local_index(token, dcp_size: int, interleave_size: int):
    """Index of KV token(s) ``token`` in its owner's shard."""
    return (token // (dcp_size * interleave_size)) * interleave_size + token % interleave_size


def shard_count(length, dcp_size: int, interleave_size: int, rank):
    """Tokens of ``[0, length)`` held by DCP rank(s) ``rank`` (arrays broadcast)."""
    if dcp_size == 1:
        return np.asarray(length, dtype=np.int64)
    base = (length // interleave_size // dcp_size) * interleave_size
    return base + np.clip(length - base * dcp_size - np.asarray(rank) * interleave_size, 0,
                          interleave_size)


def shard_rows(extent: int, dcp_size: int, interleave_size: int) -> int:
    """KV tokens DCP rank 0 (the fullest shard) holds of a request of ``extent`` tokens."""
    if dcp_size == 1:
        return extent
    period = dcp_size * interleave_size
    return (extent // period) * interleave_size + min(extent % period, interleave_size)
