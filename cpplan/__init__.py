"""cpplan: a step compiler for context-parallel inference of sparse-MLA models.

Data flows one way: ``cpplan.planner`` (CPU, numpy + numba) compiles a step into a
``cpplan.schemas.StepPlan``; ``cpplan.runtime`` (torch) binds and executes it on one rank.
"""

from cpplan._version import __version__

# the README's install command (its quick start, run from a clone's root): the hint of every
# missing-package error, so that the fix installs the pinned CPU torch with every extra the
# commands use, not a resolver's CUDA torch and then the next missing extra
INSTALL_COMMAND = 'pip install "torch==2.13.0" -e ".[runtime,cli,hf]"'

__all__ = ["INSTALL_COMMAND", "__version__"]
