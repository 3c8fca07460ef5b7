"""The step's collectives (docs/design.md §3.8): one named function per planned collective, a ledger.

Every data collective of a step goes through one function here. Each issues exactly one
collective on the group the plan names and appends ``(name, op, group, dtype, shape)`` (shape
per rank, as in ``plan.collectives``) to the step's :class:`Ledger`; in debug mode the executor
compares the ledger with the plan at the end of the step (:func:`check_ledger`). Bytes that are
fp8 travel as uint8 (gloo has no float8 type).

Transport is a :class:`Comm`: :class:`DistComm` over torch.distributed groups, or the replay
harness's thread transport (all ranks as threads of one process). A :class:`StepChannel` binds a
transport to one step's ledger, to the plan-verification gate that every named collective
passes first, and to the step's fault watch (runtime/faults.py): a transport error becomes a
:class:`PeerFailedError` or :class:`RankLostError` that names the rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from cpplan.schemas import names
from cpplan.schemas.errors import CollectiveLedgerError, CpplanError
from cpplan.schemas.names import TOPK_CANDIDATE_DTYPE, Group
from cpplan.schemas.plan import StepPlan

# activation_dtype name -> torch dtype (and back for the ledger's dtype names)
ACT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ACT_NAMES = {dtype: name for name, dtype in ACT_DTYPES.items()}


# ------------------------------------------------------------------------- transport
class Comm(Protocol):
    """Transport for the named collectives: nothing but data movement on a group. ``watch``
    (a :class:`~cpplan.runtime.faults.StepWatch` or None) may end a blocking wait early when a
    peer announces a failure."""

    def all_gather(self, group: Group, out: torch.Tensor, inp: torch.Tensor,
                   watch=None) -> None:
        """out ``[size * n, ...]`` <- every rank's inp ``[n, ...]``, rank-major."""

    def all_reduce_sum(self, group: Group, tensor: torch.Tensor, watch=None) -> None:
        """tensor <- sum over the group's ranks, in place."""

    def size(self, group: Group) -> int:
        """Ranks in ``group``."""


def _resolve_all_gather() -> Callable:
    """``all_gather_single`` where torch has it (2.13 deprecates ``all_gather_into_tensor``
    with a warning), else ``all_gather_into_tensor`` (torch 2.11, the GPU image)."""
    single = getattr(dist, "all_gather_single", None)
    if single is not None:
        return single
    return dist.all_gather_into_tensor


_ALL_GATHER = _resolve_all_gather()


def all_gather_tensor(out: torch.Tensor, inp: torch.Tensor, group=None, async_op=False):
    """Version-proof flat all-gather into ``out`` (``[size * n, ...]``, rank-major)."""
    return _ALL_GATHER(out, inp, group=group, async_op=async_op)


class DistComm:
    """torch.distributed transport over a :class:`~cpplan.runtime.groups.Groups`' data groups.
    On the CPU (gloo, where the host blocks in every collective) a watched collective is issued
    async and awaited through ``watch.wait``, which reads the fault board between short timed
    waits; on CUDA collectives are queued on the stream and never waited on here."""

    def __init__(self, groups) -> None:
        self.groups = groups
        self.host_blocking = groups.device.type == "cpu"

    def size(self, group: Group) -> int:
        return self.groups.size(group)

    def all_gather(self, group: Group, out: torch.Tensor, inp: torch.Tensor,
                   watch=None) -> None:
        watched = watch is not None and self.host_blocking
        work = all_gather_tensor(out, inp, group=self.groups.group(group), async_op=watched)
        if watched:
            watch.wait(work)

    def all_reduce_sum(self, group: Group, tensor: torch.Tensor, watch=None) -> None:
        watched = watch is not None and self.host_blocking
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.groups.group(group),
                               async_op=watched)
        if watched:
            watch.wait(work)


class NoComm:
    """The transport of a one-rank executor (P = W = 1, no torch.distributed world): every
    group has one rank and the plan lists no collective, so one issued here is a bug."""

    def size(self, group: Group) -> int:
        return 1

    def all_gather(self, group: Group, out: torch.Tensor, inp: torch.Tensor,
                   watch=None) -> None:
        raise AssertionError(f"a {group} all-gather on a one-rank executor")

    def all_reduce_sum(self, group: Group, tensor: torch.Tensor, watch=None) -> None:
        raise AssertionError(f"a {group} all-reduce on a one-rank executor")


# ------------------------------------------------------------------------- ledger
@dataclasses.dataclass(frozen=True)
class LedgerEntry:
    name: str
    op: str
    group: str
    dtype: str
    shape: tuple[int, ...]


