"""cpplan inspect: a readable report of a plan (or of a step compiled on the fly)."""

from __future__ import annotations

import argparse
import json
import sys

from cpplan.cli.common import PATHS_NOTE, add_config_flags, load_plans, path_arg
from cpplan.cli.terminal import emit, markup, quiet_broken_pipe
from cpplan.report import plan_report
from cpplan.schemas import ConfigError, StepInputError

EXAMPLE = """examples:
  cpplan inspect step.msgpack                     # a recorded plan
  cpplan inspect step.msgpack --rank 1            # only PCP rank 1's rows
  cpplan inspect step.json --pcp 4 --dcp 4        # compile a step on the fly
  cpplan inspect step.msgpack --json | jq .collectives
  cpplan inspect step.msgpack --json --indices    # with the deinterleave indices
config flags (--config, --pcp, ...) apply to a step file only: a plan carries its config.
""" + PATHS_NOTE + "\n"

# rows of each table in the text report (requests, rows per rank, PCP ranks, gather chunks,
# collectives, cost ranks); --json has them all
MAX_ROWS_SHOWN = 64


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "inspect", help="show what a plan does, rank by rank", epilog=EXAMPLE,
        description="Report a plan: config and digest, requests, per-rank rows and padding, "
                    "gather chunks, collectives, cost and workspace.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("plan", metavar="PLAN", type=path_arg,
                        help="plan file, or a step file plus config")
    parser.add_argument("--rank", type=int, metavar="R", help="show one PCP rank's rows only")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--indices", action="store_true",
                        help="with --json: include each gather chunk's deinterleave indices")
    add_config_flags(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.indices and not args.json:
        raise ConfigError("--indices adds the deinterleave indices to the JSON report only: "
                          "add --json")
    loaded = load_plans([args.plan], args)[0]
    plan = loaded.plan
    if args.rank is not None and not 0 <= args.rank < plan.config.pcp_size:
        raise StepInputError(
            f"--rank must be in [0, {plan.config.pcp_size}) for pcp_size "
            f"{plan.config.pcp_size}: got {args.rank}")
    report = plan_report(plan, with_indices=args.indices,
                         max_rows=None if args.json else MAX_ROWS_SHOWN,
                         schema_version=loaded.schema_version)
    if args.rank is not None:
        report["ranks"] = [report["ranks"][args.rank]]
    if args.json:
        emit(json.dumps(report, separators=(",", ":")))
        return 0
    report["totals"] = {"requests": plan.num_requests, "rows": plan.num_rows,
                        "ranks": len(report["ranks"]), "gather_chunks": len(plan.gather_chunks),
                        "collectives": len(plan.collectives)}
    try:
        _print_text(report)
    except BrokenPipeError:
        quiet_broken_pipe()
    return 0


def _print_text(report: dict) -> None:
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:  # Rich's own exits 1; a closed pipe is not an error
            self.quiet = True
            quiet_broken_pipe()

    # piped output keeps full cell text instead of folding tables to 80 columns; no emoji
    # codes or markup from data (user strings go through terminal.markup)
    console = _Console(highlight=False, emoji=False,
                       width=None if sys.stdout.isatty() else 160)
    for section in (_header, _requests, _ranks, _chunks, _collectives, _cost):
        section(console, report)


def _table(title: str, columns: tuple[str, ...], left: tuple[str, ...] = ()):
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right")
    return table


def _header(console, report: dict) -> None:
    cfg = report["config"]
    graph = f"cuda graph {report['cudagraph_size']}" if report["cudagraph_size"] else "eager"
    console.print(
        f"[bold]step {report['step_id']}[/]  digest {report['digest']}  "
        f"schema v{report['schema_version']}\n"
        f"P={cfg['pcp_size']} W={cfg['dcp_size']} I={cfg['interleave_size']} "
        f"B={cfg['block_size']} kv={cfg['kv_cache_dtype']} heads={cfg['num_heads']} "
        f"topk={cfg['topk']} max_model_len={cfg['max_model_len']} "
        f"workspace={cfg['gather_workspace_tokens']} rows  |  T={report['padded_num_tokens']} "
        f"({graph}), {report['num_decode_rows']} decode rows"
        + (", decodes owned by one rank each (shard_decode_requests)"
           if cfg.get("shard_decode_requests") else ""))


def _requests(console, report: dict) -> None:
    total = report["totals"]["requests"]
    table = _table(f"requests ({total})",
                   ("#", "req_id", "mode", "c", "q", "cs", "extent", "shard rows"),
                   left=("req_id", "mode"))
    colour = {"decode": "cyan", "split": "green", "replicated": "yellow", "owned": "magenta"}
    for r in report["requests"][:MAX_ROWS_SHOWN]:
        owner = f" by rank {r['owner_rank']}" if "owner_rank" in r else ""
        table.add_row(str(r["index"]), markup(r["req_id"]),
                      f"[{colour[r['mode']]}]{r['mode']}{owner}[/]",
                      str(r["num_computed_tokens"]), str(r["num_scheduled_tokens"]),
                      str(r["chunk_size"]), str(r["extent"]), str(r["dcp_shard_rows"]))
    console.print(table)
    _more(console, total, "requests")


def _ranks(console, report: dict) -> None:
    for rank in report["ranks"][:MAX_ROWS_SHOWN]:
        real, padded = rank["num_tokens"], rank["padded_num_tokens"]
        waste = 100.0 * rank["padding"] / padded if padded else 0.0
        table = _table(f"PCP rank {rank['rank']}: {real} tokens, padded to {padded} "
                       f"({rank['padding']} padding, {waste:.1f}% waste)",
                       ("row", "request", "query offset", "tokens", "first position",
                        "kv write"))
        for j, row in enumerate(rank["rows"][:MAX_ROWS_SHOWN]):
            table.add_row(str(j), str(row["request"]), str(row["query_offset"]),
                          str(row["num_tokens"]), str(row["position_start"]),
                          "yes" if row["kv_write"] else "-")
        console.print(table)
        _more(console, report["totals"]["rows"], "rows")
    _more(console, report["totals"]["ranks"], "PCP ranks")


def _more(console, total: int, what: str) -> None:
    if total > MAX_ROWS_SHOWN:
        console.print(f"  ... {total - MAX_ROWS_SHOWN} more {what} (--json shows all)")


def _chunks(console, report: dict) -> None:
    if not report["gather_chunks"]:
        return
    table = _table("gather chunks", ("chunk", "requests", "PT", "gathered rows", "total tokens"))
    w = report["config"]["dcp_size"]
    for c in report["gather_chunks"][:MAX_ROWS_SHOWN]:
        reqs = c["requests"]
        shown = ",".join(map(str, reqs[:12])) + (f",... ({len(reqs)})" if len(reqs) > 12 else "")
        table.add_row(str(c["index"]), shown, str(c["padded_local_total"]),
                      str(w * c["padded_local_total"]), str(c["total"]))
    console.print(table)
    _more(console, report["totals"]["gather_chunks"], "gather chunks")


def _collectives(console, report: dict) -> None:
    table = _table(f"collectives (per rank; {report['config']['num_layers']} layers)",
                   ("name", "op", "group", "dtype", "shape", "bytes/layer", "bytes/step"),
                   left=("name", "op", "group", "dtype", "shape"))
    for c in report["collectives"][:MAX_ROWS_SHOWN]:
        table.add_row(markup(c["name"]), c["op"], c["group"], c["dtype"],
                      "x".join(map(str, c["shape"])),
                      f"{c['bytes']:,}" if c["per_layer"] else "-", f"{c['bytes_per_step']:,}")
    console.print(table)
    _more(console, report["totals"]["collectives"], "collectives")


def _cost(console, report: dict) -> None:
    cost, ws = report["cost"], report["workspace"]
    table = _table(f"cost per layer (imbalance max/mean {cost['imbalance']:.3f})",
                   ("rank", "attention keys", "indexer keys", "attention GFLOP",
                    "indexer GFLOP", "gathered MB"))
    ranks = len(cost["attention_flops"])
    for r in range(min(ranks, MAX_ROWS_SHOWN)):
        table.add_row(str(r), f"{cost['attention_keys'][r]:,}", f"{cost['indexer_keys'][r]:,}",
                      f"{cost['attention_flops'][r] / 1e9:.2f}",
                      f"{cost['indexer_flops'][r] / 1e9:.2f}",
                      f"{cost['gathered_bytes'][r] / 1e6:.2f}")
    console.print(table)
    _more(console, ranks, "ranks")
    console.print(
        f"workspace per rank: gather {ws['gather_bytes']:,} B of {ws['gather_capacity_bytes']:,} "
        f"B capacity ({ws['gather_rows']} rows), insert {ws['insert_bytes']:,} B, restore "
        f"{ws['restore_bytes']:,} B")
