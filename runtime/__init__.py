"""cpplan.runtime: binds a StepPlan to one rank and executes it (torch; Triton on CUDA).

Modules: ``groups`` (process groups), ``executor`` (StepExecutor: bind, insert, attend,
restore), ``collectives`` (one named function per planned collective, with a ledger),
``verify`` (cross-rank digest check), ``arena`` and ``tables`` (pinned arena ring, token-level
tables), ``kernels`` (dispatch table: torch reference, Triton). The public embedding API is
re-exported by :mod:`cpplan.api`; the simulation harness that drives this package lives in
:mod:`cpplan.sim` (the runtime never imports it, nor the CLI or the API).
"""
