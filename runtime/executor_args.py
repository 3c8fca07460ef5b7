"""The StepExecutor's arguments, checked before anything is allocated (docs/design.md §6.10):
one-line ConfigError with got / expected for a config the runtime's kernels cannot run, a rank
outside its group, a size that is no positive integer, a device this process has not, or a
softmax scale that is not a finite positive number.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from cpplan.schemas.config import ParallelConfig
from cpplan.schemas.errors import ConfigError

MAX_ARENA_WORDS = 1 << 28  # 2 GiB of int64 words per arena: far above any real step's tables
# the dims the runtime's kernels and cache formats take (docs/design.md §4); a config may plan
# other dims, but no kernel here would compute them
RUNTIME_DIMS = {"qk_head_dim": 576, "v_head_dim": 512, "index_head_dim": 128}


def is_int_in_range(value, lo: int, hi: int) -> bool:
    """``value`` is an int or a numpy integer (never a bool, a float or a str) in [lo, hi]: the
    test every size and count the runtime takes from an engine goes through (the executor's
    sizes here, ``num_blocks`` of the caches and of a bind)."""
    return (type(value) is int or isinstance(value, np.integer)) and lo <= value <= hi


def check_executor_args(config, **ints) -> None:
    """A StepExecutor's sizes, before anything is allocated: ConfigError (got / expected) for a
    config this runtime cannot run, a rank outside its group or a size that is not a positive
    integer (a rank out of range would read other ranks' rows of the plan: a wrong answer)."""
    if not isinstance(config, ParallelConfig):
        raise ConfigError(f"config: got {type(config).__name__}; expected a ParallelConfig")
    for name, want in RUNTIME_DIMS.items():
        if getattr(config, name) != want:
            raise ConfigError(f"{name}: got {getattr(config, name)}; expected {want}, the only "
                              "value this runtime's kernels and cache formats take")
    sizes = {"pcp_rank": config.pcp_size, "dcp_rank": config.dcp_size}
    for name, value in ints.items():
        if value is None and name == "max_blocks_per_request":
            continue
        low = 0 if name in sizes else 1
        high = sizes.get(name, 1 << 31) - 1
        if not is_int_in_range(value, low, high):
            want = (f"0..{high} (the config's {name[:3].upper()} size is {high + 1})"
                    if name in sizes else "a positive integer below 2**31")
            raise ConfigError(f"StepExecutor {name}: got {value!r}; expected {want}")


def check_device(device, where: str) -> torch.device:
    """``device`` as a torch.device this process can allocate on: ConfigError (got / expected)
    for what is no device name, or a CUDA device where there is none (torch's own errors
    were an AssertionError "Torch not compiled with CUDA enabled" or a pinned-memory
    RuntimeError)."""
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError, ValueError):
        raise ConfigError(f"{where} device: got {device!r}; expected a torch device ('cpu', "
                          "'cuda', 'cuda:1' or a torch.device)") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"{where} device: got {str(dev)!r}; expected 'cpu': no CUDA "
                              "device here (torch.cuda.is_available() is False)")
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"{where} device: got {str(dev)!r}; expected cuda:0..cuda:"
                              f"{count - 1} ({count} CUDA devices here)")
    return dev


def check_sm_scale(sm_scale) -> float:
    """The attention's softmax scale as a float: ConfigError unless a finite positive number.
    It is the model's own (docs/design.md §4.1: for MLA ``(qk_nope + qk_rope) ** -0.5`` times
    the yarn mscale squared), never 1/sqrt(576): a wrong scale gives no error, only wrong
    tokens."""
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float, np.floating,
                                                                 np.integer)):
        raise ConfigError(f"sm_scale: got {type(sm_scale).__name__} {sm_scale!r}; expected a "
                          "finite positive float (the model's softmax scale)")
    value = float(sm_scale)
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"sm_scale: got {value!r}; expected a finite positive float (the "
                          "model's softmax scale)")
    return value
