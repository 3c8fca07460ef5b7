"""How the ranks' digest-check rows meet: a gloo all-gather, or a shared-memory board on one host.

The digest check (runtime/verify.py) exchanges one short row per rank per checked step (the
16-byte plan digest and a status byte) and needs every rank's row before the step's first data
collective. On the control group that is a 17-byte gloo all-gather: about 0.19 ms median on an
idle 2-core host, 0.30 ms on the H200 host (bench/step.py), on the host's critical path of every
step at P x W > 1. When every rank of the control group runs on one host, a board in
``/dev/shm`` does the same in microseconds: each rank writes its row into its own slot and reads
the others'.

``open_exchange(groups, kind)`` returns the exchange every rank of the control group agrees on
(a collective call on that group, once, at executor construction):

- ``"gloo"``: :class:`GlooExchange`, the all-gather;
- ``"shm"``: :class:`SharedMemoryExchange`; a ``ConfigError`` when the ranks cannot share one
  board (different hosts, no ``/dev/shm``);
- ``"auto"`` (default): the board when every rank can share it, else gloo.

The board (created by control rank 0, mapped by every rank, unlinked as soon as all have mapped
it, so nothing is left in ``/dev/shm`` whatever happens to the processes): a header of one
24-byte entry per rank (pid, setup nonce, the last exchange up to which it has read every
row), then ``ROWS`` rows of slots, one 64-byte slot per rank in each. Exchange ``n`` (counted
per exchange object, the same on every rank) writes ``[n u64][row][xxh64 of n and row]`` into
row ``n % ROWS`` of this rank's slot; a reader takes a slot once its count is ``n`` and its
hash matches, so a torn or reordered read (any memory model) is never taken. A slot is
rewritten ``ROWS`` exchanges later, and only once every rank has acknowledged reading the row
it held (in normal running it has long since: checks start at bind and are awaited by the
step's first collective). A rank may have at most ``ROWS - 1`` exchanges started and not yet
awaited (``UsageError`` otherwise): the executor's bound steps in flight, its
``arena_depth``, which it keeps below that.

Waiting spins briefly, then yields, then sleeps in growing slices. A rank whose process is gone
(or a zombie) ends the wait at once; a rank that is alive but silent ends it at the control
timeout. Either way :class:`ExchangeTimeout` names the silent ranks and the caller turns it into
``RankLostError``.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
import uuid

import torch
import torch.distributed as dist
import xxhash

from cpplan.schemas.errors import ConfigError, UsageError

EXCHANGE_KINDS = ("auto", "shm", "gloo")
SHM_DIR = "/dev/shm"
SLOT_BYTES = 64
ROWS = 16  # rows of slots: at most ROWS - 1 exchanges outstanding a rank (module docstring)
HEADER_BYTES = 24  # per rank: pid u64, setup nonce u64, acknowledged exchange u64
_COUNT = struct.Struct("<Q")
_SPIN = 64  # tight polls before yielding
_YIELD_S = 1e-3  # then sched_yield polls for this long, then sleeps
_SLEEP_MAX_S = 1e-3
_LIVENESS_S = 0.05  # between checks that the silent ranks' processes still exist


class ExchangeTimeout(RuntimeError):
    """Some ranks wrote no row for this exchange (or never acknowledged reading the row a slot
    held before it could be rewritten): they went silent (``gone`` False) or their process
    ended (``gone`` True). ``ranks`` lists them (None: gloo cannot tell)."""

    def __init__(self, message: str, ranks: list[int] | None = None, gone: bool = False):
        super().__init__(message)
        self.ranks, self.gone = ranks, gone


class GlooExchange:
    """The rows all-gathered on the gloo control group (async; awaited in ``wait``)."""

    kind = "gloo"

    def __init__(self, groups) -> None:
        self.group, self.size = groups.control, groups.control_size

    def start(self, row: bytes) -> _GlooPending:
        mine = torch.frombuffer(bytearray(row), dtype=torch.uint8)
        outs = [torch.empty(len(row), dtype=torch.uint8) for _ in range(self.size)]
        return _GlooPending(outs, dist.all_gather(outs, mine, group=self.group, async_op=True))

    def close(self) -> None:
        pass


class _GlooPending:
    def __init__(self, outs, work) -> None:
        self.outs, self.work = outs, work

    def wait(self, timeout_s: float) -> list[bytes]:
        """Every rank's row in rank order; ``ExchangeTimeout`` when gloo gives up (its own
        timeout is the group's, ``timeout_s``)."""
        try:
            self.work.wait()
        except RuntimeError as exc:  # gloo: timeout or a peer gone
            raise ExchangeTimeout(str(exc)) from None
        return [t.numpy().tobytes() for t in self.outs]  # CPU tensors (gloo): no device sync


