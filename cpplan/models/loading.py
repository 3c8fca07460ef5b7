"""Loading the transformers models cpplan serves (docs/design.md §4.5), and the presets.

Two families, both transformers >= 5.23: ``DeepseekV32ForCausalLM`` (model_type
``deepseek_v32``) and ``GlmMoeDsaForCausalLM`` (``glm_moe_dsa``). A model comes from

- a local checkpoint folder (``config.json`` + safetensors): ``from_pretrained(folder,
  local_files_only=True)``, never the network; the dims are checked from ``config.json``
  before any weight is read; a missing, truncated or incomplete weights file is one line;
  every file it opens is first checked a regular file within its cap, and the weights must
  be safetensors (:mod:`cpplan.models.checkpoint`);
- a transformers config object (random weights from a seed);
- a preset name (:data:`PRESETS`): a small random-weight model from a seed with the real
  attention dims (kv_lora_rank 512, qk_rope_head_dim 64, index_head_dim 128), a few layers,
  8 query heads, 4 indexer heads, hidden 256, vocab 512, four routed experts,
  ``initializer_range`` 0.1 (so attention is far from uniform) and ``index_topk`` 32 (so the
  indexer selects below the contexts); float32 on CPU. ``tiny-glm-5`` shares the indexer on
  layers 1 and 3 (pattern F, S, F, S).

Every model is built with ``attn_implementation="eager"`` (the reference forward of
:mod:`cpplan.models.reference` runs it; cpplan's own forward does not use it) and in eval mode.
A missing transformers is one line giving the README's install command; a model whose dims do not
fit the runtime, or whose config its own modules cannot run (an MoE gate whose experts do not
divide into its groups, :func:`check_modules`), is one
:class:`~cpplan.schemas.errors.ConfigError` line naming the field, from the config alone
(:func:`model_config`: no weight read). :func:`eos_token_ids` reads the end-of-sequence ids
the way transformers' ``generate`` does.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from cpplan.models.checkpoint import check_weights, read_json
from cpplan.schemas.errors import ConfigError

MIN_TRANSFORMERS = (5, 23)
# model_type -> (config class, causal-LM class) names in transformers
FAMILIES = {
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
}
# the dims the runtime's kernels and cache formats take (docs/design.md §4.1): field -> value
REQUIRED_DIMS = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128}
POSITIVE_FIELDS = ("num_attention_heads", "index_n_heads", "index_topk", "qk_nope_head_dim",
                   "v_head_dim", "q_lora_rank", "hidden_size", "num_hidden_layers", "vocab_size")
# upper bounds, checked before anything proportional to a size is built (transformers' config
# makes per-layer lists of num_hidden_layers): DeepSeek-V3.2 has 61 layers and 128 heads,
# GLM-5 78 layers; the rest within the int32 every plan's size fits
MAX_DIMS = {"num_hidden_layers": 4096, "num_attention_heads": 4096, "index_n_heads": 4096}
MAX_SIZE = 2**31 - 1

_TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
             num_attention_heads=8, num_key_value_heads=8, n_routed_experts=4,
             n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
             first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=512, qk_rope_head_dim=64,
             index_head_dim=128, index_n_heads=4, index_topk=32, initializer_range=0.1,
             max_position_embeddings=4096, tie_word_embeddings=False)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-deepseek-v32": ("deepseek_v32", dict(_TINY, num_hidden_layers=3, qk_nope_head_dim=64,
                                               v_head_dim=64)),
    "tiny-glm-5": ("glm_moe_dsa", dict(_TINY, num_hidden_layers=4, qk_nope_head_dim=96,
                                       v_head_dim=128,
                                       indexer_types=["full", "shared", "full", "shared"])),
}


def require_transformers():
    """The ``transformers`` module, >= 5.23; ConfigError (one line giving the README's
    install command, :data:`cpplan.INSTALL_COMMAND`) where it is missing or older."""
    try:
        import transformers
    except ImportError:
        from cpplan import INSTALL_COMMAND

        raise ConfigError("transformers is not installed: got no module 'transformers'; "
                          f"expected transformers>=5.23 ({INSTALL_COMMAND}, the README's "
                          "install)") from None
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_TRANSFORMERS:
        from cpplan import INSTALL_COMMAND

        raise ConfigError(f"transformers {transformers.__version__} is too old: expected "
                          f">=5.23 ({INSTALL_COMMAND}, the README's install)")
    return transformers


def family_classes(model_type: str) -> tuple[type, type]:
    """(config class, causal-LM class) of ``model_type``; ConfigError for any other type."""
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type: got {model_type!r}; expected one of "
                          f"{', '.join(FAMILIES)} (DeepSeek-V3.2 or GLM-5 sparse MLA)")
    transformers = require_transformers()
    names = FAMILIES[model_type]
    return getattr(transformers, names[0]), getattr(transformers, names[1])


def check_dims(config) -> None:
    """The model's dims fit the runtime (docs/design.md §4.1, §4.5): kv_lora_rank 512,
    qk_rope_head_dim 64, index_head_dim 128, positive head counts and sizes (at most
    :data:`MAX_DIMS`, else int32: checked before anything of their size is built), a first
    layer with its own indexer. ``config``: a transformers config or a ``config.json`` dict.
    One-line ConfigError naming the field, the value and what is expected otherwise."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    family_type = get("model_type")
    if not isinstance(family_type, str) or family_type not in FAMILIES:
        raise ConfigError(f"model_type: got {_short(family_type)}; expected one of "
                          f"{', '.join(FAMILIES)}")
    for name, want in REQUIRED_DIMS.items():
        if type(get(name)) is not int or get(name) != want:
            raise ConfigError(f"{name}: got {_short(get(name))}; expected {want}, the only value "
                              "cpplan's kernels and cache formats take")
    for name in POSITIVE_FIELDS:
        value, high = get(name), MAX_DIMS.get(name, MAX_SIZE)
        if type(value) is not int or value < 1:
            raise ConfigError(f"{name}: got {_short(value)}; expected a positive integer")
        if value > high:
            raise ConfigError(f"{name}: got {value}; expected at most {high}")
    layers = get("num_hidden_layers")
    kinds = get("indexer_types") or ("full",) * layers
    if not isinstance(kinds, (list, tuple)) or len(kinds) != layers \
            or any(k not in ("full", "shared") for k in kinds) or kinds[0] != "full":
        raise ConfigError(f"indexer_types: got {_short(kinds)}; expected 'full' or 'shared' "
                          f"for each of {layers} layers, the first 'full'")


