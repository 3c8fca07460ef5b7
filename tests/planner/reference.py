"""A deliberately naive planner, written from docs/design.md §3 alone: the tests' oracle and
the benchmark's baseline.

It does what each rank of the old engine did: iterate ranks, iterate requests, build that rank's
rows, then derive shapes, gather chunks and collectives. Pure Python (no numpy in the
derivation) and it never calls planner code. Its output is a dict of plain Python values keyed by
the StepPlan field names; :func:`plan_facts` turns a StepPlan into the same form and
:func:`assert_plan_matches` compares the two with a readable diff.
"""

from __future__ import annotations

from cpplan.schemas.config import ParallelConfig
from cpplan.schemas.plan import EAGER, MODE_DECODE, MODE_OWNED, MODE_REPLICATED, MODE_SPLIT, StepPlan
from cpplan.schemas.step import StepInput

KV_BYTES = {"fp8_ds_mla": 656, "bf16": 1152}
INDEXER_K_BYTES = 132
ACT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


# ------------------------------------------------------------------ per request
def chunk_bounds(q: int, k: int, cs: int) -> tuple[int, int]:
    """Query offsets [start, end) of chunk k of a request of q tokens cut in chunks of cs."""
    return min(k * cs, q), min((k + 1) * cs, q)


def request_mode(p_size: int, w_size: int, q: int, prefilling: bool,
                 owned: bool = False) -> tuple[int, int]:
    """(mode, chunk size) of one request (docs/design.md §3.1): a P > 1, W > 1 prefill is replicated when
    fewer than S of its chunks are non-empty; a decode is owned by one rank when ``owned``
    (the config's shard_decode_requests)."""
    if not prefilling:
        return (MODE_OWNED if owned else MODE_DECODE), q
    if p_size == 1:
        return MODE_REPLICATED, q
    s = 2 * p_size
    cs = (q + s - 1) // s
    non_empty = 0
    for k in range(s):
        a, b = chunk_bounds(q, k, cs)
        if b > a:
            non_empty += 1
    if w_size > 1 and non_empty < s:
        return MODE_REPLICATED, q
    return MODE_SPLIT, cs


