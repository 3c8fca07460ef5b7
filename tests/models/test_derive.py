"""The softmax scale and the ParallelConfig derived from a model's config, against the model's
own attention module (its ``scaling`` attribute is the reference)."""

import math

import pytest

pytest.importorskip("transformers")

from cpplan.models import build_model, model_spec, parallel_config, preset_config  # noqa: E402
from cpplan.models.derive import yarn_mscale  # noqa: E402
from cpplan.schemas.errors import ConfigError  # noqa: E402

# DeepSeek-V3.2's own rope_parameters (config.json of deepseek-ai/DeepSeek-V3.2-Exp)
DSV32_YARN = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
              "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096,
              "rope_theta": 10000.0}


def _hf_scaling(model) -> set:
    return {layer.self_attn.scaling for layer in model.model.layers}


@pytest.mark.parametrize("name, overrides", [
    ("tiny-deepseek-v32", {}),
    ("tiny-glm-5", {}),
    ("tiny-deepseek-v32", {"rope_parameters": DSV32_YARN, "qk_nope_head_dim": 128,
                           "max_position_embeddings": 163840}),
    ("tiny-glm-5", {"rope_parameters": {**DSV32_YARN, "factor": 8.0, "mscale_all_dim": 0.707},
                    "max_position_embeddings": 32768}),
    ("tiny-glm-5", {"rope_parameters": {**DSV32_YARN, "mscale_all_dim": 0.0},
                    "max_position_embeddings": 32768}),
])
def test_scale_is_the_attention_modules_own(name, overrides):
    model = build_model(preset_config(name, **overrides))
    (want,) = _hf_scaling(model)
    assert model_spec(model).sm_scale == pytest.approx(want, rel=1e-15)


def test_deepseek_v32_real_dims_scale():
    config = preset_config("tiny-deepseek-v32", rope_parameters=DSV32_YARN,
                           qk_nope_head_dim=128, max_position_embeddings=163840)
    scale = model_spec(config).sm_scale
    assert scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-15)
    assert round(scale, 5) == 0.13523
    assert scale != pytest.approx(576 ** -0.5)
    assert yarn_mscale(1.0, 1.0) == 1.0 and yarn_mscale(0.5, 1.0) == 1.0


def test_parallel_config_from_the_model():
    glm = preset_config("tiny-glm-5")
    cfg = parallel_config(glm, pcp=2, dcp=2, interleave=2, kv_cache_dtype="bf16",
                          max_model_len=1024)
    assert (cfg.pcp_size, cfg.dcp_size, cfg.interleave_size, cfg.block_size) == (2, 2, 2, 64)
    assert (cfg.num_heads, cfg.index_num_heads, cfg.topk, cfg.num_layers) == (8, 4, 32, 4)
    assert (cfg.hidden_size, cfg.max_model_len, cfg.kv_cache_dtype) == (256, 1024, "bf16")
    assert (cfg.qk_head_dim, cfg.v_head_dim, cfg.index_head_dim) == (576, 512, 128)
    assert cfg.activation_dtype == "float32"
    assert parallel_config(glm, device="cuda").activation_dtype == "bfloat16"
    assert parallel_config(glm).max_model_len == glm.max_position_embeddings
    assert model_spec(glm).sources == (0, 0, 2, 2)
    assert model_spec(preset_config("tiny-deepseek-v32")).sources == (0, 1, 2)
    if "indexer_sources" in type(cfg).__struct_fields__:
        assert cfg.indexer_sources == (0, 0, 2, 2)
        assert parallel_config(glm, share_indexer=False).indexer_sources == ()
    with pytest.raises(ConfigError, match="unsupported topology"):
        parallel_config(glm, pcp=2, dcp=3)


def test_rope_conventions_are_the_modeling_files():
    # the indexer of DeepSeek-V3.2 calls the half-split rotation, GLM-5's the interleaved one;
    # both MLA attentions the interleaved one (read from the source, not assumed)
    import inspect

    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as ds
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm

    ds_ix, glm_ix = (inspect.getsource(m.forward) for m in (ds.DeepseekV32Indexer,
                                                          glm.GlmMoeDsaIndexer))
    assert "apply_rotary_pos_emb(q_rot" in ds_ix and "_interleave" not in ds_ix
    assert "apply_rotary_pos_emb_interleave(q_rot" in glm_ix
    for attn in (ds.DeepseekV32Attention, glm.GlmMoeDsaAttention):
        assert "apply_rotary_pos_emb_interleave(q_rot, k_rot" in inspect.getsource(attn.forward)
    assert model_spec(preset_config("tiny-deepseek-v32")).indexer_rope == "half"
    assert model_spec(preset_config("tiny-glm-5")).indexer_rope == "interleave"
    assert {model_spec(preset_config(n)).mla_rope for n in ("tiny-deepseek-v32",
                                                              "tiny-glm-5")} == {"interleave"}
