"""The step's collectives (DESIGN 3.8): one named function per planned collective, a ledger.

Every data collective of a step goes through one function here. Each issues exactly one
collective on the group the plan names and appends ``(name, op, group, dtype, shape)`` (shape
per rank, as in ``plan.collectives``) to the step's :class:`Ledger`; in debug mode the executor
compares the ledger with the plan at the end of the step (:func:`check_ledger`). Bytes that are
fp8 travel as uint8 (gloo has no float8 type).

Transport is a :class:`Comm`: :class:`DistComm` over torch.distributed groups, or
``cpplan.runtime.replay.ThreadComm`` (all ranks as threads of one process, for ``replay``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from cpplan.schemas.errors import CollectiveLedgerError
from cpplan.schemas.plan import StepPlan

TOPK_CANDIDATE_DTYPE = "float32+int64"  # one packed entry: (score, global token id)
_ACT_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ------------------------------------------------------------------------- transport
class Comm(Protocol):
    """What the named collectives need from a transport; ``group`` is "pcp" or "dcp"."""

    def all_gather(self, group: str, out: torch.Tensor, inp: torch.Tensor) -> None:
        """out ``[size * n, ...]`` <- every rank's inp ``[n, ...]``, rank-major."""

    def all_reduce_sum(self, group: str, tensor: torch.Tensor) -> None:
        """tensor <- sum over the group's ranks, in place."""

    def before_first(self) -> None:
        """Called before each collective (the executor awaits the digest check here)."""

    def size(self, group: str) -> int:
        """Ranks in ``group``."""


def _resolve_all_gather() -> Callable:
    """``all_gather_single`` where torch has it (2.13 deprecates ``all_gather_into_tensor``
    with a warning), else ``all_gather_into_tensor`` (torch 2.11, the GPU image)."""
    single = getattr(dist, "all_gather_single", None)
    if single is not None:
        return single
    return dist.all_gather_into_tensor


_ALL_GATHER = _resolve_all_gather()


def all_gather_tensor(out: torch.Tensor, inp: torch.Tensor, group=None) -> None:
    """Version-proof flat all-gather into ``out`` (``[size * n, ...]``, rank-major)."""
    _ALL_GATHER(out, inp, group=group)


class DistComm:
    """torch.distributed transport over a :class:`~cpplan.runtime.groups.Groups`' data groups."""

    def __init__(self, groups) -> None:
        self.groups = groups
        self.on_collective: Callable[[], None] = lambda: None

    def before_first(self) -> None:
        self.on_collective()

    def size(self, group: str) -> int:
        return self.groups.size(group)

    def all_gather(self, group: str, out: torch.Tensor, inp: torch.Tensor) -> None:
        all_gather_tensor(out, inp, group=self.groups.group(group))

    def all_reduce_sum(self, group: str, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.groups.group(group))


# ------------------------------------------------------------------------- ledger
@dataclasses.dataclass(frozen=True)
class LedgerEntry:
    name: str
    op: str
    group: str
    dtype: str
    shape: tuple[int, ...]


class Ledger:
    """The collectives one rank issued in one step, in issue order."""

    def __init__(self) -> None:
        self.entries: list[LedgerEntry] = []

    def record(self, name: str, op: str, group: str, dtype: str, shape) -> None:
        self.entries.append(LedgerEntry(name, op, group, dtype, tuple(int(d) for d in shape)))

    def __len__(self) -> int:
        return len(self.entries)


def expected_ledger(plan: StepPlan) -> list[LedgerEntry]:
    """The plan's collective list as issued: per-layer entries repeated for every layer (in plan
    order), then the once-per-step entries (``restore``)."""
    per_layer = [c for c in plan.collectives if c.per_layer]
    once = [c for c in plan.collectives if not c.per_layer]
    seq = per_layer * plan.config.num_layers + once
    return [LedgerEntry(c.name, c.op, c.group, c.dtype, tuple(c.shape)) for c in seq]


def check_ledger(plan: StepPlan, ledger: Ledger, rank: int) -> None:
    """Raise CollectiveLedgerError at the first entry where ledger and plan differ."""
    want, got = expected_ledger(plan), ledger.entries
    for k in range(max(len(want), len(got))):
        w = want[k] if k < len(want) else None
        g = got[k] if k < len(got) else None
        if w != g:
            raise CollectiveLedgerError(
                f"rank {rank}, step {plan.step_id}: collective #{k} issued {g} but the plan "
                f"lists {w} ({len(got)} issued, {len(want)} planned)"
            )


def act_name(dtype: torch.dtype) -> str:
    return _ACT_NAMES[dtype]


