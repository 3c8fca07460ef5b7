"""The Gluon kernels (Hopper, sm_90), run by the Triton backend: the few-head fp8_ds_mla decode
attention (``decode``), which the Triton plan picks for its Gluon families (``triton/plan.py``).

Nothing is imported here: ``decode`` needs a Triton with Gluon (tested: 3.6) and is imported
only where a plan chose a Gluon family.
"""
