"""The reference for cpplan's forward: the model's own transformers forward, teacher-forced over
a sequence in one process (eager attention), optionally given cpplan's numerics
(docs/design.md §4.5).

Numerics (a documented choice, not an accident). transformers' indexer scores in fp32 and picks
``torch.topk`` (ties unspecified); it skips the fp8 quantisation of DeepSeek's inference code.
cpplan's indexer follows the inference code (docs/design.md §4.3): the query in fp8 e4m3 with one
power-of-two scale per token and head (folded into the head weight), the key in fp8 with one
per token, scores ``sum_h w8_h * ReLU(q8_h . k)``, top-k by score descending then token id
ascending. Below the contexts the two select slightly different keys, so the reference has two
indexers:

- ``indexer="stock"``: the model as transformers ships it;
- ``indexer="cpplan"``: each indexer module's ``forward`` on this model instance replaced (for
  the duration of a ``with`` block) by one that computes the same q / k / weights from the
  module's own weights, quantises them as above (the scale rule of docs/design.md §4.2,
  written here separately from the runtime's), scores in float64 and orders ties by id.

and three KV caches (``kv_cache_dtype``): ``None`` (the stock fp32 latent), ``"bf16"`` or
``"fp8_ds_mla"`` (the 576-wide latent row ``[kv_a_layernorm(c_kv) | rope(k_pe)]`` rounded as
cpplan's cache stores it: the attention module's ``expand_kv`` sees the rounded row). With
topk >= every context the indexer does not matter (every causal key is selected); the KV
format always does.

Long sequences: transformers' eager attention and both indexers score every query at once
(O(S^2 x heads) memory); with ``rows`` (or where :func:`auto_rows` finds the memory free short)
the attention modules run :mod:`cpplan.models.reference_attention` and the selections
:func:`cpplan_topk` / :func:`stock_topk` a chunk of query rows at a time, O(rows x S).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Sequence

import torch

from cpplan.models.reference_attention import causal, chunked_attention_forward
from cpplan.schemas.errors import ConfigError

INDEXERS = ("stock", "cpplan")
KV_FORMATS = (None, "bf16", "fp8_ds_mla")
FP8_MAX, SCALE_FLOOR = 448.0, 2.0 ** -126
# the RoPE function each family's indexer calls, by name in its modeling module (read there)
_HF_INDEXER_ROPE = {"deepseek_v32": "apply_rotary_pos_emb",
                    "glm_moe_dsa": "apply_rotary_pos_emb_interleave"}


def fp8_pow2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups ``x [..., g]`` -> (fp8 e4m3 values as float32 ``[..., g]``, power-of-two scales
    float32 ``[...]``) with ``scale = 2 ** ceil(log2(max(amax, 2**-126) / 448))``, the
    exponent found in float64 and corrected against ``448 * 2**e`` (exact), and ``x / scale``
    rounded to nearest even; ``values * scale`` approximates x."""
    amax = x.detach().abs().amax(dim=-1).double().clamp_min(SCALE_FLOOR)
    e = torch.ceil(torch.log2(amax / FP8_MAX))
    e = torch.where(FP8_MAX * torch.exp2(e) < amax, e + 1, e)
    e = torch.where(FP8_MAX * torch.exp2(e - 1) >= amax, e - 1, e)
    scale = torch.exp2(e)
    values = (x.double() / scale[..., None]).to(torch.float8_e4m3fn).float()
    return values, scale.float()


