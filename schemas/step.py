"""StepInput: one scheduler step's global batch, the planner's only per-step input.

In memory the requests are columns (cheap to build from an engine's arrays, cheap for the
planner to read). In a file (JSON or msgpack) a step is a list of request objects, the form of
docs/design.md §2.3; ``cpplan.schemas.codec`` converts between the two.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from cpplan.schemas.arrays import Array
from cpplan.schemas.config import ParallelConfig
from cpplan.schemas.errors import StepInputError

MAX_STEP_ID = 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
_COLUMN_DTYPES = (("num_computed_tokens", ("<i8", "<i4")), ("num_scheduled_tokens", ("<i8", "<i4")),
                  ("is_prefilling", ("|u1",)))
_INT_TYPES = {int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
              np.uint64}
_BOOL_TYPES = {bool, np.bool_}


def _as_array(values, name: str, allowed: set) -> np.ndarray:
    """values as a 1-D numpy array, its element types checked when it is a Python sequence
    (numpy would silently turn [1, True] into [1, 1] and ["false"] into [True])."""
    if isinstance(values, np.ndarray):
        arr = values
    else:
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise StepInputError(f"{name} must be a sequence or a numpy array: got "
                                 f"{type(values).__name__}")
        types = set(map(type, values))
        if types - allowed:
            first = next(v for v in values if type(v) not in allowed)
            what = "bools (or 0/1 integers)" if bool in allowed else "integers"
            raise StepInputError(f"{name} must hold {what}: got {type(first).__name__} "
                                 f"{first!r}")
        try:
            arr = np.asarray(values, dtype=np.int64 if bool not in allowed else
                             None if len(values) else np.bool_)
        except OverflowError:
            raise StepInputError(f"{name} must be within int32: got a value beyond int64") \
                from None
    if arr.ndim != 1:
        raise StepInputError(f"{name} must be one-dimensional: got shape {arr.shape}")
    return arr


def _counts(values, name: str) -> np.ndarray:
    arr = _as_array(values, name, _INT_TYPES)
    if arr.dtype.kind not in "iu":
        raise StepInputError(f"{name} must have an integer dtype: got {arr.dtype}")
    if arr.size and (arr.min() < INT32_MIN or arr.max() > INT32_MAX):
        bad = arr[(arr < INT32_MIN) | (arr > INT32_MAX)][0]
        raise StepInputError(f"{name} must be within int32 [{INT32_MIN}, {INT32_MAX}]: got "
                             f"{int(bad)}")
    return arr


def _flags(values, name: str = "is_prefilling") -> np.ndarray:
    arr = _as_array(values, name, _BOOL_TYPES | _INT_TYPES)
    if arr.dtype.kind == "b":
        return arr
    if arr.dtype.kind not in "iu" or (arr.size and (arr.min() < 0 or arr.max() > 1)):
        raise StepInputError(f"{name} must be bools (or 0/1 integers): got dtype "
                             f"{arr.dtype}" + (f" values in [{arr.min()}, {arr.max()}]"
                                               if arr.dtype.kind in "iu" else ""))
    return arr.astype(np.bool_)


class RequestInput(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One request of a step, as it appears in a step file."""

    req_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    is_prefilling: bool
    is_sampled: bool | None = None  # its last scheduled token is sampled (None: not said)


