"""The fault board, the step watch and the NCCL watchdog over an in-memory store (no world):
what one rank posts, another reads; the watchdog aborts the data groups on a peer's failure.
The no-majority wording of a plan mismatch."""

from __future__ import annotations

import time
import types

import pytest
import torch.distributed as dist

from cpplan.runtime.faults import FaultBoard, StepWatch, Watchdog, one_line
from cpplan.runtime.verify import digest_groups, has_majority
from cpplan.schemas.errors import PeerFailedError, RankLostError


class _Group:
    group_name = "7"


def _groups(store, rank: int, size: int = 2, pcp=None, dcp=None):
    return types.SimpleNamespace(store=store, control=_Group(), control_rank=rank,
                                 control_size=size, control_timeout_s=5.0, pcp=pcp, dcp=dcp)


def test_a_posted_failure_is_read_by_the_peer_only():
    store = dist.HashStore()
    failing, peer = FaultBoard(_groups(store, 1)), FaultBoard(_groups(store, 0))
    exc = ValueError("block 41\nout of range")
    assert peer.peer_failure(3, step_id=9) is None
    failing.announce(3, exc)
    err = peer.peer_failure(3, step_id=9)
    assert isinstance(err, PeerFailedError) and isinstance(err, RankLostError)
    assert err.rank == 1 and err.detail == "ValueError: block 41 out of range"
    assert str(err).startswith("rank 1 failed in step 9 (check #3): ValueError: block 41")
    assert failing.peer_failure(3, step_id=9) is None  # its own post is not a peer's failure
    assert peer.peer_failure(4, step_id=10) is None  # keys are per step


def test_without_a_store_nothing_is_posted_and_errors_stay_unnamed():
    board = FaultBoard(_groups(None, 0))
    board.announce(1, ValueError("x"))
    assert board.peer_failure(1, 1) is None
    err = StepWatch(None, 1, 5, 120.0).transport_error("kv_gather[0]", RuntimeError("reset"))
    assert isinstance(err, RankLostError) and "kv_gather[0]" in str(err)


def test_transport_error_prefers_the_announced_failure_then_names_the_silent_rank():
    store = dist.HashStore()
    boards = [FaultBoard(_groups(store, r, size=3)) for r in range(3)]
    watch = StepWatch(boards[0], 2, 4, 120.0)
    boards[1].announce(2, KeyError("req-3"))
    assert isinstance(watch.transport_error("restore", RuntimeError("closed")), PeerFailedError)
    watch = StepWatch(boards[0], 5, 6, 120.0)  # nobody announced: rank 2 is silent
    boards[1]._missing("collective restore/5")  # rank 1 is alive at that point
    t0 = time.monotonic()
    err = watch.transport_error("restore", RuntimeError("Connection closed by peer"))
    assert type(err) is RankLostError and str(err).startswith("ranks [2] did not take part")
    assert time.monotonic() - t0 < 3.0


def test_step_watch_wait_ends_on_a_peer_failure():
    store = dist.HashStore()
    peer = FaultBoard(_groups(store, 0))

    class NeverDone:
        def wait(self, timeout):
            raise RuntimeError("Operation timed out!")

        def is_completed(self):
            return False

    FaultBoard(_groups(store, 1)).announce(1, RuntimeError("boom"))
    with pytest.raises(PeerFailedError, match="rank 1 failed .*RuntimeError: boom"):
        StepWatch(peer, 1, 0, 120.0).wait(NeverDone())


def test_watchdog_aborts_the_data_groups_once():
    store = dist.HashStore()
    aborted = []
    group = types.SimpleNamespace(abort=lambda: aborted.append(1))
    peer = FaultBoard(_groups(store, 0))
    dog = Watchdog(peer, _groups(store, 0, pcp=group, dcp=group))
    step = StepWatch(peer, 1, 0, 120.0)
    dog.watch(step)
    time.sleep(0.3)
    assert aborted == [] and step.aborted_by is None
    FaultBoard(_groups(store, 1)).announce(1, RuntimeError("boom"))
    deadline = time.monotonic() + 3
    while not aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert aborted == [1]  # pcp and dcp are one group here: aborted once
    assert step.transport_error("decode_out", RuntimeError("aborted")) is step.aborted_by
    dog.watch(None)


def test_one_line():
    assert one_line(RuntimeError("a\n  b")) == "RuntimeError: a b"


@pytest.mark.parametrize("digests,majority,groups", [
    ([b"a", b"b"], False, [[0], [1]]), ([b"a", b"a", b"b"], True, [[0, 1], [2]]),
    ([b"a", b"b", b"b", b"a"], False, [[0, 3], [1, 2]]), ([b"a", b"b", b"c"], False,
                                                          [[0], [1], [2]]),
    ([b"a", b"a"], True, [[0, 1]]),
])
def test_majority_and_digest_groups(digests, majority, groups):
    assert has_majority(digests) is majority
    assert digest_groups(digests) == groups
