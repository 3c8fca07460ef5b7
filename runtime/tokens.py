"""The public view of a bound step's tokens on one rank: which request and position each of
the rank's T rows is, and which rows are padding (docs/design.md §3.3, §3.7).

An engine computes its projections, RoPE and embeddings for its own rows only: row k of every
per-token tensor it passes to ``insert`` / ``attend`` / ``restore`` is token ``k`` of this view.
The host arrays come from the plan (numpy, O(T), built once per step at first use); the device
tensors from the step's expanded tables (no upload, no sync).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from cpplan.schemas.errors import CapacityError
from cpplan.schemas.plan import StepPlan

PAD_REQUEST = -1  # request index of a padded row


@dataclasses.dataclass(frozen=True)
class TokenView:
    """One rank's T rows (T = the plan's ``padded_num_tokens``); rows ``[0, num_tokens)`` are
    real, the rest padding.

    Host (numpy, owned by the view, alive as long as it): ``request_np`` ``[T]`` int64, the
    request index (the step's order) or PAD_REQUEST; ``position_np`` ``[T]`` int64, the token's
    position in its request (0 for padding); ``valid_np`` ``[T]`` bool. Device (the executor's
    device, views of the step's tables: valid until the arena is reused): ``request``,
    ``position`` int64 ``[T]`` and ``valid`` bool ``[T]``, the same values.
    """

    num_tokens: int
    request_np: np.ndarray
    position_np: np.ndarray
    valid_np: np.ndarray
    request: torch.Tensor
    position: torch.Tensor
    valid: torch.Tensor

    @property
    def padded_num_tokens(self) -> int:
        return len(self.request_np)


def host_tokens(plan: StepPlan, pcp_rank: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(request [T], position [T], real count) of PCP rank ``pcp_rank``'s rows, from the plan's
    row tables: row r's tokens are ``row_token_start[p, r] + j`` for j < ``row_num_tokens[p,
    r]``, at position ``c + row_query_offset[p, r] + j``."""
    t_pad = plan.padded_num_tokens
    lens = plan.row_num_tokens.np()[pcp_rank].astype(np.int64)
    start = plan.row_token_start.np()[pcp_rank].astype(np.int64)
    first = plan.row_position_start()[pcp_rank]
    req = plan.row_request.np().astype(np.int64)
    n = int(lens.sum())
    within = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    dst = np.repeat(start, lens) + within
    request = np.full(t_pad, PAD_REQUEST, dtype=np.int64)
    position = np.zeros(t_pad, dtype=np.int64)
    request[dst] = np.repeat(req, lens)
    position[dst] = np.repeat(first, lens) + within
    return request, position, n


def token_view(host: tuple[np.ndarray, np.ndarray, int], token_req: torch.Tensor,
               token_pos: torch.Tensor, iota: torch.Tensor) -> TokenView:
    """The view of a bound step (``host``: its :func:`host_tokens`; ``token_req`` /
    ``token_pos``: its device tables; ``iota``: an arange of at least T on the same device)."""
    request, position, n = host
    valid = iota[: len(request)] < n
    return TokenView(num_tokens=n, request_np=request, position_np=position,
                     valid_np=request != PAD_REQUEST,
                     request=torch.where(valid, token_req, PAD_REQUEST), position=token_pos,
                     valid=valid)


def pack_sampled(plan: StepPlan, pcp_rank: int, words: np.ndarray, offset: int) -> int:
    """Write restore_sampled's indices into the arena's host ``words`` at ``offset``: the M
    token indices this rank sends, then each sampled request's row of the gathered ``[P * M]``
    buffer (at P == 1: its token index). Returns the words written."""
    send = plan.sampled_send_rows(pcp_rank)
    index = plan.sampled_restore_index()
    n = len(send) + len(index)
    if offset + n > len(words):
        raise CapacityError(f"step {plan.step_id} needs {offset + n:,} arena words, capacity "
                            f"{len(words):,} (the sampled rows: {n:,})")
    words[offset: offset + len(send)] = send
    words[offset + len(send): offset + n] = index
    return n