class Ledger:
    """The collectives one rank issued in one step, in issue order. Given the step's ``plan``
    (debug mode), each entry is compared with the plan's entry at its position as it is
    recorded, before the collective is issued: a rank about to issue a collective the plan
    does not list there (an engine that skipped a layer's ``attend``, a tensor of another
    dtype) raises CollectiveLedgerError, which its peers hear of as PeerFailedError, rather
    than entering a collective its peers are not in (gloo aborts the process; NCCL hangs)."""

    def __init__(self, plan: StepPlan | None = None, rank: int = 0) -> None:
        self.entries: list[LedgerEntry] = []
        self._plan, self._rank = plan, rank
        self._planned: list | None = None  # the plan's entries in issue order

    def record(self, name: str, op: str, group: str, dtype: str, shape) -> None:
        entry = LedgerEntry(name, op, group, dtype, tuple(int(d) for d in shape))
        self.entries.append(entry)
        if self._plan is not None:
            self._check_last(entry)

    def _check_last(self, entry: LedgerEntry) -> None:
        plan, k = self._plan, len(self.entries) - 1
        if self._planned is None:  # built at the first collective: bind stays as cheap
            self._planned = expected_ledger(plan)
        want = self._planned[k] if k < len(self._planned) else None
        if entry != want:
            raise CollectiveLedgerError(
                f"rank {self._rank}, step {plan.step_id}: collective #{k} would issue {entry} "
                f"but the plan lists {want} there; not issued")

    def __len__(self) -> int:
        return len(self.entries)


def expected_ledger(plan: StepPlan) -> list[LedgerEntry]:
    """The plan's collective list as issued: per layer, in plan order, the per-layer entries
    that layer issues (the indexer's only on full indexer layers, where some layers share a
    top-k), then the once-per-step entries (``restore``)."""
    entries = [(c, LedgerEntry(c.name, c.op, c.group, c.dtype, tuple(c.shape)))
               for c in plan.collectives]
    per_layer = [(c, e) for c, e in entries if c.per_layer]
    if not any(c.layers for c, _ in per_layer):
        out = [e for _, e in per_layer] * plan.config.num_layers
    else:
        out = [e for layer in range(plan.config.num_layers)
               for c, e in per_layer if c.issued_on(layer)]
    return out + [e for c, e in entries if not c.per_layer]


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


# ------------------------------------------------------------------------- one step's channel
class StepChannel:
    """One bound step's collectives: the transport, the ledger, and the plan-verification gate.

    ``pending_check`` is the cross-rank digest exchange started at bind (or None). Every named
    collective first calls :meth:`await_plan_verified`, which waits for that exchange the first
    time and is free afterwards: no data collective of a step runs before every rank is known to
    hold the same plan (docs/design.md §5). ``watch`` (or None) is the step's fault watch.
    """

    def __init__(self, comm: Comm, pending_check=None, watch=None, plan: StepPlan | None = None,
                 rank: int = 0) -> None:
        self.comm = comm
        self.ledger = Ledger(plan, rank)  # with a plan: each collective checked as it is issued
        self.pending_check = pending_check
        self.watch = watch

    def await_plan_verified(self) -> None:
        pending, self.pending_check = self.pending_check, None
        if pending is not None:
            pending.wait()

    def size(self, group: Group) -> int:
        return self.comm.size(group)

    def _gather(self, kind: names.CollectiveKind, dtype: str, out, inp, chunk=None) -> None:
        self.await_plan_verified()
        label = kind.label(chunk)
        self.ledger.record(label, kind.op.value, kind.group.value, dtype, inp.shape)
        self.issue(label, self.comm.all_gather, kind.group, out, inp)

    def issue(self, label: str, op, *args) -> None:
        """Run one transport call; a transport failure is named (peer failed / rank lost)."""
        try:
            op(*args, watch=self.watch)
        except CpplanError:
            raise
        except RuntimeError as exc:  # gloo/NCCL: a peer gone, timed out, or aborted
            if self.watch is None:
                raise
            raise self.watch.transport_error(label, exc) from None


# ------------------------------------------------------------------------- named collectives
def kv_insert(ch: StepChannel, out: torch.Tensor, inp: torch.Tensor) -> None:
    """pcp all-gather of this rank's new prefill KV: inp ``[T - nd, kv_bytes]`` uint8 ->
    out ``[P * (T - nd), kv_bytes]`` uint8 (fp8_ds_mla or bf16 bytes), rank-major."""
    ch._gather(names.KV_INSERT, "uint8", out, inp)


