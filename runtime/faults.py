"""Rank-local failures told to the other ranks through the control plane (the world's store).

A rank that raises during a step (in bind, insert, attend, restore) posts its one-line error
under the step's key before it re-raises; its peers must then stop promptly with a
:class:`PeerFailedError` naming that rank and that error, instead of blocking in the next data
collective until the data timeout with a transport error that names no rank.

How the peers find out:

- at bind, through the digest check: the exchange carries a status byte, so a rank whose bind
  failed still takes part and every peer raises at the check (runtime/verify.py);
- inside a data collective on gloo (CPU), through :meth:`StepWatch.wait`: the collective is
  issued async and awaited in short timed waits; between them the store is read (one key), so
  a peer's failure ends the wait within ~``POLL_S``. The collective itself is not cut short;
- on NCCL the host does not block in a collective (work is queued on the stream), so a
  :class:`Watchdog` thread polls the store while a step is bound and aborts the rank's data
  groups (``ProcessGroupNCCL.abort()``) when a peer fails, which ends the queued work with an
  error that :meth:`StepWatch.transport_error` turns into the PeerFailedError.

After a PeerFailedError or RankLostError the data groups are in an unknown state (a collective
may still be pending): the engine must rebuild its groups before the next step.
Keys live under ``cpplan/<control group name>/``: unique per ``Groups.build`` in a world, and
the same on every rank, as is the step sequence number (binds seen by this executor).
"""

from __future__ import annotations

import datetime
import threading
import time

from cpplan.schemas.errors import PeerFailedError, RankLostError

POLL_S = 0.1  # between timed waits on a collective, the store is read once
ALIVE_GRACE_S = 2.0  # survivors wait this long for each other's "alive" mark after a failure
MESSAGE_CHARS = 300


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line, cut to MESSAGE_CHARS."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:MESSAGE_CHARS]


class FaultBoard:
    """One executor's view of the failure keys. Without a store (or in a world of one) it
    announces nothing and finds nothing; transport errors then stay unnamed RankLostErrors."""

    def __init__(self, groups) -> None:
        self.store = groups.store if groups.control is not None else None
        self.rank, self.size = groups.control_rank, groups.control_size
        self.control_timeout_s = groups.control_timeout_s
        name = getattr(groups.control, "group_name", None) or "0"
        self.prefix = f"cpplan/{name}"
        self.seq = 0

    def next_step(self) -> int:
        """Sequence number of the next bound step: the same on every rank."""
        self.seq += 1
        return self.seq

    # ------------------------------------------------------------------ this rank failed
    def announce(self, seq: int, exc: BaseException) -> None:
        """Post this rank's error for step ``seq`` (message first, then the flag peers poll)."""
        if self.store is None:
            return
        try:
            self.store.set(f"{self.prefix}/failed/{seq}/{self.rank}", one_line(exc))
            self.store.set(f"{self.prefix}/failed/{seq}", str(self.rank))
        except (RuntimeError, ValueError):
            pass  # the store is gone too: peers fall back to the transport's own error

    # ------------------------------------------------------------------ a peer failed
    def peer_failure(self, seq: int, step_id: int) -> PeerFailedError | None:
        """The failure a peer posted for step ``seq``, if any (one store round trip)."""
        if self.store is None:
            return None
        try:
            if not self.store.check([f"{self.prefix}/failed/{seq}"]):
                return None
            rank = int(self.store.get(f"{self.prefix}/failed/{seq}"))
        except (RuntimeError, ValueError):
            return None
        if rank == self.rank:
            return None
        return self.failed_ranks(seq, step_id, [rank])

    def failed_ranks(self, seq: int, step_id: int, ranks: list[int]) -> PeerFailedError:
        """The error naming ``ranks`` (which announced a failure) and the first one's message."""
        detail = "(no message: no store)"
        if self.store is not None:
            try:
                detail = self.store.get(f"{self.prefix}/failed/{seq}/{ranks[0]}").decode()
            except (RuntimeError, ValueError):
                detail = "(its message could not be read from the store)"
        return PeerFailedError(
            f"rank {ranks[0]} failed in step {step_id} (check #{seq}): {detail}"
            + (f" (also failed: ranks {ranks[1:]})" if len(ranks) > 1 else ""),
            rank=ranks[0], detail=detail)

    # ------------------------------------------------------------------ a peer went silent
    def lost_error(self, seq: int, step_id: int, what: str, timeout_s: float,
                   exc: BaseException) -> RankLostError:
        """Name the ranks that did not reach ``what`` of step ``seq`` (via "alive" marks)."""
        missing = self._missing(f"{what}/{seq}")
        if missing is None:  # no store: the transport may still know (the shm digest board)
            missing = getattr(exc, "ranks", None)
        named = f"ranks {missing}" if missing else "a rank (unknown: no store)"
        return RankLostError(f"{named} did not take part in the {what} of step {step_id} "
                             f"(check #{seq}) within {timeout_s:g} s: {one_line(exc)}")

    def _missing(self, tag: str) -> list[int] | None:
        if self.store is None:
            return None
        try:
            self.store.set(f"{self.prefix}/alive/{tag}/{self.rank}", b"1")
            deadline = time.monotonic() + ALIVE_GRACE_S
            while True:
                missing = [r for r in range(self.size)
                           if not self.store.check([f"{self.prefix}/alive/{tag}/{r}"])]
                if not missing or time.monotonic() > deadline:
                    return missing
                time.sleep(0.05)
        except (RuntimeError, ValueError):
            return None


