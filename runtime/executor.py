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
import math

import numpy as np
import torch

from cpplan.runtime import collectives as coll
from cpplan.runtime.arena import ArenaRing, arena_words
from cpplan.runtime.bound import DUMMY_SLOT, BoundStep, LayerCache
from cpplan.runtime.exchange import ROWS
from cpplan.runtime.executor_args import MAX_ARENA_WORDS, check_device, check_executor_args, check_sm_scale
from cpplan.runtime.faults import FaultBoard, StepWatch, Watchdog, one_line
from cpplan.runtime.kernels import get_kernels
from cpplan.runtime.kernels import reference as kref
from cpplan.runtime.passes import LayerPasses
from cpplan.runtime.segments import AliasCheck, build_tables, check_block_tables, compile_host_kernels
from cpplan.runtime.tables import TABLE_NAMES
from cpplan.runtime.tokens import pack_sampled
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

__all__ = ["DUMMY_SLOT", "BoundStep", "LayerCache", "StepExecutor"]  # the runtime's step API


class StepExecutor(LayerPasses):
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
                 data_timeout_s: float = 0.0,
                 dcp_compact: bool | int | str = "auto") -> None:
        self.sm_scale = check_sm_scale(sm_scale)
        check_executor_args(config, pcp_rank=pcp_rank, dcp_rank=dcp_rank,
                             max_tokens=max_tokens, max_requests=max_requests,
                             max_blocks_per_request=max_blocks_per_request,
                             arena_depth=arena_depth)
        if isinstance(data_timeout_s, bool) or not isinstance(data_timeout_s, (int, float)) \
                or not 0 <= data_timeout_s < math.inf:  # False for NaN
            raise ConfigError(f"StepExecutor data_timeout_s: got {data_timeout_s!r}"[:160]
                              + "; expected a finite number of seconds >= 0")
        # dcp_compact: W > 1 decode attention over the rank's slots packed into
        # compact_width(topk, W) columns, plus an overflow pass for rows holding more, instead
        # of topk columns mostly -1 (an int: that width, e.g. to force the overflow pass in
        # tests). "auto": on where interleave_size == 1, where a row's keys alternate over the
        # ranks token by token and its top-k splits about evenly; larger interleaves put whole
        # runs of a row's keys on one rank, and the overflow pass is slow (bench/RESULTS.md,
        # "compacted DCP attention by default"; docs/design.md §3.6).
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
              **kwargs) -> StepExecutor:
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
                    **kwargs) -> StepExecutor:
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

    # ------------------------------------------------------------------ end of step
    def restore_sampled(self, bound: BoundStep, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's rows ``[T, hidden_size]`` (the config's activation dtype) -> the rows to
        sample ``[n_sampled, hidden_size]``: each sampled request's last scheduled token, in
        ascending request index (the step's ``is_sampled``), the same on every rank. One
        all-gather of ``[M, hidden]`` over PCP (M: the most any rank supplies), none at
        P == 1 or with nothing sampled. Only for a step that names its sampled rows."""
        with self._announcing(self._watch_of(bound)):  # the peers hear of a refusal too
            self._check_restore(bound, hidden, sampled=True)
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
        with self._announcing(self._watch_of(bound)):  # the peers hear of a refusal too
            self._check_restore(bound, hidden, sampled=False)
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
