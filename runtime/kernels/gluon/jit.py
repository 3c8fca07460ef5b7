"""What the Gluon kernels share: ``gluon.jit`` with arguments left unspecialised."""

from __future__ import annotations

from triton.experimental import gluon


def jit_unspecialised(*names):
    """``gluon.jit`` with ``names`` left unspecialised (a step-varying int or stride: each new
    "== 1" / "multiple of 16" class would be a compile; bench/jit_variants.py); plain
    ``gluon.jit`` where this Triton's gluon.jit takes no ``do_not_specialize``."""
    try:
        return gluon.jit(do_not_specialize=list(names))
    except TypeError:
        return gluon.jit
