"""Kernel variants that never won a default, kept runnable for comparison by bench/kernels.py.

``kmajor`` (keys on the wide side of the products; bench/RESULTS.md, variant sweep). Deleted
rather than kept: the heads kernels' register prefetch (4-7x slower at 64 keys: spills), bf16
dequantisation (168-174 vs 187 TFLOP/s), evict-first loads and ``tl.range(warp_specialize=True)``
(no change); they are in the history before the kernels were split by backend.
"""
