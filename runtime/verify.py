"""The digest check: every rank's plan digest compared across the control group.

``DigestCheck.start(plan)`` (at bind) hands this rank's 16-byte digest and a status byte to the
exchange (runtime/exchange.py: a board in shared memory when every rank runs on one host, else
an async gloo all-gather); ``PendingCheck.wait()`` (just before the step's first data
collective) awaits every rank's row.
On a mismatch every rank exchanges its encoded plan (bytes through the same gloo group, no
pickle), finds the first differing field and raises the same :class:`PlanMismatchError` (when
no digest has a majority it says the ranks disagree instead of blaming some). A rank whose bind
failed locally still takes part, with status FAILED (its error is on the store: runtime/faults.py),
and every peer raises :class:`PeerFailedError` naming it. A rank that does not take part fails
the check on the others within ``control_timeout_s`` (:class:`RankLostError`, naming it through
the store when one is available).

Cost (bench/step.py): one exchange of 17 bytes a rank per checked step; modes ``every``
(default), ``sampled`` (every N-th bind of this executor, counted locally so all ranks agree)
and ``off``.
"""

from __future__ import annotations

import collections

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from cpplan.runtime.exchange import ExchangeTimeout, open_exchange
from cpplan.runtime.faults import FaultBoard, one_line
from cpplan.schemas.arrays import Array
from cpplan.schemas.codec import decode_plan, digest, encode_plan
from cpplan.schemas.errors import ConfigError, PlanMismatchError, RankLostError
from cpplan.schemas.plan import StepPlan

VERIFY_MODES = ("every", "sampled", "off")
DIGEST_BYTES = 16
STATUS_OK, STATUS_FAILED = 0, 1  # the byte after the digest: did this rank's bind succeed


def agree_on_setup(groups, config, **settings) -> None:
    """Every rank of the control group builds its executor from the same config and options
    (a collective call on it, once, before any other set-up traffic): one int64 a rank, the
    xxh64 of the config's fingerprint and ``settings``. ConfigError on every rank naming the
    ranks that differ from control rank 0 (they would set up other exchanges, or none, and
    meet in mismatched collectives); RankLostError when a peer does not take part within the
    control timeout (it failed before building its executor)."""
    if groups.control is None:
        return
    import xxhash

    from cpplan.schemas.codec import config_fingerprint

    text = config_fingerprint(config) + repr(sorted(settings.items()))
    mine = torch.tensor([xxhash.xxh64_intdigest(text.encode()) >> 1], dtype=torch.int64)
    outs = [torch.empty_like(mine) for _ in range(groups.control_size)]
    try:
        dist.all_gather(outs, mine, group=groups.control)
    except RuntimeError as exc:  # gloo: a peer gone or late past the control timeout
        raise RankLostError(
            f"executor set-up on control rank {groups.control_rank}: a peer did not take part "
            f"within the control timeout ({groups.control_timeout_s:g} s): {one_line(exc)}; "
            "expected every rank to build its executor at the same time") from None
    values = [int(o) for o in outs]
    differ = [r for r, v in enumerate(values) if v != values[0]]
    if differ:
        raise ConfigError(f"executor set-up: ranks {differ} were built with another config or "
                          f"other options than rank 0 ({', '.join(sorted(settings))}, the "
                          "config); expected the same on every rank")


class DigestCheck:
    """Per-executor digest verification state (one per rank)."""

    def __init__(self, groups, mode: str = "every", every_n: int = 1,
                 board: FaultBoard | None = None, exchange: str = "auto") -> None:
        """A collective call on the control group (the exchange is set up here, on every
        rank). exchange: "auto" (shared memory when every rank is on this host, else gloo),
        "shm" or "gloo" (runtime/exchange.py)."""
        if mode not in VERIFY_MODES:
            raise ConfigError(f"verify mode must be one of {VERIFY_MODES}: got {mode!r}")
        if type(every_n) is not int or every_n < 1:
            raise ConfigError(f"verify every_n must be an integer >= 1: got {every_n!r}")
        self.groups, self.mode, self.every_n = groups, mode, every_n
        self.board = board if board is not None else FaultBoard(groups)
        self.exchange = open_exchange(groups, exchange) if mode != "off" else None
        self.seq = 0  # binds seen by this rank: the same on every rank
        self.passed = 0  # checks that passed

    def start(self, plan: StepPlan, failed: bool = False) -> PendingCheck | None:
        """Start the check of ``plan`` if this bind is due; returns the handle to wait on.
        ``failed``: this rank's bind failed (its error already announced for this bind)."""
        self.seq += 1
        due = self.mode == "every" or (self.mode == "sampled" and self.seq % self.every_n == 0)
        if not due or self.exchange is None:
            return None
        status = STATUS_FAILED if failed else STATUS_OK
        try:
            pending = self.exchange.start(digest(plan) + bytes([status]))
        except ExchangeTimeout as exc:  # the board's slot still unread by a silent or dead rank
            raise self.board.lost_error(self.seq, plan.step_id, "digest check",
                                        self.groups.control_timeout_s, exc) from None
        return PendingCheck(self, plan, pending, self.seq)

    def close(self) -> None:
        """Unmap the shared-memory board (if any); the check is unusable afterwards."""
        if self.exchange is not None:
            self.exchange.close()


