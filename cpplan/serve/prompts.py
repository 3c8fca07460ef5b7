"""The prompts of ``cpplan generate``: a JSONL file or the built-in set, checked against the
model before any rank starts (docs/design.md §6.10: one line naming the file and line).

File format: one JSON object a line (blank lines skipped)::

    {"id": "a", "prompt_token_ids": [1, 2, 3]}           # token ids, 0 <= id < vocab_size
    {"id": "b", "prompt": "text", "max_tokens": 8}        # text: needs the model's tokenizer
    {"id": "c", "prompt_token_ids": [7], "stop_token_ids": [13, 2]}

``id`` (optional, default the line number) is a string or an integer; ``max_tokens`` (or its
older name ``max_new_tokens``; optional) overrides ``--max-new-tokens`` for that request;
``stop_token_ids`` (optional) are token ids that end the request once generated, besides the
model's end-of-sequence ids (kept under ``--ignore-eos``). Every prompt has at least one token
and ``len(prompt) + max_tokens <= max_model_len``; every token id (prompt and stop ids) is in
``[0, vocab_size)``.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from cpplan.schemas.errors import ConfigError
from cpplan.schemas.files import loads_json, read_input

BUILTIN_LENGTHS = (1, 3, 17, 64, 130, 300)  # q < 2P, around a block, a long chunked prompt
KEYS = {"id", "prompt_token_ids", "prompt", "max_tokens", "max_new_tokens", "stop_token_ids"}
# the prompts file's cap: its token lists as Python ints, a tuple and a numpy check each, stay
# within a few hundred MB (a 2,000-request file of 2,000-token prompts is about 20 MB)
MAX_PROMPTS_BYTES = 32 * 2**20


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: str
    token_ids: tuple[int, ...]
    max_new_tokens: int
    text: str | None = None
    stop_token_ids: tuple[int, ...] = ()  # the line's own; the model's eos ids are added later


def builtin_prompts(vocab_size: int, max_new_tokens: int, seed: int = 0) -> list[Prompt]:
    """A few prompts of 1..300 random token ids (from ``seed``) for a fresh machine."""
    rng = np.random.default_rng(seed)
    return [Prompt(f"builtin-{k}-len{n}", tuple(rng.integers(0, vocab_size, n).tolist()),
                   max_new_tokens) for k, n in enumerate(BUILTIN_LENGTHS)]


def load_tokenizer(model_source: str):
    """The checkpoint folder's tokenizer (local files only), or None where it has none
    (presets never have one)."""
    if not os.path.isdir(model_source) or not any(
            os.path.lexists(os.path.join(model_source, f))
            for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    from cpplan.models.checkpoint import check_tokenizer_files

    check_tokenizer_files(model_source)  # a FIFO among them would block transformers' open
    try:
        return AutoTokenizer.from_pretrained(model_source, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any loader failure is one line
        raise ConfigError(f"{model_source}: the tokenizer cannot be loaded "
                          f"({type(exc).__name__}: {str(exc).strip()[:160]})") from None


def read_prompts(path: str, *, max_new_tokens: int, tokenizer=None) -> list[Prompt]:
    """The prompts of a JSONL file (module docstring); ConfigError naming the line for a
    malformed line (a key given twice, nesting past the recursion limit included), an empty
    file; InputFileError for one that is unreadable, not a regular file (a FIFO would block
    the read) or over MAX_PROMPTS_BYTES."""
    data = read_input(path, MAX_PROMPTS_BYTES)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    out, seen = [], set()
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        try:
            obj = loads_json(line)
        except ValueError as exc:
            raise ConfigError(f"{where}: not a JSON object ({str(exc).split(':')[0]})") \
                from None
        out.append(_prompt(obj, where, lineno, max_new_tokens, tokenizer))
        if out[-1].id in seen:
            raise ConfigError(f"{where}: id {out[-1].id!r} repeats an earlier line's; "
                                 "expected unique ids")
        seen.add(out[-1].id)
    if not out:
        raise ConfigError(f"{path}: no prompts; expected one JSON object a line, e.g. "
                             '{"id": "a", "prompt_token_ids": [1, 2, 3]}')
    return out


def _prompt(obj, where: str, lineno: int, max_new_tokens: int, tokenizer) -> Prompt:
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: got a JSON {type(obj).__name__}; expected an object "
                             'with "prompt_token_ids" (or "prompt")')
    extra = sorted(set(obj) - KEYS)
    if extra:
        raise ConfigError(f"{where}: unknown key {extra[0]!r}; expected only "
                             f"{', '.join(sorted(KEYS))}")
    rid = obj.get("id", str(lineno))
    if type(rid) not in (str, int):
        raise ConfigError(f"{where}: id got {type(rid).__name__}; expected a string")
    if "max_tokens" in obj and "max_new_tokens" in obj:
        raise ConfigError(f'{where}: both "max_tokens" and "max_new_tokens"; expected one')
    key = "max_tokens" if "max_tokens" in obj else "max_new_tokens"
    n = obj.get(key, max_new_tokens)
    if type(n) is not int or not 1 <= n <= 1_000_000:
        raise ConfigError(f"{where}: {key} got {n!r}; expected an integer in [1, 1000000]")
    stop = obj.get("stop_token_ids", [])
    if not isinstance(stop, list) or any(type(t) is not int for t in stop):
        raise ConfigError(f"{where}: stop_token_ids must be a list of integers")
    text = None
    if "prompt_token_ids" in obj and "prompt" in obj:
        raise ConfigError(f'{where}: both "prompt_token_ids" and "prompt"; expected one')
    if "prompt_token_ids" in obj:
        ids = obj["prompt_token_ids"]
        if not isinstance(ids, list) or any(type(t) is not int for t in ids):
            raise ConfigError(f"{where}: prompt_token_ids must be a list of integers")
    elif "prompt" in obj:
        text = obj["prompt"]
        if not isinstance(text, str):
            raise ConfigError(f"{where}: prompt got {type(text).__name__}; expected text")
        if tokenizer is None:
            raise ConfigError(f'{where}: "prompt" text needs the checkpoint\'s tokenizer, '
                                 'and this model has none; expected "prompt_token_ids"')
        ids = list(tokenizer(text)["input_ids"])
    else:
        raise ConfigError(f'{where}: no "prompt_token_ids"; expected a list of token ids '
                             '(or "prompt" text with a tokenizer)')
    if not ids:
        raise ConfigError(f"{where}: the prompt is empty; expected at least one token")
    return Prompt(str(rid), tuple(ids), n, text, tuple(stop))


def check_prompts(prompts: list[Prompt], *, vocab_size: int, max_model_len: int,
                  source: str) -> None:
    """Every token id (prompt and stop ids) in ``[0, vocab_size)``, every ``prompt +
    max_new_tokens`` within ``max_model_len``; ConfigError naming the request otherwise."""
    for p in prompts:
        for what, ids in (("token id", p.token_ids), ("stop token id", p.stop_token_ids)):
            bad = _outside(ids, vocab_size)
            if bad is not None:
                raise ConfigError(f"{source} request {p.id!r}: {what} {bad} is outside the "
                                  f"vocabulary; expected 0 <= id < {vocab_size}")
        if len(p.token_ids) + p.max_new_tokens > max_model_len:
            raise ConfigError(f"{source} request {p.id!r}: {len(p.token_ids)} prompt tokens + "
                              f"{p.max_new_tokens} new tokens; expected at most max_model_len "
                              f"{max_model_len} in all")


def _outside(ids, vocab_size: int) -> int | None:
    """The first id of ``ids`` outside ``[0, vocab_size)`` (one vectorised pass), or None."""
    if not ids:
        return None
    if all(abs(t) < 2**62 for t in ids):
        arr = np.asarray(ids, dtype=np.int64)
        if arr.min() >= 0 and arr.max() < vocab_size:
            return None
    return next(t for t in ids if not 0 <= t < vocab_size)
