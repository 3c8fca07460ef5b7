"""Compile, for sm_90 and without a GPU, every Triton kernel launch a piece of code makes.

The interpreter (``TRITON_INTERPRET=1``, the CPU suite) runs a kernel's Python, not its
compilation: a kernel that reads a module-level int not wrapped in ``tl.constexpr``, or whose
types do not unify across an ``if``, passes every CPU test and fails on its first GPU launch.
This closes that gap for the select:

    TRITON_INTERPRET=1 python bench/sm90_compile.py record FILE   # run the select, write launches
    python bench/sm90_compile.py compile FILE                     # compile each one for sm_90

``record`` runs the tiled indexer's top-k (``indexer_select._select``) under the interpreter on
small rows through each of its paths (split, filter with either trim, segments, long rows; a
DCP rank's global ids for decode) and writes every distinct launch of an
``indexer_select_jit`` kernel: argument types (tensors' dtypes, ints, floats), constexpr
values and launch options. ``compile`` (no interpreter: the
kernels must be ``triton.jit`` functions) compiles each with ``triton.compile`` for
``GPUTarget("cuda", 90, 32)``, prints one line a kernel and exits 1 if any fails.
tests/kernels/test_indexer_tiled.py runs both (slow lane).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys

_DTYPES = {"torch.int32": "*i32", "torch.int64": "*i64", "torch.float32": "*fp32",
           "torch.float16": "*fp16", "torch.bfloat16": "*bf16", "torch.float8_e4m3fn": "*fp8e4nv"}
_OPTIONS = ("num_warps", "num_stages", "maxnreg")


def _arg_type(v) -> str:
    """A runtime argument's signature type: a tensor's pointer type, i32 / i64, fp32."""
    import torch

    if isinstance(v, torch.Tensor):
        return _DTYPES[str(v.dtype)]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2**31 <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"bench/sm90_compile.py: got a {type(v).__name__} argument; expected a "
                    f"tensor, an int or a float")


def record(path: str) -> int:
    """Run the select's paths under the interpreter; write their distinct launches to path."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("bench/sm90_compile.py record: run it with TRITON_INTERPRET=1")
    import torch

    from cpplan.runtime.kernels.triton import indexer_select as sel
    from cpplan.runtime.kernels.triton import indexer_select_jit as sjit
    from cpplan.runtime.kernels.triton.indexer_tiled import IndexerTiles

    launches: dict[str, dict] = {}
    kernels = {n: k for n, k in vars(sjit).items() if hasattr(k, "run") and hasattr(k, "fn")}

    def spy(name, kernel):
        run = kernel.run
        params = inspect.signature(kernel.fn).parameters
        constexprs = {n for n, p in params.items() if "constexpr" in str(p.annotation)}

        def wrapped(*args, grid, warmup, **kwargs):
            types, const = {}, {}
            for n, v in [*zip(params, args), *kwargs.items()]:
                if n in _OPTIONS:
                    continue
                if n in constexprs:
                    const[n] = v
                else:
                    types[n] = _arg_type(v)
            opts = {o: kwargs[o] for o in _OPTIONS if o in kwargs}
            entry = {"kernel": name, "types": types, "const": const, "options": opts}
            launches[json.dumps(entry, sort_keys=True)] = entry
            return run(*args, grid=grid, warmup=warmup, **kwargs)

        kernel.run = wrapped

    for name, k in kernels.items():
        spy(name, k)
    g = torch.Generator().manual_seed(0)
    small = {"select_block": 64, "select_cap": 64, "select_sample": 64, "split_run": 64,
             "rank_chunk": 32, "filter_rank_chunk": 32, "rank_runs": 4}
    filt = {"programs_per_sm": 8, "filter_chunk": 64, "filter_cap": 128, "filter_sample": 256,
            "trim_rows": 0, "split_rows": 0}
    decode = {"decode_ids": True, "W": 2, "I": 64, "rank": 1}  # a DCP rank's global ids
    cases = [  # (rows, keys, topk, tiles, ids)
        (3, 200, 16, {}, {}),  # the split path, default tiles
        (3, 200, 16, {}, decode),
        (5, 700, 40, {**small, "split_rows": 0}, {}),  # segments
        (5, 700, 40, {**small, **filt}, {}),  # the filter path, bisection trim
        (5, 700, 40, {**small, **filt}, decode),
        (5, 700, 40, {**small, **filt, "trim_radix_bits": 4}, {}),  # the radix trim
        (5, 700, 40, {**small, **filt, "rank_row_major": False}, {}),
        (2, 3000, 40, {**small, "split_rows": 0, "rank_runs": 1}, {}),  # long rows
    ]
    for R, L, topk, kw, ids in cases:
        scores = torch.randint(-50, 50, (R, L), generator=g).float()
        keys = sel.score_keys(scores)
        lens = torch.randint(0, L + 1, (R,), generator=g).to(torch.int32)
        top_s, top_i = sel._outputs(R, topk, keys.device, fill=False)
        sel._select(keys, lens, topk, top_s, top_i, dataclasses.replace(IndexerTiles(), **kw),
                    **ids)
    with open(path, "w") as f:
        json.dump(list(launches.values()), f)
    print(f"{len(launches)} distinct launches of {len({e['kernel'] for e in launches.values()})} "
          f"kernels recorded")
    return 0


def compile_all(path: str) -> int:
    """Compile each recorded launch for sm_90; one line each; 1 if any fails."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("bench/sm90_compile.py compile: run it without TRITON_INTERPRET")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cpplan.runtime.kernels.triton import indexer_select_jit as sjit

    with open(path) as f:
        launches = json.load(f)
    failed = 0
    for e in launches:
        fn = getattr(sjit, e["kernel"])
        params = inspect.signature(fn.fn).parameters
        const = {n: p.default for n, p in params.items() if p.default is not p.empty}
        const.update(e["const"])
        sig = {n: e["types"].get(n, "constexpr") for n in fn.arg_names}
        const = {n: v for n, v in const.items() if sig[n] == "constexpr"}
        try:
            k = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                               options=e["options"])
            print(f"ok     {e['kernel']} ({len(k.asm['cubin'])} B of cubin) "
                  f"{json.dumps(e['const'], sort_keys=True)}")
        except Exception as err:  # noqa: BLE001 (every failure reported, then exit 1)
            failed += 1
            lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
            why = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "")
            print(f"FAILED {e['kernel']} {json.dumps(e['const'], sort_keys=True)}: "
                  f"{type(err).__name__}: {why[:300]}")
    print(f"{len(launches) - failed} of {len(launches)} launches compiled for sm_90")
    return 1 if failed else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("record", "compile"):
        sys.exit("usage: bench/sm90_compile.py record|compile FILE")
    return record(argv[1]) if argv[0] == "record" else compile_all(argv[1])


if __name__ == "__main__":
    sys.exit(main())