def local_len(extent: int, rank: int, w_size: int, inter: int) -> int:
    """KV tokens of an extent on DCP rank ``rank`` (docs/design.md §3.4); the extent when W == 1."""
    if w_size == 1:
        return extent
    base = (extent // inter // w_size) * inter
    return base + max(0, min(extent - base * w_size - rank * inter, inter))


# ------------------------------------------------------------------ per rank
def rank_rows(p: int, p_size: int, reqs: list[tuple[int, int, bool]], modes) -> list[tuple]:
    """Rank p's rows in published order: (request, query offset, tokens, kv written). An owned
    decode is this rank's when the decodes counted before it leave p as the next owner in
    turn (rank 0, 1, ..., P-1, 0, ...); elsewhere its row is empty."""
    rows = []
    decodes_seen = 0
    for i, (_c, q, _pre) in enumerate(reqs):
        if modes[i][0] == MODE_DECODE:
            rows.append((i, 0, q, 1))
        elif modes[i][0] == MODE_OWNED:
            mine = decodes_seen % p_size == p
            rows.append((i, 0, q if mine else 0, 1 if mine else 0))
            decodes_seen += 1
    s = 2 * p_size
    for i, (_c, q, _pre) in enumerate(reqs):
        mode, cs = modes[i]
        if mode == MODE_REPLICATED:
            rows.append((i, 0, q, 1 if p == 0 else 0))
        elif mode == MODE_SPLIT:
            for k in (p, s - 1 - p):
                a, b = chunk_bounds(q, k, cs)
                rows.append((i, a, b - a, 1))
    return rows


def cut_chunks(config: ParallelConfig, reqs, modes) -> list[dict]:
    """Greedy gather chunks over prefill requests (docs/design.md §3.5); none when W == 1."""
    w, inter = config.dcp_size, config.interleave_size
    if w == 1:
        return []
    chunks: list[list[int]] = []
    current: list[int] = []
    rows = 0
    for i, (c, q, _pre) in enumerate(reqs):
        if modes[i][0] in (MODE_DECODE, MODE_OWNED):
            continue
        pad = local_len(c + q, 0, w, inter)
        if current and w * (rows + pad) > config.gather_workspace_tokens:
            chunks.append(current)
            current, rows = [], 0
        current.append(i)
        rows += pad
    if current:
        chunks.append(current)
    out = []
    for members in chunks:
        pads = [local_len(reqs[i][0] + reqs[i][1], 0, w, inter) for i in members]
        extents = [reqs[i][0] + reqs[i][1] for i in members]
        pcu, gcu = [0], [0]
        for pad, e in zip(pads, extents):
            pcu.append(pcu[-1] + pad)
            gcu.append(gcu[-1] + e)
        out.append({"requests": members, "pad": pads, "padded_local_cu": pcu,
                    "global_cu": gcu, "padded_local_total": pcu[-1], "total": gcu[-1]})
    return out


def reference_collectives(config: ParallelConfig, t_pad: int, nd: int, has_prefill: bool,
                          chunks: list[dict], sampled_rows=None) -> list[tuple]:
    """docs/design.md §3.8's table, row by row: (name, op, group, dtype, shape, bytes,
    per_layer, layers); sampled_rows: M of a step that names its sampled rows, else None."""
    out = _collectives_table(config, t_pad, nd, has_prefill, chunks, sampled_rows)
    sources = config.indexer_sources
    full = tuple(k for k in range(config.num_layers) if sources and sources[k] == k)
    indexer = ("indexer_k_insert", "indexer_k_gather", "topk_candidates")
    return [(*c, full if c[0].split("[")[0] in indexer else ()) for c in out]


def _collectives_table(config, t_pad, nd, has_prefill, chunks, sampled_rows) -> list[tuple]:
    p, w = config.pcp_size, config.dcp_size
    kv, act = KV_BYTES[config.kv_cache_dtype], config.activation_dtype
    h, out = config.num_heads, []
    if p > 1 and has_prefill:
        out.append(("kv_insert", "all_gather", "pcp", "uint8", (t_pad - nd, kv),
                    (t_pad - nd) * kv, True))
        out.append(("indexer_k_insert", "all_gather", "pcp", "uint8", (t_pad - nd, 132),
                    (t_pad - nd) * 132, True))
    for c, ch in enumerate(chunks):
        pt = ch["padded_local_total"]
        out.append((f"indexer_k_gather[{c}]", "all_gather", "dcp", "uint8", (pt, 132),
                    pt * 132, True))
        out.append((f"kv_gather[{c}]", "all_gather", "dcp", "uint8", (pt, kv), pt * kv, True))
    if w > 1 and nd > 0:
        out.append(("topk_candidates", "all_gather", "dcp", "float32+int32",
                    (nd, config.topk), nd * config.topk * (4 + 4), True))
        out.append(("decode_lse", "all_gather", "dcp", "float32", (nd, h), nd * h * 4, True))
        out.append(("decode_out", "all_reduce", "dcp", act, (nd, h, config.v_head_dim),
                    nd * h * config.v_head_dim * ACT_BYTES[act], True))
    if p > 1 and sampled_rows is None:
        out.append(("restore", "all_gather", "pcp", act, (t_pad, config.hidden_size),
                    t_pad * config.hidden_size * ACT_BYTES[act], False))
    elif p > 1 and sampled_rows:
        out.append(("restore_sampled", "all_gather", "pcp", act,
                    (sampled_rows, config.hidden_size),
                    sampled_rows * config.hidden_size * ACT_BYTES[act], False))
    return out


def reference_sampled(step: StepInput, modes, per_rank, starts):
    """(is_sampled, sampled_source, M) by walking each rank's rows token by token: a sampled
    request's last query token is taken from the rank whose row holds it, rank 0 for decodes
    and replicated prefills (their rows are on every rank)."""
    if step.is_sampled is None:
        return None, None, None
    flags = [int(f) for f in step.is_sampled.np().tolist()]
    q = step.num_scheduled_tokens.np().tolist()
    source = {}
    for p, rows in enumerate(per_rank):
        for (req, off, n, _), start in zip(rows, starts[p]):
            if not flags[req] or (p > 0 and modes[req][0] not in (MODE_SPLIT, MODE_OWNED)):
                continue
            for j in range(n):
                if off + j == q[req] - 1:
                    source[req] = [p, start + j]
    src = [source[i] for i in range(len(flags)) if flags[i]]
    counts = [sum(1 for r, _ in src if r == p) for p in range(len(per_rank))]
    rows = max(counts) if src and len(per_rank) > 1 else 0
    return flags, src, rows


def reference_plan(config: ParallelConfig, step: StepInput) -> dict:
    """Every fact of the step's plan, derived rank by rank (see the module docstring)."""
    p_size, w_size, inter = config.pcp_size, config.dcp_size, config.interleave_size
    reqs = [(r.num_computed_tokens, r.num_scheduled_tokens, r.is_prefilling)
            for r in step.requests()]
    owned = bool(config.shard_decode_requests)
    modes = [request_mode(p_size, w_size, q, pre, owned) for (c, q, pre) in reqs]
    per_rank = [rank_rows(p, p_size, reqs, modes) for p in range(p_size)]
    starts, counts = [], []
    for rows in per_rank:
        acc, st = 0, []
        for row in rows:
            st.append(acc)
            acc += row[2]
        starts.append(st)
        counts.append(acc)
    t_real = max(counts)
    t_pad, graph = t_real, EAGER
    for size in config.cudagraph_token_sizes:
        if size >= t_real:
            t_pad, graph = size, size
            break
    decode_rows = [i for i, m in enumerate(modes) if m[0] == MODE_DECODE]
    nd = sum(reqs[i][1] for i in decode_rows)
    chunks = cut_chunks(config, reqs, modes)
    flags, source, sampled_rows = reference_sampled(step, modes, per_rank, starts)
    return {
        "step_id": step.step_id,
        "req_ids": list(step.req_ids),
        "num_computed_tokens": [c for c, q, pre in reqs],
        "num_scheduled_tokens": [q for c, q, pre in reqs],
        "is_prefilling": [int(pre) for c, q, pre in reqs],
        "mode": [m for m, cs in modes],
        "chunk_size": [cs for m, cs in modes],
        "dcp_shard_rows": [local_len(c + q, 0, w_size, inter) for c, q, pre in reqs],
        "dcp_local_lens": [[local_len(c + q, r, w_size, inter) for r in range(w_size)]
                           for c, q, pre in reqs],
        "row_request": [row[0] for row in per_rank[0]],
        "row_query_offset": [[row[1] for row in rows] for rows in per_rank],
        "row_num_tokens": [[row[2] for row in rows] for rows in per_rank],
        "row_token_start": starts,
        "row_kv_write": [[row[3] for row in rows] for rows in per_rank],
        "rank_row_request": [[row[0] for row in rows] for rows in per_rank],
        "num_decode_rows": len(decode_rows),
        "num_decode_tokens": nd,
        "num_tokens": counts,
        "padded_num_tokens": t_pad,
        "cudagraph_size": graph,
        "gather_chunks": chunks,
        # a decode-only step padded to a graph size runs every padded token as a decode
        "collectives": reference_collectives(
            config, t_pad, t_pad if graph != EAGER and nd > 0 and len(decode_rows) == len(reqs)
            else nd, len(decode_rows) < len(reqs), chunks, sampled_rows),
        "is_sampled": flags,
        "sampled_source": source,
    }


# ------------------------------------------------------------------ comparison
def plan_facts(plan: StepPlan) -> dict:
    """A StepPlan as plain Python values in :func:`reference_plan`'s form."""
    out: dict = {}
    for name in plan.__struct_fields__:
        value = getattr(plan, name)
        if name == "config":
            continue
        if name == "gather_chunks":
            value = [{f: (getattr(ch, f).np().tolist() if hasattr(getattr(ch, f), "np")
                          else getattr(ch, f)) for f in ch.__struct_fields__} for ch in value]
        elif name == "collectives":
            value = [(c.name, c.op, c.group, c.dtype, tuple(c.shape), c.bytes, c.per_layer,
                      tuple(c.layers)) for c in value]
        elif hasattr(value, "np"):
            value = value.np().tolist()
        elif isinstance(value, tuple):
            value = list(value)
        out[name] = value
    return out


def _diff(path: str, got, want, out: list[str], limit: int) -> None:
    if len(out) >= limit:
        return
    if isinstance(want, dict) and isinstance(got, dict):
        for key in want:
            _diff(f"{path}.{key}", got.get(key, "<missing>"), want[key], out, limit)
    elif isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)):
        if len(got) != len(want):
            out.append(f"{path}: length {len(got)} (plan) != {len(want)} (reference)")
        for k, (g, w) in enumerate(zip(got, want)):
            _diff(f"{path}[{k}]", g, w, out, limit)
    elif got != want:
        out.append(f"{path}: plan {got!r} != reference {want!r}")


def plan_diff(plan: StepPlan, ref: dict, limit: int = 12) -> list[str]:
    """Up to ``limit`` lines naming the differing fields (first differences first)."""
    facts = plan_facts(plan)
    out: list[str] = []
    for key, want in ref.items():
        if key == "rank_row_request":
            continue  # checked separately: every rank's row map equals row_request
        _diff(key, facts.get(key, "<missing>"), want, out, limit)
    return out


def assert_plan_matches(plan: StepPlan, ref: dict) -> None:
    lines = plan_diff(plan, ref)
    if lines:
        cfg = plan.config
        head = (f"plan != reference (P={cfg.pcp_size} W={cfg.dcp_size} I={cfg.interleave_size}"
                f", {plan.num_requests} requests):")
        raise AssertionError("\n  ".join([head, *lines]))
