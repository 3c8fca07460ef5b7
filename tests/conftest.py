"""Suite-wide test setup.

Hypothesis: the derandomized "ci" profile (deadline=None: numba JIT and CI load make wall-time
deadlines flaky) is loaded by default; ``HYPOTHESIS_PROFILE=dev`` explores fresh random examples.
The planner's kernels are JIT-compiled once per session (docs/design.md §7.7, Hypothesis with numba).
"""

import os
import warnings

import pytest
from hypothesis import HealthCheck, settings

# On a failure Hypothesis writes a patch through libcst, whose import emits a DeprecationWarning
# (mypy_extensions.TypedDict) that "warnings are errors" turns into a pytest INTERNALERROR that
# hides the falsifying example. Import it once here, where the warning is expected.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        import hypothesis.extra._patching  # noqa: F401
    except ImportError:
        pass

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session", autouse=True)
def _planner_kernels_compiled():
    """JIT the planner once per session, before any test times itself."""
    from cpplan.planner import compile_planner_kernels

    compile_planner_kernels()


@pytest.fixture
def full_disk(monkeypatch):
    """Every file written through ``os.fdopen`` fails with ENOSPC (a full disk), as the atomic
    writer sees it; closing still works."""
    import errno

    real = os.fdopen

    class FullDisk:
        def __init__(self, fd, mode):
            self.handle = real(fd, mode)

        def __enter__(self):
            return self

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __exit__(self, *exc):
            self.handle.close()

    monkeypatch.setattr(os, "fdopen", FullDisk)
