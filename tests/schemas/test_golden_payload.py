"""Golden payload bytes: the canonical encoding of a few plans is pinned (docs/design.md §6.6).

The cpplan version lives only in the envelope, so these files compare plan payloads (what the
digest covers). The pinned plans come from the raw generator (random tables with no planning
meaning): msgspec round-trips their payload, and the decoder refuses them as inconsistent. A failure means the wire format changed: that needs a schema_version bump.
Regenerate on purpose with:  CPPLAN_REGEN_GOLDEN=1 pytest tests/schemas/test_golden_payload.py
"""

import os
from pathlib import Path

import msgspec
import pytest

from cpplan.schemas import (
    SCHEMA_VERSION,
    PlanFormatError,
    StepPlan,
    decode_plan,
    digest,
    encode_plan,
    plan_payload,
)
from tests.schemas.factories import make_raw_plan

GOLDEN = Path(__file__).parent / "golden"
CASES = {"empty": (0, 0), "small": (1, 5), "medium": (2, 40), "wide": (7, 64)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_payload_bytes_pinned(name):
    seed, n = CASES[name]
    plan = make_raw_plan(seed, num_requests=n)
    path = GOLDEN / f"v{SCHEMA_VERSION}-{name}.payload.msgpack"
    if os.environ.get("CPPLAN_REGEN_GOLDEN") == "1":
        path.write_bytes(plan_payload(plan))
    expected = path.read_bytes()
    assert plan_payload(plan) == expected
    assert digest(msgspec.msgpack.decode(expected, type=StepPlan)) == digest(plan)
    with pytest.raises(PlanFormatError, match="inconsistent plan"):
        decode_plan(encode_plan(plan))
