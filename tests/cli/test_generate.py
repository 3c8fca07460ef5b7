"""`cpplan generate`: the --json contract, tokens over P x W ranks equal to the 1 x 1 run's and
to the model's own teacher-forced forward (--check) and to its own ``generate`` where topk
covers the contexts, both models (GLM-5's shared-indexer layers), chunked prefill, mixed
steps, a preemption, seeded sampling, text prompts through a checkpoint's tokenizer, a lost
rank (exit 4), and every bad input as one line with exit code 2.

One spawned 2-rank gloo world serves most multi-rank runs (2x2, 1x2, 2x1: max(P, W) = 2);
1 x 1 runs in this process with one torch thread (the CLI's own threads are the host's)."""

import json

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from cpplan.serve.check import check_outputs  # noqa: E402
from cpplan.serve.run import prepare, serve  # noqa: E402
from tests.cli.inprocess import run_cli  # noqa: E402

MODEL = "tiny-deepseek-v32"
# 1 and 3 tokens (q < 2P), 70 (above topk 32: cpplan's indexer numerics), 140 (chunked under
# the budget of 64, and the longest context)
LENGTHS = (1, 3, 70, 140)
NEW = 4
BUDGET = 64


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    import numpy as np

    rng = np.random.default_rng(3)
    path = tmp_path_factory.mktemp("gen") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{n}", "prompt_token_ids":
                                        rng.integers(0, 512, n).tolist()}) + "\n"
                            for n in LENGTHS))
    return path


@pytest.fixture(scope="module")
def world():
    from cpplan.sim.launch import World

    w = World(2, timeout_s=120.0)
    yield w
    w.close()


def _run(prompts_file, world=None, **kw):
    """(prepared, rank 0's result) of one run; every rank's tokens must agree."""
    kw.setdefault("kv_cache_dtype", "bf16")
    prep = prepare(model=MODEL, prompts_path=str(prompts_file), max_new_tokens=NEW, seed=0,
                   max_num_batched_tokens=BUDGET, keep_logits=True, progress=False, **kw)
    results = serve(prep, world)
    for r in results:
        assert r.ok and "error" not in r.value, (r.error, r.value.get("error"))
    outs = [r.value["outputs"] for r in results]
    assert all(o == outs[0] for o in outs), outs
    return prep, results[0].value


_BASE = {}


def _base(prompts_file, kv):
    """The 1 x 1 run of the prompts (cached per KV format)."""
    if kv not in _BASE:
        _BASE[kv] = _run(prompts_file, kv_cache_dtype=kv)
    return _BASE[kv]


def test_json_output_shape_and_check(prompts_file):
    res = run_cli("generate", "--model", MODEL, "--prompts", prompts_file, "--max-new-tokens",
                  NEW, "--max-num-batched-tokens", BUDGET, "--check", "--json")
    assert res.code == 0, res.stderr
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    assert len(lines) == len(LENGTHS) + 1
    assert [x["id"] for x in lines[:-1]] == [f"p{n}" for n in LENGTHS]  # input order
    for x in lines[:-1]:
        assert len(x["output_token_ids"]) == NEW and x["ttft_s"] > 0 and x["tpot_s"] >= 0
    s = lines[-1]
    assert {"ok", "steps", "collectives", "digest_checks"} <= set(s)
    assert s["ok"] is True and s["check"]["tokens_equal"] == len(LENGTHS) * NEW
    assert s["collectives"] == 0 and s["digest_checks"] == 0  # one process: no peers
    assert s["mixed_steps"] > 0  # decodes of the short prompts beside the long one's chunks
    assert "check OK" in res.stderr
    _, base = _base(prompts_file, "fp8_ds_mla")
    assert [x["output_token_ids"] for x in lines[:-1]] == base["outputs"]


