"""ParallelConfig: the static facts every rank shares for the life of a serving process.

Validated at construction (also when decoded from a file): an invalid config never exists.
Types are checked too (msgspec checks them only when decoding): a bool, float or str where an
integer belongs, or a dtype name outside the enums, is a ConfigError, not a later crash.
"""

from __future__ import annotations

import operator
from typing import Literal

import msgspec
import numpy as np

from cpplan.schemas.errors import ConfigError
from cpplan.schemas.sharding import shard_rows

KV_BYTES_PER_TOKEN = {"fp8_ds_mla": 656, "bf16": 1152}
INDEXER_K_BYTES_PER_TOKEN = 132  # 128 fp8 values + one fp32 scale
MAX_SUPPORTED_TOKENS = 2**31 - 1  # every token count in a plan fits int32

MAX_PARALLEL_SIZE = 1024  # PCP / DCP ranks; reports draw and list one lane per rank

KvCacheDtype = Literal["fp8_ds_mla", "bf16"]
ActivationDtype = Literal["bfloat16", "float16", "float32"]
ACTIVATION_DTYPES = ("bfloat16", "float16", "float32")
_POSITIVE_FIELDS = (
    "pcp_size", "dcp_size", "interleave_size", "block_size", "num_heads", "num_layers",
    "qk_head_dim", "v_head_dim", "topk", "index_num_heads", "index_head_dim", "hidden_size",
    "max_model_len",
)
_POSITIVE_VALUES = operator.attrgetter(*_POSITIVE_FIELDS)
_JUST_INT = {int}


class ParallelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Topology, model dimensions and buffer budgets, fixed at start-up.

    ``gather_workspace_tokens`` is the number of gathered KV rows (``dcp_size * PT``) one gather
    chunk may use; 0 asks for the minimum, ``dcp_size * shard_rows(max_model_len)``, which is
    what the constructed config then holds.
    """

    pcp_size: int = 1
    dcp_size: int = 1
    interleave_size: int = 1
    block_size: int = 64
    kv_cache_dtype: KvCacheDtype = "fp8_ds_mla"
    num_heads: int = 128
    num_layers: int = 61
    qk_head_dim: int = 576
    v_head_dim: int = 512
    topk: int = 2048
    index_num_heads: int = 64
    index_head_dim: int = 128
    hidden_size: int = 7168
    activation_dtype: ActivationDtype = "bfloat16"
    max_model_len: int = 131072
    cudagraph_token_sizes: tuple[int, ...] = ()
    gather_workspace_tokens: int = 0
    # per layer, the layer whose indexer top-k it attends with: itself (a full indexer layer)
    # or an earlier full layer (a shared layer, GLM-5's "S": no indexer, no index keys); ()
    # means every layer is full (DeepSeek-V3.2). indexer_sources_from_types builds it.
    indexer_sources: tuple[int, ...] = ()
    # schema 3: vLLM's decode ownership (its ``pcp_shard_decode_requests``): each decode runs on
    # one PCP rank, ``ordinal % pcp_size`` over the decodes in request order (MODE_OWNED,
    # docs/design.md §3.1). Only with pcp_size > 1 and dcp_size == 1, where every rank holds the
    # whole KV. Off is stored as UNSET, so a config without it has the bytes and digests it had
    # before the field existed; read it as a bool (UNSET is falsy).
    shard_decode_requests: bool | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self) -> None:
        sizes = _POSITIVE_VALUES(self)
        # fast path (every decoded plan carries a config): all exact ints within range; any
        # other value goes through the per-field checks, which coerce or name the field
        if not (set(map(type, sizes)) == _JUST_INT and min(sizes) >= 1
                and max(sizes) <= MAX_SUPPORTED_TOKENS):
            for name in _POSITIVE_FIELDS:
                self._check_int(name, 1)
        self._check_int("gather_workspace_tokens", 0)
        for name in ("pcp_size", "dcp_size"):
            if getattr(self, name) > MAX_PARALLEL_SIZE:
                raise ConfigError(f"{name} must be <= {MAX_PARALLEL_SIZE}: got "
                                  f"{getattr(self, name)}")
        for name, allowed in (("kv_cache_dtype", tuple(KV_BYTES_PER_TOKEN)),
                              ("activation_dtype", ACTIVATION_DTYPES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}: got "
                                  f"{getattr(self, name)!r}")
        self._check_graph_sizes()
        self._check_indexer_sources()
        p, w = self.pcp_size, self.dcp_size
        self._check_shard_decode_requests(p, w)
        if not (w == 1 or p == 1 or w == p):
            raise ConfigError(
                f"unsupported topology pcp_size={p} dcp_size={w}: expected dcp_size == 1, "
                f"pcp_size == 1 or dcp_size == pcp_size"
            )
        if self.block_size % self.interleave_size != 0:
            raise ConfigError(
                f"block_size % interleave_size must be 0: got block_size={self.block_size}, "
                f"interleave_size={self.interleave_size}"
            )
        if self.qk_head_dim < self.v_head_dim:
            raise ConfigError(
                f"qk_head_dim must be >= v_head_dim: got {self.qk_head_dim} < {self.v_head_dim}"
            )
        minimum = self.min_gather_workspace_tokens
        if self.gather_workspace_tokens == 0:
            msgspec.structs.force_setattr(self, "gather_workspace_tokens", minimum)
        elif self.gather_workspace_tokens < minimum:
            raise ConfigError(
                f"gather_workspace_tokens must be >= dcp_size * shard_rows(max_model_len) = "
                f"{minimum}: got {self.gather_workspace_tokens}"
            )
        if self.gather_workspace_tokens > MAX_SUPPORTED_TOKENS:
            raise ConfigError(
                f"gather_workspace_tokens (dcp_size * shard_rows(max_model_len) when 0) must be "
                f"<= {MAX_SUPPORTED_TOKENS}: got {self.gather_workspace_tokens}"
            )

    def _check_int(self, name: str, low: int) -> None:
        """An int (a numpy integer is taken as its value; a bool, float or str is refused) in
        [low, MAX_SUPPORTED_TOKENS]: every size and count of a plan fits int32."""
        value = getattr(self, name)
        if isinstance(value, np.integer):
            value = int(value)
            msgspec.structs.force_setattr(self, name, value)
        if type(value) is not int:
            raise ConfigError(f"{name} must be an integer: got {type(value).__name__} "
                              f"{value!r}")
        if value < low:
            rule = "positive" if low == 1 else f">= {low}"
            raise ConfigError(f"{name} must be {rule}: got {value}")
        if value > MAX_SUPPORTED_TOKENS:
            raise ConfigError(f"{name} must be <= {MAX_SUPPORTED_TOKENS}: got {value}")

    def _check_graph_sizes(self) -> None:
        sizes = self.cudagraph_token_sizes
        if type(sizes) is tuple and (not sizes or (
                set(map(type, sizes)) == _JUST_INT and sizes[0] >= 1
                and sizes[-1] <= MAX_SUPPORTED_TOKENS
                and all(a < b for a, b in zip(sizes, sizes[1:])))):
            return  # already a strictly increasing tuple of ints in range
        if isinstance(sizes, (list, np.ndarray)):
            sizes = tuple(sizes)
        if not isinstance(sizes, tuple):
            raise ConfigError(f"cudagraph_token_sizes must be a tuple of integers: got "
                              f"{type(sizes).__name__}")
        sizes = tuple(int(s) if isinstance(s, np.integer) else s for s in sizes)
        if any(type(s) is not int for s in sizes):
            raise ConfigError(f"cudagraph_token_sizes must hold integers only: got "
                              f"{[s for s in sizes]!r}")
        if any(not 1 <= s <= MAX_SUPPORTED_TOKENS for s in sizes) \
                or list(sizes) != sorted(set(sizes)):
            raise ConfigError(
                f"cudagraph_token_sizes must be in [1, {MAX_SUPPORTED_TOKENS}], strictly "
                f"increasing: got {list(sizes)}")
        msgspec.structs.force_setattr(self, "cudagraph_token_sizes", sizes)

    def _check_indexer_sources(self) -> None:
        sources = self.indexer_sources
        if isinstance(sources, (list, np.ndarray)):
            sources = tuple(int(s) if isinstance(s, np.integer) else s for s in sources)
            msgspec.structs.force_setattr(self, "indexer_sources", sources)
        if not isinstance(sources, tuple) or any(type(s) is not int for s in sources):
            raise ConfigError(f"indexer_sources must be a tuple of layer indices: got "
                              f"{sources!r}")
        if not sources:
            return
        if len(sources) != self.num_layers:
            raise ConfigError(f"indexer_sources must name one source per layer: got "
                              f"{len(sources)} for num_layers {self.num_layers}")
        for layer, src in enumerate(sources):
            if src != layer and not (0 <= src < layer and sources[src] == src):
                raise ConfigError(
                    f"indexer_sources[{layer}]: got {src}; expected {layer} (a full indexer "
                    f"layer) or an earlier full layer, one of "
                    f"{[k for k in range(layer) if sources[k] == k]}")

    def _check_shard_decode_requests(self, p: int, w: int) -> None:
        shard = self.shard_decode_requests
        if shard is msgspec.UNSET:
            return
        if isinstance(shard, np.bool_):
            shard = bool(shard)
        if type(shard) is not bool:
            raise ConfigError(f"shard_decode_requests must be a bool: got "
                              f"{type(shard).__name__} {shard!r}")
        if not shard:  # off is UNSET: the bytes of a config that never named the field
            msgspec.structs.force_setattr(self, "shard_decode_requests", msgspec.UNSET)
            return
        msgspec.structs.force_setattr(self, "shard_decode_requests", True)
        if p == 1 or w != 1:
            raise ConfigError(f"shard_decode_requests needs pcp_size > 1 and dcp_size == 1 (a "
                              f"DCP-sharded KV needs every decode on every DCP rank): got "
                              f"pcp_size={p} dcp_size={w}")

    def indexer_source(self, layer: int) -> int:
        """The layer whose indexer top-k ``layer`` attends with (itself when full)."""
        return self.indexer_sources[layer] if self.indexer_sources else layer

    @property
    def full_indexer_layers(self) -> tuple[int, ...]:
        """The layers that run their own indexer (every layer when indexer_sources is ())."""
        if not self.indexer_sources:
            return tuple(range(self.num_layers))
        return tuple(k for k, s in enumerate(self.indexer_sources) if s == k)

    @property
    def min_gather_workspace_tokens(self) -> int:
        return self.dcp_size * shard_rows(self.max_model_len, self.dcp_size, self.interleave_size)

    @property
    def world_size(self) -> int:
        return max(self.pcp_size, self.dcp_size)

    @property
    def num_prefill_chunks(self) -> int:
        """S = 2P: chunks a split prefill is cut into."""
        return 2 * self.pcp_size

    @property
    def kv_bytes_per_token(self) -> int:
        return KV_BYTES_PER_TOKEN[self.kv_cache_dtype]

    @property
    def index_k_bytes_per_token(self) -> int:
        return INDEXER_K_BYTES_PER_TOKEN

    def shard_rows(self, extent: int) -> int:
        return shard_rows(extent, self.dcp_size, self.interleave_size)


INDEXER_TYPES = ("full", "shared")


def indexer_sources_from_types(types) -> tuple[int, ...]:
    """``ParallelConfig.indexer_sources`` from per-layer indexer types, GLM-5's
    ``config.indexer_types`` ("full" / "shared", or "F" / "S"): a shared layer reuses the top-k
    of the nearest full layer before it. ConfigError for another type or a first layer that
    is shared (it has no full layer to reuse)."""
    sources, last_full = [], None
    for layer, kind in enumerate(types):
        kind = {"F": "full", "S": "shared"}.get(kind, kind)
        if kind not in INDEXER_TYPES:
            raise ConfigError(f"indexer type of layer {layer}: got {kind!r}; expected 'full' "
                              "or 'shared' (or 'F' / 'S')")
        if kind == "full":
            last_full = layer
        elif last_full is None:
            raise ConfigError(f"indexer type of layer {layer}: got 'shared' before any full "
                              "layer; expected the first layer to be 'full'")
        sources.append(last_full)
    return tuple(sources)
