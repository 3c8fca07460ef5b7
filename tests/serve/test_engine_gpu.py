"""The serving engine's CUDA graphs on one GPU (skipped without CUDA): decode steps replayed
from captured graphs give the eager run's tokens and pass ``--check`` (float32 activations),
and equal the same padded steps run eagerly bit for bit (bf16); a second workload on the same
engine captures nothing new."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from cpplan.models import load_model  # noqa: E402
from cpplan.serve.check import check_outputs  # noqa: E402
from cpplan.serve.engine import GenerateJob, local_engine, serve_local  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ((5, 17, 3), tuple(range(40, 130)), (9,), tuple(range(200, 261)), (7, 7))
PRESETS = ["tiny-deepseek-v32", "tiny-glm-5"]


def _job(model: str, dtype: str, **kw) -> GenerateJob:
    fields = dict(model=model, seed=0, prompts=PROMPTS, max_new_tokens=(5, 4, 9, 3, 6),
                  max_model_len=512, max_num_batched_tokens=64, max_num_seqs=5,
                  num_blocks=48, progress=False, keep_logits=True, device="cuda", dtype=dtype)
    return GenerateJob(**{**fields, **kw})


def _replays(engine) -> int:
    return sum(c.replays for c in engine.graphs.captured.values())


@pytest.mark.parametrize("name", PRESETS)
def test_replayed_decodes_give_the_eager_tokens_and_pass_the_check(name):
    model = load_model(name, seed=0, dtype=torch.float32, device="cuda")
    job = _job(name, "float32", cuda_graphs=True)
    engine = local_engine(model, job)
    first = serve_local(model, job, engine)
    again = serve_local(model, job, engine)
    eager = serve_local(model, _job(name, "float32"))
    for res in (first, again, eager):
        assert "error" not in res, res.get("tb")
    assert first["captures"] > 0 and again["captures"] == 0 and again["graph_steps"] > 0
    assert _replays(engine) >= again["graph_steps"]
    assert first["outputs"] == again["outputs"] == eager["outputs"]
    res = check_outputs(model, PROMPTS, again["outputs"], again["logits"], "fp8_ds_mla",
                        [str(i) for i in range(len(PROMPTS))])
    assert res.ok, res.line()


@pytest.mark.parametrize("name", PRESETS)
def test_bf16_replays_equal_the_padded_eager_steps_bit_for_bit(name):
    model = load_model(name, seed=0, dtype=torch.bfloat16, device="cuda")
    job = _job(name, "bfloat16", cuda_graphs=True)
    engine = local_engine(model, job)
    serve_local(model, job, engine)  # captures every key this workload meets
    replayed = serve_local(model, job, engine)
    plain = local_engine(model, job)
    plain.graphs.enabled = False  # the same padded steps and body, eagerly
    eager = serve_local(model, job, plain)
    assert replayed["captures"] == 0 and replayed["graph_steps"] > 0
    assert replayed["outputs"] == eager["outputs"]
    for a, b in zip(replayed["logits"], eager["logits"]):
        assert torch.equal(a, b), float((a - b).abs().max())


def test_a_workload_of_other_prompts_reuses_the_graphs():
    name = PRESETS[0]
    model = load_model(name, seed=0, dtype=torch.float32, device="cuda")
    job = _job(name, "float32", cuda_graphs=True)
    engine = local_engine(model, job)
    serve_local(model, job, engine)
    other = dataclasses.replace(job, prompts=tuple(p[::-1] for p in PROMPTS))
    got = serve_local(model, other, engine)
    fresh = serve_local(model, dataclasses.replace(other, cuda_graphs=False))
    assert got["outputs"] == fresh["outputs"]
    assert got["graph_steps"] > 0 and got["captures"] == 0  # same lengths: same keys