@pytest.mark.parametrize("kv", ["bf16", "fp8_ds_mla"])
def test_the_1x1_tokens_equal_the_models_own_forward(prompts_file, kv):
    prep, base = _base(prompts_file, kv)
    got = check_outputs(prep.model, prep.job.prompts, base["outputs"], base["logits"], kv,
                        [p.id for p in prep.prompts])
    assert got.ok and got.ties == 0, got.line()
    assert got.close >= (1.0 if kv == "bf16" else 0.85) * got.positions, got.line()
    steps_140 = -(-140 // BUDGET)
    assert base["steps"] >= steps_140 + NEW - 1  # the long prompt was chunked


@pytest.mark.parametrize("pcp,dcp,inter,kv", [(2, 2, 1, "fp8_ds_mla"), (1, 2, 1, "bf16"),
                                              (2, 1, 1, "fp8_ds_mla"), (2, 2, 2, "bf16")])
def test_tokens_over_ranks_equal_the_1x1_run(prompts_file, world, pcp, dcp, inter, kv):
    _, base = _base(prompts_file, kv)
    _, got = _run(prompts_file, world, pcp=pcp, dcp=dcp, interleave=inter, kv_cache_dtype=kv)
    assert got["outputs"] == base["outputs"]
    assert got["digest_checks"] == got["steps"] and got["collectives"] > 0
    diff = max(float((a - b).abs().max()) for a, b in zip(got["logits"], base["logits"]))
    assert diff < 5e-2, diff


def test_a_preemption_keeps_the_tokens(tmp_path, world):
    import numpy as np

    rng = np.random.default_rng(4)
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{k}", "prompt_token_ids":
                                        rng.integers(0, 512, n).tolist()}) + "\n"
                            for k, n in enumerate((126, 126, 5))))
    _, base = _run(path)  # blocks for every request at once: no preemption
    assert base["preempted"] == 0
    # 131 tokens take 3 blocks of 64 at W = 1, 2 at W = 2 (66 rows a rank): with 3 (W = 1)
    # or 2 (W = 2) blocks a rank, a running request's next block evicts a later one
    _, got = _run(path, num_blocks=4)
    assert got["preempted"] > 0 and got["outputs"] == base["outputs"]
    _, got2 = _run(path, world, pcp=1, dcp=2, num_blocks=3)
    assert got2["preempted"] > 0 and got2["outputs"] == base["outputs"]


def _save_checkpoint(folder):
    from cpplan.models import load_model

    load_model(MODEL).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _save_checkpoint(tmp_path_factory.mktemp("ckpt"))


def _one_line(res, *needles):
    assert res.code == 2, (res.code, res.stderr)
    assert res.stdout == ""  # nothing half written
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cpplan generate: error:"), res.stderr
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_a_checkpoint_folder_serves_like_the_preset(checkpoint, prompts_file):
    res = run_cli("generate", "--model", checkpoint, "--prompts", prompts_file,
                  "--max-new-tokens", 2, "--max-num-batched-tokens", BUDGET, "--json")
    assert res.code == 0, res.stderr
    _, base = _base(prompts_file, "fp8_ds_mla")
    got = [json.loads(x)["output_token_ids"] for x in res.stdout.splitlines()[:-1]]
    assert got == [o[:2] for o in base["outputs"]]


@pytest.mark.parametrize("field,value", [("kv_lora_rank", 256), ("index_head_dim", 64)])
def test_a_checkpoint_the_runtime_cannot_serve(checkpoint, tmp_path, field, value):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg[field] = value
    (bad / "config.json").write_text(json.dumps(cfg))
    _one_line(run_cli("generate", "--model", bad, "--max-new-tokens", 2), field, str(value))


@pytest.mark.parametrize("how", ["missing", "truncated"])
def test_missing_or_truncated_weights(checkpoint, tmp_path, how):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    (weights,) = bad.glob("*.safetensors")
    if how == "missing":
        weights.unlink()
    else:
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    _one_line(run_cli("generate", "--model", bad, "--max-new-tokens", 2), str(bad))


