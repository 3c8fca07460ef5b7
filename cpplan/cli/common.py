"""What several commands share: config flags, paths, loading a plan (or compiling a step),
output. Input errors name the file they concern (docs/design.md §6.10)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from cpplan.schemas import (
    SCHEMA_VERSION,
    ConfigError,
    ParallelConfig,
    PlanFormatError,
    StepPlan,
    codec,
    decode_config,
    decode_plan,
    decode_step,
)
from cpplan.schemas.errors import InputFileError
from cpplan.schemas.files import read_input

INT32_MAX = 2**31 - 1
MAX_PARALLEL_SIZE = 1024  # ParallelConfig's limit on pcp_size / dcp_size
MAX_LIST_ITEMS = 4096
PATHS_NOTE = "Paths are files: '-' (stdin/stdout) is not supported; write ./- for a file named '-'."


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


_size = bounded_int(1, INT32_MAX)  # ParallelConfig's sizes are in [1, 2**31 - 1]
_parallel_size = bounded_int(1, MAX_PARALLEL_SIZE)


def path_arg(text: str) -> str:
    """An argparse type for a file path: '-' is refused (it would be read or written as a
    file named '-', not as stdin/stdout), and so is an empty path."""
    if text == "-":
        raise argparse.ArgumentTypeError("'-' (stdin/stdout) is not supported: give a file path "
                                         "(./- for a file named '-')")
    if not text:
        raise argparse.ArgumentTypeError("expected a file path: got ''")
    return text


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
    group.add_argument("--config", type=path_arg, metavar="CONFIG",
                       help="config file (JSON or cpplan msgpack)")
    group.add_argument("--pcp", type=_parallel_size, metavar="P", help="PCP size (default 1)")
    group.add_argument("--dcp", type=_parallel_size, metavar="W", help="DCP size (default 1)")
    group.add_argument("--interleave", type=_size, metavar="I",
                       help="KV interleave size (default 1)")
    group.add_argument("--block-size", type=_size, metavar="B", help="default 64")
    group.add_argument("--max-model-len", type=_size, metavar="N",
                       help="default 131072")
    group.add_argument("--kv-cache-dtype", choices=["fp8_ds_mla", "bf16"])
    group.add_argument("--cudagraph-sizes", type=_int_list, metavar="8,16,...",
                       help="CUDA-graph token sizes (default none: eager)")
    group.add_argument("--gather-workspace-tokens", type=bounded_int(0, INT32_MAX), metavar="N",
                       help="gathered KV rows per chunk (default, or 0: the minimum)")


_FLAG_FIELDS = {
    "pcp": "pcp_size", "dcp": "dcp_size", "interleave": "interleave_size",
    "block_size": "block_size", "max_model_len": "max_model_len",
    "kv_cache_dtype": "kv_cache_dtype", "cudagraph_sizes": "cudagraph_token_sizes",
    "gather_workspace_tokens": "gather_workspace_tokens",
}


def config_flags_given(args: argparse.Namespace) -> list[str]:
    """The config flags on the command line (--config first), as the user spells them."""
    names = ["--config"] if getattr(args, "config", None) is not None else []
    return names + ["--" + flag.replace("_", "-") for flag in _FLAG_FIELDS
                    if getattr(args, flag, None) is not None]


def config_from_args(args: argparse.Namespace) -> ParallelConfig:
    overrides = {field: getattr(args, flag) for flag, field in _FLAG_FIELDS.items()
                 if getattr(args, flag, None) is not None}
    if getattr(args, "config", None):
        if overrides:
            names = ", ".join(config_flags_given(args)[1:])
            raise PlanFormatError(f"give --config or topology flags, not both: got {names}")
        return named(args.config, decode_config, read_file(args.config))
    return ParallelConfig(**overrides)


def read_file(path: str) -> bytes:
    """Every CLI input goes through here: a regular file of at most MAX_INPUT_BYTES."""
    return read_input(path)


def named(path: str, decode, data: bytes):
    """``decode(data)``, its decoding errors (same type) prefixed with the file's path."""
    try:
        return decode(data)
    except InputFileError:
        raise
    except PlanFormatError as exc:
        raise type(exc)(f"{path}: {exc}") from None


@dataclass(frozen=True)
class Loaded:
    """A plan as a command got it: from a plan file (``schema_version`` the file's) or compiled
    from a step file (the version this cpplan writes)."""

    path: str
    plan: StepPlan
    schema_version: int


def load_plans(paths: list[str], args: argparse.Namespace) -> list[Loaded]:
    """Each path's plan: a plan file as it is, a step file (JSON or msgpack) compiled with the
    config from args. Config flags where no input is a step file are refused: a plan carries
    its own config, and the flags would be silently ignored."""
    datas = [read_file(path) for path in paths]
    kinds = [codec.file_kind(data) for data in datas]
    flags = config_flags_given(args)
    if flags and all(kind == codec.KIND_PLAN for kind in kinds):
        files = " and ".join(paths) + (" are plan files, which carry their config"
                                       if len(paths) > 1 else " is a plan file, which carries "
                                       "its config")
        raise ConfigError(f"{', '.join(flags)} appl{'y' if len(flags) > 1 else 'ies'} to step "
                          f"files only: {files}; drop the flag")
    config = None
    loaded = []
    for path, data, kind in zip(paths, datas, kinds):
        if kind == codec.KIND_PLAN:
            plan = named(path, decode_plan, data)
            version = codec.read_envelope(data).schema_version
            loaded.append(Loaded(path, plan, version))
            continue
        step = _decode_step(path, data, kind)
        from cpplan.planner import compile as compile_plan

        if config is None:
            config = config_from_args(args)
        loaded.append(Loaded(path, compile_plan(config, step), SCHEMA_VERSION))
    return loaded


def _decode_step(path: str, data: bytes, kind: str | None):
    if kind == codec.KIND_STEP:  # a cpplan step file: its own errors, named
        return named(path, decode_step, data)
    try:
        return decode_step(data)
    except PlanFormatError as exc:
        raise PlanFormatError(f"{path}: neither a plan nor a step file ({exc})") from None


def stdout_is_terminal() -> bool:
    return sys.stdout.isatty()