class SharedMemoryExchange:
    """The board described in the module docstring. ``row_bytes`` <= SLOT_BYTES - 16."""

    kind = "shm"

    def __init__(self, board: mmap.mmap, rank: int, size: int, pids: list[int],
                 check_pids: bool, timeout_s: float = 30.0) -> None:
        self.board, self.rank, self.size = board, rank, size
        self.pids, self.check_pids, self.timeout_s = pids, check_pids, timeout_s
        self.count = 0  # exchanges started: the same on every rank
        self.acked, self.done = 0, set()  # this rank read every row of exchanges <= acked

    def _slot(self, row: int, rank: int) -> int:
        return self.size * HEADER_BYTES + (row * self.size + rank) * SLOT_BYTES

    def start(self, row: bytes) -> _ShmPending:
        if len(row) > SLOT_BYTES - 16:
            raise ValueError(f"exchange row of {len(row)} bytes: expected at most "
                             f"{SLOT_BYTES - 16}")
        n = self.count + 1
        if n > ROWS:  # this rank's slot for n last held n - ROWS: read by every rank yet?
            if self.acked < n - ROWS:
                raise UsageError(f"digest exchange #{n} started with #{self.acked + 1} not yet "
                                 f"awaited here: expected at most {ROWS - 1} outstanding")
            _poll(self, lambda: [r for r in range(self.size) if self._acked(r) < n - ROWS],
                  self.timeout_s, f"acknowledged exchange #{n - ROWS}")
        self.count = n
        body = _COUNT.pack(n) + row
        at = self._slot(n % ROWS, self.rank)
        self.board[at: at + len(body) + 8] = body + xxhash.xxh64_digest(body)
        return _ShmPending(self, n, len(row))

    def read(self, count: int, rank: int, row_bytes: int) -> bytes | None:
        """Rank ``rank``'s row of exchange ``count``, or None if it is not (wholly) there."""
        at = self._slot(count % ROWS, rank)
        if _COUNT.unpack_from(self.board, at)[0] != count:
            return None
        data = self.board[at: at + 16 + row_bytes]
        body = data[: 8 + row_bytes]
        if xxhash.xxh64_digest(body) != data[8 + row_bytes:] or _COUNT.unpack_from(body)[0] != count:
            return None  # written while we read: poll again
        return body[8:]

    def _acked(self, rank: int) -> int:
        return _COUNT.unpack_from(self.board, rank * HEADER_BYTES + 16)[0]

    def ack(self, count: int) -> None:
        """This rank has read every row of exchange ``count``: publish the highest count up to
        which it has read them all (an aligned 8-byte store; a stale read only delays)."""
        self.done.add(count)
        while self.acked + 1 in self.done:
            self.acked += 1
            self.done.discard(self.acked)
        _COUNT.pack_into(self.board, self.rank * HEADER_BYTES + 16, self.acked)

    def gone(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` whose process no longer runs (never any when pids are foreign)."""
        return [r for r in ranks if self.check_pids and not _process_alive(self.pids[r])]

    def close(self) -> None:
        if not self.board.closed:
            self.board.close()


class _ShmPending:
    def __init__(self, ex: SharedMemoryExchange, count: int, row_bytes: int) -> None:
        self.ex, self.count, self.row_bytes = ex, count, row_bytes

    def wait(self, timeout_s: float) -> list[bytes]:
        """Every rank's row in rank order, polled from the board."""
        ex, rows = self.ex, [None] * self.ex.size

        def missing() -> list[int]:
            for r in range(ex.size):
                if rows[r] is None:
                    rows[r] = ex.read(self.count, r, self.row_bytes)
            return [r for r in range(ex.size) if rows[r] is None]

        _poll(ex, missing, timeout_s, f"wrote their digest row (exchange #{self.count})")
        ex.ack(self.count)
        return rows


def _poll(ex: SharedMemoryExchange, missing, timeout_s: float, what: str) -> None:
    """Until ``missing()`` (the ranks not there yet) is empty: spin, then yield, then sleep in
    growing slices; ``ExchangeTimeout`` for ranks whose process is gone (at once) or that stay
    missing for ``timeout_s``."""
    start = time.monotonic()
    polls, nap, next_liveness = 0, 2e-5, start + _LIVENESS_S
    while True:
        late = missing()
        if not late:
            return
        polls += 1
        if polls <= _SPIN:
            continue
        now = time.monotonic()
        if now >= next_liveness:
            next_liveness = now + _LIVENESS_S
            dead = ex.gone(late)
            if dead:
                raise ExchangeTimeout(f"ranks {dead} exited before they {what}", dead, gone=True)
        if now - start > timeout_s:
            raise ExchangeTimeout(f"ranks {late} never {what} within {timeout_s:g} s", late)
        if now - start < _YIELD_S:
            os.sched_yield()
        else:
            time.sleep(nap)
            nap = min(nap * 2, _SLEEP_MAX_S)


def _process_alive(pid: int) -> bool:
    """False when ``pid`` is gone or a zombie (a killed rank its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc here: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            pass
        return True


def open_exchange(groups, kind: str = "auto"):
    """The exchange for ``groups.control`` (a collective call on it: every rank, same ``kind``).
    None in a world of one (nothing to exchange)."""
    if kind not in EXCHANGE_KINDS:
        raise ConfigError(f"digest exchange {kind!r}: expected one of {EXCHANGE_KINDS}")
    if groups.control is None:
        return None
    if kind == "gloo":
        return GlooExchange(groups)
    board = _open_board(groups)
    if board is None:
        if kind == "shm":
            raise ConfigError("digest exchange 'shm': got ranks that cannot share a board in "
                              f"{SHM_DIR} (other hosts, or no {SHM_DIR}); expected all "
                              "ranks of the control group on one host (or use 'gloo')")
        return GlooExchange(groups)
    return board


def _gather_ints(values: list[int], groups) -> list[list[int]]:
    """Every rank's ``values`` (int64) through the control group."""
    mine = torch.tensor(values, dtype=torch.int64)
    outs = [torch.empty_like(mine) for _ in range(groups.control_size)]
    dist.all_gather(outs, mine, group=groups.control)
    return [o.tolist() for o in outs]  # CPU tensors of the gloo group, once at set-up


def _open_board(groups) -> SharedMemoryExchange | None:
    """Rank 0 creates the board, every rank maps it and proves it sees the others' writes;
    None on every rank unless all succeeded. Three small gloo all-gathers, once."""
    rank, size = groups.control_rank, groups.control_size
    nbytes = size * (HEADER_BYTES + ROWS * SLOT_BYTES)
    path = ""
    if rank == 0:
        path = os.path.join(SHM_DIR, f"cpplan-digest-{os.getpid()}-{uuid.uuid4().hex}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, nbytes)
            finally:
                os.close(fd)
        except OSError:
            path = ""
    try:  # whatever happens from here (a peer gone, a timeout, Ctrl-C), the file goes
        board, marks, verdict = _map_board(groups, path, nbytes)
    finally:
        if rank == 0 and path:
            try:
                os.unlink(path)  # every rank has mapped it (or given up): nothing stays behind
            except OSError:
                pass
    if not all(v[0] for v in verdict):
        if board is not None:
            board.close()
        return None
    pids = [m[1] for m in marks]
    check_pids = all(_process_alive(p) for p in pids)  # False in separate pid namespaces
    return SharedMemoryExchange(board, rank, size, pids, check_pids, groups.control_timeout_s)


def _map_board(groups, path: str, nbytes: int):
    """Every rank maps rank 0's board ``path`` (announced through the control group) and proves
    it sees the others' writes: (the mapping or None, every rank's (ok, pid, nonce), every
    rank's verdict). Three small gloo all-gathers."""
    rank = groups.control_rank
    names = _gather_ints(list(path.encode().ljust(128, b"\0")), groups)
    path = bytes(names[0]).rstrip(b"\0").decode()
    board, nonce = None, int.from_bytes(os.urandom(7), "little")
    try:
        if path:
            try:
                fd = os.open(path, os.O_RDWR)
                try:
                    board = mmap.mmap(fd, nbytes)
                finally:
                    os.close(fd)
                board[rank * HEADER_BYTES: (rank + 1) * HEADER_BYTES] = struct.pack(
                    "<QQQ", os.getpid(), nonce, 0)
            except (OSError, ValueError):
                board = None
        marks = _gather_ints([board is not None, os.getpid(), nonce], groups)
        seen = board is not None and all(
            ok and struct.unpack_from("<QQ", board, r * HEADER_BYTES) == (pid, n)
            for r, (ok, pid, n) in enumerate(marks))
        verdict = _gather_ints([seen], groups)
    except BaseException:
        if board is not None:
            board.close()
        raise
    return board, marks, verdict
