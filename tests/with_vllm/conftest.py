"""(Not named tests/vllm: pytest puts tests/ on sys.path, where a folder named vllm would
shadow vLLM itself.) tests/with_vllm runs in the CI's second venv, where vLLM 0.32 is installed (.ci/run); in the main
venv its vLLM tests skip. vLLM is imported once here with the warnings of its own import-time
dependencies silenced (requests warns about a missing charset detector, which vLLM never
uses); the suite's warnings-are-errors rule holds for everything after."""

from __future__ import annotations

import importlib.util
import warnings

if importlib.util.find_spec("vllm") is not None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import vllm  # noqa: F401
        import vllm.v1.attention.backends.mla.flashmla_sparse  # noqa: F401
        import vllm.v1.attention.backends.mla.indexer  # noqa: F401
        import vllm.v1.worker.gpu.pcp_manager  # noqa: F401
