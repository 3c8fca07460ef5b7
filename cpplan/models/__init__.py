"""Serving transformers' DeepSeek-V3.2 and GLM-5 through cpplan's runtime (docs/design.md §4.5).

Needs the extra ``cpplan[hf]`` (transformers >= 5.23, safetensors); this package imports
without it, and every function that needs it says so in one ConfigError line.

Once per process (every rank)::

    from cpplan.api import Groups, LayerCache, StepExecutor, compile
    from cpplan.models import RankForward, load_model, model_spec, parallel_config, rank_token_ids

    model = load_model("tiny-glm-5")                 # a preset, or a local checkpoint folder
    config = parallel_config(model, pcp=P, dcp=W, kv_cache_dtype="fp8_ds_mla",
                             max_model_len=4096, device="cpu")   # a ParallelConfig
    spec = model_spec(model)                         # sm_scale, RoPE conventions, shared layers
    executor = StepExecutor.from_groups(config, Groups.build(config), sm_scale=spec.sm_scale)
    #          or StepExecutor.local(config, sm_scale=spec.sm_scale) at P = W = 1
    caches = [LayerCache.empty(config, num_blocks, device) for _ in range(config.num_layers)]
    forward = RankForward(model)

Per step (every rank, the same global StepInput, ``is_sampled`` set per request)::

    plan = compile(config, step)
    bound = executor.bind(plan, block_tables)
    token_ids = rank_token_ids(bound, sequences)     # [T] int64: sequences[i] = request i's tokens
    logits = forward(executor, bound, caches, token_ids)   # [num_sampled, vocab], every rank
    executor.finish(bound)
    # row k of logits belongs to request sampled_requests(plan)[k] (ascending request index)

``forward`` runs the model's own modules on the rank's T rows only (embedding, norms,
projections, MLP / MoE, rotary embedding, LM head), inserts and attends every layer in order
through ``executor`` (absorbed 576-wide queries, the model's RoPE conventions, the indexer's
scales folded into its weights, no indexer inputs on GLM-5's shared layers) and returns the
LM head's logits of the sampled rows. ``forward.hidden_states(...)`` stops before the restore
(``[T, hidden_size]``, the config's activation dtype), e.g. for a loop under CUDA graphs.

References (one process, the model's own transformers forward): ``teacher_forced_logits``,
``reference_generate`` and ``selection_overlap`` in :mod:`cpplan.models.reference`, with the
stock indexer or cpplan's indexer numerics, and the KV latent as stored or rounded like
cpplan's cache.

Modules: ``loading`` (presets, checkpoints, the dims check), ``derive`` (softmax scale, RoPE
conventions, ParallelConfig), ``rows`` (a bound step's rows, token ids, sampled rows),
``forward`` (:class:`RankForward`), ``reference``.
"""

from __future__ import annotations

from cpplan.models.derive import ModelSpec, model_spec, parallel_config, softmax_scale
from cpplan.models.forward import RankForward
from cpplan.models.loading import (
                                   PRESETS,
                                   build_model,
                                   check_dims,
                                   load_model,
                                   preset_config,
                                   require_transformers,
)
from cpplan.models.rows import RankRows, rank_rows, rank_token_ids, sampled_hidden, sampled_requests

__all__ = ["PRESETS", "ModelSpec", "RankForward", "RankRows", "build_model", "check_dims",
           "load_model", "model_spec", "parallel_config", "preset_config", "rank_rows",
           "rank_token_ids", "require_transformers", "sampled_hidden", "sampled_requests",
           "softmax_scale"]
