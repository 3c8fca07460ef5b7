"""The same plans encode to the same bytes and digests in every process, under any hash seed."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
from cpplan.schemas import digest, encode_plan
from tests.schemas.factories import make_plan
import xxhash
out = []
for seed in range(24):
    plan = make_plan(seed, num_requests=seed * 9)
    out.append([xxhash.xxh3_128_hexdigest(encode_plan(plan)), digest(plan).hex()])
json.dump(out, sys.stdout)
"""


def _run(hash_seed: str) -> list:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(proc.stdout)


def test_bytes_and_digests_identical_across_hash_seeds():
    seeds = ["0", "1", str(random.randrange(2, 2**32))]
    results = [_run(s) for s in seeds]
    assert len(results[0]) == 24
    assert results[0] == results[1] == results[2], f"hash seeds {seeds} disagree"
    assert len({d for _, d in results[0]}) == 24  # distinct plans, distinct digests
