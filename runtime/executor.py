"""StepExecutor: one rank's runtime for compiled plans (docs/design.md §3.4-3.8, §5).

Per step: ``bind`` (tables into the arena ring, one H2D copy, the digest check started), then per
layer ``insert`` (KV and indexer-K insert) and ``attend`` (indexer top-k and sparse MLA: gathered
KV through remapped rows for prefill tokens, the local shard plus an exact LSE merge for decode
tokens), then ``restore`` and ``finish``. The engine owns the tensors (q, KV, caches); the
executor owns the tables and issues exactly the plan's collectives, each through one named
function of :mod:`cpplan.runtime.collectives`. Kernels come from the dispatch table; the
indexer entry points get their key width (``max_keys``) from the plan's tables, since reading it
from the device would be a host sync. Step code never reads a tensor's value on the
host (no ``.item()``, ``.cpu()``, ``.tolist()``, ``synchronize``): tests/runtime checks this.

A rank that raises inside a step announces its error on the control plane before re-raising,
so its peers stop with a PeerFailedError naming it instead of waiting out the data timeout
(runtime/faults.py; at bind through the digest check's status byte).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np
import torch

from cpplan.runtime import collectives as coll
from cpplan.runtime.arena import ArenaRing, arena_words
from cpplan.runtime.exchange import ROWS
from cpplan.runtime.faults import FaultBoard, StepWatch, Watchdog, one_line
from cpplan.runtime.kernels import gather_indexer_k, get_kernels, scatter_indexer_k
from cpplan.runtime.kernels import reference as kref
from cpplan.runtime.segments import (AliasCheck, build_tables, check_block_tables,
                                     compile_host_kernels, int_in, local_prefill_keys)
from cpplan.runtime.tables import (TABLE_NAMES, Layout, StepMeta, StepTables, iota,
                                   local_prefill_rows)
from cpplan.runtime.selection import Attended, LayerPass, Selection, keeps_selection
from cpplan.runtime.tokens import TokenView, pack_sampled, token_view
from cpplan.schemas.config import ParallelConfig
from cpplan.schemas.errors import (
    CapacityError,
    ConfigError,
    CpplanError,
    PlanMismatchError,
    RankLostError,
    TensorArgError,
    UsageError,
)
from cpplan.schemas.plan import StepPlan

DUMMY_SLOT = 0  # slot 0 (block 0) of every cache is reserved: padded and skipped rows use it


# how W == 1 prefill tokens reach their keys: "gather" (the default), a per-step copy of their
# requests' keys and the prefill indexer; "paged", the decode indexer over the paged cache (one
# query per program). H200, 32k prompt + 64 decodes: indexer 35.3 against 85.9 ms a layer
# (StepExecutor.prefill_keys; bench/step_gpu.py --prefill-keys both compares them)
PREFILL_KEYS = ("paged", "gather")


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
    def empty(cls, config: ParallelConfig, num_blocks: int, device) -> "LayerCache":
        """Zeroed caches of ``num_blocks`` blocks (block 0 reserved: at least 2)."""
        if not int_in(num_blocks, 2, 2**31 - 1):
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
            self._tokens = token_view(self.plan, self.pcp_rank, t.token_req, t.token_pos,
                                      iota(self.plan.padded_num_tokens, t.token_req.device))
        return self._tokens

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


MAX_ARENA_WORDS = 1 << 28  # 2 GiB of int64 words per arena: far above any real step's tables
# the dims the runtime's kernels and cache formats take (docs/design.md §4); a config may plan
# other dims, but no kernel here would compute them
RUNTIME_DIMS = {"qk_head_dim": 576, "v_head_dim": 512, "index_head_dim": 128}


def _check_executor_args(config, **ints) -> None:
    """A StepExecutor's sizes, before anything is allocated: ConfigError (got / expected) for a
    config this runtime cannot run, a rank outside its group or a size that is not a positive
    integer (a rank out of range would read other ranks' rows of the plan: a wrong answer)."""
    if not isinstance(config, ParallelConfig):
        raise ConfigError(f"config: got {type(config).__name__}; expected a ParallelConfig")
    for name, want in RUNTIME_DIMS.items():
        if getattr(config, name) != want:
            raise ConfigError(f"{name}: got {getattr(config, name)}; expected {want}, the only "
                              "value this runtime's kernels and cache formats take")
    sizes = {"pcp_rank": config.pcp_size, "dcp_rank": config.dcp_size}
    for name, value in ints.items():
        if value is None and name == "max_blocks_per_request":
            continue
        low = 0 if name in sizes else 1
        high = sizes.get(name, 1 << 31) - 1
        if not int_in(value, low, high):
            want = (f"0..{high} (the config's {name[:3].upper()} size is {high + 1})"
                    if name in sizes else "a positive integer below 2**31")
            raise ConfigError(f"StepExecutor {name}: got {value!r}; expected {want}")


def check_device(device, where: str) -> torch.device:
    """``device`` as a torch.device this process can allocate on: ConfigError (got / expected)
    for what is no device name, or a CUDA device where there is none (torch's own errors
    were an AssertionError "Torch not compiled with CUDA enabled" or a pinned-memory
    RuntimeError)."""
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError, ValueError):
        raise ConfigError(f"{where} device: got {device!r}; expected a torch device ('cpu', "
                          "'cuda', 'cuda:1' or a torch.device)") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"{where} device: got {str(dev)!r}; expected 'cpu': no CUDA "
                              "device here (torch.cuda.is_available() is False)")
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"{where} device: got {str(dev)!r}; expected cuda:0..cuda:"
                              f"{count - 1} ({count} CUDA devices here)")
    return dev


