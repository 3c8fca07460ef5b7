"""The Gluon kernels (Hopper, sm_90), run by the Triton backend: the few-head fp8_ds_mla decode,
and the opt-in prefill indexer logits (``logits``: products overlapped with epilogues).

Nothing is imported here: both need a Triton with Gluon (tested: 3.6); ``decode`` is imported
only where a plan chose a Gluon family (``triton/plan.py``), ``logits`` only where
``IndexerTiles.logits_gluon`` asks for it.
"""