def round_kv(kv_nope: torch.Tensor, k_rot: torch.Tensor, kv_cache_dtype: str
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent ``[..., 512]`` and RoPE ``[..., 64]`` parts of KV rows as the cache holds
    them: "bf16" both rounded to bf16; "fp8_ds_mla" the latent in four groups of 128 fp8 values
    with power-of-two scales (dequantised) and the RoPE part in bf16 (docs/design.md §4.2)."""
    rot = k_rot.to(torch.bfloat16).to(k_rot.dtype)
    if kv_cache_dtype == "bf16":
        return kv_nope.to(torch.bfloat16).to(kv_nope.dtype), rot
    groups = kv_nope.reshape(*kv_nope.shape[:-1], 4, 128)
    values, scale = fp8_pow2(groups)
    return (values * scale[..., None]).reshape(kv_nope.shape).to(kv_nope.dtype), rot


def cpplan_topk(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, allowed: torch.Tensor | None,
                topk: int, *, rows: int | None = None) -> torch.Tensor:
    """cpplan's selection: q ``[B, S, Hi, 128]`` and k ``[B, T, 128]`` (post-RoPE), w
    ``[B, S, Hi]`` float32 with every scale folded, allowed ``[B, S, T]`` bool (None: causal,
    query i at position T - S + i) -> ``[B, S, min(topk, T)]`` int32 key positions, score
    descending then position ascending. ``rows``: queries scored at once (default all), so
    the float64 logits take O(rows x T) memory; a query's result does not depend on it (its
    logits of fp8 values are exact in float64, and each row sums its own heads)."""
    b, s = q.shape[:2]
    t = k.shape[1]
    qv, qs = fp8_pow2(q.float())
    kv, ks = fp8_pow2(k.float())
    kd = (kv * ks[..., None]).double()
    wq = (w.float() * qs).double()
    step = s if rows is None else max(1, rows)
    out = []
    for start in range(0, s, step):
        stop = min(s, start + step)
        logits = torch.einsum("bshd,btd->bsht", qv[:, start:stop].double(), kd).clamp_min(0)
        scores = torch.einsum("bsh,bsht->bst", wq[:, start:stop], logits)
        del logits
        keep = (allowed[:, start:stop] if allowed is not None
                else causal(t - s + start, t - s + stop, t, q.device))
        scores = scores.masked_fill(~keep, float("-inf"))
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        out.append(order[..., : min(topk, t)].to(torch.int32))
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


def stock_topk(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, topk: int, *,
               softmax_scale: float, rows: int) -> torch.Tensor:
    """transformers' indexer selection restated in chunks of ``rows`` queries (its forward
    scores every query at once): ``relu(q . k * softmax_scale)`` in float32 summed over the
    heads with ``w`` ``[B, S, Hi]`` (``weights_proj`` times ``Hi ** -0.5``), causal keys only,
    ``torch.topk`` (ties unspecified, as there); one sequence without a cache."""
    s, t = q.shape[1], k.shape[1]
    kt = k.transpose(-1, -2).float().unsqueeze(1)
    out = []
    for start in range(0, s, rows):
        stop = min(s, start + rows)
        scores = torch.relu(torch.matmul(q[:, start:stop].float(), kt) * softmax_scale)
        index = torch.matmul(w[:, start:stop].unsqueeze(-2), scores).squeeze(-2)
        del scores
        index = index.masked_fill(~causal(start, stop, t, q.device), float("-inf"))
        out.append(index.topk(min(topk, t), dim=-1).indices.to(torch.int32))
    return torch.cat(out, dim=1)


def _indexer_qk(self, hidden_states, q_resid, position_embeddings, past_key_values=None):
    """An HF indexer module's post-RoPE queries ``[B, S, Hi, D]`` and keys ``[B, T, D]``,
    from its own weights and RoPE function, as its forward computes them."""
    b, s, _ = hidden_states.shape
    cos, sin = position_embeddings
    rope = getattr(sys.modules[type(self).__module__], _HF_INDEXER_ROPE[self.config.model_type])
    q = self.wq_b(q_resid).view(b, s, self.n_heads, self.head_dim)
    k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
    r = self.qk_rope_head_dim
    q_rot, k_rot = rope(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., r:]], dim=-1)
    k = torch.cat([k_rot, k[..., r:]], dim=-1).squeeze(2)
    if past_key_values is not None:
        k = past_key_values.update_indexer(k, self.layer_idx)
    return q, k


def _indexer_weights(self, hidden_states) -> torch.Tensor:
    """The indexer's head weights ``[B, S, Hi]`` float32 times ``Hi ** -0.5``."""
    w = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float()
    return w * (self.n_heads ** -0.5)


def cpplan_select(rows: int):
    """A ``select`` for :func:`~cpplan.models.reference_attention.chunked_attention_forward`:
    cpplan's numerics, ``rows`` queries at a time."""
    def select(ix, hidden_states, q_resid, position_embeddings):
        q, k = _indexer_qk(ix, hidden_states, q_resid, position_embeddings)
        w = _indexer_weights(ix, hidden_states) * ix.softmax_scale
        return cpplan_topk(q, k, w, None, ix.index_topk, rows=rows)
    return select


