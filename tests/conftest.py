"""Suite-wide test setup.

Hypothesis: the derandomized "ci" profile (deadline=None: numba JIT and CI load make wall-time
deadlines flaky) is loaded by default; ``HYPOTHESIS_PROFILE=dev`` explores fresh random examples.
The planner's kernels are JIT-compiled once per session (DESIGN 7, Hypothesis with numba).
"""

import os

import pytest
from hypothesis import HealthCheck, settings

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
def _planner_warmup():
    """JIT the planner once per session, before any test times itself."""
    from cpplan.planner import warmup

    warmup()
