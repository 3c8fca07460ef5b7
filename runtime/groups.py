"""All distributed state of a rank in one object, built once from a validated ParallelConfig.

``Groups`` holds the PCP and DCP data groups (NCCL on CUDA, gloo on CPU), a gloo group for
control traffic (the digest check), the rank's coordinates and the timeouts. Build it from an
initialised world (``Groups.build``), from torchrun's environment (``Groups.from_env``), or
adopt the groups an engine already has (``Groups.adopt``).

Rank layout (docs/design.md §2.2): the world has max(P, W) ranks; with W == P the DCP group is the PCP
group; a size-1 group is ``None`` (no collective is planned on it).
"""

from __future__ import annotations

import dataclasses
import datetime
import numbers
import os

import numpy as np
import torch
import torch.distributed as dist

from cpplan.schemas.config import ParallelConfig
from cpplan.schemas.errors import ConfigError
from cpplan.schemas.names import Group, group_of

DEFAULT_CONTROL_TIMEOUT_S = 30.0  # the digest check: a lost rank is named within this
DATA_TIMEOUT_FACTOR = 4  # data collectives: by default this many control timeouts
DEFAULT_TIMEOUT_S = DATA_TIMEOUT_FACTOR * DEFAULT_CONTROL_TIMEOUT_S  # 120 s


MAX_TIMEOUT_S = 7 * 86400.0  # a week: any longer is a unit mistake (and overflows timedelta)


def check_timeouts(where: str, timeout_s, control_timeout_s) -> None:
    """ConfigError (got / expected) unless ``control_timeout_s`` and ``timeout_s`` (None: the
    default) are real numbers of seconds in (0, MAX_TIMEOUT_S]: NaN, negative, infinite or a
    string failed deep in torch (a timedelta, a rendezvous), or silently never timed out."""
    for name, value in (("timeout_s", timeout_s), ("control_timeout_s", control_timeout_s)):
        if value is None and name == "timeout_s":
            continue
        ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) \
            and 0 < float(value) <= MAX_TIMEOUT_S  # False for NaN
        if not ok:
            raise ConfigError(f"{where} {name}: got {value!r}"[:160] + "; expected a number "
                              f"of seconds in (0, {MAX_TIMEOUT_S:.0f}]")


def data_timeout(timeout_s: float | None, control_timeout_s: float) -> float:
    """The data collectives' timeout: the one given, else DATA_TIMEOUT_FACTOR control
    timeouts (a rank stopped after its digest row holds its peers that long, not a fixed
    120 s whatever control timeout the user chose)."""
    return float(timeout_s) if timeout_s is not None else DATA_TIMEOUT_FACTOR * control_timeout_s


