"""cpplan.sim: the simulation harness (docs/design.md §8). It drives the runtime the way an engine
would and checks every step against a single-device oracle; the runtime never imports it.

Modules: ``coords`` (model inputs from coordinates), ``allocator`` (one rank's paged blocks),
``scheduler`` (the deterministic mini serving loop), ``model`` (the reference layers run through
the embedding API), ``oracle`` (single-device reference), ``launch`` (spawned or torchrun
worlds), ``simulate`` (``cpplan simulate``'s per-rank body), ``replay`` (all ranks of one step
as threads of one process).
"""