def indexer_k_insert(ch: StepChannel, out: torch.Tensor, inp: torch.Tensor) -> None:
    """pcp all-gather of the new prefill indexer keys: ``[T - nd, 132]`` uint8 per rank."""
    ch._gather(names.INDEXER_K_INSERT, "uint8", out, inp)


def indexer_k_gather(ch: StepChannel, chunk: int, out: torch.Tensor, inp: torch.Tensor) -> None:
    """dcp all-gather of gather chunk ``chunk``'s local indexer keys: ``[PT_c, 132]`` uint8
    per rank -> ``[W * PT_c, 132]`` rank-major (read through remapped rows, never copied)."""
    ch._gather(names.INDEXER_K_GATHER, "uint8", out, inp, chunk)


def kv_gather(ch: StepChannel, chunk: int, out: torch.Tensor, inp: torch.Tensor) -> None:
    """dcp all-gather of gather chunk ``chunk``'s local KV: ``[PT_c, kv_bytes]`` uint8."""
    ch._gather(names.KV_GATHER, "uint8", out, inp, chunk)


def topk_candidates(ch: StepChannel, scores: torch.Tensor,
                    ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dcp all-gather of the decode rows' local top-k: scores ``[nd, topk]`` (sent as float32;
    the reference indexer's scores are integers, exact in float32) and global ids ``[nd, topk]``
    int32 (a plan's token ids fit), packed into one uint8 buffer ``[nd, topk * 8]`` so it is
    one collective. Returns ``(scores [nd, W, topk] float32, ids [nd, W, topk] int32)``: views
    of the received buffer (no copy; list w = rank w's), unit last stride."""
    nd, topk = ids.shape
    packed = torch.cat([scores.float().contiguous().view(torch.uint8),
                        ids.int().contiguous().view(torch.uint8)], dim=1)
    size = ch.size(Group.DCP)
    out = torch.empty(size * nd, topk * 8, dtype=torch.uint8, device=packed.device)
    ch.await_plan_verified()
    kind = names.TOPK_CANDIDATES
    ch.ledger.record(kind.name, kind.op.value, kind.group.value, TOPK_CANDIDATE_DTYPE, (nd, topk))
    ch.issue(kind.name, ch.comm.all_gather, Group.DCP, out, packed)
    out = out.view(size, nd, topk * 8)
    all_scores = out[..., : 4 * topk].view(torch.float32)
    all_ids = out[..., 4 * topk :].view(torch.int32)
    return all_scores.permute(1, 0, 2), all_ids.permute(1, 0, 2)


def decode_lse(ch: StepChannel, lse_base_e: torch.Tensor) -> torch.Tensor:
    """dcp all-gather of the decode rows' partial LSE ``[nd, H]`` float32 -> ``[W, nd, H]``."""
    size = ch.size(Group.DCP)
    out = torch.empty((size,) + tuple(lse_base_e.shape), dtype=torch.float32,
                      device=lse_base_e.device)
    ch._gather(names.DECODE_LSE, "float32", out.view(-1, lse_base_e.shape[-1]),
               lse_base_e.float().contiguous())
    return out


def decode_out(ch: StepChannel, scaled_out: torch.Tensor) -> None:
    """dcp all-reduce (sum) of the LSE-scaled partial decode outputs ``[nd, H, 512]`` act,
    in place."""
    ch.await_plan_verified()
    kind = names.DECODE_OUT
    ch.ledger.record(kind.name, kind.op.value, kind.group.value, act_name(scaled_out.dtype),
                     scaled_out.shape)
    ch.issue(kind.name, ch.comm.all_reduce_sum, Group.DCP, scaled_out)


def restore(ch: StepChannel, out: torch.Tensor, inp: torch.Tensor) -> None:
    """pcp all-gather of every rank's rows ``[T, hidden]`` act -> ``[P * T, hidden]``; the
    plan's restore index then puts the tokens in global order."""
    ch._gather(names.RESTORE, act_name(inp.dtype), out, inp)


def restore_sampled(ch: StepChannel, out: torch.Tensor, inp: torch.Tensor) -> None:
    """pcp all-gather of the sampled rows each rank supplies ``[M, hidden]`` act (padded to
    M, the most any rank supplies) -> ``[P * M, hidden]``; the plan's sampled restore index
    then picks each sampled request's row."""
    ch._gather(names.RESTORE_SAMPLED, act_name(inp.dtype), out, inp)