class StepWatch:
    """One bound step's link to the board: how its collectives wait and how their transport
    errors are named."""

    def __init__(self, board: FaultBoard | None, seq: int, step_id: int,
                 data_timeout_s: float) -> None:
        self.board, self.seq, self.step_id = board, seq, step_id
        self.data_timeout_s = data_timeout_s
        self.aborted_by: PeerFailedError | None = None  # set by the Watchdog (NCCL)

    def wait(self, work) -> None:
        """Await an async gloo work in POLL_S slices, reading the board between them."""
        poll = datetime.timedelta(seconds=POLL_S)
        while True:
            try:
                work.wait(poll)
                return
            except RuntimeError:
                if work.is_completed():  # done meanwhile: return, or raise its own error
                    work.wait()
                    return
            peer = self.board.peer_failure(self.seq, self.step_id) if self.board else None
            if peer is not None:
                raise peer

    def transport_error(self, name: str, exc: BaseException) -> Exception:
        """What a failed data collective means: a peer's announced failure, else a lost rank."""
        if self.aborted_by is not None:
            return self.aborted_by
        if self.board is None:
            return RankLostError(f"collective {name} of step {self.step_id} failed: "
                                 f"{one_line(exc)}")
        peer = self.board.peer_failure(self.seq, self.step_id)
        if peer is not None:
            return peer
        return self.board.lost_error(self.seq, self.step_id, f"collective {name}",
                                     self.data_timeout_s, exc)


class Watchdog:
    """For NCCL: a daemon thread that, while a step is watched, polls the board every POLL_S
    and on a peer's failure calls ``abort()`` (``ProcessGroupNCCL.abort``) on the rank's data
    groups, so queued work ends with an error instead of hanging the next host sync."""

    def __init__(self, board: FaultBoard, groups) -> None:
        self.board, self.groups = board, groups
        self._watch: StepWatch | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="cpplan-watchdog")
        self._thread.start()

    def watch(self, step: StepWatch | None) -> None:
        with self._lock:
            self._watch = step

    def _loop(self) -> None:
        while True:
            time.sleep(POLL_S)
            with self._lock:
                step = self._watch
            if step is None or step.aborted_by is not None:
                continue
            peer = self.board.peer_failure(step.seq, step.step_id)
            if peer is not None:
                step.aborted_by = peer
                self.abort_groups()

    def abort_groups(self) -> None:
        for pg in {id(g): g for g in (self.groups.pcp, self.groups.dcp) if g is not None}.values():
            abort = getattr(pg, "abort", None)
            if abort is not None:
                abort()
