"""stdout onto a file system that fills up: the kernel takes part of a write, then refuses the
rest. Every command's output is written whole or the command exits 2 with one line naming
stdout; a cut file never comes with exit 0 (issue 68 item 4)."""

import errno
import os
import resource
import signal
import subprocess
import sys

import pytest

import cpplan.cli as cli
from cpplan.schemas.errors import OutputError
from tests.cli.test_cli import ENV, ROOT

GOLDEN = ROOT / "tests" / "golden" / "v3"
PLAN = GOLDEN / "bf16_cache_mixed_p2w2.msgpack"  # inspect --json: about 11.8 kB
SMALL = GOLDEN / "empty_step_p2w2.msgpack"  # inspect --json: about 1.1 kB
LIMIT = 4096


def _run_capped(tmp_path, *argv):
    """``cpplan ARGV`` with stdout a file in a process that may write at most LIMIT bytes to
    any file (RLIMIT_FSIZE, SIGXFSZ ignored): a full disk as write(2) reports it."""
    def cap():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))

    out = tmp_path / "out"
    with open(out, "wb") as handle:
        res = subprocess.run([sys.executable, "-m", "cpplan", *map(str, argv)], stdout=handle,
                             stderr=subprocess.PIPE, preexec_fn=cap, env=ENV, timeout=120)
    return res.returncode, res.stderr.decode(), out.read_bytes()


@pytest.mark.slow  # a real process per case: the limit and the interpreter's own stdout
@pytest.mark.parametrize("argv", [("inspect", "--json", PLAN), ("inspect", PLAN)])
def test_output_cut_by_a_full_disk_is_exit_2(tmp_path, argv):
    code, err, data = _run_capped(tmp_path, *argv)
    assert (code, len(data)) == (2, LIMIT)
    assert err == ("cpplan inspect: error: cannot write stdout: File too large; the output is "
                   "incomplete\n")


@pytest.mark.slow
def test_output_within_the_limit_is_whole(tmp_path):
    code, err, data = _run_capped(tmp_path, "inspect", "--json", SMALL)
    assert (code, err) == (0, "")
    full = subprocess.run([sys.executable, "-m", "cpplan", "inspect", "--json", SMALL],
                          capture_output=True, env=ENV, timeout=120).stdout
    assert data == full and len(full) < LIMIT


def test_whole_writes_retry_a_short_write_and_raise_on_a_full_disk(monkeypatch):
    """The raw writer of the checked stdout, against a fake fd taking 3 bytes a call and then
    none: the first write is retried to the end, the second is one OutputError."""
    taken = []

    def short_write(fd, data):
        if sum(map(len, taken)) >= 6:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        taken.append(bytes(data[:3]))
        return len(taken[-1])

    monkeypatch.setattr(cli.os, "write", short_write)
    raw = cli._WholeWrites(99)
    assert raw.write(b"abcdef") == 6 and b"".join(taken) == b"abcdef"
    with pytest.raises(OutputError) as err:
        raw.write(b"ghi")
    assert str(err.value) == ("cannot write stdout: No space left on device; the output is "
                              "incomplete")


def test_a_broken_pipe_stays_a_broken_pipe(monkeypatch):
    def closed(fd, data):
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    monkeypatch.setattr(cli.os, "write", closed)
    with pytest.raises(BrokenPipeError):
        cli._WholeWrites(99).write(b"x")
