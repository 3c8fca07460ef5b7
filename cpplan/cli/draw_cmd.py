"""cpplan draw: a picture of a step, one lane per PCP rank."""

from __future__ import annotations

import argparse

import numpy as np

from cpplan.cli.common import PATHS_NOTE, add_config_flags, bounded_int, load_plans, path_arg
from cpplan.schemas import MODE_DECODE, MODE_OWNED, MODE_REPLICATED, MODE_SPLIT, StepPlan
from cpplan.schemas.errors import CapacityError, OutputError
from cpplan.schemas.files import check_output_target, write_atomic

EXAMPLE = """examples:
  cpplan draw step.msgpack -o step.png
  cpplan draw step.json --pcp 4 --dcp 4 -o step.png
config flags (--config, --pcp, ...) apply to a step file only: a plan carries its config.
""" + PATHS_NOTE + "\n"

# How a mode looks: (hatch, edge colour). Fill colour is per request.
MODE_STYLE = {MODE_DECODE: ("", "#1f4e79"), MODE_SPLIT: ("", "black"),
              MODE_REPLICATED: ("///", "#7a5c00"), MODE_OWNED: ("..", "#1f4e79")}
LANE_HEIGHT = 0.6
FIG_WIDTH = 12  # inches
MIN_DPI, MAX_DPI = 10, 600
MAX_LANES = 64  # PCP ranks drawn
MAX_SPANS = 50_000  # row spans (ranks x rows) drawn
MAX_PIXELS = 60_000_000  # before bbox trimming; about 240 MB of RGBA while rendering


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "draw", help="draw a plan as a PNG", epilog=EXAMPLE,
        description="Draw each PCP rank's rows as spans coloured by request (decode, split and "
                    "replicated rows styled apart), padding hatched grey, gather chunks "
                    "bracketed under each lane.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("plan", metavar="PLAN", type=path_arg,
                        help="plan file, or a step file plus config")
    parser.add_argument("-o", "--output", required=True, metavar="PNG", type=path_arg,
                        help="the picture (a .png path; never one of the inputs)")
    parser.add_argument("--dpi", type=bounded_int(MIN_DPI, MAX_DPI), default=120,
                        help=f"resolution, {MIN_DPI} to {MAX_DPI} (default 120)")
    add_config_flags(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not args.output.lower().endswith(".png"):
        raise OutputError(f"output must be a .png file: got {args.output!r}")
    inputs = (args.plan, args.config)
    check_output_target(args.output, inputs)  # before the work, not after
    plan = load_plans([args.plan], args)[0].plan
    write_atomic(args.output, render_png(plan, dpi=args.dpi), inputs=inputs)
    return 0


def draw_plan(plan: StepPlan, path: str, dpi: int = 120) -> None:
    """Draw ``plan`` into the PNG file ``path`` (written atomically)."""
    write_atomic(path, render_png(plan, dpi=dpi))


def check_drawable(plan: StepPlan, dpi: int) -> None:
    """Refuse, with one line, a picture too large to be useful or to allocate safely."""
    p_size = plan.config.pcp_size
    spans = p_size * plan.num_rows
    if p_size > MAX_LANES or spans > MAX_SPANS:
        raise CapacityError(f"draw shows at most {MAX_LANES} PCP ranks and {MAX_SPANS:,} row "
                            f"spans: got {p_size} ranks, {spans:,} spans (use cpplan inspect)")
    width, height = FIG_WIDTH * dpi, (1.2 + 1.1 * p_size) * dpi
    if width * height > MAX_PIXELS:
        raise CapacityError(f"draw at --dpi {dpi} would be {int(width)} x {int(height)} pixels:"
                            f" limit {MAX_PIXELS:,} pixels (lower --dpi)")


def render_png(plan: StepPlan, dpi: int = 120) -> bytes:
    """The picture as PNG bytes (rendered in memory, so a failed write leaves no file)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    cfg = plan.config
    p_size, t_pad = cfg.pcp_size, max(plan.padded_num_tokens, 1)
    check_drawable(plan, dpi)
    fig, ax = plt.subplots(figsize=(FIG_WIDTH, 1.2 + 1.1 * p_size))
    for p in range(p_size):
        _draw_lane(ax, plan, p, plt.get_cmap("tab20"), Rectangle)
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
        Patch(facecolor="white", edgecolor=MODE_STYLE[MODE_OWNED][1], hatch="..",
              label="owned decode"),
        Patch(facecolor="#dddddd", edgecolor="grey", hatch="xx", label="padding"),
    ], loc="lower right", fontsize=8, ncols=5, bbox_to_anchor=(1.0, 1.06), frameon=False)
    fig.tight_layout()
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, dpi=dpi, bbox_inches="tight", format="png")
    finally:
        plt.close(fig)
    return buffer.getvalue()


def _draw_lane(ax, plan: StepPlan, p: int, cmap, Rectangle) -> None:
    """PCP rank p's rows (coloured by request, hatched by mode), its padding and its chunks."""
    p_size, t_pad = plan.config.pcp_size, max(plan.padded_num_tokens, 1)
    req, modes = plan.row_request.np(), plan.mode.np()
    lens, starts = plan.row_num_tokens.np(), plan.row_token_start.np()
    offs = plan.row_query_offset.np()
    y = p_size - 1 - p
    for j in range(len(req)):
        if lens[p, j] == 0:
            continue
        hatch, edge = MODE_STYLE[int(modes[req[j]])]
        ax.add_patch(Rectangle((starts[p, j], y), lens[p, j], LANE_HEIGHT,
                               facecolor=cmap(int(req[j]) % 20), edgecolor=edge,
                               hatch=hatch, linewidth=0.6))
        if lens[p, j] > 0.08 * t_pad:  # room for the label (numbers only: no user text)
            ax.text(starts[p, j] + lens[p, j] / 2, y + LANE_HEIGHT / 2,
                    f"r{req[j]} q{offs[p, j]}:{offs[p, j] + lens[p, j]}",
                    ha="center", va="center", fontsize=7)
    real = plan.num_tokens[p]
    if real < plan.padded_num_tokens:
        ax.add_patch(Rectangle((real, y), plan.padded_num_tokens - real, LANE_HEIGHT,
                               facecolor="#dddddd", edgecolor="grey", hatch="xx",
                               linewidth=0.6))
    _draw_chunks(ax, plan, p, y)


def _draw_chunks(ax, plan: StepPlan, p: int, y: float) -> None:
    """Bracket, under lane p, the span of rows whose requests form each gather chunk."""
    req = plan.row_request.np()
    lens, starts = plan.row_num_tokens.np()[p], plan.row_token_start.np()[p]
    chunk_of = np.full(plan.num_requests, -1, np.int64)
    for k, chunk in enumerate(plan.gather_chunks):
        chunk_of[chunk.requests.np()] = k
    rows = np.flatnonzero((chunk_of[req] >= 0) & (lens > 0))
    if not rows.size:
        return
    # a chunk's rows are contiguous on a rank: its first and last non-empty row bound it
    ids, first = np.unique(chunk_of[req[rows]], return_index=True)
    _, last_rev = np.unique(chunk_of[req[rows]][::-1], return_index=True)
    last = rows.size - 1 - last_rev
    for k, a, b in zip(ids.tolist(), rows[first].tolist(), rows[last].tolist()):
        x0, x1 = starts[a], starts[b] + lens[b]
        ax.plot([x0, x0, x1, x1], [y - 0.05, y - 0.15, y - 0.15, y - 0.05], color="purple",
                linewidth=1.2)
        ax.text((x0 + x1) / 2, y - 0.3, f"gather chunk {k}", ha="center", va="center",
                fontsize=7, color="purple")
