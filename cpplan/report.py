"""A plan as plain data: what ``cpplan inspect --json`` prints and ``cpplan diff`` compares.

Keys are stable (scripts rely on them): digest, schema_version, step_id, config, requests,
ranks, gather_chunks, collectives, plus cost and workspace.
"""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np

from cpplan.schemas import MODE_NAMES, MODE_OWNED, SCHEMA_VERSION, CapacityError, StepPlan, digest


def _cost_dict(plan: StepPlan) -> dict:
    from cpplan.planner import estimate_cost

    cost = estimate_cost(plan)
    if dataclasses.is_dataclass(cost):
        return _plain(dataclasses.asdict(cost))
    return _plain(msgspec.to_builtins(cost))


def _plain(obj):
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def requests_table(plan: StepPlan, limit: int | None = None) -> list[dict]:
    """One dict per request; only the first ``limit`` when given (a text report shows a few,
    and builds no more than it shows)."""
    end = plan.num_requests if limit is None else min(limit, plan.num_requests)
    c = plan.num_computed_tokens.np()[:end].tolist()
    q = plan.num_scheduled_tokens.np()[:end].tolist()
    pre = plan.is_prefilling.np()[:end].tolist()
    mode = plan.mode.np()[:end].tolist()
    cs = plan.chunk_size.np()[:end].tolist()
    shard = plan.dcp_shard_rows.np()[:end].tolist()
    local = plan.dcp_local_lens.np()[:end].tolist()
    owners = owner_ranks(plan)
    out = [
        {"index": i, "req_id": rid, "num_computed_tokens": c[i], "num_scheduled_tokens": q[i],
         "is_prefilling": bool(pre[i]), "mode": MODE_NAMES[mode[i]], "chunk_size": cs[i],
         "extent": c[i] + q[i], "dcp_shard_rows": shard[i], "dcp_local_lens": local[i]}
        for i, rid in enumerate(plan.req_ids[:end])
    ]
    for i, rank in owners.items():
        if i < end:
            out[i]["owner_rank"] = rank
    return out


def owner_ranks(plan: StepPlan) -> dict[int, int]:
    """Request index -> the PCP rank that computes it, for owned decodes (the only requests
    one rank computes alone): the rank whose copy of the row is written."""
    req = plan.row_request.np()
    owned = np.nonzero(plan.mode.np()[req] == MODE_OWNED)[0]
    ranks = plan.row_kv_write.np()[:, owned].argmax(axis=0)
    return dict(zip(req[owned].tolist(), ranks.tolist()))


def ranks_table(plan: StepPlan, limit: int | None = None) -> list[dict]:
    """Per PCP rank, its rows (the first ``limit`` when given)."""
    end = plan.num_rows if limit is None else min(limit, plan.num_rows)
    req = plan.row_request.np()[:end].tolist()
    offs = plan.row_query_offset.np()[:, :end].tolist()
    lens = plan.row_num_tokens.np()[:, :end].tolist()
    starts = plan.row_token_start.np()[:, :end].tolist()
    writes = plan.row_kv_write.np()[:, :end].tolist()
    pos = plan.row_position_start()[:, :end].tolist()
    out = []
    for p in range(plan.config.pcp_size):
        rows = [
            {"request": req[j], "query_offset": offs[p][j], "num_tokens": lens[p][j],
             "position_start": pos[p][j], "token_start": starts[p][j],
             "kv_write": bool(writes[p][j]), "decode": j < plan.num_decode_rows}
            for j in range(len(req))
        ]
        out.append({"rank": p, "num_tokens": plan.num_tokens[p],
                    "padded_num_tokens": plan.padded_num_tokens,
                    "padding": plan.padded_num_tokens - plan.num_tokens[p], "rows": rows})
    return out


MAX_INDICES = 2**24  # --indices lists at most this many deinterleave entries (about 200 MB)


