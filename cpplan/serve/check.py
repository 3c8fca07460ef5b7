"""``cpplan generate --check``: the model's own transformers forward, teacher-forced over each
request's prompt + generated tokens in this process, compared at every generated position
(docs/design.md §4.5).

Reference per request: the stock model where ``index_topk`` covers the request's every context
(then the indexer selects every causal key and its numerics do not matter), else the model
with cpplan's indexer numerics (:mod:`cpplan.models.reference`: fp8 query and keys with
power-of-two scales, ties by token id); the KV latent rounded as cpplan's cache stores it.

Verdict (exit 1 where it fails). A position is *close* where every logit is within the
tolerance (:data:`TOL` with float32 activations, :data:`TOL_BF16_ACTIVATIONS` with bf16) of the
reference's. At every close position the token must be the reference's argmax, or a near-tie
(the reference's logit of it within the tolerance of its maximum; counted apart). Where
rounding is involved (an fp8 KV cache, a request below topk, whose indexer query is fp8, or
bf16 activations) a position may be beyond the tolerance, and its token may then differ, but
at least :data:`MIN_CLOSE` of all positions must be close; with none involved, every one.

Why: float32 summation order alone stays far below TOL, but the chunked and sharded forward's
float32 noise against the reference's whole forward now and then puts a value on the other
side of an fp8 rounding boundary (steps of 1/16), or an indexer score on the other side of the
k-th (the reference scores in float64), so a selected key changes. That moves the logits of
its position, and of the request's later positions that attend to it, by up to ~2 on these
random models; where a position's top two logits are closer than that, its greedy token
differs too. Measured on the CPU at 1 x 1, the built-in prompts, fp8 KV: both presets with
seeds 0-7 and 16 new tokens left 78-96 of 96 positions close, with 64 new tokens (seeds 0, 1,
3, 5, 7 of tiny-deepseek-v32, 0, 1, 3 of tiny-glm-5) 291-380 of 384; tokens differed at 0-6
positions, every one beyond the tolerance (the rule before, every token equal, failed 13 of
those 24 runs); one request kept as few as 3 of its 16 positions close (a key flipped early
in it), so the share counts all positions. A wrong RoPE convention or softmax scale (x0.9 to
x1.5) left 1 of 96 close in both presets. The report gives the largest |dlogit|, the close
positions and the tokens that differ beyond the tolerance.
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
# of the positions close where rounding is involved: the presets left 76-100% close, a wrong
# RoPE convention or softmax scale 1% (the module's docstring)
MIN_CLOSE = 0.5


@dataclasses.dataclass
class CheckResult:
    positions: int = 0
    equal: int = 0  # cpplan's token is the reference's argmax
    ties: int = 0  # not the argmax, but within TOL of it
    close: int = 0  # every logit within TOL
    far_differ: int = 0  # tokens differing (not near-ties) at positions beyond TOL
    close_differ: int = 0  # tokens differing (not near-ties) at close positions
    min_close: float = MIN_CLOSE  # of the positions close (1: no rounding involved)
    max_dlogit: float = 0.0
    stock: int = 0  # requests checked against the stock model
    first_diff: str = ""  # the first differing token at a close position, described
    first_far: str = ""  # the first differing token beyond the tolerance, described
    tol: float = TOL
    # per request below topk and full-indexer layer: the share of the unquantised (stock)
    # indexer's top-k that cpplan's numerics also select, over the same hidden states
    overlaps: list = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """The verdict (the module's docstring)."""
        return self.close_differ == 0 and self.close >= self.min_close * self.positions

    def line(self) -> str:
        """One line: the verdict and its figures."""
        head = "check OK" if self.ok else "check FAILED"
        text = (f"{head}: tokens equal at {self.equal + self.ties} of {self.positions} "
                f"positions ({self.ties} near-ties within {self.tol:g}"
                + (f"; {self.far_differ} differing where the logits are beyond it"
                   if self.far_differ else "")
                + f"); max |dlogit| {self.max_dlogit:.3g}, {self.close} of {self.positions} "
                f"positions within tolerance {self.tol:g} (needs {self.min_close:.0%}); "
                f"{self.stock} request(s) against the stock model, the rest against cpplan's "
                "indexer numerics")
        if self.overlaps:
            text += (f" (their selection overlaps the unquantised indexer's by "
                     f"{min(self.overlaps):.3f}-{max(self.overlaps):.3f})")
        if self.first_diff:
            return text + f"; first difference: {self.first_diff}"
        return text + (f"; first difference (beyond the tolerance): {self.first_far}"
                       if self.first_far else "")


@torch.no_grad()
def check_outputs(model, prompts, outputs, logits, kv_cache_dtype: str, ids, *,
                  tol: float = TOL) -> CheckResult:
    """``model``: the reference (float32); ``prompts[i]`` / ``outputs[i]`` token ids,
    ``logits[i]`` ``[len(outputs[i]), vocab]`` cpplan's sampled logits (float32), ``ids[i]``
    the request's id (for the report); ``tol``: :data:`TOL`, or
    :data:`TOL_BF16_ACTIVATIONS` where cpplan ran with bf16 activations."""
    from cpplan.models.reference import auto_rows, selection_overlap, teacher_forced_logits

    res = CheckResult(tol=tol)
    topk = model.config.index_topk
    for rid, prompt, out, ours in zip(ids, prompts, outputs, logits):
        tokens = list(prompt) + list(out)
        stock = len(tokens) - 1 <= topk
        res.stock += int(stock)
        pos = list(range(len(prompt) - 1, len(tokens) - 1))
        rows = auto_rows(model, len(tokens) - 1, len(pos), what=f"request {rid!r}")
        if not stock:
            res.overlaps += selection_overlap(model, tokens[:-1], rows=rows)
        ref = teacher_forced_logits(model, tokens[:-1], pos, kv_cache_dtype=kv_cache_dtype,
                                    indexer="stock" if stock else "cpplan", rows=rows).cpu()
        ours = ours.float()
        got = torch.as_tensor(list(out), dtype=torch.long)
        best = ref.argmax(-1)
        picked = ref.gather(1, got[:, None])[:, 0]
        equal = got == best
        tie = ~equal & (picked >= ref.amax(-1) - tol)
        d = (ref - ours).abs().amax(-1)
        near = d <= tol
        differ = ~equal & ~tie
        res.positions += len(out)
        res.equal += int(equal.sum())
        res.ties += int(tie.sum())
        res.close += int(near.sum())
        res.close_differ += int((differ & near).sum())
        res.far_differ += int((differ & ~near).sum())
        res.max_dlogit = max(res.max_dlogit, float(d.max()))
        for k in differ.nonzero()[:, 0].tolist():
            what = (f"request {rid!r} new token {k}: cpplan {int(got[k])}, the model "
                    f"{int(best[k])}")
            if near[k] and not res.first_diff:  # breaks the verdict
                res.first_diff = what
            elif not near[k] and not res.first_far:
                res.first_far = f"{what} (|dlogit| {float(d[k]):.3g})"
    # no rounding involved: bf16 KV, every request against the stock model, float32 activations
    if kv_cache_dtype == "bf16" and res.stock == len(outputs) and tol == TOL:
        res.min_close = 1.0
    return res


def check_memory(config, prompts, *, device: str, served_dtype) -> None:
    """Before the weights load: ConfigError (one line, the numbers) where the reference
    forward over the longest request (prompt + its new tokens) could not run on ``device``
    even one query row at a time, beside the float32 reference weights (and the served ones
    where ``served_dtype`` is not float32: the reference is then a float32 copy)."""
    from cpplan.models.memory import check_fits, free_bytes, reference_bytes, weight_bytes

    longest = max(prompts, key=lambda p: len(p.token_ids) + p.max_new_tokens)
    weights = weight_bytes(config, torch.float32)
    if served_dtype != torch.float32:
        weights += weight_bytes(config, served_dtype)
    need = reference_bytes(config, len(longest.token_ids) + longest.max_new_tokens - 1,
                           longest.max_new_tokens)
    check_fits(need, free_bytes(device), weights=weights, what=f"request {longest.id!r}")
