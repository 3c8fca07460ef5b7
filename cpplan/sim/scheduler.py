"""A deterministic mini serving loop's scheduler (no torch).

The scheduler admits prompts, chunk-prefills long ones under a token budget, decodes, finishes
and preempts (recompute), and emits each step's global ``StepInput``. Every decision uses global
facts only, so every rank runs its own copy and emits the same steps. Each rank's blocks are the
engine's side: :mod:`cpplan.sim.allocator`.
"""

from __future__ import annotations

import dataclasses

from cpplan.schemas.step import StepInput


@dataclasses.dataclass
class Request:
    req_id: str
    prompt_len: int
    output_len: int
    arrival: int
    computed: int = 0  # tokens in the KV cache
    generated: int = 0  # output tokens sampled so far

    @property
    def prefill_len(self) -> int:
        """Tokens to prefill: the prompt, plus earlier outputs after a preemption."""
        return self.prompt_len + max(self.generated - 1, 0)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prefill_len


def preset_requests(pcp_size: int, max_model_len: int, num_long: int = 2) -> list[Request]:
    """Prompt lengths 1, 2, 3, around multiples of 2P and S^2, and long chunked prompts."""
    s = 2 * pcp_size
    lens = [1, 2, 3, s - 1, s, s + 1, 2 * s - 1, 2 * s, 2 * s + 1, s * s - 1, s * s + 1, 37]
    lens[2:2] = [max_model_len // 2 + 61 * k for k in range(num_long)]
    reqs = []
    for k, n in enumerate(lens):
        n = max(1, min(n, max_model_len - 24))
        reqs.append(Request(f"req-{k:02d}-len{n}", n, 4 + (k * 7) % 13, arrival=k // 3))
    return reqs


class MiniScheduler:
    """Admission in arrival order; per step: decodes first (1 token each), then prefills under
    ``token_budget``, at most ``max_prefill_chunk`` tokens per request (long prompts are
    chunk-prefilled side by side); preempts the most recently admitted request when the KV
    budget (sum of extents) would overflow."""

    def __init__(self, requests: list[Request], *, token_budget: int, max_running: int,
                 kv_token_budget: int, max_prefill_chunk: int = 48,
                 name_sampled: bool = False) -> None:
        self.waiting = sorted(requests, key=lambda r: (r.arrival, r.req_id))
        self.running: list[Request] = []
        self.token_budget, self.max_running = token_budget, max_running
        self.kv_token_budget = kv_token_budget
        self.max_prefill_chunk = max_prefill_chunk  # per request and step (vLLM's long-prefill cap)
        self.finished: list[str] = []
        self.preempted: list[str] = []  # ids preempted in the last schedule() call
        self._scheduled: list[tuple[Request, int]] = []
        # steps name their sampled rows: decodes and prefills that end their prompt
        self.name_sampled = name_sampled

    def schedule(self, step_id: int) -> StepInput | None:
        """The next step's global batch (None when nothing is left to run)."""
        self.preempted = []
        budget = self.token_budget
        plan: list[tuple[Request, int]] = []
        for r in self.running:
            if not r.prefilling:
                plan.append((r, 1))
                budget -= 1
        for r in self.running:
            if r.prefilling and budget > 0:
                n = min(r.prefill_len - r.computed, budget, self.max_prefill_chunk)
                plan.append((r, n))
                budget -= n
        while (budget > 0 and self.waiting and self.waiting[0].arrival <= step_id
               and len(self.running) < self.max_running):
            r = self.waiting.pop(0)
            self.running.append(r)
            n = min(r.prefill_len, budget, self.max_prefill_chunk)
            plan.append((r, n))
            budget -= n
        plan = self._fit_kv(plan)
        if not plan:
            return None
        order = {id(r): k for k, r in enumerate(self.running)}
        plan.sort(key=lambda rq: order[id(rq[0])])
        self._scheduled = plan
        sampled = ([r.computed + q >= r.prefill_len for r, q in plan] if self.name_sampled
                   else None)
        return StepInput.build(step_id, [r.req_id for r, _ in plan],
                               [r.computed for r, _ in plan], [q for _, q in plan],
                               [r.prefilling for r, _ in plan], sampled)

    def _fit_kv(self, plan):
        while plan and sum(r.computed + q for r, q in plan) > self.kv_token_budget:
            victim = self.running.pop()  # most recently admitted
            victim.computed = 0
            self.waiting.insert(0, victim)
            self.preempted.append(victim.req_id)
            plan = [(r, q) for r, q in plan if r is not victim]
        return plan

    def complete(self) -> list[str]:
        """Apply the last scheduled step; returns ids that finished."""
        done = []
        for r, q in self._scheduled:
            was_prefill = r.prefilling
            r.computed += q
            if was_prefill and not r.prefilling:
                r.generated = max(r.generated, 1)
            elif not was_prefill:
                r.generated += 1
            if not r.prefilling and r.generated >= r.output_len:
                done.append(r.req_id)
        self.running = [r for r in self.running if r.req_id not in done]
        self.finished += done
        self._scheduled = []
        return done
