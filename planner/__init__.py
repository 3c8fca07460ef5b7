"""cpplan.planner: compile a scheduler step into a StepPlan (pure CPU; numpy + numba, no torch).

``compile(config, step)`` is the planner (docs/design.md §3); ``warmup()`` JIT-compiles its
kernels at start-up; ``estimate_cost(plan)`` derives a per-rank cost estimate on demand.
"""

from cpplan.planner._kernels import warmup
from cpplan.planner.compile import compile
from cpplan.planner.cost import CostEstimate, estimate_cost

__all__ = ["CostEstimate", "compile", "estimate_cost", "warmup"]
