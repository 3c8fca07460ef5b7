"""``cpplan generate``: serve a transformers DeepSeek-V3.2 / GLM-5 model through cpplan's
runtime over P x W ranks (continuous batching, chunked prefill, mixed steps, preemption) and
print each request's tokens; ``--check`` compares them with the model's own forward.

P = W = 1 runs in this process (``--device cpu`` or ``cuda``); larger worlds are spawned
processes, max(P, W) of them: gloo on CPU, or NCCL with one GPU each (``--device cuda``);
every rank runs the same scheduler (rank 0's tokens are printed; every rank's must agree).
Progress goes to stderr: one line rewritten in place on a terminal (requests done, tokens/s,
ETA), nothing per step otherwise; ``--verbose`` one line per step, ``--quiet`` none at all.

A request stops at the model's end-of-sequence token (``eos_token_id`` of the checkpoint's
generation_config.json, else config.json; ``--ignore-eos`` turns it off), at one of its own
``stop_token_ids`` or after its ``max_tokens``; its output says which (``finish_reason``
"stop" or "length").

Exit codes: 0 done (and ``--check`` passed), 1 ``--check`` found a difference (or the ranks'
tokens differ), 2 bad input, 3 plan mismatch, 4 a rank was lost, 5 an exception in a rank's
work or in the check's reference (one line naming the rank, the step, the layer or phase).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time

from cpplan.cli.common import bounded_int

EXAMPLE = """example:
  cpplan generate --model tiny-deepseek-v32                  # built-in prompts, 1 x 1
  cpplan generate --model tiny-glm-5 --pcp 2 --dcp 2 --check
  cpplan generate --model ./ckpt --prompts p.jsonl --max-new-tokens 32 --json
prompts file (JSONL): {"id": "a", "prompt_token_ids": [1, 2, 3]} one object a line
  ("prompt": "text" where the checkpoint has a tokenizer; "max_tokens" and
  "stop_token_ids" per line)
