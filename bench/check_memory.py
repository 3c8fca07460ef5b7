"""``cpplan generate --check``'s memory at long prompts (issue 66): one request per case served at
P = W = 1, then the check's reference forward (cpplan.serve.check), its peak device memory
measured alone (``torch.cuda.max_memory_allocated`` after a reset).

    python bench/check_memory.py                       # one GPU: 32768- and 9000-token prompts
    python bench/check_memory.py --tokens 131072       # a 141 GB card
    python bench/check_memory.py --tiny --device cpu --tokens 600   # toy sizes, on a CPU

The model is bench/generate.py's (4 layers, hidden 2048, 128 heads, indexer 64 x 128, topk
2048; ``--tiny``: the tiny-deepseek-v32 preset), random weights saved as a checkpoint folder,
float32 (``--check`` wants float32 activations on random models: docs/serving.md),
``max_position_embeddings`` raised to the longest case. Per case: the query rows the
reference computes at once (from the memory free), the check's line, its seconds, its peak
memory and the device's total; a case refused before generation prints the refusal line. One
markdown table to stdout, ``--json`` one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate import BENCH_MODEL  # noqa: E402

from cpplan.schemas.errors import ConfigError  # noqa: E402


def _checkpoint(folder: str, longest: int, tiny: bool) -> None:
    from cpplan.models import build_model, preset_config

    fields = {} if tiny else dict(BENCH_MODEL)
    fields["max_position_embeddings"] = max(longest, 4096)
    build_model(preset_config("tiny-deepseek-v32", **fields), seed=0).save_pretrained(folder)


def _case(folder: str, tokens: int, new: int, device: str) -> dict:
    from cpplan.cli.generate_cmd import _check_memory
    from cpplan.models.reference import auto_rows
    from cpplan.serve.check import check_outputs
    from cpplan.serve.run import prepare, reference_model, serve

    prompts = os.path.join(folder, f"prompts-{tokens}.jsonl")
    ids = torch.randint(1, 500, (tokens,), generator=torch.Generator().manual_seed(tokens))
    with open(prompts, "w") as f:
        f.write(json.dumps({"id": f"p{tokens}", "prompt_token_ids": ids.tolist()}) + "\n")
    args = argparse.Namespace(device=device, dtype="float32")
    row = {"tokens": tokens, "new_tokens": new}
    try:
        prep = prepare(model=folder, prompts_path=prompts, max_new_tokens=new, seed=0,
                       device=device, dtype="float32", keep_logits=True, progress=False,
                       max_num_batched_tokens=2048, before_load=_check_memory(args))
    except ConfigError as exc:
        return {**row, "refused": str(exc)}
    (result,) = serve(prep)
    if result.error is not None:
        return {**row, "error": f"{type(result.error).__name__}: {result.error}"}
    head = result.value
    model = reference_model(prep)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    row["rows_at_once"] = auto_rows(model, tokens + new - 1, new) or tokens + new - 1
    t0 = time.monotonic()
    check = check_outputs(model, prep.job.prompts, head["outputs"], head["logits"],
                          prep.job.kv_cache_dtype, [p.id for p in prep.prompts])
    row.update(check_s=round(time.monotonic() - t0, 2), ok=check.ok, line=check.line())
    if device == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        row["before_gib"] = round(base / 2**30, 2)
        row["device_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    del prep, model
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[32768, 9000])
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny-deepseek-v32 preset's dims")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        _checkpoint(folder, max(a.tokens) + a.new_tokens, a.tiny)
        for n in a.tokens:
            rows.append(_case(folder, n, a.new_tokens, a.device))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    print(f"| prompt tokens | rows at once | check | seconds | peak GiB (before) | {name} |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        verdict = r.get("refused") or r.get("error") or ("OK" if r["ok"] else "FAILED")
        print(f"| {r['tokens']} | {r.get('rows_at_once', '-')} | {verdict} | "
              f"{r.get('check_s', '-')} | {r.get('peak_gib', '-')} ({r.get('before_gib', '-')}) "
              f"| {r.get('device_gib', '-')} |")
    if a.json:
        print(json.dumps({"device": name, "cases": rows}))
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
