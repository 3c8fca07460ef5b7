"""A world of rank processes, reusable across jobs (tests, ``cpplan simulate``).

``World(n)`` starts n processes (forked from a server with torch preloaded: :func:`_context`),
each joining one torch.distributed world through a TCPStore that the parent hosts on 127.0.0.1
(so the store outlives any rank); ``world.run(fn, *args)`` runs ``fn(ctx, *args)`` on every
rank and returns one :class:`RankResult` per rank. Workers run with OMP_NUM_THREADS=1 and stay
up between jobs: starting them is the expensive part.

A job ends in bounded time: once one rank has answered (or died), the others get ``settle_s``
more before they are declared lost (hung or stopped); ``close`` then kills them. Workers ignore
SIGINT (the parent owns Ctrl-C and ends them), exit quietly when the parent is gone (its pipe
closed, or the worker re-parented), and never print a traceback for a pipe the parent closed.

Under torchrun (RANK, WORLD_SIZE and MASTER_ADDR set) there is no world to spawn:
``join_torchrun`` makes this process that one rank of torchrun's world and returns the same
:class:`WorkerContext` a spawned rank gets, so one job function serves both.

Both paths keep NVLink multicast off (``NO_MULTICAST_ENV``, set with setdefault before any
process group exists): on the shared multi-GPU hosts a program using it can take the host's
GPUs out of service.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback

import torch.distributed as dist

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                    "NVSHMEM_DISABLE_NVLS": "1"}
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


def keep_multicast_off() -> None:
    """setdefault NO_MULTICAST_ENV in this process (inherited by the processes it starts)."""
    for name, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(name, value)


@dataclasses.dataclass
class WorkerContext:
    """What a job function gets on its rank. ``store``: the world's store (None: the default
    world's, looked up by ``Groups.build``); ``local_rank``: the rank on its host (its GPU)."""

    rank: int
    world_size: int
    backend: str
    store: object
    local_rank: int = 0


@dataclasses.dataclass(frozen=True)
class TorchrunEnv:
    """The rank's place in a torchrun world, read from the environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def torchrun_env() -> TorchrunEnv | None:
    """The torchrun world this process belongs to, or None when RANK, WORLD_SIZE and
    MASTER_ADDR are not all set (then nothing was launched for us: spawn a World)."""
    env = os.environ
    if not all(env.get(name) for name in TORCHRUN_VARS):
        return None
    world = int(env["WORLD_SIZE"])
    return TorchrunEnv(rank=int(env["RANK"]), world_size=world,
                       local_rank=int(env.get("LOCAL_RANK", "0")),
                       local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))))


def join_torchrun(backend: str, timeout_s: float) -> WorkerContext:
    """Join torchrun's world as this one rank (env:// rendezvous): gloo, or NCCL on GPU
    LOCAL_RANK with the communicator created now (eagerly, so a broken NCCL setup fails here
    rather than at the step's first collective). Call :func:`leave_torchrun` at the end."""
    import torch

    keep_multicast_off()
    env = torchrun_env()
    assert env is not None, "join_torchrun outside torchrun"
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank)
        kwargs["device_id"] = torch.device("cuda", env.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout, **kwargs)
    return WorkerContext(dist.get_rank(), dist.get_world_size(), backend, None, env.local_rank)


def leave_torchrun(clean: bool = True) -> None:
    """Destroy the default world; skipped when a rank is gone (``clean=False``): tearing down
    NCCL against a dead peer can block, and torchrun ends the ranks anyway."""
    if clean and dist.is_initialized():
        dist.destroy_process_group()


@dataclasses.dataclass
class RankResult:
    rank: int
    value: object = None
    error: BaseException | None = None
    lost: bool = False  # the process died or did not answer in time
    tb: str = ""
    exitcode: int | None = None  # the process's exit code when it died (negative: signal)
    waited_s: float = 0.0  # when it did not answer: how long after the first answer

    @property
    def ok(self) -> bool:
        return self.error is None and not self.lost

    def lost_reason(self) -> str:
        """One line: how this rank was lost."""
        if self.exitcode is not None:
            how = (f"killed by signal {-self.exitcode}" if self.exitcode < 0
                   else f"exited with code {self.exitcode}")
            return f"process {how}"
        if self.waited_s:
            return (f"no answer {self.waited_s:.1f} s after the other ranks answered "
                    f"(hung or stopped)")
        return "process exited or hung"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's (a reused pid: treated as alive)
        return True
    return True


def _exit_with_parent(parent_pid: int) -> None:
    """End this worker quietly once the World's process is gone. The worker's own parent is
    the fork server, which outlives it only briefly: either one gone (the worker re-parented,
    or the World's pid not alive) ends the worker."""
    server = os.getppid()

    def loop() -> None:
        while os.getppid() == server and _pid_alive(parent_pid):
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=loop, daemon=True, name="cpplan-parent-watch").start()


