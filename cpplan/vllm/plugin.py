"""cpplan's vLLM plugin (entry point group ``vllm.general_plugins``): the recorder and the guard
around vLLM's ``PCPManager.partition_batch``, enabled by environment variables only.

vLLM calls :func:`register` in every process it starts (the engine and each worker). With
``CPPLAN_VLLM`` unset or empty it returns at once: nothing is imported (not numpy, not cpplan's
planner, not vLLM) and nothing is wrapped. Otherwise it checks the installed vLLM release
(``cpplan.vllm.version``) and wraps two functions of ``vllm.v1.worker.gpu.pcp_manager``:

- ``PCPManager.partition_batch``, the narrowest hook of vLLM 0.32's step: it takes the global
  ``InputBatch`` and returns the rank's local one; nothing of the step's PCP / DCP traffic has
  run when it returns. The wrapper runs vLLM's own method first, then cpplan's modes, then
  returns vLLM's result unchanged;
- ``maybe_build_pcp_manager``, only to remember the ``VllmConfig`` a manager was built from
  (the model's dimensions and limits for cpplan's config).

The variables (docs/vllm.md):

- ``CPPLAN_VLLM``: ``record``, ``guard`` or ``record,guard``;
- ``CPPLAN_VLLM_DIR``: the record folder (needed by ``record``), created if missing;
- ``CPPLAN_VLLM_EXCHANGE``: ``auto`` (default: a shared-memory board when the ranks of a group
  share a host, else gloo), ``shm`` or ``gloo``;
- ``CPPLAN_VLLM_GUARD_FIELDS``: ``all`` (default) or ``host`` (skip the fields vLLM keeps on
  the device, whose copy to the host waits for the GPU);
- ``CPPLAN_VLLM_TIMEOUT_S``: how long a rank waits for its peers' guard rows (default 60).

A bad value is a ``ConfigError`` from ``register``, one line, before vLLM builds anything.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref

ENV_MODES = "CPPLAN_VLLM"
ENV_DIR = "CPPLAN_VLLM_DIR"
ENV_EXCHANGE = "CPPLAN_VLLM_EXCHANGE"
ENV_FIELDS = "CPPLAN_VLLM_GUARD_FIELDS"
ENV_TIMEOUT = "CPPLAN_VLLM_TIMEOUT_S"
MODES = ("record", "guard")
MAX_TIMEOUT_S = 7 * 86400.0
LOGGER_NAME = "vllm.cpplan"  # under vLLM's logger: its handler and format


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the environment asked for."""

    modes: frozenset
    folder: str | None = None
    exchange: str = "auto"
    fields: str = "all"
    timeout_s: float = 60.0

    @property
    def record(self) -> bool:
        return "record" in self.modes

    @property
    def guard(self) -> bool:
        return "guard" in self.modes


def settings_from_env(env=None) -> Settings | None:
    """The plugin's settings from ``env`` (default ``os.environ``); None when ``CPPLAN_VLLM`` is
    unset or blank. ConfigError, one line, for an unknown mode or a bad value."""
    env = os.environ if env is None else env
    text = env.get(ENV_MODES, "").strip()
    if not text:
        return None
    from cpplan.schemas.errors import ConfigError
    from cpplan.vllm.guard import EXCHANGE_KINDS, FIELD_SETS

    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ConfigError(f"{ENV_MODES}={text!r}"[:120] + f": expected {', '.join(MODES)} or "
                          "record,guard")
    folder = env.get(ENV_DIR, "").strip() or None
    if "record" in modes and folder is None:
        raise ConfigError(f"{ENV_MODES}={text} records steps: set {ENV_DIR} to a folder")
    exchange = env.get(ENV_EXCHANGE, "auto").strip() or "auto"
    fields = env.get(ENV_FIELDS, "all").strip() or "all"
    for name, value, allowed in ((ENV_EXCHANGE, exchange, EXCHANGE_KINDS),
                                 (ENV_FIELDS, fields, FIELD_SETS)):
        if value not in allowed:
            raise ConfigError(f"{name}={value!r}"[:120] + f": expected one of {allowed}")
    raw = env.get(ENV_TIMEOUT, "").strip()
    timeout_s = 60.0
    if raw:
        try:
            timeout_s = float(raw)
        except ValueError:
            timeout_s = float("nan")
        if not 0 < timeout_s <= MAX_TIMEOUT_S:  # False for NaN
            raise ConfigError(f"{ENV_TIMEOUT}={raw!r}"[:120] + ": expected a number of seconds "
                              f"in (0, {MAX_TIMEOUT_S:.0f}]")
    return Settings(modes=frozenset(modes), folder=folder, exchange=exchange, fields=fields,
                    timeout_s=timeout_s)


