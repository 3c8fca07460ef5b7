"""The Gluon kernels (Hopper, sm_90), run by the Triton backend: the few-head fp8_ds_mla decode
attention (``decode``), which the Triton plan picks for its Gluon families (``triton/plan.py``),
and the warp-specialised prefill indexer logits (``indexer_logits``), which
``triton/indexer_tiled.prefill_logits`` picks for wide chunks.

Nothing is imported here: both need a Triton with Gluon (tested: 3.6; the logits also compile
offline with 3.9) and are imported only where they run.
"""
