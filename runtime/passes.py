"""The per-layer half of the StepExecutor: ``insert`` and ``attend`` and the attention passes
behind them (docs/design.md §5.4). Mixed into :class:`~cpplan.runtime.executor.StepExecutor`,
which owns the state these methods read (config, kernels, ranks, sm_scale, the checks).

Per layer: ``insert`` writes the new tokens (decode tokens straight to their owner's slots,
prefill tokens through ``kv_insert`` / ``indexer_k_insert`` when planned); ``attend`` runs the
indexer (W == 1: the rank's complete cache; W > 1: per gather chunk over the all-gathered,
rank-major keys, and for decode rows the local top-k merged across the DCP group) and sparse
MLA over the selection, or, on a shared indexer layer, over its source layer's selection.
"""

from __future__ import annotations

import torch

from cpplan.runtime import collectives as coll
from cpplan.runtime.bound import BoundStep, LayerCache
from cpplan.runtime.kernels import gather_indexer_k, scatter_indexer_k
from cpplan.runtime.selection import Attended, LayerPass, Selection, keeps_selection
from cpplan.schemas.errors import UsageError


class LayerPasses:
    """insert / attend and the attention passes (module docstring); a mixin of
    StepExecutor."""

    # ------------------------------------------------------------------ per layer
    def insert(self, bound: BoundStep, cache: LayerCache, kv_new: torch.Tensor,
               index_k_new: torch.Tensor | None, *, layer: int | None = None) -> None:
        """Write layer ``layer``'s new tokens into this rank's caches. kv_new ``[T, 576]``
        float and index_k_new ``[T, 128]`` float: this rank's tokens in its token order
        (:attr:`BoundStep.tokens`; pads ignored). On a shared indexer layer (the config's
        ``indexer_sources``) index_k_new may be None and is not written: the layer reads its
        source layer's selection. Layers run in order, 0 .. num_layers - 1, each step;
        ``layer`` (optional) is checked against that count. Tensors or caches that do not fit
        the step raise TensorArgError (got / expected)."""
        with self._announcing(self._watch_of(bound)):  # refusals reach the peers too
            self._usable(bound, "insert")
            layer = self._next_layer(bound, "insert", layer)
            full = self.config.indexer_source(layer) == layer
            T, cfg = bound.plan.padded_num_tokens, self.config
            self._expect_cache(bound, "insert", cache, indexer=full)
            self._expect(bound, "insert", "kv_new", kv_new, (T, cfg.qk_head_dim))
            if full:
                self._expect(bound, "insert", "index_k_new", index_k_new,
                             (T, cfg.index_head_dim))
            bound.layers_inserted += 1
            self._insert(bound, cache, kv_new, index_k_new if full else None)

    def _insert(self, bound: BoundStep, cache: LayerCache, kv_new, index_k_new) -> None:
        # decode tokens are quantised straight into their cache slots (one kernel per cache);
        # prefill rows are quantised first, since kv_insert may all-gather them.
        # index_k_new None: a shared indexer layer (no index keys, no indexer_k_insert)
        m, t, ch = bound.meta, bound.tables, bound.channel
        nd = m.num_decode_tokens
        if nd:
            if self.config.kv_cache_dtype == "fp8_ds_mla":
                self.kernels.pack_fp8_ds_mla_into(cache.kv, t.insert_dec, kv_new[:nd])
            else:
                cache.kv.index_copy_(0, t.insert_dec, self.pack_kv(kv_new[:nd]))
            if index_k_new is not None:
                self.kernels.pack_indexer_k_into(cache.index_k, t.insert_dec, index_k_new[:nd])
        if nd == kv_new.shape[0] and not m.kv_insert:
            return
        kv_pre = self.pack_kv(kv_new[nd:]).contiguous()
        k_pre = (None if index_k_new is None
                 else self.kernels.quantize_indexer_k(index_k_new[nd:]).contiguous())
        if m.kv_insert:
            p_size = self.config.pcp_size
            kv_all = kv_pre.new_empty((p_size * kv_pre.shape[0], kv_pre.shape[1]))
            coll.kv_insert(ch, kv_all, kv_pre)
            kv_pre = kv_all
            if k_pre is not None:
                k_all = k_pre.new_empty((p_size * k_pre.shape[0], k_pre.shape[1]))
                coll.indexer_k_insert(ch, k_all, k_pre)
                k_pre = k_all
        cache.kv.index_copy_(0, t.insert_pre, kv_pre)
        if k_pre is not None:
            scatter_indexer_k(cache.index_k, t.insert_pre, k_pre)

    def attend(self, bound: BoundStep, cache: LayerCache, q: torch.Tensor,
               index_q: torch.Tensor | None, index_w: torch.Tensor | None, *,
               layer: int | None = None, return_selection: bool = False):
        """Sparse MLA for this rank's tokens at layer ``layer`` (the next in order; checked when
        given): q ``[T, H, 576]`` (the config's activation dtype; the absorbed query),
        index_q ``[T, Hi, 128]``, index_w ``[T, Hi]`` -> out ``[T, H, 512]`` (q's dtype; zero
        for padded tokens), softmax(q . k * sm_scale) over the selected keys with the
        executor's ``sm_scale``, the model's own scale. On a shared indexer layer index_q and
        index_w may be None (they are ignored): the layer attends with its source layer's
        selection (the merged decode top-k included), so it issues no indexer collective.

        ``return_selection=True``: returns ``Attended(out, topk_ids, lse)`` instead, with
        ``topk_ids`` ``[T, topk]`` int32 the selected global token ids in the reference order
        (score descending, id ascending; -1 = no key, and for padded rows) and ``lse`` ``[T,
        H]`` float32 the natural-log LSE of the scaled scores (-inf where no key); nothing
        extra is computed when it is False. Tensors or caches that do not fit the step raise
        TensorArgError (got / expected)."""
        with self._announcing(self._watch_of(bound)):
            self._usable(bound, "attend")
            layer = self._next_layer(bound, "attend", layer)
            source = self.config.indexer_source(layer)
            T, cfg = bound.plan.padded_num_tokens, self.config
            self._expect_cache(bound, "attend", cache, indexer=source == layer)
            self._expect(bound, "attend", "q", q, (T, cfg.num_heads, cfg.qk_head_dim),
                         self._act)  # the output's dtype: decode_out all-reduces it
            if source == layer:
                self._expect(bound, "attend", "index_q", index_q,
                             (T, cfg.index_num_heads, cfg.index_head_dim))
                self._expect(bound, "attend", "index_w", index_w, (T, cfg.index_num_heads))
            if layer >= bound.layers_inserted:
                # the layer's caches lack this step's own keys until its insert: attention
                # would read the old cache and run on, silently wrong for every prefill row
                raise UsageError(f"step {bound.plan.step_id}: attend of layer {layer} before "
                                 f"its insert; expected insert then attend for each layer "
                                 f"({bound.layers_inserted} layer(s) inserted so far)")
            bound.layers_attended += 1
            ctx = LayerPass(layer, source, return_selection, keeps_selection(cfg, layer))
            out = self._attend(bound, cache, q, index_q, index_w, ctx)
            if not return_selection:
                return out
            return Attended(out, *ctx.collected(T, cfg.topk, q.shape[1], q.device))

    def _next_layer(self, bound: BoundStep, call: str, layer) -> int:
        """The layer this insert / attend is (layers run in order each step)."""
        want = bound.layers_inserted if call == "insert" else bound.layers_attended
        if layer is not None and layer != want:
            raise UsageError(f"step {bound.plan.step_id}: {call} of layer {layer!r}; expected "
                             f"layer {want} (layers run in order, 0 .. num_layers - 1)")
        if want >= self.config.num_layers:
            raise UsageError(f"step {bound.plan.step_id}: {call} of layer {want}; expected at "
                             f"most num_layers = {self.config.num_layers} layers a step")
        return want

    def _attend(self, bound: BoundStep, cache: LayerCache, q, index_q, index_w,
                ctx: LayerPass) -> torch.Tensor:
        # Where one pass covers every token (a decode-only step; W == 1 without padding), its
        # result (a new tensor, q's dtype) is the output: no zero fill and no copy into it
        # (docs/design.md §5.6).
        m, T = bound.meta, q.shape[0]
        if self.config.dcp_size == 1:
            lo, hi, width = m.local_range
            if hi > lo:
                part = self._attend_local(bound, cache, q, index_q, index_w, lo, hi, width,
                                          ctx)[0]
                if (lo, hi) == (0, T):
                    return part.to(q.dtype)  # itself when the dtypes agree
            out = q.new_zeros(T, q.shape[1], self.config.v_head_dim)
            if hi > lo:
                out[lo:hi] = part
            return out
        nd = m.num_decode_tokens
        if nd == T and not m.chunk_ranges:
            o, lse = self._attend_local(bound, cache, q, index_q, index_w, 0, nd,
                                        m.decode_width, ctx)
            return self._merge_decode(bound, o, lse, ctx).to(q.dtype)
        out = q.new_zeros(T, q.shape[1], self.config.v_head_dim)
        for c in range(len(m.chunk_ranges)):
            self._attend_chunk(bound, cache, q, index_q, index_w, c, out, ctx)
        if nd:
            o, lse = self._attend_local(bound, cache, q, index_q, index_w, 0, nd,
                                        m.decode_width, ctx)
            out[:nd] = self._merge_decode(bound, o, lse, ctx)
        return out

    def _local_topk(self, bound, cache, index_q, index_w, lo, hi, width):
        """The indexer for tokens [lo, hi) over this rank's own cache: (scores, ids) of the
        decode tokens' local top-k and the prefill tokens' (W == 1) in one buffer."""
        k, t, cfg = self.kernels, bound.tables, self.config
        bt = bound.token_block_tables(lo, hi)
        # W == 1: the prefill tokens [nd, hi) score a contiguous copy of their requests' keys
        # with the prefill indexer (a key tile per query block, not one query a program)
        mid = max(lo, bound.meta.num_decode_tokens) if self._gathers_prefill(bound) else hi

        def decode_topk():
            return k.indexer_topk_decode(index_q[lo:mid], index_w[lo:mid], cache.index_k,
                                         t.local_len[lo:mid], bt[: mid - lo],
                                         cfg.block_size, cfg.dcp_size, self.dcp_rank,
                                         cfg.interleave_size, cfg.topk, max_keys=width)

        if mid == hi:
            return decode_topk()
        if mid == lo:
            return None, self._prefill_topk(bound, cache, index_q, index_w, mid, hi, width)
        # one buffer: the decode rows' top-k, then the prefill rows' (no cat). The prefill is
        # launched first: at a step's start the device runs its long kernels while the host
        # launches the decode's short ones (docs/design.md §5.5)
        scores = torch.empty(hi - lo, cfg.topk, dtype=torch.float32, device=index_q.device)
        top = torch.empty(hi - lo, cfg.topk, dtype=torch.int32, device=index_q.device)
        self._prefill_topk(bound, cache, index_q, index_w, mid, hi, width,
                           out=(scores[mid - lo:], top[mid - lo:]))
        dec_s, dec_i = decode_topk()
        scores[: mid - lo].copy_(dec_s)
        top[: mid - lo].copy_(dec_i)
        return scores, top

    def _local_selection(self, bound, cache, index_q, index_w, lo, hi, width) -> Selection:
        """A full layer's selection for tokens [lo, hi) over this rank's cache (W == 1: all
        its tokens; W > 1: the decode tokens, their candidates merged across the DCP group)."""
        k, cfg = self.kernels, self.config
        bt = bound.token_block_tables(lo, hi)
        scores, top = self._local_topk(bound, cache, index_q, index_w, lo, hi, width)
        w_size, inter, bs = cfg.dcp_size, cfg.interleave_size, cfg.block_size
        if bound.meta.decode_merge:  # W > 1: the decode rows' candidates from every rank
            all_s, all_i = coll.topk_candidates(bound.channel, scores, top)
            if self.decode_width < cfg.topk:  # this rank's share of the merged top-k, packed
                # into a narrower index (no merged list); rows holding more: the overflow pass
                packed = k.merge_local_slots(all_s, all_i, cfg.topk, w_size, self.dcp_rank, bt,
                                             bs, inter, self.decode_width)
                return Selection(None, None, packed, (all_s, all_i))
            top = k.merge_topk_candidates(all_s, all_i, cfg.topk, w_size)
        return Selection(top, k.filter_local_slots(top, bt, bs, w_size, self.dcp_rank, inter))

    def _attend_local(self, bound, cache, q, index_q, index_w, lo, hi, width, ctx):
        """Tokens [lo, hi) over this rank's own cache: (out, lse) of the attention with the
        layer's selection (its own, or its source layer's on a shared layer)."""
        k, cfg = self.kernels, self.config
        key = "local" if cfg.dcp_size == 1 else "decode"
        sel = ctx.select(bound.selections, key, lambda: self._local_selection(bound, cache, index_q,
                                                                   index_w, lo, hi, width))
        kv = self._kv_view(cache.kv)
        if sel.slots is None:  # the compacted W > 1 decode: (main, overflow, count)
            main, over, count = sel.packed
            plan = self._attention_plan(bound, "decode", q, lo, hi, kv.shape[0],
                                        topk=self.decode_width)
            out, lse = k.sparse_mla_attention(q[lo:hi], kv, main, self.sm_scale,
                                              kv_format=cfg.kv_cache_dtype, plan=plan)
            k.sparse_mla_overflow(q[lo:hi], kv, over, count, self.decode_width, out, lse,
                                  self.sm_scale, kv_format=cfg.kv_cache_dtype)
        else:
            plan = self._attention_plan(bound, key, q, lo, hi, kv.shape[0])
            out, lse = k.sparse_mla_attention(q[lo:hi], kv, sel.slots, self.sm_scale,
                                              kv_format=cfg.kv_cache_dtype, plan=plan)
        if ctx.want:
            ctx.ids.append((lo, hi, sel.token_ids(k, cfg)))
            if cfg.dcp_size == 1:
                ctx.lse.append((lo, hi, lse))
        return out, lse

    def _gathers_prefill(self, bound: BoundStep) -> bool:
        """W == 1 prefill tokens in this step."""
        m = bound.meta
        return self.config.dcp_size == 1 and m.num_tokens > m.num_decode_tokens

    def _prefill_topk(self, bound, cache, index_q, index_w, lo: int, hi: int, width: int, *,
                      out=None):
        """W == 1 prefill tokens [lo, hi) (all past the decodes): their requests' keys copied
        into one buffer (``bound.local_prefill``, 132 B a key), then the prefill indexer over it,
        as for a gather chunk with W = 1; ids are token positions, as the decode path's are.
        out: (scores, ids) views the indexer writes into."""
        src, pcu = bound.local_prefill
        nd = bound.meta.num_decode_tokens
        keys = gather_indexer_k(cache.index_k, src)
        return self.kernels.indexer_topk_prefill(
            index_q[lo:hi], index_w[lo:hi], keys, bound.tables.key_len[lo:hi],
            pcu[lo - nd: hi - nd], src.shape[0], 1, 1, self.config.topk, max_keys=width,
            out=out)[1]

    def _attend_chunk(self, bound, cache, q, index_q, index_w, c: int, out, ctx) -> None:
        """Prefill tokens of gather chunk c: all-gather the chunk's KV shards (and, on a full
        indexer layer, its indexer K), rank-major, never deinterleaved, read through remapped
        rows."""
        k, t, cfg, ch = self.kernels, bound.tables, self.config, bound.channel
        w_size, inter = cfg.dcp_size, cfg.interleave_size
        chunk = t.gather[c]
        pt, src = chunk.num_rows, chunk.src
        k_all = None
        if ctx.full:
            k_all = cache.index_k.new_empty((w_size * pt, cfg.index_k_bytes_per_token))
            coll.indexer_k_gather(ch, c, k_all, gather_indexer_k(cache.index_k, src))
        kv_all = cache.kv.new_empty((w_size * pt, cache.kv.shape[1]))
        coll.kv_gather(ch, c, kv_all, cache.kv.index_select(0, src))
        lo, hi, width = chunk.token_range
        if hi == lo:
            return
        pcu = t.region_pcu[lo:hi]

        def select():
            top = k.indexer_topk_prefill(index_q[lo:hi], index_w[lo:hi], k_all,
                                         t.key_len[lo:hi], pcu, pt, w_size, inter, cfg.topk,
                                         max_keys=width)[1]
            return Selection(top, k.remap_to_gathered(top, pcu, pt, w_size, inter))

        sel = ctx.select(bound.selections, f"chunk[{c}]", select)
        plan = self._attention_plan(bound, f"chunk[{c}]", q, lo, hi, kv_all.shape[0])
        o, lse = k.sparse_mla_attention(q[lo:hi], self._kv_view(kv_all), sel.slots,
                                        self.sm_scale, kv_format=cfg.kv_cache_dtype, plan=plan)
        out[lo:hi] = o
        if ctx.want:
            ctx.ids.append((lo, hi, sel.ids))
            ctx.lse.append((lo, hi, lse))

    def _merge_decode(self, bound, o_part, lse_part, ctx):
        """Exact LSE merge over DCP (docs/design.md §3.6): all-gather lse, scale, all-reduce."""
        lse_all = coll.decode_lse(bound.channel, lse_part)
        scaled = self.kernels.lse_scale(o_part, lse_all, self.dcp_rank)
        coll.decode_out(bound.channel, scaled)
        if ctx.want:
            ctx.lse.append((0, o_part.shape[0], torch.logsumexp(lse_all, dim=0)))
        return scaled

    # ------------------------------------------------------------------ formats
    def pack_kv(self, kv: torch.Tensor) -> torch.Tensor:
        """KV rows ``[n, 576]`` float -> the cache's bytes ``[n, kv_bytes]`` uint8 (fp8_ds_mla
        quantised, or bf16 bytes): what :meth:`insert` writes."""
        if self.config.kv_cache_dtype == "fp8_ds_mla":
            return self.kernels.quantize_fp8_ds_mla(kv)
        return kv.to(torch.bfloat16).contiguous().view(torch.uint8)

    def _kv_view(self, kv_bytes: torch.Tensor) -> torch.Tensor:
        """Cache bytes as the attention kernels read them: fp8_ds_mla rows stay uint8."""
        if self.config.kv_cache_dtype == "fp8_ds_mla":
            return kv_bytes
        return kv_bytes.view(torch.bfloat16)

    def _attention_plan(self, bound: BoundStep, key: str, q: torch.Tensor, lo: int, hi: int,
                        num_kv_rows: int, topk: int | None = None):
        """The pass's kernel plan, made once per bound step (host shapes only, no sync);
        ``topk``: the pass's index width (default the config's)."""
        plan = bound.attention.get(key)
        if plan is None:
            plan = self.kernels.plan_attention(
                num_tokens=hi - lo, num_heads=q.shape[1], topk=topk or self.config.topk,
                kv_format=self.config.kv_cache_dtype, num_kv_rows=num_kv_rows, q_dtype=q.dtype,
                device=self.device)
            bound.attention[key] = plan
        return plan
