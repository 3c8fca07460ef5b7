"""The serving scheduler of ``cpplan generate`` (no torch): continuous batching, chunked
prefill under a token budget, prefills and decodes mixed in one step, finishes at each
request's ``max_new_tokens``, and preemption by recompute when a DCP rank's blocks run out.

A request holds its token ids (prompt + generated). Each step schedules, for every running
request in admission order, ``min(remaining, budget left)`` of the tokens not yet in the KV
cache (``remaining = len(tokens) - computed``: 1 for a decode, the rest of the prompt for a
prefill, the prompt and the outputs again after a preemption), then admits waiting requests
while the budget, ``max_num_seqs`` and the blocks allow. A request is sampled in a step iff
the step reaches its last token; its new token is appended by :meth:`Scheduler.complete`.
When a running request's next chunk does not fit a rank's free blocks, the most recently
admitted running request is preempted (its blocks freed, its KV recomputed later), until it
fits. Every decision uses global facts only: every rank runs its own copy and emits the same
``StepInput`` (``req_ids`` are ``"r<input index>"``).
"""

from __future__ import annotations

import dataclasses

from cpplan.schemas.errors import ConfigError
from cpplan.schemas.step import StepInput
from cpplan.serve.blocks import BlockBook


@dataclasses.dataclass
class Request:
    index: int  # input order
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the cache
    preemptions: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)  # prompt + output, kept

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt) + list(self.output)

    @property
    def req_id(self) -> str:
        return f"r{self.index}"

    def append(self, token: int) -> None:
        self.output.append(token)
        self.tokens.append(token)

    @property
    def remaining(self) -> int:
        return len(self.prompt) + len(self.output) - self.computed

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class Scheduler:
    """``requests`` all arrive at step 0 (in input order); ``book`` the ranks' blocks."""

    def __init__(self, requests: list[Request], book: BlockBook, *,
                 max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.waiting = list(requests)
        self.running: list[Request] = []
        self.book = book
        self.budget, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.scheduled: list[tuple[Request, int]] = []
        self.preempted = 0
        for r in requests:
            if not book.capacity_ok(len(r.prompt) + r.max_new_tokens):
                raise ConfigError(
                    f"request {r.index}: {len(r.prompt)} prompt + {r.max_new_tokens} new "
                    f"tokens need {book.blocks_for(len(r.prompt) + r.max_new_tokens)} KV "
                    f"blocks on one rank; expected at most {book.num_blocks - 1} (raise "
                    "--num-blocks)")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, step_id: int) -> StepInput:
        """The next step (call only while :attr:`has_work`)."""
        left, plan = self.budget, []
        k = 0
        while k < len(self.running) and left > 0:
            r = self.running[k]
            n = min(r.remaining, left)
            while not self.book.fits(r.req_id, r.computed + n):
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                if victim is r:
                    break
            else:
                self.book.grow(r.req_id, r.computed + n)
                plan.append((r, n))
                left -= n
                k += 1
                continue
            break  # r itself was preempted: nothing after it runs
        while (left > 0 and self.waiting and len(self.running) < self.max_num_seqs):
            r = self.waiting[0]
            n = min(r.remaining, left)
            if not self.book.fits(r.req_id, r.computed + n):
                break
            self.waiting.pop(0)
            self.running.append(r)
            self.book.grow(r.req_id, r.computed + n)
            plan.append((r, n))
            left -= n
        if not plan:  # cannot happen: capacity_ok holds every request alone
            raise ConfigError(f"step {step_id}: no request fits the KV blocks")
        self.scheduled = plan
        return StepInput.build(step_id, [r.req_id for r, _ in plan],
                               [r.computed for r, _ in plan], [n for _, n in plan],
                               [r.remaining > 1 for r, _ in plan],
                               [r.computed + n == len(r.tokens) for r, n in plan])

    def _preempt(self, r: Request) -> None:
        self.book.release(r.req_id)
        r.computed = 0
        r.preemptions += 1
        self.preempted += 1
        self.waiting.insert(0, r)

    def complete(self, sampled: dict[int, int]) -> list[Request]:
        """Apply the last step: ``sampled`` maps a scheduled request's index to its new
        token. Returns the requests that finished (their blocks freed)."""
        done = []
        for r, n in self.scheduled:
            r.computed += n
            if r.index in sampled:
                r.append(int(sampled[r.index]))
            if r.done:
                done.append(r)
                self.book.release(r.req_id)
        ids = {id(r) for r in done}
        self.running = [r for r in self.running if id(r) not in ids]
        self.scheduled = []
        return done
