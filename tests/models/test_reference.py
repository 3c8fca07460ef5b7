"""The references themselves: cpplan's indexer numerics and KV rounding, written in
cpplan.models.reference separately from the runtime's formats, agree with the runtime's
quantisers bit for bit; the patches touch one model instance and are undone; with top-k
above every context the two indexers select the same keys."""

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from harness import prompts  # noqa: E402

from cpplan.models.reference import (  # noqa: E402
    cpplan_topk,
    fp8_pow2,
    reference_numerics,
    round_kv,
    selection_overlap,
    teacher_forced_logits,
)
from cpplan.runtime.kernels.reference import formats  # noqa: E402
from cpplan.runtime.kernels.reference.indexer import indexer_topk  # noqa: E402
from cpplan.schemas.errors import ConfigError  # noqa: E402


def _values(n=3000, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 576, generator=g) * torch.exp(3 * torch.randn(n, 1, generator=g))
    x[:4] = torch.tensor([448.0, 448.0 * 2 ** -3, 449.0, 0.0])[:, None]  # scale edges, zero
    return x


def test_kv_rounding_matches_the_runtimes_cache_formats():
    x = _values()
    got = torch.cat(round_kv(x[:, :512], x[:, 512:], "fp8_ds_mla"), dim=-1)
    assert torch.equal(got, formats.dequantize_fp8_ds_mla(formats.quantize_fp8_ds_mla(x)))
    got = torch.cat(round_kv(x[:, :512], x[:, 512:], "bf16"), dim=-1)
    assert torch.equal(got, x.to(torch.bfloat16).float())


def test_indexer_quantisation_matches_the_runtimes():
    x = _values()[:, :128]
    values, scale = fp8_pow2(x)
    packed = formats.quantize_indexer_k(x)
    assert torch.equal(values * scale[:, None], formats.dequantize_indexer_k(packed))
    q8, w8 = formats.quantize_indexer_q(x.reshape(-1, 4, 128)[:, :, :], torch.ones(750, 4))
    assert torch.equal(q8.float(), values.reshape(-1, 4, 128))
    assert torch.equal(w8, scale.reshape(-1, 4))


def test_cpplan_topk_matches_the_runtimes_reference_indexer():
    g = torch.Generator().manual_seed(1)
    n, heads = 90, 4
    q, k = torch.randn(n, heads, 128, generator=g), torch.randn(n, 128, generator=g)
    w = torch.randn(n, heads, generator=g)
    k[40:50] = k[30:40]  # equal keys: ties, broken by position
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    got = cpplan_topk(q[None], k[None], w[None], causal[None], 16)[0]
    rows = torch.where(causal, torch.arange(n)[None, :], -1)
    want = indexer_topk(q, w, formats.quantize_indexer_k(k), rows, rows, 16)[1]
    keys = causal.sum(-1)
    for j in range(n):  # beyond a row's causal keys HF pads with masked ones, cpplan with -1
        m = min(16, int(keys[j]))
        assert got[j, :m].tolist() == want[j, :m].tolist()


def test_the_patches_touch_one_instance_and_are_undone(tiny_models):
    model, other = tiny_models["tiny-glm-5"][0], tiny_models["tiny-deepseek-v32"][0]
    tokens = prompts([60])[0]
    stock = teacher_forced_logits(model, tokens)
    with reference_numerics(model, indexer="cpplan", kv_cache_dtype="fp8_ds_mla"):
        assert "forward" in vars(model.model.layers[0].self_attn.indexer)
        assert model.model.layers[1].self_attn.indexer is None  # a shared layer: no indexer
        assert "forward" not in vars(other.model.layers[0].self_attn.indexer)
        patched = model(input_ids=torch.tensor([tokens])).logits[0]
    assert not torch.allclose(patched, stock, atol=1e-2)
    assert "forward" not in vars(model.model.layers[0].self_attn.indexer)
    assert "expand_kv" not in vars(model.model.layers[0].self_attn)
    assert torch.equal(teacher_forced_logits(model, tokens), stock)
    with pytest.raises(ConfigError, match="indexer: got 'fp8'"):
        teacher_forced_logits(model, tokens, indexer="fp8")


@pytest.mark.parametrize("name", ["tiny-deepseek-v32", "tiny-glm-5"])
def test_the_indexers_agree_where_topk_covers_the_context(tiny_models, name):
    below, covers = tiny_models[name]
    tokens = prompts([100])[0]
    assert selection_overlap(covers, tokens) == [1.0] * len(selection_overlap(covers, tokens))
    a = teacher_forced_logits(covers, tokens)
    b = teacher_forced_logits(covers, tokens, indexer="cpplan")
    assert float((a - b).abs().max()) < 1e-4  # the same keys; attention in the same fp32
    overlap = selection_overlap(below, tokens)
    assert len(overlap) == (3 if name == "tiny-deepseek-v32" else 2)
    assert all(0.9 < o < 1.0 for o in overlap), overlap