def chunks_table(plan: StepPlan, with_indices: bool, limit: int | None = None) -> list[dict]:
    """Per gather chunk (the first ``limit`` when given)."""
    cfg = plan.config
    if with_indices:
        count = sum(chunk.total for chunk in plan.gather_chunks)
        if count > MAX_INDICES:
            raise CapacityError(f"--indices would list {count:,} deinterleave indices: limit "
                                f"{MAX_INDICES:,} (leave --indices off for this plan)")
    out = []
    for k, chunk in enumerate(plan.gather_chunks[:limit]):
        entry = {"index": k, "requests": chunk.requests.np().tolist(),
                 "pad": chunk.pad.np().tolist(), "padded_local_total": chunk.padded_local_total,
                 "total": chunk.total, "padded_local_cu": chunk.padded_local_cu.np().tolist(),
                 "global_cu": chunk.global_cu.np().tolist()}
        if with_indices:
            entry["deinterleave"] = chunk.deinterleave(cfg.dcp_size,
                                                       cfg.interleave_size).tolist()
        out.append(entry)
    return out


def collectives_table(plan: StepPlan, limit: int | None = None) -> list[dict]:
    """Per collective (the first ``limit`` when given); ``layers`` (where some layers share an
    indexer top-k) lists the layers a per-layer entry is issued on, and only then appears."""
    layers = plan.config.num_layers
    out = []
    for c in plan.collectives[:limit]:
        entry = {"name": c.name, "op": c.op, "group": c.group, "dtype": c.dtype,
                 "shape": list(c.shape), "bytes": c.bytes, "per_layer": c.per_layer,
                 "bytes_per_step": c.bytes * c.issues_per_step(layers)}
        if c.layers:
            entry["layers"] = list(c.layers)
        out.append(entry)
    return out


def sampled_table(plan: StepPlan) -> dict | None:
    """The sampled rows of a step that names them (None otherwise): per sampled request its
    index, the PCP rank that supplies its last token and the token's index there."""
    if plan.is_sampled is None:
        return None
    src = plan.sampled_source.np().tolist()
    reqs = [int(i) for i in np.nonzero(plan.is_sampled.np())[0]]
    return {"rows_per_rank": plan.sampled_rows_per_rank(),
            "requests": [{"request": i, "pcp_rank": r, "token": t}
                         for i, (r, t) in zip(reqs, src)]}


def workspace(plan: StepPlan) -> dict:
    """Bytes a rank's buffers need for this step, next to what the config sizes them for."""
    cfg = plan.config
    per_token = cfg.kv_bytes_per_token + cfg.index_k_bytes_per_token
    gathered = max((cfg.dcp_size * c.padded_local_total for c in plan.gather_chunks), default=0)
    insert = cfg.pcp_size * (plan.padded_num_tokens - plan.num_decode_tokens) \
        if cfg.pcp_size > 1 and plan.num_decode_rows < plan.num_rows else 0
    act_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}[cfg.activation_dtype]
    return {
        "gather_rows": gathered,
        "gather_bytes": gathered * per_token,
        "gather_capacity_bytes": cfg.gather_workspace_tokens * per_token,
        "insert_rows": insert,
        "insert_bytes": insert * per_token,
        "restore_bytes": cfg.pcp_size * (plan.padded_num_tokens if plan.is_sampled is None
                                         else plan.sampled_rows_per_rank())
        * cfg.hidden_size * act_bytes if cfg.pcp_size > 1 else 0,
    }


def plan_report(plan: StepPlan, *, with_indices: bool = False, with_cost: bool = True,
                max_rows: int | None = None, schema_version: int = SCHEMA_VERSION) -> dict:
    """The report; ``max_rows`` caps the requests, the rows per rank, the gather chunks and the
    collectives listed (a text report's view: what is built stays bounded by what is shown;
    ``totals`` then counts them all), None lists everything.
    ``schema_version`` is the plan file's (the default, the version this cpplan writes, is a
    freshly compiled plan's)."""
    report = {
        "digest": digest(plan).hex(),
        "schema_version": schema_version,
        "step_id": plan.step_id,
        "config": msgspec.to_builtins(plan.config),
        "num_decode_rows": plan.num_decode_rows,
        "num_decode_tokens": plan.num_decode_tokens,
        "padded_num_tokens": plan.padded_num_tokens,
        "cudagraph_size": plan.cudagraph_size,
        "requests": requests_table(plan, max_rows),
        "ranks": ranks_table(plan, max_rows),
        "gather_chunks": chunks_table(plan, with_indices, max_rows),
        "collectives": collectives_table(plan, max_rows),
        "workspace": workspace(plan),
    }
    sampled = sampled_table(plan)
    if sampled is not None:
        report["sampled"] = sampled
    if with_cost:
        report["cost"] = _cost_dict(plan)
    return report
