"""The serving scheduler of ``cpplan generate`` (no torch): continuous batching, chunked
prefill under a token budget, prefills and decodes mixed in one step, finishes at a stop
token (the model's end-of-sequence ids and the request's own ``stop_token_ids``: finish reason
"stop", the token kept as the last output) or at the request's ``max_new_tokens`` ("length"),
and preemption by recompute when a DCP rank's blocks run out. A finished request's blocks are
freed in :meth:`Scheduler.complete`, so the next step can admit a waiting request into them.

A request holds its token ids (prompt + generated). Each step schedules ``min(remaining,
budget left)`` of the tokens not yet in the KV cache (``remaining = len(tokens) - computed``:
1 for a decode, the rest of the prompt for a prefill, the prompt and the outputs again after a
preemption) of every running decode, then of every running prefill (admission order), then
admits waiting requests while the budget, ``max_num_seqs`` and the blocks allow. A request is sampled in a step iff
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


@dataclasses.dataclass(eq=False)  # compared by identity
class Request:
    index: int  # input order
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the cache
    preemptions: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)  # prompt + output, kept
    stop: frozenset[int] = frozenset()  # token ids that end the request once generated
    first_step: int = -1  # the step that first scheduled it (-1: not yet)
    finish_step: int = -1  # the step whose token finished it

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt) + list(self.output)
        self.stop = frozenset(self.stop)

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
    def finish_reason(self) -> str | None:
        """"stop" (the last token is a stop token), "length" (``max_new_tokens`` reached) or
        None (running); a stop token at the last allowed position is a "stop", as engines
        report it."""
        if self.output and self.output[-1] in self.stop:
            return "stop"
        return "length" if len(self.output) >= self.max_new_tokens else None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


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
        self._left, self._plan, self._gone, self._step = 0, {}, set(), -1
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
        """The next step (call only while :attr:`has_work`): running decodes first (one
        token each), then running prefills (chunks of what the budget leaves), then
        admissions; requests in admission order within the step."""
        self._left, self._plan = self.budget, {}  # request index -> scheduled tokens
        self._gone = set()  # indices preempted in this step
        for decodes in (True, False):
            for r in list(self.running):
                if self._left <= 0:
                    break
                if (r.remaining == 1) == decodes and r.index not in self._gone:
                    self._take(r)
        while self._left > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            if not self.book.fits(r.req_id, r.computed + min(r.remaining, self._left)):
                break  # admission never preempts
            self.running.append(self.waiting.pop(0))
            self._take(r)
        if not self._plan:  # cannot happen: capacity_ok holds every request alone
            raise ConfigError(f"step {step_id}: no request fits the KV blocks")
        plan = [(r, self._plan[r.index]) for r in self.running if r.index in self._plan]
        self.scheduled = plan
        self._step = step_id
        for r, _ in plan:
            if r.first_step < 0:
                r.first_step = step_id
        return StepInput.build(step_id, [r.req_id for r, _ in plan],
                               [r.computed for r, _ in plan], [n for _, n in plan],
                               [r.remaining > 1 for r, _ in plan],
                               [r.computed + n == len(r.tokens) for r, n in plan])

    def _take(self, r: Request) -> None:
        """Schedule ``min(remaining, budget left)`` of ``r``'s tokens, preempting the most
        recently admitted running requests (unscheduling them) until every rank holds it;
        nothing where ``r`` itself is the one preempted."""
        n = min(r.remaining, self._left)
        while not self.book.fits(r.req_id, r.computed + n):
            victim = self.running.pop()
            self._left += self._plan.pop(victim.index, 0)
            self._preempt(victim)
            if victim is r:
                return
        self.book.grow(r.req_id, r.computed + n)
        self._plan[r.index] = n
        self._left -= n

    def _preempt(self, r: Request) -> None:
        self._gone.add(r.index)
        self.book.release(r.req_id)
        r.computed = 0
        r.preemptions += 1
        self.preempted += 1
        self.waiting.insert(0, r)

    def complete(self, sampled: dict[int, int]) -> list[Request]:
        """Apply the last step: ``sampled`` maps a scheduled request's index to its new
        token. Returns the requests that finished, at a stop token or at their length (their
        blocks freed now: the next step may admit a waiting request into them)."""
        done = []
        for r, n in self.scheduled:
            r.computed += n
            if r.index in sampled:
                r.append(int(sampled[r.index]))
            if r.done:
                r.finish_step = self._step
                done.append(r)
                self.book.release(r.req_id)
        ids = {id(r) for r in done}
        self.running = [r for r in self.running if id(r) not in ids]
        self.scheduled = []
        return done