def check_modules(config) -> None:
    """The model's own modules can run ``config`` (a resolved transformers config): where a
    layer is an MoE (``mlp_layer_types`` "sparse"), its gate (``TopkRouter``: the routed
    experts in ``n_group`` groups, each group scored by its top-2 experts, the best
    ``topk_group`` groups kept, ``num_experts_per_tok`` experts taken from them) needs the
    experts divisible into the groups, at least 2 experts a group, ``1 <= topk_group <=
    n_group`` and ``num_experts_per_tok`` within the kept groups' experts; else the gate
    raises (``selected index k out of range``) or routes to masked experts mid-forward.
    One-line ConfigError naming the fields otherwise."""
    kinds = getattr(config, "mlp_layer_types", None) or ()
    if "sparse" not in kinds:
        return
    experts, groups = config.n_routed_experts, config.n_group
    topk_group, per_token = config.topk_group, config.num_experts_per_tok
    for name, value in (("n_routed_experts", experts), ("n_group", groups),
                        ("topk_group", topk_group), ("num_experts_per_tok", per_token)):
        if type(value) is not int or value < 1:
            raise ConfigError(f"{name}: got {value!r}; expected a positive integer (the MoE "
                              "layers' gate)")
    if experts % groups:
        raise ConfigError(f"n_routed_experts {experts} in n_group {groups} groups: expected "
                          "the experts divisible into the groups (the MoE gate's view)")
    if experts // groups < 2:
        raise ConfigError(f"n_routed_experts {experts} in n_group {groups} groups: "
                          f"{experts // groups} expert(s) a group; expected at least 2 (the "
                          "MoE gate scores each group by its top-2 experts)")
    if topk_group > groups:
        raise ConfigError(f"topk_group: got {topk_group}; expected at most n_group {groups}")
    if per_token > topk_group * (experts // groups):
        raise ConfigError(f"num_experts_per_tok: got {per_token}; expected at most the "
                          f"{topk_group * (experts // groups)} experts of the topk_group "
                          f"{topk_group} groups the gate keeps")


def model_config(source: str):
    """The transformers config of a preset or a checkpoint folder's ``config.json``, with
    the family's defaults filled in; no weight is read. Dims (:func:`check_dims`) and the
    modules (:func:`check_modules`) are checked; one-line ConfigError otherwise."""
    if source in PRESETS:
        config = preset_config(source)
    else:
        raw = _read_config_json(source)
        check_dims(raw)
        config_cls = getattr(require_transformers(), FAMILIES[raw["model_type"]][0])
        try:
            config = config_cls.from_pretrained(source, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any loader failure is one line
            raise ConfigError(f"{os.path.join(source, 'config.json')}: cannot be read as a "
                              f"{config_cls.__name__} ({_first_line(exc)})") from None
    check_dims(config)
    check_modules(config)
    return config


def eos_token_ids(source: str, config=None) -> tuple[int, ...]:
    """The model's end-of-sequence token ids, as transformers' ``generate`` stops at them:
    ``eos_token_id`` (an int, a list or null) of the folder's generation_config.json where
    it has that key, else of its config (``config``, read if None); a preset's from its
    config. ConfigError for a value that is no token id."""
    found = _generation_eos(source)
    if found is None:
        config = config if config is not None else model_config(source)
        found = (getattr(config, "eos_token_id", None), f"{source} config")
    value, where = found
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if any(type(t) is not int or t < 0 for t in ids):
        raise ConfigError(f"{where}: eos_token_id got {value!r}; expected a token id, a list "
                          "of them or null")
    return tuple(dict.fromkeys(ids))


def _generation_eos(source: str) -> tuple[Any, str] | None:
    """(eos_token_id, the file) of a folder's generation_config.json, None where it has no
    such file or key."""
    path = os.path.join(source, "generation_config.json")
    if source in PRESETS or not os.path.lexists(path):
        return None
    gen = read_json(path)
    if not isinstance(gen, dict) or "eos_token_id" not in gen:
        return None
    return gen["eos_token_id"], path


def preset_config(name: str, **overrides):
    """The transformers config of preset ``name`` (:data:`PRESETS`), fields overridden by
    ``overrides`` (e.g. ``index_topk=512``); ConfigError for an unknown name."""
    if name not in PRESETS:
        raise ConfigError(f"model preset: got {name!r}; expected one of {', '.join(PRESETS)} "
                          "or a checkpoint folder")
    model_type, fields = PRESETS[name]
    config_cls, _ = family_classes(model_type)
    return config_cls(**{**fields, **overrides})


def build_model(config, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                device="cpu") -> torch.nn.Module:
    """A random-weight causal LM of ``config`` (a DeepseekV32Config or GlmMoeDsaConfig),
    weights drawn from ``seed`` (the global RNG is left as it was), eval mode, eager
    attention, ``dtype`` on ``device``. ConfigError where the dims do not fit."""
    check_dims(config)
    check_modules(config)
    _, model_cls = family_classes(config.model_type)
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.to(device=device, dtype=dtype).eval()


def load_model(source: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
               device="cpu") -> torch.nn.Module:
    """A preset name (built from ``seed``) or a local checkpoint folder (config.json +
    safetensors; ``from_pretrained(..., local_files_only=True)``). Dims are checked from
    config.json first; ConfigError (one line) for an unknown preset, a folder without
    config.json, unreadable, truncated or incomplete weights."""
    if source in PRESETS:
        return build_model(preset_config(source), seed=seed, dtype=dtype, device=device)
    config = model_config(source)
    _, model_cls = family_classes(config.model_type)
    check_weights(source)
    return _from_folder(model_cls, source, dtype, device)


def _read_config_json(source: str) -> dict:
    """A checkpoint folder's config.json as a dict; ConfigError (one line) otherwise."""
    path = os.path.join(source, "config.json")
    if not os.path.isdir(source) or not os.path.lexists(path):
        raise ConfigError(f"model: got {source!r}; expected a preset ({', '.join(PRESETS)}) "
                          "or a folder holding config.json and safetensors weights")
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: got a JSON {type(raw).__name__}; expected an object")
    return raw


def _from_folder(model_cls, folder: str, dtype, device) -> torch.nn.Module:
    """``from_pretrained`` of a checked folder; its failures (no weights, a truncated file,
    missing tensors) as one ConfigError line."""
    try:
        model, info = model_cls.from_pretrained(folder, local_files_only=True, dtype=dtype,
                                                attn_implementation="eager",
                                                use_safetensors=True,
                                                output_loading_info=True)
    except Exception as exc:  # noqa: BLE001 - OSError, SafetensorError, ValueError, ...
        raise ConfigError(f"{folder}: the weights cannot be loaded "
                          f"({type(exc).__name__}: {_first_line(exc)})") from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ConfigError(f"{folder}: the weights lack {len(missing)} tensors (first "
                          f"{missing[0]!r}); expected every tensor of the model")
    check_dims(model.config)
    return model.to(device=device).eval()


def _short(value, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters, a list to its first 8 items: an error line
    names a bad value without quoting a 4,096-element list (or a 10,000-digit integer, whose
    repr raises)."""
    items = list(value) if isinstance(value, (list, tuple)) else None
    try:
        text = repr(items[:8] if items is not None else value)
    except (ValueError, RecursionError):
        return f"a {type(value).__name__} too large to show"
    if len(text) > limit:
        text = text[:limit] + "..."
    if items is not None and len(items) > 8:
        text += f" (the first 8 of {len(items)} items)"
    return text


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__
