"""cpplan: a step compiler for context-parallel inference of sparse-MLA models.

Data flows one way: ``cpplan.planner`` (CPU, numpy + numba) compiles a step into a
``cpplan.schemas.StepPlan``; ``cpplan.runtime`` (torch) binds and executes it on one rank.
"""

from cpplan._version import __version__

__all__ = ["__version__"]