def register() -> None:
    """vLLM's entry point: nothing unless ``CPPLAN_VLLM`` is set; then the version check, then
    :func:`install` (idempotent: vLLM may call this more than once in a process)."""
    settings = settings_from_env()
    if settings is None:
        return
    from cpplan.vllm.version import check_vllm_version

    check_vllm_version()
    install(settings)


# ---------------------------------------------------------------- the wrappers
_installed: dict = {}  # the hook and the originals while installed


def install(settings: Settings, *, groups=None, model_dims: dict | None = None,
            records_here=None):
    """Wrap vLLM's functions for ``settings``; returns the :class:`Hook`.

    For tests and embedders: ``groups`` (a list of gloo process groups, exchanged over in
    order) replaces vLLM's PCP and TP groups; ``model_dims`` (ParallelConfig fields) the
    dimensions read from the VllmConfig; ``records_here`` (a bool, or a function of the
    manager giving the folder to record into, or None) the choice of the recording rank."""
    from vllm.v1.worker.gpu import pcp_manager

    uninstall()
    hook = Hook(settings, groups=groups, model_dims=model_dims, records_here=records_here)
    original_partition = pcp_manager.PCPManager.partition_batch
    original_build = pcp_manager.maybe_build_pcp_manager

    def partition_batch(self, input_batch, batch_desc):
        local = original_partition(self, input_batch, batch_desc)
        hook.after_partition(self, input_batch, batch_desc, local)
        return local

    def maybe_build_pcp_manager(vllm_config, *args, **kwargs):
        manager = original_build(vllm_config, *args, **kwargs)
        if manager is not None:
            hook.vllm_configs[manager] = vllm_config
        return manager

    partition_batch.__wrapped__ = original_partition
    partition_batch.__doc__ = original_partition.__doc__
    maybe_build_pcp_manager.__wrapped__ = original_build
    pcp_manager.PCPManager.partition_batch = partition_batch
    pcp_manager.maybe_build_pcp_manager = maybe_build_pcp_manager
    _installed.update(hook=hook, partition=original_partition, build=original_build)
    return hook


def uninstall() -> None:
    """Put vLLM's functions back and close the hook's exchanges (a no-op when not installed)."""
    if not _installed:
        return
    from vllm.v1.worker.gpu import pcp_manager

    pcp_manager.PCPManager.partition_batch = _installed["partition"]
    pcp_manager.maybe_build_pcp_manager = _installed["build"]
    _installed.pop("hook").close()
    _installed.clear()


def installed_hook():
    """The hook in place (None when the plugin wrapped nothing)."""
    return _installed.get("hook")



# ---------------------------------------------------------------- per manager, per step
def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:400]


def _world_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def model_dims_from(vllm_config) -> dict:
    """ParallelConfig fields read from a VllmConfig: the limits that bound a step (max_model_len,
    block_size) and the model's dimensions (the plan's shapes, so its digest and what
    ``cpplan inspect`` shows); a field vLLM does not state is left to cpplan's default."""
    dims: dict = {}
    model, cache = getattr(vllm_config, "model_config", None), getattr(vllm_config, "cache_config",
                                                                      None)
    if model is not None and getattr(model, "max_model_len", None):
        dims["max_model_len"] = int(model.max_model_len)
    if cache is not None and getattr(cache, "block_size", None):
        dims["block_size"] = int(cache.block_size)
    if cache is not None and getattr(cache, "cache_dtype", None) in ("fp8_ds_mla",):
        dims["kv_cache_dtype"] = "fp8_ds_mla"
    elif cache is not None and getattr(cache, "cache_dtype", None) in ("auto", "bfloat16"):
        dims["kv_cache_dtype"] = "bf16"
    hf = getattr(model, "hf_text_config", None) if model is not None else None
    if hf is None:
        return dims
    tp = getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1
    for field, name in (("num_layers", "num_hidden_layers"), ("topk", "index_topk"),
                        ("index_num_heads", "index_n_heads"),
                        ("index_head_dim", "index_head_dim"), ("hidden_size", "hidden_size")):
        value = getattr(hf, name, None)
        if isinstance(value, int) and value > 0:
            dims[field] = value
    heads = getattr(hf, "num_attention_heads", None)
    if isinstance(heads, int) and heads > 0 and heads % tp == 0:
        dims["num_heads"] = heads // tp
    rank, rope = getattr(hf, "kv_lora_rank", None), getattr(hf, "qk_rope_head_dim", None)
    if isinstance(rank, int) and isinstance(rope, int):
        dims["qk_head_dim"], dims["v_head_dim"] = rank + rope, rank
    return dims


