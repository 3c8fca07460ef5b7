"""The plugin's environment settings and the recorder, without vLLM (the main venv runs these):
every bad value is one ConfigError line naming the variable; unset means nothing happens; a
recorded step reads back with ``cpplan inspect`` and its file name carries the plan's digest,
computed here from the config and step directly."""

from __future__ import annotations

import json

import pytest

from cpplan.planner import compile as compile_plan
from cpplan.schemas import ParallelConfig, StepInput, digest
from cpplan.schemas.errors import ConfigError
from cpplan.vllm import plugin
from cpplan.vllm.record import Recorder
from tests.cli.inprocess import run_cli


def test_unset_or_blank_is_no_plugin():
    assert plugin.settings_from_env({}) is None
    assert plugin.settings_from_env({"CPPLAN_VLLM": "  "}) is None


def test_register_without_the_variable_does_nothing(monkeypatch):
    monkeypatch.delenv("CPPLAN_VLLM", raising=False)
    assert plugin.register() is None and plugin.installed_hook() is None


def test_good_settings():
    s = plugin.settings_from_env({"CPPLAN_VLLM": "record, guard", "CPPLAN_VLLM_DIR": "/tmp/x",
                                  "CPPLAN_VLLM_EXCHANGE": "gloo",
                                  "CPPLAN_VLLM_GUARD_FIELDS": "host",
                                  "CPPLAN_VLLM_TIMEOUT_S": "2.5"})
    assert (s.record, s.guard, s.folder, s.exchange, s.fields, s.timeout_s) == \
        (True, True, "/tmp/x", "gloo", "host", 2.5)
    assert plugin.settings_from_env({"CPPLAN_VLLM": "guard"}).timeout_s == 60.0


@pytest.mark.parametrize("env, words", [
    ({"CPPLAN_VLLM": "recrod"}, "CPPLAN_VLLM='recrod': expected record, guard"),
    ({"CPPLAN_VLLM": ","}, "expected record, guard"),
    ({"CPPLAN_VLLM": "record"}, "set CPPLAN_VLLM_DIR"),
    ({"CPPLAN_VLLM": "guard", "CPPLAN_VLLM_EXCHANGE": "nccl"}, "CPPLAN_VLLM_EXCHANGE='nccl'"),
    ({"CPPLAN_VLLM": "guard", "CPPLAN_VLLM_GUARD_FIELDS": "some"}, "CPPLAN_VLLM_GUARD_FIELDS"),
    ({"CPPLAN_VLLM": "guard", "CPPLAN_VLLM_TIMEOUT_S": "nan"}, "expected a number of seconds"),
    ({"CPPLAN_VLLM": "guard", "CPPLAN_VLLM_TIMEOUT_S": "0"}, "expected a number of seconds"),
    ({"CPPLAN_VLLM": "guard", "CPPLAN_VLLM_TIMEOUT_S": "1e9"}, "expected a number of seconds"),
])
def test_bad_settings_are_one_config_error_line(env, words):
    with pytest.raises(ConfigError) as info:
        plugin.settings_from_env(env)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_a_recorded_step_reads_back_with_its_digest(tmp_path):
    config = ParallelConfig(pcp_size=2, dcp_size=1, shard_decode_requests=True)
    step = StepInput.build(5, ["p100", "p3", "d40", "d17"], [0, 0, 40, 17], [100, 3, 1, 1],
                           [True, True, False, False])
    want = digest(compile_plan(config, step))
    path = Recorder(tmp_path, config).write(step, want)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["config.json", "replay-config.json", f"step-000005-{want.hex()}.msgpack"])
    got = run_cli("inspect", path, "--config", tmp_path / "config.json", "--json")
    assert got.code == 0, got.stderr
    report = json.loads(got.stdout)
    assert report["digest"] == want.hex() and report["step_id"] == 5
    owners = [r.get("owner_rank") for r in report["requests"]]
    assert owners == [None, None, 0, 1]  # ordinal % P over the decodes


def test_a_failed_record_write_is_an_output_error_leaving_nothing(tmp_path):
    from cpplan.schemas.errors import OutputError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    config = ParallelConfig()
    step = StepInput.build(0, ["a"], [0], [4], [True])
    with pytest.raises(OutputError):
        Recorder(blocker / "sub", config).write(step, bytes(16))
    assert [p.name for p in tmp_path.iterdir()] == ["file"]
