"""cpplan inside vLLM: vLLM 0.32's per-rank step metadata stated from a cpplan plan.

:mod:`cpplan.vllm.adapter` turns vLLM's global batch into a StepInput and a plan back into what
vLLM's ``PCPManager.partition_batch`` and sparse-MLA builders give each rank; numpy only, it
never imports vLLM. :func:`check_vllm_version` (the one entry here that imports vLLM, lazily)
names the releases those rules are vLLM's for.
"""

from cpplan.vllm.adapter import (
    CUDAGRAPH_MODES,
    DSA_FIELDS,
    LOCAL_BATCH_FIELDS,
    config_for,
    dsa_metadata,
    full_graph_num_reqs,
    local_batch,
    step_input,
)
from cpplan.vllm.version import SUPPORTED, SUPPORTED_NAMES, VllmVersionError, check_vllm_version

__all__ = [
    "CUDAGRAPH_MODES", "DSA_FIELDS", "LOCAL_BATCH_FIELDS", "SUPPORTED", "SUPPORTED_NAMES",
    "VllmVersionError", "check_vllm_version", "config_for", "dsa_metadata", "full_graph_num_reqs",
    "local_batch", "step_input",
]