class StepInput(msgspec.Struct, frozen=True, kw_only=True):
    """The global batch in the scheduler's order; request i is named by its index i.

    Columns, each ``[num_requests]``: ``num_computed_tokens`` and ``num_scheduled_tokens``
    int64, ``is_prefilling`` uint8 (0/1), and ``is_sampled`` uint8 (0/1) or None: the requests
    whose last scheduled token this step samples (a decode, a prefill that ends its prompt);
    a step that names them restores those rows only (``restore_sampled``), one that does not
    (None) restores every token. Build with :meth:`build` or :meth:`from_requests`.
    """

    step_id: int
    req_ids: tuple[str, ...]
    num_computed_tokens: Array
    num_scheduled_tokens: Array
    is_prefilling: Array
    is_sampled: Array | None = None

    def __post_init__(self) -> None:
        step_id = self.step_id
        if isinstance(step_id, np.integer):
            step_id = int(step_id)
            msgspec.structs.force_setattr(self, "step_id", step_id)
        if type(step_id) is not int or not 0 <= step_id <= MAX_STEP_ID:
            raise StepInputError(f"step_id must be an integer in [0, {MAX_STEP_ID}]: got "
                                 f"{type(step_id).__name__} {step_id!r}")
        if not isinstance(self.req_ids, tuple):
            raise StepInputError(f"req_ids must be a tuple of str: got "
                                 f"{type(self.req_ids).__name__}")
        bad = [i for i, rid in enumerate(self.req_ids) if type(rid) is not str] \
            if set(map(type, self.req_ids)) - {str} else []
        if bad:
            rid = self.req_ids[bad[0]]
            raise StepInputError(f"req_ids[{bad[0]}] of step {step_id} must be a str: got "
                                 f"{type(rid).__name__} {rid!r}")
        n = len(self.req_ids)
        for name, dtypes in _COLUMN_DTYPES:
            column = getattr(self, name)
            if not isinstance(column, Array) or column.dtype not in dtypes:
                raise StepInputError(f"{name} must be an Array of dtype {' or '.join(dtypes)}: "
                                     f"got {getattr(column, 'dtype', type(column).__name__)}")
            if column.shape != (n,):
                raise StepInputError(
                    f"{name} must have shape ({n},) like req_ids: got {column.shape}"
                )
        sampled = self.is_sampled
        if sampled is not None and (not isinstance(sampled, Array) or sampled.dtype != "|u1"
                                    or sampled.shape != (n,)):
            got = (f"{sampled.dtype} {sampled.shape}" if isinstance(sampled, Array)
                   else type(sampled).__name__)
            raise StepInputError(f"is_sampled must be None or an Array |u1 of shape ({n},) "
                                 f"like req_ids: got {got}")

    @classmethod
    def build(
        cls,
        step_id: int,
        req_ids: Sequence[str],
        num_computed_tokens: Sequence[int] | np.ndarray,
        num_scheduled_tokens: Sequence[int] | np.ndarray,
        is_prefilling: Sequence[bool] | np.ndarray,
        is_sampled: Sequence[bool] | np.ndarray | None = None,
    ) -> StepInput:
        """Columns from sequences or arrays. Token counts must be integers (a float, bool or
        str is refused, never rounded or coerced) within int32; ``is_prefilling`` and
        ``is_sampled`` (optional) must be bools (or 0/1 integers in an integer array). Range
        rules against a config are :meth:`validate`'s."""
        if isinstance(req_ids, (str, bytes)):
            raise StepInputError(f"req_ids must be a sequence of str: got "
                                 f"{type(req_ids).__name__} {req_ids!r}")
        return cls(
            step_id=step_id,
            req_ids=tuple(req_ids),
            num_computed_tokens=Array.of(_counts(num_computed_tokens,
                                                 "num_computed_tokens"), "<i8"),
            num_scheduled_tokens=Array.of(_counts(num_scheduled_tokens,
                                                  "num_scheduled_tokens"), "<i8"),
            is_prefilling=Array.of(_flags(is_prefilling), "|u1"),
            is_sampled=(None if is_sampled is None
                        else Array.of(_flags(is_sampled, "is_sampled"), "|u1")),
        )

    @classmethod
    def from_requests(cls, step_id: int, requests: Sequence[RequestInput]) -> StepInput:
        """Requests that say nothing of sampling count as not sampled, unless none says
        anything (then the step names no sampled rows)."""
        said = any(r.is_sampled is not None for r in requests)
        return cls.build(
            step_id,
            [r.req_id for r in requests],
            [r.num_computed_tokens for r in requests],
            [r.num_scheduled_tokens for r in requests],
            [r.is_prefilling for r in requests],
            [bool(r.is_sampled) for r in requests] if said else None,
        )

    @property
    def num_requests(self) -> int:
        return len(self.req_ids)

    def requests(self) -> list[RequestInput]:
        c = self.num_computed_tokens.np()
        q = self.num_scheduled_tokens.np()
        pre = self.is_prefilling.np()
        sampled = self.is_sampled.np() if self.is_sampled is not None else None
        return [
            RequestInput(
                req_id=rid,
                num_computed_tokens=int(c[i]),
                num_scheduled_tokens=int(q[i]),
                is_prefilling=bool(pre[i]),
                is_sampled=bool(sampled[i]) if sampled is not None else None,
            )
            for i, rid in enumerate(self.req_ids)
        ]

    def validate(self, config: ParallelConfig) -> None:
        """Raise StepInputError naming the first bad request; O(requests), vectorised."""
        c = self.num_computed_tokens.np()
        q = self.num_scheduled_tokens.np()
        pre = self.is_prefilling.np()
        # the extent, each term clamped first: int64 columns near 2**63 would wrap in c + q
        cap = config.max_model_len + 1
        extent = np.minimum(c, cap) + np.minimum(q, cap)
        checks = (
            (c < 0, "num_computed_tokens must be >= 0", c),
            (q < 1, "num_scheduled_tokens must be >= 1", q),
            (pre > 1, "is_prefilling must be 0 or 1", pre),
            (extent > config.max_model_len,
             f"extent num_computed_tokens + num_scheduled_tokens must be <= max_model_len "
             f"{config.max_model_len}", None),
        )
        for bad, rule, values in checks:
            if bad.any():
                i = int(np.argmax(bad))
                got = int(values[i]) if values is not None else int(c[i]) + int(q[i])
                raise StepInputError(
                    f"request {i} ({self.req_ids[i]!r}) of step {self.step_id}: {rule}: "
                    f"got {got}"
                )
        if len(set(self.req_ids)) != len(self.req_ids):
            seen: set[str] = set()
            for i, rid in enumerate(self.req_ids):
                if rid in seen:
                    raise StepInputError(
                        f"request {i} ({rid!r}) of step {self.step_id}: req_id must be unique: "
                        f"got a duplicate"
                    )
                seen.add(rid)
