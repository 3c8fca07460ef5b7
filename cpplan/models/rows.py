"""A bound step's rows as a model forward sees them (docs/design.md §4.5, §5.5): which request
and position each of the rank's T rows holds, the token ids of those rows, and which requests
are sampled (their last scheduled token's hidden row restored for the LM head).

The rows come from the runtime's ``bound.tokens`` view; the sampled rows from
``executor.restore_sampled`` for a step that names them (``StepInput.build(...,
is_sampled=...)``), else every request's last token out of ``restore`` (every query token in
global order: requests in index order, each one's tokens by position).
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
    """The :class:`RankRows` of ``bound`` (the runtime's TokenView: host arrays, no device
    read)."""
    t = bound.tokens
    return RankRows(t.request_np, t.position_np, t.valid_np, t.position)


def rank_token_ids(bound, sequences: Sequence[Sequence[int]], device=None) -> torch.Tensor:
    """Token ids of the rank's T rows, ``[T]`` int64 on ``device`` (default: the step's
    tables' device): row j holds ``sequences[request[j]][position[j]]``, padding holds 0.
    ``sequences[i]``: request i's tokens so far (prompt + generated), at least as long as
    every position this step schedules. Host work and one upload only (the rows from
    ``bound.host_tokens``; on CUDA from pinned memory, asynchronously): a step a CUDA graph
    replays expands no tables for it."""
    request, position, _ = bound.host_tokens
    valid = np.flatnonzero(request >= 0)
    out = np.zeros(request.shape[0], dtype=np.int64)
    if len(valid):
        req, pos = request[valid], position[valid]
        lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
        short = pos >= lengths[req]
        if short.any():
            j = valid[int(np.argmax(short))]
            raise TensorArgError(f"step {bound.plan.step_id}: request {request[j]} has "
                                 f"{lengths[request[j]]} tokens; expected at least "
                                 f"{int(position[j]) + 1} (the step schedules position "
                                 f"{int(position[j])})")
        # each run of consecutive rows of one request reads its span once (a prefill chunk
        # is one numpy copy, a decode one element)
        cut = np.flatnonzero(np.diff(req)) + 1
        for lo, hi in zip(np.r_[0, cut], np.r_[cut, len(req)]):
            p = pos[lo:hi]
            first = int(p.min())
            src = np.asarray(sequences[int(req[lo])][first: int(p.max()) + 1], dtype=np.int64)
            out[valid[lo:hi]] = src[p - first]
    device = torch.device(device) if device is not None else bound.device
    ids = torch.from_numpy(out)
    if device.type != "cuda":
        return ids.to(device)
    # pinned by torch's host cache, whose block is reused only after the copy reading it ends
    return ids.pin_memory().to(device, non_blocking=True)


def sampled_requests(plan) -> np.ndarray:
    """Request indices whose last scheduled token is sampled this step, ascending: the rows
    of :func:`sampled_hidden` (``plan.is_sampled``; every request where the step names none)."""
    if plan.is_sampled is None:
        return np.arange(plan.num_requests, dtype=np.int64)
    return np.flatnonzero(plan.is_sampled.np()).astype(np.int64)


def sampled_hidden(executor, bound, hidden: torch.Tensor) -> torch.Tensor:
    """The sampled requests' last-token rows ``[num_sampled, hidden_size]`` of this rank's
    ``hidden [T, hidden_size]`` (every rank gets all of them), in :func:`sampled_requests`
    order."""
    if bound.plan.is_sampled is not None:
        return executor.restore_sampled(bound, hidden)
    rows = executor.restore(bound, hidden)  # [sum q, hidden], global order
    last = np.cumsum(bound.plan.num_scheduled_tokens.np()) - 1
    index = torch.from_numpy(last[sampled_requests(bound.plan)]).to(rows.device)
    return rows.index_select(0, index)
