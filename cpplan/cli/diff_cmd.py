"""cpplan diff: what changed between two plans (or a plan and a step compiled with a config)."""

from __future__ import annotations

import argparse

from cpplan.cli.common import PATHS_NOTE, add_config_flags, load_plans, path_arg
from cpplan.cli.terminal import emit, plain
from cpplan.report import plan_report

EXAMPLE = """examples:
  cpplan diff golden.msgpack new.msgpack
  cpplan diff golden.msgpack step.json --config config.json
exit status: 0 equal, 1 different, 2 error
config flags (--config, --pcp, ...) apply to the step file(s) only: a plan carries its config.
""" + PATHS_NOTE + "\n"

MAX_LINES_PER_SECTION = 20
MAX_ROWS_COMPARED = 100_000  # requests, and rows per rank, compared entry by entry


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "diff", help="semantic diff of two plans", epilog=EXAMPLE,
        description="Compare two plans (either may be a step file compiled with the config "
                    "flags): digest, request modes, rows, shapes, gather chunks, collectives.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("a", metavar="A", type=path_arg, help="plan file (or step file + config)")
    parser.add_argument("b", metavar="B", type=path_arg, help="plan file (or step file + config)")
    add_config_flags(parser)
    parser.set_defaults(run=run)


def _fmt(value) -> str:
    return str(value).replace(" ", "")


def _compare_dicts(label: str, a: dict, b: dict, skip=()) -> list[str]:
    return [f"{label}: {key} {_fmt(a.get(key))} -> {_fmt(b.get(key))}"
            for key in sorted(set(a) | set(b)) if key not in skip and a.get(key) != b.get(key)]


def _by_key(items: list[dict], key: str) -> dict:
    return {item[key]: item for item in items}


def diff_reports(a: dict, b: dict) -> list[str]:
    """Human-readable differences, most important first; empty when the plans are equal."""
    out: list[str] = []
    if a["digest"] != b["digest"]:
        out.append(f"digest: {a['digest']} -> {b['digest']}")
    out += _compare_dicts("config", a["config"], b["config"])
    out += _compare_dicts("step", a, b, skip=("digest", "config", "requests", "ranks",
                                              "gather_chunks", "collectives", "cost",
                                              "workspace"))
    for section in (_collectives_diff, _requests_diff, _ranks_diff, _chunks_diff):
        out += _cap(section(a, b))
    return out


def _collectives_diff(a: dict, b: dict) -> list[str]:
    col_a, col_b = _by_key(a["collectives"], "name"), _by_key(b["collectives"], "name")
    section = []
    for name in list(col_a) + [n for n in col_b if n not in col_a]:
        if name not in col_b:
            section.append(f"collective {name}: removed")
        elif name not in col_a:
            c = col_b[name]
            section.append(f"collective {name}: added {c['op']} {c['group']} "
                           f"{_fmt(c['shape'])} {c['dtype']}")
        else:
            section += _compare_dicts(f"collective {name}", col_a[name], col_b[name])
    if [c["name"] for c in a["collectives"] if c["name"] in col_b] != \
            [c["name"] for c in b["collectives"] if c["name"] in col_a]:
        section.append("collectives: issue order changed")
    return section


def _requests_diff(a: dict, b: dict) -> list[str]:
    req_a, req_b = _by_key(a["requests"], "req_id"), _by_key(b["requests"], "req_id")
    section = []
    for rid in [r["req_id"] for r in a["requests"]] + [r["req_id"] for r in b["requests"]
                                                        if r["req_id"] not in req_a]:
        if rid not in req_b:
            section.append(f"request {rid!r}: removed")
        elif rid not in req_a:
            section.append(f"request {rid!r}: added (mode {req_b[rid]['mode']})")
        else:
            section += _compare_dicts(f"request {rid!r}", req_a[rid], req_b[rid])
    return sorted(section, key=lambda line: ": mode " not in line)  # mode changes first


def _ranks_diff(a: dict, b: dict) -> list[str]:
    """Rank by rank; a rank in one plan only (another P) is named first, before the capped
    row differences of the ranks both have."""
    only = [f"rank {r['rank']}: only in {side} ({len(r['rows'])} rows, {r['num_tokens']} tokens)"
            for side, mine, other in (("A", a, b), ("B", b, a))
            for r in mine["ranks"][len(other["ranks"]):]]
    section = []
    for ra, rb in zip(a["ranks"], b["ranks"]):
        section += _compare_dicts(f"rank {ra['rank']}", ra, rb, skip=("rows",))
        for j in range(max(len(ra["rows"]), len(rb["rows"]))):
            if j >= len(ra["rows"]):
                section.append(f"rank {ra['rank']} row {j}: added {_fmt(rb['rows'][j])}")
            elif j >= len(rb["rows"]):
                section.append(f"rank {ra['rank']} row {j}: removed")
            else:
                section += _compare_dicts(f"rank {ra['rank']} row {j}", ra["rows"][j],
                                          rb["rows"][j])
    return only + section


def _chunks_diff(a: dict, b: dict) -> list[str]:
    section = []
    for k in range(max(len(a["gather_chunks"]), len(b["gather_chunks"]))):
        ca = a["gather_chunks"][k] if k < len(a["gather_chunks"]) else None
        cb = b["gather_chunks"][k] if k < len(b["gather_chunks"]) else None
        if ca is None or cb is None:
            section.append(f"gather chunk {k}: {'added' if ca is None else 'removed'}")
        else:
            section += _compare_dicts(f"gather chunk {k}", ca, cb)
    return section


def _cap(lines: list[str]) -> list[str]:
    if len(lines) <= MAX_LINES_PER_SECTION:
        return lines
    return lines[:MAX_LINES_PER_SECTION] + [f"... {len(lines) - MAX_LINES_PER_SECTION} more"]


def run(args: argparse.Namespace) -> int:
    loaded_a, loaded_b = load_plans([args.a, args.b], args)
    plan_a, plan_b = loaded_a.plan, loaded_b.plan
    a = plan_report(plan_a, with_cost=False, max_rows=MAX_ROWS_COMPARED,
                    schema_version=loaded_a.schema_version)
    b = plan_report(plan_b, with_cost=False, max_rows=MAX_ROWS_COMPARED,
                    schema_version=loaded_b.schema_version)
    lines = diff_reports(a, b)
    if not lines:
        emit(f"plans are equal (digest {a['digest']})")
        return 0
    largest = max(plan_a.num_requests, plan_b.num_requests, plan_a.num_rows, plan_b.num_rows)
    if largest > MAX_ROWS_COMPARED:
        lines.append(f"(requests and rows past the first {MAX_ROWS_COMPARED:,} not compared "
                     f"one by one; the digests cover them)")
    emit("\n".join(plain(line) for line in lines))
    return 1