@dataclasses.dataclass
class Groups:
    """One rank's view of the PCP x DCP world. ``pcp``/``dcp`` are process groups (None when
    the group has one rank); ``control`` is a gloo group over the same ranks (None in a world of
    one); ``store`` (optional) lets the digest check name a rank that went missing."""

    config: ParallelConfig
    rank: int
    world_size: int
    pcp_rank: int
    dcp_rank: int
    pcp: object | None
    dcp: object | None
    control: object | None
    device: torch.device
    timeout_s: float = DEFAULT_TIMEOUT_S
    control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
    store: object | None = None

    def group(self, name: Group | str):
        """The process group for ``name`` ("pcp"/"dcp"; None when that group has one rank)."""
        return self.pcp if group_of(name) is Group.PCP else self.dcp

    def size(self, name: Group | str) -> int:
        return self.config.pcp_size if group_of(name) is Group.PCP else self.config.dcp_size

    # ------------------------------------------------------------------ constructors
    @classmethod
    def build(cls, config: ParallelConfig, *, device: str | torch.device | None = None,
              timeout_s: float | None = None,
              control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S, store=None) -> Groups:
        """From an initialised default world of exactly ``config.world_size`` ranks; collective
        (every rank calls it). The data groups use the world's backend; their timeout is
        ``timeout_s``, by default four control timeouts (:func:`data_timeout`)."""
        check_timeouts("Groups.build", timeout_s, control_timeout_s)
        timeout_s = data_timeout(timeout_s, control_timeout_s)
        if not isinstance(config, ParallelConfig):
            raise ConfigError(f"Groups.build: got {type(config).__name__}; expected a "
                              "ParallelConfig")
        if not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialised: call Groups.from_env or "
                              "init_process_group first")
        rank, world = dist.get_rank(), dist.get_world_size()
        if world != config.world_size:
            raise ConfigError(f"world size must equal max(pcp_size, dcp_size) = "
                              f"{config.world_size}: got {world}")
        backend = dist.get_backend()
        dev = _checked_device(device, "Groups.build") if device is not None \
            else _default_device(backend, rank)
        data = control = None
        if world > 1:
            ranks = list(range(world))
            data = dist.new_group(ranks, backend=backend,
                                  timeout=datetime.timedelta(seconds=timeout_s))
            control = dist.new_group(ranks, backend="gloo",
                                     timeout=datetime.timedelta(seconds=control_timeout_s))
        if store is None:
            store = _default_store()
        p, w = config.pcp_size, config.dcp_size
        return cls(config=config, rank=rank, world_size=world,
                   pcp_rank=rank if p > 1 else 0, dcp_rank=rank if w > 1 else 0,
                   pcp=data if p > 1 else None, dcp=data if w > 1 else None,
                   control=control, device=dev, timeout_s=timeout_s,
                   control_timeout_s=control_timeout_s, store=store)

    @classmethod
    def from_env(cls, config: ParallelConfig, *, backend: str | None = None,
                 **kwargs) -> Groups:
        """Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): initialise the
        default world if needed, then :meth:`build`."""
        check_timeouts("Groups.from_env", kwargs.get("timeout_s"),
                       kwargs.get("control_timeout_s", DEFAULT_CONTROL_TIMEOUT_S))
        if not dist.is_initialized():
            backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
            timeout = datetime.timedelta(seconds=data_timeout(
                kwargs.get("timeout_s"), kwargs.get("control_timeout_s",
                                                    DEFAULT_CONTROL_TIMEOUT_S)))
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=timeout)
        return cls.build(config, **kwargs)

    @classmethod
    def adopt(cls, config: ParallelConfig, *, pcp_group, dcp_group, control_group,
              device: str | torch.device, store=None, timeout_s: float | None = None,
              control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S) -> Groups:
        """Take an engine's groups (e.g. one PCP/DCP group per tensor-parallel slice). Ranks are
        read from the groups; ``control_group`` must be a gloo group over the ranks whose plans
        must agree (typically the union of the PCP and DCP groups)."""
        check_timeouts("Groups.adopt", timeout_s, control_timeout_s)
        if not isinstance(config, ParallelConfig):
            raise ConfigError(f"Groups.adopt: got {type(config).__name__}; expected a "
                              "ParallelConfig")
        device = _checked_device(device, "Groups.adopt")
        if not dist.is_initialized():
            raise ConfigError("Groups.adopt: torch.distributed is not initialised; expected the "
                              "engine's world, whose groups are adopted")
        pcp_rank = dist.get_rank(pcp_group) if pcp_group is not None else 0
        dcp_rank = dist.get_rank(dcp_group) if dcp_group is not None else 0
        for name, grp, want in (("pcp", pcp_group, config.pcp_size),
                                ("dcp", dcp_group, config.dcp_size)):
            got = dist.get_world_size(grp) if grp is not None else 1
            if got != want:
                raise ConfigError(f"adopted {name} group has {got} ranks: expected {want}")
        timeout_s = data_timeout(timeout_s, control_timeout_s)
        if control_group is None and config.world_size > 1:
            # without it no digest check could run: a rank with another plan would enter the
            # data collectives (NCCL hangs, gloo aborts) instead of stopping every rank
            raise ConfigError(f"Groups.adopt control_group: got None for a world of "
                              f"{config.world_size} ranks; expected a gloo group over the "
                              "ranks whose plans must agree (the digest check runs on it)")
        return cls(config=config, rank=dist.get_rank(), world_size=dist.get_world_size(),
                   pcp_rank=pcp_rank, dcp_rank=dcp_rank, pcp=pcp_group, dcp=dcp_group,
                   control=control_group, device=torch.device(device), timeout_s=timeout_s,
                   control_timeout_s=control_timeout_s, store=store)

    @property
    def control_rank(self) -> int:
        return dist.get_rank(self.control) if self.control is not None else 0

    @property
    def control_size(self) -> int:
        return dist.get_world_size(self.control) if self.control is not None else 1


def _checked_device(device, where: str) -> torch.device:
    from cpplan.runtime.executor import check_device  # the executor's rule, one place

    return check_device(device, where)


def _default_device(backend: str, rank: int) -> torch.device:
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        return torch.device("cuda", local)
    return torch.device("cpu")


def _default_store():
    """The default world's store (used only to name a lost rank); None if torch hides it."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except (RuntimeError, ValueError):
        return None