@pytest.mark.parametrize("content,needle", [
    ("", "no prompts"),
    ('{"id": "a", "prompt_token_ids": [1, 2]}\n{"id": "b", "prompt_token_ids": [1,\n',
     "line 2"),
    ('{"id": "a", "prompt_token_ids": [1, 512]}\n', "token id 512 is outside the vocabulary"),
    ('{"id": "a", "prompt_token_ids": [-1]}\n', "token id -1"),
    ('{"id": "a", "prompt_token_ids": ' + json.dumps([5] * 60) + "}\n", "max_model_len 64"),
    ('{"id": "a", "prompt": "hello"}\n', "tokenizer"),
    ('[1, 2]\n', "line 1"),
    ('{"prompt_token_ids": [1], "prompt": "a"}\n', "expected one"),
    ('{"prompt_token_ids": [1], "temperature": 1}\n', "unknown key 'temperature'"),
    ('{"id": "a", "prompt_token_ids": [1]}\n{"id": "a", "prompt_token_ids": [2]}\n',
     "line 2: id 'a' repeats"),
    ('{"prompt_token_ids": []}\n', "empty"),
    ('{"prompt_token_ids": [1.5]}\n', "list of integers"),
])
def test_bad_prompts_are_one_line(tmp_path, content, needle):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    _one_line(run_cli("generate", "--model", MODEL, "--prompts", path, "--max-model-len", 64,
                      "--max-new-tokens", 8), needle)


def test_missing_transformers_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    _one_line(run_cli("generate", "--model", MODEL), 'pip install "torch==2.13.0" -e '
              '".[runtime,cli,hf]"')


def test_glm5_shared_indexer_layers_over_2x2(prompts_file, world):
    """GLM-5's shared-indexer layers (pattern F, S, F, S) through the runtime's sources."""
    kw = dict(model="tiny-glm-5", prompts_path=str(prompts_file), max_new_tokens=NEW, seed=0,
              max_num_batched_tokens=BUDGET, keep_logits=True, progress=False,
              kv_cache_dtype="fp8_ds_mla")
    one = prepare(**kw)
    assert one.model.config.indexer_types == ["full", "shared", "full", "shared"]
    (base,) = serve(one)
    many = serve(prepare(**kw, pcp=2, dcp=2), world)
    assert all(r.ok and "error" not in r.value for r in many)
    assert many[0].value["outputs"] == base.value["outputs"]
    got = check_outputs(one.model, one.job.prompts, base.value["outputs"],
                        base.value["logits"], "fp8_ds_mla", [p.id for p in one.prompts])
    assert got.ok, got.line()


def test_tokens_equal_the_models_own_generate_where_topk_covers(tmp_path, prompts_file):
    from cpplan.models import build_model, preset_config
    from cpplan.models.reference import reference_generate

    model = build_model(preset_config(MODEL, index_topk=256), seed=0)  # above every context
    model.save_pretrained(tmp_path / "ckpt")
    res = run_cli("generate", "--model", tmp_path / "ckpt", "--prompts", prompts_file,
                  "--max-new-tokens", NEW, "--max-num-batched-tokens", BUDGET,
                  "--kv-cache-dtype", "bf16", "--check", "--json")
    assert res.code == 0, res.stderr
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    assert "4 request(s) against the stock model" in res.stderr
    prompts = [json.loads(x)["prompt_token_ids"] for x in prompts_file.read_text().splitlines()]
    for prompt, row in zip(prompts, lines[:-1]):
        want = reference_generate(model, prompt, NEW, kv_cache_dtype="bf16")
        assert row["output_token_ids"] == want, row["id"]


def test_text_prompts_with_the_checkpoints_tokenizer(checkpoint, tmp_path):
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint, folder)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(folder)
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "t", "prompt": "w5 w7 w9"}\n'
                    '{"id": "i", "prompt_token_ids": [5, 7, 9]}\n')
    res = run_cli("generate", "--model", folder, "--prompts", path, "--max-new-tokens", 3,
                  "--json")
    assert res.code == 0, res.stderr
    t, i, _ = (json.loads(x) for x in res.stdout.splitlines())
    assert t["output_token_ids"] == i["output_token_ids"]  # the text is those three ids
    assert t["output_text"] == " ".join(f"w{k}" for k in t["output_token_ids"])