def stock_select(rows: int):
    """A ``select``: transformers' numerics (:func:`stock_topk`), ``rows`` queries at a time."""
    def select(ix, hidden_states, q_resid, position_embeddings):
        q, k = _indexer_qk(ix, hidden_states, q_resid, position_embeddings)
        return stock_topk(q, k, _indexer_weights(ix, hidden_states), ix.index_topk,
                          softmax_scale=ix.softmax_scale, rows=rows)
    return select


def _cpplan_indexer_forward(self, hidden_states, q_resid, position_embeddings, attention_mask,
                            position_ids=None, past_key_values=None, cache=None):
    """An HF indexer's forward (same signature, same q / k / weights from its weights) with
    cpplan's numerics (module docstring); bound to one indexer module instance. The cache
    argument is ``past_key_values`` in transformers 5.23 and ``cache`` from 5.24 on."""
    past_key_values = cache if cache is not None else past_key_values
    q, k = _indexer_qk(self, hidden_states, q_resid, position_embeddings, past_key_values)
    w = _indexer_weights(self, hidden_states) * self.softmax_scale
    allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    return cpplan_topk(q, k, w, allowed, self.index_topk)


def _rounding_expand_kv(original, kv_cache_dtype: str):
    def expand_kv(kv_nope, k_rot):
        return original(*round_kv(kv_nope, k_rot, kv_cache_dtype))
    return expand_kv


@contextlib.contextmanager
def reference_numerics(model, *, indexer: str = "stock", kv_cache_dtype: str | None = None,
                       rows: int | None = None, select=None):
    """Within the block, ``model`` (this instance only) runs with the given indexer and KV
    rounding (module docstring); restored on exit. ConfigError for an unknown choice.
    ``rows``: every attention module's forward computes ``rows`` queries at a time
    (:mod:`cpplan.models.reference_attention`: one sequence, no cache; call the model with
    ``attention_mask={"indexed_attention": None}``), its selection by ``select`` (default the
    chosen indexer's, chunked alike); None: the model's own eager forward."""
    if indexer not in INDEXERS:
        raise ConfigError(f"indexer: got {indexer!r}; expected one of {INDEXERS}")
    if kv_cache_dtype not in KV_FORMATS:
        raise ConfigError(f"kv_cache_dtype: got {kv_cache_dtype!r}; expected one of "
                          f"{KV_FORMATS}")
    if rows is not None and select is None:
        select = (cpplan_select if indexer == "cpplan" else stock_select)(rows)
    patched = []  # (module, attribute name)
    try:
        for layer in model.model.layers:
            attn = layer.self_attn
            if rows is not None:
                attn.forward = functools.partial(chunked_attention_forward, attn,
                                                 select=select, rows=rows)
                patched.append((attn, "forward"))
            elif indexer == "cpplan" and getattr(attn, "indexer", None) is not None:
                attn.indexer.forward = types.MethodType(_cpplan_indexer_forward, attn.indexer)
                patched.append((attn.indexer, "forward"))
            if kv_cache_dtype is not None:
                attn.expand_kv = _rounding_expand_kv(attn.expand_kv, kv_cache_dtype)
                patched.append((attn, "expand_kv"))
        yield model
    finally:
        for module, name in patched:
            delattr(module, name)  # the class's method shows through again


def auto_rows(model, num_tokens: int, num_logits: int | None = None, *,
              what: str = "one sequence") -> int | None:
    """Query rows the reference forward over ``num_tokens`` tokens computes at once within
    the memory free on the model's device (:mod:`cpplan.models.memory`); None where every
    row fits (then the model's own eager forward runs); ConfigError where not one does."""
    from cpplan.models.memory import check_fits, free_bytes, reference_bytes

    need = reference_bytes(model.config, num_tokens, num_logits)
    rows = check_fits(need, free_bytes(model.lm_head.weight.device), what=what)
    return None if rows >= num_tokens else rows


