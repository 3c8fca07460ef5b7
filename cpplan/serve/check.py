"""``cpplan generate --check``: the model's own transformers forward, teacher-forced over each
request's prompt + generated tokens in this process, compared at every generated position
(docs/design.md §4.5).

Reference per request: the stock model where ``index_topk`` covers the request's every context
(then the indexer selects every causal key and its numerics do not matter), else the model
with cpplan's indexer numerics (:mod:`cpplan.models.reference`: fp8 query and keys with
power-of-two scales, ties by token id); the KV latent rounded as cpplan's cache stores it.

Verdict: tokens must be equal at every generated position (exit 1 otherwise); a position
where cpplan's token is not the reference's argmax but the reference's logit of it is within
the tolerance of its maximum counts as a near-tie (equal, and counted in the report). The
logits are reported against the stated tolerance (:data:`TOL` with float32 activations,
:data:`TOL_BF16_ACTIVATIONS` with bf16): max |dlogit| and how many positions have every
logit within it. float32 summation order alone stays far below TOL; below topk an indexer
score within rounding of the k-th selects a different key now and then (the reference scores
in float64), and fp8 rounding (steps of 1/16) moves a value across a boundary, which shows as
a larger |dlogit| at a few positions of these random models (measured: 1x1 and 2x2 alike,
tiny-glm-5 fp8 78 of 96 positions within 5e-2, max 1.42, every token equal).
"""

from __future__ import annotations

import dataclasses

import torch

TOL = 5e-2
# bf16 activations (CUDA's default) against the float32 reference of the same weights: bf16's
# 8-bit mantissa on every projection leaves 1e-1 of logit noise, and more where it moves a
# selected key. The random presets amplify it: transformers' own model in bf16 against
# float32 (same weights, every key selected) agreed on 89-98% of argmaxes, max |dlogit| 4.6 at
# 130 tokens, so --check with bf16 activations reports differences on them by design.
TOL_BF16_ACTIVATIONS = 5e-1


@dataclasses.dataclass
class CheckResult:
    positions: int = 0
    equal: int = 0  # cpplan's token is the reference's argmax
    ties: int = 0  # not the argmax, but within TOL of it
    close: int = 0  # every logit within TOL
    max_dlogit: float = 0.0
    stock: int = 0  # requests checked against the stock model
    first_diff: str = ""  # the first differing position, described
    tol: float = TOL
    # per request below topk and full-indexer layer: the share of the unquantised (stock)
    # indexer's top-k that cpplan's numerics also select, over the same hidden states
    overlaps: list = dataclasses.field(default_factory=list)

    @property
    def tokens_ok(self) -> bool:
        return self.equal + self.ties == self.positions

    @property
    def ok(self) -> bool:
        return self.tokens_ok

    def line(self) -> str:
        """One line: the verdict and its figures."""
        head = "check OK" if self.ok else "check FAILED"
        text = (f"{head}: tokens equal at {self.equal + self.ties} of {self.positions} "
                f"positions ({self.ties} near-ties within {self.tol:g}); max |dlogit| "
                f"{self.max_dlogit:.3g}, {self.close} of {self.positions} positions within "
                f"tolerance {self.tol:g}; {self.stock} request(s) against the stock model, the "
                "rest against cpplan's indexer numerics")
        if self.overlaps:
            text += (f" (their selection overlaps the unquantised indexer's by "
                     f"{min(self.overlaps):.3f}-{max(self.overlaps):.3f})")
        return text + (f"; first difference: {self.first_diff}" if self.first_diff else "")


@torch.no_grad()
def check_outputs(model, prompts, outputs, logits, kv_cache_dtype: str, ids, *,
                  tol: float = TOL) -> CheckResult:
    """``model``: the reference (float32); ``prompts[i]`` / ``outputs[i]`` token ids,
    ``logits[i]`` ``[len(outputs[i]), vocab]`` cpplan's sampled logits (float32), ``ids[i]``
    the request's id (for the report); ``tol``: :data:`TOL`, or
    :data:`TOL_BF16_ACTIVATIONS` where cpplan ran with bf16 activations."""
    from cpplan.models.reference import selection_overlap, teacher_forced_logits

    res = CheckResult(tol=tol)
    topk = model.config.index_topk
    for rid, prompt, out, ours in zip(ids, prompts, outputs, logits):
        tokens = list(prompt) + list(out)
        stock = len(tokens) - 1 <= topk
        res.stock += int(stock)
        if not stock:
            res.overlaps += selection_overlap(model, tokens[:-1])
        pos = list(range(len(prompt) - 1, len(tokens) - 1))
        ref = teacher_forced_logits(model, tokens[:-1], pos, kv_cache_dtype=kv_cache_dtype,
                                    indexer="stock" if stock else "cpplan").cpu()
        ours = ours.float()
        got = torch.as_tensor(list(out), dtype=torch.long)
        best = ref.argmax(-1)
        picked = ref.gather(1, got[:, None])[:, 0]
        equal = got == best
        tie = ~equal & (picked >= ref.amax(-1) - tol)
        d = (ref - ours).abs().amax(-1)
        res.positions += len(out)
        res.equal += int(equal.sum())
        res.ties += int(tie.sum())
        res.close += int((d <= tol).sum())
        res.max_dlogit = max(res.max_dlogit, float(d.max()))
        bad = (~equal & ~tie).nonzero()
        if len(bad) and not res.first_diff:
            k = int(bad[0])
            res.first_diff = (f"request {rid!r} new token {k}: cpplan {int(got[k])}, the "
                              f"model {int(best[k])}")
    return res
