"""Golden plans under plan-diff regression: every scenario must compile to its committed plan.

On a change the failure message is the `cpplan diff` of the golden plan against the new
compile. If the change is intended, regenerate with `python -m tests.golden.regen` and commit.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cpplan.planner import compile as compile_plan
from cpplan.schemas import (
    config_fingerprint,
    decode_config,
    decode_plan,
    decode_step,
    digest,
    plan_payload,
)
from cpplan.schemas.codec import read_envelope
from tests.golden.regen import golden_dir, report_json

ROOT = Path(__file__).resolve().parents[2]
NAMES = sorted(p.name[: -len(".step.json")] for p in golden_dir().glob("*.step.json"))


def test_corpus_is_large_enough():
    assert len(NAMES) >= 40


@pytest.mark.parametrize("name", NAMES)
def test_plan_matches_golden(name):
    folder = golden_dir()
    step_path, config_path = folder / f"{name}.step.json", folder / f"{name}.config.json"
    golden_path = folder / f"{name}.msgpack"
    plan = compile_plan(decode_config(config_path.read_bytes()),
                        decode_step(step_path.read_bytes()))
    golden = decode_plan(golden_path.read_bytes())
    if plan_payload(plan) != plan_payload(golden):
        proc = subprocess.run(
            [sys.executable, "-m", "cpplan", "diff", str(golden_path), str(step_path),
             "--config", str(config_path)], capture_output=True, text=True, cwd=ROOT)
        pytest.fail(f"plan for {name} changed (regenerate on purpose with "
                    f"`python -m tests.golden.regen`):\n{proc.stdout}{proc.stderr}")
    expected = (folder / f"{name}.inspect.json").read_text()
    if report_json(plan) != expected:
        new, old = json.loads(report_json(plan)), json.loads(expected)
        changed = sorted(k for k in set(new) | set(old) if new.get(k) != old.get(k))
        pytest.fail(f"inspect --json of {name} changed in sections {changed}")


def test_regen_refuses_on_unbumped_schema(tmp_path, monkeypatch):
    import tests.golden.regen as regen

    (tmp_path / "v1").mkdir()
    (tmp_path / "v7").mkdir()
    monkeypatch.setattr(regen, "ROOT", tmp_path)
    with pytest.raises(SystemExit, match="refusing: schema version is 3 but the newest golden "
                                         "folder is v7"):
        regen.check_version_folder()


V1 = sorted(p.name[: -len(".msgpack")] for p in (ROOT / "tests" / "golden" / "v1").glob("*.msgpack"))


@pytest.mark.parametrize("name", V1[::6])
def test_schema_1_files_decode_to_the_plans_compiled_now(name):
    """Schema 2 appended fields with defaults: a plan file of version 1 still opens (same config
    fingerprint) and decodes to the plan its inputs compile to today."""
    folder = ROOT / "tests" / "golden" / "v1"
    old = decode_plan((folder / f"{name}.msgpack").read_bytes())
    plan = compile_plan(decode_config((folder / f"{name}.config.json").read_bytes()),
                        decode_step((folder / f"{name}.step.json").read_bytes()))
    assert old == plan and old.is_sampled is None and old.config.indexer_sources == ()


V2 = sorted(p.name[: -len(".msgpack")] for p in (ROOT / "tests" / "golden" / "v2").glob("*.msgpack"))


def test_schema_2_corpus_is_all_there():
    assert len(V2) >= 50


@pytest.mark.parametrize("name", V2)
def test_schema_3_leaves_every_schema_2_plan_byte_identical(name):
    """Schema 3 added decode ownership, off by default: every plan of the version-2 corpus
    compiles today to the same payload bytes and digest, from a config whose fingerprint is
    unchanged, and the golden of version 3 holds the same payload."""
    folder = ROOT / "tests" / "golden" / "v2"
    data = (folder / f"{name}.msgpack").read_bytes()
    config = decode_config((folder / f"{name}.config.json").read_bytes())
    plan = compile_plan(config, decode_step((folder / f"{name}.step.json").read_bytes()))
    envelope = read_envelope(data)
    assert envelope.schema_version == 2
    assert plan_payload(plan) == envelope.payload
    assert digest(plan) == envelope.digest
    assert config_fingerprint(plan.config) == envelope.config_fingerprint
    assert not plan.config.shard_decode_requests
    v3 = read_envelope((golden_dir() / f"{name}.msgpack").read_bytes())
    assert (v3.payload, v3.digest) == (envelope.payload, envelope.digest)
