"""The prefill logits kernels compiled for sm_90 offline (no GPU needed) and their key loop read.

    python bench/sass.py [--bk 64] [--warps 4] [--stages 3] [--maxnreg 128] [--copies] [--bq 2]
                         [--sass FILE]
    python bench/sass.py --ws [--bq 4] [--math-warpgroups 2] [--stages 4] [--pipelined] [--split]
                         [--scatter] [--quant] [--math-stage]
                         [--ptx FILE]

``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` with the installed Triton (install the
device's Triton version to read what the H200 runs), then the cuobjdump / nvdisasm that Triton's
NVIDIA backend ships: registers, stack and spills of the kernel, and the instruction mix of the
loop that holds the tensor-core products (one key tile a trip). ``--copies``: per-thread key
copies instead of TMA tiles. ``--ws``: the warp-specialised Gluon kernel
(``runtime/kernels/gluon/indexer_logits_jit.py``) instead, its math warpgroups' loop (Gluon's AST
source; run it without ``TRITON_INTERPRET``). bench/RESULTS.md ("Where the prefill indexer's time goes") reads
these counts next to the H200's timings.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cpplan.runtime.kernels.triton import indexer_logits_jit as ljit

# argument types of logits_planar_kernel's pointers (the key plane's by ``tma``); ints are i32
POINTERS = {"q_ptr": "*fp8e4nv", "w_ptr": "*fp32", "ks_ptr": "*fp32", "out_ptr": "*i32",
            "len_ptr": "*i32", "pcu_ptr": "*i64"}


def compile_logits(bq: int, bk: int, warps: int, stages: int, maxnreg: int, tma: bool):
    """The compiled kernel (``triton.compile`` for sm_90) of ``logits_planar_kernel``."""
    fn = ljit.logits_planar_kernel
    const = {"W": 1, "I": 1, "BQ": bq, "HP": 64, "BK": bk, "DOT_DTYPE": tl.float8e4nv,
             "PRECISION": "tf32", "TMA": tma}
    kp = f"tensordesc<fp8e4nv[{bk}, 128]>" if tma else "*fp8e4nv"
    sig = {n: "constexpr" if n in const else kp if n == "kp_ptr" else POINTERS.get(n, "i32")
           for n in fn.arg_names}
    # 16-byte aligned, as the launcher's tensors and its output row stride are
    aligned = [i for i, n in enumerate(fn.arg_names) if sig[n].startswith("*") or n == "stride_ot"]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    opts = {"num_warps": warps, "num_stages": stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=opts)


def compile_ws(bq: int, math_warpgroups: int, stages: int, pipelined: bool = False,
               split: bool = False, epilogue: int = 1, quant: bool = False,
               math_stage: bool = False, unroll: bool = False, thread_arrive: bool = False):
    """The compiled kernel (sm_90) of the warp-specialised Gluon logits, at the launcher's
    register budget (quant: a bf16 query quantised in the kernel; math_stage: each math
    warpgroup copies its own queries; unroll: the waited pass NS tiles a trip; thread_arrive:
    every math thread arrives on the free barriers)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from cpplan.runtime.kernels.gluon import indexer_logits as ws

    fn = ws.ljit.ws_logits_kernel
    layout = gl.NVMMASharedLayout.get_default_for([ws.BOX, 128], gl.float8e4nv)
    cap, regs = ws._REGISTERS[math_warpgroups]
    const = {"W": 1, "I": 1, "BQ": bq, "HP": 64, "NM": math_warpgroups, "NS": stages,
             "MATH_REGS": regs, "EPI": epilogue, "PIPE": pipelined, "SPLIT": split, "QUANT": quant,
             "STAGE": math_stage, "UNROLL": unroll, "TARRIVE": thread_arrive,
             "CQP": triton.next_power_of_2(bq * (math_warpgroups if split else 1))}
    ptrs = {**POINTERS, "q_ptr": "*bf16" if quant else "*fp8e4nv"}
    sig = {n: "constexpr" if n in const else f"tensordesc<fp8e4nv[{ws.BOX}, 128],{layout!r}>"
           if n == "kdesc" else ptrs.get(n, "i32") for n in fn.arg_names}
    # 16-byte aligned pointers and strides that 16 divides, as the launcher's tensors give
    # (Triton specialises such ints at run time)
    aligned = [i for i, n in enumerate(fn.arg_names) if sig[n].startswith("*") or n in
               ("stride_qt", "stride_qh", "stride_wt", "stride_ot")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    return triton.compile(GluonASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": cap})


def _tool(name: str) -> str:
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.access(path, os.X_OK):
        sys.exit(f"bench/sass.py: no {name} in this Triton ({path}); expected Triton's NVIDIA "
                 f"backend binaries")
    return path


def loop_mix(sass: str, per_tile: bool = False) -> tuple[float, collections.Counter]:
    """(instructions, opcode counts) of the loop that holds the most tensor-core products:
    from its label to the branch back to it; per_tile: divided by its key tiles (an unrolled
    trip holds several; a tile's product is four 32-deep k-steps)."""
    lines = sass.splitlines()
    loops = []  # (label's line, the branch back to it)
    for i, s in enumerate(lines):
        m = re.match(r"^(\.L_x_\d+):", s)
        back = m and next((j for j in range(i + 1, len(lines))
                           if "BRA" in lines[j] and f"`({m.group(1)})" in lines[j]), None)
        if back:
            loops.append((i, back))
    best_ops = collections.Counter()
    for i, j in loops:
        if any(i <= a and b <= j and (a, b) != (i, j) for a, b in loops):
            continue  # not an innermost loop
        ops = collections.Counter()
        for line in lines[i:j + 1]:
            op = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
            if op:
                ops[op.group(1)] += 1
        if ops["QGMMA"] + ops["HGMMA"] > best_ops["QGMMA"] + best_ops["HGMMA"]:
            best_ops = ops
    tiles = max(1, (best_ops["QGMMA"] + best_ops["HGMMA"]) // 4) if per_tile else 1
    per = collections.Counter({op: round(c / tiles, 2) for op, c in best_ops.items()})
    return round(sum(best_ops.values()) / tiles, 2), per


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bq", type=int, default=2)
    ap.add_argument("--bk", type=int, default=64)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--maxnreg", type=int, default=128, help="0: no register cap")
    ap.add_argument("--copies", action="store_true", help="per-thread key copies, not TMA tiles")
    ap.add_argument("--sass", help="write the disassembly here")
    ap.add_argument("--ws", action="store_true", help="the warp-specialised Gluon kernel")
    ap.add_argument("--math-warpgroups", type=int, default=2, help="--ws: 2 to 4")
    ap.add_argument("--pipelined", action="store_true",
                    help="--ws: two accumulators, the next product before each epilogue")
    ap.add_argument("--split", action="store_true",
                    help="--ws: the math warpgroups split the CTA's queries, not its keys")
    ap.add_argument("--scatter", action="store_true",
                    help="--ws: the epilogue's quad sums scattered (EPI 2), not all-reduced")
    ap.add_argument("--quant", action="store_true",
                    help="--ws: the bf16 query quantised in the kernel's prologue")
    ap.add_argument("--math-stage", action="store_true",
                    help="--ws --split: each math warpgroup copies its own queries")
    ap.add_argument("--unroll", action="store_true",
                    help="--ws: the waited pass unrolled by the ring's stages")
    ap.add_argument("--thread-arrive", action="store_true",
                    help="--ws: every math thread arrives on the free barriers")
    ap.add_argument("--ptx", help="write the PTX here")
    a = ap.parse_args(argv)
    if a.ws:  # its own defaults: the launcher's
        given = argv if argv is not None else sys.argv
        a.stages = a.stages if "--stages" in given else 4
        a.bq = a.bq if "--bq" in given else 4
        k = compile_ws(a.bq, a.math_warpgroups, a.stages, a.pipelined, a.split,
                       2 if a.scatter else 1, a.quant, a.math_stage, a.unroll,
                       a.thread_arrive)
    else:
        k = compile_logits(a.bq, a.bk, a.warps, a.stages, a.maxnreg, not a.copies)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True,
                             text=True, check=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True,
                              check=True).stdout
    if a.sass:
        with open(a.sass, "w") as f:
            f.write(sass)
    if a.ptx:
        with open(a.ptx, "w") as f:
            f.write(k.asm["ptx"])
    usage = re.search(r"REG:(\d+) STACK:(\d+)", res)
    n, ops = loop_mix(sass, per_tile=a.ws)
    if a.ws:
        gmma = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", k.asm["ptx"])))
        nreg = sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", k.asm["ptx"])))
        print(f"ws_logits_kernel, Triton {triton.__version__}, sm_90: BQ {a.bq}, "
              f"{a.math_warpgroups} math warpgroups, {a.stages} stages"
              f"{', pipelined' * a.pipelined}{', queries split' * a.split}"
              f"{', query quantised in the kernel' * a.quant}"
              f"{', queries copied by the math warpgroups' * a.math_stage}"
              f"{', unrolled by stages' * a.unroll}"
              f"{', every thread arriving' * a.thread_arrive}; products "
              f"{', '.join(gmma)}; setmaxnreg {', '.join(f'{d} {r}' for d, r in nreg)}")
        # a wait for all products but one: two in flight (ptxas serialising the wgmmas leaves
        # only waits for none, one after each product)
        waits = collections.Counter(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d+)", sass))
        print(f"wgmma waits: {waits.get('1', 0)} for all products but one, {waits.get('0', 0)} "
              f"for all")
        loop = "math loop: {} instructions a thread a tile"
    else:
        print(f"logits_planar_kernel, Triton {triton.__version__}, sm_90: BQ {a.bq} BK {a.bk}, "
              f"{a.warps} warps, {a.stages} stages, cap {a.maxnreg or 'none'}, "
              f"{'per-thread copies' if a.copies else 'TMA tiles'}")
        loop = "key loop: {} instructions a thread a trip"
    print(f"registers {usage.group(1)}, stack {usage.group(2)} B, spill instructions "
          f"{len(re.findall(r'STL|LDL', sass))}, shared memory {k.metadata.shared} B")
    print(loop.format(f"{n:g}") + ": " + ", ".join(f"{c:g} {op}" for op, c in ops.most_common()))
    return 0

if __name__ == "__main__":
    sys.exit(main())
