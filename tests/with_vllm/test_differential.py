"""cpplan.vllm's ``local_batch`` and ``dsa_metadata`` against vLLM 0.32's own code
(tests/with_vllm/vllm_side.py), field by field, over seeded random global batches and hand cases.

Each case draws a topology (P in {1, 2, 4, 8}, W in {1, 2, 4, 8} as cpplan's configs allow them:
W == 1, P == 1 or W == P), an interleave in {1, 4, 16, 64}, the decode ownership (vLLM's
``shard_decode_requests``, on or off where P > 1 and W == 1), a CUDA-graph mode (eager,
PIECEWISE padded to a size at or above vLLM's own dispatch count, FULL for decode-only batches
under PCP) and the DSA budgets; cpplan compiles the plan from the batch's columns
(tests/with_vllm/batches.py ``step_of``), vLLM partitions its own InputBatch. A disagreement is
shrunk (requests dropped, then shortened, while it still disagrees) and reported by field.
Needs vLLM: the CI's second venv (.ci/run) runs this file.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import pytest

pytest.importorskip("vllm")

from cpplan.planner import compile as compile_plan  # noqa: E402
from cpplan.schemas.errors import ConfigError  # noqa: E402
from cpplan.vllm import DSA_FIELDS, LOCAL_BATCH_FIELDS, adapter  # noqa: E402
from tests.with_vllm import batches, vllm_side  # noqa: E402

CASES = int(os.environ.get("CPPLAN_VLLM_CASES", "2000"))
TOPOLOGIES = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (4, 1), (8, 1), (2, 2), (4, 4), (8, 8)]
INTERLEAVES = (1, 4, 16, 64)
HEADS = (16, 32, 64, 128)
RAISED: list = []  # this case's ranks whose batch vLLM's FlashMLA-sparse builder refuses


@dataclasses.dataclass(frozen=True)
class Case:
    p: int
    w: int
    interleave: int
    shard: bool
    graph: str  # NONE, PIECEWISE or FULL
    extra: int  # graph padding beyond vLLM's dispatch count
    num_heads: int
    max_model_len: int
    factor: int
    logits_mb: int

    def __str__(self) -> str:
        return (f"P={self.p} W={self.w} I={self.interleave} shard={self.shard} "
                f"graph={self.graph}+{self.extra} heads={self.num_heads} "
                f"max_model_len={self.max_model_len} factor={self.factor} "
                f"logits_mb={self.logits_mb}")


def draw_case(rng: np.random.Generator, decode_only: bool) -> Case:
    p, w = TOPOLOGIES[int(rng.integers(len(TOPOLOGIES)))]
    shard = bool(p > 1 and w == 1 and rng.random() < 0.7)
    graph = "NONE"
    if p > 1:
        modes = ["NONE", "PIECEWISE"] + (["FULL"] if decode_only else [])
        graph = modes[int(rng.integers(len(modes)))]
    return Case(p, w, int(rng.choice(INTERLEAVES)), shard, graph, int(rng.integers(0, 9)),
                int(rng.choice(HEADS)), int(rng.choice([4096, 8192])), int(rng.choice([2, 5])),
                int(rng.choice([1, 4, 512])))


# ------------------------------------------------------------------ comparing
def _same(a, b) -> str | None:
    """None when equal by value (ints of any dtype, bools, lists, arrays, tuples of arrays);
    else where they first differ."""
    if a is None or b is None:
        return None if a is None and b is None else \
            f"vLLM {'None' if a is None else 'a value'}, cpplan {'None' if b is None else 'a value'}"
    if isinstance(a, tuple) or isinstance(b, tuple):
        if not (isinstance(a, tuple) and isinstance(b, tuple)) or len(a) != len(b):
            return f"vLLM {len(a) if isinstance(a, tuple) else a!r} chunks, cpplan " \
                   f"{len(b) if isinstance(b, tuple) else b!r}"
        for k, (x, y) in enumerate(zip(a, b)):
            d = _same(x, y)
            if d:
                return f"chunk {k}: {d}"
        return None
    if isinstance(a, list) or isinstance(b, list):
        a, b = list(a), list(b)
        if a != b:
            return f"vLLM {a[:8]}, cpplan {b[:8]}"
        return None
    x, y = np.asarray(a), np.asarray(b)
    if x.ndim == 0 and y.ndim == 0:
        return None if x.item() == y.item() else f"vLLM {x.item()!r}, cpplan {y.item()!r}"
    if x.shape != y.shape:
        return f"vLLM shape {x.shape}, cpplan {y.shape}"
    bad = np.flatnonzero((x != y).reshape(-1))
    if bad.size:
        i = int(bad[0])
        return f"[{i}] vLLM {x.reshape(-1)[i].item()!r}, cpplan {y.reshape(-1)[i].item()!r}"
    return None


def vllm_answer(managers, cols, case: Case) -> tuple[list, dict]:
    """Per PCP rank vLLM's local fields; per (PCP, DCP) rank its DSA fields."""
    batch = batches.input_batch(cols)
    desc, nrp = vllm_side.descriptor("NONE"), None
    if case.graph != "NONE":
        size = vllm_side.tokens_for_dispatch(managers, cols, case.p, case.w, case.interleave,
                                             case.shard) + case.extra
        nrp = size if case.graph == "FULL" else None  # a uniform decode graph of 1 token a row
        desc = vllm_side.descriptor(case.graph, size, nrp)
    locals_, dsa = [], {}
    for rank in range(case.p):
        if case.p == 1:
            fields, local = vllm_side.global_fields(batch), batch
        else:
            fields, local = vllm_side.partition(managers, batch, case.p, rank, case.w,
                                                case.interleave, case.shard, desc)
        locals_.append(fields)
        cam = vllm_side.attention_view(local, case.graph == "FULL")
        common = vllm_side.indexer(cam, case.p, case.w, case.interleave, case.max_model_len,
                                   case.factor, case.logits_mb)
        try:
            common.update(vllm_side.flashmla(cam, case.p, case.w, case.interleave,
                                             case.num_heads, case.max_model_len, case.factor))
        except AssertionError:
            # vLLM's own builder refuses this rank's batch (a FULL graph's placeholder rank:
            # a padded decode of 0 tokens); cpplan must refuse it too
            RAISED.append(case)
            common = {"refused": True}
        for d in range(case.w):
            dsa[rank, d] = dict(common, dcp_local_seq_lens=vllm_side.dcp_local_seq_lens(
                local, case.w, d, case.interleave))
    return locals_, dsa


