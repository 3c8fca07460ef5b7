"""What reaches the terminal: user strings made inert, and stdout that may close early.

A req_id is free text from a step file. Printed raw it could carry escape sequences (move the
cursor, retitle the window) or Rich markup (``[/]`` crashes a table, ``[bold red]x[/]`` is
rendered); :func:`plain` replaces every control character with its ``\\xNN`` escape and
:func:`markup` also escapes Rich markup. A reader that stops early (``cpplan inspect | head``)
closes stdout: :func:`quiet_broken_pipe` ends the output silently (exit code unchanged: 0 for
inspect, 0 or 1 for diff as computed), never a BrokenPipe traceback.
"""

from __future__ import annotations

import os
import re
import sys

# C0 controls, DEL, C1 controls, and the Unicode line/paragraph separators and bidi overrides
# that reorder or break a terminal line
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def plain(text: str) -> str:
    """``text`` with every control character shown as an escape (one inert line)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def markup(text: str) -> str:
    """``text`` safe to pass to Rich: plain, with markup brackets escaped."""
    from rich.markup import escape

    return escape(plain(text))


def emit(text: str) -> None:
    """Write ``text`` and a newline to stdout; a closed pipe ends the output quietly."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        quiet_broken_pipe()


def quiet_broken_pipe() -> None:
    """After EPIPE: point stdout at /dev/null so the interpreter's final flush cannot fail
    again (which would print 'Exception ignored ... BrokenPipeError' and exit 120)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass  # stdout is not a real file (in-process capture): nothing to flush later
