"""`cpplan generate`'s progress on stderr: nothing per step off a terminal unless --verbose,
nothing at all with --quiet, --verbose and --quiet exclusive; the terminal's live line
(cpplan.serve.engine.live_line) against figures computed here."""

import io
import os
import re

import pytest

pytest.importorskip("transformers")

from cpplan.serve.engine import live_line  # noqa: E402
from cpplan.serve.scheduler import Request  # noqa: E402
from tests.cli.inprocess import run_cli  # noqa: E402

ARGS = ("generate", "--model", "tiny-deepseek-v32", "--max-new-tokens", "3")
STEP = re.compile(r"^step +\d+:")


def _steps(stderr):
    return [x for x in stderr.splitlines() if STEP.match(x)]


@pytest.mark.parametrize("flag", [None, "--verbose", "--quiet"])
def test_per_step_lines_only_with_verbose(flag):
    res = run_cli(*ARGS, *([flag] if flag else []))
    assert res.code == 0, res.stderr
    steps = _steps(res.stderr)
    if flag == "--verbose":
        summary = res.stdout.strip().splitlines()[-1]
        assert len(steps) == int(re.search(r"in (\d+) steps", summary).group(1)) > 1
    else:
        assert steps == [] and "\r" not in res.stderr  # stderr is not a terminal here
    if flag == "--quiet":
        assert "cpplan generate:" not in res.stderr
    else:
        assert res.stderr.count("cpplan generate: tiny-deepseek-v32 P=1 W=1") == 1


def test_verbose_and_quiet_are_exclusive():
    res = run_cli(*ARGS, "--verbose", "--quiet")
    assert res.code == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "not allowed with argument" in res.stderr


def test_the_live_line_counts_rate_and_eta(monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback: os.terminal_size((40, 24)))
    reqs = [Request(0, [1, 2], 10, output=[5] * 10, finish_step=3),
            Request(1, [1], 8, output=[5] * 2), Request(2, [3], 6)]
    out = io.StringIO()
    line = live_line(reqs, 1, 4.0, out=out)
    # 12 new tokens in 4 s: 3 a second; 6 + 6 left at that rate: 4 s
    assert line == "1/3 requests done, 12 tokens, 3.0 tokens/s, ETA 4 s"
    assert out.getvalue() == "\r" + line[:39]  # cut to the width: never wraps
    out = io.StringIO()
    live_line(reqs, 3, 4.0, end=True, out=out)
    assert out.getvalue().endswith("\n") and "done" in out.getvalue()
