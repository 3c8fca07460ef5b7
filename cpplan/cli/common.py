"""What several commands share: config flags, loading a plan (or compiling a step), output."""

from __future__ import annotations

import argparse
import sys

from cpplan.schemas import (
    ParallelConfig,
    PlanFormatError,
    StepPlan,
    decode_config,
    decode_plan,
    decode_step,
)
from cpplan.schemas import codec
from cpplan.schemas.files import read_input


INT32_MAX = 2**31 - 1
MAX_LIST_ITEMS = 4096


def bounded_int(low: int, high: int):
    """An argparse type: a decimal integer in [low, high] (one line naming both otherwise);
    ``int()`` alone would let --pcp 9223372036854775808 through to a crash."""
    def parse(text: str) -> int:
        value = _parse_int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer in [{low}, {high}]: "
                                             f"got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def _parse_int(text: str) -> int:
    stripped = text.strip()
    if len(stripped) > 20 or not stripped.lstrip("+-").isdigit() \
            or not stripped.lstrip("+-").isascii():
        raise argparse.ArgumentTypeError(f"expected an integer: got {text[:40]!r}")
    return int(stripped)


_positive_int = bounded_int(0, INT32_MAX)


def _int_list(text: str) -> tuple[int, ...]:
    if not text.strip():
        return ()
    parts = text.split(",")
    if len(parts) > MAX_LIST_ITEMS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_LIST_ITEMS} sizes: got "
                                         f"{len(parts)}")
    try:
        values = tuple(_parse_int(part) for part in parts)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 8,16,32: got {text[:60]!r}") from None
    bad = [v for v in values if not 1 <= v <= INT32_MAX]
    if bad:
        raise argparse.ArgumentTypeError(f"expected sizes in [1, {INT32_MAX}]: got {bad[0]}")
    return values


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """--config FILE, or the topology flags (defaults: ParallelConfig's)."""
    group = parser.add_argument_group("config (a file, or flags over the defaults)")
    group.add_argument("--config", metavar="CONFIG", help="config file (JSON or cpplan msgpack)")
    group.add_argument("--pcp", type=_positive_int, metavar="P", help="PCP size (default 1)")
    group.add_argument("--dcp", type=_positive_int, metavar="W", help="DCP size (default 1)")
    group.add_argument("--interleave", type=_positive_int, metavar="I",
                       help="KV interleave size (default 1)")
    group.add_argument("--block-size", type=_positive_int, metavar="B", help="default 64")
    group.add_argument("--max-model-len", type=_positive_int, metavar="N",
                       help="default 131072")
    group.add_argument("--kv-cache-dtype", choices=["fp8_ds_mla", "bf16"])
    group.add_argument("--cudagraph-sizes", type=_int_list, metavar="8,16,...",
                       help="CUDA-graph token sizes (default none: eager)")
    group.add_argument("--gather-workspace-tokens", type=_positive_int, metavar="N",
                       help="gathered KV rows per chunk (default the minimum)")


_FLAG_FIELDS = {
    "pcp": "pcp_size", "dcp": "dcp_size", "interleave": "interleave_size",
    "block_size": "block_size", "max_model_len": "max_model_len",
    "kv_cache_dtype": "kv_cache_dtype", "cudagraph_sizes": "cudagraph_token_sizes",
    "gather_workspace_tokens": "gather_workspace_tokens",
}


def config_from_args(args: argparse.Namespace) -> ParallelConfig:
    overrides = {field: getattr(args, flag) for flag, field in _FLAG_FIELDS.items()
                 if getattr(args, flag, None) is not None}
    if getattr(args, "config", None):
        if overrides:
            names = ", ".join("--" + f.replace("_", "-") for f in _FLAG_FIELDS
                              if getattr(args, f, None) is not None)
            raise PlanFormatError(f"give --config or topology flags, not both: got {names}")
        return decode_config(read_file(args.config))
    return ParallelConfig(**overrides)


def read_file(path: str) -> bytes:
    """Every CLI input goes through here: a regular file of at most MAX_INPUT_BYTES."""
    return read_input(path)


def is_plan_file(data: bytes) -> bool:
    try:
        return codec.read_envelope(data).kind == codec.KIND_PLAN
    except PlanFormatError:
        return False


def load_plan(path: str, args: argparse.Namespace) -> StepPlan:
    """A plan file, or a step file (JSON/msgpack) compiled with the config from args."""
    data = read_file(path)
    if is_plan_file(data):
        return decode_plan(data)
    try:
        step = decode_step(data)
    except PlanFormatError as exc:
        raise PlanFormatError(f"{path}: neither a plan nor a step file ({exc})") from None
    from cpplan.planner import compile as compile_plan

    return compile_plan(config_from_args(args), step)


def stdout_is_terminal() -> bool:
    return sys.stdout.isatty()
