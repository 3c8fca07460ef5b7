"""Running `cpplan` in this process (fast: no interpreter start-up), and resealing mutated plan
files (payload mutated, then digest, fingerprint and checksum recomputed so the file passes
every integrity check and reaches the plan's invariant checks)."""

from __future__ import annotations

import contextlib
import io
import time
from dataclasses import dataclass

import msgspec
import xxhash

from cpplan.cli import main
from cpplan.schemas import codec


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str
    seconds: float


def run_cli(*argv) -> Result:
    """`cpplan ARGV` in-process; an exception escaping main is reported as a traceback."""
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException as exc:  # noqa: BLE001 - what the user would see
            err.write(f"Traceback (most recent call last):\n  {type(exc).__name__}: {exc}\n")
            code = 99
    return Result(code, out.getvalue(), err.getvalue(), time.monotonic() - t0)


def payload_of(data: bytes):
    """The plan payload of a plan file, as plain msgpack data (dicts keep field order)."""
    env = msgspec.msgpack.decode(data[:-codec.CHECKSUM_BYTES], type=codec.Envelope)
    return msgspec.msgpack.decode(env.payload)


def reseal(payload, kind: str = codec.KIND_PLAN) -> bytes:
    """A file around ``payload`` with a correct digest, config fingerprint and checksum."""
    body = msgspec.msgpack.encode(payload)
    config = payload.get("config") if isinstance(payload, dict) else None
    if isinstance(config, dict) and not config.get("indexer_sources", True):
        config = {k: v for k, v in config.items() if k != "indexer_sources"}  # codec's rule
    fingerprint = xxhash.xxh3_128_hexdigest(msgspec.msgpack.encode(config)) \
        if isinstance(config, dict) else ""
    env = codec.Envelope(kind, codec.SCHEMA_VERSION, "0", fingerprint, body,
                         xxhash.xxh3_128_digest(body))
    head = msgspec.msgpack.encode(env)
    return head + xxhash.xxh3_128_digest(head)
