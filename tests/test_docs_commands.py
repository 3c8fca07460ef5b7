"""The commands in README.md and docs/*.md run as written from the repository root: every file
or folder a fenced shell command names exists in the repository, or an earlier command of the
same page makes it (``-o``, ``--record``, ``-d``, ``venv``, ``save_pretrained``, ``*_DIR=``);
``<...>`` marks a name the reader fills in. A parser written here, not the docs' own tooling."""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```(?:bash|sh|shell|console)\n(.*?)```", re.S)
# a token naming a file: a path with a folder, or a name with one of these endings
FILE_ENDINGS = (".json", ".jsonl", ".msgpack", ".png", ".txt", ".py", ".sh", ".md", ".whl",
                ".toml", ".cu", ".h")
MAKES = ("-o", "--output", "--record", "-d", "venv", ">")  # the next token is made
PLACEHOLDER = "@"


def commands(text: str) -> list[list[str]]:
    """The fenced shell commands of a page as token lists (shell quoting and comments as a
    shell reads them), one per part between ``&&``, ``;`` and ``|``."""
    out = []
    for block in FENCE.findall(text):
        for line in block.splitlines():
            line = re.sub(r"<[^<>\s]+>", PLACEHOLDER, line)  # <digest>: the reader's own
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            part: list[str] = []
            for tok in lexer:
                if tok in ("&&", ";", "|", "||"):
                    out.append(part)
                    part = []
                else:
                    part.append(tok)
            if part:
                out.append(part)
    return [c for c in out if c]


def named_files(tokens: list[str]) -> tuple[list[str], list[str]]:
    """(the paths a command reads, the paths it makes)."""
    reads, makes = [], []
    for i, tok in enumerate(tokens):
        made = re.findall(r"save_pretrained\('([^']+)'\)", tok)
        if made or (i and tokens[i - 1] in MAKES):
            makes += made or [tok]
            continue
        if "=" in tok and tok.split("=", 1)[0].endswith("_DIR"):
            makes.append(tok.split("=", 1)[1])
            continue
        if (" " in tok or PLACEHOLDER in tok or "..." in tok or tok.startswith(("-", "http", ".["))
                or "[" in tok or "=" in tok or ":" in tok):
            continue
        if "/" in tok or tok.endswith(FILE_ENDINGS):
            reads.append(tok)
    return reads, makes


def _made(path: str, made: set[str]) -> bool:
    parts = pathlib.PurePosixPath(path.removeprefix("./")).parts
    return any("/".join(parts[:k]) in made for k in range(1, len(parts) + 1))


@pytest.mark.parametrize("page", PAGES)
def test_the_files_a_page_names_exist_or_are_made_first(page):
    made: set[str] = set()
    missing = []
    for cmd in commands((ROOT / page).read_text()):
        reads, makes = named_files(cmd)
        for path in reads:
            if "*" in path:
                found = any(ROOT.glob(path)) or _made(path.split("*")[0], made)
            else:
                found = (ROOT / path).exists() or _made(path, made)
            if not found:
                missing.append(f"{path!r} in {cmd!r}")
        made |= {m.removeprefix("./").rstrip("/") for m in makes}
    assert not missing, f"{page}: " + "; ".join(missing)


def test_the_parser_sees_what_the_pages_name():
    text = ("```bash\ncpplan plan examples/step.json -o step.msgpack   # c\n"
            "cpplan inspect step.msgpack && cpplan diff a/b.msgpack step.json\n```\n"
            "```python\nnot/a/command.py\n```\n```bash\ncpplan x rec/<d>.msgpack > o/p.txt\n```\n")
    got = [named_files(c) for c in commands(text)]
    assert got == [(["examples/step.json"], ["step.msgpack"]), (["step.msgpack"], []),
                   (["a/b.msgpack", "step.json"], []), ([], ["o/p.txt"])]


def test_the_missing_package_hint_is_the_readmes_install_command():
    from cpplan import INSTALL_COMMAND

    quick_start = commands((ROOT / "README.md").read_text())[0]
    assert shlex.split(INSTALL_COMMAND) == quick_start  # the README's first command


def test_the_tools_the_readme_runs_come_with_its_test_install():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    cmds = commands((ROOT / "README.md").read_text())
    test_install = next(c for c in cmds if c[:2] == ["pip", "install"] and "test" in c[-1])
    wanted = set(re.findall(r"\w+", test_install[-1].split("[")[1])) - {"runtime"}
    packages = {re.split(r"[<>=\[]", r)[0] for extra in wanted for r in extras[extra]}
    tools = {c[0] for c in cmds} | {c[2] for c in cmds if c[:2] == ["python", "-m"]}
    assert {"ruff", "pytest"} <= tools
    assert tools & {"ruff", "pytest"} <= packages, sorted(packages)
