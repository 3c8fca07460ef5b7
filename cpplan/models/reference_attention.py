"""The reference's attention in query chunks: a transformers DeepSeek-V3.2 / GLM-5 attention
module's ``forward`` restated so that the O(S x S) parts (the indexer's scores, the attention
weights, the masks) exist for ``rows`` queries at a time, memory O(rows x S)
(:mod:`cpplan.models.memory`); transformers' eager forward holds them for every query at once.

The same modules and weights as the model's own forward, in the same order: the query and KV
projections, the attention's interleaved RoPE (looked up in the module's own modeling
module), the module's ``expand_kv`` (so the KV rounding of ``reference_numerics`` applies),
the indexer's selection (``select``, itself chunked) or, on GLM-5's shared layers, the previous
full layer's, then softmax attention over the causal keys the selection holds, scaled by the
module's ``scaling``, and ``o_proj``. One sequence, no cache, no padding: causality comes from
positions, not from a mask tensor. Where the model's eager forward adds its mask (0 or the
dtype's minimum) this sets the masked scores to that minimum: the kept scores are the same
values, the masked ones softmax to exactly 0 either way.
"""

from __future__ import annotations

import sys

import torch


def causal(start: int, stop: int, num_keys: int, device) -> torch.Tensor:
    """``[stop - start, num_keys]`` bool: query ``start + i`` of a sequence of ``num_keys``
    tokens (no cache) may see keys ``0 .. start + i``."""
    return (torch.arange(num_keys, device=device)[None, :]
            <= torch.arange(start, stop, device=device)[:, None])


def selected(topk_indices: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``[B, c, k]`` key positions -> ``[B, c, num_keys]`` bool, True where selected."""
    keep = torch.zeros(*topk_indices.shape[:-1], num_keys, dtype=torch.bool,
                       device=topk_indices.device)
    return keep.scatter_(-1, topk_indices.long(), True)


def chunked_attention_forward(self, hidden_states, position_embeddings, attention_mask=None,
                              *args, select, rows: int, prev_topk_indices=None, **kwargs):
    """A DeepSeek-V3.2 / GLM-5 attention module's forward (bound to one module, the model's
    signature) in chunks of ``rows`` queries (module docstring); ``select(indexer,
    hidden_states, q_resid, position_embeddings)`` -> ``[B, S, k]`` int32 key positions.
    Returns what the module's own forward returns: ``(output, None)``, and GLM-5's
    ``topk_indices`` third."""
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        raise AssertionError("the chunked reference runs without a cache")
    b, s = hidden_states.shape[:-1]
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
    q_states = self.q_b_proj(q_resid).view(b, s, -1, self.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    kv_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states),
                                 [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    k_pass = self.kv_a_layernorm(kv_pass).view(b, 1, s, self.kv_lora_rank)
    k_rot = k_rot.view(b, 1, s, self.qk_rope_head_dim)
    modeling = sys.modules[type(self).__module__]
    cos, sin = position_embeddings
    q_rot, k_rot = modeling.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
    query = torch.cat((q_pass, q_rot), dim=-1)
    del q_states, q_pass, q_rot
    key, value = self.expand_kv(k_pass, k_rot)
    key = modeling.repeat_kv(key, self.num_key_value_groups).transpose(2, 3)
    value = modeling.repeat_kv(value, self.num_key_value_groups)
    if getattr(self, "indexer", None) is not None:
        topk_indices = select(self.indexer, hidden_states, q_resid, position_embeddings)
    else:  # GLM-5's shared layer: the previous full layer's selection
        if prev_topk_indices is None:
            raise ValueError("Shared DSA layers require top-k indices from a previous full "
                             "indexer layer.")
        topk_indices = prev_topk_indices
    out = query.new_empty(b, s, value.shape[1], value.shape[-1])
    lowest = torch.finfo(query.dtype).min
    for start in range(0, s, rows):
        stop = min(s, start + rows)
        keep = causal(start, stop, s, query.device) & selected(topk_indices[:, start:stop], s)
        weights = torch.matmul(query[:, :, start:stop], key) * self.scaling
        weights = weights.masked_fill(~keep[:, None], lowest)
        weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
        out[:, start:stop] = torch.matmul(weights, value).transpose(1, 2)
        del weights, keep
    output = self.o_proj(out.reshape(b, s, -1))
    if self.config.model_type == "glm_moe_dsa":
        return output, None, topk_indices
    return output, None