def test_sampling_is_seeded_and_the_same_on_every_rank(prompts_file, world):
    kw = dict(kv_cache_dtype="bf16", temperature=1.0, top_p=0.9)
    _, one = _run(prompts_file, **kw)
    _, again = _run(prompts_file, **kw)
    _, many = _run(prompts_file, world, pcp=2, dcp=2, **kw)  # ranks' draws agree (_run)
    _, greedy = _base(prompts_file, "bf16")
    assert one["outputs"] == again["outputs"] == many["outputs"] != greedy["outputs"]


def test_cuda_without_a_gpu_or_with_too_few_is_one_line():
    if torch.cuda.is_available():
        n = torch.cuda.device_count() + 1
        _one_line(run_cli("generate", "--device", "cuda", "--pcp", n), "one GPU per rank")
    else:
        _one_line(run_cli("generate", "--device", "cuda"), "no CUDA device")


@pytest.mark.slow
def test_tokens_over_3x3_ranks_equal_the_1x1_run(prompts_file):

    _, base = _base(prompts_file, "fp8_ds_mla")
    _, got = _run(prompts_file, pcp=3, dcp=3, interleave=2, kv_cache_dtype="fp8_ds_mla")
    assert got["outputs"] == base["outputs"] and got["digest_checks"] == got["steps"]


def test_the_command_spawns_its_own_2x2_world():
    """The built-in prompts (1 to 300 tokens: q < 2P, chunks of the long one) at 2 x 2, with
    --check against the model's own forward."""
    res = run_cli("generate", "--model", MODEL, "--max-new-tokens", 2, "--pcp", 2, "--dcp", 2,
                  "--max-num-batched-tokens", 128, "--check", "--json")
    assert res.code == 0, res.stderr
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    assert [x["prompt_tokens"] for x in lines[:-1]] == [1, 3, 17, 64, 130, 300]
    s = lines[-1]
    assert s["ok"] and s["check"]["tokens_equal"] == 12 and s["check"]["near_ties"] == 0
    assert s["digest_checks"] == s["steps"] and s["collectives"] > 0
    assert (s["pcp"], s["dcp"]) == (2, 2) and s["mixed_steps"] > 0


@pytest.mark.slow
def test_a_lost_rank_ends_the_run_with_exit_4(prompts_file, capsys):
    """Rank 1 exits at step 2: the run ends within the timeout, one line a rank, exit 4."""
    import dataclasses

    from cpplan.cli.generate_cmd import _failures

    prep = prepare(model=MODEL, prompts_path=str(prompts_file), max_new_tokens=NEW, seed=0,
                   max_num_batched_tokens=BUDGET, progress=False, pcp=2, dcp=2, timeout_s=5.0)
    prep.job = dataclasses.replace(prep.job, kill=(2, 1))
    code = _failures(serve(prep), as_json=True)
    err = capsys.readouterr()
    assert code == 4, err
    assert "rank 1 lost" in err.err and json.loads(err.out)["exit_code"] == 4
    assert "Traceback" not in err.err and len(err.err.strip().splitlines()) <= 2


@pytest.mark.slow
def test_as_ranks_of_a_torchrun_world(prompts_file):
    """Two torchrun ranks (gloo): rank 0 alone prints, tokens as the 1 x 1 run's."""
    from tests.dist.test_torchrun import torchrun

    proc = torchrun(2, "-m", "cpplan", "generate", "--model", MODEL, "--prompts",
                    prompts_file, "--max-new-tokens", NEW, "--max-num-batched-tokens", BUDGET,
                    "--pcp", 2, "--dcp", 2, "--json")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert len(lines) == len(LENGTHS) + 1, proc.stdout  # rank 0 alone
    _, base = _base(prompts_file, "fp8_ds_mla")
    assert [x["output_token_ids"] for x in lines[:-1]] == base["outputs"]
    assert lines[-1]["digest_checks"] == lines[-1]["steps"] and lines[-1]["collectives"] > 0


