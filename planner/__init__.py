"""cpplan.planner: compile a scheduler step into a StepPlan (pure CPU; numpy + numba, no torch).

``compile(config, step)`` is the planner (docs/design.md §3); ``compile_planner_kernels()``
JIT-compiles its kernels at start-up (not ``cpplan.api.warmup``, which runs an executor's
synthetic steps); ``estimate_cost(plan)`` derives a per-rank cost estimate on demand.
"""

from cpplan.planner._kernels import compile_planner_kernels
from cpplan.planner.compile import compile
from cpplan.planner.cost import CostEstimate, estimate_cost

__all__ = ["CostEstimate", "compile", "compile_planner_kernels", "estimate_cost"]
