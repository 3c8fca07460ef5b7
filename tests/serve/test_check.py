"""``cpplan generate --check``'s verdict (cpplan/serve/check.py) on crafted outputs: the served
tokens and logits built here from the model's own teacher-forced forward (a greedy loop written
in this file), then moved where the verdict must pass or fail: a token differing where every
logit is within the tolerance fails; one differing where its logits are beyond it passes only
where rounding is involved and enough positions stay close; logits shifted everywhere fail; each with the reference whole and in chunks of query rows."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cpplan.models import load_model  # noqa: E402
from cpplan.models.reference import teacher_forced_logits  # noqa: E402
from cpplan.serve.check import MIN_CLOSE, TOL, check_outputs  # noqa: E402

PROMPT = (5, 17, 3, 99, 250)  # with NEW tokens below the preset's topk (32): the stock model
NEW = 6


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-deepseek-v32", seed=0)


@pytest.fixture(autouse=True, params=[None, 2], ids=["whole", "chunks-of-2"])
def rows(request, monkeypatch):
    """The reference as the memory free chooses it (every query at once here), and 2 query
    rows at a time (as on a long request): the verdicts must not change."""
    if request.param is not None:
        from cpplan.models import reference

        monkeypatch.setattr(reference, "auto_rows", lambda *a, **k: request.param)
    return request.param


def _served(model, kv: str):
    """(new tokens, their logits): greedy over the model's own forward, one token at a time."""
    tokens = list(PROMPT)
    for _ in range(NEW):
        row = teacher_forced_logits(model, tokens, [len(tokens) - 1], kv_cache_dtype=kv)
        tokens.append(int(row[0].argmax()))
    out = tokens[len(PROMPT):]
    logits = teacher_forced_logits(model, tokens[:-1], range(len(PROMPT) - 1, len(tokens) - 1),
                                   kv_cache_dtype=kv)
    return out, logits


def _check(model, out, logits, kv):
    return check_outputs(model, [PROMPT], [out], [logits], kv, ["r0"])


def _last_token_moved(out, logits, beyond: bool):
    """The last token replaced by the reference's least likely one; with ``beyond`` the served
    logits of that position moved (by more than TOL) so that it is their argmax."""
    out, logits = list(out), logits.clone()
    worst = int(logits[-1].argmin())
    out[-1] = worst
    if beyond:
        logits[-1, worst] = logits[-1].max() + 1.0
    return out, logits


@pytest.mark.parametrize("kv", ["bf16", "fp8_ds_mla"])
def test_the_models_own_tokens_pass(model, kv):
    out, logits = _served(model, kv)
    got = _check(model, out, logits, kv)
    assert got.ok and got.close == got.positions == NEW and got.far_differ == 0, got.line()
    assert got.line().startswith("check OK")


@pytest.mark.parametrize("kv", ["bf16", "fp8_ds_mla"])
def test_a_token_differing_where_the_logits_are_close_fails(model, kv):
    out, logits = _last_token_moved(*_served(model, kv), beyond=False)
    got = _check(model, out, logits, kv)
    assert not got.ok and got.close_differ == 1, got.line()
    assert f"first difference: request 'r0' new token {NEW - 1}: cpplan {out[-1]}" in got.line()


def test_a_token_differing_beyond_the_tolerance_passes_only_with_rounding(model):
    # bf16 KV, every key selected, float32 activations: no rounding, every position must be close
    out, logits = _last_token_moved(*_served(model, "bf16"), beyond=True)
    got = _check(model, out, logits, "bf16")
    assert got.min_close == 1.0 and not got.ok and got.far_differ == 1, got.line()
    assert "check FAILED" in got.line() and "beyond the tolerance" in got.line()
    # fp8 KV: rounding involved; 5 of 6 positions close is above MIN_CLOSE
    out, logits = _last_token_moved(*_served(model, "fp8_ds_mla"), beyond=True)
    got = _check(model, out, logits, "fp8_ds_mla")
    assert got.min_close == MIN_CLOSE and got.ok, got.line()
    assert (got.far_differ, got.close, got.equal) == (1, NEW - 1, NEW - 1), got.line()
    assert "1 differing where the logits are beyond it" in got.line()


def test_logits_shifted_everywhere_fail_with_every_token_equal(model):
    out, logits = _served(model, "fp8_ds_mla")
    got = _check(model, out, logits + 4 * TOL, "fp8_ds_mla")  # every argmax kept
    assert got.equal == got.positions and got.close == 0, got.line()
    assert not got.ok and "check FAILED" in got.line() and f"(needs {MIN_CLOSE:.0%})" in got.line()