"""


def register(sub) -> None:
    p = sub.add_parser("generate", help="serve a transformers DSA model through the runtime",
                       description=__doc__, epilog=EXAMPLE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-deepseek-v32", metavar="PRESET|DIR",
                   help="tiny-deepseek-v32, tiny-glm-5 (random weights from --seed) or a "
                        "checkpoint folder (default tiny-deepseek-v32)")
    p.add_argument("--prompts", metavar="FILE.jsonl", help="prompts (default: a built-in set "
                   "of 1..300 tokens)")
    p.add_argument("--max-new-tokens", type=bounded_int(1, 1_000_000), default=16,
                   help="tokens generated per request (default 16)")
    p.add_argument("--pcp", type=bounded_int(1, 1024), default=1, help="PCP size P (default 1)")
    p.add_argument("--dcp", type=bounded_int(1, 1024), default=1, help="DCP size W (default 1)")
    p.add_argument("--interleave", type=bounded_int(1, 2**31 - 1), default=1,
                   help="interleave size I (default 1)")
    p.add_argument("--kv-cache-dtype", choices=("fp8_ds_mla", "bf16"), default="fp8_ds_mla",
                   help="KV cache format (default fp8_ds_mla)")
    p.add_argument("--max-num-batched-tokens", type=bounded_int(1, 1 << 20), default=256,
                   metavar="N", help="query tokens per step (default 256)")
    p.add_argument("--max-num-seqs", type=bounded_int(1, 4096), default=64, metavar="N",
                   help="requests running at once (default 64)")
    p.add_argument("--num-blocks", type=bounded_int(2, 1 << 24), default=None, metavar="N",
                   help="KV blocks per rank incl. the reserved block 0 (default: the --max-num-seqs "
                        "largest requests at once); fewer makes the scheduler preempt")
    p.add_argument("--max-model-len", type=bounded_int(1, 1 << 24), default=None, metavar="N",
                   help="longest prompt + new tokens (default and at most the model's "
                        "max_position_embeddings)")
    p.add_argument("--allow-long-max-model-len", action="store_true",
                   help="take a --max-model-len above the model's max_position_embeddings "
                        "(positions it was not trained for)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the model's end-of-sequence token (benchmarks); a "
                        "line's own stop_token_ids still stop it")
    p.add_argument("--seed", type=bounded_int(0, 2**63 - 1), default=0,
                   help="seed of a preset's weights, the built-in prompts and sampling")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy; else sampling with per-request generators")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (gloo ranks) or cuda (one GPU per rank: NCCL ranks, or this "
                        "process at P = W = 1)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="weights and activations (default auto: float32 on CPU, bfloat16 on "
                        "CUDA)")
    p.add_argument("--warmup", action="store_true",
                   help="compile every kernel variant before the clock starts (TTFT without "
                        "the first steps' compiles)")
    p.add_argument("--eager", action="store_true",
                   help="no CUDA graphs (default on CUDA: decode-only steps are padded to a "
                        "graph size and replayed as captured graphs)")
    p.add_argument("--check", action="store_true",
                   help="compare with the model's own teacher-forced forward (exit 1 on a "
                        "token differing where the logits agree, or too few positions "
                        "agreeing: docs/serving.md)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="seconds before a silent rank is declared lost (default 60)")
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--verbose", action="store_true",
                       help="one stderr line per step (default: one live line on a terminal, "
                            "none otherwise)")
    shown.add_argument("--quiet", action="store_true",
                       help="no progress on stderr (errors and the check's line only)")
    p.add_argument("--json", action="store_true",
                   help="stdout: one JSON object per request, then a summary object")
    p.set_defaults(run=run)


def run(args) -> int:
    # before torch starts its OpenMP pool: spinning workers starve the interpreter's thread
    # on small CPU hosts (measured on 2 cores: 14x slower steps without it)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from cpplan.schemas.errors import ConfigError

    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(f"--temperature: got {args.temperature}; expected >= 0")
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        raise ConfigError(f"--top-p: got {args.top_p}; expected in (0, 1]")
    if not (math.isfinite(args.timeout) and 1 <= args.timeout <= 86_400):
        raise ConfigError(f"--timeout: got {args.timeout}; expected in [1, 86400] seconds")
    from cpplan.sim.launch import torchrun_env

    env = torchrun_env()
    size = max(args.pcp, args.dcp)
    if env is not None and env.world_size != size:
        # before the model is built or read (a checkpoint's weights can take minutes): rank 0
        # says it in one line, the others exit alike
        from cpplan.cli.simulate_cmd import _said_once

        return _said_once(env.rank, ConfigError(
            f"torchrun's world has {env.world_size} rank(s): --pcp {args.pcp} --dcp "
            f"{args.dcp} needs max(P, W) = {size} (--nproc-per-node x --nnodes)"))
    from cpplan.serve.run import prepare, serve

    prep = prepare(model=args.model, prompts_path=args.prompts,
                   max_new_tokens=args.max_new_tokens, seed=args.seed, pcp=args.pcp,
                   dcp=args.dcp, interleave=args.interleave,
                   kv_cache_dtype=args.kv_cache_dtype,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   max_num_seqs=args.max_num_seqs, num_blocks=args.num_blocks,
                   max_model_len=args.max_model_len,
                   allow_long_max_model_len=args.allow_long_max_model_len,
                   ignore_eos=args.ignore_eos, device=args.device, dtype=args.dtype,
                   temperature=args.temperature, top_p=args.top_p, keep_logits=args.check,
                   timeout_s=args.timeout, warmup=args.warmup, progress=not args.quiet,
                   verbose=args.verbose,
                   cuda_graphs=args.device == "cuda" and not args.eager,
                   before_load=_check_memory(args) if args.check else None)
    job = prep.job
    if (env is None or env.rank == 0) and not args.quiet:
        how = "this process" if max(job.pcp, job.dcp) == 1 and env is None else (
            "torchrun" if env is not None else "spawned")
        sys.stderr.write(f"cpplan generate: {args.model} P={job.pcp} W={job.dcp} "
                         f"I={job.interleave} {job.kv_cache_dtype} on {job.device}, "
                         f"{len(prep.prompts)} requests, {max(job.pcp, job.dcp)} rank(s) "
                         f"({how}), {job.num_blocks} KV blocks per rank\n")
    t0 = time.monotonic()
    if env is not None:
        results = _as_torchrun_rank(prep, env, args.json)
        if "_code" in results[0].value:  # a rank other than 0: rank 0 reports
            return results[0].value["_code"]
    else:
        previous = signal.signal(signal.SIGTERM, _interrupt)  # so spawned ranks are ended
        try:
            results = serve(prep)
        finally:
            signal.signal(signal.SIGTERM, previous)
    elapsed = time.monotonic() - t0
    code = _failures(results, args.json)
    if code is not None:
        return code
    values = [r.value for r in results]
    head = values[0]
    for v in values[1:]:
        if v["outputs"] != head["outputs"]:
            return _fail(args.json, 1, f"rank {v['rank']}'s tokens differ from rank 0's")
    if not head.get("outputs_agree", True):
        return _fail(args.json, 1, "the ranks' tokens differ (digests compared at the end)")
    check = None
    if args.check:
        from cpplan.serve.check import TOL, TOL_BF16_ACTIVATIONS, check_outputs
        from cpplan.serve.engine import RunError, activation_dtype
        from cpplan.serve.run import reference_model

        try:
            check = check_outputs(reference_model(prep), job.prompts, head["outputs"],
                                  head["logits"], job.kv_cache_dtype,
                                  [p.id for p in prep.prompts],
                                  tol=TOL if activation_dtype(job.device, job.dtype) == "float32"
                                  else TOL_BF16_ACTIVATIONS)
        except Exception as exc:  # e.g. out of memory beyond the estimate: one line, exit 5
            raise RunError.wrap(exc, "--check's reference") from None
        sys.stderr.write(check.line() + "\n")
    _print(prep, values, elapsed, check, args.json)
    return 0 if check is None or check.ok else 1


def _check_memory(args):
    """``prepare``'s ``before_load`` for ``--check``: the reference's memory
    (:func:`cpplan.serve.check.check_memory`), before the weights load or a rank starts."""
    def before_load(config, prompts):
        from cpplan.serve.check import check_memory
        from cpplan.serve.engine import model_dtype

        check_memory(config, prompts, device=args.device,
                     served_dtype=model_dtype(args.device, args.dtype))
    return before_load


def _as_torchrun_rank(prep, env, as_json: bool):
    """This process as rank ``env.rank`` of torchrun's world (max(P, W) ranks, checked by
    ``run``; gloo on CPU, NCCL on GPU LOCAL_RANK): rank 0 gets ``[RankResult]`` back to
    report; the others exit here with their own code (a failure is one line naming the
    rank)."""
    from cpplan.cli.simulate_cmd import _report_failures
    from cpplan.schemas.errors import RankLostError
    from cpplan.serve.engine import serve_rank
    from cpplan.sim.launch import RankResult, join_torchrun, leave_torchrun

    job = prep.job
    ctx = join_torchrun("nccl" if job.device == "cuda" else "gloo",
                        timeout_s=max(job.timeout_s * 4, 60.0))
    value = serve_rank(ctx, job)
    error = value.get("error")
    leave_torchrun(clean=not isinstance(error, RankLostError))
    if error is not None:  # each rank names its own failure; rank 0 writes the JSON
        code = _report_failures([(ctx.rank, error, None)], as_json and ctx.rank == 0,
                                torchrun=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # before torchrun ends this rank for its peer's exit
    if ctx.rank != 0:
        return [RankResult(ctx.rank, value={"rank": ctx.rank, "_code": 0})]
    return [RankResult(0, value=value)]


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _failures(results, as_json: bool) -> int | None:
    """None where every rank finished; else one line per distinct root cause (a rank's own
    failure over its peers' PeerFailedError; ranks failing alike share the line), and its
    exit code: 3 (plans differ) over 5 (an exception in a rank) over 4 (a rank lost)."""
    from cpplan.cli.simulate_cmd import rank_failures
    from cpplan.cli.terminal import plain
    from cpplan.schemas.errors import CpplanError, PeerFailedError

    failures = rank_failures(results)
    if not failures:
        return None
    causes = [f for f in failures if not isinstance(f[1], PeerFailedError)] or failures
    alike: dict[tuple[str, str], list[int]] = {}
    for rank, exc, _ in causes:
        alike.setdefault((type(exc).__name__, " ".join(str(exc).split())), []).append(rank)
    for (name, text), ranks in alike.items():
        who = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))
        sys.stderr.write(plain(f"cpplan generate: error: {who}: {name}: {text}") + "\n")
    codes = [exc.exit_code if isinstance(exc, CpplanError) else 5 for _, exc, _ in causes]
    code = max(codes, key=lambda c: (c == 3, c == 5, c == 4, c))
    if as_json:
        print(json.dumps({"ok": False, "exit_code": code, "ranks_failed": len(failures),
                          "error": str(causes[0][1])}))
    return code


def _fail(as_json: bool, code: int, message: str) -> int:
    sys.stderr.write(f"cpplan generate: error: {message}\n")
    if as_json:
        print(json.dumps({"ok": False, "exit_code": code, "error": message}))
    return code


def _print(prep, values, elapsed: float, check, as_json: bool) -> None:
    head, job = values[0], prep.job
    new = sum(len(o) for o in head["outputs"])
    rows = []
    for k, (p, out) in enumerate(zip(prep.prompts, head["outputs"])):
        row = {"id": p.id, "prompt_tokens": len(p.token_ids), "output_token_ids": out,
               "finish_reason": head["finish_reasons"][k],
               "ttft_s": round(head["ttft_s"][k], 4), "tpot_s": round(head["tpot_s"][k], 4)}
        if prep.tokenizer is not None:
            row["output_text"] = prep.tokenizer.decode(out)
        rows.append(row)
    summary = {"ok": check is None or check.ok, "steps": head["steps"],
               "collectives": head.get("collectives_world",
                                       sum(v["collectives"] for v in values)),
               "digest_checks": head["digest_checks"], "requests": len(rows),
               "prompt_tokens": sum(len(p.token_ids) for p in prep.prompts),
               "output_tokens": new, "query_tokens": head["tokens"],
               "stopped": head["finish_reasons"].count("stop"),
               "mixed_steps": head["mixed_steps"], "preempted": head["preempted"],
               "graph_steps": head["graph_steps"], "graph_captures": head["captures"],
               "serve_s": round(head["seconds"], 3), "seconds": round(elapsed, 3),
               "output_tokens_per_s": round(new / head["seconds"], 2) if head["seconds"] else 0,
               "pcp": job.pcp, "dcp": job.dcp, "interleave": job.interleave,
               "kv_cache_dtype": job.kv_cache_dtype, "device": job.device,
               "model": job.model}
    if check is not None:
        summary["check"] = {"ok": check.ok, "positions": check.positions,
                            "tokens_equal": check.equal + check.ties, "near_ties": check.ties,
                            "max_dlogit": check.max_dlogit, "tolerance": check.tol,
                            "within_tolerance": check.close,
                            "differing_beyond_tolerance": check.far_differ,
                            "differing_within_tolerance": check.close_differ,
                            "min_share_within_tolerance": check.min_close}
    if as_json:
        out = "".join(json.dumps(r) + "\n" for r in rows) + json.dumps(summary) + "\n"
        sys.stdout.write(out)
        return
    lines = []
    for r in rows:
        text = f" {r['output_text']!r}" if "output_text" in r else ""
        lines.append(f"{r['id']}: {r['prompt_tokens']} prompt tokens -> {r['output_token_ids']}"
                     f"{text} ({r['finish_reason']})  TTFT {r['ttft_s'] * 1e3:.0f} ms  "
                     f"TPOT {r['tpot_s'] * 1e3:.0f} ms")
    s = summary
    lines.append(f"{s['requests']} requests, {s['output_tokens']} new tokens in {s['steps']} "
                 f"steps ({s['mixed_steps']} mixed, {s['preempted']} preemptions, "
                 f"{s['graph_steps']} by CUDA graph), "
                 f"{s['output_tokens_per_s']} tokens/s, {s['collectives']} collectives, "
                 f"{s['digest_checks']} digest checks, {s['seconds']} s")
    sys.stdout.write("\n".join(lines) + "\n")
