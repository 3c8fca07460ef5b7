"""A checkpoint folder's files as a hostile user lays them out: FIFOs among config.json, the
shards, the tokenizer; JSON nested past the recursion limit or with a key given twice; only a
pickled ``pytorch_model.bin``. Each is one typed line naming the file, never a hang, a read of
a device or an unpickled file (issue 68 items 5, 9, 10)."""

import json
import os

import pytest

from cpplan.models.checkpoint import check_tokenizer_files, check_weights, read_json
from cpplan.models.loading import PRESETS, model_config
from cpplan.schemas.errors import ConfigError, InputFileError
from tests.fifo import raised_without_blocking


def _config_json(folder) -> None:
    model_type, fields = PRESETS["tiny-deepseek-v32"]
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, **fields}))


def _raises_at_once(fn, fifo) -> BaseException:
    exc = raised_without_blocking(fn, fifo)
    assert exc is not None, "no error raised"
    return exc


def _fifo_message(path) -> str:
    return f"cannot read {path}: it is a FIFO; expected a regular file"


def test_config_json_as_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "config.json")
    exc = _raises_at_once(lambda: model_config(str(tmp_path)), tmp_path / "config.json")
    assert type(exc) is InputFileError and str(exc) == _fifo_message(tmp_path / "config.json")


def test_config_json_as_a_link_to_dev_zero(tmp_path):
    (tmp_path / "config.json").symlink_to("/dev/zero")
    with pytest.raises(InputFileError) as err:
        model_config(str(tmp_path))
    assert str(err.value) == (f"cannot read {tmp_path / 'config.json'}: it is a device; "
                              "expected a regular file")


@pytest.mark.parametrize("nest", ["[" * 100_000, '{"a": ' * 100_000])
def test_config_json_nested_past_the_recursion_limit(tmp_path, nest):
    (tmp_path / "config.json").write_text('{"model_type": ' + nest)
    with pytest.raises(ConfigError) as err:
        model_config(str(tmp_path))
    assert str(err.value) == (f"{tmp_path / 'config.json'}: cannot be read as JSON (nested too "
                              "deeply: expected at most a few hundred levels of arrays and "
                              "objects)")


def test_config_json_with_a_key_given_twice(tmp_path):
    (tmp_path / "config.json").write_text('{"kv_lora_rank": 512, "kv_lora_rank": 256}')
    with pytest.raises(ConfigError) as err:
        model_config(str(tmp_path))
    assert str(err.value) == (f"{tmp_path / 'config.json'}: cannot be read as JSON (key "
                              "'kv_lora_rank' given twice in one object)")


def test_read_json_takes_a_bom_and_refuses_bytes_that_are_not_utf8(tmp_path):
    path = tmp_path / "a.json"
    path.write_bytes(b'\xef\xbb\xbf{"a": [1]}')
    assert read_json(str(path)) == {"a": [1]}
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ConfigError, match=r"a\.json: cannot be read as JSON \('utf-8' codec"):
        read_json(str(path))


def _index(folder, *shards) -> None:
    weight_map = {f"t{k}": name for k, name in enumerate(shards)}
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))


def test_a_shard_named_by_the_index_as_a_fifo(tmp_path):
    (tmp_path / "model-1.safetensors").write_bytes(b"x")
    os.mkfifo(tmp_path / "model-2.safetensors")
    _index(tmp_path, "model-1.safetensors", "model-2.safetensors")
    exc = _raises_at_once(lambda: check_weights(str(tmp_path)), tmp_path / "model-2.safetensors")
    assert type(exc) is InputFileError
    assert str(exc) == _fifo_message(tmp_path / "model-2.safetensors")


def test_the_shards_of_an_index_are_listed(tmp_path):
    for name in ("a.safetensors", "b.safetensors"):
        (tmp_path / name).write_bytes(b"x")
    _index(tmp_path, "b.safetensors", "a.safetensors", "b.safetensors")
    assert check_weights(str(tmp_path)) == [str(tmp_path / "a.safetensors"),
                                            str(tmp_path / "b.safetensors")]


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd"])
def test_a_shard_outside_the_folder(tmp_path, name):
    _index(tmp_path, name)
    with pytest.raises(ConfigError) as err:
        check_weights(str(tmp_path))
    assert str(err.value) == (f"{tmp_path / 'model.safetensors.index.json'}: shard {name!r}; "
                              "expected a file name inside the checkpoint folder")


def test_an_index_without_a_weight_map(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"t": 3}}')
    with pytest.raises(ConfigError) as err:
        check_weights(str(tmp_path))
    assert str(err.value) == (f"{tmp_path / 'model.safetensors.index.json'}: expected an object "
                              'with a "weight_map" of tensor names to shard file names')


def test_only_pickled_weights_are_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"a pickle")
    with pytest.raises(ConfigError) as err:
        check_weights(str(tmp_path))
    assert str(err.value) == (f"{tmp_path}: got only pytorch_model.bin; expected safetensors "
                              "weights (model.safetensors or model.safetensors.index.json and "
                              "its shards; pickled weights are never loaded)")


def test_a_generation_config_fifo_is_refused_with_the_weights(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    os.mkfifo(tmp_path / "generation_config.json")
    with pytest.raises(InputFileError) as err:
        check_weights(str(tmp_path))
    assert str(err.value) == _fifo_message(tmp_path / "generation_config.json")


def test_a_tokenizer_file_as_a_fifo(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    os.mkfifo(tmp_path / "tokenizer.json")
    with pytest.raises(InputFileError) as err:
        check_tokenizer_files(str(tmp_path))
    assert str(err.value) == _fifo_message(tmp_path / "tokenizer.json")


@pytest.mark.slow  # builds, saves and loads the tiny model through transformers
def test_a_folder_of_pickled_weights_does_not_load(tmp_path):
    pytest.importorskip("transformers")
    import torch

    from cpplan.models import build_model, load_model, preset_config

    model = build_model(preset_config("tiny-deepseek-v32"))
    model.save_pretrained(tmp_path)
    for weights in tmp_path.glob("*.safetensors"):
        weights.unlink()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")  # what transformers 4 wrote
    with pytest.raises(ConfigError, match="got only pytorch_model.bin; expected safetensors"):
        load_model(str(tmp_path))
