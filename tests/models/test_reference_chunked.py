"""The reference forward in query chunks (cpplan.models.reference_attention, the chunked
selections of cpplan.models.reference, the budget of cpplan.models.memory) against the model's
own eager forward and a per-query loop written here: the same logits and selections at any
chunk size, memory O(chunk x S) rather than O(S^2), the chunk sized from the memory free, and
one ConfigError line where not one row fits."""

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from harness import prompts  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from cpplan.models import memory  # noqa: E402
from cpplan.models.reference import (  # noqa: E402
    _indexer_qk,
    _indexer_weights,
    auto_rows,
    cpplan_topk,
    selection_overlap,
    stock_topk,
    teacher_forced_logits,
)
from cpplan.schemas.errors import ConfigError  # noqa: E402

# the chunked forward splits every float32 matrix product by query rows, and CPU kernels sum a
# product's reduction in another order for another number of rows (one row: a matrix-vector
# kernel); measured up to 2e-5 on these logits (chunks of 7 rows came out bit-equal), 500x
# below the check's tolerance (cpplan.serve.check.TOL)
LOGIT_ATOL = 1e-4


def _naive_cpplan_topk(q, k, w, topk):
    """One query at a time, no einsum: fp8 values exactly as cpplan_topk's (its fp8_pow2, tested
    against the runtime in test_reference.py), scores in float64, causal, ties by position."""
    from cpplan.models.reference import fp8_pow2

    qv, qs = fp8_pow2(q.float())
    kv, ks = fp8_pow2(k.float())
    kd = (kv * ks[:, None]).double()
    out = []
    for i in range(q.shape[0]):
        score = torch.zeros(i + 1, dtype=torch.float64)
        for h in range(q.shape[1]):
            score += float(w[i, h]) * float(qs[i, h]) * (kd[: i + 1] @ qv[i, h].double()).clamp_min(0)
        keys = sorted(range(i + 1), key=lambda t: (-float(score[t]), t))
        out.append(keys[:topk])
    return out


def test_chunked_cpplan_topk_equals_whole_and_a_per_query_loop():
    g = torch.Generator().manual_seed(3)
    n, heads, topk = 70, 4, 16
    q, k = torch.randn(1, n, heads, 128, generator=g), torch.randn(1, n, 128, generator=g)
    w = torch.randn(1, n, heads, generator=g)
    k[:, 40:50] = k[:, 30:40]  # equal keys: ties, broken by position
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None]
    whole = cpplan_topk(q, k, w, causal, topk)
    for rows in (1, 7, n):
        # bit-equal: the float64 logits of fp8 values are exact, each row sums its own heads
        assert torch.equal(cpplan_topk(q, k, w, None, topk, rows=rows), whole), rows
    want = _naive_cpplan_topk(q[0], k[0], w[0], topk)
    assert [row[: min(topk, j + 1)] for j, row in enumerate(whole[0].tolist())] == want


@pytest.mark.parametrize("name", ["tiny-deepseek-v32", "tiny-glm-5"])
def test_chunked_stock_topk_selects_what_transformers_indexer_does(tiny_models, name):
    model = tiny_models[name][0]
    ix = model.model.layers[0].self_attn.indexer
    g = torch.Generator().manual_seed(5)
    n = 90
    hidden = torch.randn(1, n, model.config.hidden_size, generator=g)
    q_resid = torch.randn(1, n, model.config.q_lora_rank, generator=g)
    pos = model.model.rotary_emb(hidden, torch.arange(n)[None])
    mask = torch.ones(1, n, n, dtype=torch.bool).tril()
    theirs = type(ix).forward(ix, hidden, q_resid, pos, mask, None)
    q, k = _indexer_qk(ix, hidden, q_resid, pos)
    w = _indexer_weights(ix, hidden)
    for rows in (1, 13):
        ours = stock_topk(q, k, w, ix.index_topk, softmax_scale=ix.softmax_scale, rows=rows)
        for j in range(n):  # beyond a row's causal keys transformers' topk takes masked ones
            m = min(ix.index_topk, j + 1)
            assert sorted(ours[0, j, :m].tolist()) == sorted(theirs[0, j, :m].tolist()), (rows, j)


