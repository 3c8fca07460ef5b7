"""cpplan's per-rank forward (P = W = 1) against the model's own transformers forward,
teacher-forced over the same tokens: greedy tokens and logits, both models, both KV formats,
top-k above every context (the stock model) and below (the model given cpplan's indexer
numerics); chunked prefill (budget 32) mixed with decodes, prompts of 1 to 100 tokens. And
the same check failing when the softmax scale or a RoPE convention is wrong."""

import pytest

pytest.importorskip("transformers")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from harness import compare, prompts, serve  # noqa: E402

from cpplan.api import LayerCache, StepExecutor, compile  # noqa: E402
from cpplan.models import (  # noqa: E402
    RankForward,
    derive,  # noqa: E402
    model_spec,
    parallel_config,
    rank_token_ids,
)
from cpplan.models.reference import reference_generate  # noqa: E402
from cpplan.schemas.errors import ConfigError, TensorArgError  # noqa: E402
from cpplan.schemas.step import StepInput  # noqa: E402

NAMES = ("tiny-deepseek-v32", "tiny-glm-5")
KV = ("bf16", "fp8_ds_mla")
PROMPTS = prompts([5, 70, 1, 100])  # contexts to 110: above topk 32, below topk 128
NEW = 10


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("name", NAMES)
def test_tokens_equal_the_stock_model_where_topk_covers_every_context(tiny_models, name, kv):
    model = tiny_models[name][1]
    got = compare(model, serve(model, PROMPTS, NEW, kv_cache_dtype=kv), kv_cache_dtype=kv)
    assert got.failures(min_close=1.0 if kv == "bf16" else 0.85) == [], got


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("name", NAMES)
def test_tokens_equal_the_model_with_cpplans_indexer_below_the_contexts(tiny_models, name, kv):
    model = tiny_models[name][0]
    served = serve(model, PROMPTS, NEW, kv_cache_dtype=kv)
    got = compare(model, served, indexer="cpplan", kv_cache_dtype=kv)
    assert got.failures() == [], got
    stock = compare(model, served, kv_cache_dtype=kv)  # the unquantised indexer differs
    assert stock.close < got.close, (stock, got)


@pytest.mark.parametrize("regime", ["covers", "below"])
@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_equal_the_models_own_generate(tiny_models, name, regime):
    model = tiny_models[name][1 if regime == "covers" else 0]
    indexer = "stock" if regime == "covers" else "cpplan"
    batch = prompts([70, 3], seed=1)
    served = serve(model, batch, 8, kv_cache_dtype="bf16")
    for prompt, r in zip(batch, served):
        want = reference_generate(model, prompt, 8, indexer=indexer, kv_cache_dtype="bf16")
        assert r.output == want


@pytest.mark.parametrize("name", NAMES)
def test_a_wrong_softmax_scale_fails_the_check(tiny_models, name, monkeypatch):
    model = tiny_models[name][1]
    monkeypatch.setattr(derive, "softmax_scale", lambda config: 576 ** -0.5)
    assert model_spec(model).sm_scale == 576 ** -0.5  # the executor and forward both use it
    got = compare(model, serve(model, PROMPTS[:2], 6), kv_cache_dtype="bf16")
    assert got.failures() and got.close == 0 and got.tokens < got.positions, got


@pytest.mark.parametrize("which", ["mla", "indexer"])
@pytest.mark.parametrize("name", NAMES)
def test_a_wrong_rope_convention_fails_the_check(tiny_models, name, which, monkeypatch):
    model = tiny_models[name][1 if which == "mla" else 0]
    mla, idx = derive.ROPE[model.config.model_type]
    other = {"half": "interleave", "interleave": "half"}
    wrong = (other[mla], idx) if which == "mla" else (mla, other[idx])
    monkeypatch.setitem(derive.ROPE, model.config.model_type, wrong)
    served = serve(model, PROMPTS[:2], 6)
    got = compare(model, served, indexer="cpplan", kv_cache_dtype="bf16")
    assert got.failures(), got


def _one_step(executor, config, tokens):
    """A bound one-request prefill of ``tokens`` and empty caches."""
    plan = compile(config, StepInput.build(0, ["a"], [0], [len(tokens)], [True]))
    bound = executor.bind(plan, np.array([[1, 2]], dtype=np.int32))
    return bound, [LayerCache.empty(config, 4, "cpu") for _ in range(config.num_layers)]


def test_the_forward_refuses_an_executor_or_rows_that_do_not_fit(tiny_models):
    model = tiny_models["tiny-deepseek-v32"][0]
    cfg = parallel_config(model, kv_cache_dtype="bf16", max_model_len=256)
    forward = RankForward(model)
    wrong = StepExecutor.local(cfg, sm_scale=576 ** -0.5, max_tokens=16, max_requests=2)
    bound, caches = _one_step(wrong, cfg, [1, 2, 3])
    with pytest.raises(ConfigError, match=r"executor sm_scale: got 0\.041.*expected the model"):
        forward(wrong, bound, caches, rank_token_ids(bound, [[1, 2, 3]]))
    ex = StepExecutor.local(cfg, sm_scale=model_spec(model).sm_scale, max_tokens=16,
                            max_requests=2)
    bound, caches = _one_step(ex, cfg, [1, 2, 3])
    with pytest.raises(TensorArgError, match=r"token_ids is \(3,\) torch.int32; expected"):
        forward(ex, bound, caches, torch.tensor([1, 2, 3], dtype=torch.int32))
    with pytest.raises(TensorArgError, match="caches: got 2; expected one per layer"):
        forward(ex, bound, caches[:2], rank_token_ids(bound, [[1, 2, 3]]))
    with pytest.raises(TensorArgError, match="request 0 has 2 tokens; expected at least 3"):
        rank_token_ids(bound, [[1, 2]])
    other = parallel_config(tiny_models["tiny-glm-5"][0], kv_cache_dtype="bf16")
    ex_glm = StepExecutor.local(other, sm_scale=model_spec(model).sm_scale, max_tokens=16,
                                max_requests=2)
    with pytest.raises(ConfigError, match="executor config num_layers: got 4; expected 3"):
        forward(ex_glm, bound, caches, rank_token_ids(bound, [[1, 2, 3]]))


def test_shared_indexer_layers_select_as_their_source_layer(tiny_models):
    """GLM-5's shared layers (1 and 3) attend with layers 0 and 2's top-k through the
    runtime's indexer_sources: the same logits as recomputing the source layer's indexer
    there, and (test above) as the model, whose shared layers reuse the top-k."""
    model = tiny_models["tiny-glm-5"][0]
    assert parallel_config(model).indexer_sources == (0, 0, 2, 2)
    shared = serve(model, PROMPTS[:2], 6, share_indexer=True)
    repeated = serve(model, PROMPTS[:2], 6, share_indexer=False)
    for a, b in zip(shared, repeated):
        assert a.output == b.output
        assert torch.equal(torch.stack(a.logits), torch.stack(b.logits))