def _vllm_groups() -> list:
    """vLLM's PCP group, then its TP group (their gloo ``cpu_group``s): every rank that shares
    one global batch (cpplan/vllm/guard.py)."""
    from vllm.distributed import parallel_state

    groups = [parallel_state.get_pcp_group()]
    tp = parallel_state.get_tp_group()
    if tp.world_size > 1:
        groups.append(tp)
    return [g.cpu_group for g in groups]


def _vllm_record_folder(manager, folder: str) -> str | None:
    """Where this rank records: the first rank of its PCP, DCP, TP and pipeline groups records
    its data-parallel rank's steps (into ``dp<rank>`` when there are several); others None."""
    if manager.pcp_rank != 0 or manager.dcp_rank != 0:
        return None
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return folder
    if parallel_state.get_tp_group().rank_in_group or parallel_state.get_pp_group().rank_in_group:
        return None
    dp = parallel_state.get_dp_group()
    return folder if dp.world_size == 1 else os.path.join(folder, f"dp{dp.rank_in_group}")


class Hook:
    """The state of the installed plugin: per PCPManager (weakly held) its config, step count,
    exchange and recorder."""

    def __init__(self, settings: Settings, *, groups=None, model_dims=None,
                 records_here=None) -> None:
        self.settings, self.groups, self.model_dims = settings, groups, model_dims
        self.records_here = records_here
        self.vllm_configs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.log = logging.getLogger(LOGGER_NAME)

    def after_partition(self, manager, global_batch, batch_desc, local) -> None:
        state = self.states.get(manager)
        if state is None:
            state = self.states[manager] = _ManagerState(self, manager)
        state.step(global_batch, batch_desc, local)

    def close(self) -> None:
        for state in list(self.states.values()):
            state.close()

    def _dims_for(self, manager) -> dict:
        if self.model_dims is not None:
            return dict(self.model_dims)
        vllm_config = self._vllm_config(manager)
        return model_dims_from(vllm_config) if vllm_config is not None else {}

    def _vllm_config(self, manager):
        vllm_config = self.vllm_configs.get(manager)
        if vllm_config is None:
            from vllm.config import get_current_vllm_config_or_none

            vllm_config = get_current_vllm_config_or_none()
        return vllm_config

    def _speculative_tokens(self, manager) -> int:
        """Draft tokens a decode request schedules (a FULL graph's request is 1 + this)."""
        spec = getattr(self._vllm_config(manager), "speculative_config", None)
        return int(getattr(spec, "num_speculative_tokens", 0) or 0)

    def _folder_for(self, manager) -> str | None:
        if not self.settings.record:
            return None
        choice = self.records_here
        if choice is None:
            return _vllm_record_folder(manager, self.settings.folder)
        if callable(choice):
            return choice(manager)
        return self.settings.folder if choice else None