@pytest.mark.parametrize("name", ["tiny-deepseek-v32", "tiny-glm-5"])
@pytest.mark.parametrize("indexer", ["stock", "cpplan"])
def test_chunked_forward_equals_the_models_own(tiny_models, name, indexer):
    model = tiny_models[name][0]
    tokens = prompts([120])[0]
    assert auto_rows(model, len(tokens)) is None  # the memory free holds every row here
    own = teacher_forced_logits(model, tokens, indexer=indexer)
    assert own.shape == (120, model.config.vocab_size)
    for rows in (1, 17, 120):
        got = teacher_forced_logits(model, tokens, indexer=indexer, rows=rows)
        torch.testing.assert_close(got, own, atol=LOGIT_ATOL, rtol=0)
    picked = [3, 64, 119]
    got = teacher_forced_logits(model, tokens, picked, indexer=indexer, rows=9)
    torch.testing.assert_close(got, own[picked], atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("name", ["tiny-deepseek-v32", "tiny-glm-5"])
@pytest.mark.parametrize("indexer,kv", [("cpplan", "fp8_ds_mla"), ("stock", "bf16")])
def test_chunked_forward_with_the_kv_rounded(tiny_models, name, indexer, kv):
    """One chunk is the model's own products, so its logits match; smaller chunks sum in
    another order, and a latent a few ulps off may round to another bf16 / fp8 value (the
    same mechanism cpplan.serve.check tolerates against cpplan's own forward, where a selected
    key that changes moves the later positions too): the check's own rule holds, at least
    MIN_CLOSE of the positions within its tolerance and those keeping their argmax (chunks of
    2 rows kept 85 of 120 on tiny-glm-5, every one from position 51 on beyond it)."""
    from cpplan.serve.check import MIN_CLOSE, TOL

    model = tiny_models[name][0]
    tokens = prompts([120])[0]
    own = teacher_forced_logits(model, tokens, indexer=indexer, kv_cache_dtype=kv)
    got = teacher_forced_logits(model, tokens, indexer=indexer, kv_cache_dtype=kv, rows=120)
    torch.testing.assert_close(got, own, atol=LOGIT_ATOL, rtol=0)
    for rows in (1, 2, 17):
        got = teacher_forced_logits(model, tokens, indexer=indexer, kv_cache_dtype=kv,
                                    rows=rows)
        close = (got - own).abs().amax(-1) <= TOL
        assert int(close.sum()) >= MIN_CLOSE * len(tokens), rows
        assert torch.equal(got.argmax(-1)[close], own.argmax(-1)[close]), rows


def test_chunked_selection_overlap_equals_the_models_own(tiny_models):
    model = tiny_models["tiny-glm-5"][0]
    tokens = prompts([100])[0]
    own = selection_overlap(model, tokens)
    assert len(own) == 2 and all(0.5 < x < 1.0 for x in own)  # two full layers, topk 32 < 100
    assert selection_overlap(model, tokens, rows=11) == pytest.approx(own, abs=1e-12)


class _Largest(TorchFunctionMode):
    """The bytes of the largest tensor any torch function returns inside the block."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.bytes = max(self.bytes, x.numel() * x.element_size())
        return out


def _largest(model, n, rows):
    with _Largest() as seen:
        teacher_forced_logits(model, prompts([n])[0], [n - 1], indexer="cpplan",
                              kv_cache_dtype="fp8_ds_mla", rows=rows)
    return seen.bytes


def test_a_fixed_chunk_makes_the_largest_tensor_linear_in_the_sequence(tiny_models):
    model = tiny_models["tiny-glm-5"][0]
    own = [_largest(model, n, None) for n in (300, 600)]
    chunked = [_largest(model, n, 8) for n in (300, 600)]
    assert own[1] >= 3.9 * own[0]  # the model's own: [H, S, S] scores, quadratic
    assert chunked[1] <= 2.05 * chunked[0]  # O(rows x S) and O(S) tensors only
    need = memory.reference_bytes(model.config, 600, 1)
    assert chunked[1] <= need.for_rows(8) and own[1] <= need.for_rows(600)


def test_a_tiny_budget_chunks_and_gives_the_same_logits(tiny_models, monkeypatch):
    model = tiny_models["tiny-deepseek-v32"][0]
    tokens = prompts([200])[0]
    need = memory.reference_bytes(model.config, 200, 4)
    budget = int((need.fixed + 5 * need.per_row) / memory.USABLE_SHARE) + 1
    monkeypatch.setattr(memory, "free_bytes", lambda device: budget)
    assert auto_rows(model, 200, 4) == 5
    got = teacher_forced_logits(model, tokens, [10, 50, 150, 199], indexer="cpplan")
    monkeypatch.setattr(memory, "free_bytes", lambda device: 1 << 40)
    assert auto_rows(model, 200, 4) is None
    own = teacher_forced_logits(model, tokens, [10, 50, 150, 199], indexer="cpplan")
    torch.testing.assert_close(got, own, atol=LOGIT_ATOL, rtol=0)


def test_no_row_fitting_is_one_config_error_line(tiny_models, monkeypatch):
    model = tiny_models["tiny-deepseek-v32"][0]
    need = memory.reference_bytes(model.config, 200, 4)
    monkeypatch.setattr(memory, "free_bytes", lambda device: need.fixed)
    with pytest.raises(ConfigError) as err:
        auto_rows(model, 200, 4, what="request 'a'")
    text = str(err.value)
    assert "\n" not in text and "request 'a' (200 tokens)" in text and "GiB free" in text


@pytest.mark.parametrize("budget,rows", [(0, 0), (10_000, 0), (10_000 + 3 * 500, 3),
                                         (10**9, 100)])
def test_query_rows_fits_the_usable_share(budget, rows):
    need = memory.ReferenceBytes(num_tokens=100, fixed=8_000, per_row=400)
    assert memory.query_rows(need, budget) == rows
    if 0 < rows < 100:  # the largest chunk that fits, and no more
        assert need.for_rows(rows) <= budget * memory.USABLE_SHARE < need.for_rows(rows + 1)
