"""The prompts file of ``cpplan generate`` as a hostile user writes it: a FIFO, a device, a
file over the cap, nesting past the recursion limit, a key given twice. Each is one typed line
naming the file (exit 2 through the CLI), never a hang, an unbounded read or a traceback."""

import os

import pytest

from cpplan.schemas.errors import ConfigError, InputFileError
from cpplan.serve import prompts as prompts_mod
from cpplan.serve.prompts import read_prompts
from tests.fifo import raised_without_blocking


def _read(path):
    return read_prompts(str(path), max_new_tokens=4)


def test_a_fifo_is_refused_at_once(tmp_path):
    fifo = tmp_path / "p.jsonl"
    os.mkfifo(fifo)
    exc = raised_without_blocking(lambda: _read(fifo), fifo)
    assert isinstance(exc, InputFileError)
    assert str(exc) == f"cannot read {fifo}: it is a FIFO; expected a regular file"


def test_a_device_is_refused_without_reading_it():
    with pytest.raises(InputFileError) as err:
        _read("/dev/zero")
    assert str(err.value) == "cannot read /dev/zero: it is a device; expected a regular file"


def test_a_file_over_the_cap_is_refused_by_its_size(tmp_path, monkeypatch):
    monkeypatch.setattr(prompts_mod, "MAX_PROMPTS_BYTES", 100)
    path = tmp_path / "p.jsonl"
    text = '{"prompt_token_ids": [' + ", ".join(["1"] * 40) + "]}\n"
    path.write_text(text)
    with pytest.raises(InputFileError) as err:
        _read(path)
    assert str(err.value) == f"{path}: file too large: got {len(text)} bytes, limit 100"


def test_the_cap_admits_a_file_of_its_size(tmp_path, monkeypatch):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt_token_ids": [1, 2]}\n')
    monkeypatch.setattr(prompts_mod, "MAX_PROMPTS_BYTES", path.stat().st_size)
    (prompt,) = _read(path)
    assert (prompt.id, prompt.token_ids, prompt.max_new_tokens) == ("a", (1, 2), 4)


@pytest.mark.parametrize("nest", ["[" * 100_000, '{"a": ' * 100_000])
def test_nesting_past_the_recursion_limit_is_one_line(tmp_path, nest):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt_token_ids": [1]}\n{"prompt_token_ids": [1], "x": ' + nest + "\n")
    with pytest.raises(ConfigError) as err:
        _read(path)
    assert str(err.value) == f"{path} line 2: not a JSON object (nested too deeply)"


def test_a_key_given_twice_is_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt_token_ids": [1], "prompt_token_ids": [2]}\n')
    with pytest.raises(ConfigError) as err:
        _read(path)
    assert str(err.value) == (f"{path} line 1: not a JSON object (key 'prompt_token_ids' "
                              "given twice in one object)")


@pytest.mark.slow  # imports transformers (about 4 s)
def test_generate_refuses_a_fifo_in_one_line(tmp_path):
    pytest.importorskip("transformers")
    from tests.cli.inprocess import run_cli

    fifo = tmp_path / "p.jsonl"
    os.mkfifo(fifo)
    box = {}
    exc = raised_without_blocking(lambda: box.setdefault("res", run_cli(
        "generate", "--prompts", fifo, "--max-new-tokens", 2)), fifo, seconds=60.0)
    assert exc is None
    res = box["res"]
    assert (res.code, res.stdout) == (2, "")
    assert res.stderr == (f"cpplan generate: error: cannot read {fifo}: it is a FIFO; "
                          "expected a regular file\n")