# ------------------------------------------------------------------------- named collectives
def _gather(comm: Comm, ledger: Ledger, name: str, group: str, dtype: str, out, inp) -> None:
    comm.before_first()
    ledger.record(name, "all_gather", group, dtype, inp.shape)
    comm.all_gather(group, out, inp)


def kv_insert(comm: Comm, ledger: Ledger, out: torch.Tensor, inp: torch.Tensor) -> None:
    """pcp all-gather of this rank's new prefill KV: inp ``[T - nd, kv_bytes]`` uint8 ->
    out ``[P * (T - nd), kv_bytes]`` uint8 (fp8_ds_mla or bf16 bytes), rank-major."""
    _gather(comm, ledger, "kv_insert", "pcp", "uint8", out, inp)


def indexer_k_insert(comm: Comm, ledger: Ledger, out: torch.Tensor, inp: torch.Tensor) -> None:
    """pcp all-gather of the new prefill indexer keys: ``[T - nd, 132]`` uint8 per rank."""
    _gather(comm, ledger, "indexer_k_insert", "pcp", "uint8", out, inp)


def indexer_k_gather(comm: Comm, ledger: Ledger, chunk: int, out: torch.Tensor,
                     inp: torch.Tensor) -> None:
    """dcp all-gather of gather chunk ``chunk``'s local indexer keys: ``[PT_c, 132]`` uint8
    per rank -> ``[W * PT_c, 132]`` rank-major (read through remapped rows, never copied)."""
    _gather(comm, ledger, f"indexer_k_gather[{chunk}]", "dcp", "uint8", out, inp)


def kv_gather(comm: Comm, ledger: Ledger, chunk: int, out: torch.Tensor,
              inp: torch.Tensor) -> None:
    """dcp all-gather of gather chunk ``chunk``'s local KV: ``[PT_c, kv_bytes]`` uint8."""
    _gather(comm, ledger, f"kv_gather[{chunk}]", "dcp", "uint8", out, inp)


def topk_candidates(comm: Comm, ledger: Ledger, scores: torch.Tensor,
                    ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dcp all-gather of the decode rows' local top-k: scores ``[nd, topk]`` (sent as float32;
    the reference indexer's scores are integers, exact in float32) and global ids ``[nd, topk]``
    int64, packed into one uint8 buffer ``[nd, topk * 12]`` so it is one collective.
    Returns ``(scores [nd, W * topk] float32, ids [nd, W * topk] int64)``, rank-major columns."""
    nd, topk = ids.shape
    packed = torch.cat([scores.float().contiguous().view(torch.uint8),
                        ids.long().contiguous().view(torch.uint8)], dim=1)
    size = comm_size(comm, "dcp")
    out = torch.empty(size * nd, topk * 12, dtype=torch.uint8, device=packed.device)
    comm.before_first()
    ledger.record("topk_candidates", "all_gather", "dcp", TOPK_CANDIDATE_DTYPE, (nd, topk))
    comm.all_gather("dcp", out, packed)
    out = out.view(size, nd, topk * 12)
    all_scores = out[..., : 4 * topk].contiguous().view(torch.float32)
    all_ids = out[..., 4 * topk :].contiguous().view(torch.int64)
    return (all_scores.permute(1, 0, 2).reshape(nd, size * topk),
            all_ids.permute(1, 0, 2).reshape(nd, size * topk))


def decode_lse(comm: Comm, ledger: Ledger, lse_base_e: torch.Tensor) -> torch.Tensor:
    """dcp all-gather of the decode rows' partial LSE ``[nd, H]`` float32 -> ``[W, nd, H]``."""
    size = comm_size(comm, "dcp")
    out = torch.empty((size,) + tuple(lse_base_e.shape), dtype=torch.float32,
                      device=lse_base_e.device)
    _gather(comm, ledger, "decode_lse", "dcp", "float32", out.view(-1, lse_base_e.shape[-1]),
            lse_base_e.float().contiguous())
    return out


def decode_out(comm: Comm, ledger: Ledger, scaled_out: torch.Tensor) -> None:
    """dcp all-reduce (sum) of the LSE-scaled partial decode outputs ``[nd, H, 512]`` act,
    in place."""
    comm.before_first()
    ledger.record("decode_out", "all_reduce", "dcp", act_name(scaled_out.dtype), scaled_out.shape)
    comm.all_reduce_sum("dcp", scaled_out)


def restore(comm: Comm, ledger: Ledger, out: torch.Tensor, inp: torch.Tensor) -> None:
    """pcp all-gather of every rank's rows ``[T, hidden]`` act -> ``[P * T, hidden]``; the
    plan's restore index then puts the tokens in global order."""
    _gather(comm, ledger, "restore", "pcp", act_name(inp.dtype), out, inp)


def comm_size(comm, group: str) -> int:
    return comm.size(group)

