"""The ``cpplan`` command line: one module per command, registered here.

Every command turns cpplan's own errors (and missing files) into one line on stderr and the
error's exit code (2 for bad input), never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from cpplan._version import __version__
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
}

EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage dump
        sys.stderr.write(f"cpplan: error: {message}\n")
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
    for name, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # command not built yet
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        return int(args.run(args) or 0)
    except CpplanError as exc:
        sys.stderr.write(f"cpplan {args.command}: error: {exc}\n")
        return exc.exit_code
    except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        sys.stderr.write(f"cpplan {args.command}: error: {exc.strerror}: {exc.filename}\n")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        sys.stderr.write(f"cpplan {args.command}: interrupted\n")
        return 130
