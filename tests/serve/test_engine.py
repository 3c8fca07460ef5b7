"""The serving engine (cpplan/serve/engine.py) on the CPU: decode steps padded to CUDA-graph
sizes (the graphs' static shapes; replayed only on CUDA) give the unpadded run's tokens and
pass ``--check``; one engine serves workload after workload with fresh-engine tokens; a job
that does not fit the engine is refused."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")

from cpplan.models import load_model  # noqa: E402
from cpplan.schemas.errors import UsageError  # noqa: E402
from cpplan.serve.check import check_outputs  # noqa: E402
from cpplan.serve.engine import GenerateJob, graph_sizes, local_engine, serve_local  # noqa: E402

PROMPTS = ((5, 17, 3), tuple(range(40, 130)), (9,), tuple(range(200, 261)))


def _job(model: str, **kw) -> GenerateJob:
    fields = dict(model=model, seed=0, prompts=PROMPTS, max_new_tokens=(5, 4, 6, 3),
                  max_model_len=512, max_num_batched_tokens=64, max_num_seqs=4,
                  num_blocks=40, progress=False, keep_logits=True)
    return GenerateJob(**{**fields, **kw})


_MODELS: dict = {}


def _load(name: str):
    if name not in _MODELS:
        _MODELS[name] = load_model(name, seed=0)
    return name, _MODELS[name]


@pytest.fixture(scope="module", params=["tiny-deepseek-v32", "tiny-glm-5"])
def model(request):
    return _load(request.param)


@pytest.fixture(scope="module")
def glm5():
    """One preset where the test's point does not depend on the model (GLM-5: MoE layers and
    shared-indexer layers both)."""
    return _load("tiny-glm-5")


def test_graph_sizes_cover_every_batch_with_the_smallest_size():
    for n in range(1, 70):
        sizes = graph_sizes(n)
        assert sizes[-1] == n and list(sizes) == sorted(set(sizes))
        for b in range(1, n + 1):  # a batch of b pads to the first size >= b: under 2b
            pad = next(s for s in sizes if s >= b)
            assert b <= pad < 2 * b or pad == n


def test_padded_decode_steps_keep_the_tokens_and_pass_the_check(model):
    name, m = model
    plain = serve_local(m, _job(name))
    padded = serve_local(m, _job(name, cuda_graphs=True))
    assert "error" not in plain and "error" not in padded
    assert padded["graph_steps"] > 0 and plain["graph_steps"] == 0
    assert padded["captures"] == 0  # the CPU runs every step eagerly
    assert padded["outputs"] == plain["outputs"]
    res = check_outputs(m, PROMPTS, padded["outputs"], padded["logits"], "fp8_ds_mla",
                        [str(i) for i in range(len(PROMPTS))])
    assert res.ok, res.line()


def test_graph_keyed_steps_take_the_capturable_experts(glm5, monkeypatch):
    """A CUDA graph cannot capture transformers' default MoE path (it copies from the host):
    the graph-keyed (padded decode-only) steps run the experts by "batched_mm", every other
    step by the model's own default, and the model's setting is restored after each."""
    from transformers.integrations import moe

    name, m = glm5
    default = m.config._experts_implementation
    calls = []
    batched = moe.ALL_EXPERTS_FUNCTIONS["batched_mm"]

    def counting(self, hidden, *args, **kw):
        calls.append(hidden.shape[0])
        return batched(self, hidden, *args, **kw)

    monkeypatch.setitem(moe.ALL_EXPERTS_FUNCTIONS, "batched_mm", counting)
    padded = serve_local(m, _job(name, cuda_graphs=True))
    assert m.config._experts_implementation == default != "batched_mm"
    moe_layers = sum(type(layer.mlp).__name__.endswith("MoE") for layer in m.model.layers)
    assert len(calls) == padded["graph_steps"] * moe_layers > 0
    assert set(calls) <= {1, 2, 4}  # graph sizes of max_num_seqs 4: decode-only rows
    calls.clear()
    serve_local(m, _job(name))
    assert calls == []


def test_one_engine_serves_one_workload_after_another(glm5):
    name, m = glm5
    job = _job(name, cuda_graphs=True)
    engine = local_engine(m, job)
    first = serve_local(m, dataclasses.replace(job, prompts=PROMPTS[:2],
                                               max_new_tokens=(2, 7)), engine)
    again = serve_local(m, job, engine)
    fresh = serve_local(m, job)
    assert "error" not in first and again["outputs"] == fresh["outputs"]
    # greedy: the same prompts' tokens are prefixes of each other (request 1 asks for 7 of 4)
    assert first["outputs"][0] == fresh["outputs"][0][:2]
    assert first["outputs"][1][:4] == fresh["outputs"][1]


def test_a_job_the_engine_was_not_built_for_is_refused(model):
    name, m = model
    engine = local_engine(m, _job(name))
    with pytest.raises(UsageError, match="num_blocks is 41; expected the engine's 40"):
        engine.serve(_job(name, num_blocks=41))


def test_token_times_are_read_once_the_tokens_reach_the_host(glm5, monkeypatch):
    """TTFT / TPOT are stamped after the sampler's host read: on CUDA that read is where the
    step's device work (a long prefill's above all) is waited for. A first step whose read
    takes 2 s (standing in for that wait) must be in every request's TTFT, and each TPOT must
    be the mean interval between the reads that returned the request's tokens (stamped before
    the read, the 2 s would land in the first request's first interval)."""
    import time

    from cpplan.serve import engine

    name, m = glm5
    delay, reads = 2.0, []  # (request indices, time the read returned)
    plain = engine.Sampler.batch

    def slow_first(self, indices, logits):
        if not reads:
            time.sleep(delay)
        out = plain(self, indices, logits)
        reads.append((list(indices), time.monotonic()))
        return out

    monkeypatch.setattr(engine.Sampler, "batch", slow_first)
    res = serve_local(m, _job(name, keep_logits=False))
    assert reads[0][0] and min(res["ttft_s"]) >= delay
    for i, tpot in enumerate(res["tpot_s"]):
        stamps = [t for indices, t in reads if i in indices]
        want = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
        assert abs(tpot - want) < 5e-3, (i, tpot, want)
