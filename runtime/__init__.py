"""cpplan.runtime: binds a StepPlan to one rank and executes it (torch; Triton on CUDA).

Modules: ``groups`` (process groups), ``executor`` (StepExecutor: bind, insert, attend,
restore), ``collectives`` (one named function per planned collective, with a ledger),
``verify`` (cross-rank digest check), ``arena`` and ``tables`` (pinned arena ring, token-level
tables), ``kernels`` (dispatch table: torch reference, Triton), and the simulation pieces
(``coords``, ``oracle``, ``scheduler``, ``launch``, ``simulate``, ``replay``). The public
embedding API is re-exported by :mod:`cpplan.api`.
"""
