"""StepInput: one scheduler step's global batch, the planner's only per-step input.

In memory the requests are columns (cheap to build from an engine's arrays, cheap for the
planner to read). In a file (JSON or msgpack) a step is a list of request objects, the form of
DESIGN.md section 2; ``cpplan.schemas.codec`` converts between the two.
"""

from __future__ import annotations

from typing import Sequence

import msgspec
import numpy as np

from cpplan.schemas.arrays import Array
from cpplan.schemas.config import ParallelConfig
from cpplan.schemas.errors import StepInputError


class RequestInput(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One request of a step, as it appears in a step file."""

    req_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    is_prefilling: bool


class StepInput(msgspec.Struct, frozen=True, kw_only=True):
    """The global batch in the scheduler's order; request i is named by its index i.

    Columns, each ``[num_requests]``: ``num_computed_tokens`` and ``num_scheduled_tokens``
    int64, ``is_prefilling`` uint8 (0/1). Build with :meth:`build` or :meth:`from_requests`.
    """

    step_id: int
    req_ids: tuple[str, ...]
    num_computed_tokens: Array
    num_scheduled_tokens: Array
    is_prefilling: Array

    def __post_init__(self) -> None:
        n = len(self.req_ids)
        for name in ("num_computed_tokens", "num_scheduled_tokens", "is_prefilling"):
            column = getattr(self, name)
            if column.shape != (n,):
                raise StepInputError(
                    f"{name} must have shape ({n},) like req_ids: got {column.shape}"
                )

    @classmethod
    def build(
        cls,
        step_id: int,
        req_ids: Sequence[str],
        num_computed_tokens: Sequence[int] | np.ndarray,
        num_scheduled_tokens: Sequence[int] | np.ndarray,
        is_prefilling: Sequence[bool] | np.ndarray,
    ) -> "StepInput":
        return cls(
            step_id=int(step_id),
            req_ids=tuple(req_ids),
            num_computed_tokens=Array.of(num_computed_tokens, "<i8"),
            num_scheduled_tokens=Array.of(num_scheduled_tokens, "<i8"),
            is_prefilling=Array.of(np.asarray(is_prefilling, dtype=bool), "|u1"),
        )

    @classmethod
    def from_requests(cls, step_id: int, requests: Sequence[RequestInput]) -> "StepInput":
        return cls.build(
            step_id,
            [r.req_id for r in requests],
            [r.num_computed_tokens for r in requests],
            [r.num_scheduled_tokens for r in requests],
            [r.is_prefilling for r in requests],
        )

    @property
    def num_requests(self) -> int:
        return len(self.req_ids)

    def requests(self) -> list[RequestInput]:
        c = self.num_computed_tokens.np()
        q = self.num_scheduled_tokens.np()
        pre = self.is_prefilling.np()
        return [
            RequestInput(
                req_id=rid,
                num_computed_tokens=int(c[i]),
                num_scheduled_tokens=int(q[i]),
                is_prefilling=bool(pre[i]),
            )
            for i, rid in enumerate(self.req_ids)
        ]

    def validate(self, config: ParallelConfig) -> None:
        """Raise StepInputError naming the first bad request; O(requests), vectorised."""
        c = self.num_computed_tokens.np()
        q = self.num_scheduled_tokens.np()
        pre = self.is_prefilling.np()
        checks = (
            (c < 0, "num_computed_tokens must be >= 0", c),
            (q < 1, "num_scheduled_tokens must be >= 1", q),
            (pre > 1, "is_prefilling must be 0 or 1", pre),
            (c + q > config.max_model_len,
             f"extent num_computed_tokens + num_scheduled_tokens must be <= max_model_len "
             f"{config.max_model_len}", c + q),
        )
        for bad, rule, values in checks:
            if bad.any():
                i = int(np.argmax(bad))
                raise StepInputError(
                    f"request {i} ({self.req_ids[i]!r}) of step {self.step_id}: {rule}: "
                    f"got {int(values[i])}"
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