class PendingCheck:
    def __init__(self, owner: DigestCheck, plan: StepPlan, pending, seq: int):
        self.owner, self.plan, self.pending, self.seq = owner, plan, pending, seq

    def wait(self) -> None:
        """Await the exchange; raise PlanMismatchError / PeerFailedError / RankLostError (the
        same on every rank; a rank whose own bind failed returns, to raise its own error)."""
        g, board, step_id = self.owner.groups, self.owner.board, self.plan.step_id
        try:
            rows = self.pending.wait(g.control_timeout_s)
        except ExchangeTimeout as exc:  # a peer silent for the timeout, or gone
            raise board.lost_error(self.seq, step_id, "digest check", g.control_timeout_s,
                                   exc) from None
        digests = [r[:DIGEST_BYTES] for r in rows]
        if len(set(digests)) > 1:
            raise _mismatch_error(g, self.plan, digests, self.seq)
        failed = [r for r, row in enumerate(rows) if row[DIGEST_BYTES] == STATUS_FAILED]
        if not failed:
            self.owner.passed += 1
        elif g.control_rank not in failed:
            raise board.failed_ranks(self.seq, step_id, failed)


def divergent_ranks(digests: list[bytes]) -> tuple[list[int], bytes]:
    """Ranks outside the majority digest (on a tie: those differing from rank 0)."""
    counts = collections.Counter(digests)
    top = max(counts.values())
    winners = [d for d, n in counts.items() if n == top]
    majority = winners[0] if len(winners) == 1 else digests[0]
    return [r for r, d in enumerate(digests) if d != majority], majority


def has_majority(digests: list[bytes]) -> bool:
    """True when one digest is held by more ranks than every other (then the rest diverged)."""
    counts = sorted(collections.Counter(digests).values(), reverse=True)
    return len(counts) == 1 or counts[0] > counts[1]


def digest_groups(digests: list[bytes]) -> list[list[int]]:
    """Ranks grouped by digest, in order of each group's lowest rank."""
    groups: dict[bytes, list[int]] = {}
    for r, d in enumerate(digests):
        groups.setdefault(d, []).append(r)
    return list(groups.values())


def _joined(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _mismatch_error(g, plan: StepPlan, digests: list[bytes], seq: int) -> PlanMismatchError:
    bad, majority = divergent_ranks(digests)
    ref_rank = digests.index(majority)
    plans = _exchange_plans(g, plan)
    ref = plans[ref_rank]
    field = "unknown (plans could not be exchanged)"
    if ref is not None and plans[bad[0]] is not None:
        field = first_difference(plans[bad[0]], ref) or "none (same fields, different bytes)"
    step_id = ref.step_id if ref is not None else plan.step_id
    if has_majority(digests):
        good = [r for r in range(len(digests)) if r not in bad]
        who = (f"ranks {bad} compiled a different plan than ranks {good} (digest "
               f"{digests[bad[0]].hex()[:12]} vs {majority.hex()[:12]})")
    else:  # no majority: nobody can tell which side is right
        sides = digest_groups(digests)
        who = (f"ranks {_joined([str(s) for s in sides])} disagree (no majority; digests "
               f"{', '.join(digests[s[0]].hex()[:12] for s in sides)})")
    return PlanMismatchError(
        f"plan mismatch at step {step_id} (check #{seq}): {who}; first differing field on "
        f"rank {bad[0]} vs rank {ref_rank}: {field}")


def _exchange_plans(g, plan: StepPlan) -> list[StepPlan | None]:
    """Every rank's encoded plan, through the gloo group as bytes (no pickle)."""
    data = encode_plan(plan)
    size = g.control_size
    lens = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lens, torch.tensor([len(data)], dtype=torch.int64), group=g.control)
    width = max(int(t[0]) for t in lens)
    buf = torch.zeros(width, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    outs = [torch.empty(width, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(outs, buf, group=g.control)
    plans = []
    for t, n in zip(outs, lens):
        try:
            plans.append(decode_plan(t.numpy()[: int(n[0])].tobytes()))
        except ValueError:
            plans.append(None)
    return plans


def first_difference(a, b, prefix: str = "") -> str | None:
    """Dotted path of the first field where two plan values differ (None if equal)."""
    if a == b:
        return None
    if isinstance(a, Array) and isinstance(b, Array):
        if a.shape != b.shape:
            return f"{prefix} (shape {a.shape} vs {b.shape})"
        x, y = a.np(), b.np()
        k = int(np.argmax((x != y).reshape(-1)))
        idx = np.unravel_index(k, x.shape) if x.shape else ()
        return f"{prefix}[{', '.join(map(str, idx))}] ({x[idx]} vs {y[idx]})"
    if isinstance(a, msgspec.Struct) and type(a) is type(b):
        for name in a.__struct_fields__:
            sub = first_difference(getattr(a, name), getattr(b, name),
                                   f"{prefix}.{name}" if prefix else name)
            if sub is not None:
                return sub
        return prefix
    if isinstance(a, tuple) and isinstance(b, tuple):
        for k, (x, y) in enumerate(zip(a, b)):
            sub = first_difference(x, y, f"{prefix}[{k}]")
            if sub is not None:
                return sub
        return f"{prefix} (length {len(a)} vs {len(b)})"
    return f"{prefix} ({a!r} vs {b!r})"