def check_sm_scale(sm_scale) -> float:
    """The attention's softmax scale as a float: ConfigError unless a finite positive number.
    It is the model's own (docs/design.md §4.1: for MLA ``(qk_nope + qk_rope) ** -0.5`` times
    the yarn mscale squared), never 1/sqrt(576): a wrong scale gives no error, only wrong
    tokens."""
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float, np.floating,
                                                                 np.integer)):
        raise ConfigError(f"sm_scale: got {type(sm_scale).__name__} {sm_scale!r}; expected a "
                          "finite positive float (the model's softmax scale)")
    value = float(sm_scale)
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"sm_scale: got {value!r}; expected a finite positive float (the "
                          "model's softmax scale)")
    return value


class StepExecutor:
    """One per rank, sized once. ``sm_scale`` is the model's softmax scale, used by every
    attention pass (required: there is no default that is right for a model). ``comm``
    carries the collectives; ``check`` (a :class:`~cpplan.runtime.verify.DigestCheck`,
    optional) verifies plans across ranks. :meth:`from_groups` builds one for a rank of a
    torch.distributed world, :meth:`local` one for a single device with no world."""

    def __init__(self, config: ParallelConfig, *, sm_scale: float, pcp_rank: int,
                 dcp_rank: int, comm, device, check=None, kernels=None, max_tokens: int = 8192,
                 max_requests: int = 1024, max_blocks_per_request: int | None = None,
                 arena_depth: int = 2,
                 debug: bool = True, faults: FaultBoard | None = None,
                 data_timeout_s: float = 0.0, prefill_keys: str = "gather",
                 dcp_compact: bool | int | str = "auto") -> None:
        self.sm_scale = check_sm_scale(sm_scale)
        _check_executor_args(config, pcp_rank=pcp_rank, dcp_rank=dcp_rank,
                             max_tokens=max_tokens, max_requests=max_requests,
                             max_blocks_per_request=max_blocks_per_request,
                             arena_depth=arena_depth)
        if isinstance(data_timeout_s, bool) or not isinstance(data_timeout_s, (int, float)) \
                or not 0 <= data_timeout_s < math.inf:  # False for NaN
            raise ConfigError(f"StepExecutor data_timeout_s: got {data_timeout_s!r}"[:160]
                              + "; expected a finite number of seconds >= 0")
        if prefill_keys not in PREFILL_KEYS:
            raise ConfigError(f"prefill_keys must be one of {PREFILL_KEYS}: got {prefill_keys!r}")
        self.prefill_keys = prefill_keys
        # dcp_compact: W > 1 decode attention over the rank's slots packed into
        # compact_width(topk, W) columns plus an overflow pass for rows holding more, not topk
        # columns mostly -1 (True; an int: that width, e.g. to force the overflow pass in
        # tests). "auto" (the default): on where interleave_size == 1, where a row's keys
        # alternate over the ranks token by token, so its top-k splits evenly unless its scores
        # follow the token's parity: on two H200s the P = W = 2 decode step (64 x 2k-6k)
        # 0.96 against 1.03 ms back to back (bench/step_gpu.py --dcp-compact on|off). Larger
        # interleaves keep whole runs of a row's keys on one rank, and a row holding most of
        # its top-k on one rank takes the overflow pass, which is slow (149.0 against 105.4 us
        # when 8 of 64 rows hold all their keys on one rank: bench/dcp_attention.py).
        if dcp_compact == "auto":
            dcp_compact = config.interleave_size == 1
        elif type(dcp_compact) not in (bool, int):
            raise ConfigError(f"dcp_compact: got {dcp_compact!r}, expected 'auto', True, False "
                              "or a width")
        self.decode_width = config.topk
        if dcp_compact is not False:
            width = (dcp_compact if type(dcp_compact) is int
                     else kref.compact_width(config.topk, config.dcp_size))
            if not 1 <= width <= config.topk:
                raise ConfigError(f"dcp_compact width: got {width}, expected 1..{config.topk} "
                                  "(topk)")
            if config.dcp_size > 1:
                self.decode_width = width
        self.config, self.pcp_rank, self.dcp_rank = config, pcp_rank, dcp_rank
        self.comm, self.check, self.debug = comm, check, debug
        self.faults, self.data_timeout_s = faults, data_timeout_s
        self.watchdog: Watchdog | None = None
        self.device = check_device(device, "StepExecutor")
        self._arg_device = (torch.device("cuda", torch.cuda.current_device())  # "cuda" alone
                            if self.device.type == "cuda" and self.device.index is None
                            else self.device)
        self.kernels = kernels or get_kernels(str(self.device.type))
        self.max_tokens, self.max_requests = max_tokens, max_requests
        if max_blocks_per_request is None:
            max_blocks_per_request = -(-config.shard_rows(config.max_model_len)
                                       // config.block_size)
        words = arena_words(max_tokens, max_requests, max_blocks_per_request, config.pcp_size,
                            config.dcp_size, config.cudagraph_token_sizes)
        if arena_depth >= ROWS - 1:  # the shared-memory digest board's bound (exchange.py)
            raise ConfigError(f"arena_depth: got {arena_depth}, expected at most {ROWS - 2}")
        if words > MAX_ARENA_WORDS:  # refused before a pinned allocation of that size
            raise ConfigError(
                f"the step arena would hold {words:,} words ({words * 8 / 2**30:.1f} GiB, "
                f"x{arena_depth} on the host and the device) for max_requests {max_requests:,} x "
                f"max_blocks_per_request {max_blocks_per_request:,} (from max_model_len "
                f"{config.max_model_len:,}); expected at most {MAX_ARENA_WORDS:,}: pass smaller "
                "max_requests or max_blocks_per_request")
        self.arena = ArenaRing(words, self.device, arena_depth)
        compile_host_kernels()  # bind's host kernels, compiled (or loaded) now rather than at step 1
        self._aliases = AliasCheck()  # blocks written in a step belong to one request
        self._last_bound: BoundStep | None = None  # refuse() after bind fails this step
        self._act = coll.ACT_DTYPES[config.activation_dtype]  # q, the outputs, restore's rows

    @classmethod
    def local(cls, config: ParallelConfig, *, sm_scale: float, device="cpu",
              **kwargs) -> "StepExecutor":
        """A one-rank executor (P = W = 1) that needs no torch.distributed world: such a plan
        lists no collective and there is no peer to verify a digest with. Same API as
        :meth:`from_groups`'s (``kwargs``: the constructor's sizes and options)."""
        if not isinstance(config, ParallelConfig):
            raise ConfigError(f"StepExecutor.local: got {type(config).__name__}; expected a "
                              "ParallelConfig")
        if config.world_size != 1:
            raise ConfigError(f"StepExecutor.local: got pcp_size={config.pcp_size}, dcp_size="
                              f"{config.dcp_size}; expected 1 and 1 (more ranks need a world: "
                              "Groups.build and StepExecutor.from_groups)")
        return cls(config, sm_scale=sm_scale, pcp_rank=0, dcp_rank=0, comm=coll.NoComm(),
                   device=device, **kwargs)

    @classmethod
    def from_groups(cls, config: ParallelConfig, groups, *, sm_scale: float,
                    verify: str = "every", verify_every: int = 1, digest_exchange: str = "auto",
                    **kwargs) -> "StepExecutor":
        """A collective call on ``groups`` (the digest exchange is set up here).
        digest_exchange: "auto", "shm" or "gloo" (runtime/exchange.py)."""
        from cpplan.runtime.verify import DigestCheck, agree_on_setup

        if getattr(groups, "config", None) != config:
            got = (f"groups of {groups.config!r}" if hasattr(groups, "config")
                   else type(groups).__name__)
            raise ConfigError(f"from_groups: got {got}; expected Groups built for this "
                              f"config ({config!r})")
        board = FaultBoard(groups)
        agree_on_setup(groups, config, verify=verify, verify_every=verify_every,
                       digest_exchange=digest_exchange)
        try:
            check = DigestCheck(groups, verify, verify_every, board, exchange=digest_exchange)
        except RuntimeError as exc:  # the exchange's set-up traffic: a peer gone or late
            if isinstance(exc, CpplanError):
                raise
            raise RankLostError(f"digest exchange set-up on control rank {groups.control_rank}:"
                                f" a peer did not take part within the control timeout "
                                f"({groups.control_timeout_s:g} s): {one_line(exc)}") from None
        ex = cls(config, sm_scale=sm_scale, pcp_rank=groups.pcp_rank, dcp_rank=groups.dcp_rank,
                 comm=coll.DistComm(groups), device=groups.device, check=check, faults=board,
                 data_timeout_s=groups.timeout_s, **kwargs)
        if groups.device.type == "cuda" and board.store is not None:
            ex.watchdog = Watchdog(board, groups)  # the host never blocks in an NCCL call
        return ex

    # ------------------------------------------------------------------ bind
    def bind(self, plan: StepPlan, block_tables: np.ndarray,
             num_blocks: int | None = None) -> BoundStep:
        """Start the digest check, build the rank's table segments (host, O(rows + requests))
        and pack them into the next arena (one H2D copy); the step's tables are expanded on the
        device at first use (:attr:`BoundStep.tables`). ``block_tables`` ``[N, max_blocks]``
        int: this rank's local blocks of each of the plan's requests (block 0 is reserved);
        ``num_blocks`` (optional) the cache's block count, to refuse out-of-range blocks. Bad tables or a plan compiled for another config
        raise before anything is sent or written; the peers then raise PeerFailedError at the
        digest check (or, with the check off for this step, in their first collective)."""
        if not isinstance(plan, StepPlan):
            raise UsageError(f"bind: got {type(plan).__name__}; expected a StepPlan (from "
                             "cpplan.api.compile or a decoded plan file)")
        seq = self.faults.next_step() if self.faults is not None else 0
        watch = StepWatch(self.faults, seq, plan.step_id, self.data_timeout_s)
        try:
            bt, top = self._check_bind(plan, block_tables, num_blocks)
        except Exception as exc:
            self._fail_bind(plan, watch, exc)
            raise
        pending = self.check.start(plan) if self.check is not None else None
        try:  # not _announcing: bind runs cold after a step's work, each host call counts
            words = self.arena.acquire()
            host = build_tables(plan, self.pcp_rank, self.dcp_rank, bt, DUMMY_SLOT, out=words)
            names, sizes = TABLE_NAMES, host.sizes
            if plan.is_sampled is not None:  # restore_sampled's two indices, after the tables
                names, sizes = names + ("sampled",), sizes + (
                    pack_sampled(plan, self.pcp_rank, words, sum(sizes)),)
            views = self.arena.commit(names, sizes)
        except Exception as exc:
            self._announce(watch, exc)
            raise
        if self.watchdog is not None:
            self.watchdog.watch(watch)
        self._last_bound = BoundStep(plan, host.meta, host.layout, views,
                         coll.StepChannel(self.comm, pending, watch,
                                          plan if self.debug else None, self.rank_id),
                         lease=self.arena.lease,
                         owner=self, pcp_rank=self.pcp_rank,
                         cache_rows=(top + 1) * plan.config.block_size)
        return self._last_bound

    def refuse(self, plan: StepPlan, exc: BaseException) -> None:
        """This rank cannot run ``plan``: a failure of the engine's own between compile and
        bind (its blocks could not be allocated, a recording could not be written). In place
        of ``bind``, on this rank only: the peers are told as for a failed bind (they raise
        PeerFailedError naming this rank and ``exc`` at the step's digest check, or, with the
        check off for the step, at their first collective, rather than waiting out a timeout
        for this rank), then ``exc`` is raised here (a plan that differs across ranks is
        named first, as PlanMismatchError). After ``bind`` (the engine failed mid-step, between
        two calls of its own), pass the plan or its BoundStep: the failure is posted for that
        step, so a peer inside one of its collectives raises PeerFailedError within about a
        second (gloo; on CUDA the watchdog aborts the data groups) instead of waiting out the
        data timeout, and the step is closed."""
        if not isinstance(exc, BaseException):  # `raise exc` would be a TypeError
            what = (f"the class {exc.__name__}" if isinstance(exc, type)
                    else f"{type(exc).__name__} {exc!r}"[:120])
            raise UsageError(f"refuse exc: got {what}; expected an exception instance (the "
                             "engine's own failure, raised again here)")
        bound = plan if isinstance(plan, BoundStep) else self._last_bound
        if bound is not None and (bound is plan or bound.plan is plan) and bound.owner is self \
                and not bound.finished:  # after bind, mid-step: the step's own failure slot
            bound.finished = True
            if self.watchdog is not None:
                self.watchdog.watch(None)
            self._announce(bound.channel.watch, exc)
            raise exc
        if not isinstance(plan, StepPlan):
            raise UsageError(f"refuse: got {type(plan).__name__}; expected a StepPlan or the "
                             "BoundStep that bind() returned")
        seq = self.faults.next_step() if self.faults is not None else 0
        self._fail_bind(plan, StepWatch(self.faults, seq, plan.step_id, self.data_timeout_s),
                        exc)
        raise exc

    def _fail_bind(self, plan: StepPlan, watch: StepWatch, exc: BaseException) -> None:
        """A bind that will raise ``exc``: announce it, take part in the digest check as failed
        (a plan that differs across ranks is named first: its wait raises that)."""
        self._announce(watch, exc)
        pending = self.check.start(plan, failed=True) if self.check is not None else None
        if pending is not None:
            pending.wait()

    def _expect(self, bound: BoundStep, call: str, name: str, x, shape: tuple,
                dtype=None) -> None:
        """``x`` must be a tensor of ``shape`` on this executor's device, floating point (or
        of ``dtype``): a wrong row or head count would otherwise run and give a silently wrong
        answer (a few comparisons; no sync)."""
        if (isinstance(x, torch.Tensor) and x.shape == shape and x.device == self._arg_device
                and (x.dtype == dtype if dtype is not None else x.dtype.is_floating_point)):
            return  # the common case: about 0.5 us
        got = (f"{tuple(x.shape)} {str(x.dtype).replace('torch.', '')} on {x.device}"
               if isinstance(x, torch.Tensor) else type(x).__name__)
        want = str(dtype).replace("torch.", "") if dtype is not None else "floating point"
        raise TensorArgError(f"step {bound.plan.step_id}: {call}: {name} is {got}; expected "
                             f"{shape} {want} on {self.device}")

    def _expect_cache(self, bound: BoundStep, call: str, cache, indexer: bool = True) -> None:
        """The layer's caches: uint8, kv a row of this config's token bytes per slot, index_k
        a block-planar row per block of as many slots (not read on a shared indexer layer:
        ``indexer`` False)."""
        cfg = self.config
        if not isinstance(cache, LayerCache):
            raise TensorArgError(f"step {bound.plan.step_id}: {call}: cache is "
                                 f"{type(cache).__name__}; expected a LayerCache")
        for name in ("kv", "index_k") if indexer else ("kv",):  # one flat buffer of slots
            t = getattr(cache, name)
            if isinstance(t, torch.Tensor) and t.is_inference() \
                    and not torch.is_inference_mode_enabled():  # its writes would raise deep
                raise TensorArgError(f"step {bound.plan.step_id}: {call}: cache.{name} was made "
                                     "under torch.inference_mode() and is used outside it; "
                                     "expected a normal tensor (make the caches outside "
                                     "inference_mode, as LayerCache.empty does, or run the "
                                     "step inside it)")
            if isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_contiguous():
                raise TensorArgError(f"step {bound.plan.step_id}: {call}: cache.{name} has "
                                     f"strides {tuple(t.stride())}; expected a contiguous "
                                     f"tensor (strides ({t.shape[1]}, 1))")
        if isinstance(cache.kv, torch.Tensor) and cache.kv.dim() == 3:  # a paged [blocks, B, row]
            raise TensorArgError(
                f"step {bound.plan.step_id}: {call}: cache.kv is {tuple(cache.kv.shape)}; "
                f"expected one row a slot, [num_blocks * {cfg.block_size}, "
                f"{cfg.kv_bytes_per_token}] (a paged cache passes kv.view(-1, "
                f"{cfg.kv_bytes_per_token}))")
        rows = cache.kv.shape[0] if isinstance(cache.kv, torch.Tensor) else -1
        self._expect(bound, call, f"cache.kv ({cfg.kv_cache_dtype})", cache.kv,
                     (rows, cfg.kv_bytes_per_token), torch.uint8)
        if indexer:
            self._expect(bound, call, "cache.index_k (block-planar)", cache.index_k,
                         (rows // cfg.block_size, cfg.block_size * cfg.index_k_bytes_per_token),
                         torch.uint8)
        if rows < bound.cache_rows:  # an out-of-range index would fault the device (CUDA)
            bs = cfg.block_size
            raise TensorArgError(f"step {bound.plan.step_id}: {call}: the caches hold {rows:,} "
                                 f"rows ({rows // bs:,} blocks); expected at least "
                                 f"{bound.cache_rows:,}: the step's block tables reach block "
                                 f"{bound.cache_rows // bs - 1:,} (pass num_blocks to bind to "
                                 "check them there)")

    def _usable(self, bound: BoundStep, call: str) -> None:
        """A bound step is used between its bind and its finish, and before ``arena_depth``
        later binds have reused its arena (its tables would silently be another step's), by
        the executor that bound it (another one's arena and config would read it wrongly)."""
        if not isinstance(bound, BoundStep):
            raise UsageError(f"{call}: got {type(bound).__name__}; expected the BoundStep that "
                             "bind() returned")
        if bound.owner is not None and bound.owner is not self:
            raise UsageError(f"step {bound.plan.step_id}: {call} on a step bound by another "
                             "StepExecutor; expected the executor whose bind() returned it")
        if bound.finished:
            raise UsageError(f"step {bound.plan.step_id}: {call} after finish(); expected a "
                             "new bind for a new step")
        if bound.lease is not None and not self.arena.holds(bound.lease):
            depth = self.arena.depth
            raise UsageError(f"step {bound.plan.step_id}: {call} on a bound step whose tables "
                             f"a later bind has overwritten (arena_depth {depth}); expected at "
                             f"most {depth} bound steps in flight: finish a step before "
                             f"binding {depth} more")

    @staticmethod
    def _watch_of(bound) -> StepWatch:
        """The step's watch, for :meth:`_announcing`; a value that is not a BoundStep is refused
        (UsageError) before anything runs."""
        if not isinstance(bound, BoundStep):
            raise UsageError(f"got {type(bound).__name__} where a step was expected; expected "
                             "the BoundStep that bind() returned")
        return bound.channel.watch

    def _announce(self, watch: StepWatch, exc: BaseException) -> None:
        """Tell the peers this rank failed (unless the failure came from them)."""
        if self.faults is not None and not isinstance(exc, (PlanMismatchError, RankLostError)):
            self.faults.announce(watch.seq, exc)

    @contextlib.contextmanager
    def _announcing(self, watch: StepWatch):
        try:
            yield
        except Exception as exc:
            self._announce(watch, exc)
            raise

    def _check_bind(self, plan: StepPlan, block_tables, num_blocks: int | None
                    ) -> tuple[np.ndarray, int]:
        if plan.config is not self.config and plan.config != self.config:  # field by field
            raise ConfigError(f"step {plan.step_id}: the plan was compiled for another config "
                              f"than this executor's ({plan.config!r} vs {self.config!r})")
        if plan.padded_num_tokens > self.max_tokens:
            real = max(plan.num_tokens, default=0)
            why = (f" (its largest rank has {real:,}, padded to a CUDA-graph size of the "
                   "config)" if real < plan.padded_num_tokens else "")
            raise CapacityError(f"step {plan.step_id} needs {plan.padded_num_tokens:,} tokens "
                                f"per rank{why}, capacity {self.max_tokens:,} (the "
                                "executor's max_tokens)")
        return check_block_tables(plan, self.dcp_rank, block_tables, num_blocks,
                                  self._aliases)

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
        # W == 1 with prefill_keys="gather": the prefill tokens [nd, hi) score a contiguous
        # copy of their requests' keys with the prefill indexer (a key tile per query block)
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
        """W == 1 prefill tokens in this step, and prefill_keys="gather"."""
        m = bound.meta
        return (self.prefill_keys == "gather" and self.config.dcp_size == 1
                and m.num_tokens > m.num_decode_tokens)

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

    # ------------------------------------------------------------------ end of step
    def restore_sampled(self, bound: BoundStep, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's rows ``[T, hidden_size]`` (the config's activation dtype) -> the rows to
        sample ``[n_sampled, hidden_size]``: each sampled request's last scheduled token, in
        ascending request index (the step's ``is_sampled``), the same on every rank. One
        all-gather of ``[M, hidden]`` over PCP (M: the most any rank supplies), none at
        P == 1 or with nothing sampled. Only for a step that names its sampled rows."""
        self._check_restore(bound, hidden, sampled=True)
        with self._announcing(self._watch_of(bound)):
            self._usable(bound, "restore_sampled")
            self._expect(bound, "restore_sampled", "hidden", hidden,
                         (bound.plan.padded_num_tokens, self.config.hidden_size), self._act)
            rows, n = bound.sampled_counts
            index = bound.views["sampled"]
            if self.config.pcp_size > 1 and n:
                full = hidden.new_empty((self.config.pcp_size * rows, hidden.shape[1]))
                coll.restore_sampled(bound.channel, full, hidden.index_select(0, index[:rows]))
                return full.index_select(0, index[rows: rows + n])
            bound.channel.await_plan_verified()
            if not n:
                return hidden.new_empty((0, hidden.shape[1]))
            return hidden.index_select(0, index[rows: rows + n])

    def _check_restore(self, bound, hidden, sampled: bool) -> None:
        """The restore that the step's plan lists (full, or the sampled rows), never inside a
        CUDA-graph capture (its row count changes per step)."""
        name = "restore_sampled" if sampled else "restore"
        if isinstance(hidden, torch.Tensor) and hidden.is_cuda and \
                torch.cuda.is_current_stream_capturing():
            raise UsageError(f"step {bound.plan.step_id}: {name} inside a CUDA-graph capture; "
                             "expected after StepGraphs.run (its row count changes per step)")
        if isinstance(bound, BoundStep) and (bound.plan.is_sampled is not None) != sampled:
            want = "restore_sampled" if not sampled else "restore"
            why = ("names its sampled rows (StepInput.is_sampled)" if not sampled
                   else "names no sampled rows")
            raise UsageError(f"step {bound.plan.step_id}: {name} on a step that {why}; "
                             f"expected {want}")

    def restore(self, bound: BoundStep, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's rows ``[T, hidden_size]`` (the config's activation dtype) -> every query
        token in global order ``[sum q, hidden_size]`` (all-gathered over PCP when P > 1). A
        step that names its sampled rows restores those only: :meth:`restore_sampled`."""
        self._check_restore(bound, hidden, sampled=False)
        with self._announcing(self._watch_of(bound)):
            self._usable(bound, "restore")
            self._expect(bound, "restore", "hidden", hidden,
                         (bound.plan.padded_num_tokens, self.config.hidden_size), self._act)
            if bound.meta.restore:
                full = hidden.new_empty((self.config.pcp_size * hidden.shape[0],
                                         hidden.shape[1]))
                coll.restore(bound.channel, full, hidden.contiguous())
            else:
                bound.channel.await_plan_verified()
                full = hidden
            # a graph key's restore index is padded to P * T: its first sum q rows count
            index = bound.tables.restore_index[: bound.meta.num_global_tokens]
            return full.index_select(0, index)

    def finish(self, bound: BoundStep) -> coll.Ledger:
        """Close the step: the digest check is awaited even if no collective ran; in debug mode
        the ledger must equal the plan's list (CollectiveLedgerError otherwise)."""
        watch = self._watch_of(bound)
        if self.watchdog is not None:
            self.watchdog.watch(None)
        with self._announcing(watch):
            self._usable(bound, "finish")
            bound.channel.await_plan_verified()
            if self.debug:
                coll.check_ledger(bound.plan, bound.ledger, self.rank_id)
        bound.finished = True
        return bound.ledger

    @property
    def rank_id(self) -> int:
        return max(self.pcp_rank, self.dcp_rank)

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

