"""Issue 31 item 7: standard streams closed at start (``cpplan inspect f >&-``, ``2>&-``) were
an AttributeError traceback ('NoneType' object has no attribute 'isatty') or exit 1. Now: stdout
closed is a one-line OutputError, exit 2 (a command that writes no stdout still runs); stderr
closed drops the error line but keeps the exit code."""

import subprocess
import sys

import pytest

from tests.cli.test_cli import ENV, ROOT

GOLDEN = ROOT / "tests" / "golden" / "v2"
PLAN = GOLDEN / "mixed_p2w2.msgpack"


def _cpplan(args, close):
    """`cpplan ARGS` with the fds in ``close`` closed (as the shell's >&- does)."""
    cmd = " ".join(["exec", sys.executable, "-m", "cpplan", *map(str, args)] +
                   [f"{fd}>&-" for fd in close])
    return subprocess.run(["bash", "-c", cmd], env=ENV, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args", [["inspect", PLAN], ["inspect", PLAN, "--json"]])
def test_closed_stdout_is_one_line_exit_2(args):
    proc = _cpplan(args, [1])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cpplan inspect: error: stdout is closed"), \
        lines


def test_closed_stderr_keeps_the_exit_code_and_the_output():
    proc = _cpplan(["inspect", ROOT / "no-such-file.msgpack"], [2])
    assert proc.returncode == 2 and proc.stdout == ""
    proc = _cpplan(["inspect", PLAN, "--json"], [2])
    assert proc.returncode == 0 and proc.stdout.startswith('{"digest":')


def test_both_closed_and_a_command_without_stdout(tmp_path):
    assert _cpplan(["inspect", PLAN], [1, 2]).returncode == 2
    out = tmp_path / "d.png"
    proc = _cpplan(["draw", PLAN, "-o", out], [1])  # draw writes its file, no stdout
    assert proc.returncode == 0 and out.stat().st_size > 0, proc.stderr
