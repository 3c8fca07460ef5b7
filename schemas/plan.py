"""StepPlan: one scheduler step compiled for every rank (docs/design.md §3).

A plan is a frozen, keyword-only msgspec Struct holding integers, strings and arrays only (no
floats), so its canonical msgpack bytes and digest are the same in every process. Tables are
per request (``[N]``) and per published row (``[R]`` or ``[P, R]``); token-level arrays are not
stored, and are materialised on demand by the methods here (numpy only).
"""

from __future__ import annotations

import msgspec
import numpy as np

from cpplan.schemas.arrays import Array
from cpplan.schemas.config import ParallelConfig
from cpplan.schemas.sharding import local_index, owner

MODE_DECODE = 0
MODE_SPLIT = 1
MODE_REPLICATED = 2
MODE_OWNED = 3  # a decode computed by one PCP rank (ParallelConfig.shard_decode_requests)
MODE_NAMES = ("decode", "split", "replicated", "owned")
# modes whose rows hold different tokens on different PCP ranks: each rank's copy is its own
# (restored, sampled and KV-written from the rank that holds it), not PCP rank 0's
PER_RANK_MODES = (MODE_SPLIT, MODE_OWNED)

EAGER = 0  # cudagraph_size of a step that runs eager


class Collective(msgspec.Struct, frozen=True, kw_only=True):
    """One collective the step issues, per rank, in issue order (docs/design.md §3.8).

    ``shape`` is the per-rank input; ``bytes`` = prod(shape) * itemsize (summed over the dtypes
    of a packed entry such as ``topk_candidates``: ``float32+int32``). ``per_layer`` entries are
    issued once per layer (on the layers of ``layers`` only, when it is not empty: the indexer's
    collectives where some layers share an earlier layer's top-k), the others once per step.
    """

    name: str
    op: str  # "all_gather" | "all_reduce"
    group: str  # "pcp" | "dcp"
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    per_layer: bool
    layers: tuple[int, ...] = ()  # schema 2: the layers a per-layer entry is issued on; () all

    def issued_on(self, layer: int) -> bool:
        """A per-layer entry: whether ``layer`` issues it."""
        return not self.layers or layer in self.layers

    def issues_per_step(self, num_layers: int) -> int:
        """How many times one step issues it."""
        if not self.per_layer:
            return 1
        return len(self.layers) if self.layers else num_layers


class GatherChunk(msgspec.Struct, frozen=True, kw_only=True):
    """A run of prefill requests whose DCP-gathered KV fits the workspace (docs/design.md §3.5).

    Per region (request) j of the chunk: ``requests[j]`` the request index, ``pad[j]`` =
    shard_rows(E) rows every DCP rank contributes; ``padded_local_cu`` [n+1] and ``global_cu``
    [n+1] the exclusive prefix sums of pad and of extents. ``padded_local_total`` is PT (each
    rank all-gathers ``[PT, bytes]``); ``total`` the chunk's tokens in global order.
    """

    requests: Array  # [n] int32
    pad: Array  # [n] int32
    padded_local_cu: Array  # [n + 1] int64
    global_cu: Array  # [n + 1] int64
    padded_local_total: int
    total: int

    def gathered_row(self, region: np.ndarray, token: np.ndarray, dcp_size: int,
                     interleave_size: int) -> np.ndarray:
        """Row of the rank-major gathered buffer ``[W * PT]`` holding token ``token`` of region
        ``region`` (both int arrays of one shape): owner(t) * PT + pcu[region] + local(t)."""
        token = np.asarray(token, dtype=np.int64)
        pcu = self.padded_local_cu.np()
        return (owner(token, dcp_size, interleave_size) * self.padded_local_total
                + pcu[np.asarray(region)] + local_index(token, dcp_size, interleave_size))

    def deinterleave(self, dcp_size: int, interleave_size: int) -> np.ndarray:
        """int64 [total]: gathered row of every token of the chunk, in global token order."""
        gcu = self.global_cu.np()
        extents = np.diff(gcu)
        region = np.repeat(np.arange(len(extents)), extents)
        token = np.arange(self.total, dtype=np.int64) - gcu[region]
        return self.gathered_row(region, token, dcp_size, interleave_size)


class StepPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Everything every rank does in one step. Names follow docs/design.md §2.1.

    Requests (input order), each ``[N]``: ``num_computed_tokens``, ``num_scheduled_tokens``
    (int32), ``is_prefilling`` and ``mode`` (uint8, MODE_*), ``chunk_size`` (cs = ceil(q/S) for
    split requests, q otherwise), ``dcp_shard_rows`` (int32, = extent when W == 1) and
    ``dcp_local_lens`` ``[N, W]`` int32 (KV tokens of the extent on each DCP rank).

    Rows (published order, identical on all ranks; zero-length rows kept): ``row_request``
    ``[R]`` int32; per PCP rank ``row_query_offset``, ``row_num_tokens`` and
    ``row_token_start`` (row's first token in the rank's token order) ``[P, R]`` int32;
    ``row_kv_write`` ``[P, R]`` uint8: 1 where rank p's copy of the row's new KV is written (a
    replicated prefill is written from PCP rank 0 only). The first ``num_decode_rows`` rows are
    decodes, holding ``num_decode_tokens`` tokens on every rank. Under
    ``config.shard_decode_requests`` decodes are MODE_OWNED instead (both counts are then 0):
    still the first rows, each holding its tokens on its owner rank only, whose copy alone is
    written (``row_kv_write``).

    Shapes: ``num_tokens[p]`` real tokens of PCP rank p, ``padded_num_tokens`` T for all ranks,
    ``cudagraph_size`` the graph size T came from (EAGER = 0).

    Sampled rows (schema 2; None when the step names none): ``is_sampled`` ``[N]`` uint8 as
    the step gave it; ``sampled_source`` ``[n_sampled, 2]`` int32, per sampled request in
    ascending request index, the PCP rank that supplies its last scheduled token and the
    token's index in that rank's token order (a split request's last token comes from the rank
    that computed it, a decode's or replicated prefill's from PCP rank 0, as in restore).
    """

    config: ParallelConfig
    step_id: int
    req_ids: tuple[str, ...]
    num_computed_tokens: Array
    num_scheduled_tokens: Array
    is_prefilling: Array
    mode: Array
    chunk_size: Array
    dcp_shard_rows: Array
    dcp_local_lens: Array
    row_request: Array
    row_query_offset: Array
    row_num_tokens: Array
    row_token_start: Array
    row_kv_write: Array
    num_decode_rows: int
    num_decode_tokens: int
    num_tokens: tuple[int, ...]
    padded_num_tokens: int
    cudagraph_size: int
    gather_chunks: tuple[GatherChunk, ...]
    collectives: tuple[Collective, ...]
    is_sampled: Array | None = None
    sampled_source: Array | None = None

    # ---- derived views (not stored) ----
    @property
    def num_requests(self) -> int:
        return len(self.req_ids)

    @property
    def num_rows(self) -> int:
        return self.row_request.shape[0]

    @property
    def graph_replayable(self) -> bool:
        """A decode-only step padded to a CUDA-graph size (docs/design.md §3.7): the runtime
        runs all T tokens through the decode pass (padded ones have no key), the decode
        collectives carry T rows, and a captured graph may replay it."""
        return (self.cudagraph_size != EAGER and self.num_decode_tokens > 0
                and self.num_decode_rows == self.num_rows)

    def extent(self) -> np.ndarray:
        """int64 [N]: c + q."""
        return self.num_computed_tokens.np().astype(np.int64) + self.num_scheduled_tokens.np()

    def row_position_start(self) -> np.ndarray:
        """int64 [P, R]: position of each row's first token (c of its request + query offset)."""
        c = self.num_computed_tokens.np().astype(np.int64)
        return c[self.row_request.np()][None, :] + self.row_query_offset.np()

    @property
    def num_sampled(self) -> int:
        """Sampled requests (0 when the step names none)."""
        return 0 if self.sampled_source is None else self.sampled_source.shape[0]

    def sampled_rows_per_rank(self) -> int:
        """M: the most sampled tokens any PCP rank supplies (restore_sampled's ``[M, hidden]``;
        0 at P == 1, where nothing is gathered)."""
        if not self.num_sampled or self.config.pcp_size == 1:
            return 0
        ranks = self.sampled_source.np()[:, 0]
        return int(np.bincount(ranks, minlength=self.config.pcp_size).max())

    def sampled_send_rows(self, pcp_rank: int) -> np.ndarray:
        """int64 [M]: the token indices PCP rank ``pcp_rank`` sends in restore_sampled, its
        sampled tokens in request order, padded with token 0 (those rows are never read);
        empty at P == 1, where nothing is gathered."""
        if self.config.pcp_size == 1 or not self.num_sampled:
            return np.zeros(0, dtype=np.int64)
        src = self.sampled_source.np()
        mine = src[src[:, 0] == pcp_rank, 1].astype(np.int64)
        out = np.zeros(self.sampled_rows_per_rank(), dtype=np.int64)
        out[: len(mine)] = mine
        return out

    def sampled_restore_index(self) -> np.ndarray:
        """int64 [n_sampled]: each sampled request's row in the gathered ``[P * M]`` buffer of
        restore_sampled (P == 1: its token index on the rank)."""
        if not self.num_sampled:
            return np.zeros(0, dtype=np.int64)
        src = self.sampled_source.np().astype(np.int64)
        ranks = src[:, 0]
        # rank-major: a rank's k-th sampled token is row k of its block
        order = np.argsort(ranks, kind="stable")
        within = np.empty(len(ranks), dtype=np.int64)
        counts = np.bincount(ranks, minlength=self.config.pcp_size)
        starts = np.cumsum(counts) - counts
        within[order] = np.arange(len(ranks)) - np.repeat(starts, counts)
        if self.config.pcp_size == 1:
            return src[:, 1]
        return ranks * self.sampled_rows_per_rank() + within

    def mode_names(self) -> list[str]:
        return [MODE_NAMES[m] for m in self.mode.np()]

    def restore_index(self) -> np.ndarray:
        """int64 [sum q]: for every query token in global order (request by request), its row
        in the PCP-gathered ``[P * T]`` buffer. Split tokens come from the rank that computed
        them (an owned decode's from its owner); decode and replicated tokens from PCP rank
        0."""
        p_size, t_pad = self.config.pcp_size, self.padded_num_tokens
        req = self.row_request.np()
        mode = self.mode.np()[req]
        offs = self.row_query_offset.np()
        lens = self.row_num_tokens.np()
        start = self.row_token_start.np()
        take = np.ones((p_size, len(req)), dtype=bool)
        take[1:, ~np.isin(mode, PER_RANK_MODES)] = False
        rank, row = np.nonzero(take & (lens > 0))
        q = self.num_scheduled_tokens.np().astype(np.int64)
        qcu = np.concatenate(([0], np.cumsum(q)))
        out = np.empty(int(qcu[-1]), dtype=np.int64)
        seg_len = lens[rank, row].astype(np.int64)
        seg_dst = qcu[req[row]] + offs[rank, row]
        seg_src = rank.astype(np.int64) * t_pad + start[rank, row]
        within = np.arange(int(seg_len.sum())) - np.repeat(np.cumsum(seg_len) - seg_len, seg_len)
        out[np.repeat(seg_dst, seg_len) + within] = np.repeat(seg_src, seg_len) + within
        return out
