"""Nsight Compute's per-instruction counters of a CUDA kernel, summed by source line, function
and step (CPU; reads what the GPU machine wrote).

    python bench/ncu_lines.py --csv SASS.csv --source row_topk.cu (--binary LIB.so|K.cubin | --sass F)
                              [--top 30]

``SASS.csv``: ``ncu -i REPORT --page source --csv --print-source sass`` of a report taken with
``--set full --import-source yes`` (one block a kernel: each instruction's address, warp-state
samples, instructions executed and samples by stall reason). The instructions' source lines
come from ``nvdisasm -g`` of the same build: ``--binary`` a cubin or the shared library nvcc
wrote (its cubins taken out with ``cuobjdump -xelf``), or ``--sass`` that disassembly as text;
each CSV block is matched to the function whose opcodes it repeats, so the build must be the
profiled one (e.g. copy the library from ``$CPPLAN_CUDA_CACHE`` to ``$OUT`` in the same call).
Lines are grouped by the source's functions (a line at column 0 that opens one) and, inside a
function, by its numbered steps (comments ``// 1. ...``); inlined code counts where it is
written. Prints, a kernel each: the totals, the groups by samples (with their three main stall
reasons) and the ``--top`` lines. bench/RESULTS.md ("twenty-second session: the unrolled sort")
reads the CUDA select's profile by the same mapping. The GPU side, e.g.:

    ncu --set full --import-source yes --kernel-name regex:row_topk -c 1 -o sel python3 ...
    ncu -i sel.ncu-rep --page source --csv --print-source sass > $OUT/sass.csv
    cp $CPPLAN_CUDA_CACHE/row_topk-sm90-*.so $OUT/
"""

from __future__ import annotations

import argparse
import collections
import csv
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
LINE_MARK = re.compile(r'//## File "([^"]+)", line (\d+)')
INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
FUNCTION = re.compile(r"^\.text\.(\S+):$")
STEP = re.compile(r"^\s*//\s*(\d+)\.")
LAUNCH_BOUNDS = re.compile(r"__launch_bounds__\s*\([^)]*\)")
# a line at column 0 that opens a function: its name, before "(" (not a declaration's keyword)
OPENS = re.compile(r"^(?!(?:struct|namespace|template|extern|static_assert|constexpr|using|"
                   r"typedef|return)\b)[A-Za-z_][\w:<>,*&\s]*?\b(\w+)\s*\(")


class Failed(Exception):
    """Bad input or a missing tool: one line for the user."""


def opcode(text: str) -> str:
    """The instruction's opcode, without its predicate and modifiers."""
    words = text.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def parse_sass(text: str) -> dict[str, list[tuple[int, str, int | None]]]:
    """``nvdisasm -g -c`` text -> {function: [(offset, opcode, source line or None)]}."""
    out: dict[str, list] = {}
    current = None
    line = None
    for raw in text.splitlines():
        m = FUNCTION.match(raw.strip())
        if m:
            current, line = m.group(1), None
            out[current] = []
            continue
        m = LINE_MARK.search(raw)
        if m:
            line = int(m.group(2))
            continue
        m = INSTRUCTION.match(raw)
        if m and current is not None:
            out[current].append((int(m.group(1), 16), opcode(m.group(2)), line))
    return {k: v for k, v in out.items() if v}


def read_csv(path: str) -> list[tuple[str, list[dict[str, str]]]]:
    """ncu's source-page CSV -> [(kernel name, [instruction rows])], one block a kernel."""
    blocks: list[tuple[str, list]] = []
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    i = 0
    while i < len(rows):
        if rows[i] and rows[i][0] == "Kernel Name":
            if i + 1 >= len(rows):
                raise Failed(f"{path}: a kernel block without its header row")
            name, header, body = rows[i][1], rows[i + 1], []
            i += 2
            while i < len(rows) and not (rows[i] and rows[i][0] == "Kernel Name"):
                if len(rows[i]) == len(header):
                    body.append(dict(zip(header, rows[i])))
                i += 1
            for need in ("Address", "Source", SAMPLES, EXECUTED):
                if need not in header:
                    raise Failed(f"{path}: column {need!r} missing; expected ncu --page source "
                                 f"--csv --print-source sass of a --set full report")
            blocks.append((name, body))
        else:
            i += 1
    if not blocks:
        raise Failed(f"{path}: no 'Kernel Name' block; expected ncu --page source --csv "
                     f"--print-source sass")
    return blocks


def match(body: list[dict[str, str]], functions: dict[str, list]) -> tuple[str, list] | None:
    """The disassembled function whose opcodes are the CSV block's, in order."""
    ops = [opcode(r["Source"]) for r in body]
    for name, ins in functions.items():
        if len(ins) == len(ops) and all(a == b[1] for a, b in zip(ops, ins)):
            return name, ins
    return None


def groups(source: str) -> dict[int, str]:
    """Each source line's group: the function or struct it lies in (from the line at column 0
    that opens it to the next; a name on the line after ``__global__ void
    __launch_bounds__(...)``), with ", step N" from a ``// N.`` comment inside it on."""
    out: dict[int, str] = {}
    function, step, pending = "(file)", None, False
    for no, text in enumerate(source.splitlines(), 1):
        bare = LAUNCH_BOUNDS.sub("", text)
        m = OPENS.match(bare)
        named = re.match(r"^(\w+)\s*\(", bare) if pending else None
        if re.match(r"^struct\s+(\w+)", bare) and not bare.rstrip().endswith(";"):
            function, step, pending = "struct " + bare.split()[1], None, False
        elif named:
            function, step, pending = named.group(1), None, False
        elif m and not bare.rstrip().endswith(";"):
            function, step, pending = m.group(1), None, False
        elif re.match(r"^__(global|device)__\b", bare) and "(" not in bare:
            pending = True  # the name is on the next line
        s = STEP.match(text)
        if s and function != "(file)":
            step = s.group(1)
        out[no] = function + (f", step {step}" if step else "")
    return out


