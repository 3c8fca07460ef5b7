"""The one list of process groups and collectives, shared by planner and runtime.

The planner writes these names into ``StepPlan.collectives`` (as plain strings, so the plan's
bytes do not depend on Python's enum machinery); the runtime issues each collective through the
function of :mod:`cpplan.runtime.collectives` named after its kind and checks the ledger against
the plan. docs/design.md §3.8 gives the condition, shape and dtype of each.
"""

from __future__ import annotations

import dataclasses
import enum


class Group(str, enum.Enum):
    """A data process group. The world has max(P, W) ranks; with P == W both are the same
    ranks (docs/design.md §2)."""

    PCP = "pcp"
    DCP = "dcp"


class Op(str, enum.Enum):
    ALL_GATHER = "all_gather"
    ALL_REDUCE = "all_reduce"


@dataclasses.dataclass(frozen=True)
class CollectiveKind:
    """One kind of collective: its name, op and group; ``per_chunk`` kinds are issued once per
    gather chunk (their plan name carries the chunk, ``kv_gather[2]``); ``per_layer`` kinds once
    per layer, the others once per step; ``indexer`` kinds only on the layers that run their
    own indexer (ParallelConfig.full_indexer_layers: a shared layer reuses an earlier top-k)."""

    name: str
    op: Op
    group: Group
    per_layer: bool = True
    per_chunk: bool = False
    indexer: bool = False

    def label(self, chunk: int | None = None) -> str:
        """The name as it appears in a plan and a ledger."""
        if self.per_chunk:
            if chunk is None:
                raise ValueError(f"collective {self.name!r} is per gather chunk: got no chunk")
            return f"{self.name}[{chunk}]"
        return self.name


KV_INSERT = CollectiveKind("kv_insert", Op.ALL_GATHER, Group.PCP)
INDEXER_K_INSERT = CollectiveKind("indexer_k_insert", Op.ALL_GATHER, Group.PCP, indexer=True)
INDEXER_K_GATHER = CollectiveKind("indexer_k_gather", Op.ALL_GATHER, Group.DCP, per_chunk=True,
                                  indexer=True)
KV_GATHER = CollectiveKind("kv_gather", Op.ALL_GATHER, Group.DCP, per_chunk=True)
TOPK_CANDIDATES = CollectiveKind("topk_candidates", Op.ALL_GATHER, Group.DCP, indexer=True)
DECODE_LSE = CollectiveKind("decode_lse", Op.ALL_GATHER, Group.DCP)
DECODE_OUT = CollectiveKind("decode_out", Op.ALL_REDUCE, Group.DCP)
RESTORE = CollectiveKind("restore", Op.ALL_GATHER, Group.PCP, per_layer=False)
# the sampled rows only (a step that names them): [M, hidden], M the most any rank holds
RESTORE_SAMPLED = CollectiveKind("restore_sampled", Op.ALL_GATHER, Group.PCP, per_layer=False)

# Issue order within a step: per layer the inserts, then per chunk its two gathers, then the
# decode merge; after the last layer, restore.
COLLECTIVE_KINDS = (KV_INSERT, INDEXER_K_INSERT, INDEXER_K_GATHER, KV_GATHER, TOPK_CANDIDATES,
                    DECODE_LSE, DECODE_OUT, RESTORE, RESTORE_SAMPLED)

TOPK_CANDIDATE_DTYPE = "float32+int32"  # one packed entry: (score, global token id)
# (ids fit int32: every token count of a plan does, config.MAX_SUPPORTED_TOKENS; plans recorded
# before 2026-12-01 list "float32+int64", 12 B an entry, and still decode)


def kind_of(label: str) -> CollectiveKind:
    """The kind of a plan/ledger name (``kv_gather[3]`` -> KV_GATHER); ValueError if unknown."""
    base = label.split("[", 1)[0]
    for kind in COLLECTIVE_KINDS:
        if kind.name == base:
            return kind
    raise ValueError(f"collective {label!r}: expected one of {[k.name for k in COLLECTIVE_KINDS]}")


def group_of(name: str | Group) -> Group:
    """``"pcp"``/``"dcp"`` (or a Group) -> Group; ValueError for anything else."""
    try:
        return Group(name)
    except ValueError:
        raise ValueError(f"group {name!r}: expected 'pcp' or 'dcp'") from None
