"""Loading: presets, local checkpoint folders, the dims the runtime takes, a missing extra."""

import sys

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from cpplan.models import build_model, check_dims, load_model, preset_config  # noqa: E402
from cpplan.models.reference import teacher_forced_logits  # noqa: E402
from cpplan.schemas.errors import ConfigError  # noqa: E402

BAD_DIMS = [
    ("tiny-deepseek-v32", {"kv_lora_rank": 256}, "kv_lora_rank: got 256; expected 512"),
    ("tiny-deepseek-v32", {"qk_rope_head_dim": 32}, "qk_rope_head_dim: got 32; expected 64"),
    ("tiny-glm-5", {"index_head_dim": 64}, "index_head_dim: got 64; expected 128"),
    ("tiny-glm-5", {"num_attention_heads": 0}, "num_attention_heads: got 0; expected a pos"),
    ("tiny-deepseek-v32", {"index_n_heads": 0}, "index_n_heads: got 0; expected a positive"),
    ("tiny-glm-5", {"indexer_types": ["shared", "full", "full", "full"]},
     "indexer_types: got ['shared', 'full', 'full', 'full']; expected"),
]


@pytest.mark.parametrize("name, fields, message", BAD_DIMS)
def test_dims_that_do_not_fit_are_refused_in_one_line(name, fields, message):
    config = preset_config(name, **fields)
    with pytest.raises(ConfigError) as err:
        build_model(config)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_checkpoint_folder_is_checked_before_its_weights_are_read(tmp_path):
    import json

    build_model(preset_config("tiny-deepseek-v32")).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "kv_lora_rank": 256}))
    for weights in tmp_path.glob("*.safetensors"):
        weights.write_bytes(b"not read")
    with pytest.raises(ConfigError, match=r"^kv_lora_rank: got 256; expected 512"):
        load_model(str(tmp_path))


def test_a_saved_preset_loads_back_with_the_same_logits(tmp_path):
    model = build_model(preset_config("tiny-glm-5"), seed=3)
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    tokens = [5, 7, 11, 13, 17]
    assert torch.equal(teacher_forced_logits(model, tokens), teacher_forced_logits(loaded, tokens))
    assert loaded.config.indexer_types == ["full", "shared", "full", "shared"]


def test_bad_folders_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="expected a preset .* or a folder holding config"):
        load_model(str(tmp_path))
    build_model(preset_config("tiny-deepseek-v32")).save_pretrained(tmp_path)
    (weights,) = tmp_path.glob("*.safetensors")
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ConfigError, match="the weights cannot be loaded") as err:
        load_model(str(tmp_path))
    assert "\n" not in str(err.value)
    weights.unlink()
    with pytest.raises(ConfigError, match="got no weights; expected safetensors weights"):
        load_model(str(tmp_path))


def test_missing_tensors_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    build_model(preset_config("tiny-deepseek-v32")).save_pretrained(tmp_path)
    (weights,) = tmp_path.glob("*.safetensors")
    tensors = load_file(weights)
    dropped = "model.layers.1.self_attn.kv_b_proj.weight"
    del tensors[dropped]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=f"lack 1 tensors .first '{dropped}'"):
        load_model(str(tmp_path))


def test_presets_are_seeded_and_unknown_names_refused():
    a, b = (load_model("tiny-deepseek-v32", seed=s) for s in (1, 1))
    c = load_model("tiny-deepseek-v32", seed=2)
    wa, wb, wc = (m.model.layers[0].self_attn.q_a_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    with pytest.raises(ConfigError, match="model preset: got 'tiny-llama'"):
        preset_config("tiny-llama")
    with pytest.raises(ConfigError, match="model_type: got 'llama'"):
        check_dims({"model_type": "llama"})


def test_a_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    with pytest.raises(ConfigError) as err:
        preset_config("tiny-glm-5")
    assert 'pip install "torch==2.13.0" -e ".[runtime,cli,hf]"' in str(err.value)
    assert "\n" not in str(err.value)
