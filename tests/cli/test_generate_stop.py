"""`cpplan generate` stops where transformers' own `generate` does: at the model's
end-of-sequence ids (generation_config.json over config.json), at a line's own
``stop_token_ids``, else after ``max_tokens``; over 2 x 2 gloo ranks as in one process.

References, each written apart from the code under test: the same run with ``ignore_eos``
cut after its first stop token (a naive loop here), transformers' own ``generate`` of the
checkpoint (which stops at its eos), and the 1 x 1 run. The checkpoint is the tiny preset
with a top-k above every context (so the stock model is the reference) and, in its
generation_config.json, three eos ids found by running the prompts once without them: two
requests emit one at their fifth token, in the same step as the last chunk of a 300-token
prompt's chunked prefill; a request preempted after two tokens emits one as the first token
after it is recomputed; a waiting request is admitted in the step after a stop."""

import json

import pytest

pytest.importorskip("transformers")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from cpplan.serve.run import prepare, serve  # noqa: E402
from tests.cli.inprocess import run_cli  # noqa: E402

NEW, BUDGET = 8, 64
# found by one ignore-eos run of the prompts below (asserted again in _check_the_eos_ids)
EOS = [508, 384, 16]
OWN_STOP = 467  # request "d"'s own stop_token_ids: its third token
# workload A: two short prompts decode side by side, a 300-token one chunk-prefilled (its
# chunks of 57, 62, 62, 62 and 57 tokens: the last at step 4, beside the two stopping), a
# fourth waiting for a slot (max_num_seqs 3)
A_LENGTHS, A_SEED, A_SEQS = (2, 5, 300, 9), 11, 3
# workload B (tests/cli/test_generate.py's preemption prompts): with 4 blocks a rank at
# 1 x 1 and 5 at W = 2, request 2 is preempted after 2 tokens; its third is an eos id
B_LENGTHS, B_SEED, B_BLOCKS = (126, 126, 5), 4, {1: 4, 2: 5}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from cpplan.models import build_model, preset_config

    folder = tmp_path_factory.mktemp("stop") / "ckpt"
    build_model(preset_config("tiny-deepseek-v32", index_topk=512), seed=0).save_pretrained(
        folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = EOS
    (folder / "generation_config.json").write_text(json.dumps(gen))
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == 1  # not read
    return folder


def _prompts(folder, name, lengths, seed, own=None):
    rng = np.random.default_rng(seed)
    lines = []
    for k, n in enumerate(lengths):
        line = {"id": "abcd"[k], "prompt_token_ids": rng.integers(0, 512, n).tolist()}
        if own is not None and k == own:
            line["stop_token_ids"] = [OWN_STOP]
        lines.append(line)
    path = folder.parent / f"{name}.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path, lines


@pytest.fixture(scope="module")
def world():
    from cpplan.sim.launch import World

    w = World(2, timeout_s=120.0)
    yield w
    w.close()


def _run(checkpoint, path, world=None, **kw):
    kw.setdefault("max_num_seqs", A_SEQS)
    prep = prepare(model=str(checkpoint), prompts_path=str(path), max_new_tokens=NEW, seed=0,
                   max_num_batched_tokens=BUDGET, kv_cache_dtype="bf16", progress=False,
                   **kw)
    results = serve(prep, world)
    for r in results:
        assert r.ok and "error" not in r.value, (r.error, r.value.get("error"))
    assert all(r.value["outputs"] == results[0].value["outputs"] for r in results)
    return prep, results[0].value


def _cut(output, stop):
    """The naive reference: ``output`` up to and including its first stop token."""
    for k, t in enumerate(output):
        if t in stop:
            return output[: k + 1], "stop"
    return output, "length"


def _check_the_eos_ids(full, where):
    """The ignore-eos run emits each chosen id where the test needs it, and no earlier."""
    for k, j in where:
        assert full[k][j] in EOS and not set(full[k][:j]) & set(EOS), (k, full[k])


def test_eos_comes_from_generation_config_then_config(checkpoint, tmp_path):
    import shutil

    from cpplan.models import load_model
    from cpplan.models.loading import eos_token_ids

    assert eos_token_ids(str(checkpoint)) == tuple(EOS)
    assert load_model(str(checkpoint)).generation_config.eos_token_id == EOS  # transformers'
    bare = tmp_path / "bare"
    shutil.copytree(checkpoint, bare)
    (bare / "generation_config.json").unlink()
    cfg = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 7}))
    assert eos_token_ids(str(bare)) == (7,)
    assert eos_token_ids("tiny-glm-5") == (1,)  # the preset's config


