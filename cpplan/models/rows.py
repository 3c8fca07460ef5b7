"""A bound step's rows as a model forward sees them (docs/design.md §4.5, §5.5): which request
and position each of the rank's T rows holds, the token ids of those rows, and which requests
are sampled (their last scheduled token's hidden row restored for the LM head).

Uses the runtime's ``bound.tokens`` view, ``plan.is_sampled`` and ``executor.restore_sampled``
where the runtime has them; otherwise the same facts from the step's tables, ``restore`` (every
query token, global order: requests in index order, each one's tokens by position) and every
request counted as sampled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from cpplan.schemas.errors import TensorArgError


@dataclasses.dataclass(frozen=True)
class RankRows:
    """The rank's T rows of a bound step: ``request`` [T] int64 (request index; -1 for
    padding), ``position`` [T] int64 (position in the request; 0 for padding), ``valid`` [T]
    bool, and ``position_t`` [T] int64 on the executor's device (RoPE positions)."""

    request: np.ndarray
    position: np.ndarray
    valid: np.ndarray
    position_t: torch.Tensor


def rank_rows(bound) -> RankRows:
    """The :class:`RankRows` of ``bound`` (host arrays read once; no device read where the
    runtime provides ``bound.tokens``)."""
    tokens = getattr(bound, "tokens", None)
    if tokens is not None:
        return RankRows(np.asarray(tokens.request_np, dtype=np.int64),
                        np.asarray(tokens.position_np, dtype=np.int64),
                        np.asarray(tokens.valid_np, dtype=bool), tokens.position)
    t = bound.tables  # older runtime: real tokens are rows [0, num_tokens)
    n, size = bound.meta.num_tokens, bound.plan.padded_num_tokens
    valid = np.arange(size) < n
    req = np.where(valid, t.token_req.cpu().numpy().astype(np.int64), -1)
    pos = np.where(valid, t.token_pos.cpu().numpy().astype(np.int64), 0)
    return RankRows(req, pos, valid, torch.from_numpy(pos).to(t.token_pos.device))


def rank_token_ids(bound, sequences: Sequence[Sequence[int]], device=None) -> torch.Tensor:
    """Token ids of the rank's T rows, ``[T]`` int64 on ``device`` (default: the step's
    tables' device): row j holds ``sequences[request[j]][position[j]]``, padding holds 0.
    ``sequences[i]``: request i's tokens so far (prompt + generated), at least as long as
    every position this step schedules."""
    rows = rank_rows(bound)
    out = np.zeros(rows.request.shape[0], dtype=np.int64)
    for j in np.flatnonzero(rows.valid):
        seq, p = sequences[rows.request[j]], int(rows.position[j])
        if p >= len(seq):
            raise TensorArgError(f"step {bound.plan.step_id}: request {rows.request[j]} has "
                                 f"{len(seq)} tokens; expected at least {p + 1} (the step "
                                 f"schedules position {p})")
        out[j] = seq[p]
    return torch.from_numpy(out).to(device if device is not None else rows.position_t.device)


def sampled_requests(plan) -> np.ndarray:
    """Request indices whose last scheduled token is sampled this step, ascending: the rows
    of :func:`sampled_hidden` (``plan.is_sampled`` where the plan has it, else every request)."""
    flags = getattr(plan, "is_sampled", None)
    if flags is None:
        return np.arange(plan.num_requests, dtype=np.int64)
    flags = flags.np() if hasattr(flags, "np") else np.asarray(flags)
    return np.flatnonzero(flags.astype(bool)).astype(np.int64)


def sampled_hidden(executor, bound, hidden: torch.Tensor) -> torch.Tensor:
    """The sampled requests' last-token rows ``[num_sampled, hidden_size]`` of this rank's
    ``hidden [T, hidden_size]`` (every rank gets all of them), in :func:`sampled_requests`
    order."""
    if hasattr(executor, "restore_sampled"):
        return executor.restore_sampled(bound, hidden)
    rows = executor.restore(bound, hidden)  # [sum q, hidden], global order
    last = np.cumsum(bound.plan.num_scheduled_tokens.np()) - 1
    index = torch.from_numpy(last[sampled_requests(bound.plan)]).to(rows.device)
    return rows.index_select(0, index)
