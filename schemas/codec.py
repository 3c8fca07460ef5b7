"""The one module that encodes and decodes cpplan data (docs/design.md §6.7).

File format (msgpack), for plans, steps and configs alike::

    msgpack([kind, schema_version, cpplan_version, config_fingerprint, payload, digest])
    + checksum   # 16 raw bytes: xxh3_128 over everything before it

``payload`` is the canonical msgpack of the object; ``digest`` = xxh3_128(payload), the value
ranks compare (the cpplan version is outside it). Nothing in a file depends on time, host or
hash seed: the same object always gives the same bytes.

Decoding untrusted bytes raises only :class:`PlanFormatError` (or :class:`SchemaVersionError`),
with one line saying what was wrong. No pickle anywhere.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import Annotated, TypeVar

import msgspec
import xxhash

from cpplan._version import __version__
from cpplan.schemas.config import ParallelConfig
from cpplan.schemas.errors import PlanFormatError, SchemaVersionError
from cpplan.schemas.invariants import check_plan
from cpplan.schemas.plan import StepPlan
from cpplan.schemas.step import StepInput

# 2: ParallelConfig.indexer_sources, Collective.layers, StepPlan.is_sampled / sampled_source
# and the restore_sampled collective (files of version 1 decode with their defaults)
# 3: ParallelConfig.shard_decode_requests and MODE_OWNED (vLLM's decode ownership); a config
# without it encodes, fingerprints and digests exactly as under version 2
SCHEMA_VERSION = 3
KIND_PLAN = "cpplan.plan"
KIND_STEP = "cpplan.step"
KIND_CONFIG = "cpplan.config"
CHECKSUM_BYTES = 16
MAX_FILE_BYTES = 256 * 2**20  # refused before any decoding

_Count = Annotated[int, msgspec.Meta(ge=-(2**53), le=2**53)]


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    """The file wrapper; its layout never changes (new fields only at the end, with defaults)."""

    kind: str
    schema_version: int
    cpplan_version: str
    config_fingerprint: str
    payload: bytes
    digest: bytes


class _RequestFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                   omit_defaults=True):
    req_id: str
    num_computed_tokens: _Count
    num_scheduled_tokens: _Count
    is_prefilling: bool
    is_sampled: bool | None = None  # schema 2; absent in a file that names no sampled rows


class _StepFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A step as a file holds it (docs/design.md §2.3)."""

    step_id: _Count
    requests: list[_RequestFile]


_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_payload_decoders = {
    KIND_PLAN: msgspec.msgpack.Decoder(StepPlan),
    KIND_STEP: msgspec.msgpack.Decoder(_StepFile),
    KIND_CONFIG: msgspec.msgpack.Decoder(ParallelConfig),
}
_step_json_decoder = msgspec.json.Decoder(_StepFile)
_object_json_decoder = msgspec.json.Decoder(dict)
_config_json_decoder = msgspec.json.Decoder(ParallelConfig)

T = TypeVar("T")


def _hash128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


# Per-thread scratch buffers that encoding reuses: a large plan then costs one fresh
# allocation (the returned bytes) instead of three, each of which page-faults in anew.
_scratch = threading.local()


def _encode_scratch(obj, slot: str) -> bytearray:
    buf = getattr(_scratch, slot, None)
    if buf is None:
        buf = bytearray()
        setattr(_scratch, slot, buf)
    _encoder.encode_into(obj, buf)
    return buf


# ---------------------------------------------------------------- digests
def plan_payload(plan: StepPlan) -> bytes:
    """Canonical msgpack bytes of a plan (what the digest covers and goldens pin)."""
    return _encoder.encode(plan)


def digest(plan: StepPlan) -> bytes:
    """128-bit digest of the canonical plan payload: the value every rank compares."""
    return _hash128(_encode_scratch(plan, "payload"))


@functools.lru_cache(maxsize=64)
def config_fingerprint(config: ParallelConfig) -> str:
    """Hex xxh3_128 of the canonical config bytes. A field that schema 2 added is left out
    while it holds its default, so a config that does not use it keeps its schema-1
    fingerprint and files of version 1 still open."""
    if config.indexer_sources:
        return _hash128(_encoder.encode(config)).hex()
    fields = msgspec.to_builtins(config)
    del fields["indexer_sources"]
    return _hash128(_encoder.encode(fields)).hex()


# ---------------------------------------------------------------- envelopes
def _wrap(kind: str, payload, fingerprint: str) -> bytes:
    """File bytes for a payload (bytes or a scratch bytearray, encoded as msgpack bin)."""
    body = _encode_scratch(
        Envelope(kind, SCHEMA_VERSION, __version__, fingerprint, payload, _hash128(payload)),
        "body",
    )
    body += _hash128(body)
    return bytes(body)


_KIND_WORDS = {KIND_PLAN: "a plan", KIND_STEP: "a step", KIND_CONFIG: "a config"}


def _require_bytes(data, what: str = "a cpplan file") -> None:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PlanFormatError(f"expected the bytes of {what}: got {type(data).__name__}")


