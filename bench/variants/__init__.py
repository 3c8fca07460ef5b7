"""Kernel variants that never won (or no longer hold) a default, kept runnable for the benches
that compare against them; no runtime code imports this package.

``kmajor`` (keys on the wide side of the products; bench/kernel_times.py; bench/RESULTS.md, variant
sweep). ``old_indexer`` (the first Triton indexer, one program per query and key block;
bench/indexer.py's "old" and bench/kernel_times.py's remap comparison). ``gluon_logits`` (the Gluon
prefill indexer logits, products overlapped with epilogues, slower on the H200;
bench/indexer.py --only planar). Deleted
rather than kept: the heads kernels' register prefetch (4-7x slower at 64 keys: spills), bf16
dequantisation (168-174 vs 187 TFLOP/s), evict-first loads and ``tl.range(warp_specialize=True)``
(no change); they are in the history before the kernels were split by backend.
"""
