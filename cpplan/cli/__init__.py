"""The ``cpplan`` command line: one module per command, registered here.

Every command turns cpplan's own errors (and any OSError) into one line on stderr and the
error's exit code (2 for bad input), never a traceback; control characters in the line are
escaped. A reader closing stdout early (``| head``) ends the output quietly: the command's own
exit code (0, or diff's 0/1), no BrokenPipe traceback. stdout and stderr write what their
encoding cannot hold as backslash escapes (a non-ASCII req_id under ``PYTHONIOENCODING=ascii``),
and an optional package missing (``pip install .`` has no rich, matplotlib or torch) is one
line naming the extra that installs it (docs/design.md §6.10).
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import signal
import sys
import threading

from cpplan import INSTALL_COMMAND
from cpplan._version import __version__
from cpplan.cli.terminal import plain, quiet_broken_pipe
from cpplan.schemas.errors import CpplanError

# command name -> module under cpplan.cli; each module defines register(subparsers) and
# run(args) -> int. Modules import lazily so `cpplan plan` never imports torch.
COMMANDS = {
    "plan": "cpplan.cli.plan_cmd",
    "inspect": "cpplan.cli.inspect_cmd",
    "diff": "cpplan.cli.diff_cmd",
    "draw": "cpplan.cli.draw_cmd",
    "simulate": "cpplan.cli.simulate_cmd",
    "replay": "cpplan.cli.replay_cmd",
    "generate": "cpplan.cli.generate_cmd",
}

EXIT_BAD_INPUT = 2

# optional packages -> the extra of pyproject.toml that installs them
OPTIONAL_EXTRAS = {"rich": "cli", "matplotlib": "cli", "torch": "runtime", "triton": "runtime",
                   "transformers": "hf", "safetensors": "hf", "flash_mla": "flashmla"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage dump
        sys.stderr.write(f"cpplan: error: {plain(' '.join(message.split()))}\n")
        raise SystemExit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="cpplan",
        description="Compile, inspect, diff, draw and simulate context-parallel step plans.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run 'cpplan COMMAND --help' for a command's options and an example.",
    )
    parser.add_argument("--version", action="version", version=f"cpplan {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for module_name in COMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # command not built yet
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    _stand_in_for_closed_streams()
    _escape_unencodable_output()
    saved_stdout = _checked_stdout()
    try:
        return _main(argv)
    finally:
        if saved_stdout is not None:
            try:
                sys.stdout.flush()
            except OSError:  # already reported (or stdout gone): the exit code tells
                pass
            sys.stdout = saved_stdout


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    previous = _interrupt_on_sigterm()
    try:
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # a write that fails here is exit 2, not a success cut short
        return code
    except CpplanError as exc:
        _error_line(args.command, str(exc))
        return exc.exit_code
    except BrokenPipeError:
        quiet_broken_pipe()
        return 0
    except ModuleNotFoundError as exc:  # an optional package left out, or a broken install
        top = (exc.name or "?").partition(".")[0]
        extra = OPTIONAL_EXTRAS.get(top)
        hint = (f'pip install "cpplan[{extra}]"' if extra == "flashmla" else
                f"{INSTALL_COMMAND} (the README's install)" if extra else "reinstall cpplan")
        _error_line(args.command, f"needs {exc.name if top == 'cpplan' else top}, which is "
                                  f"not installed: {hint}")
        return EXIT_BAD_INPUT
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        _error_line(args.command, f"{exc.strerror or exc}{where}")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        sys.stderr.write(f"cpplan {args.command}: interrupted\n")
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _sigterm(signum, frame) -> None:
    raise KeyboardInterrupt


def _interrupt_on_sigterm():
    """SIGTERM ends a command as Ctrl-C does (exit 130), through every ``finally``: an atomic
    writer's temp file is removed, spawned ranks are ended; the default action killed the
    process mid-write and left the temp file. Returns the handler it replaced (None off the
    main thread, where no handler can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _sigterm)


class _WholeWrites(io.RawIOBase):
    """A standard output fd whose ``write`` takes every byte or raises: on a file system that
    fills up (or past RLIMIT_FSIZE) the kernel takes part of a write, and Python's own stdout
    then dropped the rest without an error (``--json`` cut at 4,096 bytes, exit 0). A failed
    write is an OutputError naming stdout; EPIPE stays BrokenPipeError (``| head``)."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return os.isatty(self._fd)

    def write(self, data) -> int:
        from cpplan.schemas.errors import OutputError

        view = memoryview(data).cast("B")
        total = len(view)
        while view:
            try:
                n = os.write(self._fd, view)
            except BrokenPipeError:
                raise
            except OSError as exc:
                raise OutputError(f"cannot write stdout: {exc.strerror or exc}; the output is "
                                  "incomplete") from None
            view = view[n:]
        return total


def _checked_stdout():
    """sys.stdout rebuilt over :class:`_WholeWrites` where it is a real fd (not an in-process
    capture or a closed stream); returns the stream it replaced, else None."""
    stream = sys.stdout
    try:
        fd = stream.fileno()
        os.fstat(fd)
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return None
    try:
        stream.flush()
    except OSError:
        return None
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(_WholeWrites(fd)),
                                  encoding=getattr(stream, "encoding", None) or "utf-8",
                                  errors="backslashreplace",
                                  line_buffering=getattr(stream, "line_buffering", False))
    return stream


class _ClosedStdout:
    """sys.stdout where fd 1 was closed at start (``cpplan inspect f >&-``; Python then sets
    sys.stdout to None and the first print was an AttributeError traceback): writing is a
    one-line OutputError, exit 2; a command that writes no stdout (``plan -o``) runs as usual."""

    encoding, errors = "utf-8", "strict"

    def write(self, text: str) -> int:
        from cpplan.schemas.errors import OutputError

        raise OutputError("stdout is closed (>&-): got no stream to write the output to; "
                          "expected an open stdout (redirect it to a file or /dev/null)")

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise OSError("stdout is closed")


def _closed(stream) -> bool:
    """None (Python's stand-in for a standard fd closed at start) or a file whose fd is
    closed; a stream with no fd (an in-process capture) is open."""
    if stream is None:
        return True
    try:
        fd = stream.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return False
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def _stand_in_for_closed_streams() -> None:
    """A standard stream closed at start (``>&-``, ``2>&-``): stdout becomes a _ClosedStdout,
    stderr /dev/null (error lines are dropped; the exit code still tells: 2 for bad input)."""
    if _closed(sys.stdout):
        sys.stdout = _ClosedStdout()
    if _closed(sys.stderr):
        try:
            sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
        except OSError:
            sys.stderr = io.StringIO()


def _escape_unencodable_output() -> None:
    """Characters the terminal's encoding lacks are written as ``\\xNN`` / ``\\uNNNN``
    escapes instead of raising UnicodeEncodeError mid-report."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):  # closed, or not reconfigurable now
                pass


def _error_line(command: str, message: str) -> None:
    try:
        sys.stderr.write(f"cpplan {command}: error: {plain(' '.join(message.split()))}\n")
    except (OSError, ValueError):  # stderr unwritable: the exit code alone tells
        pass
