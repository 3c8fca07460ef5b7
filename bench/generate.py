"""cpplan generate against transformers' own generate: the same random-weight model, the same
prompts, the same device, one run (docs/design.md §4.5).

    python bench/generate.py                      # H200: 4-layer DeepseekV32, hidden 2048,
                                                  # 128 heads, indexer 64 x 128, topk 2048
    python bench/generate.py --tiny               # toy sizes (runs on a CPU)
    python bench/generate.py --skip-hf --batch 64 --context 4096

Cases (``--context`` tokens of prompt each, ``--new-tokens`` greedy tokens): transformers'
``generate`` (bf16, sdpa attention; its indexer and mask are dense over the context) at
``--hf-batch`` requests, then ``cpplan.serve`` (P = W = 1 on this device, fp8_ds_mla KV,
chunked prefill under ``--max-num-batched-tokens``) at ``--batch`` requests, eagerly and
(on CUDA) with decode steps replayed as CUDA graphs, each after an untimed warm-up run
(kernels compiled, allocator warm; cpplan's on the same engine, so its graphs are captured). Per case: TTFT
(prompt to first token) and TPOT (mean time between later tokens), medians over requests,
tokens/s, peak device memory; the ratios cpplan / transformers last. A transformers case that
runs out of memory is reported as such. Writes a markdown table to stdout, ``--json`` one JSON
object as the last line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch

from cpplan.models import build_model, preset_config
from cpplan.serve.engine import GenerateJob, local_engine, serve_local

BENCH_MODEL = dict(hidden_size=2048, num_attention_heads=128, num_key_value_heads=128,
                   q_lora_rank=1536, qk_nope_head_dim=128, v_head_dim=128,
                   index_n_heads=64, index_topk=2048, n_routed_experts=8,
                   num_experts_per_tok=2, intermediate_size=4096, moe_intermediate_size=1024,
                   num_hidden_layers=4, vocab_size=32000, initializer_range=0.02,
                   max_position_embeddings=32768)
TINY_MODEL = dict(num_hidden_layers=2, index_topk=64, max_position_embeddings=4096)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _peak_gib(device) -> float:
    if torch.device(device).type != "cuda":
        return 0.0
    return torch.cuda.max_memory_allocated() / 2**30


def _reset_peak(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def bench_hf(model, prompts: torch.Tensor, new_tokens: int, device) -> dict:
    """transformers' generate: TTFT = one new token's call; TPOT from the full call."""
    _reset_peak(device)
    with torch.inference_mode():
        try:
            kw = dict(attention_mask=torch.ones_like(prompts), pad_token_id=0, do_sample=False)
            warm = prompts[:, :64]  # warm-up: kernels and allocator, not timed
            model.generate(warm, max_new_tokens=2, attention_mask=torch.ones_like(warm),
                           pad_token_id=0, do_sample=False)
            _sync(device)
            t0 = time.perf_counter()
            model.generate(prompts, max_new_tokens=1, min_new_tokens=1, **kw)
            _sync(device)
            t1 = time.perf_counter()
            out = model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 **kw)
            _sync(device)
            t2 = time.perf_counter()
        except torch.OutOfMemoryError:
            return {"oom": True, "peak_gib": _peak_gib(device)}
    ttft, total = t1 - t0, t2 - t1
    tpot = (total - ttft) / max(new_tokens - 1, 1)
    n = prompts.shape[0] * new_tokens
    return {"ttft_s": ttft, "tpot_s": tpot, "tokens_per_s": n / total,
            "peak_gib": _peak_gib(device), "tokens": out[:, prompts.shape[1]:].tolist()}


def bench_cpplan(model, prompts: list[list[int]], new_tokens: int, args, *,
                 graphs: bool) -> dict:
    """cpplan.serve at P = W = 1 on the device, one engine (executor, caches, graphs) for a
    warm-up workload and then the timed one, as a long-lived server: per-request TTFT / TPOT
    from the engine. The warm-up (not timed) is the same prompts with 2 new tokens: every
    kernel variant compiled, and with ``graphs`` the decode steps' graph keys captured (the
    timed run's decodes have the same batch and key-block bucket; its captures are counted)."""
    blocks = 1 + len(prompts) * -(-(len(prompts[0]) + new_tokens) // 64)
    job = GenerateJob(model="bench", seed=0, prompts=tuple(tuple(p) for p in prompts),
                      max_new_tokens=(new_tokens,) * len(prompts),
                      max_model_len=len(prompts[0]) + new_tokens,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      max_num_seqs=max(len(prompts), 1), num_blocks=blocks,
                      device=args.device, progress=False, cuda_graphs=graphs)
    _reset_peak(args.device)
    with torch.inference_mode():
        engine = local_engine(model, job)
        warm = serve_local(model, dataclasses.replace(job, max_new_tokens=(2,) * len(prompts)),
                           engine)
        if "error" in warm:
            raise warm["error"]
        _sync(args.device)
        t0 = time.perf_counter()
        res = serve_local(model, job, engine)
        _sync(args.device)
        seconds = time.perf_counter() - t0
    if "error" in res:
        raise res["error"]
    del engine
    return {"ttft_s": statistics.median(res["ttft_s"]), "tpot_s": statistics.median(res["tpot_s"]),
            "tokens_per_s": len(prompts) * new_tokens / seconds, "peak_gib": _peak_gib(args.device),
            "steps": res["steps"], "graph_steps": res["graph_steps"],
            "captures": res["captures"], "warmup_captures": warm["captures"],
            "tokens": res["outputs"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=16384, help="prompt tokens (default 16384)")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens generated (default 32)")
    ap.add_argument("--batch", type=int, default=1, help="cpplan's requests (default 1)")
    ap.add_argument("--hf-batch", type=int, default=None,
                    help="transformers' requests (default --batch)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--skip-hf", action="store_true", help="cpplan only")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="toy sizes (runs on a CPU)")
    ap.add_argument("--no-eager", action="store_true",
                    help="skip cpplan's eager case (on CUDA both eager and CUDA graphs run)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    fields = dict(BENCH_MODEL, **(TINY_MODEL if args.tiny else {}))
    if args.tiny:
        fields.update(hidden_size=256, num_attention_heads=8, num_key_value_heads=8,
                      q_lora_rank=128, index_n_heads=4, vocab_size=512, intermediate_size=512,
                      moe_intermediate_size=128, n_routed_experts=4)
    dtype = torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32
    model = build_model(preset_config("tiny-deepseek-v32", **fields), seed=0, dtype=dtype,
                        device=args.device)
    gen = torch.Generator().manual_seed(1)
    hf_batch = args.hf_batch or args.batch
    ids = torch.randint(0, fields["vocab_size"], (max(args.batch, hf_batch), args.context),
                        generator=gen)
    rows = {}
    if not args.skip_hf:
        try:
            model.set_attn_implementation("sdpa")
        except (AttributeError, ValueError) as exc:  # keep eager where sdpa is not offered
            print(f"transformers: sdpa not set ({exc}); eager attention", file=sys.stderr)
        rows["transformers"] = bench_hf(model, ids[:hf_batch].to(args.device),
                                        args.new_tokens, args.device)
        model.set_attn_implementation("eager") if hasattr(model, "set_attn_implementation") \
            else None
    cuda = torch.device(args.device).type == "cuda"
    if not (cuda and args.no_eager):
        rows["cpplan eager"] = bench_cpplan(model, ids[: args.batch].tolist(), args.new_tokens,
                                            args, graphs=False)
    if cuda:
        rows["cpplan graphs"] = bench_cpplan(model, ids[: args.batch].tolist(),
                                             args.new_tokens, args, graphs=True)
    print(f"## generate, {args.context}-token prompts, {args.new_tokens} new tokens, "
          f"{args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'})\n")
    print("| engine | requests | TTFT ms | TPOT ms | tokens/s | peak GiB | graph steps |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        n = hf_batch if name == "transformers" else args.batch
        if r.get("oom"):
            print(f"| {name} | {n} | out of memory | | | {r['peak_gib']:.1f} |")
            continue
        graph = (f"{r['graph_steps']} of {r['steps']} ({r['captures']} captured in the run)"
                 if "graph_steps" in r else "")
        print(f"| {name} | {n} | {r['ttft_s'] * 1e3:.1f} | {r['tpot_s'] * 1e3:.2f} | "
              f"{r['tokens_per_s']:.1f} | {r['peak_gib']:.1f} | {graph} |")
    hf = rows.get("transformers")
    eager, graphs = rows.get("cpplan eager"), rows.get("cpplan graphs")
    if eager and graphs:
        print(f"\ngraphs / eager: TPOT {graphs['tpot_s'] / eager['tpot_s']:.3f}; tokens equal: "
              f"{graphs['tokens'] == eager['tokens']}")
    for name in ("cpplan eager", "cpplan graphs"):
        cp = rows.get(name)
        if not (cp and hf and not hf.get("oom")):
            continue
        same = sum(a == b for x, y in zip(hf["tokens"], cp["tokens"]) for a, b in zip(x, y))
        total = sum(len(x) for x in hf["tokens"][: args.batch])
        print(f"ratio {name} / transformers: TTFT {cp['ttft_s'] / hf['ttft_s']:.3f}, TPOT "
              f"{cp['tpot_s'] / hf['tpot_s']:.3f}; greedy tokens equal at {same} of {total} "
              "positions (bf16: near-ties flip)")
    if args.json:
        print(json.dumps({k: {f: v for f, v in r.items() if f != "tokens"}
                          for k, r in rows.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
