"""CUDA-graph replay of a bound step's per-layer work (docs/design.md §5.6).

A graph-replayable plan (``StepPlan.graph_replayable``: decode-only, padded to a CUDA-graph
size) binds to static shapes: every padded token is a decode, the decode pass reads
``blocks * block_size`` keys and block tables of ``blocks`` columns, and its table segments fill a
fixed layout (``StepMeta.graph_key`` = (T, blocks); runtime/segments.py). One captured graph
therefore serves every step of its key: only the arena's words and the engine's inputs change.

:class:`StepGraphs` wraps the engine's per-step body, ``body(bound, *inputs) -> outputs``, which
calls the executor's ``insert`` and ``attend`` for every layer (and any engine work between
them). ``run(bound, *inputs)``:

1. not graph-replayable (or not on CUDA): ``body(bound, *inputs)``, eagerly;
2. first step of its key: the body runs eagerly (the kernels compile, NCCL communicators and
   lazy state are set up), then a graph of the same body is captured over static copies of the
   arena words and inputs; the step's result is the eager one (torch synchronises the device
   around a capture: once per key, never on a replay);
3. later steps: the step's arena words and inputs are copied into the static buffers and the
   graph is replayed; the result is the graph's static outputs, valid until the next ``run`` of
   this ``StepGraphs`` (copy what must outlive it).

A graph holds the addresses of everything its body touched at capture: the caches and any other
tensor the body closes over must stay the same objects for the graphs' lifetime (reallocate
them, and make a new ``StepGraphs``). Inputs are matched by shape and dtype; a new shape is a
new capture. All graphs share one memory pool (keys are T sizes times powers of two of key
blocks: a private pool each would hold tens of MB per key): a graph's temporaries may reuse what
another graph's outputs occupy, so outputs, and the tables ``restore`` reads, are only valid
until the next replay of any graph. Each replay rewrites its own tables first.

The guarantees of an eager step hold: the digest check completes before the graph (and so
before the first collective) runs; the collectives the capture recorded are appended to the
step's ledger, so ``finish`` still compares the ledger with this step's plan; ``restore`` runs
after ``run`` and before the next one (it reads the graph's static restore index). Every
rank captures and replays the same keys in the same order, since keys depend on the plan only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from cpplan.runtime import collectives as coll
from cpplan.runtime.executor import BoundStep, StepExecutor
from cpplan.runtime.tables import TABLE_NAMES, StepTables, iota
from cpplan.schemas.errors import UsageError


@dataclasses.dataclass
class CapturedStep:
    """One captured graph: its static arena words, inputs, outputs and tables, and the
    collectives its capture recorded (the ledger entries every replay appends)."""

    graph: torch.cuda.CUDAGraph
    words: torch.Tensor
    inputs: tuple[torch.Tensor, ...]
    outputs: object
    tables: StepTables
    ledger: list
    replays: int = 0


class StepGraphs:
    """Captured graphs of one executor's decode steps, keyed by ``(graph_key, input shapes
    and dtypes)``. ``enabled=False`` runs every step eagerly (the same body, for A/B runs)."""

    def __init__(self, executor, body: Callable, *, enabled: bool = True) -> None:
        if not isinstance(executor, StepExecutor) or not callable(body):
            raise UsageError(f"StepGraphs: got ({type(executor).__name__}, "
                             f"{type(body).__name__}); expected (a StepExecutor, a callable "
                             "body(bound, *inputs))")
        self.ex, self.body = executor, body
        self.enabled = enabled and executor.device.type == "cuda"
        self.captured: dict = {}
        self._pool = torch.cuda.graph_pool_handle() if self.enabled else None

    def run(self, bound, *inputs: torch.Tensor):
        """The step's body outputs: by graph replay when the step has a graph key (see the module
        docstring), otherwise eagerly."""
        with self.ex._announcing(self.ex._watch_of(bound)):  # the peers are told, as for insert
            self.ex._usable(bound, "StepGraphs.run")
        key = bound.meta.graph_key
        if key is None or not self.enabled:
            return self.body(bound, *inputs)
        sig = (key,) + tuple((tuple(x.shape), x.dtype) for x in inputs)
        bound.channel.await_plan_verified()  # before any collective of this step, as eagerly
        cap = self.captured.get(sig)
        if cap is None:
            out = self.body(bound, *inputs)
            self.captured[sig] = self._capture(bound, inputs)
            return out
        cap.words.copy_(_words(_graph_views(bound.views))[0])
        for static, x in zip(cap.inputs, inputs):
            if static is not x:
                static.copy_(x)
        cap.graph.replay()
        cap.replays += 1
        bound.channel.ledger.entries.extend(cap.ledger)
        bound.use_tables(cap.tables)
        return cap.outputs

    def _capture(self, bound, inputs) -> CapturedStep:
        graph_views = _graph_views(bound.views)
        span, offsets = _words(graph_views)
        words = span.clone()
        views = {name: words[off: off + graph_views[name].numel()]
                 for name, off in offsets.items()}
        static_inputs = tuple(x.clone() for x in inputs)
        # the shared arange the expansion reads must not grow inside a capture: memory taken from
        # the shared pool there could later be a temporary of another graph
        iota(bound.layout.total(bound.meta), self.ex.device)
        channel = coll.StepChannel(self.ex.comm, None, bound.channel.watch)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            tables = StepTables.expand(views, bound.meta, bound.layout)
            step = BoundStep(bound.plan, bound.meta, bound.layout, views, channel, _tables=tables,
                             pcp_rank=bound.pcp_rank)
            outputs = self.body(step, *static_inputs)
        return CapturedStep(graph, words, static_inputs, outputs, tables,
                            list(channel.ledger.entries))


def _graph_views(views: dict) -> dict:
    """The views a captured graph reads: the step's tables (static in size for a graph key),
    not restore_sampled's indices, which follow the step's sampled requests and are read
    after the graph, from the step's own arena."""
    return {name: views[name] for name in TABLE_NAMES}


def _words(views: dict) -> tuple[torch.Tensor, dict]:
    """The contiguous span of arena words holding ``views`` (one pack), and each view's offset
    in it."""
    first = next(iter(views.values()))
    start = min(v.storage_offset() for v in views.values())
    end = max(v.storage_offset() + v.numel() for v in views.values())
    span = first.as_strided((end - start,), (1,), start)
    return span, {name: v.storage_offset() - start for name, v in views.items()}
