"""cpplan draw: a picture of a step, one lane per PCP rank."""

from __future__ import annotations

import argparse

from cpplan.cli.common import add_config_flags, load_plan
from cpplan.schemas import MODE_DECODE, MODE_REPLICATED, MODE_SPLIT, StepPlan
from cpplan.schemas.errors import PlanFormatError

EXAMPLE = """examples:
  cpplan draw step.msgpack -o step.png
  cpplan draw step.json --pcp 4 --dcp 4 -o step.png
"""

# How a mode looks: (hatch, edge colour). Fill colour is per request.
MODE_STYLE = {MODE_DECODE: ("", "#1f4e79"), MODE_SPLIT: ("", "black"),
              MODE_REPLICATED: ("///", "#7a5c00")}
LANE_HEIGHT = 0.6


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "draw", help="draw a plan as a PNG", epilog=EXAMPLE,
        description="Draw each PCP rank's rows as spans coloured by request (decode, split and "
                    "replicated rows styled apart), padding hatched grey, gather chunks "
                    "bracketed under each lane.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("plan", metavar="PLAN", help="plan file, or a step file plus config")
    parser.add_argument("-o", "--output", required=True, metavar="PNG")
    parser.add_argument("--dpi", type=int, default=120)
    add_config_flags(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not args.output.lower().endswith(".png"):
        raise PlanFormatError(f"output must be a .png file: got {args.output!r}")
    plan = load_plan(args.plan, args)
    draw_plan(plan, args.output, dpi=args.dpi)
    return 0


def draw_plan(plan: StepPlan, path: str, dpi: int = 120) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    cfg = plan.config
    p_size, t_pad = cfg.pcp_size, max(plan.padded_num_tokens, 1)
    req = plan.row_request.np()
    modes = plan.mode.np()
    lens, starts = plan.row_num_tokens.np(), plan.row_token_start.np()
    offs = plan.row_query_offset.np()
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(12, 1.2 + 1.1 * p_size))
    for p in range(p_size):
        y = p_size - 1 - p
        for j in range(len(req)):
            if lens[p, j] == 0:
                continue
            hatch, edge = MODE_STYLE[int(modes[req[j]])]
            ax.add_patch(Rectangle((starts[p, j], y), lens[p, j], LANE_HEIGHT,
                                   facecolor=cmap(int(req[j]) % 20), edgecolor=edge,
                                   hatch=hatch, linewidth=0.6))
            if lens[p, j] > 0.08 * t_pad:  # room for the label
                ax.text(starts[p, j] + lens[p, j] / 2, y + LANE_HEIGHT / 2, f"r{req[j]} q{offs[p, j]}:{offs[p, j] + lens[p, j]}",
                        ha="center", va="center", fontsize=7)
        real = plan.num_tokens[p]
        if real < plan.padded_num_tokens:
            ax.add_patch(Rectangle((real, y), plan.padded_num_tokens - real, LANE_HEIGHT,
                                   facecolor="#dddddd", edgecolor="grey", hatch="xx",
                                   linewidth=0.6))
        _draw_chunks(ax, plan, p, y)
    ax.set_xlim(0, t_pad * 1.01)
    ax.set_ylim(-0.6, p_size)
    ax.set_yticks([p_size - 1 - p + LANE_HEIGHT / 2 for p in range(p_size)])
    ax.set_yticklabels([f"PCP rank {p}" for p in range(p_size)])
    ax.set_xlabel("token slot in the rank's padded batch")
    graph = f"CUDA graph {plan.cudagraph_size}" if plan.cudagraph_size else "eager"
    ax.set_title(f"step {plan.step_id}: P={p_size} W={cfg.dcp_size} I={cfg.interleave_size}, "
                 f"{plan.num_requests} requests, T={plan.padded_num_tokens} ({graph}), "
                 f"{len(plan.gather_chunks)} gather chunks", loc="left", pad=22)
    ax.legend(handles=[
        Patch(facecolor="white", edgecolor=MODE_STYLE[MODE_DECODE][1], label="decode"),
        Patch(facecolor="white", edgecolor="black", label="split prefill"),
        Patch(facecolor="white", edgecolor=MODE_STYLE[MODE_REPLICATED][1], hatch="///",
              label="replicated prefill"),
        Patch(facecolor="#dddddd", edgecolor="grey", hatch="xx", label="padding"),
    ], loc="lower right", fontsize=8, ncols=4, bbox_to_anchor=(1.0, 1.06), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)


def _draw_chunks(ax, plan: StepPlan, p: int, y: float) -> None:
    """Bracket, under lane p, the span of rows whose requests form each gather chunk."""
    req = plan.row_request.np()
    lens, starts = plan.row_num_tokens.np()[p], plan.row_token_start.np()[p]
    for k, chunk in enumerate(plan.gather_chunks):
        members = set(chunk.requests.np().tolist())
        rows = [j for j in range(len(req)) if int(req[j]) in members and lens[j] > 0]
        if not rows:
            continue
        x0, x1 = starts[rows[0]], starts[rows[-1]] + lens[rows[-1]]
        ax.plot([x0, x0, x1, x1], [y - 0.05, y - 0.15, y - 0.15, y - 0.05], color="purple",
                linewidth=1.2)
        ax.text((x0 + x1) / 2, y - 0.3, f"gather chunk {k}", ha="center", va="center",
                fontsize=7, color="purple")