@pytest.mark.parametrize("rank", [0, 1])
def test_a_torchrun_world_of_the_wrong_size_is_one_line_from_rank_0(monkeypatch, rank):
    """A rank of a 2-rank torchrun world asked for P = W = 3: exit 2 before the model is
    built, the line from rank 0 alone (the check reads torchrun's variables only, so it runs
    here in-process with them set)."""
    for name, value in (("RANK", rank), ("WORLD_SIZE", 2), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, str(value))
    res = run_cli("generate", "--model", MODEL, "--pcp", 3, "--dcp", 3)
    if rank == 0:
        _one_line(res, "torchrun's world has 2 rank(s)", "needs max(P, W) = 3")
    else:
        assert (res.code, res.stdout, res.stderr) == (2, "", "")


@pytest.mark.parametrize("rows", [None, 5])
@pytest.mark.parametrize("wrong", ["mla-rope", "sm-scale"])
def test_check_fails_when_the_forward_is_wrong(prompts_file, monkeypatch, wrong, rows):
    """--check is a real reference: a wrong RoPE convention or softmax scale in the serving
    side (the reference is the model's own forward, untouched) exits 1 with one line; also
    with the reference computed 5 query rows at a time (as where memory is short)."""
    from cpplan.models import derive, reference

    if rows is not None:
        monkeypatch.setattr(reference, "auto_rows", lambda *a, **k: rows)

    if wrong == "mla-rope":
        monkeypatch.setitem(derive.ROPE, "deepseek_v32", ("half", "half"))
    else:
        scale = derive.softmax_scale
        monkeypatch.setattr(derive, "softmax_scale", lambda config: 1.5 * scale(config))
    res = run_cli("generate", "--model", MODEL, "--prompts", prompts_file, "--max-new-tokens",
                  NEW, "--max-num-batched-tokens", BUDGET, "--check", "--json")
    assert res.code == 1, res.stderr
    assert json.loads(res.stdout.splitlines()[-1])["ok"] is False
    failed = [x for x in res.stderr.splitlines() if x.startswith("check FAILED")]
    assert len(failed) == 1 and "first difference" in failed[0]


def test_check_refused_before_the_weights_load_where_memory_is_short(prompts_file, monkeypatch):
    """Where the reference of the longest request cannot fit one query row beside its weights,
    --check is one line, exit 2, before the weights load or a token is generated."""
    from cpplan.models import loading, memory

    monkeypatch.setattr(memory, "free_bytes", lambda device: 1 << 20)

    def never(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(loading, "load_model", never)
    res = run_cli("generate", "--model", MODEL, "--prompts", prompts_file, "--max-new-tokens",
                  NEW, "--check")
    _one_line(res, "--check: the reference forward over request 'p140' (143 tokens)",
              "GiB free")
    assert run_cli("generate", "--model", MODEL, "--prompts", prompts_file, "--max-new-tokens",
                   NEW).code == 99  # without --check nothing is refused: it reaches the stub load


def test_an_out_of_memory_error_in_the_check_is_one_line_exit_5(prompts_file, monkeypatch):
    from cpplan.serve import check

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 38.72 GiB\nmore")

    monkeypatch.setattr(check, "check_outputs", oom)
    res = run_cli("generate", "--model", MODEL, "--prompts", prompts_file, "--max-new-tokens",
                  NEW, "--check")
    assert res.code == 5 and "Traceback" not in res.stderr, res.stderr
    errors = [x for x in res.stderr.splitlines() if "error:" in x]
    assert errors == ["cpplan generate: error: --check's reference: OutOfMemoryError: CUDA out "
                      "of memory. Tried to allocate 38.72 GiB"], res.stderr
