"""Planner compile latency against the naive reference (tests/planner/reference.py), same run.

Steps are a realistic mix: 90% decodes with contexts up to 128k, 10% prefills of 1..16k query
tokens, a third of them chunked (already 1..32k tokens in). Topology P = W in {2, 4, 8}, I = 1,
fp8_ds_mla, max_model_len 131072 and the minimum gather workspace.

    python bench/planner.py            # full table
    python bench/planner.py --quick    # fewer repetitions (a smoke run)

Goals (issue 3): 512 requests at P = W = 4 <= 100 us median including encode + digest, >= 20x
faster than the reference; 4096 requests <= 1 ms.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import pathlib
import platform

from common import make_step, median_us  # bench/common.py

from cpplan import planner
from cpplan.schemas import ParallelConfig, digest, encode_plan

_REF_PATH = pathlib.Path(__file__).resolve().parent.parent / "tests" / "planner" / "reference.py"


def _load_reference():
    spec = importlib.util.spec_from_file_location("planner_reference_bench", _REF_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(quick: bool) -> list[dict]:
    reference = _load_reference()
    planner.compile_planner_kernels()
    rows = []
    for n in (64, 512, 4096):
        for size in (2, 4, 8):
            config = ParallelConfig(pcp_size=size, dcp_size=size, max_model_len=131072)
            step = make_step(n, seed=n * 10 + size)
            plan = planner.compile(config, step)
            reference.assert_plan_matches(plan, reference.reference_plan(config, step))
            reps = (50 if quick else 2000) if n < 4096 else (20 if quick else 300)
            ref_reps = 3 if quick else (30 if n < 4096 else 7)
            compile_us = median_us(lambda: planner.compile(config, step), reps)
            full_us = median_us(
                lambda: (lambda p: (encode_plan(p), digest(p)))(planner.compile(config, step)),
                reps)
            ref_us = median_us(lambda: reference.reference_plan(config, step), ref_reps)
            rows.append({"requests": n, "P=W": size, "compile_us": compile_us,
                         "full_us": full_us, "ref_us": ref_us, "ratio": ref_us / compile_us,
                         "chunks": len(plan.gather_chunks)})
    return rows


def table(rows: list[dict]) -> str:
    head = ("| requests | P=W | gather chunks | compile us | compile+encode+digest us | "
            "reference us | ratio (ref / compile) |")
    lines = [head, "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['requests']} | {r['P=W']} | {r['chunks']} | {r['compile_us']:.1f} "
                     f"| {r['full_us']:.1f} | {r['ref_us']:.0f} | {r['ratio']:.0f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    rows = run(args.quick)
    print(f"# {datetime.date.today()} {platform.python_version()} {platform.processor()}"
          f"{' (quick)' if args.quick else ''}")
    print(table(rows))


if __name__ == "__main__":
    main()
