"""The prefill indexer's two kernels on the bench's inputs, a few times over: a target for a
profiler, e.g. (one GPU)

    ncu --clock-control none --set full --kernel-name regex:row_topk --launch-skip 2 \\
        --launch-count 1 -o sel python3 bench/select_once.py --inputs normal
    ncu --import sel.ncu-rep --page details

(``regex:ws_logits`` for the logits kernel). Inputs as ``bench/indexer.py``'s
(``prefill_inputs``): T queries over N keys, causal, integer-valued or normal draws."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import indexer as bench  # noqa: E402  (bench/indexer.py)
import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", type=bench._prefill_cases, default=[(4096, 32768)], metavar="TxN",
                    help="T queries x N keys (default 4096x32768)")
    ap.add_argument("--inputs", choices=("integer", "normal"), default="integer")
    ap.add_argument("--repeat", type=int, default=3, help="logits + select runs (default 3)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    bench.INPUTS = a.inputs
    T, N = a.case[0]
    args, _ = bench.prefill_inputs(T, N)
    q, w, k, key_len, pcu, N = args[:6]
    tiles = bench.it.IndexerTiles()
    keys = torch.empty(T, N, dtype=torch.int32, device="cuda")
    top_s = torch.empty(T, bench.TOPK, device="cuda")
    top_i = torch.empty(T, bench.TOPK, dtype=torch.int32, device="cuda")
    q8, w8 = bench.pack.quantize_indexer_q(q, w)
    kp, ks = bench.it.split_planes(k)
    for _ in range(a.repeat):
        bench.it.prefill_logits(q8, w8, kp, ks, keys, N, key_len, pcu, N, 1, 1, tiles)
        bench.it._select(keys, key_len, bench.TOPK, top_s, top_i, tiles)
    torch.cuda.synchronize()
    print(f"ran T {T} x N {N}, {a.inputs} inputs, {a.repeat} times", flush=True)


if __name__ == "__main__":
    main()