@torch.no_grad()
def teacher_forced_logits(model, tokens: Sequence[int], positions: Sequence[int] | None = None,
                          *, indexer: str = "stock", kv_cache_dtype: str | None = None,
                          rows: int | None = None) -> torch.Tensor:
    """The model's logits ``[len(positions), vocab]`` float32 (all positions by default) of
    one forward over ``tokens`` (one sequence, no cache), with :func:`reference_numerics`;
    row i predicts the token after ``tokens[positions[i]]``. ``rows``: queries computed at
    once (default :func:`auto_rows`: the model's own forward where every query fits); the
    logits of the chunked forward equal the model's own to float32 rounding (its matrix
    products are split differently), its selection the same keys."""
    device = model.lm_head.weight.device
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
    if rows is None:
        rows = auto_rows(model, ids.shape[1], None if positions is None else len(positions))
    if rows is None:
        with reference_numerics(model, indexer=indexer, kv_cache_dtype=kv_cache_dtype):
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
        if positions is None:
            return logits
        return logits.index_select(0, torch.as_tensor(list(positions), dtype=torch.long,
                                                      device=device))
    keep = torch.as_tensor(list(range(ids.shape[1]) if positions is None else positions),
                           dtype=torch.long, device=device)
    with reference_numerics(model, indexer=indexer, kv_cache_dtype=kv_cache_dtype, rows=rows):
        out = model(input_ids=ids, attention_mask={"indexed_attention": None}, use_cache=False,
                    logits_to_keep=keep)
    return out.logits[0].float()


@torch.no_grad()
def reference_generate(model, prompt: Sequence[int], max_new_tokens: int, *,
                       indexer: str = "stock", kv_cache_dtype: str | None = None,
                       stop: bool = False, stop_token_ids: Sequence[int] = ()) -> list[int]:
    """The model's own greedy ``generate`` (its cache, one sequence) of up to
    ``max_new_tokens`` tokens after ``prompt``, with :func:`reference_numerics`; returns the
    new tokens. ``stop``: it stops where transformers does, at the end-of-sequence ids of the
    model's ``generation_config`` (and ``stop_token_ids`` besides), the token kept; else it
    runs to ``max_new_tokens`` (``min_new_tokens``)."""
    device = model.lm_head.weight.device
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    if stop:
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        limits = dict(eos_token_id=[*eos, *stop_token_ids] or None)
    else:
        limits = dict(min_new_tokens=max_new_tokens)
    with reference_numerics(model, indexer=indexer, kv_cache_dtype=kv_cache_dtype):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0, **limits)
    return out[0, ids.shape[1]:].tolist()


@torch.no_grad()
def selection_overlap(model, tokens: Sequence[int], *, rows: int | None = None) -> list[float]:
    """Per full-indexer layer, the mean fraction of the stock indexer's top-k keys that
    cpplan's numerics also select (same hidden states: the stock forward over ``tokens``),
    over the queries with more causal keys than topk (1.0 where there are none). ``rows``:
    as :func:`teacher_forced_logits` (default :func:`auto_rows`); chunked, the stock
    selection is :func:`stock_topk`'s."""
    found = []

    def share(stock, ours, topk):
        width = stock.shape[1]
        a, b = (torch.zeros(*x.shape[:-1], width, dtype=torch.bool, device=x.device)
                .scatter(-1, x.long(), True) for x in (stock, ours))
        keys = torch.arange(width, device=stock.device) + 1
        over = keys > topk  # queries whose selection drops keys
        part = (a & b).sum(-1)[0].double() / stock.shape[-1]
        found.append(float(part[over].mean()) if bool(over.any()) else 1.0)

    def both(self, hidden_states, q_resid, position_embeddings, attention_mask, *args, **kw):
        stock = type(self).forward(self, hidden_states, q_resid, position_embeddings,
                                   attention_mask, *args, **kw)
        ours = _cpplan_indexer_forward(self, hidden_states, q_resid, position_embeddings,
                                       attention_mask, *args, **kw)
        share(stock, ours, self.index_topk)
        return stock

    device = model.lm_head.weight.device
    ids = torch.tensor([list(tokens)], device=device)
    if rows is None:
        rows = auto_rows(model, ids.shape[1], 1)
    if rows is not None:
        stock_rows, ours_rows = stock_select(rows), cpplan_select(rows)

        def select(ix, *inputs):
            stock = stock_rows(ix, *inputs)
            share(stock, ours_rows(ix, *inputs), ix.index_topk)
            return stock

        with reference_numerics(model, rows=rows, select=select):
            model(input_ids=ids, attention_mask={"indexed_attention": None}, use_cache=False,
                  logits_to_keep=1)
        return found
    indexers = [layer.self_attn.indexer for layer in model.model.layers
                if getattr(layer.self_attn, "indexer", None) is not None]
    try:
        for ix in indexers:
            ix.forward = types.MethodType(both, ix)
        model(input_ids=ids, use_cache=False)
    finally:
        for ix in indexers:
            del ix.forward
    return found
