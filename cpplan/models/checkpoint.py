"""The files of a checkpoint folder, checked before transformers opens any of them
(docs/failures.md): each must be a regular file within its cap, so a FIFO named as a weights
shard (or a tokenizer, or config.json) never blocks a load, and a symlink to ``/dev/zero`` is
never read. The JSON files are parsed here, strictly (:func:`cpplan.schemas.files.loads_json`:
no key given twice, no RecursionError), and the weights must be safetensors: a folder holding
only ``pytorch_model.bin`` (a pickle) is refused, never unpickled.

Every failure is one :class:`~cpplan.schemas.errors.ConfigError` or
:class:`~cpplan.schemas.errors.InputFileError` line naming the file (exit 2).
"""

from __future__ import annotations

import os

from cpplan.schemas.errors import ConfigError
from cpplan.schemas.files import check_input_file, loads_json, read_input

MAX_JSON_BYTES = 16 * 2**20  # config.json, generation_config.json (a few kB in real models)
MAX_INDEX_BYTES = 64 * 2**20  # model.safetensors.index.json (DeepSeek-V3's: about 9 MB)
MAX_TOKENIZER_BYTES = 256 * 2**20  # tokenizer.json of a 150k vocabulary: about 10 MB
MAX_SHARD_BYTES = 2**40  # safetensors are mapped, not read: the cap is only a sanity bound
SAFETENSORS, INDEX = "model.safetensors", "model.safetensors.index.json"
# what transformers' tokenizer loading may open in a local folder
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                   "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt",
                   "merges.txt", "chat_template.jinja", "chat_template.json")


def read_json(path: str, max_bytes: int = MAX_JSON_BYTES):
    """The JSON value of the regular file ``path``; InputFileError (unreadable, not a regular
    file, over ``max_bytes``) or ConfigError (not UTF-8 JSON, a key given twice, nested past
    the recursion limit), one line naming the file."""
    data = read_input(path, max_bytes)
    try:
        return loads_json(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError) as exc:
        words = " ".join(str(exc).split())[:200]
        raise ConfigError(f"{path}: cannot be read as JSON ({words})") from None


def check_weights(folder: str) -> list[str]:
    """The safetensors files transformers will open (``model.safetensors``, or every shard
    the index names), each checked a regular file, as is a generation_config.json (which
    ``from_pretrained`` reads too); ConfigError where there are no safetensors (only
    ``pytorch_model.bin``, say) or the index names a file outside the folder."""
    generation = os.path.join(folder, "generation_config.json")
    if os.path.lexists(generation):
        check_input_file(generation, MAX_JSON_BYTES)
    index = os.path.join(folder, INDEX)
    if os.path.lexists(index):
        return [os.path.join(folder, name) for name in _shards(index)]
    single = os.path.join(folder, SAFETENSORS)
    if not os.path.lexists(single):
        found = sorted(n for n in os.listdir(folder) if n.endswith((".bin", ".pt", ".pth")))
        what = f"only {', '.join(found[:3])}" if found else "no weights"
        raise ConfigError(f"{folder}: got {what}; expected safetensors weights ({SAFETENSORS} "
                          f"or {INDEX} and its shards; pickled weights are never loaded)")
    check_input_file(single, MAX_SHARD_BYTES)
    return [single]


def _shards(index: str) -> list[str]:
    """The shard file names of a safetensors index (``weight_map``: tensor -> file), each a
    regular file in the index's folder."""
    obj = read_json(index, MAX_INDEX_BYTES)
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict) or not weight_map \
            or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConfigError(f"{index}: expected an object with a \"weight_map\" of tensor "
                          "names to shard file names")
    names = sorted(set(weight_map.values()))
    folder = os.path.dirname(index)
    for name in names:
        if os.path.isabs(name) or ".." in name.split("/") or "\\" in name or "\x00" in name:
            raise ConfigError(f"{index}: shard {name[:100]!r}; expected a file name inside "
                              "the checkpoint folder")
        check_input_file(os.path.join(folder, name), MAX_SHARD_BYTES)
    return names


def check_tokenizer_files(folder: str) -> None:
    """Each tokenizer file present in ``folder`` (even as a dangling link or a FIFO) is a
    regular file within MAX_TOKENIZER_BYTES; InputFileError naming it otherwise."""
    for name in TOKENIZER_FILES:
        path = os.path.join(folder, name)
        if os.path.lexists(path):
            check_input_file(path, MAX_TOKENIZER_BYTES)
