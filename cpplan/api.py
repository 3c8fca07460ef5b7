"""cpplan's embedding API: what a serving engine calls, and all the mini serving loop uses.

Once per process::

    groups = Groups.build(config)              # or Groups.from_env / Groups.adopt(engine groups)
    executor = StepExecutor.from_groups(config, groups, sm_scale=model_scale,
                                          verify="every")   # the model's softmax scale
    # one device, no torch.distributed world: StepExecutor.local(config, sm_scale=...)
    caches = [LayerCache.empty(config, num_blocks, groups.device) for _ in range(layers)]

Per scheduler step (every rank, same global StepInput)::

    plan = compile(config, step)               # pure CPU, identical on every rank
    bound = executor.bind(plan, block_tables)  # tables -> arena, one H2D copy, digest check starts
    tokens = bound.tokens                      # TokenView: request / position / padding per row
    for layer, cache in enumerate(caches):     # the engine's own tensors, this rank's tokens
        executor.insert(bound, cache, kv_new, index_k_new)   # index_k_new None: shared layer
        out = executor.attend(bound, cache, q, index_q, index_w)
    rows = executor.restore_sampled(bound, hidden)  # a step with is_sampled: [n_sampled, hidden]
    # rows = executor.restore(bound, hidden)   # a step without: [sum q, hidden], global order
    executor.finish(bound)                     # digest awaited; ledger == plan in debug mode
    record_plan(plan, "runs/a")                # optional: for cpplan inspect / replay

Before the first step, ``warmup(executor)`` (on every rank at once) runs a few synthetic steps on
scratch caches so that every kernel variant is compiled before serving.

Decode steps under CUDA graphs (docs/design.md §5.6): configure ``cudagraph_token_sizes``, wrap
the per-layer loop above in ``graphs = StepGraphs(executor, body)`` with ``body(bound, *inputs)``
calling ``insert`` / ``attend``, and call ``out = graphs.run(bound, *inputs)`` between ``bind`` and
``restore``: decode-only steps are then replayed from a graph captured at their key's first step.

A divergent rank raises PlanMismatchError on every rank before the first data collective; a
rank missing from the check raises RankLostError (named) within the control timeout.
"""

from __future__ import annotations

import os

from cpplan.planner.compile import compile  # noqa: A004 - the planner's public name
from cpplan.runtime.executor import BoundStep, LayerCache, StepExecutor
from cpplan.runtime.graphs import StepGraphs
from cpplan.runtime.groups import Groups
from cpplan.runtime.selection import Attended
from cpplan.runtime.tokens import TokenView
from cpplan.schemas.codec import encode_plan
from cpplan.schemas.config import ParallelConfig
from cpplan.schemas.errors import OutputError, UsageError
from cpplan.schemas.files import write_atomic
from cpplan.schemas.plan import StepPlan
from cpplan.schemas.step import StepInput
from cpplan.warmup import warmup


def record_plan(plan: StepPlan, directory: str) -> str:
    """Write ``step-<id>.msgpack`` (for ``cpplan inspect`` / ``replay``); returns the path.
    ``directory`` (a str path or os.PathLike of one) is created if missing; OutputError (got /
    expected) where it cannot be; UsageError where ``plan`` is not a StepPlan or
    ``directory`` is not a str path (bytes, None)."""
    if not isinstance(plan, StepPlan):
        raise UsageError(f"record_plan: got {type(plan).__name__}; expected a StepPlan")
    try:
        folder = os.fspath(directory)
    except TypeError:
        folder = None
    if not isinstance(folder, str):  # bytes mixed with the str file name: a raw TypeError
        raise UsageError(f"record_plan directory: got {type(directory).__name__} "
                         f"{directory!r}"[:160] + "; expected a str path (or an os.PathLike "
                         "of one)")
    directory = folder
    try:
        os.makedirs(directory, exist_ok=True)
    except (OSError, TypeError, ValueError) as exc:
        raise OutputError(f"record_plan: cannot create the folder {directory!r}: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    path = os.path.join(directory, f"step-{plan.step_id}.msgpack")
    write_atomic(path, encode_plan(plan))
    return path


__all__ = ["Attended", "BoundStep", "Groups", "LayerCache", "ParallelConfig", "StepExecutor", "StepGraphs",
           "StepInput", "StepPlan", "TokenView", "compile", "record_plan", "warmup"]
