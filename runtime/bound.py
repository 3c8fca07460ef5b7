"""What a bound step and a layer's caches are, on one rank (docs/design.md §5.3).

``LayerCache``: one layer's paged KV and indexer-K caches, owned by the engine. ``BoundStep``:
a plan bound on one rank by :meth:`StepExecutor.bind <cpplan.runtime.executor.StepExecutor.bind>`
(the arena's views of its tables, host meta, the collective channel, the layers run so far and
the selections shared layers reuse). ``DUMMY_SLOT``: the reserved slot padded rows point at.
"""

from __future__ import annotations

import dataclasses

import torch

from cpplan.runtime import collectives as coll
from cpplan.runtime.executor_args import check_device, is_int_in_range
from cpplan.runtime.segments import local_prefill_keys
from cpplan.runtime.tables import Layout, StepMeta, StepTables, iota, local_prefill_rows
from cpplan.runtime.tokens import TokenView, host_tokens, token_view
from cpplan.schemas.config import ParallelConfig
from cpplan.schemas.errors import ConfigError
from cpplan.schemas.plan import StepPlan

DUMMY_SLOT = 0  # slot 0 (block 0) of every cache is reserved: padded and skipped rows use it

@dataclasses.dataclass
class LayerCache:
    """One layer's paged caches on one rank: ``kv [S, kv_bytes]`` uint8 (fp8_ds_mla or bf16
    bytes, a slot's row; S = num_blocks * block_size) and ``index_k [num_blocks, block_size *
    132]`` uint8, block-planar: a block's block_size x 128 fp8 values, then its block_size
    float32 scales (docs/design.md §4.3; ``gather_indexer_k`` / ``scatter_indexer_k`` move
    packed rows). Slot DUMMY_SLOT is reserved. Owned by the engine, lives as long as it does."""

    kv: torch.Tensor
    index_k: torch.Tensor

    @classmethod
    def empty(cls, config: ParallelConfig, num_blocks: int, device) -> LayerCache:
        """Zeroed caches of ``num_blocks`` blocks (block 0 reserved: at least 2)."""
        if not is_int_in_range(num_blocks, 2, 2**31 - 1):
            raise ConfigError(f"LayerCache.empty num_blocks: got {num_blocks!r}; expected an "
                              "integer in [2, 2**31) (block 0 is reserved)")
        device = check_device(device, "LayerCache.empty") if device is not None else None
        slots = int(num_blocks) * config.block_size
        # normal tensors even under torch.inference_mode(): an inference tensor cannot be
        # written outside that mode, and the caches outlive the block that made them
        with torch.inference_mode(False):
            return cls(torch.zeros(slots, config.kv_bytes_per_token, dtype=torch.uint8,
                                   device=device),
                       torch.zeros(num_blocks, config.block_size * config.index_k_bytes_per_token,
                                   dtype=torch.uint8, device=device))


@dataclasses.dataclass
class BoundStep:
    """A plan bound on one rank: the arena's views of its table segments, the host meta and
    layout, and the step's collective channel (ledger + the digest check in flight). The typed
    device tables are expanded from the views at first use (:attr:`tables`), so a step that a
    captured graph replays (runtime/graphs.py) never expands them eagerly."""

    plan: StepPlan
    meta: StepMeta
    layout: Layout
    views: dict  # name -> device view into the arena (alive for arena_depth binds)
    channel: coll.StepChannel
    # attention pass ("local" / "decode" / "chunk[c]") -> the kernel plan every layer runs;
    # chosen at the pass's first call from host shapes (the cache's rows are first seen there)
    attention: dict = dataclasses.field(default_factory=dict)
    _tables: StepTables | None = None
    _local_prefill: tuple | None = None
    _block_tables: dict = dataclasses.field(default_factory=dict)  # (lo, hi) -> rows' tables
    lease: tuple | None = None  # (arena slot, commit) of the views; None: static views (graphs)
    finished: bool = False
    cache_rows: int = 0  # the rows the layer caches need: the step's largest block's end
    owner: object = None  # the StepExecutor that bound it (None: a graph capture's own step)
    pcp_rank: int = 0
    _tokens: TokenView | None = None
    _host_tokens: tuple | None = None
    layers_inserted: int = 0  # layers run so far this step (they run in order)
    layers_attended: int = 0
    # (layer, attention pass) -> Selection of a full layer a later shared layer reuses
    selections: dict = dataclasses.field(default_factory=dict)

    @property
    def local_prefill(self) -> tuple:
        """W == 1: (src, pcu) of the local prefill keys buffer (tables.local_prefill_rows),
        derived once per step at first use."""
        if self._local_prefill is None:
            self._local_prefill = local_prefill_rows(self.tables, self.meta, self.layout,
                                                     local_prefill_keys(self.plan))
        return self._local_prefill

    @property
    def tokens(self) -> TokenView:
        """Which request and position each of this rank's T rows is, and which are padding
        (:class:`~cpplan.runtime.tokens.TokenView`): the rows of every per-token tensor the
        engine passes to insert / attend / restore. Built once per step at first use."""
        if self._tokens is None:
            t = self.tables
            self._tokens = token_view(self.host_tokens, t.token_req, t.token_pos,
                                      iota(self.plan.padded_num_tokens, t.token_req.device))
        return self._tokens

    @property
    def host_tokens(self) -> tuple:
        """(request [T], position [T], real count) of this rank's rows on the host only
        (:func:`~cpplan.runtime.tokens.host_tokens`; what :attr:`tokens` holds as numpy):
        no device work, so a step a graph replays need not expand its tables for it."""
        if self._host_tokens is None:
            self._host_tokens = host_tokens(self.plan, self.pcp_rank)
        return self._host_tokens

    @property
    def device(self) -> torch.device:
        """The device of the step's tables (the executor's)."""
        return next(iter(self.views.values())).device

    @property
    def sampled_counts(self) -> tuple[int, int]:
        """(M, n_sampled) of a step that names its sampled rows (host integers)."""
        return self.plan.sampled_rows_per_rank(), self.plan.num_sampled

    @property
    def tables(self) -> StepTables:
        if self._tables is None:
            self._tables = StepTables.expand(self.views, self.meta, self.layout)
        return self._tables

    def use_tables(self, tables: StepTables) -> None:
        """Point the step at tables expanded elsewhere (a graph's static copy)."""
        self._tables = tables
        self._block_tables.clear()
        self._tokens = None

    def token_block_tables(self, lo: int, hi: int) -> torch.Tensor:
        """The block-table row of each of tokens [lo, hi) (their requests' rows), gathered once
        per step and shared by every layer's pass over those tokens."""
        bt = self._block_tables.get((lo, hi))
        if bt is None:
            t = self.tables
            bt = self._block_tables[(lo, hi)] = t.block_tables.index_select(0, t.token_req[lo:hi])
        return bt

    @property
    def ledger(self) -> coll.Ledger:
        return self.channel.ledger