def _unwrap(data: bytes, kind: str, max_bytes: int) -> Envelope:
    _require_bytes(data)
    if len(data) > max_bytes:
        raise PlanFormatError(f"file too large: got {len(data):,} bytes, limit {max_bytes:,}")
    if len(data) <= CHECKSUM_BYTES:
        raise PlanFormatError(f"not a cpplan file: got only {len(data)} bytes")
    view = memoryview(data)  # no copy of a large body
    body, checksum = view[:-CHECKSUM_BYTES], bytes(view[-CHECKSUM_BYTES:])
    if _hash128(body) != checksum:
        raise PlanFormatError(f"checksum mismatch: {_what_it_looks_like(data)}")
    try:
        env = _envelope_decoder.decode(body)
    except _DECODE_FAILURES as exc:
        raise PlanFormatError(f"not a cpplan file: {_one_line(exc)}") from None
    if env.schema_version > SCHEMA_VERSION:
        what = _KIND_WORDS.get(env.kind, f"a {env.kind[:40]!r}")
        raise SchemaVersionError(
            f"{what} file written by schema version {env.schema_version} (cpplan "
            f"{env.cpplan_version[:40]}), newer than this cpplan reads (1 to "
            f"{SCHEMA_VERSION}): upgrade cpplan"
        )
    if env.schema_version < 1:  # versions start at 1: 0 or less was never written
        raise PlanFormatError(f"invalid schema version: got {env.schema_version}, expected 1 "
                              f"to {SCHEMA_VERSION}")
    if env.kind != kind:
        raise PlanFormatError(f"wrong kind of file: got {env.kind[:40]!r}, expected {kind!r}")
    if _hash128(env.payload) != env.digest:
        raise PlanFormatError("payload digest mismatch: the file is corrupted")
    return env


def _what_it_looks_like(data) -> str:
    """Why a checksum failed, in words a user can act on."""
    head = bytes(data[:1])
    if head == b"{" or head[:1].isspace() or bytes(data[:3]) == UTF8_BOM:
        return "the file is JSON, not a cpplan msgpack file (a step or config JSON goes where " \
               "a step or config is expected)"
    if head != b"\x96":  # every cpplan file starts with the 6-item envelope array
        return "not a cpplan file"
    return "the file is truncated or corrupted"


def _decode_payload(env: Envelope):
    try:
        return _payload_decoders[env.kind].decode(env.payload)
    except _DECODE_FAILURES as exc:
        raise PlanFormatError(f"invalid {env.kind} payload: {_one_line(exc)}") from None


# What msgspec may raise on hostile bytes: its own errors, and a UnicodeDecodeError (a
# ValueError) for invalid UTF-8 in strings; RecursionError for absurd nesting.
_DECODE_FAILURES = (msgspec.MsgspecError, ValueError, RecursionError, OverflowError)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


# ---------------------------------------------------------------- plans
def encode_plan(plan: StepPlan) -> bytes:
    """A plan file's bytes; canonical (same plan, same bytes, any process)."""
    return _wrap(KIND_PLAN, _encode_scratch(plan, "payload"), config_fingerprint(plan.config))


def decode_plan(data: bytes, *, max_bytes: int = MAX_FILE_BYTES) -> StepPlan:
    env = _unwrap(data, KIND_PLAN, max_bytes)
    plan = _decode_payload(env)
    if config_fingerprint(plan.config) != env.config_fingerprint:
        raise PlanFormatError(f"config fingerprint does not match the plan's config: got "
                              f"{env.config_fingerprint[:40]!r}, expected "
                              f"{config_fingerprint(plan.config)!r}")
    check_plan(plan)  # checksum-valid is not consistent: refuse what inspect/runtime can't use
    return plan


def read_envelope(data: bytes, *, max_bytes: int = MAX_FILE_BYTES) -> Envelope:
    """Check a file of any kind and return its envelope (kind, versions, digest)."""
    _require_bytes(data)
    return _unwrap(data, file_kind(data) or KIND_PLAN, max_bytes)