def cpplan_answer(cols, case: Case, graph_size: int | None):
    sizes = (graph_size,) if graph_size is not None else ()
    config = adapter.config_for(case.p, case.w, case.interleave, case.shard,
                                num_heads=case.num_heads, max_model_len=case.max_model_len,
                                cudagraph_token_sizes=sizes)
    plan = compile_plan(config, batches.step_of(cols))
    mode = {"NONE": "NONE", "PIECEWISE": "PIECEWISE", "FULL": "FULL_DECODE_ONLY"}[case.graph]
    keys = dict(cudagraph_mode=mode)
    locals_ = [adapter.local_batch(plan, r, 0, **keys) for r in range(case.p)]
    dsa = {}
    for r in range(case.p):
        for d in range(case.w):
            try:
                dsa[r, d] = adapter.dsa_metadata(plan, r, d, prefill_workspace_factor=case.factor,
                                                 indexer_max_logits_mb=case.logits_mb, **keys)
            except ConfigError as exc:
                dsa[r, d] = {"refused": str(exc)}
    return locals_, dsa


def disagreement(managers, cols, case: Case) -> str | None:
    """The first field where cpplan and vLLM differ on this batch, or None."""
    theirs_local, theirs_dsa = vllm_answer(managers, cols, case)
    size = None
    if case.graph != "NONE":
        size = vllm_side.tokens_for_dispatch(managers, cols, case.p, case.w, case.interleave,
                                             case.shard) + case.extra
    mine_local, mine_dsa = cpplan_answer(cols, case, size)
    for r in range(case.p):
        mine = dict(mine_local[r])
        mine["idx_mapping_np"] = cols["idx"][np.asarray(mine["idx_mapping_np"], dtype=np.intp)]
        for key in LOCAL_BATCH_FIELDS:
            d = _same(theirs_local[r][key], mine[key])
            if d:
                return f"local_batch PCP rank {r}: {key}: {d}"
    for (r, dr), theirs in theirs_dsa.items():
        if "refused" in theirs or "refused" in mine_dsa[r, dr]:
            if not ("refused" in theirs and "refused" in mine_dsa[r, dr]):
                refuser = "vLLM" if "refused" in theirs else "cpplan"
                return f"dsa_metadata PCP rank {r}, DCP rank {dr}: only {refuser} refuses " \
                       f"the rank's batch ({mine_dsa[r, dr].get('refused', 'an assertion')})"
            continue
        for key in DSA_FIELDS:
            d = _same(theirs[key], mine_dsa[r, dr][key])
            if d:
                return f"dsa_metadata PCP rank {r}, DCP rank {dr}: {key}: {d}"
    return None


