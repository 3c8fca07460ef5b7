"""No hidden state: another process, under another hash seed, compiling a corpus of steps (after
a JSON round trip) in shuffled order reproduces every digest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np

from cpplan import planner
from cpplan.schemas import ParallelConfig, StepInput, digest, encode_config_json, encode_step_json

_CHILD = textwrap.dedent("""
    import json, random, sys, pathlib
    from cpplan import planner
    from cpplan.schemas import decode_config, decode_step, digest
    root = pathlib.Path(sys.argv[1])
    names = sorted(p.name.split(".")[0] for p in root.glob("*.step.json"))
    random.Random(7).shuffle(names)
    out = {}
    for name in names:
        config = decode_config((root / f"{name}.config.json").read_bytes())
        step = decode_step((root / f"{name}.step.json").read_bytes())
        out[name] = digest(planner.compile(config, step)).hex()
    print(json.dumps(out))
""")


def _corpus() -> list[tuple[ParallelConfig, StepInput]]:
    rng = np.random.default_rng(2024)
    topologies = [(1, 1), (2, 1), (4, 1), (1, 4), (2, 2), (4, 4), (8, 8), (3, 3)]
    out = []
    for k in range(40):
        p, w = topologies[k % len(topologies)]
        config = ParallelConfig(pcp_size=p, dcp_size=w, interleave_size=[1, 2, 16, 64][k % 4],
                                max_model_len=65536,
                                cudagraph_token_sizes=(8, 64, 512) if k % 3 == 0 else ())
        n = int(rng.integers(0, 120))
        pre = rng.random(n) < 0.3
        q = np.where(pre, rng.integers(1, 4000, n), rng.integers(1, 3, n))
        c = rng.integers(0, 60000, n)
        ids = [f"req-{k}-{i}-{rng.integers(1 << 30)}" for i in range(n)]
        out.append((config, StepInput.build(k, ids, c, q, pre)))
    return out


def test_subprocess_reproduces_digests(tmp_path):
    expected = {}
    for k, (config, step) in enumerate(_corpus()):
        name = f"s{k:03d}"
        (tmp_path / f"{name}.config.json").write_bytes(encode_config_json(config))
        (tmp_path / f"{name}.step.json").write_bytes(encode_step_json(step))
        expected[name] = digest(planner.compile(config, step)).hex()
    env = dict(os.environ, PYTHONHASHSEED="12345")
    result = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    got = json.loads(result.stdout)
    assert got == expected
    assert len(set(expected.values())) == len(expected)  # the corpus is not degenerate
