"""The digest check: every rank's plan digest compared over the gloo control group.

``DigestCheck.start(plan)`` (at bind) issues an async all-gather of the 16-byte digest;
``PendingCheck.wait()`` (just before the step's first data collective) awaits it. On a mismatch
every rank exchanges its encoded plan (bytes through the same gloo group, no pickle), finds the
first differing field and raises the same :class:`PlanMismatchError`. A rank that does not take
part fails the check on the others within ``control_timeout_s`` (:class:`RankLostError`, naming
it through the store when one is available).

Cost (bench/step.py): one 16-byte gloo all-gather per checked step; modes ``every`` (default),
``sampled`` (every N-th bind of this executor, counted locally so all ranks agree) and ``off``.
"""

from __future__ import annotations

import collections
import time

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from cpplan.schemas.arrays import Array
from cpplan.schemas.codec import decode_plan, digest, encode_plan
from cpplan.schemas.errors import ConfigError, PlanMismatchError, RankLostError
from cpplan.schemas.plan import StepPlan

VERIFY_MODES = ("every", "sampled", "off")
DIGEST_BYTES = 16
_ALIVE_GRACE_S = 2.0  # survivors wait this long for each other's "alive" mark after a failure


class DigestCheck:
    """Per-executor digest verification state (one per rank)."""

    def __init__(self, groups, mode: str = "every", every_n: int = 1) -> None:
        if mode not in VERIFY_MODES:
            raise ConfigError(f"verify mode must be one of {VERIFY_MODES}: got {mode!r}")
        if every_n < 1:
            raise ConfigError(f"verify every_n must be >= 1: got {every_n}")
        self.groups, self.mode, self.every_n = groups, mode, every_n
        self.seq = 0  # binds seen by this rank: the same on every rank
        self.passed = 0  # checks that passed

    def start(self, plan: StepPlan) -> "PendingCheck | None":
        """Start the check of ``plan`` if this bind is due; returns the handle to wait on."""
        self.seq += 1
        due = self.mode == "every" or (self.mode == "sampled" and self.seq % self.every_n == 0)
        if not due or self.groups.control is None:
            return None
        mine = torch.frombuffer(bytearray(digest(plan)), dtype=torch.uint8)
        outs = [torch.empty(DIGEST_BYTES, dtype=torch.uint8)
                for _ in range(self.groups.control_size)]
        work = dist.all_gather(outs, mine, group=self.groups.control, async_op=True)
        return PendingCheck(self, plan, outs, work, time.monotonic())


class PendingCheck:
    def __init__(self, owner: DigestCheck, plan: StepPlan, outs, work, started: float):
        self.owner, self.plan, self.outs, self.work, self.started = owner, plan, outs, work, started

    def wait(self) -> None:
        """Await the exchange; raise PlanMismatchError / RankLostError (on every rank alike)."""
        g = self.owner.groups
        try:
            self.work.wait()
        except RuntimeError as exc:  # gloo: timeout or a peer gone
            raise _lost_error(g, self.owner.seq, self.plan.step_id, exc) from None
        digests = [bytes(t.numpy().tobytes()) for t in self.outs]
        if len(set(digests)) == 1:
            self.owner.passed += 1
            return
        raise _mismatch_error(g, self.plan, digests, self.owner.seq)


def divergent_ranks(digests: list[bytes]) -> tuple[list[int], bytes]:
    """Ranks outside the majority digest (on a tie: those differing from rank 0)."""
    counts = collections.Counter(digests)
    top = max(counts.values())
    winners = [d for d, n in counts.items() if n == top]
    majority = winners[0] if len(winners) == 1 else digests[0]
    return [r for r, d in enumerate(digests) if d != majority], majority


def _mismatch_error(g, plan: StepPlan, digests: list[bytes], seq: int) -> PlanMismatchError:
    bad, majority = divergent_ranks(digests)
    ref_rank = digests.index(majority)
    plans = _exchange_plans(g, plan)
    ref = plans[ref_rank]
    field = "unknown (plans could not be exchanged)"
    if ref is not None and plans[bad[0]] is not None:
        field = first_difference(plans[bad[0]], ref) or "none (same fields, different bytes)"
    step_id = ref.step_id if ref is not None else plan.step_id
    good = [r for r in range(len(digests)) if r not in bad]
    return PlanMismatchError(
        f"plan mismatch at step {step_id} (check #{seq}): ranks {bad} compiled a different plan "
        f"than ranks {good} (digest {digests[bad[0]].hex()[:12]} vs {majority.hex()[:12]}); "
        f"first differing field on rank {bad[0]} vs rank {ref_rank}: {field}")


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


def _lost_error(g, seq: int, step_id: int, exc: BaseException) -> RankLostError:
    """Name the ranks that did not reach check #seq, through the store if there is one."""
    size, me = g.control_size, g.control_rank
    missing: list[int] | None = None
    store = g.store
    if store is not None:
        try:
            store.set(f"cpplan/alive/{seq}/{me}", b"1")
            deadline = time.monotonic() + _ALIVE_GRACE_S
            while True:
                missing = [r for r in range(size)
                           if not store.check([f"cpplan/alive/{seq}/{r}"])]
                if not missing or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        except (RuntimeError, ValueError):
            missing = None
    named = f"ranks {missing}" if missing else "a rank (unknown: no store)"
    detail = " ".join(str(exc).split())[:200]
    return RankLostError(
        f"{named} did not take part in the digest check of step {step_id} (check #{seq}) within "
        f"{g.control_timeout_s:g} s: {detail}")