def tally(body, ins, group_of):
    """{group: [samples, instructions, Counter(stall reason -> samples)]} and the same by line."""
    by_group: dict[str, list] = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    by_line: dict[int | None, list] = collections.defaultdict(
        lambda: [0, 0, collections.Counter()])
    for row, (_, _, line) in zip(body, ins):
        samples, executed = int(row[SAMPLES] or 0), int(row[EXECUTED] or 0)
        stalls = collections.Counter({k[len("stall_"):]: int(v) for k, v in row.items()
                                      if k.startswith("stall_") and "Not Issued" not in k
                                      and v.isdigit() and int(v)})
        for acc in (by_group[group_of.get(line, "(no line)")], by_line[line]):
            acc[0] += samples
            acc[1] += executed
            acc[2].update(stalls)
    return by_group, by_line


def report(name, by_group, by_line, source_lines, top) -> str:
    samples = sum(v[0] for v in by_group.values()) or 1
    executed = sum(v[1] for v in by_group.values()) or 1
    out = [f"== {name}", f"   {samples} samples, {executed / 1e6:.1f} M warp instructions",
           f"   {'samples':>8} {'instr':>7}  group [main stall reasons]"]
    for g, (s, n, st) in sorted(by_group.items(), key=lambda kv: -kv[1][0]):
        reasons = ", ".join(f"{r} {c / max(s, 1) * 100:.0f}%" for r, c in st.most_common(3))
        out.append(f"   {s / samples * 100:7.1f}% {n / executed * 100:6.1f}%  {g} [{reasons}]")
    out.append(f"   top {top} lines:")
    for line, (s, n, st) in sorted(by_line.items(), key=lambda kv: -kv[1][0])[:top]:
        text = source_lines[line - 1].strip()[:60] if line and line <= len(source_lines) else ""
        reasons = ", ".join(f"{r} {c}" for r, c in st.most_common(2))
        out.append(f"   {s / samples * 100:7.1f}% {n / executed * 100:6.1f}%  L{line}: {text} "
                   f"[{reasons}]")
    return "\n".join(out)


def tool(name: str) -> str:
    """``name`` (nvdisasm, cuobjdump) on PATH, under $CUDA_HOME/bin, or Triton's copy."""
    found = shutil.which(name) or shutil.which(os.path.join(
        os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", name))
    if not found:
        try:
            import triton  # noqa: PLC0415  (its NVIDIA backend ships these tools)
            found = shutil.which(os.path.join(os.path.dirname(triton.__file__), "backends",
                                              "nvidia", "bin", name))
        except ImportError:
            pass
    if not found:
        raise Failed(f"no {name} (put the CUDA toolkit on PATH, set CUDA_HOME, or install triton)")
    return found


def disassemble(binary: str) -> str:
    """``nvdisasm -g -c`` of a cubin, or of every cubin inside a shared library."""
    if not os.path.isfile(binary):
        raise Failed(f"--binary: no such file: {binary}")
    with tempfile.TemporaryDirectory() as tmp:
        cubins = [binary]
        if not binary.endswith(".cubin"):
            subprocess.run([tool("cuobjdump"), "-xelf", "all", os.path.abspath(binary)],
                           cwd=tmp, capture_output=True, text=True, check=False)
            cubins = sorted(glob.glob(os.path.join(tmp, "*.cubin")))
            if not cubins:
                raise Failed(f"--binary: no cubin inside {binary} (cuobjdump -xelf found none)")
        texts = []
        for c in cubins:
            res = subprocess.run([tool("nvdisasm"), "-g", "-c", c], capture_output=True,
                                 text=True, check=False)
            if res.returncode:
                raise Failed(f"nvdisasm failed on {c}: {res.stderr.strip()[-200:]}")
            texts.append(res.stdout)
    return "\n".join(texts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", required=True, help="ncu --page source --csv --print-source sass")
    ap.add_argument("--source", required=True, help="the kernel's .cu file")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--binary", help="the profiled build: a cubin or nvcc's shared library")
    where.add_argument("--sass", help="nvdisasm -g -c of the profiled build, as text")
    ap.add_argument("--top", type=int, default=30, help="lines listed a kernel (default 30)")
    a = ap.parse_args(argv)
    try:
        for path in (a.csv, a.source) + ((a.sass,) if a.sass else ()):
            if not os.path.isfile(path):
                raise Failed(f"no such file: {path}")
        with open(a.source) as f:
            source = f.read()
        if a.sass:
            with open(a.sass) as f:
                functions = parse_sass(f.read())
        else:
            functions = parse_sass(disassemble(a.binary))
        if not functions:
            raise Failed("no function with instructions in the disassembly (nvdisasm -g -c?)")
        group_of = groups(source)
        for name, body in read_csv(a.csv):
            found = match(body, functions)
            if found is None:
                print(f"== {name}: no function of the disassembly has its {len(body)} "
                      f"instructions (another build?)")
                continue
            by_group, by_line = tally(body, found[1], group_of)
            print(report(name, by_group, by_line, source.splitlines(), a.top))
    except Failed as e:
        print(f"ncu_lines: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
