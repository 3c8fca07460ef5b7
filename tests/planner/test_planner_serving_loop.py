"""A serving loop as a Hypothesis state machine: requests arrive, prefill in chunks under a token
budget, decode (with speculative tokens), finish, get preempted and resume (recomputing from
scratch). Every scheduled step is compiled and checked against the naive reference."""

from __future__ import annotations

import planner_reference as ref
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from planner_strategies import TOPOLOGIES

from cpplan import planner
from cpplan.schemas import ParallelConfig, StepInput
from tests.lane import examples

MAX_LEN = 4096


class ServingLoop(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.config: ParallelConfig | None = None
        self.running: list[dict] = []  # scheduler order
        self.waiting: list[dict] = []
        self.next_id = 0
        self.step_id = 0

    @initialize(topology=st.sampled_from(TOPOLOGIES), inter=st.sampled_from((1, 2, 16, 64)),
                extra=st.sampled_from((0, 1, 3)))
    def configure(self, topology, inter, extra):
        p, w = topology
        base = ParallelConfig(pcp_size=p, dcp_size=w, interleave_size=inter,
                              max_model_len=MAX_LEN)
        self.config = ParallelConfig(
            pcp_size=p, dcp_size=w, interleave_size=inter, max_model_len=MAX_LEN,
            gather_workspace_tokens=base.gather_workspace_tokens * (1 + extra),
            cudagraph_token_sizes=(16, 256, 1024) if extra == 1 else ())

    @rule(prompts=st.lists(st.integers(1, 4000), min_size=1, max_size=8),
          max_new=st.integers(1, 40))
    def arrive(self, prompts, max_new):
        for prompt in prompts:
            self.waiting.append({"id": f"q{self.next_id}", "prompt": prompt, "computed": 0,
                                 "generated": 0, "max_new": max_new})
            self.next_id += 1

    @rule(budget=st.integers(1, 8192), spec=st.integers(0, 3))
    def step(self, budget, spec):
        while self.waiting and len(self.running) < 64:
            self.running.append(self.waiting.pop(0))
        scheduled = []
        for req in self.running:
            target = req["prompt"] + req["generated"]
            if req["computed"] < target - 1:  # prefilling (chunked by the budget)
                q = min(target - req["computed"], budget)
                if q < 1:
                    continue
                budget -= q
                scheduled.append((req, q, True))
            else:  # decode: 1 token plus speculative ones, within the model length
                q = max(1, min(1 + spec, MAX_LEN - req["computed"]))
                scheduled.append((req, q, False))
        scheduled = [s for s in scheduled if s[0]["computed"] + s[1] <= MAX_LEN]
        self._compile_and_check(scheduled)
        for req, q, prefilling in scheduled:
            req["computed"] += q
            if not prefilling or req["computed"] >= req["prompt"]:
                req["generated"] += 1
        self.running = [r for r in self.running
                        if r["generated"] < r["max_new"] and r["computed"] < MAX_LEN - 4]

    def _compile_and_check(self, scheduled):
        step = StepInput.build(
            self.step_id, [r["id"] for r, _, _ in scheduled],
            [r["computed"] for r, _, _ in scheduled], [q for _, q, _ in scheduled],
            [pre for _, _, pre in scheduled])
        self.step_id += 1
        plan = planner.compile(self.config, step)
        ref.assert_plan_matches(plan, ref.reference_plan(self.config, step))

    @precondition(lambda self: self.running)
    @rule(k=st.integers(0, 63))
    def finish(self, k):
        self.running.pop(k % len(self.running))

    @precondition(lambda self: self.running)
    @rule(k=st.integers(0, 63))
    def preempt(self, k):
        req = self.running.pop(k % len(self.running))
        req["prompt"] += req["generated"]  # resumes by recomputing prompt + output so far
        req["max_new"] -= req["generated"]
        req["generated"] = 0
        req["computed"] = 0
        if req["max_new"] > 0 and req["prompt"] < MAX_LEN - 8:
            self.waiting.append(req)


TestServingLoop = ServingLoop.TestCase
# 60 loops of up to 40 steps (up to 2,400 compiled steps, each against the reference;
# derandomized: the same loops every run), about one per topology x interleave pair (13 x 4),
# the rules (arrive, step, finish, preempt) interleaved within each; 120 loops (6.5 s, 60: 2.7 s
# on the 2-core machine) made a second pass over the same pairs. The quick lane runs 8.
TestServingLoop.settings = settings(max_examples=examples(60, quick=8), stateful_step_count=40)
