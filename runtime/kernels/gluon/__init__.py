"""The Gluon kernels (Hopper, sm_90): the few-head fp8_ds_mla decode, run by the Triton backend.

Nothing is imported here: ``decode`` needs a Triton with Gluon (tested: 3.6) and is imported
only where a plan chose a Gluon family (``triton/plan.py``).
"""
