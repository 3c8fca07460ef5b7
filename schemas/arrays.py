"""Arrays inside plans: contiguous little-endian bytes plus dtype and shape.

Decoded arrays are read-only views (``np.frombuffer``) over the decoded bytes: no copy, and no
way to mutate a plan through them.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import numpy as np

# The only dtypes a plan carries; index dtypes are explicit.
ALLOWED_DTYPES = ("<i4", "<i8", "|u1")
_ITEMSIZE = {"<i4": 4, "<i8": 8, "|u1": 1}
_NP_DTYPE = {name: np.dtype(name) for name in ALLOWED_DTYPES}
# msgspec checks these in C while decoding; __post_init__ only checks the byte count.
_Dtype = Literal["<i4", "<i8", "|u1"]
_Shape = Annotated[tuple[Annotated[int, msgspec.Meta(ge=0, le=2**40)], ...],
                   msgspec.Meta(max_length=4)]


class Array(msgspec.Struct, frozen=True, array_like=True):
    """An n-d array as ``(dtype, shape, data)``; ``data`` holds ``prod(shape)`` items, C order."""

    dtype: _Dtype
    shape: _Shape
    data: bytes

    def __post_init__(self) -> None:
        expected = _ITEMSIZE.get(self.dtype) if isinstance(self.dtype, str) else None
        if expected is None:
            raise ValueError(f"array dtype must be one of {', '.join(ALLOWED_DTYPES)}: got "
                             f"{self.dtype!r}")
        for dim in self.shape:
            expected *= dim
        if len(self.data) != expected:
            raise ValueError(
                f"array of shape {self.shape} {self.dtype} needs {expected} bytes: "
                f"got {len(self.data)}"
            )

    @classmethod
    def of(cls, values: np.ndarray | list, dtype: str) -> Array:
        """Pack ``values`` as ``dtype`` (one of ALLOWED_DTYPES)."""
        arr = np.ascontiguousarray(values, dtype=np.dtype(dtype))
        return cls(dtype, tuple(int(d) for d in arr.shape), arr.tobytes())

    def np(self) -> np.ndarray:
        """A read-only numpy view of the data (no copy; a bind takes about ten)."""
        flat = np.frombuffer(self.data, _NP_DTYPE[self.dtype])
        return flat if len(self.shape) == 1 else flat.reshape(self.shape)

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1


def i32(values) -> Array:
    return Array.of(values, "<i4")


def i64(values) -> Array:
    return Array.of(values, "<i8")


def u8(values) -> Array:
    return Array.of(values, "|u1")