def test_stops_over_2x2_equal_the_1x1_run_the_naive_cut_and_transformers(checkpoint, world):
    from cpplan.models.reference import reference_generate

    path, lines = _prompts(checkpoint, "a", A_LENGTHS, A_SEED, own=3)
    _, full = _run(checkpoint, path, ignore_eos=True)
    _check_the_eos_ids(full["outputs"], [(0, 4), (1, 4)])
    assert full["outputs"][3][2] == OWN_STOP and full["finish_reasons"] == ["length"] * 3 + [
        "stop"]  # under --ignore-eos a line's own stop ids still stop it
    prep, one = _run(checkpoint, path)
    _, many = _run(checkpoint, path, world, pcp=2, dcp=2)
    for k, line in enumerate(lines):
        stop = set(EOS) | set(line.get("stop_token_ids", ()))
        want, reason = _cut(full["outputs"][k], stop)
        assert (one["outputs"][k], one["finish_reasons"][k]) == (want, reason), k
        hf = reference_generate(prep.model, line["prompt_token_ids"], NEW, kv_cache_dtype="bf16",
                                stop=True, stop_token_ids=line.get("stop_token_ids", ()))
        assert one["outputs"][k] == hf, k
    assert one["finish_reasons"] == ["stop", "stop", "length", "stop"]
    for key in ("outputs", "finish_reasons", "first_steps", "finish_steps"):
        assert many[key] == one[key], key  # the same steps on every rank and topology
    a, b = one["finish_steps"][:2]
    # the same step, beside the long prompt's last chunk (after 57 + 3 x 62 of its tokens)
    assert a == b == 4 and one["first_steps"][2] == 0 and 57 + 3 * 62 < A_LENGTHS[2]
    assert one["first_steps"][3] == a + 1  # the waiting request takes a freed slot at once
    assert many["digest_checks"] == many["steps"] and many["collectives"] > 0


def test_a_request_stops_right_after_its_preemption_over_2x2(checkpoint, world):
    from cpplan.models.reference import reference_generate

    path, lines = _prompts(checkpoint, "b", B_LENGTHS, B_SEED)
    _, full = _run(checkpoint, path, ignore_eos=True, num_blocks=B_BLOCKS[1], max_num_seqs=64)
    _check_the_eos_ids(full["outputs"], [(2, 2)])
    prep, one = _run(checkpoint, path, num_blocks=B_BLOCKS[1], max_num_seqs=64)
    _, many = _run(checkpoint, path, world, pcp=2, dcp=2, num_blocks=B_BLOCKS[2],
                   max_num_seqs=64)
    for got in (one, many):
        assert got["preemptions"][2] >= 1 and got["finish_reasons"] == ["length", "length",
                                                                         "stop"]
        assert got["outputs"] == [_cut(o, set(EOS))[0] for o in full["outputs"]]
    assert many["outputs"][2] == reference_generate(prep.model, lines[2]["prompt_token_ids"],
                                                    NEW, kv_cache_dtype="bf16", stop=True)


def test_the_json_lines_say_why_each_request_finished(checkpoint):
    path, _ = _prompts(checkpoint, "a", A_LENGTHS, A_SEED, own=3)
    args = ("generate", "--model", checkpoint, "--prompts", path, "--max-new-tokens", NEW,
            "--max-num-batched-tokens", BUDGET, "--max-num-seqs", A_SEQS, "--kv-cache-dtype",
            "bf16", "--json")
    res = run_cli(*args)
    assert res.code == 0, res.stderr
    *rows, summary = (json.loads(x) for x in res.stdout.splitlines())
    assert [r["finish_reason"] for r in rows] == ["stop", "stop", "length", "stop"]
    assert [len(r["output_token_ids"]) for r in rows] == [5, 5, NEW, 3]
    assert summary["stopped"] == 3 and summary["output_tokens"] == 5 + 5 + NEW + 3
    res = run_cli(*args, "--ignore-eos")
    assert res.code == 0, res.stderr
    rows = [json.loads(x) for x in res.stdout.splitlines()[:-1]]
    assert [r["finish_reason"] for r in rows] == ["length"] * 3 + ["stop"]
