"""CUDA kernels of the Triton backend, compiled on first use by the CUDA toolkit's ``nvcc``
where one is found and loaded through ctypes (no torch headers, no extension build: seconds to
compile, cached by source; ``build``). Each is optional: without a toolkit, or on a GPU it was
not built for, the Triton kernels run instead, and ``row_topk.unavailable_reason`` says why.

Modules: ``build`` (find nvcc, compile, cache, load), ``row_topk`` (the prefill indexer's
exact top-k of each row, one CTA a row in shared memory; source ``row_topk.cu``).
"""