class _ManagerState:
    """One PCPManager's guard and recorder (its steps counted from 0, alike on every rank)."""

    def __init__(self, hook: Hook, manager) -> None:
        from cpplan.vllm import adapter

        self.hook, self.settings, self.adapter = hook, hook.settings, adapter
        self.manager = weakref.ref(manager)
        self.seq = 0
        self.where = (f"rank {_world_rank()} (PCP rank {manager.pcp_rank}, DCP rank "
                      f"{manager.dcp_rank})")
        self.error: BaseException | None = None
        try:
            self.config = adapter.config_for(manager.pcp_world_size, manager.dcp_world_size,
                                             manager.cp_interleave,
                                             bool(manager.shard_decode_requests),
                                             **hook._dims_for(manager))
        except Exception as exc:  # noqa: BLE001 - reported at every step, through the exchange
            self.config, self.error = None, exc
        self.graph_configs: dict = {}
        self.num_speculative_tokens = hook._speculative_tokens(manager)
        self.exchange = None
        if self.settings.guard:
            from cpplan.vllm.guard import GuardExchange

            groups = hook.groups if hook.groups is not None else _vllm_groups()
            self.exchange = GuardExchange(groups, kind=self.settings.exchange,
                                          timeout_s=self.settings.timeout_s)
        self.recorder = None
        folder = hook._folder_for(manager)
        if folder is not None and self.config is not None:
            from cpplan.vllm.record import Recorder

            self.recorder = Recorder(folder, self.config)
        self.last_warning = None

    def _config_for(self, batch_desc):
        """The step's config: padded as vLLM pads it (a CUDA-graph step to the descriptor's
        token count, docs/design.md §3.7), else the eager config."""
        if self.error is not None:
            raise self.error
        if batch_desc.cg_mode.name == "NONE":
            return self.config
        size = int(batch_desc.num_tokens)
        config = self.graph_configs.get(size)
        if config is None:
            import msgspec

            config = msgspec.structs.replace(self.config, cudagraph_token_sizes=(size,))
            self.graph_configs[size] = config
        return config

    def step(self, global_batch, batch_desc, local) -> None:
        """After vLLM's partition: compile, compare (guard), record, then the exchange, which
        every rank joins whatever happened before it."""
        from cpplan.planner import compile as compile_plan
        from cpplan.schemas.codec import digest
        from cpplan.vllm.guard import NO_DIGEST, OWN_FAILED, OWN_MISMATCH, check_partition

        seq, self.seq = self.seq, self.seq + 1
        step = plan = finding = None
        plan_digest, bits = NO_DIGEST, 0
        try:
            step = self.adapter.step_input(global_batch, step_id=seq)
            plan = compile_plan(self._config_for(batch_desc), step)
            plan_digest = digest(plan)
            if self.exchange is not None:
                manager = self.manager()
                # the descriptor's runtime mode (NONE, PIECEWISE, FULL): a FULL graph is
                # always a decode-only one under PCP (PCPManager.validate_config)
                mode = {"FULL": "FULL_DECODE_ONLY"}.get(batch_desc.cg_mode.name,
                                                        batch_desc.cg_mode.name)
                expected = self.adapter.local_batch(
                    plan, manager.pcp_rank, manager.dcp_rank, cudagraph_mode=mode,
                    num_speculative_tokens=self.num_speculative_tokens)
                finding = check_partition(manager, global_batch, local, expected,
                                          self.settings.fields, self.where)
                bits = OWN_MISMATCH if finding is not None else 0
        except Exception as exc:  # noqa: BLE001 - every rank must still join the exchange
            bits = OWN_FAILED
            finding = f"{self.where}: cpplan could not check the step: {_one_line(exc)}"
            if self.exchange is None:
                self._warn(f"cpplan record, step {seq}: not recorded: {_one_line(exc)}")
        if self.recorder is not None and plan is not None:
            self._record(step, plan_digest)
        if self.exchange is not None:
            self.exchange.agree(seq, plan_digest, bits, finding, step)

    def _record(self, step, digest: bytes) -> None:
        from cpplan.schemas.errors import OutputError

        try:
            self.recorder.write(step, digest)
        except OutputError as exc:  # the engine goes on; the line says what was lost
            self._warn(f"cpplan record, step {step.step_id}: not recorded: {exc}")

    def _warn(self, line: str) -> None:
        """One line on vLLM's log; a failure repeated step after step (the same reason, the
        line's last part) is logged once."""
        key = line.rsplit(": ", 1)[-1]
        if key != self.last_warning:
            self.hook.log.warning("%s", line)
            self.last_warning = key

    def close(self) -> None:
        if self.exchange is not None:
            self.exchange.close()
