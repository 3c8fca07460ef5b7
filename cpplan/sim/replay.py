"""Replay: every rank of one recorded step in one process, against the oracle.

Ranks run as threads; their collectives are in-process tensor operations (:class:`ThreadComm`:
a barrier, then a concatenation or a sum in rank order, so every rank gets identical bytes).
Each rank's cache is rebuilt from coordinates (the tokens before the step), the step runs
through the same StepExecutor as in a real world, and the restored rows are compared with the
single-device oracle. This is how a multi-rank step is debugged on one machine, and how the GPU
path runs on one GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import torch

from cpplan.runtime.executor import LayerCache, StepExecutor
from cpplan.schemas.errors import ConfigError
from cpplan.schemas.names import Group, group_of
from cpplan.schemas.plan import StepPlan
from cpplan.sim import coords
from cpplan.sim.allocator import BlockAllocator
from cpplan.sim.model import prefill_history, request_keys_on, run_step
from cpplan.sim.oracle import max_abs_error, oracle_step

REPLAY_TIMEOUT_S = 120.0  # a rank thread stuck this long fails the replay


class ThreadWorld:
    """Shared state of n rank threads."""

    def __init__(self, size: int, timeout_s: float = 120.0) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout_s)
        self.slots: list = [None] * size

    def exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()
        return values


class ThreadComm:
    """Collectives between rank threads. In the supported topologies a group of more than one
    rank is the whole world (docs/design.md §2.2), so both groups map onto the one ThreadWorld."""

    def __init__(self, world: ThreadWorld, rank: int, pcp_size: int, dcp_size: int) -> None:
        self.world, self.rank = world, rank
        self.sizes = {Group.PCP: pcp_size, Group.DCP: dcp_size}

    def size(self, group: Group) -> int:
        return self.sizes[group_of(group)]

    def all_gather(self, group: str, out: torch.Tensor, inp: torch.Tensor, watch=None) -> None:
        torch.cat(self.world.exchange(self.rank, inp), dim=0, out=out)

    def all_reduce_sum(self, group: str, tensor: torch.Tensor, watch=None) -> None:
        parts = self.world.exchange(self.rank, tensor.clone())
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        tensor.copy_(total)


@dataclasses.dataclass
class ReplayResult:
    step_id: int
    max_abs_err: float
    collectives: int  # issued, all ranks
    tokens: int
    restored: object = None  # rank 0's restored rows (a tensor), for tests


def replay_plan(plan: StepPlan, seed: int, device: str = "cpu", kernels=None,
                step_guard=None, executor_options: dict | None = None,
                sm_scale: float = coords.SIM_SM_SCALE) -> ReplayResult:
    """Run all ranks of ``plan`` as threads on ``device``; compare with the oracle (both at the
    recorded run's ``sm_scale``).
    ``executor_options``: extra keyword arguments of every rank's ``StepExecutor``.
    ``step_guard``: a context-manager factory (e.g. CUDA sync debug mode, which is process-wide)
    entered by the calling thread once every rank has rebuilt its caches and left while no rank
    does anything but bind + the step."""
    check_replayable(plan)
    cfg = plan.config
    world = ThreadWorld(cfg.world_size, REPLAY_TIMEOUT_S)
    phase = threading.Barrier(cfg.world_size + 1, timeout=REPLAY_TIMEOUT_S)
    results: list = [None] * cfg.world_size
    errors: list = []

    def rank_body(rank: int) -> None:
        try:
            results[rank] = _run_rank(plan, seed, device, world, rank, kernels, phase,
                                      {**(executor_options or {}), "sm_scale": sm_scale})
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)
            world.barrier.abort()
            phase.abort()

    threads = [threading.Thread(target=rank_body, args=(r,)) for r in range(cfg.world_size)]
    for th in threads:
        th.start()
    try:
        phase.wait()  # every rank has rebuilt its caches (and synchronised its device)
        with (step_guard() if step_guard is not None else contextlib.nullcontext()):
            phase.wait()  # go
            phase.wait()  # every rank has finished its step
    except threading.BrokenBarrierError:
        pass
    for th in threads:
        th.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if errors:
        raise (real or errors)[0]
    restored = results[0][0]
    expected = oracle_step(plan, seed, device=device, sm_scale=sm_scale)
    return ReplayResult(plan.step_id, max_abs_error(plan, restored, expected),
                        sum(r[1] for r in results),
                        int(plan.num_scheduled_tokens.np().sum()), restored)


def check_replayable(plan: StepPlan) -> None:
    """Replay's model (``model.run_step``) restores every layer's attention output, so the plan's
    ``restore`` width must be num_layers * num_heads * v_head_dim, as in plans recorded by
    ``cpplan simulate``; anything else is refused up front, not as a ledger mismatch."""
    cfg = plan.config
    width = cfg.num_layers * cfg.num_heads * cfg.v_head_dim
    if cfg.hidden_size != width:
        raise ConfigError(
            f"replay runs plans of the simulation model (e.g. from `cpplan simulate --record`): "
            f"hidden_size must be num_layers * num_heads * v_head_dim = {width}: "
            f"got {cfg.hidden_size}")


def _run_rank(plan: StepPlan, seed: int, device: str, world: ThreadWorld, rank: int, kernels,
              phase: threading.Barrier, options: dict):
    cfg = plan.config
    pcp_rank = rank if cfg.pcp_size > 1 else 0
    dcp_rank = rank if cfg.dcp_size > 1 else 0
    comm = ThreadComm(world, rank, cfg.pcp_size, cfg.dcp_size)
    extents = plan.extent()
    # sized for this plan's longest request, not max_model_len (near 2**31 that asked the
    # allocator for terabytes)
    longest = int(extents.max()) if plan.num_requests else 1
    blocks_per_req = max(1, -(-cfg.shard_rows(longest) // cfg.block_size))
    executor = StepExecutor(cfg, sm_scale=options.pop("sm_scale"), pcp_rank=pcp_rank,
                            dcp_rank=dcp_rank, comm=comm, device=device, kernels=kernels, max_tokens=plan.padded_num_tokens,
                            max_requests=max(1, plan.num_requests),
                            max_blocks_per_request=blocks_per_req, **options)
    num_blocks = 1 + plan.num_requests * blocks_per_req
    alloc = BlockAllocator(num_blocks, cfg.block_size, cfg.dcp_size, dcp_rank,
                           cfg.interleave_size)
    for rid, extent in zip(plan.req_ids, extents):
        alloc.ensure(rid, int(extent))
    tables = alloc.table(plan.req_ids, blocks_per_req)
    caches = [LayerCache.empty(cfg, num_blocks, device) for _ in range(cfg.num_layers)]
    prefill_history(executor, plan, caches, tables, seed)
    keys = request_keys_on(plan, executor.device)
    if executor.device.type == "cuda":
        torch.cuda.synchronize(executor.device)  # setup, outside the step under test
    phase.wait()  # setup done
    phase.wait()  # go: the caller's guard is on
    bound = executor.bind(plan, tables, num_blocks)
    restored = run_step(executor, bound, caches, seed, keys)
    phase.wait()  # step done
    return restored, len(bound.ledger)