def _smaller(cols):
    """Every one-step smaller batch: one request dropped, then one request's q or c halved
    (a decode kept a decode, a prefill chunk kept inside its prompt)."""
    n = len(cols["req_ids"])
    for i in range(n if n > 1 else 0):
        keep = [k for k in range(n) if k != i]
        yield batches.columns([cols["req_ids"][k] for k in keep], cols["c"][keep],
                              cols["q"][keep], cols["prefill_len"][keep], cols["idx"][keep])
    for i in range(n):
        for field, low in (("q", 1), ("c", 0)):
            value = int(cols[field][i])
            if value <= low:
                continue
            smaller = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in cols.items()}
            smaller[field][i] = max(low, value // 2)
            if field == "c" and smaller["c"][i] < smaller["prefill_len"][i] <= value:
                continue  # keep a decode a decode
            if field == "q":
                smaller["prefill_len"][i] -= value - smaller["q"][i]
            yield smaller


def shrink(managers, cols, case: Case) -> tuple[dict, str]:
    """The smallest batch (fewest requests, then fewest tokens) that still disagrees: the
    first smaller batch that disagrees is taken, until none does."""
    found = disagreement(managers, cols, case)
    assert found is not None
    while True:
        for smaller in _smaller(cols):
            d = _try(managers, smaller, case)
            if d:
                cols, found = smaller, d
                break
        else:
            return cols, found


def _try(managers, cols, case):
    try:
        return disagreement(managers, cols, case)
    except Exception as exc:  # noqa: BLE001 - a shrunk batch vLLM or cpplan refuses is no witness
        del exc
        return None


def _describe(cols) -> str:
    return ", ".join(f"{r}(c={int(c)} q={int(q)} prefill_len={int(pl)})" for r, c, q, pl in
                     zip(cols["req_ids"], cols["c"], cols["q"], cols["prefill_len"]))


def run_cases(managers, cases) -> tuple[int, int, list[str], int]:
    """(cases run, fields compared, disagreements as shrunk one-line reports, cases some rank
    of which vLLM's FlashMLA-sparse builder refuses)."""
    fields = len(LOCAL_BATCH_FIELDS)
    n_fields, failures, refused = 0, [], 0
    for name, cols, case in cases:
        RAISED.clear()
        found = disagreement(managers, cols, case)
        refused += bool(RAISED)
        n_fields += case.p * fields + case.p * case.w * len(DSA_FIELDS) * (not RAISED)
        if found:
            small, why = shrink(managers, cols, case)
            failures.append(f"{name} [{case}]: {why}; smallest batch: {_describe(small)}")
    return len(cases), n_fields, failures, refused


def seeded_cases(count: int):
    for seed in range(count):
        rng = np.random.default_rng([64, seed])
        decode_only = rng.random() < 0.25
        cols = (batches.decode_batch(rng) if decode_only else batches.random_batch(rng))
        yield f"seed {seed}", cols, draw_case(rng, decode_only)


def hand_cases():
    out = []
    for name, cols in batches.hand_batches().items():
        decode_only = bool((cols["c"] >= cols["prefill_len"]).all())
        for p, w in TOPOLOGIES:
            for shard in ([False, True] if p > 1 and w == 1 else [False]):
                graphs = ["NONE"] + (["PIECEWISE"] if p > 1 else []) + (
                    ["FULL"] if p > 1 and decode_only else [])
                for graph in graphs:
                    for interleave in (1, 64) if w > 1 else (1,):
                        out.append((name, cols, Case(p, w, interleave, shard, graph, 3, 64,
                                                     4096, 2, 1)))
    return out


@pytest.fixture(scope="module")
def managers():
    return vllm_side.Managers()


def _report(what: str, cases: int, fields: int, failures: list[str], refused: int) -> None:
    sys.stderr.write(f"\ncpplan.vllm differential ({what}): {cases} cases, {fields} fields "
                     f"compared, {len(failures)} disagreements; {refused} cases where "
                     f"vLLM's FlashMLA-sparse builder asserts on a rank and cpplan refuses "
                     f"alike\n")


def test_the_adapter_names_every_field_vllm_sets():
    assert set(LOCAL_BATCH_FIELDS) == set(vllm_side.LOCAL_FIELDS) | set(vllm_side.PRIVATE)


def test_hand_cases_agree_with_vllm(managers, capsys):
    cases, fields, failures, refused = run_cases(managers, hand_cases())
    with capsys.disabled():
        _report("hand cases", cases, fields, failures, refused)
    assert failures == []


def test_random_batches_agree_with_vllm(managers, capsys):
    cases, fields, failures, refused = run_cases(managers, list(seeded_cases(CASES)))
    with capsys.disabled():
        _report("seeded random batches", cases, fields, failures, refused)
    assert cases >= min(CASES, 2000)
    assert failures == [], "\n".join(failures[:10])


@pytest.mark.parametrize("field, where", [
    ("positions", "local"), ("hidden_restore_idx", "local"), ("seq_lens", "local"),
    ("indexer_chunk_specs", "dsa"), ("workspace_starts", "dsa"),
])
def test_a_wrong_field_is_caught_and_named(managers, monkeypatch, field, where):
    """Sensitivity: one value of one field changed in cpplan's answer is a disagreement naming
    that field (the suite can fail)."""
    cols = batches.hand_batches()["issue64"]
    case = Case(2, 2, 1, False, "NONE", 0, 64, 4096, 2, 1)
    assert disagreement(managers, cols, case) is None
    real = adapter.local_batch if where == "local" else adapter.dsa_metadata

    def wrong(*args, **kwargs):
        out = dict(real(*args, **kwargs))
        value = out[field]
        if value is not None and np.asarray(value).size:
            value = np.array(value, copy=True)
            value.reshape(-1)[-1] += 1
            out[field] = value
        return out

    monkeypatch.setattr(adapter, "local_batch" if where == "local" else "dsa_metadata", wrong)
    found = disagreement(managers, cols, case)
    assert found is not None and f": {field}: " in found, found
