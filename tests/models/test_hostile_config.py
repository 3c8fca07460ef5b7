"""A checkpoint's config.json as a hostile user writes it: sizes far beyond any model, values
of the wrong type. Each is one ConfigError line from the JSON alone, before transformers builds
a config (whose per-layer lists follow num_hidden_layers) or anything of that size exists."""

import json
import tracemalloc

import pytest

from cpplan.models.loading import PRESETS, check_dims, model_config
from cpplan.schemas.errors import ConfigError


def _raw(**fields) -> dict:
    """The tiny DeepSeek-V3.2 preset as a config.json dict, ``fields`` over it."""
    model_type, base = PRESETS["tiny-deepseek-v32"]
    return {"model_type": model_type, **base, **fields}


def _error(raw) -> str:
    with pytest.raises(ConfigError) as err:
        check_dims(raw)
    return str(err.value)


def test_the_preset_passes():
    check_dims(_raw())
    check_dims(_raw(num_hidden_layers=4096))


@pytest.mark.parametrize("layers", [1_000_000_000, 2**31 - 1, 2**63])
def test_a_billion_layers_is_refused_without_building_a_list_of_them(layers):
    tracemalloc.start()
    try:
        message = _error(_raw(num_hidden_layers=layers))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert message == f"num_hidden_layers: got {layers}; expected at most 4096"
    assert peak < 2**20  # a list of `layers` strings would be 8 bytes each


@pytest.mark.parametrize("field, value, message", [
    ("num_attention_heads", 10**6, "num_attention_heads: got 1000000; expected at most 4096"),
    ("index_n_heads", 4097, "index_n_heads: got 4097; expected at most 4096"),
    ("vocab_size", 2**40, f"vocab_size: got {2**40}; expected at most {2**31 - 1}"),
    ("hidden_size", 2**31, f"hidden_size: got {2**31}; expected at most {2**31 - 1}"),
    ("num_hidden_layers", True, "num_hidden_layers: got True; expected a positive integer"),
    ("num_hidden_layers", 1.5, "num_hidden_layers: got 1.5; expected a positive integer"),
    ("model_type", ["deepseek_v32"],
     "model_type: got ['deepseek_v32']; expected one of deepseek_v32, glm_moe_dsa"),
    ("kv_lora_rank", 512.0, "kv_lora_rank: got 512.0; expected 512, the only value cpplan's "
                            "kernels and cache formats take"),
    ("indexer_types", "full", "indexer_types: got 'full'; expected 'full' or 'shared' for each "
                              "of 3 layers, the first 'full'"),
    ("indexer_types", ["full", ["x"], "full"], "indexer_types: got ['full', ['x'], 'full']; "
     "expected 'full' or 'shared' for each of 3 layers, the first 'full'"),
])
def test_sizes_and_types_out_of_range(field, value, message):
    assert _error(_raw(**{field: value})) == message


def test_a_long_value_is_cut_in_the_line():
    message = _error(_raw(indexer_types=["full"] * 2 + ["shard"] * 1000))
    assert message == ("indexer_types: got ['full', 'full', " + "'shard', " * 5 + "'shard'] "
                       "(the first 8 of 1002 items); expected 'full' or 'shared' for each of 3 "
                       "layers, the first 'full'")


def test_a_checkpoint_folder_is_refused_from_its_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_raw(num_hidden_layers=10**9)))
    with pytest.raises(ConfigError) as err:
        model_config(str(tmp_path))
    assert str(err.value) == "num_hidden_layers: got 1000000000; expected at most 4096"
