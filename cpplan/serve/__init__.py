"""``cpplan generate``'s serving engine over a transformers DSA model (docs/design.md §4.5).

Modules: ``prompts`` (JSONL and built-in prompts, checked against the model), ``blocks``
(every DCP rank's paged KV blocks, one deterministic book), ``scheduler`` (continuous
batching, chunked prefill, mixed steps, finishes, preemption by recompute), ``engine`` (one
rank's loop: compile, bind, :class:`~cpplan.models.RankForward`, sample), ``run`` (prepare and
check every input, then serve in this process or on spawned gloo ranks), ``check`` (the
model's own teacher-forced forward, compared at every generated position).

Needs the extra ``cpplan[hf]``; importing this package does not import torch or transformers.
"""
