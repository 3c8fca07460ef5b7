"""What cpplan needs to know about a model, derived from its transformers config
(docs/design.md §4.5): the softmax scale, the RoPE conventions, the shared-indexer sources,
and the ``ParallelConfig`` to serve it with.

The softmax scale follows the modeling files' ``yarn_apply_mscale`` exactly:
``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2``
where ``rope_parameters`` names a rope type other than "default" with a non-zero
``mscale_all_dim`` (``mscale(s, m) = 0.1 * m * ln(s) + 1`` for ``s > 1``, else 1). Never
``576 ** -0.5``: the absorbed 576-wide product equals the model's ``q . k`` over its
``qk_nope + qk_rope`` dims, so the model's scale is the right one.

RoPE: the MLA part (q_pe, k_pe) uses interleaved pairs in both models; the indexer's first 64
dims use half-split pairs in DeepSeek-V3.2 and interleaved pairs in GLM-5 (read from
modeling_deepseek_v32.py / modeling_glm_moe_dsa.py, transformers 5.23). :data:`ROPE` holds
the conventions by model type; tests swap them to show that a wrong one changes the tokens.
"""

from __future__ import annotations

import dataclasses
import math

from cpplan.models.loading import check_dims
from cpplan.schemas.config import ParallelConfig, indexer_sources_from_types
from cpplan.schemas.errors import ConfigError

# model_type -> (MLA RoPE, indexer RoPE): "interleave" (pairs 2i, 2i+1) or "half" (i, i + 32)
ROPE = {"deepseek_v32": ("interleave", "half"), "glm_moe_dsa": ("interleave", "interleave")}
CPU_ACTIVATION, CUDA_ACTIVATION = "float32", "bfloat16"


def yarn_mscale(scale: float, mscale: float) -> float:
    """``0.1 * mscale * ln(scale) + 1`` for ``scale > 1``, else 1 (DeepSeek's yarn mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(config) -> float:
    """The attention's softmax scale of a transformers config (float), as the model's
    attention module sets ``self.scaling``: ``qk_head_dim ** -0.5`` with the yarn mscale
    squared where the rope parameters ask for it (module docstring)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = config.rope_parameters or {}
    if not isinstance(rope, dict) or ("rope_type" not in rope and
                                      any(isinstance(v, dict) for v in rope.values())):
        raise ConfigError(f"rope_parameters: got {rope!r}; expected one flat dict (rope_type, "
                          "rope_theta, ...) for every layer")
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim", 0):
        m = yarn_mscale(rope["factor"], rope["mscale_all_dim"])
        scale = scale * m * m
    return float(scale)


def indexer_sources(config) -> tuple[int, ...]:
    """Per layer, the layer whose indexer top-k it uses: itself where the layer has an indexer
    ("full"), else the latest earlier full layer ("shared": GLM-5's ``indexer_types``)."""
    kinds = getattr(config, "indexer_types", None) or ["full"] * config.num_hidden_layers
    return indexer_sources_from_types(kinds)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The facts of one model the per-rank forward needs (all from its config)."""

    model_type: str
    num_layers: int
    num_heads: int  # H, query heads
    index_heads: int  # Hi
    qk_nope: int
    v_head_dim: int
    sm_scale: float
    mla_rope: str  # "interleave" or "half"
    indexer_rope: str
    sources: tuple[int, ...]  # indexer_sources()

    @property
    def shared_layers(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.sources) if s != i)


def model_spec(model_or_config) -> ModelSpec:
    """The :class:`ModelSpec` of a transformers model (or its config); ConfigError where the
    dims do not fit the runtime."""
    config = getattr(model_or_config, "config", model_or_config)
    check_dims(config)
    mla, idx = ROPE[config.model_type]
    return ModelSpec(model_type=config.model_type, num_layers=config.num_hidden_layers,
                     num_heads=config.num_attention_heads, index_heads=config.index_n_heads,
                     qk_nope=config.qk_nope_head_dim, v_head_dim=config.v_head_dim,
                     sm_scale=softmax_scale(config), mla_rope=mla, indexer_rope=idx,
                     sources=indexer_sources(config))


def parallel_config(model_or_config, *, pcp: int = 1, dcp: int = 1, interleave: int = 1,
                    kv_cache_dtype: str = "fp8_ds_mla", max_model_len: int | None = None,
                    device="cpu", activation_dtype: str | None = None,
                    share_indexer: bool = True, **extra) -> ParallelConfig:
    """The ``ParallelConfig`` serving the model over ``pcp`` x ``dcp`` ranks: heads, indexer
    heads, topk (``index_topk``), hidden size and layers from the model; ``max_model_len``
    (default the model's ``max_position_embeddings``); activations float32 on CPU, bfloat16
    on CUDA unless ``activation_dtype`` is given; block size 64; ``indexer_sources`` for
    GLM-5's shared layers (``share_indexer=False``: none; the forward then gives a shared
    layer its source layer's indexer inputs again, which yields the same top-k at the cost
    of running the indexer there). ``extra``: other ParallelConfig fields (e.g.
    ``cudagraph_token_sizes``). ConfigError for dims that do not fit or a bad topology."""
    config = getattr(model_or_config, "config", model_or_config)
    spec = model_spec(config)
    if activation_dtype is None:
        kind = device.type if hasattr(device, "type") else str(device).split(":")[0]
        activation_dtype = CUDA_ACTIVATION if kind == "cuda" else CPU_ACTIVATION
    fields = dict(pcp_size=pcp, dcp_size=dcp, interleave_size=interleave, block_size=64,
                  kv_cache_dtype=kv_cache_dtype, num_heads=spec.num_heads,
                  num_layers=spec.num_layers, topk=config.index_topk,
                  index_num_heads=spec.index_heads, index_head_dim=config.index_head_dim,
                  hidden_size=config.hidden_size, activation_dtype=activation_dtype,
                  max_model_len=max_model_len or config.max_position_embeddings, **extra)
    if share_indexer and spec.shared_layers:
        fields["indexer_sources"] = spec.sources
    return ParallelConfig(**fields)


def runtime_shares_indexer(config: ParallelConfig) -> bool:
    """Whether ``config`` names shared-indexer layers (``indexer_sources``): they are then
    given no indexer inputs, else their source layer's inputs again (the same top-k)."""
    sources = config.indexer_sources
    return any(s != i for i, s in enumerate(sources))
