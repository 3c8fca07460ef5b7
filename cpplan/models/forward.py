"""One rank's forward of a transformers DSA model over one bound step (docs/design.md §4.5).

Every projection, norm, MLP / MoE, the rotary embedding and the LM head are the model's own
modules with its weights; cpplan supplies the attention (``executor.insert`` / ``attend``) in
the absorbed 576-wide latent form. Per layer, for the rank's T rows (T = padded tokens):

    h       = input_layernorm(x)                                   [T, hidden]
    q_resid = q_a_layernorm(q_a_proj(h))                           [T, q_lora_rank]
    q       = q_b_proj(q_resid) -> [q_nope | q_pe]                 [T, H, qk_nope + 64]
    c_kv | k_pe = kv_a_proj_with_mqa(h);  c_kv = kv_a_layernorm(c_kv)
    W_UK, W_UV = kv_b_proj.weight viewed [H, qk_nope + v, 512], split
    q_abs   = [q_nope @ W_UK | rope(q_pe)]                         [T, H, 576]
    kv      = [c_kv | rope(k_pe)]                                  [T, 576]
    iq      = rope_idx(wq_b(q_resid))  (first 64 of 128 dims)      [T, Hi, 128]
    ik      = rope_idx(k_norm(wk(h)))                              [T, 128]
    iw      = weights_proj(h) * Hi ** -0.5 * indexer.softmax_scale [T, Hi] float32
    out     = attend(insert(kv, ik), q_abs, iq, iw)                [T, H, 512]
    x      += o_proj(out @ W_UV^T)                                 [T, hidden]
    x      += mlp(post_attention_layernorm(x))

``rope`` is the model's interleaved rotation, ``rope_idx`` the indexer's (half-split in
DeepSeek-V3.2, interleaved in GLM-5: :data:`cpplan.models.derive.ROPE`), both from
transformers' own functions with the cos / sin of the model's rotary embedding at the rows'
positions. The indexer weight holds the scales HF applies to its scores (``Hi ** -0.5`` and
``head_dim ** -0.5``; positive, so folding them commutes with the ReLU). Shared-indexer
layers (GLM-5) pass no indexer inputs: the runtime reuses their source layer's top-k. Then
the final norm, the sampled rows (:func:`cpplan.models.rows.sampled_hidden`) and the LM head.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch

from cpplan.models.derive import ModelSpec, model_spec, runtime_shares_indexer
from cpplan.models.loading import require_transformers
from cpplan.models.rows import rank_rows, sampled_hidden
from cpplan.schemas.errors import ConfigError, TensorArgError

_ACT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


CAPTURABLE_EXPERTS = "batched_mm"


@contextlib.contextmanager
def experts_implementation(model: torch.nn.Module, name: str):
    """transformers' MoE experts implementation of ``model`` set to ``name`` inside the block
    (the config's ``_experts_implementation``, which each experts module reads per call)."""
    config = model.config
    before = config._experts_implementation
    config._experts_implementation = name
    try:
        yield
    finally:
        config._experts_implementation = before


def rope_functions() -> dict:
    """Convention name -> transformers' rotation ``f(q, k, cos, sin, unsqueeze_dim=1)``:
    "interleave" (pairs 2i, 2i+1) and "half" (pairs i, i + d/2)."""
    require_transformers()
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as ds

    return {"interleave": ds.apply_rotary_pos_emb_interleave, "half": ds.apply_rotary_pos_emb}


class RankForward:
    """The per-rank forward of one model (build once per process; holds no step state).

    ``RankForward(model)(executor, bound, caches, token_ids) -> logits [num_sampled, vocab]``.
    ``model``: a DeepseekV32ForCausalLM or GlmMoeDsaForCausalLM on the executor's device.
    """

    def __init__(self, model: torch.nn.Module, spec: ModelSpec | None = None) -> None:
        self.model, self.spec = model, spec or model_spec(model)
        # the part of the forward running now, for an error's report: "layer 2 (mlp)", ...
        self.where = "the embedding"
        self.rope = rope_functions()
        self.layers = list(model.model.layers)
        s = self.spec
        self.absorb = []  # per layer (W_UK [H, qk_nope, 512], W_UV [H, v, 512]), views
        for layer in self.layers:
            w = layer.self_attn.kv_b_proj.weight.view(s.num_heads, s.qk_nope + s.v_head_dim, -1)
            self.absorb.append((w[:, : s.qk_nope], w[:, s.qk_nope:]))

    @torch.no_grad()
    def __call__(self, executor, bound, caches: Sequence, token_ids: torch.Tensor
                 ) -> torch.Tensor:
        """Logits ``[num_sampled, vocab]`` (the model's dtype) of the sampled requests' last
        tokens, in ascending request index (:func:`cpplan.models.rows.sampled_requests`), on
        every rank. ``token_ids`` ``[T]`` int64: the token of each of the rank's rows
        (:func:`cpplan.models.rows.rank_token_ids`; padding rows any valid id)."""
        return self.head(executor, bound, self.hidden_states(executor, bound, caches, token_ids))

    @torch.no_grad()
    def head(self, executor, bound, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[num_sampled, vocab]`` from the rank's rows after the final norm
        (:meth:`hidden_states`): the sampled rows restored to every rank, then the LM head.
        Runs outside a CUDA graph (restore's row count follows the step's sampled requests)."""
        lm_head = self.model.lm_head
        self.where = "the lm head"
        return lm_head(sampled_hidden(executor, bound, hidden).to(lm_head.weight.dtype))

    @torch.no_grad()
    def hidden_states(self, executor, bound, caches: Sequence, token_ids: torch.Tensor, *,
                      capturable: bool = False) -> torch.Tensor:
        """The rank's rows after the final norm, ``[T, hidden_size]`` in the config's
        activation dtype (what ``restore`` takes); every layer inserted and attended in
        order 0..L-1. ``capturable``: the MoE experts by transformers' "batched_mm" (a
        gather of each row's experts and batched products: no host sync, so a CUDA graph can
        capture it; the default "grouped_mm" copies from the host) for this call."""
        if capturable:
            with experts_implementation(self.model, CAPTURABLE_EXPERTS):
                return self.hidden_states(executor, bound, caches, token_ids)
        act = self._check(executor, bound, caches, token_ids)
        self.where = "the embedding"
        rows = rank_rows(bound)
        x = self.model.model.embed_tokens(token_ids)
        cos, sin = (t[0] for t in self.model.model.rotary_emb(x[None], rows.position_t[None]))
        shares = runtime_shares_indexer(executor.config)
        indexed = {}  # source layer -> (index_k, index_q, index_w): reused where not shared
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            x = self._layer(i, layer, executor, bound, cache, x, (cos, sin), act, shares,
                            indexed)
        self.where = "the final norm"
        return self.model.model.norm(x).to(act)

    def _layer(self, i: int, layer, executor, bound, cache, x, cos_sin, act, shares: bool,
               indexed: dict) -> torch.Tensor:
        attn = layer.self_attn
        self.where = f"layer {i} (attention)"
        h = layer.input_layernorm(x)
        q_resid = attn.q_a_layernorm(attn.q_a_proj(h))
        q, kv = self._mla(i, attn, h, q_resid, cos_sin)
        source = self.spec.sources[i]
        if source == i:
            indexed[i] = self._indexer(attn.indexer, h, q_resid, cos_sin)
        ik, iq, iw = (None, None, None) if source != i and shares else indexed[source]
        executor.insert(bound, cache, kv, ik)
        out = executor.attend(bound, cache, q.to(act), iq, iw)  # [T, H, 512]
        w_uv = self.absorb[i][1]
        v = torch.einsum("thc,hvc->thv", out.to(w_uv.dtype), w_uv)
        x = x + attn.o_proj(v.reshape(v.shape[0], -1))
        self.where = f"layer {i} ({'moe' if hasattr(layer.mlp, 'gate') else 'mlp'})"
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _mla(self, i: int, attn, h, q_resid, cos_sin) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_abs [T, H, 576], kv [T, 576]) of one layer."""
        s, (cos, sin) = self.spec, cos_sin
        q = attn.q_b_proj(q_resid).view(h.shape[0], s.num_heads, -1)
        q_nope, q_pe = q[..., : s.qk_nope], q[..., s.qk_nope:]
        c_kv, k_pe = attn.kv_a_proj_with_mqa(h).split([attn.kv_lora_rank,
                                                       attn.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = self.rope[s.mla_rope](q_pe, k_pe[:, None], cos, sin, unsqueeze_dim=1)
        q_lat = torch.einsum("thd,hdc->thc", q_nope, self.absorb[i][0])
        kv = torch.cat([attn.kv_a_layernorm(c_kv), k_pe[:, 0]], dim=-1)
        return torch.cat([q_lat, q_pe], dim=-1), kv

    def _indexer(self, indexer, h, q_resid, cos_sin) -> tuple:
        """(index_k [T, 128], index_q [T, Hi, 128], index_w [T, Hi] float32) of a full
        layer, RoPE on the first ``qk_rope_head_dim`` dims by the indexer's convention."""
        cos, sin = cos_sin
        iq = indexer.wq_b(q_resid).view(h.shape[0], indexer.n_heads, indexer.head_dim)
        ik = indexer.k_norm(indexer.wk(h))
        r = indexer.qk_rope_head_dim
        q_rot, k_rot = self.rope[self.spec.indexer_rope](iq[..., :r], ik[:, None, :r], cos, sin,
                                                         unsqueeze_dim=1)
        iq = torch.cat([q_rot, iq[..., r:]], dim=-1)
        ik = torch.cat([k_rot[:, 0], ik[:, r:]], dim=-1)
        w = indexer.weights_proj(h.to(indexer.weights_proj.weight.dtype)).float()
        return ik, iq, w * (indexer.n_heads ** -0.5) * indexer.softmax_scale

    def _check(self, executor, bound, caches, token_ids) -> torch.dtype:
        """The executor serves this model (heads, layers, the softmax scale) and the
        arguments fit the step; returns the activation dtype. ConfigError / TensorArgError."""
        cfg, s = executor.config, self.spec
        for name, got, want in (("num_heads", cfg.num_heads, s.num_heads),
                                ("index_num_heads", cfg.index_num_heads, s.index_heads),
                                ("num_layers", cfg.num_layers, s.num_layers),
                                ("hidden_size", cfg.hidden_size,
                                 self.model.config.hidden_size)):
            if got != want:
                raise ConfigError(f"executor config {name}: got {got}; expected {want} "
                                  f"(the model's)")
        if not math.isclose(executor.sm_scale, s.sm_scale, rel_tol=1e-12):
            raise ConfigError(f"executor sm_scale: got {executor.sm_scale!r}; expected the "
                              f"model's softmax scale {s.sm_scale!r} (StepExecutor(..., "
                              "sm_scale=model_spec(model).sm_scale))")
        if len(caches) != s.num_layers:
            raise TensorArgError(f"caches: got {len(caches)}; expected one per layer "
                                 f"({s.num_layers})")
        T = bound.plan.padded_num_tokens
        if not (isinstance(token_ids, torch.Tensor) and token_ids.shape == (T,)
                and token_ids.dtype == torch.int64):
            got = (f"{tuple(token_ids.shape)} {token_ids.dtype}"
                   if isinstance(token_ids, torch.Tensor) else type(token_ids).__name__)
            raise TensorArgError(f"step {bound.plan.step_id}: token_ids is {got}; expected "
                                 f"({T},) int64 (one per row of the rank)")
        return _ACT[cfg.activation_dtype]