def file_kind(data) -> str | None:
    """The kind an envelope at the start of ``data`` names, its checksum not verified: a probe
    to choose the decoder (which checks everything), None when ``data`` holds no envelope."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) <= CHECKSUM_BYTES \
            or len(data) > MAX_FILE_BYTES:
        return None
    try:
        kind = _envelope_decoder.decode(memoryview(data)[:-CHECKSUM_BYTES]).kind
    except _DECODE_FAILURES:
        return None
    return kind


# ---------------------------------------------------------------- JSON
UTF8_BOM = b"\xef\xbb\xbf"


def _strip_bom(data):
    """A UTF-8 byte order mark (as some Windows editors write) is accepted and dropped."""
    if isinstance(data, (bytes, bytearray, memoryview)) and bytes(data[:3]) == UTF8_BOM:
        return bytes(data[3:])
    return data


def _looks_like_json(data) -> bool:
    head = bytes(data[:1]) if isinstance(data, (bytes, bytearray, memoryview)) else b""
    return head[:1].isspace() or head == b"{"


def _decode_json(decoder, data, what: str):
    """Typed JSON decode; a key given twice in one object is refused (msgspec would keep one
    of them silently), checked by the standard library once msgspec has accepted the text."""
    try:
        obj = decoder.decode(data)
    except _DECODE_FAILURES as exc:
        raise PlanFormatError(f"invalid {what} JSON: {_one_line(exc)}") from None
    try:
        json.loads(bytes(data), object_pairs_hook=_refuse_duplicates)
    except _DuplicateKey as exc:
        raise PlanFormatError(f"invalid {what} JSON: key {exc.args[0]!r} given twice in one "
                              f"object") from None
    except (ValueError, RecursionError) as exc:
        raise PlanFormatError(f"invalid {what} JSON: {_one_line(exc)}") from None
    return obj


class _DuplicateKey(Exception):
    pass


def _refuse_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        seen = set()
        for k in keys:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return dict(pairs)


def decode_json_object(data, what: str, max_bytes: int = 2**20) -> dict:
    """A small JSON object (e.g. ``replay.json``): BOM accepted, duplicate keys refused; any
    failure is a PlanFormatError naming ``what``."""
    _require_bytes(data, f"{what} (JSON)")
    if len(data) > max_bytes:
        raise PlanFormatError(f"{what}: file too large: got {len(data):,} bytes, limit "
                              f"{max_bytes:,}")
    obj = _decode_json(_object_json_decoder, _strip_bom(data), what)
    return obj


# ---------------------------------------------------------------- steps
def _step_from_file(f: _StepFile) -> StepInput:
    try:
        said = any(r.is_sampled is not None for r in f.requests)
        return StepInput.build(
            f.step_id,
            [r.req_id for r in f.requests],
            [r.num_computed_tokens for r in f.requests],
            [r.num_scheduled_tokens for r in f.requests],
            [r.is_prefilling for r in f.requests],
            [bool(r.is_sampled) for r in f.requests] if said else None,
        )
    except (ValueError, OverflowError) as exc:
        raise PlanFormatError(f"invalid step: {_one_line(exc)}") from None


def _step_to_file(step: StepInput) -> _StepFile:
    return _StepFile(
        step_id=step.step_id,
        requests=[_RequestFile(**msgspec.structs.asdict(r)) for r in step.requests()],
    )


def encode_step(step: StepInput) -> bytes:
    return _wrap(KIND_STEP, _encoder.encode(_step_to_file(step)), "")


def encode_step_json(step: StepInput) -> bytes:
    return msgspec.json.format(_json_encoder.encode(_step_to_file(step)), indent=1)


def decode_step(data: bytes, *, max_bytes: int = MAX_FILE_BYTES) -> StepInput:
    """A step from a cpplan step file, a bare msgpack map or JSON (detected by content)."""
    if isinstance(data, (bytes, bytearray, memoryview)) and len(data) > max_bytes:
        raise PlanFormatError(f"file too large: got {len(data):,} bytes, limit {max_bytes:,}")
    data = _strip_bom(data)
    if _looks_like_json(data):
        return _step_from_file(_decode_json(_step_json_decoder, data, "step"))
    head = bytes(data[:1]) if isinstance(data, (bytes, bytearray, memoryview)) else b""
    if head and 0x80 <= head[0] <= 0x8F or head in (b"\xde", b"\xdf"):  # a bare msgpack map
        try:
            return _step_from_file(_payload_decoders[KIND_STEP].decode(data))
        except _DECODE_FAILURES as exc:
            raise PlanFormatError(f"invalid step msgpack: {_one_line(exc)}") from None
    return _step_from_file(_decode_payload(_unwrap(data, KIND_STEP, max_bytes)))


# ---------------------------------------------------------------- configs
def encode_config(config: ParallelConfig) -> bytes:
    return _wrap(KIND_CONFIG, _encoder.encode(config), config_fingerprint(config))


def encode_config_json(config: ParallelConfig) -> bytes:
    return msgspec.json.format(_json_encoder.encode(config), indent=1)


def decode_config(data: bytes, *, max_bytes: int = MAX_FILE_BYTES) -> ParallelConfig:
    """A config from JSON or a cpplan config file. Rule violations surface as PlanFormatError
    here (the file is not a valid config); build ParallelConfig directly to get ConfigError."""
    if isinstance(data, (bytes, bytearray, memoryview)) and len(data) > max_bytes:
        raise PlanFormatError(f"file too large: got {len(data):,} bytes, limit {max_bytes:,}")
    data = _strip_bom(data)
    if _looks_like_json(data):
        return _decode_json(_config_json_decoder, data, "config")
    return _decode_payload(_unwrap(data, KIND_CONFIG, max_bytes))


def to_builtins(obj) -> object:
    """Plain Python data (dicts, lists, str, int) for JSON reports."""
    return msgspec.to_builtins(obj)
