"""The guard: vLLM's own partition of a step checked against cpplan's plan on every rank, and the
plan's digest agreed across the ranks, before the step's first PCP / DCP collective.

``Guard.check`` runs right after ``PCPManager.partition_batch`` (the plugin's wrapper,
cpplan/vllm/plugin.py). Each rank compiles the plan from the global batch (the planner is a pure
function of it, docs/design.md §1.2), derives what its partition must be
(``adapter.local_batch``), compares that with what vLLM built (:func:`vllm_view`), and then takes
part in the exchange: one short row a rank (step count, plan digest, a verdict byte) over each
of the exchange's groups in turn. A rank whose check failed, or that could not plan the step at
all, still sends its row, so the verdict reaches every rank in the same exchange; the ranks
that see a bad row then swap their one-line findings (and, for differing digests, their step
files, to name the first differing field of the batch), and every rank raises the same
:class:`VllmGuardError`. Nothing else of the step has run by then.

The groups: vLLM's PCP group (its ``cpu_group``, gloo), then its TP group when it has more than
one rank. vLLM lays its DCP groups over PCP first, then TP, so PCP x TP holds every rank that
shares one global batch; the second round's rows carry the first round's verdict, so a rank
whose own PCP group was clean still learns of its neighbours' mismatch. Each round is an
exchange of runtime/exchange.py: a shared-memory board when the group's ranks share one host,
else a gloo all-gather.

Nothing here imports vLLM; torch is imported when the exchange is set up.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence

import numpy as np

from cpplan.schemas.errors import CpplanError

# what vllm_view reads from device tensors (a device-to-host copy, so a sync on a GPU); the
# other fields are host arrays of vLLM's batch
DEVICE_FIELDS = frozenset({"positions", "seq_lens", "logits_indices", "hidden_restore_idx",
                           "padded_gather_idx", "gathered_kv_write_mask", "local_gather_idx"})
PRIVATE_FIELDS = ("hidden_restore_idx", "padded_gather_idx", "gathered_kv_write_mask",
                  "local_gather_idx")  # PCPManager's, with a leading underscore there
FIELD_SETS = ("all", "host")
EXCHANGE_KINDS = ("auto", "shm", "gloo")
DEFAULT_TIMEOUT_S = 60.0

# one row a rank a round: step count, plan digest, verdict bits (fits the board's 48 bytes)
_ROW = struct.Struct("<q16sB")
OWN_MISMATCH, OWN_FAILED, CARRIED = 1, 2, 4  # verdict bits; OWN_FAILED: the digest is void
NO_DIGEST = bytes(16)
MAX_DETAIL_BYTES = 480  # one rank's finding as sent (a longer one is cut)


class VllmGuardError(CpplanError, RuntimeError):
    """vLLM's step differs from cpplan's plan on some rank, or the ranks hold different global
    batches; raised on every rank of the step before its first collective, naming the step,
    the rank and the first differing field."""

    exit_code = 3


# ---------------------------------------------------------------- vLLM's partition as data
def _host(value) -> np.ndarray:
    """A torch tensor (any device) or array as a host numpy array."""
    if hasattr(value, "detach"):
        value = value.detach()
        if value.device.type != "cpu":
            value = value.cpu()
        return value.numpy()
    return np.asarray(value)


def vllm_view(manager, local_batch, keys: Sequence[str], fields: str = "all") -> dict:
    """What vLLM's ``partition_batch`` gave this rank, under the adapter's keys (``keys``, the
    keys of ``adapter.local_batch``): the local InputBatch's fields and the manager's private
    arrays, host numpy arrays or ints; ``None`` stays ``None``. ``fields="host"`` leaves out
    the device tensors (:data:`DEVICE_FIELDS`)."""
    view = {}
    for key in keys:
        if fields == "host" and key in DEVICE_FIELDS:
            continue
        if key in PRIVATE_FIELDS:
            value = getattr(manager, "_" + key)
        else:
            value = getattr(local_batch, key)
        if value is None or isinstance(value, (int, np.integer)):
            view[key] = value
        elif key == "req_ids":
            view[key] = list(value)
        else:
            view[key] = _host(value)
    return view


def _shown(values: np.ndarray, at: int) -> str:
    return str(values[at].item() if hasattr(values[at], "item") else values[at])


def first_difference(expected: dict, got: dict) -> str | None:
    """The first field (in ``got``'s order) where vLLM's partition (``got``) and cpplan's
    (``expected``) differ, as ``name[i]: vLLM x, cpplan y`` (or a length or kind); None when
    every field of ``got`` agrees. Integers are compared by value, whatever their dtype."""
    for key, mine in got.items():
        theirs = expected.get(key, KeyError)
        if theirs is KeyError:
            return f"{key}: vLLM has it, cpplan's local_batch does not"
        if mine is None or theirs is None:
            if mine is not theirs:
                return f"{key}: vLLM {'None' if mine is None else 'an array'}, cpplan " \
                       f"{'None' if theirs is None else 'an array'}"
            continue
        if key == "req_ids":
            mine, theirs = list(mine), list(theirs)
            if mine != theirs:
                if len(mine) != len(theirs):
                    return f"req_ids: vLLM {len(mine)} rows, cpplan {len(theirs)}"
                at = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
                return f"req_ids[{at}]: vLLM {mine[at]!r}, cpplan {theirs[at]!r}"
            continue
        a, b = np.asarray(mine), np.asarray(theirs)
        if a.ndim == 0 or b.ndim == 0:
            if a.ndim != b.ndim or int(a) != int(b):
                return f"{key}: vLLM {a.tolist()}, cpplan {b.tolist()}"
            continue
        if a.shape != b.shape:
            return f"{key}: vLLM length {a.shape[0]}, cpplan {b.shape[0]}"
        differ = a != b
        if differ.any():
            at = int(np.argmax(differ))
            return f"{key}[{at}]: vLLM {_shown(a, at)}, cpplan {_shown(b, at)}"
    return None


# ---------------------------------------------------------------- the exchange
@dataclasses.dataclass
class _Control:
    """What runtime/exchange.py reads of a group (its ``Groups.control`` view)."""

    control: object
    control_size: int
    control_rank: int
    control_timeout_s: float


class _Round:
    """One group's exchange (set up collectively on that group when made)."""

    def __init__(self, group, kind: str, timeout_s: float) -> None:
        import torch.distributed as dist

        from cpplan.runtime.exchange import open_exchange

        self.group, self.timeout_s = group, timeout_s
        self.members = dist.get_process_group_ranks(group)  # world ranks, in group order
        self.exchange = open_exchange(_Control(group, len(self.members),
                                               dist.get_rank(group), timeout_s), kind)

    def run(self, seq: int, digest: bytes, bits: int, finding: str | None,
            step) -> str | None:
        """This round's rows; None when all agree, else the one-line finding every rank of
        the group computes alike from the rows and the swapped details."""
        from cpplan.runtime.exchange import ExchangeTimeout

        try:
            rows = self.exchange.start(_ROW.pack(seq, digest, bits)).wait(self.timeout_s)
        except ExchangeTimeout as exc:
            raise VllmGuardError(
                f"cpplan guard, step {seq}: the guard's exchange with world ranks "
                f"{self.members} failed: {' '.join(str(exc).split())}; expected every rank to "
                f"check the step within {self.timeout_s:g} s") from None
        parsed = [_ROW.unpack(r[: _ROW.size]) for r in rows]
        seqs = [p[0] for p in parsed]
        digests = [p[1] for p in parsed if not p[2] & OWN_FAILED]
        if len(set(seqs)) == 1 and len(set(digests)) <= 1 and not any(p[2] for p in parsed):
            return None
        details = _gather_bytes(self.group, (finding or "").encode()[:MAX_DETAIL_BYTES])
        parts = []
        if len(set(seqs)) > 1:
            counts = ", ".join(f"rank {m} at step {s}" for m, s in zip(self.members, seqs))
            parts.append(f"the ranks are at different steps ({counts}): some rank ran "
                         "partition_batch more often; expected the same count on every rank")
        elif len(set(digests)) > 1:
            parts.append(self._digest_finding(parsed, step))
        for text in details:
            text = text.decode(errors="replace")
            if text and text not in parts:
                parts.append(text)
        return "; ".join(parts) or "a rank reported a problem it could not name"

    def _digest_finding(self, parsed, step) -> str:
        """Which ranks hold another global batch, and its first differing field (the step
        files swapped through the group: bytes, no pickle)."""
        from cpplan.runtime.verify import digest_groups, divergent_ranks
        from cpplan.runtime.verify import first_difference as first_field
        from cpplan.schemas.codec import decode_step, encode_step

        steps = _gather_bytes(self.group, encode_step(step) if step is not None else b"")
        valid = [i for i, p in enumerate(parsed) if not p[2] & OWN_FAILED]
        digests = [parsed[i][1] for i in valid]
        bad, majority = divergent_ranks(digests)
        bad_rank, ref_rank = valid[bad[0]], valid[digests.index(majority)]
        field = "unknown (a step file did not decode)"
        try:
            field = first_field(decode_step(steps[bad_rank]), decode_step(steps[ref_rank])) \
                or "none (same fields, different bytes)"
        except ValueError:
            pass
        sides = " vs ".join(f"ranks {[self.members[valid[i]] for i in side]} (plan digest "
                            f"{digests[side[0]].hex()[:12]})" for side in digest_groups(digests))
        return (f"the ranks hold different global batches: {sides}; first differing field of "
                f"the batch on rank {self.members[bad_rank]} vs rank {self.members[ref_rank]}: "
                f"{field}")

    def close(self) -> None:
        if self.exchange is not None:
            self.exchange.close()


def _gather_bytes(group, data: bytes) -> list[bytes]:
    """Every rank's ``data`` through the gloo ``group`` (lengths first, then padded bytes)."""
    import torch
    import torch.distributed as dist

    size = dist.get_world_size(group)
    lens = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lens, torch.tensor([len(data)], dtype=torch.int64), group=group)
    width = max(1, max(int(t[0]) for t in lens))
    buf = torch.zeros(width, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    outs = [torch.empty(width, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(outs, buf, group=group)
    return [o.numpy()[: int(n[0])].tobytes() for o, n in zip(outs, lens)]


class GuardExchange:
    """The rounds of the guard's exchange over ``groups`` (in order; groups of one rank and
    None are skipped). Made collectively: every rank of every group, at the same point."""

    def __init__(self, groups: Sequence, *, kind: str = "auto",
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        import torch.distributed as dist

        self.rounds = [_Round(g, kind, timeout_s) for g in groups
                       if g is not None and dist.get_world_size(g) > 1]

    def agree(self, seq: int, digest: bytes, bits: int, finding: str | None, step) -> None:
        """Every round in turn; VllmGuardError (the same on every rank) when any rank of any
        round reported a problem or the digests differ. ``step``: this rank's StepInput (None
        when it could not be built), swapped only when the digests differ."""
        found = None
        for rnd in self.rounds:
            now = rnd.run(seq, digest, bits | (CARRIED if found else 0), found or finding, step)
            found = found or now
        if found is None and bits:  # a world of one: nobody to exchange with
            found = finding
        if found is not None:
            raise VllmGuardError(f"cpplan guard, step {seq}: {found}")

    def close(self) -> None:
        for rnd in self.rounds:
            rnd.close()


# ---------------------------------------------------------------- one rank's check
def check_partition(manager, global_batch, local, expected: dict, fields: str,
                    where: str) -> str | None:
    """Compare vLLM's partition of this rank (``local``, ``manager``'s private arrays) with
    cpplan's (``expected``: ``adapter.local_batch`` of the step's plan); the finding names the
    rank (``where``) and the first differing field, None when they agree. The adapter's
    ``idx_mapping_np`` (positions in the global batch) goes through the global batch's, as
    vLLM's does."""
    idx = expected.get("idx_mapping_np")
    if idx is not None:
        expected = dict(expected)
        expected["idx_mapping_np"] = np.asarray(global_batch.idx_mapping_np)[np.asarray(idx)]
    got = vllm_view(manager, local, list(expected), fields)
    diff = first_difference(expected, got)
    if diff is None:
        return None
    return f"{where}: vLLM's partition_batch differs from cpplan's plan at {diff}"
