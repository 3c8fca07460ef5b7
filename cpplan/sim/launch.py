"""A spawn-based world of rank processes, reusable across jobs (tests, ``cpplan simulate``).

``World(n)`` starts n processes (multiprocessing "spawn"), each joining one torch.distributed
world through a TCPStore that the parent hosts on 127.0.0.1 (so the store outlives any rank);
``world.run(fn, *args)`` runs ``fn(ctx, *args)`` on every rank and returns one
:class:`RankResult` per rank. Workers run with OMP_NUM_THREADS=1 and stay up between jobs:
spawning and importing torch is the expensive part.

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
import os
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

    @property
    def ok(self) -> bool:
        return self.error is None and not self.lost


def _worker_main(rank: int, world_size: int, port: int, backend: str, timeout_s: float,
                 conn) -> None:
    import torch

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
        except EOFError:
            break
        if msg is None:
            break
        fn, args = msg
        try:
            conn.send(("ok", fn(ctx, *args), ""))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, typed
            _send_error(conn, exc, traceback.format_exc())
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - shutting down a possibly broken world
        pass


def _send_error(conn, exc: BaseException, tb: str) -> None:
    """Report a job's exception to the parent, typed when the pipe can carry it (the pipe
    serialises before sending, so a refusal sends nothing), else as a RuntimeError."""
    try:
        conn.send(("err", exc, tb))
    except Exception:  # noqa: BLE001 - an exception type the pipe cannot carry
        conn.send(("err", RuntimeError(f"{type(exc).__name__}: {exc}"), tb))


class World:
    """n rank processes joined in one gloo (or NCCL) world; reuse it for many jobs."""

    def __init__(self, world_size: int, *, backend: str = "gloo", timeout_s: float = 120.0):
        self.world_size, self.backend = world_size, backend
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        keep_multicast_off()
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned children
        try:
            for rank in range(world_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, daemon=True,
                                   args=(rank, world_size, self.store.port, backend, timeout_s,
                                         child))
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

    def run(self, fn, *args, timeout_s: float = 600.0) -> list[RankResult]:
        """Run ``fn(ctx, *args)`` on every rank (fn must be importable by the children)."""
        for rank, conn in enumerate(self._conns):
            if self.alive[rank]:
                conn.send((fn, args))
        deadline = time.monotonic() + timeout_s
        results = []
        for rank, conn in enumerate(self._conns):
            results.append(self._collect(rank, conn, deadline))
        return results

    def _collect(self, rank: int, conn, deadline: float) -> RankResult:
        if not self.alive[rank]:
            return RankResult(rank, lost=True)
        while True:
            if conn.poll(0.05):
                try:
                    status, payload, tb = conn.recv()
                except (EOFError, ConnectionError):
                    break
                if status == "ok":
                    return RankResult(rank, value=payload)
                return RankResult(rank, error=payload, tb=tb)
            if not self._procs[rank].is_alive() or time.monotonic() > deadline:
                break
        self.alive[rank] = False
        return RankResult(rank, lost=True)

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

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