def _worker_main(rank: int, world_size: int, port: int, backend: str, timeout_s: float,
                 conn, parent_pid: int) -> None:
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _exit_with_parent(parent_pid)
    keep_multicast_off()
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    ctx = WorkerContext(rank, world_size, backend, store, local_rank=rank)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # the parent is gone: nobody to report to
        if msg is None:
            break
        fn, args = msg
        try:
            reply = ("ok", fn(ctx, *args), "")
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, typed
            reply = ("err", exc, traceback.format_exc())
        _send(conn, reply)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - shutting down a possibly broken world
        pass


def _send(conn, reply) -> None:
    """Report a job's result to the parent; an exception the pipe cannot carry goes as a
    RuntimeError (the pipe serialises before sending, so a refusal sends nothing). A closed
    pipe means the parent is gone: exit quietly."""
    try:
        try:
            conn.send(reply)
        except (BrokenPipeError, ConnectionError, EOFError):
            raise
        except Exception:  # noqa: BLE001 - a value the pipe cannot carry
            status, exc, tb = reply
            conn.send(("err", RuntimeError(f"{type(exc).__name__}: {exc}"), tb))
    except (BrokenPipeError, ConnectionError, EOFError, OSError):
        os._exit(0)


# What the fork server imports once, so that each rank it forks starts with torch, gloo and the
# simulate / serve job code already loaded (a spawned rank imported them itself: ~2 s of CPU a
# rank, the main cost of a world on a 2-core machine).
PRELOAD = ("torch", "torch.distributed", "cpplan.sim.simulate")


def _context(preload: tuple[str, ...]):
    """multiprocessing's "forkserver" context: ranks are forked from a server process that
    imported nothing but ``preload`` (no threads, no CUDA context). The server starts with the
    first World of this process (OMP_NUM_THREADS=1, the multicast variables set) and serves
    every World after it, with the first World's preload."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


class World:
    """n rank processes joined in one gloo (or NCCL) world; reuse it for many jobs."""

    def __init__(self, world_size: int, *, backend: str = "gloo", timeout_s: float = 120.0,
                 preload: tuple[str, ...] = PRELOAD):
        self.world_size, self.backend = world_size, backend
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        keep_multicast_off()
        ctx = _context(preload)
        self._conns, self._procs = [], []
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # read by the fork server when this starts it
        try:
            for rank in range(world_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, daemon=True,
                                   args=(rank, world_size, self.store.port, backend, timeout_s,
                                         child, os.getpid()))
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        self.alive = [True] * world_size

    def run(self, fn, *args, timeout_s: float = 600.0,
            settle_s: float | None = None) -> list[RankResult]:
        """Run ``fn(ctx, *args)`` on every rank (fn must be importable by the children).
        ``timeout_s`` bounds the job; ``settle_s`` (optional) bounds how long the other ranks
        may take once one rank has answered or died."""
        results: dict[int, RankResult] = {}
        for rank, conn in enumerate(self._conns):
            if self.alive[rank]:
                conn.send((fn, args))
            else:
                results[rank] = RankResult(rank, lost=True)
        deadline = time.monotonic() + timeout_s
        first: float | None = None
        try:
            while len(results) < self.world_size and time.monotonic() < deadline:
                pending = [r for r in range(self.world_size) if r not in results]
                multiprocessing.connection.wait([self._conns[r] for r in pending], timeout=0.05)
                for rank in pending:
                    got = self._poll(rank)
                    if got is not None:
                        results[rank] = got
                        if first is None and settle_s is not None:
                            first = time.monotonic()
                            deadline = min(deadline, first + settle_s)
        except KeyboardInterrupt:  # Ctrl-C / SIGTERM mid-job: close() ends the busy ranks now
            for rank in range(self.world_size):  # rather than after their job
                if rank not in results:
                    self.alive[rank] = False
            raise
        waited = time.monotonic() - first if first is not None else 0.0
        for rank in range(self.world_size):
            if rank not in results:
                self.alive[rank] = False
                results[rank] = RankResult(rank, lost=True, waited_s=waited)
        return [results[r] for r in range(self.world_size)]

    def _poll(self, rank: int) -> RankResult | None:
        """The rank's answer if it has one, a lost result if its process died, else None."""
        conn, proc = self._conns[rank], self._procs[rank]
        if conn.poll(0):
            try:
                status, payload, tb = conn.recv()
            except (EOFError, ConnectionError):
                pass
            else:
                if status == "ok":
                    return RankResult(rank, value=payload)
                return RankResult(rank, error=payload, tb=tb)
        if proc.is_alive():
            return None
        self.alive[rank] = False
        return RankResult(rank, lost=True, exitcode=proc.exitcode)

    def close(self) -> None:
        if not all(self.alive):  # a broken world cannot shut down cleanly: end its ranks
            for proc in self._procs:
                if proc.is_alive():
                    proc.kill()
        for rank, conn in enumerate(self._conns):
            if self.alive[rank]:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
